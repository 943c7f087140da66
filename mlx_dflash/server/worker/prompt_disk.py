"""The prompt cache's disk tier: conversations kept as session files across evictions and restarts.

Sessions the memory cache evicts, and on a clean stop every live one, are written as
session files (`decoding.session_file`: the target's caches, the drafter's context K/V,
the tokens and marks; prompt lookup's index is rebuilt from the tokens on reading). A
request whose prompt a file serves better than memory by a margin worth the read
(`MIN_GAIN` tokens, and a tenth of the file's) reads it back and goes on from it as
from a memory hit.

A file is named by the models' fingerprint (`session_file.model_fingerprint`: weights,
dtypes, quantization, configs, MLX version) and a digest of its tokens, so a changed
model never reads a stale file. The folder is bounded in bytes, every session file in
it counted (other models' too: the least recently used go first, so a replaced model's
files age out). An in-memory index of the headers (tokens, marks) is built at start;
each request compares its prompt only with the files whose first `BUCKET` tokens it
shares, in numpy. A file that is not whole (its header unreadable, cut short, or
arrays that do not fit) is removed with one log line: under our name it can only be
a damaged copy of ours. Other models' files are never read, only counted; a file not
named as the tier names its files is never touched, and a temporary file is deleted
only once the process writing it is gone.

Evicted sessions are written by a background thread (the request that evicted them
does not wait for the disk): the worker evaluates their arrays (`encode_session`), the
thread only writes bytes. A write that fails (a full disk) logs one line and the cache
goes on in memory; no partial file is left behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ...decoding.session import DecodingSession
from ...decoding.session_file import (
    PARTIAL_SUFFIX,
    EncodedSession,
    SessionFileError,
    encode_session,
    load_session,
    model_fingerprint,
    read_header,
    write_session,
)
from ...platform.files import cache_dir
from ...targets.model import TargetModel

logger = logging.getLogger("mlx_dflash")

DIR_ENV = "MLX_DFLASH_PROMPT_CACHE_DIR"  # the default of `serve --prompt-cache-dir` (tests set "off")
OFF = {"", "off", "none", "no", "false", "0"}
DEFAULT_MAX_BYTES = 8 << 30
FREE_SHARE = 10  # by default the tier takes at most a tenth of the disk space free for it
MIN_GAIN = 256  # prompt tokens a file must hold beyond memory's best to be read
GAIN_SHARE = 10  # ... and a tenth of its own tokens: a read costs in proportion to the file
BUCKET = 64  # leading tokens that index the files (a file worth reading shares more)
MAX_QUEUED = 4  # evicted sessions waiting for the writer; beyond, an eviction is not written
SUFFIX = ".safetensors"
# Only files named so are the tier's (any model's): nothing else in the folder is read, counted or deleted.
_NAME = r"[0-9a-f]{16}-[0-9a-f]{32}" + re.escape(SUFFIX)
_FILE = re.compile(f"^{_NAME}$")
_PARTIAL = re.compile(rf"^\.{_NAME}\.(\d+)\.[0-9a-f]+" + re.escape(PARTIAL_SUFFIX) + "$")


def default_dir() -> Path:
    """`prompt-cache` under the project's cache folder (`platform.files.cache_dir`)."""
    return cache_dir() / "prompt-cache"


def resolve_dir(value: str | None) -> Path | None:
    """The folder `serve --prompt-cache-dir` names: None for the default, 'off' or 'none' for no disk tier."""
    if value is None:
        return default_dir()
    if value.strip().lower() in OFF:
        return None
    return Path(value).expanduser()


