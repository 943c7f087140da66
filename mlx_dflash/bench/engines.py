"""The decoding modes a benchmark compares, behind one small interface.

`MlxLmEngine` is mlx-lm's own `stream_generate` (the baseline people know);
`DFlashEngine` is ours, with a drafter (DFlash) or without one (the engine's overhead),
with or without prompt lookup, at a fixed block size or `auto`, with linear blocks or draft trees
(`tree_budget`). It times the loop users run; `profile=True` adds a host sync per cycle to split draft
and verify time (a separate, opt-in measurement).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_sampler

from ..auto.policy import AUTO, make_policy
from ..decoding.tree import SPINE
from ..decoding.tree_step import refusal
from ..drafters.dflash import DFlashDraftModel
from ..generate import stream_generate
from ..proposers.factory import check_block_size, make_proposer
from ..targets.model import as_target
from .modes import mode_name


@dataclass
class Run:
    """One mode's generation for one prompt, timed from the outside the same way for every mode."""

    tokens: list[int]  # generated ids, stop token excluded
    prompt_tokens: int
    ttft_s: float  # call to first token
    decode_s: float  # first token to last
    peak_memory_gb: float
    finish_reason: str | None
    acceptance_lengths: list[int] = field(default_factory=list)  # DFlash: a + 1 per cycle
    draft_s: float = 0.0
    verify_s: float = 0.0
    block_sizes: list[int] = field(default_factory=list)  # each cycle's block size
    predicted_tokens: float = 0.0  # `auto`: the cost model's expectation over its cycles
    predicted_seconds: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # proposed tokens kept, per source
    tree_sizes: list[int] = field(default_factory=list)  # each cycle's draft-tree nodes (0: a linear block)


class Engine(Protocol):
    name: str
    block_size: int | str | None

    def run(self, prompt_ids: list[int], *, max_tokens: int, temp: float, seed: int | None) -> Run: ...


class MlxLmEngine:
    """The target alone through mlx-lm's `stream_generate`, with the same sampler as ours."""

    block_size = None

    def __init__(self, model: nn.Module, tokenizer: Any, name: str = "mlx-lm"):
        self.model, self.tokenizer, self.name = model, tokenizer, name

    def run(self, prompt_ids: list[int], *, max_tokens: int, temp: float, seed: int | None) -> Run:
        from mlx_lm.generate import stream_generate as lm_stream_generate

        if seed is not None:
            mx.random.seed(seed)
        mx.reset_peak_memory()
        tokens: list[int] = []
        finish, first = None, None
        start = time.perf_counter()
        for response in lm_stream_generate(
            self.model, self.tokenizer, mx.array(prompt_ids), max_tokens=max_tokens, sampler=make_sampler(temp)
        ):
            if first is None:
                first = time.perf_counter()
            finish = response.finish_reason
            # The final response repeats a stop token (not output) or carries the last token ("length").
            if finish is None or finish == "length":
                tokens.append(int(response.token))
        end = time.perf_counter()
        first = first or end
        return Run(tokens, len(prompt_ids), first - start, end - first, mx.get_peak_memory() / 1e9, finish)


