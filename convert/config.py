"""Config handling: what kind of checkpoint this is, and normalisation for mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_dflash.errors import DFlashError


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise DFlashError(f"{directory}: missing config.json (not a model directory)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise DFlashError(f"{path}: expected a JSON object")
    return config


def is_drafter(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return "dflash_config" in config or any("DFlash" in a for a in archs)


def rope_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Top-level rope keys mlx-lm reads, recovered from transformers-5 `rope_parameters`.

    mlx-lm 0.32 reads only a top-level `rope_theta`; without it the model silently
    runs with base 10000, wrong from the first token.
    """
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    out: dict[str, Any] = {}
    if config.get("rope_theta") is None and params.get("rope_theta") is not None:
        out["rope_theta"] = params["rope_theta"]
    rope_type = params.get("rope_type", "default")
    if config.get("rope_scaling") is None and rope_type != "default":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def normalise_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy with rope settings at the top level and loader-irrelevant keys dropped."""
    out = dict(config)
    out.update(rope_overrides(config))
    out.pop("rope_parameters", None) if "rope_theta" in out else None
    for key in ("_name_or_path", "transformers_version", "quantization_config", "quantization"):
        out.pop(key, None)
    return out
