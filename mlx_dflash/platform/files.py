"""Writing a JSON file so that a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


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
