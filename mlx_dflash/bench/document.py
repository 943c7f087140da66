"""The `--json` document (schema in docs/bench.md): configuration, machine, records, summary, failures."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from .runner import BenchResult
from .stats import summarize

SCHEMA_VERSION = 1


def machine() -> str:
    """The CPU (or Apple chip) and OS, as people name them."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or name
        except (OSError, subprocess.SubprocessError):
            pass
    import mlx.core as mx

    device = "GPU" if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()) else "CPU"
    return f"{name}, {platform.system()} {platform.machine()}, MLX {mx.__version__} on the {device}"


def build_document(result: BenchResult, config: dict[str, Any], command: str = "") -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "machine": machine(),
        "config": config,
        "ok": result.ok,
        "failures": list(result.failures),
        "summary": summarize(result.records),
        "records": [r.to_dict() for r in result.records],
    }
