"""`dflash-mlx models`: the known target/drafter pairs and what is cached locally."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .app import app


@app.command()
def models() -> None:
    """List the short names of known target/drafter pairs and the converted-weights cache."""
    from mlx_dflash.loading.resolve import KNOWN_PAIRS, cached_conversions, converted_cache_dir, in_hub_cache

    console = Console()
    table = Table(title="Known pairs (use the short name as MODEL or SRC)")
    for column in ("short name", "target repo", "drafter repo", "DFlash", "in HF cache"):
        table.add_column(column, overflow="fold")
    for pair in KNOWN_PAIRS:
        cached = [role for role, repo in (("target", pair.target), ("drafter", pair.drafter)) if in_hub_cache(repo)]
        version = "DFlash2" if pair.dflash == 2 else "v1"
        table.add_row(*(Text(cell) for cell in (pair.name, pair.target, pair.drafter, version,
                                               ", ".join(cached) or "-")))
    console.print(table)
    entries = cached_conversions()
    if not entries:
        console.print(Text(f"converted cache {converted_cache_dir()}: empty"))
        return
    cache = Table(title=Text(f"Converted cache ({converted_cache_dir()})"))
    for column in ("kind", "source", "options", "size", "directory"):
        cache.add_column(column, overflow="fold")
    for e in entries:
        options = ", ".join(f"{k}={v}" for k, v in e["options"].items() if v not in (None, False)) or "as is"
        cache.add_row(*(Text(cell) for cell in (e["kind"], str(e["source"]), options, f"{e['bytes'] / 2**20:.1f} MiB",
                                               e["path"].name)))
    console.print(cache)
