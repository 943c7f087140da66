"""`--tree-budget` and `--tree-shape`: the draft-tree options generate, chat and serve share.

A draft tree verifies, in one target pass, the drafted block's likeliest alternative
continuations beside the block itself (`mlx_dflash.decoding.tree`). The values are checked
here, before any model loads (a usage error); whether the target and drafter can verify
trees is checked once they are loaded (`mlx_dflash.generate.tree_settings`).
"""

from __future__ import annotations

import typer

from mlx_dflash.targets.tree import TREE_MODEL_TYPES

TREE_BUDGET_HELP = (
    "Draft trees: verify each drafted block as a tree of N nodes, the block's likeliest alternative "
    "continuations checked in the same target pass (more tokens accepted per cycle, for a wider verify; "
    "the output is the same). 0: linear blocks (default); auto: let --block-size auto weigh trees where "
    "this pair can verify them (with a fixed --block-size: linear blocks). N > 0 needs a DFlash v1 drafter "
    f"and a target of {', '.join(TREE_MODEL_TYPES)} (hybrid and sliding-window targets are refused)."
)
TREE_SHAPE_HELP = (
    "Draft-tree shape: spine (default: the linear draft plus the likeliest other nodes, so a tree never "
    "accepts fewer tokens than the linear block) or paper (the N likeliest nodes, as DDTree picks them)."
)


def tree_budget_option(value: str) -> str:
    """Typer callback: `--tree-budget` takes auto, 0 or a positive integer (else a usage error)."""
    from mlx_dflash.auto.policy import parse_tree_budget
    from mlx_dflash.errors import DFlashError

    try:
        return str(parse_tree_budget(value))
    except DFlashError as e:
        raise typer.BadParameter(str(e)) from None


def tree_shape_option(value: str) -> str:
    """Typer callback: `--tree-shape` takes spine or paper (else a usage error)."""
    from mlx_dflash.auto.policy import parse_tree_shape
    from mlx_dflash.errors import DFlashError

    try:
        return parse_tree_shape(value)
    except DFlashError as e:
        raise typer.BadParameter(str(e)) from None
