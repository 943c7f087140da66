"""Building the mlx-lm model a target checkpoint's config describes (drafters: mlx_dflash.loading)."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from mlx_dflash.errors import DFlashError


def target_model(config: dict[str, Any], where: str) -> nn.Module:
    from mlx_lm.utils import _get_classes

    model_type = config.get("model_type")
    if not model_type:
        raise DFlashError(f"{where}: config.json has no model_type")
    try:
        model_cls, args_cls = _get_classes(config)
    except ValueError:
        raise DFlashError(f"{where}: unsupported architecture '{model_type}' (mlx-lm has no such model type)") from None
    try:
        return model_cls(args_cls.from_dict(config))
    except (TypeError, KeyError, ValueError) as e:
        raise DFlashError(f"{where}: incomplete or invalid {model_type} config ({e})") from None
