"""Who proposes the tokens the target verifies, one proposer per file.

The drafting proposers (DFlash, DFlash2, the rank follower) keep `base.Proposer`; prompt lookup
reads the committed tokens instead (`PromptLookup.propose(tokens, n)`), a second source the session
consults every cycle.

- `base.py`: the `Proposer` interface, the `Proposal` a sampling proposer states, source names.
- `dflash.py`, `dflash2.py`: block drafting with a DFlash or DFlash2 drafter.
- `lookup.py`: prompt lookup, proposals read off the context with no drafter.
- `rank_follower.py`: what ranks other than 0 run in place of the drafter.
- `factory.py`: the one place proposers are built, and the block size each can draft.

Imports `drafters`, `targets` and `errors`.
"""
