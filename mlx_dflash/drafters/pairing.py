"""The drafter/target compatibility check, shared by `load` and `convert`.

It works on loaded models and on bare configs alike, so `convert` can refuse a
mismatched pair before writing anything, without building the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import IncompatibleDrafterError


@dataclass(frozen=True)
class TargetShape:
    """What a drafter needs to know about its target."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    name: str = "target"

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "target") -> TargetShape:
        text = config.get("text_config", config)  # multimodal configs nest the LM
        try:
            return cls(int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]), name)
        except KeyError as e:
            raise IncompatibleDrafterError(f"{name} config has no {e.args[0]}; cannot check the drafter") from None


def _shape(target: Any) -> TargetShape:
    if isinstance(target, TargetShape):
        return target
    return TargetShape(target.hidden_size, target.vocab_size, target.num_layers)


def check_compatible(drafter: Any, target: Any, drafter_name: str = "drafter") -> None:
    """Raise one clear sentence naming both sides when the drafter was not made for the target.

    `drafter` is a `DFlashDraftModel` or its `ModelArgs`; `target` a `TargetModel` or a `TargetShape`.
    """
    args = getattr(drafter, "args", drafter)
    t = _shape(target)
    d, tn = drafter_name, t.name
    if args.hidden_size != t.hidden_size:
        raise IncompatibleDrafterError(f"{d} hidden size {args.hidden_size} != {tn} hidden size {t.hidden_size}")
    if args.vocab_size != t.vocab_size:
        raise IncompatibleDrafterError(f"{d} vocabulary {args.vocab_size} != {tn} embedding rows {t.vocab_size}")
    if args.dflash_config.get("target_layer_ids") is None:
        args.resolve_target_layers(t.num_layers)
    bad = [i for i in args.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise IncompatibleDrafterError(
            f"{d} target_layer_ids {bad} are outside the {tn}'s {t.num_layers} layers"
        )
    try:
        mask = args.mask_token_id
    except ValueError as e:
        raise IncompatibleDrafterError(f"{d}: {e}") from None
    if not 0 <= mask < t.vocab_size:
        raise IncompatibleDrafterError(
            f"{d} mask_token_id {mask} is outside the {tn}'s embedding table of {t.vocab_size} rows"
        )
    if not 2 <= args.block_size <= 512:
        raise IncompatibleDrafterError(f"{d} block_size {args.block_size} must be between 2 and 512")
