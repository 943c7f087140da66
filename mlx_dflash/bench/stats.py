"""Figures per dataset (and overall) and mode, from the per-prompt records: medians and spread over repeats."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..decoding.stats import acceptance_histogram, mean_acceptance
from .runner import Record

ALL = "all"


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range over repeats (one value per repeat)."""
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def decode_tps(records: Sequence[Record]) -> float:
    """Decoded tokens (after the prefill's) per decode second, pooled over the records."""
    seconds = sum(r.decode_s for r in records)
    return sum(max(r.generated_tokens - 1, 0) for r in records) / seconds if seconds > 0 else 0.0


def _by_repeat(records: Sequence[Record]) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        out[r.repeat].append(r)
    return out


def _ratio(mode: dict[int, list[Record]], base: dict[int, list[Record]]) -> list[float]:
    out = []
    for repeat, recs in sorted(mode.items()):
        b = decode_tps(base.get(repeat, []))
        if b > 0:
            out.append(decode_tps(recs) / b)
    return out


def _pairs(mode: Sequence[Record], base: Sequence[Record]) -> list[tuple[Record, Record]]:
    """The mode's runs matched with the base mode's runs of the same prompt turn and repeat."""
    key = lambda r: (r.dataset, r.prompt_id, r.turn, r.context, r.repeat)  # noqa: E731
    by_key = {key(r): r for r in base}
    return [(r, by_key[key(r)]) for r in mode if key(r) in by_key]


def paired_ratio(mode: Sequence[Record], base: Sequence[Record], level: float = 0.9,
                 resamples: int = 2000) -> dict[str, float] | None:
    """Pooled decode tok/s over the base mode's, on the same runs, with a bootstrap interval.

    The runs are resampled as pairs (a mode's run with the base's run of the same prompt and
    repeat), so the noise that hits both alike (a slow prompt, a slow minute) cancels; the
    seed is fixed, so the same records give the same interval.
    """
    pairs = _pairs(mode, base)
    if not pairs:
        return None
    tokens = np.array([[max(r.generated_tokens - 1, 0) for r in pair] for pair in pairs], dtype=np.float64)
    seconds = np.array([[r.decode_s for r in pair] for pair in pairs], dtype=np.float64)

    def ratio(t: np.ndarray, s: np.ndarray) -> np.ndarray:  # (..., pairs, 2) -> (...)
        rate = np.divide(t.sum(-2), s.sum(-2), out=np.zeros(t.shape[:-2] + (2,)), where=s.sum(-2) > 0)
        return np.divide(rate[..., 0], rate[..., 1], out=np.zeros(rate.shape[:-1]), where=rate[..., 1] > 0)

    picks = np.random.default_rng(0).integers(len(pairs), size=(resamples, len(pairs)))
    draws = np.sort(ratio(tokens[picks], seconds[picks]))
    cut = int((1.0 - level) / 2 * resamples)
    return {"ratio": float(ratio(tokens, seconds)), "low": float(draws[cut]), "high": float(draws[-cut - 1])}


def summarize(records: Sequence[Record], baseline: str = "mlx-lm", target: str = "target") -> list[dict[str, Any]]:
    """One row per (dataset, context, mode), then the same over all datasets (dataset "all")."""
    groups: dict[tuple[str, int | None, str], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.dataset, r.context, r.mode)].append(r)
        groups[(ALL, r.context, r.mode)].append(r)
    datasets = list(dict.fromkeys(r.dataset for r in records))
    if len(datasets) == 1:  # "all" would only repeat the one dataset
        groups = {k: v for k, v in groups.items() if k[0] != ALL}
    rows = []
    for (dataset, context, mode), recs in groups.items():
        per_repeat = _by_repeat(recs)
        lengths = [n for r in recs for n in r.acceptance_lengths]
        cycles = len(lengths)
        draft, verify = sum(r.draft_s for r in recs), sum(r.verify_s for r in recs)
        decode = sum(r.decode_s for r in recs)
        sizes: Counter[int] = Counter()
        for r in recs:
            sizes.update({int(k): v for k, v in r.block_size_histogram.items()})
        predicted_s = sum(r.predicted_seconds for r in recs)
        trees = [n for r in recs for n in r.tree_sizes if n > 0]
        base = _by_repeat(groups.get((dataset, context, baseline), []))
        alone = _by_repeat(groups.get((dataset, context, target), []))
        rows.append({
            "dataset": dataset,
            "context": context,
            "mode": mode,
            "block_size": recs[0].block_size,
            "prompts": len({(r.dataset, r.prompt_id, r.turn) for r in recs}),
            "runs": len(recs),
            "generated_tokens": sum(r.generated_tokens for r in recs),
            "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in recs),
            "decode_tps": spread([decode_tps(v) for _, v in sorted(per_repeat.items())]),
            "ttft_s": spread([statistics.median(r.ttft_s for r in v) for _, v in sorted(per_repeat.items())]),
            "speedup": spread(_ratio(per_repeat, base)) if base else None,
            "speedup_vs_target": spread(_ratio(per_repeat, alone)) if alone else None,
            "paired_vs_target": paired_ratio(recs, groups.get((dataset, context, target), [])) if alone else None,
            "peak_memory_gb": max(r.peak_memory_gb for r in recs),
            "tau": mean_acceptance(lengths) if cycles else None,
            "cycles": cycles,
            "acceptance_histogram": acceptance_histogram(lengths) if cycles else [],
            # Per verify cycle: all of it; with --profile also drafting, the target's verify pass,
            # and everything else (sampling, acceptance, cache bookkeeping, detokenizing).
            "cycle_ms": {
                "total": 1e3 * decode / cycles,
                **({"draft": 1e3 * draft / cycles, "verify": 1e3 * verify / cycles,
                    "overhead": 1e3 * max(decode - draft - verify, 0.0) / cycles} if draft + verify > 0 else {}),
            } if cycles else None,
            "block_size_histogram": dict(sorted(sizes.items())),
            # `auto`: tokens per second its cost model expected, against decode_tps measured.
            "predicted_tps": sum(r.predicted_tokens for r in recs) / predicted_s if predicted_s > 0 else None,
            "mismatches": sum(r.match is False for r in recs),
            # Draft trees: the mode's budget and shape, the cycles verified as trees, their mean node count.
            "tree_budget": recs[0].tree_budget,
            "tree_shape": recs[0].tree_shape,
            "tree_cycles": len(trees),
            "mean_tree_size": statistics.fmean(trees) if trees else None,
        })
    order = {d: i for i, d in enumerate([*datasets, ALL])}
    rows.sort(key=lambda r: (order[r["dataset"]], r["context"] or 0))
    return rows
