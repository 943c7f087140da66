"""The project's own files: where they are kept, and JSON written so that a reader never sees half of one."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

CACHE_ENV = "MLX_DFLASH_CACHE"  # overrides where converted models, calibrations and the like are kept


def cache_dir() -> Path:
    """The folder for what is made once and reused (conversions, calibrations): `$MLX_DFLASH_CACHE`,
    else `mlx-dflash` under `$XDG_CACHE_HOME` (default `~/.cache`)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "mlx-dflash")
    return Path(root).expanduser()


def write_json_atomic(path: str | os.PathLike[str], data: Any, **json_kwargs: Any) -> None:
    """Write `data` as JSON (`json.dumps` options in `json_kwargs`) to `path`, atomically.

    The text goes to a temporary file of a unique name in the same folder (a rename across
    file systems is not atomic; a unique name keeps concurrent writers apart), which then
    replaces `path`. On any failure `path` is left as it was and the temporary file removed.
    """
    path = Path(path)
    text = json.dumps(data, **json_kwargs) + "\n"  # serialised first: a bad value touches no file
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