class DFlashEngine:
    """Our `stream_generate`: DFlash with a drafter, the target alone without one.

    `drafter` may also be a factory `(prompt_ids, max_tokens) -> proposer`, called per run
    (the benchmark-only proposers of `bench.proposers`). With `auto`, one policy serves
    every run of the mode, as one serves a whole chat or server: what it learned about
    the drafter and the machine carries over from prompt to prompt.

    `tree_budget`: 0 verifies linear blocks; N verifies the drafter's blocks as draft trees
    of N nodes of `tree_shape` wherever the session can (`decoding.tree_step.refusal`);
    "auto" lets `auto` weigh trees too. The mode's name then ends in " tN" or " t-auto"
    (and the shape, when not the default spine).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, drafter: DFlashDraftModel | Callable | Any | None,
                 block_size: int | str | None = None, name: str | None = None, *, calibration: Any = None,
                 profile: bool = False, lookup: bool = False, tree_budget: int | str = 0,
                 tree_shape: str | None = None):
        self.model, self.tokenizer, self.drafter, self.lookup = model, tokenizer, drafter, lookup
        self.block_size = (block_size or AUTO) if drafter is not None or lookup else None
        self.tree_budget = tree_budget if drafter is not None else 0
        self.tree_shape = (tree_shape or SPINE) if self.tree_budget else None
        kind = "+".join(["dflash"] * (drafter is not None) + ["lookup"] * lookup)
        self.name = name or (mode_name(self.block_size, self.tree_budget, self.tree_shape, kind) if kind else "target")
        self.calibration, self.profile = calibration, profile
        self.policy: Any = None

    def run(self, prompt_ids: list[int], *, max_tokens: int, temp: float, seed: int | None) -> Run:
        drafter = self.drafter
        if callable(drafter) and not isinstance(drafter, nn.Module):
            drafter = drafter(prompt_ids, max_tokens)
        if self.block_size == AUTO and self.policy is None:
            self.policy = make_policy(AUTO, check_block_size(None, drafter, lookup=self.lookup), self.calibration,
                                      drafter=drafter is not None, lookup=self.lookup,
                                      **self._tree_settings())
        elif self.tree_budget and self.policy is None:  # a fixed block verified as trees: its own policy
            self.policy = make_policy(self.block_size, self.block_size, drafter=drafter is not None,
                                      lookup=self.lookup, **self._tree_settings())
        mx.reset_peak_memory()
        tokens: list[int] = []
        event, first = None, None
        start = time.perf_counter()
        for event in stream_generate(
            self.model, self.tokenizer, prompt_ids, draft_model=drafter, max_tokens=max_tokens,
            temp=temp, seed=seed, block_size=self.block_size, profile=self.profile and drafter is not None,
            policy=self.policy, prompt_lookup=self.lookup,
        ):
            if first is None:
                first = time.perf_counter()
            tokens.extend(event.tokens)
        end = time.perf_counter()
        first = first or end
        stats = event.stats if event is not None else None
        timings = stats.timings if stats is not None else {}
        return Run(
            tokens, len(prompt_ids), first - start, end - first, mx.get_peak_memory() / 1e9,
            event.finish_reason if event is not None else None,
            list(stats.acceptance_lengths) if stats is not None and (self.drafter is not None or self.lookup) else [],
            timings.get("draft", 0.0), timings.get("verify", 0.0),
            list(stats.block_sizes) if stats is not None and (self.drafter is not None or self.lookup) else [],
            stats.predicted_tokens if stats is not None else 0.0, stats.predicted_seconds if stats is not None else 0.0,
            dict(stats.accepted_by_source) if stats is not None else {},
            # (GenerationStats.tree_sizes: read defensively, a stats object without it reports none)
            list(getattr(stats, "tree_sizes", None) or [])
            if stats is not None and (self.drafter is not None or self.lookup) else [],
        )

    def _tree_settings(self) -> dict[str, Any]:
        return {"tree_budget": self.tree_budget, "tree_shape": self.tree_shape} if self.tree_budget else {}


def tree_refusal(model: nn.Module, drafter: Any, block_size: int | None = None) -> str | None:
    """Why `drafter` on `model` cannot verify draft trees (None: it can), as a session would decide
    (`decoding.tree_step.refusal`); the benchmark-only factories of `bench.proposers` draft linear blocks."""
    if drafter is None:
        return "trees need a drafter"
    if callable(drafter) and not isinstance(drafter, nn.Module):
        return "the benchmark-only oracle proposers draft linear blocks"
    target = as_target(model)
    return refusal(target, make_proposer(target, drafter, block_size or check_block_size(None, drafter)))
