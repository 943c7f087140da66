"""The `--json` document (schema in docs/bench.md): configuration, machine, records, summary, failures."""

from __future__ import annotations

from typing import Any

from ..platform.setup import machine
from .runner import BenchResult
from .stats import summarize

SCHEMA_VERSION = 1


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
