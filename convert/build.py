"""Building the model a checkpoint's config describes, and loading weights into it, every key and shape checked.

Targets are mlx-lm model classes; drafters are this project's (`mlx_dflash.drafters`), picked by
the config's `architectures`. Conversion and `mlx_dflash.load_drafter` both build through here.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dflash.drafters import dflash2
from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs
from mlx_dflash.errors import DFlashError

# `architectures` -> (model class, its args); any other name (or none) loads as v1, as it always did.
DRAFTER_ARCHITECTURES = {
    "DFlashDraftModel": (DFlashDraftModel, ModelArgs),
    dflash2.ARCHITECTURE: (dflash2.DFlash2DraftModel, dflash2.ModelArgs),
}


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


def build_drafter(config: dict[str, Any], where: str, num_target_layers: int | None = None) -> DFlashDraftModel:
    """The drafter a z-lab config describes (random weights), or one clear error."""
    if "dflash_config" not in config:
        raise DFlashError(f"{where}: config.json has no dflash_config; not a DFlash drafter")
    architecture = (config.get("architectures") or ["DFlashDraftModel"])[0]
    model_cls, args_cls = DRAFTER_ARCHITECTURES.get(architecture, DRAFTER_ARCHITECTURES["DFlashDraftModel"])
    try:
        args = args_cls.from_dict(config)
    except TypeError as e:
        raise DFlashError(f"{where}: incomplete drafter config ({e})") from None
    except ValueError as e:
        raise DFlashError(f"{where}: {e}") from None
    if num_target_layers is not None:
        args.resolve_target_layers(num_target_layers)
    try:
        return model_cls(args)
    except ValueError as e:
        raise DFlashError(f"{where}: {e}") from None


def load_checked(model: nn.Module, weights: dict[str, mx.array], where: str) -> None:
    """Load `weights` into `model`, refusing missing, unexpected or misshapen tensors."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DFlashError(
            f"{where}: weights do not match the config"
            + (f"; missing {', '.join(missing[:4])}" if missing else "")
            + (f"; unexpected {', '.join(unexpected[:4])}" if unexpected else "")
        )
    for key, value in expected.items():
        if weights[key].shape != value.shape:
            raise DFlashError(
                f"{where}: weight {key} has shape {tuple(weights[key].shape)}, the config implies {tuple(value.shape)}"
            )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
