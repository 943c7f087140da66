"""`dflash-mlx`: the command-line entry point (Typer). Commands register here."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

import mlx_dflash  # noqa: F401  (Linux: OpenBLAS must load before mlx.core)
from mlx_dflash.errors import DFlashError

app = typer.Typer(
    name="dflash-mlx",
    help="DFlash speculative decoding for MLX: lossless, block-parallel drafting with a "
    "small diffusion drafter, verified by the target in one pass.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """DFlash speculative decoding for MLX."""


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear error line (no traceback) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _register() -> None:
    from . import generate_cmd  # noqa: F401


def main() -> None:
    _register()
    try:
        app()
    except DFlashError as e:
        raise SystemExit(fail(str(e)).exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
