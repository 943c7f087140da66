"""Run by `mlx.launch` from test_distributed.py: the CLI, with "{rank}" in its arguments replaced
by this process's rank, so that each rank can be given other files.

    per_rank_cli.py generate -m /tmp/x/target{rank} ...
"""

from __future__ import annotations

import os
import sys

from mlx_dflash.cli.main import main

if __name__ == "__main__":
    rank = os.environ.get("MLX_RANK", "0")
    sys.argv = [sys.argv[0], *(arg.replace("{rank}", rank) for arg in sys.argv[1:])]
    main()
