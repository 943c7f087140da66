"""Which DFlash modes a `--block-size` x `--tree-budget` x `--tree-shape` sweep runs, and their names.

A mode is (block size, tree budget, tree shape). Tree budget 0 is a linear block (the
shape then means nothing: None); a positive budget verifies draft trees of that many
nodes; "auto" lets `--block-size auto` weigh trees too. Combinations that cannot differ
from another collapse onto it and run once: a fixed block size with tree budget "auto"
(a fixed block's policy verifies linear blocks then), and block size 1 with any budget
(nothing is drafted) are the linear mode of that block size.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..auto.policy import AUTO
from ..decoding.tree import SPINE

Mode = tuple[int | str, int | str, str | None]  # (block size, tree budget, tree shape or None)


def collapse(block_size: int | str, tree_budget: int | str, tree_shape: str) -> Mode:
    """The mode a combination really runs (see the module docstring)."""
    if tree_budget == 0 or block_size == 1 or (tree_budget == AUTO and block_size != AUTO):
        return (block_size, 0, None)
    return (block_size, tree_budget, tree_shape)


def combinations(sizes: Sequence[int | str], budgets: Sequence[int | str] = (0,),
                 shapes: Sequence[str] = (SPINE,)) -> list[Mode]:
    """Every (size, budget, shape), collapsed and without duplicates, in the order given."""
    return list(dict.fromkeys(collapse(b, t, s) for b in sizes for t in budgets or (0,) for s in shapes or (SPINE,)))


def drop_refused(modes: Sequence[Mode], reason: str | None) -> tuple[list[Mode], list[str]]:
    """When trees cannot be verified (`reason`: why not), the modes left and the skipped ones
    ("mode: reason"): an explicit budget's modes are skipped; a budget of auto runs linear
    blocks (its mode collapses onto the linear one, run once)."""
    if reason is None:
        return list(modes), []
    skipped = [f"{mode_name(*m)}: {reason}" for m in modes if m[1] not in (0, AUTO)]
    kept = [(b, 0, None) if t == AUTO else (b, t, s) for b, t, s in modes if t in (0, AUTO)]
    return list(dict.fromkeys(kept)), skipped


def mode_name(block_size: int | str, tree_budget: int | str = 0, tree_shape: str | None = None,
              kind: str = "dflash") -> str:
    """'dflash-b8', 'dflash-auto', 'dflash-b8 t32', 'dflash-auto t-auto', 'dflash-auto t32 paper'."""
    return f"{kind}-{block_size if block_size == AUTO else f'b{block_size}'}{tree_suffix(tree_budget, tree_shape)}"


def tree_suffix(tree_budget: int | str, tree_shape: str | None) -> str:
    """'' for a linear mode, ' t32', ' t-auto', ' t32 paper' (the shape named when not the default)."""
    if not tree_budget:
        return ""
    return f" t{'-auto' if tree_budget == AUTO else tree_budget}" + \
        (f" {tree_shape}" if tree_shape and tree_shape != SPINE else "")
