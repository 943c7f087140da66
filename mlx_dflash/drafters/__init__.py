"""The draft models and what feeds them the target's context.

- `dflash.py`: the DFlash (v1) drafter, parameter names equal to the z-lab checkpoint keys.
- `dflash2.py`, `selector.py`: DFlash2 and its candidate selector.
- `injection.py`: the K/V injection, the committed positions' features into every draft layer.
- `draft_cache.py`: the drafter's context K/V, written once, never concatenated.
- `pairing.py`: whether a drafter fits a target, on loaded models or bare configs.

Imports `kernels` (the injection's Metal kernels), `targets` and `errors`.
"""
