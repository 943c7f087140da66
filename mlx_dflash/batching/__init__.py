"""Several sessions decoding together: one draft forward and one verify forward per cycle.

- `batch.py`: `SessionBatch`, which takes over its sessions' caches and runs their cycles as
  one, each row committing its own accepted prefix; what cannot be batched yet, and why.
- `target_cache.py`: the target's K/V for rows of different lengths, with per-row rollback.
- `draft_cache.py`: the drafter's context K/V for rows of different context lengths.

Imports `decoding` (batching extends the session), `proposers`, `drafters`, `targets`,
`platform` and `errors`.
"""
