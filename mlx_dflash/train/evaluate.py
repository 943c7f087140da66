"""Acceptance length measured the only honest way: by running the real engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx.utils import tree_flatten

from ..decoding.stats import mean_acceptance
from ..drafters.dflash import DFlashDraftModel
from ..generate import stream_generate
from ..targets.model import TargetModel


@dataclass
class TauReport:
    tau: float
    acceptance_lengths: list[int] = field(default_factory=list)
    num_prompts: int = 0
    num_tokens: int = 0


def frozen_copy(drafter: DFlashDraftModel) -> DFlashDraftModel:
    """An inference copy: the engine re-points k/v projections, which must not touch training weights."""
    weights = dict(tree_flatten(drafter.parameters()))
    copy = DFlashDraftModel(drafter.args)
    copy.quantize_packed(weights)  # an exported, quantized drafter: the same packed layers
    copy.load_weights(list(weights.items()))
    copy.eval()
    return copy


def measure_tau(target: TargetModel, tokenizer: Any, drafter: DFlashDraftModel | None,
                prompts: Sequence[Sequence[int]], *, max_tokens: int, block_size: int | None = None) -> TauReport:
    """Greedy generation on each prompt with the drafter; tau over all cycles of all prompts."""
    model = frozen_copy(drafter) if drafter is not None else None
    lengths: list[int] = []
    tokens = 0
    for ids in prompts:
        stats = None
        for event in stream_generate(target, tokenizer, list(ids), draft_model=model, max_tokens=max_tokens,
                                     block_size=block_size):
            stats = event.stats
        if stats is not None:
            lengths.extend(stats.acceptance_lengths)
            tokens += stats.num_tokens
    return TauReport(mean_acceptance(lengths), lengths, len(prompts), tokens)
