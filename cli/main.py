"""`dflash-mlx`: the command-line entry point. Commands register on `app.app`."""

from __future__ import annotations

import sys

from mlx_dflash.errors import DFlashError

from .app import app, err_console, fail


def _register() -> None:
    from . import bench_cmd, chat_cmd, convert_cmd, generate_cmd, models_cmd, serve_cmd, train_cmd  # noqa: F401
    from . import calibrate_cmd as calibrate_cmd  # noqa: F401


def main() -> None:
    _register()
    try:
        app()
    except DFlashError as e:
        raise SystemExit(fail(str(e)).exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


__all__ = ["app", "err_console", "fail", "main"]

if __name__ == "__main__":
    main()
