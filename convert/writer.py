"""Atomic output: everything goes to a temporary sibling directory, renamed at the end.

On any failure (including Ctrl-C) the temporary directory is removed and DST is
untouched; an existing DST is replaced only with `force`.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from mlx_dflash.errors import DFlashError


def check_destination(dst: Path, force: bool) -> None:
    if dst.exists() and not force:
        raise DFlashError(f"{dst} already exists; pass --force to overwrite it")
    if dst.exists() and not dst.is_dir():
        raise DFlashError(f"{dst} exists and is not a directory")


def _os_message(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission denied"
    return e.strerror or str(e)


@contextlib.contextmanager
def atomic_directory(dst: Path, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes `dst` when the block succeeds."""
    dst = dst.expanduser().absolute()
    check_destination(dst, force)
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise DFlashError(f"cannot write {dst}: {_os_message(e)}") from None
    try:
        yield tmp
        _publish(tmp, dst, force)
    except OSError as e:
        raise DFlashError(f"cannot write {dst}: {_os_message(e)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    if not dst.exists():
        tmp.rename(dst)
        return
    check_destination(dst, force)  # it may have appeared while we worked
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    dst.rename(old)
    try:
        tmp.rename(dst)
    except OSError:
        old.rename(dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
