"""The Typer application and the error line every command shares.

Kept apart from `main.py` so that commands register on one `app` however the
CLI is started (`dflash-mlx`, `python -m mlx_dflash.cli`, or `-m ...cli.main`).
"""

from __future__ import annotations

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


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear error line (no traceback) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)
