"""Writes `ddtree_reference.json`: draft trees and accepted lengths from the DDTree paper's own code.

The fixture pins `mlx_dflash.decoding.tree` (shape "paper") to the public reference implementation
of the DDTree paper (github.com/liranringel/ddtree, `ddtree.py`). That file is not part of this
project: this script imports it at run time from the path given with `--reference` and calls two of
its functions, the tree builder (`build_ddtree_tree(draft_logits, budget)`) and the walk along the
target's tokens (`follow_verified_tree(child_maps, posterior)`). Its model-loading imports
(loguru, transformers, its `model` and `dflash` modules) are replaced by stubs first; the two
functions use none of them beyond timing helpers.

Cases: vocabulary V = 32, drafts D in {7, 15} positions deep, budgets {4, 8, 16, 32, 64}, ROUNDS
rounds each, then SHARP_ROUNDS "sharp" ones, from a seeded numpy generator. A round is
- draft logits (D, V), float32: standard normals times a per-row temperature in [0.5, 4] (sharp
  rounds: [8, 16], so confident drafts whose trees run deep, down to the last position);
- a true continuation t_1..t_{D+1}: t_d is the draft's rank-r token at position d, r = 0 with
  probability 0.6, 1 with 0.25, 2 with 0.1, otherwise a uniformly random token (t_{D+1}, past
  the draft, is always uniform);
- the target's rule, the same in the test: after the root the target picks t_1; after a node
  whose path is x_1..x_d it picks t_{d+1} if x_1..x_d == t_1..t_d, else (7 * sum(x) + 3 d + 1) % V.

Stored per round: the logits (each float32 written as the float64 of the same value, so it reads
back bit-exact), the continuation, the budget, the reference's tree as the sorted list of its
nodes' token paths (root excluded), and its accepted length (len of `follow_verified_tree`'s
accepted indices, the root included).

Rounds are drawn without near-ties, so that float rounding cannot decide a tree: every row's
logits are distinct, and in float64 the likeliest node left out of the tree is at least MARGIN
(in log-probability) below the least likely node in it. Draws that fail are redrawn.

Regenerate (reference at commit c96427a185677bf4133ed865dd1626a5041aef9b):

    mkdir -p /tmp/ddtree_ref
    git -C <ddtree clone> show HEAD:ddtree.py > /tmp/ddtree_ref/ddtree.py
    python tests/decoding/ddtree_reference.py --reference /tmp/ddtree_ref/ddtree.py \\
        --out tests/decoding/ddtree_reference.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

V = 32
DEPTHS = (7, 15)
BUDGETS = (4, 8, 16, 32, 64)
ROUNDS = 6
SHARP_ROUNDS = 2
TEMPERATURES = (0.5, 4.0)
SHARP_TEMPERATURES = (8.0, 16.0)
SEED = 20260416
MARGIN = 1e-3
RANK_PROBS = (0.6, 0.25, 0.1)  # ranks 0, 1, 2; the rest: a uniform token


def target_choice(path: tuple[int, ...], continuation: list[int], vocab: int) -> int:
    """The target's token after the node whose tokens (root excluded) are `path`."""
    d = len(path)
    if list(path) == continuation[:d]:
        return continuation[d]
    return (7 * sum(path) + 3 * d + 1) % vocab


