"""The target model: its forward with the selected layers' hidden states, per mlx-lm family.

- `model.py`: `TargetModel`, a forward rebuilt from the mlx-lm model's own parts that equals
  `model(x)` and keeps the layers the drafter reads; exact rollback of every cache kind.
- `families.py`: how each supported family embeds, masks and loops.
- `dtypes.py`: the compute dtypes and the default per backend.

Imports `distributed` (a sharded target agrees across ranks) and `errors`.
"""
