"""`--block-size auto`: each cycle's block size and proposal source, for the most tokens per second.

- `policy.py`: `AutoBlockSize`, which maximises expected tokens over a cycle's cost, and
  `make_policy` for a `--block-size` setting.
- `estimators.py`: what it knows of each source, per-position acceptance and per-size costs.
- `calibration.py`: this machine's measured cycle costs, cached per model shapes.
- `acceptance_memory.py`: what a run learnt of a drafter's acceptance, kept for the next.

Imports `decoding` (the policy contract; calibration runs real cycles), `proposers`,
`drafters`, `targets`, `platform` and `errors`.
"""
