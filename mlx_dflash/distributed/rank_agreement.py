"""Ranks check that they run the same thing before loading weights.

Under mlx.launch each Mac loads its own packages and its own copy of the model files. A
rank with another mlx, or a model directory that is half synced, would otherwise shard,
decode and disagree only later: a hang at the first collective that differs, or shards of
two different models summed into garbage. So every rank describes its setup
(`fingerprint.describe`), the ranks exchange hashes of their descriptions (one all-reduce),
and on any difference rank 0's description goes to every rank, each differing rank names
what differs from it, and every rank raises the same `DFlashError`: one clear line on each,
at the same point, instead of a watchdog's timeout.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import DFlashError
from . import fingerprint
from .world import Distributed

MAX_PHRASES = 6  # differences named per rank; the rest are counted
_ABSENT = object()  # a config key one side does not have


def _show(value: Any) -> str:
    text = "absent" if value is _ABSENT else json.dumps(value, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _config_differences(mine: Any, theirs: Any, where: str, out: list[str]) -> None:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(set(mine) | set(theirs)):
            _config_differences(mine.get(key, _ABSENT), theirs.get(key, _ABSENT), f"{where}.{key}", out)
    elif mine != theirs:
        out.append(f"{where.lstrip('.')} {_show(mine)} vs {_show(theirs)}")


def _file_differences(mine: dict[str, Any], theirs: dict[str, Any], what: str, label: str) -> list[str]:
    out = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in theirs or name not in mine:
            out.append(f"{label} {name} {'present vs absent' if name in mine else 'absent vs present'}")
            continue
        a, b = mine[name], theirs[name]
        if isinstance(a, dict):  # a weight file: size, then header
            if a["size"] != b["size"]:
                out.append(f"{label} {name} size {a['size']} vs {b['size']}")
            if a["header"] != b["header"]:
                out.append(f"{label} {name} header differs" if not a["header"].startswith("unreadable")
                           else f"{label} {name} header {a['header']}")
        elif a != b:
            out.append(f"{label} {name} {what} differs")
    return out


def _model_differences(mine: dict[str, Any], theirs: dict[str, Any], label: str) -> list[str]:
    out: list[str] = []
    if isinstance(mine["config"], dict) and isinstance(theirs["config"], dict):
        _config_differences(mine["config"], theirs["config"], "", out)
        out = [f"{label} config.json {phrase}" for phrase in out]
    elif mine["config"] != theirs["config"]:
        shown = [c if isinstance(c, str) else "present" for c in (mine["config"], theirs["config"])]
        out.append(f"{label} config.json {shown[0]} vs {shown[1]}")
    out += _file_differences(mine["tokenizer"], theirs["tokenizer"], "content", f"{label} tokenizer file")
    out += _file_differences(mine["weights"], theirs["weights"], "", label)
    return out


def differences(mine: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """What differs between two descriptions, as short phrases ("mlx 0.31.2 vs 0.32.4": mine, then the
    reference's; "target model.safetensors header differs")."""
    out = [f"{name} {mine['versions'].get(name, 'not installed')} vs {reference['versions'].get(name, 'not installed')}"
           for name in sorted(set(mine["versions"]) | set(reference["versions"]))
           if mine["versions"].get(name) != reference["versions"].get(name)]
    out += _model_differences(mine["target"], reference["target"], "target")
    if (mine["drafter"] is None) != (reference["drafter"] is None):
        out.append(f"drafter {'none' if mine['drafter'] is None else 'given'} vs "
                   f"{'none' if reference['drafter'] is None else 'given'}")
    elif mine["drafter"] is not None:
        out += _model_differences(mine["drafter"], reference["drafter"], "drafter")
    return out


def summary(phrases: list[str]) -> str:
    """At most `MAX_PHRASES` phrases, joined, with a count of the rest."""
    shown = "; ".join(phrases[:MAX_PHRASES]) or "the descriptions differ"
    return shown + (f"; and {len(phrases) - MAX_PHRASES} more" if len(phrases) > MAX_PHRASES else "")


def check_ranks_agree(w: Distributed, description: dict[str, Any]) -> None:
    """Return when every rank's description equals rank 0's; else raise, on every rank, one DFlashError
    naming each differing rank and what differs (collective: every rank calls it, at the same point)."""
    text = fingerprint.canonical(description)
    digests = w.gather_rows(list(hashlib.sha256(text.encode()).digest()))
    differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if not differing:
        return
    reference = json.loads(w.share_text(text if w.is_main else None) or "{}")
    mine = summary(differences(description, reference)) if w.rank in differing else None
    lines = [f"rank {rank} differs from rank 0: {w.share_text(mine, root=rank)}" for rank in differing]
    raise DFlashError("ranks disagree: " + "; ".join(lines) + " (each 'A vs B' is that rank's, then rank 0's; "
                      "every rank needs the same package versions and model files, checked before loading)")


def check_before_loading(w: Distributed, target: Path, drafter: Path | None = None) -> None:
    """Describe this rank's packages, `target` and `drafter` directories and check every rank agrees."""
    check_ranks_agree(w, fingerprint.describe(target, drafter))
