"""From a name to loaded models: short names, the Hugging Face Hub, the converted cache, `load`.

- `loaders.py`: `load`, `load_target`, `load_drafter`, every key and shape checked.
- `resolve.py`: short names for known pairs, Hub snapshots, conversions cached once.
- `hub.py`: Hub snapshots through huggingface_hub's cache, with one-line errors.

Imports `convert` (building models, converting on first use), `distributed`, `drafters`,
`targets`, `platform` and `errors`.
"""
