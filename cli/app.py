"""The Typer application and the error line every command shares.

Kept apart from `main.py` so that commands register on one `app` however the
CLI is started (`dflash-mlx`, `python -m mlx_dflash.cli`, or `-m ...cli.main`).
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

import mlx_dflash  # noqa: F401  (Linux: OpenBLAS must load before mlx.core)

app = typer.Typer(
    name="dflash-mlx",
    help="DFlash speculative decoding for MLX: a small block-diffusion drafter proposes ~16 tokens "
    "in one pass and the target verifies them in one pass; the output is exactly the target's own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """DFlash speculative decoding for MLX: lossless, several times faster generation."""


_RANK_PREFIX = [""]  # "rank N: " on the non-zero ranks of a distributed run


def set_rank_prefix(prefix: str) -> None:
    _RANK_PREFIX[0] = prefix


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear error line (no traceback) and return the exit to raise."""
    if _RANK_PREFIX[0]:  # a following rank: its console is quiet, but its errors are not
        sys.stderr.write(f"error: {_RANK_PREFIX[0]}{message}\n")
    else:
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)
