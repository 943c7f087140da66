"""Run by `mlx.launch -n 2 --backend ring` from test_distributed.py: ranks check they agree before loading.

    agreement_worker.py ROOT OUT_PREFIX
ROOT holds target/ and drafter/ and variants of them. In each scenario both ranks call
`mlx_dflash.load`, rank 1 on a variant (for "version", with another mlx version reported by the
fingerprint's version function, replaced here for the scenario); each rank records the error it
raised (None: it loaded) and how long that took. The same processes then go on to the next
scenario: a disagreement leaves the ranks in step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx_dflash
from mlx_dflash.distributed import fingerprint
from mlx_dflash.distributed.world import world
from mlx_dflash.errors import DFlashError

# name -> rank 1's target, drafter and mlx version (None: the installed one); rank 0 loads target/, drafter/
SCENARIOS = {
    "version": ("target", "drafter", "0.0.0-test"),
    "header": ("target_header", "drafter", None),
    "tokenizer": ("target_tokenizer", "drafter", None),
    "drafter": ("target", "drafter_config", None),
    "same": ("target", "drafter", None),
}


def run(root: Path, out_prefix: str) -> None:
    w = world()
    installed = fingerprint.installed_versions
    results = {}
    for name, variant in SCENARIOS.items():
        target, drafter, mlx_version = variant if w.rank == 1 else ("target", "drafter", None)
        if mlx_version is not None:
            fingerprint.installed_versions = lambda v=mlx_version: {**installed(), "mlx": v}
        start = time.monotonic()
        try:
            mlx_dflash.load(str(root / target), str(root / drafter))
            error = None
        except DFlashError as e:
            error = str(e)
        finally:
            fingerprint.installed_versions = installed
        results[name] = {"error": error, "seconds": time.monotonic() - start}
    Path(f"{out_prefix}.rank{w.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2])
