"""`dflash-mlx`: the command-line entry point. Commands register on `app.app`."""

from __future__ import annotations

import os
import sys

from mlx_dflash.errors import DFlashError

from .app import app, err_console, fail, set_rank_prefix


def _register() -> None:
    from . import (  # noqa: F401
        bench_cmd,
        chat_cmd,
        convert_cmd,
        doctor_cmd,
        generate_cmd,
        models_cmd,
        serve_cmd,
        train_cmd,  # noqa: F401
    )
    from . import calibrate_cmd as calibrate_cmd  # noqa: F401


def _follow_rank_zero() -> None:
    """Under mlx.launch, rank 0 alone prints and writes; the other ranks' stdout goes nowhere
    and their error lines say which rank they come from."""
    from mlx_dflash.distributed.world import world

    w = world()
    if w is None or w.is_main:
        return
    sys.stdout = open(os.devnull, "w")  # for the life of the process
    err_console.quiet = True
    set_rank_prefix(f"rank {w.rank}: ")


def main() -> None:
    _register()
    _follow_rank_zero()
    try:
        app()
    except DFlashError as e:
        raise SystemExit(fail(str(e)).exit_code) from None
    except RuntimeError as e:
        from mlx_dflash.distributed.world import world

        w = world()
        if w is None or "[ring]" not in str(e) and "[jaccl]" not in str(e) and "[mpi]" not in str(e):
            raise
        w.give_up(f"lost the connection to another rank ({str(e).splitlines()[0]})")
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


__all__ = ["app", "err_console", "fail", "main"]

if __name__ == "__main__":
    main()
