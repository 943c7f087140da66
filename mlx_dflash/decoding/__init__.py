"""The decode loop: one speculative step, the session that keeps the caches, the loop over cycles.

- `step.py`: one cycle, draft, verify, accept: the acceptance rule.
- `sampling.py`: the target's sampler, and speculative rejection sampling.
- `session.py`: `DecodingSession`, committed tokens, caches and rollback across cycles and turns.
- `block_size.py`: the contract of a block-size policy, and the fixed size.
- `loop.py`: `stream_session`, one event per cycle; `stats.py`: what the cycles add up to.
- `constraint.py`: a grammar as masks over the target's distributions.
- `stream_guard.py`: what a consumer does when a stream ends: close, then store the session.

Imports `proposers` (through their interface), `targets`, `platform` and `errors`; the
adaptive block size (`auto`) and batching build on it, never the other way.
"""