def _stub(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module


def load_reference(path: Path):
    """The reference `ddtree.py` as a module, its unused heavy imports stubbed out."""

    class _Unused:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("stub: not used by the tree functions")

    def _unused(*args, **kwargs):
        raise RuntimeError("stub: not used by the tree functions")

    class _Logger:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    _stub("loguru", logger=_Logger())
    _stub("transformers", AutoModelForCausalLM=_Unused, DynamicCache=_Unused)
    _stub("model", DFlashDraftModel=_Unused, sample=_unused, extract_context_feature=_unused)
    _stub(
        "dflash",
        dflash_generate=_unused,
        cuda_time=time.perf_counter,
        empty_stage_times=lambda names: {n: 0.0 for n in names},
    )
    spec = importlib.util.spec_from_file_location("ddtree_paper_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def draw_round(rng: np.random.Generator, depth: int, sharp: bool) -> tuple[np.ndarray, list[int]]:
    temps = rng.uniform(*(SHARP_TEMPERATURES if sharp else TEMPERATURES), size=(depth, 1))
    logits = (rng.standard_normal((depth, V)) * temps).astype(np.float32)
    continuation = []
    for d in range(depth + 1):
        u = rng.random()
        rank = next((r for r, c in enumerate(np.cumsum(RANK_PROBS)) if u < c), None)
        if d < depth and rank is not None:
            continuation.append(int(np.argsort(-logits[d], kind="stable")[rank]))
        else:
            continuation.append(int(rng.integers(V)))
    return logits, continuation


def node_paths(parents: list[int], tokens: list[int]) -> list[tuple[int, ...]]:
    """Each node's token path from the root (root: ()), for a table whose parents come first."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(parents)):
        assert 0 <= parents[i] < i, "parents must precede their children"
        paths.append(paths[parents[i]] + (tokens[i - 1],))
    return paths


def margin(logits: np.ndarray, paths: list[tuple[int, ...]], k: int) -> float:
    """In float64: the least likely node kept minus the likeliest node left out (given top-k rows)."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    logp = x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
    ranked = np.argsort(-logp, axis=-1, kind="stable")[:, :k]

    def score(path):
        return sum(logp[d, t] for d, t in enumerate(path))

    kept = set(paths[1:])
    worst_kept = min(score(p) for p in kept)
    best_out = -np.inf
    for p in paths:  # the root and every kept node: its best child not kept
        if len(p) == logits.shape[0]:
            continue
        left_out = [int(t) for t in ranked[len(p)] if p + (int(t),) not in kept]  # best first
        if left_out:
            best_out = max(best_out, score(p + (left_out[0],)))
    return worst_kept - best_out


def reference_round(ref, torch, logits: np.ndarray, continuation: list[int], budget: int) -> dict:
    node_tokens, _depths, parents, child_maps, _visibility, _times = ref.build_ddtree_tree(torch.tensor(logits), budget)
    tokens = [int(t) for t in node_tokens.tolist()]
    paths = node_paths(list(parents), tokens)
    assert len(set(paths)) == len(paths) == budget + 1
    posterior = torch.tensor([[target_choice(p, continuation, V) for p in paths]], dtype=torch.long)
    accepted, _next = ref.follow_verified_tree(child_maps, posterior)
    return {
        "paths": paths,
        "accepted": len(accepted),
        "margin": margin(logits, paths, min(budget, V)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="the DDTree paper's ddtree.py")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    ref = load_reference(args.reference)
    rng = np.random.default_rng(SEED)
    rounds, redraws, margins = [], 0, []
    for depth in DEPTHS:
        for budget in BUDGETS:
            for i in range(ROUNDS + SHARP_ROUNDS):
                sharp = i >= ROUNDS
                while True:
                    logits, continuation = draw_round(rng, depth, sharp)
                    distinct = all(len(np.unique(row)) == V for row in logits)
                    result = reference_round(ref, torch, logits, continuation, budget)
                    if distinct and result["margin"] >= MARGIN:
                        break
                    redraws += 1
                margins.append(result["margin"])
                values = [[float(x) for x in row] for row in logits]
                assert np.array_equal(np.array(values, dtype=np.float32), logits)
                rounds.append(
                    {
                        "depth": depth,
                        "budget": budget,
                        "round": i,
                        "sharp": sharp,
                        "accepted": result["accepted"],
                        "continuation": continuation,
                        "tree": sorted(list(p) for p in result["paths"][1:]),
                        "logits": values,
                    }
                )
    header = {
        "about": "DDTree paper reference trees and accepted lengths; written by tests/decoding/ddtree_reference.py",
        "reference": "github.com/liranringel/ddtree ddtree.py",
        "reference_sha256": hashlib.sha256(args.reference.read_bytes()).hexdigest(),
        "vocab": V,
        "seed": SEED,
        "margin": MARGIN,
    }
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rounds)
    head = json.dumps(header, separators=(",", ":"))[:-1]
    args.out.write_text(f'{head},"rounds":[\n{body}\n]}}\n')
    json.loads(args.out.read_text())  # well-formed
    accepted = [r["accepted"] for r in rounds]
    print(
        f"{len(rounds)} rounds ({redraws} redrawn for near-ties, smallest margin {min(margins):.4f}), "
        f"accepted lengths {min(accepted)}..{max(accepted)} "
        f"(mean {np.mean(accepted):.2f}), {args.out.stat().st_size} bytes -> {args.out}"
    )


if __name__ == "__main__":
    main()