def default_disk_bytes(directory: Path, used: int = 0) -> int:
    """`DEFAULT_MAX_BYTES`, or a tenth of the disk space free for `directory` (counting the `used`
    bytes of its files as free: the bound does not shrink as it fills), whichever is less."""
    return min(DEFAULT_MAX_BYTES, (shutil.disk_usage(directory).free + used) // FREE_SHARE)


def fingerprint_of(target: TargetModel, drafter: Any = None) -> str:
    """What the files of these models depend on: `model_fingerprint` (weights, dtypes, quantization)
    with both configs (rope, the drafter's target layers and windows) and the MLX version."""
    return model_fingerprint(target, drafter, target_args=_plain(target.args),
                             drafter_args=_plain(getattr(drafter, "args", None)), mlx=mx.__version__)


def _plain(value: Any) -> Any:
    """`value` as JSON-able data that is the same in every run (no object addresses)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def usable_length(tokens: np.ndarray, prompt: np.ndarray, rewindable: bool, marks: Sequence[int]) -> int | None:
    """`prompt_cache._usable_length`'s rule for a file: how many of its `tokens` a request for
    `prompt` can keep (None: no use); the common prefix found in numpy."""
    n = min(len(tokens), len(prompt))
    differ = np.flatnonzero(tokens[:n] != prompt[:n])
    common = int(differ[0]) if differ.size else n
    keep = min(common + 1, len(tokens), len(prompt) - 1)
    if keep < len(tokens) and not rewindable:
        keep = max((m for m in marks if m <= keep), default=0)
    return keep if keep >= 2 else None


@dataclass
class DiskEntry:
    path: Path
    tokens: np.ndarray
    rewindable: bool
    marks: list[int]  # lengths a session read from it can be rolled back to (unrewindable targets)
    nbytes: int
    used: float  # when last written or read (the file's mtime): least recently used go first

    def serves(self, other: DiskEntry) -> bool:
        """Every prompt `other` serves, this serves as well (so `other` is not worth keeping)."""
        n = len(other.tokens)
        if len(self.tokens) < n or not np.array_equal(self.tokens[: n - 1], other.tokens[: n - 1]):
            return False  # the last token is the pending one, which a request replaces
        if self.rewindable:
            return True
        return {n, *other.marks} <= {len(self.tokens), *self.marks}


class PromptDisk:
    """The session files of one pair of models in `directory`, at most `max_bytes` of files there."""

    def __init__(self, directory: str | Path, max_bytes: int | None, fingerprint: str):
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.prefix = fingerprint[:16] + "-"
        self._lock = threading.Lock()  # the index: the worker reads it, the writer thread changes it
        self._entries: dict[Path, DiskEntry] = {}
        self._buckets: dict[tuple[int, ...], set[Path]] = {}
        self._others: dict[Path, tuple[int, float]] = {}  # other models' files: (bytes, used)
        self.nbytes = 0  # every session file in the folder, ours and others'
        self.hits = 0
        self._queued = 0
        self._failing = False  # a write failed: the next failures log nothing until one succeeds
        self._writer: ThreadPoolExecutor | None = None
        self._scan()
        self.max_bytes = default_disk_bytes(self.dir, self.nbytes) if max_bytes is None else max_bytes
        with self._lock:
            self._evict()

    @classmethod
    def for_models(cls, directory: str | Path, max_bytes: int | None, target: TargetModel,
                   drafter: Any = None) -> PromptDisk | None:
        """The tier of these models' files in `directory` (None, with one log line, when the folder cannot be used)."""
        try:
            return cls(directory, max_bytes, fingerprint_of(target, drafter))
        except OSError as e:
            logger.warning("mlx-dflash serve: no prompt cache on disk: %s cannot be used (%s)", directory, e)
            return None

    def __len__(self) -> int:
        return len(self._entries)

    # -- the index -------------------------------------------------------------------------
    def _scan(self) -> None:
        for path in sorted(self.dir.iterdir()):
            try:
                if _PARTIAL.match(path.name):
                    _remove_orphan(path)
                elif _FILE.match(path.name) and path.is_file():
                    self._index(path)
            except OSError as e:  # gone meanwhile (another server's eviction), or unreadable
                logger.warning("mlx-dflash serve: prompt cache file %s skipped (%s)", path, e)
        if self._others:
            logger.info("mlx-dflash serve: %d prompt cache files of other models in %s (counted in the bound, "
                        "never read)", len(self._others), self.dir)

    def _index(self, path: Path) -> None:
        stat = path.stat()
        if not path.name.startswith(self.prefix):
            self._others[path] = (stat.st_size, stat.st_mtime)
            self.nbytes += stat.st_size
            return
        try:
            header = read_header(path)
            if header.fingerprint != self.fingerprint:
                raise SessionFileError(f"{path}: saved with other models")
            entry = DiskEntry(path, np.asarray(header.tokens, dtype=np.int64), bool(header.metadata["rewindable"]),
                              [int(m) for m in header.metadata["marks"]], header.nbytes, stat.st_mtime)
        except (SessionFileError, KeyError, TypeError, ValueError) as e:
            logger.warning("mlx-dflash serve: removed a damaged prompt cache file: %s", e)
            path.unlink(missing_ok=True)
            return
        self._add(entry)

    def _add(self, entry: DiskEntry) -> None:
        self._entries[entry.path] = entry
        self._buckets.setdefault(_bucket(entry.tokens), set()).add(entry.path)
        self.nbytes += entry.nbytes

    def _remove(self, path: Path) -> None:
        """Forget a file and delete it (the lock held)."""
        entry = self._entries.pop(path, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            bucket = self._buckets.get(_bucket(entry.tokens))
            if bucket is not None:
                bucket.discard(path)
                if not bucket:
                    del self._buckets[_bucket(entry.tokens)]
        elif path in self._others:
            self.nbytes -= self._others.pop(path)[0]
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # the bound is kept by the index; a file that will not go is counted no more

    def _evict(self, keep: Path | None = None) -> None:
        """Delete the least recently used files until the folder keeps to its bound (the lock held)."""
        while self.nbytes > self.max_bytes:
            used = [(e.used, p) for p, e in self._entries.items() if p != keep]
            used += [(u, p) for p, (_, u) in self._others.items()]
            if not used:
                return
            self._remove(min(used)[1])

    def _path(self, tokens: np.ndarray) -> Path:
        return self.dir / f"{self.prefix}{hashlib.sha256(tokens.tobytes()).hexdigest()[:32]}{SUFFIX}"

    # -- reading ---------------------------------------------------------------------------
    def best(self, prompt: list[int], memory: int = 0) -> tuple[int, Path] | None:
        """(tokens to keep, file) of the file serving `prompt` best, when it keeps enough more
        than `memory` (the memory cache's best) to be worth reading; else None."""
        if len(prompt) - 1 - memory < MIN_GAIN:
            return None  # no file can gain enough: the common case of a memory hit costs nothing more
        with self._lock:
            entries = [self._entries[p] for p in self._buckets.get(tuple(prompt[:BUCKET]), ())]
        if not entries:
            return None
        ids = np.asarray(prompt, dtype=np.int64)
        best: tuple[int, int, Path] | None = None  # (keep, -file tokens, path): the smaller file on a tie
        for entry in entries:
            keep = usable_length(entry.tokens, ids, entry.rewindable, entry.marks)
            if keep is None or keep - memory < max(MIN_GAIN, len(entry.tokens) // GAIN_SHARE):
                continue
            candidate = (keep, -len(entry.tokens), entry.path)
            if best is None or candidate[:2] > best[:2]:
                best = candidate
        return (best[0], best[2]) if best is not None else None

    def load(self, path: Path, new_session: Callable[[], DecodingSession]) -> DecodingSession | None:
        """The session saved in `path`, built on `new_session()`; None (one log line, the file
        removed) when it cannot be read back."""
        try:
            session, _ = load_session(path, new_session, fingerprint=self.fingerprint)
        except SessionFileError as e:
            if path.exists():  # else another server sharing the folder evicted it meanwhile: nothing to say
                logger.warning("mlx-dflash serve: a prompt cache file was skipped and removed: %s", e)
            with self._lock:
                self._remove(path)
            return None
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None:
                entry.used = time.time()
        try:
            os.utime(path)  # used now: the least recently used files go first, after a restart too
        except OSError:
            pass
        self.hits += 1
        return session

    # -- writing ---------------------------------------------------------------------------
    def write(self, session: DecodingSession) -> bool:
        """Queue `session` (evicted from memory) for the writer thread; False when it is not
        written: too short to be worth a read, already served by a file, or the writer is behind."""
        if len(session.tokens) <= MIN_GAIN or self._queued >= MAX_QUEUED:
            return False
        if self._served(session):
            return False
        encoded = self._encode(session)
        if encoded is None:
            return False
        with self._lock:
            self._queued += 1
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="dflash-prompt-disk")
            self._writer.submit(self._write, *encoded)
        return True

    def write_all(self, sessions: list[tuple[DecodingSession, int]]) -> int:
        """Write `sessions` ((session, bytes in memory), least recently used first) now, after any
        queued writes: the newest that fit the bound, so the oldest are the ones left out. Returns
        how many files were written."""
        self.flush()
        chosen: list[DecodingSession] = []
        room = self.max_bytes
        for session, size in reversed(sessions):
            if size <= room and len(session.tokens) > MIN_GAIN:
                chosen.append(session)
                room -= size
        written = 0
        for session in reversed(chosen):  # oldest first: the newest are then the most recently used
            if not self._served(session):
                encoded = self._encode(session)
                if encoded is not None:
                    self._queued += 1  # `_write` counts it out
                    written += self._write(*encoded)
        return written

    def flush(self) -> None:
        """Wait for the queued writes (and let the writer thread end)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def _served(self, session: DecodingSession) -> bool:
        """Some file serves every prompt `session` would: it is only marked used."""
        probe = _entry_of(session)
        with self._lock:
            for path in self._buckets.get(_bucket(probe.tokens), ()):
                entry = self._entries[path]
                if entry.serves(probe):
                    entry.used = time.time()
                    return True
        return False

    def _encode(self, session: DecodingSession) -> tuple[EncodedSession, DiskEntry] | None:
        """The session's arrays evaluated (on its own thread) and its index entry; None when it is not written."""
        entry = _entry_of(session)
        try:
            encoded = encode_session(session, fingerprint=self.fingerprint,
                                     metadata={"rewindable": entry.rewindable, "marks": entry.marks})
        except SessionFileError as e:  # a proposer or cache the format does not hold: memory only
            logger.debug("mlx-dflash serve: a conversation stays in memory only: %s", e)
            return None
        except Exception:  # noqa: BLE001 - a conversation the disk cannot take must not fail its request
            logger.exception("mlx-dflash serve: a conversation could not be prepared for the prompt cache on disk")
            return None
        if encoded.nbytes > self.max_bytes:
            return None
        entry.path = self._path(entry.tokens)
        return encoded, entry

    def _write(self, encoded: EncodedSession, entry: DiskEntry) -> bool:
        """Write one file, then drop the files it serves and keep to the bound (the writer thread's work)."""
        try:
            try:
                entry.nbytes = write_session(encoded, entry.path)
            except OSError as e:
                if not self._failing:
                    logger.warning("mlx-dflash serve: a conversation could not be written to the prompt cache on "
                                   "disk (%s); the cache goes on in memory", e)
                self._failing = True
                return False
            self._failing = False
            entry.used = time.time()
            with self._lock:
                if entry.path in self._entries:
                    self._remove_entry_only(entry.path)
                for path in list(self._buckets.get(_bucket(entry.tokens), ())):
                    if entry.serves(self._entries[path]):
                        self._remove(path)
                self._add(entry)
                self._evict(keep=entry.path)
            return True
        except Exception:  # noqa: BLE001 - the writer thread must never die silently
            logger.exception("mlx-dflash serve: writing a prompt cache file failed")
            return False
        finally:
            with self._lock:
                self._queued = max(0, self._queued - 1)

    def _remove_entry_only(self, path: Path) -> None:
        """Forget a file about to be replaced by one of the same name (the lock held)."""
        entry = self._entries.pop(path)
        self.nbytes -= entry.nbytes
        self._buckets[_bucket(entry.tokens)].discard(path)

    def describe(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "files": len(self._entries), "bytes": self.nbytes,
                "max_bytes": self.max_bytes, "hits": self.hits}


def _bucket(tokens: np.ndarray) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens[:BUCKET])


def _entry_of(session: DecodingSession) -> DiskEntry:
    """An index entry for `session`'s file (its path, size and time filled in when written)."""
    return DiskEntry(Path(), np.asarray(session.tokens, dtype=np.int64), session.rewindable,
                     [m.length for m in session.marks], 0, 0.0)


def _remove_orphan(path: Path) -> None:
    """A temporary file whose writer is gone (killed mid-write) is deleted; a live writer's is left."""
    pid = int(_PARTIAL.match(path.name).group(1))
    try:
        os.kill(pid, 0)
        return  # alive (this process, or another server writing to the same folder)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
    except PermissionError:
        return  # another user's live process
