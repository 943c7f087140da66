"""One target across several machines (`mx.distributed`, started by `mlx.launch`).

- `world.py`: the ranks, tensor-parallel sharding of the target, rank 0 first.
- `rank_agreement.py`: before any weights load, every rank checks that the others run the same
  packages and model files (`fingerprint.py`: what a rank is about to run, described cheaply).

Imports `errors` and `version` only. What the other ranks run in place of the drafter is a
proposer (`mlx_dflash.proposers.rank_follower`).
"""
