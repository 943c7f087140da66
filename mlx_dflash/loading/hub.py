"""Hugging Face Hub snapshots through huggingface_hub's cache, with one-line errors.

The cache location and offline mode are read from the environment at call time
(huggingface_hub reads them once, at import).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DFlashError


def offline(flag: bool = False) -> bool:
    return flag or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def is_repo_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def snapshot(repo_id: str, *, allow_patterns: list[str] | None = None, revision: str | None = None,
             repo_type: str = "model", offline_only: bool = False, cache_dir: str | Path | None = None,
             hint: str = "") -> Path:
    """The local snapshot directory of a Hub repo: from the cache, or downloaded (online)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    what = f"dataset {repo_id}" if repo_type == "dataset" else repo_id
    local_only = offline(offline_only)
    try:
        return Path(snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns,
            cache_dir=cache_dir or hub_cache_dir(), local_files_only=local_only,
        ))
    except LocalEntryNotFoundError:
        how = "offline mode is on" if local_only else "the Hub cannot be reached"
        raise DFlashError(f"{what} is not in the local Hugging Face cache and {how}{hint}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise DFlashError(f"could not download {what}: {str(e).splitlines()[0]}{hint}") from None
