"""`dflash-mlx calibrate`: what each block size costs on this machine, for `--block-size auto`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .app import app, err_console


@contextmanager
def progress_line(description: str) -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on stderr; yields the `progress(done, total)` callback."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bars:
        task = None

        def progress(done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bars.add_task(description, total=total)
            bars.update(task, completed=done)

        yield progress


def block_size_option(value: str) -> str:
    """Typer callback: `--block-size` takes auto or a positive integer (else a usage error)."""
    from mlx_dflash.auto.policy import parse_block_size
    from mlx_dflash.errors import DFlashError

    try:
        return str(parse_block_size(value))
    except DFlashError as e:
        raise typer.BadParameter(str(e)) from None


def calibration_for(target: Any, drafter: Any, block_size: Any, *, refresh: bool = False,
                    recall: bool = True, trees: bool = False) -> Any:
    """The calibration seeding `--block-size auto` (cached; measured with a progress line when
    missing); None for a fixed block size or without a drafter. Warnings are printed here.
    With `recall`, it carries what earlier runs learnt of the drafter's acceptance (a
    benchmark starts from nothing instead, to be repeatable); `remember_acceptance` saves it.
    `trees` (`--tree-budget auto`): it holds the draft trees' costs too (measured when missing)."""
    from mlx_dflash.auto.acceptance_memory import seed
    from mlx_dflash.auto.calibration import calibrate
    from mlx_dflash.auto.policy import AUTO

    if drafter is None or (block_size != AUTO and not refresh):
        return None
    what = "block sizes and draft trees" if trees else "block sizes"
    with progress_line(f"calibrating {what} on this machine (once per model)") as progress:
        calibration, warning = calibrate(target, drafter, refresh=refresh, progress=progress, trees=trees)
    if warning:
        err_console.print(f"[yellow]{escape(warning)}[/]", highlight=False)
    if calibration is not None and recall:
        seed(calibration, target, drafter)
    return calibration


def remember_acceptance(target: Any, drafter: Any, calibration: Any) -> None:
    """Keep what `auto` learnt of the drafter's acceptance this run for the next (rank 0 only)."""
    from mlx_dflash.auto.acceptance_memory import remember
    from mlx_dflash.distributed.world import is_main_process

    if calibration is None or calibration.acceptance is None or not is_main_process():
        return
    warning = remember(target, drafter, calibration.acceptance)
    if warning:
        err_console.print(f"[yellow]{escape(warning)}[/]", highlight=False)


@app.command()
def calibrate(
    model: Annotated[str | None, typer.Argument(help="Target: short name, Hugging Face repo id, mlx-lm directory or .gguf file (default: the embedded SmolLM2-135M-Instruct and its drafter).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="DFlash drafter (default: the short name's or the embedded default's).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 | float16 | bfloat16 (default: float32 on the CPU).")] = None,
    trees: Annotated[bool, typer.Option("--trees/--no-trees", help="Also measure a draft tree of each budget `--tree-budget auto` weighs (16, 32, 64 nodes, spine), where the pair verifies trees.")] = True,
) -> None:
    """Measure (again) what a decoding cycle of each block size costs for this model on this machine.

    `--block-size auto` (the default of chat, generate, bench and serve) does this once by
    itself; run it after a change to the machine or to MLX, or to see the figures.
    """
    import mlx_dflash
    from mlx_dflash.auto.calibration import cache_file
    from mlx_dflash.errors import DFlashError
    from mlx_dflash.loading.resolve import choose_pair

    choice = choose_pair(model, draft)
    if choice.draft is None:
        raise DFlashError("calibration measures drafting cycles: give a --draft")
    target, _, drafter = mlx_dflash.load(choice.target, choice.draft, dtype=dtype)
    calibration = calibration_for(target, drafter, None, refresh=True, trees=trees)
    table = Table("block size", "ms per cycle at 64 tokens", "+ ms per 1k context", "vs a plain step",
                  title="cost of one decoding cycle", header_style="bold")
    plain = calibration.costs[1][0] + 64 * calibration.costs[1][1]
    rows = [(str(size), ab) for size, ab in sorted(calibration.costs.items())]
    rows += [(f"{drafter.block_size}, tree of {budget}", ab) for budget, ab in sorted((calibration.tree_costs or {}).items())]
    for name, (a, b) in rows:
        at64 = a + 64 * b
        table.add_row(name, f"{1e3 * at64:.1f}", f"{1e6 * b:.1f}", f"{at64 / plain:.2f}x")
    Console().print(table)
    if trees and calibration.tree_costs == {}:
        Console().print("draft trees: not measured (this pair cannot verify them; `--tree-budget` says why)")
    Console().print(escape(f"measured in {calibration.seconds:.1f} s, saved to {cache_file(calibration.key)}"),
                    highlight=False)


__all__ = ["block_size_option", "calibrate", "calibration_for", "progress_line"]
