"""A decoding session in one safetensors file: its caches, tokens and marks, to go on later.

What is written: every target cache's `state` (and `meta_state`), the drafter's context
K/V (`DraftContextCache`), the committed tokens, the session's marks, a fingerprint of the
models (`model_fingerprint`: shapes, dtypes, quantization and a digest of weight samples,
so a changed model never reads a stale file) and the caller's metadata (a chat's
messages). Prompt lookup's index is not written: it is rebuilt from the tokens, which
costs microseconds per token. Files are written whole or not at all (a temporary file
renamed into place); a foreign, stale or damaged file raises `SessionFileError` on
reading, never anything else.

`read_header` reads only the JSON header (tokens, fingerprint, metadata), which is what
an index of many files needs; it also finds a file cut short. `save_session` is
`encode_session` (on the session's thread: its arrays evaluated where their graphs were
built) then `write_session` (only bytes to disk: any thread, a background writer's).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import DFlashError
from ..proposers.dflash import DFlashProposer
from ..targets.model import TargetModel
from .prefix_marks import PrefixMark
from .session import DecodingSession

FORMAT = "mlx-dflash-session/1"
HEADER_LIMIT = 256 << 20  # a header longer than this is not ours
WEIGHT_SAMPLE = 64  # elements of each weight array hashed into the fingerprint
PARTIAL_SUFFIX = ".partial.safetensors"  # a file being written (safetensors names end so)


class SessionFileError(DFlashError):
    """A session file that cannot be read back into this session: foreign, stale or damaged."""


@dataclass
class SessionHeader:
    tokens: list[int]
    fingerprint: str
    metadata: dict[str, Any]
    nbytes: int  # the file's size


def model_fingerprint(target: TargetModel, drafter: Any = None, **extra: Any) -> str:
    """What a saved cache depends on: each model's parameter names, shapes, dtypes and a digest
    of the first `WEIGHT_SAMPLE` values of every parameter (quantized ones included), and `extra`."""
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for name, model in (("target", target.model), ("drafter", drafter)):
        digest.update(name.encode())
        if model is None:
            continue
        params = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
        samples = [p.reshape(-1)[:WEIGHT_SAMPLE] for _, p in params]
        mx.eval(samples)
        for (key, p), sample in zip(params, samples, strict=True):
            digest.update(f"{key}:{p.shape}:{p.dtype}".encode())
            digest.update(bytes(memoryview(sample.astype(mx.float32) if sample.dtype == mx.bfloat16 else sample)))
    return digest.hexdigest()


def session_fingerprint(session: DecodingSession) -> str:
    """`model_fingerprint` of a session's target and drafter (what its caches were computed with)."""
    return model_fingerprint(session.target, getattr(session.proposer, "drafter", None))


@dataclass
class EncodedSession:
    """A session as `encode_session` left it for `write_session`: arrays evaluated, header made."""

    tokens: list[int]
    arrays: dict[str, mx.array]
    header: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def encode_session(session: DecodingSession, *, fingerprint: str,
                   metadata: dict[str, Any] | None = None) -> EncodedSession:
    """What `save_session` writes, on the session's own thread: its arrays evaluated there, so
    writing them (`write_session`) builds no graph on another thread's stream and may run on any."""
    proposer = session.proposer
    if proposer is not None and not isinstance(proposer, DFlashProposer):
        raise SessionFileError(f"a {type(proposer).__name__} session cannot be saved (only DFlash v1 drafters')")
    if len(session.tokens) < 1:
        raise SessionFileError("an empty session has nothing to save")
    session.settle()
    if proposer is not None:
        session.inject_pending()  # the drafter then holds every committed position
    arrays: dict[str, mx.array] = {}
    layout = {
        "target": [{"class": type(c).__name__, "state": _encode(c.state, f"t.{i}", arrays),
                    "meta": _encode(_meta_state(c), f"tm.{i}", arrays)} for i, c in enumerate(session.cache)],
        "draft": _encode_draft(proposer, arrays) if proposer is not None else None,
        "marks": [{"length": m.length, "states": {str(i): _encode(s, f"m.{k}.{i}", arrays)
                                                  for i, s in m.states.items()}}
                  for k, m in enumerate(session.marks)],
    }
    mx.eval(list(arrays.values()))
    header = {"format": FORMAT, "fingerprint": fingerprint, "tokens": json.dumps(session.tokens),
              "layout": json.dumps(layout), "metadata": json.dumps(metadata or {})}
    return EncodedSession(list(session.tokens), arrays, header)


def write_session(encoded: EncodedSession, path: str | Path) -> int:
    """Write an encoded session to `path`, whole or not at all; returns the file's size in bytes.
    Raises OSError (a full disk); no partial file is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer: two threads or processes writing the same key never share a temporary file.
    partial = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")
    try:
        with mx.stream(mx.cpu):  # the copies `save_safetensors` makes of strided views: off the decoding device
            mx.save_safetensors(str(partial), encoded.arrays, encoded.header)
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size


def save_session(session: DecodingSession, path: str | Path, *, fingerprint: str | None = None,
                 metadata: dict[str, Any] | None = None) -> int:
    """Write `session` to `path` (atomically); returns the file's size in bytes.
    `fingerprint` defaults to the session's own models' (`session_fingerprint`)."""
    if fingerprint is None:
        fingerprint = session_fingerprint(session)
    return write_session(encode_session(session, fingerprint=fingerprint, metadata=metadata), path)


def read_header(path: str | Path) -> SessionHeader:
    """The tokens, fingerprint and metadata of a session file, without reading its arrays."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > HEADER_LIMIT:
                raise ValueError(f"a header of {length} bytes")
            table = json.loads(f.read(length))
        meta = table.pop("__metadata__", None) or {}
        # A file cut short (a crash mid-copy, a full disk) is found here, before its arrays are read.
        end = 8 + length + max((entry["data_offsets"][1] for entry in table.values()), default=0)
        size = path.stat().st_size
        if size < end:
            raise ValueError(f"{size} bytes where its arrays end at {end}: cut short")
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {FORMAT!r}")
        return SessionHeader(json.loads(meta["tokens"]), meta["fingerprint"], json.loads(meta["metadata"]), size)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error) as e:
        raise SessionFileError(f"{path}: not a session file this version can read ({e})") from e


def load_session(path: str | Path, new_session: Callable[[], DecodingSession] | DecodingSession, *,
                 fingerprint: str | None = None) -> tuple[DecodingSession, dict[str, Any]]:
    """A session as `save_session` wrote it, built on `new_session()` (or on a fresh session
    given as it is); and the saved metadata. `fingerprint` defaults to that session's models'.
    Raises `SessionFileError` for a file of other models (fingerprint), or one that does not fit."""
    header = read_header(path)
    session = new_session if isinstance(new_session, DecodingSession) else None
    if fingerprint is None:
        session = session or new_session()
        fingerprint = session_fingerprint(session)
    if header.fingerprint != fingerprint:
        raise SessionFileError(f"{path}: saved with other models (or another dtype or quantization)")
    session = session or new_session()
    if session.tokens:
        raise SessionFileError("a session file loads into a fresh session only")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        layout = json.loads(meta["layout"])
        if len(layout["target"]) != len(session.cache):
            raise ValueError(f"{len(layout['target'])} target caches, not {len(session.cache)}")
        for c, saved in zip(session.cache, layout["target"], strict=True):
            if saved["class"] != type(c).__name__:
                raise ValueError(f"a {saved['class']} cache where this target has a {type(c).__name__}")
            c.state = _decode(saved["state"], arrays)
            saved_meta = _decode(saved["meta"], arrays)
            if saved_meta:
                c.meta_state = saved_meta
        if (layout["draft"] is None) != (session.proposer is None):
            raise ValueError("saved with a drafter" if session.proposer is None else "saved without a drafter")
        if layout["draft"] is not None:
            _decode_draft(session.proposer, layout["draft"], arrays)
        session.marks = [PrefixMark(m["length"], {int(i): _decode(s, arrays) for i, s in m["states"].items()})
                         for m in layout["marks"]]
        session.tokens = header.tokens
        offsets = {c.offset for c in session.cache if hasattr(c, "offset")}
        if offsets - {len(session.tokens) - 1}:
            raise ValueError(f"caches hold {sorted(offsets)} positions for {len(session.tokens)} tokens")
        mx.eval([a for _, a in tree_flatten([c.state for c in session.cache]) if isinstance(a, mx.array)])
    except SessionFileError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged file breaks, the caller gets one error
        raise SessionFileError(f"{path}: cannot be read into this session ({type(e).__name__}: {e})") from e
    if session.lookup is not None:
        session.lookup.sync(session.tokens)
    return session, header.metadata


def _meta_state(cache: Any) -> Any:
    try:
        return cache.meta_state
    except (AttributeError, NotImplementedError):
        return ""


def _encode(value: Any, key: str, arrays: dict[str, mx.array]) -> Any:
    """A JSON skeleton of a cache state: arrays go to `arrays` under their key."""
    if isinstance(value, mx.array):
        arrays[key] = value
        return {"array": key}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, f"{key}.{i}", arrays) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise SessionFileError(f"a cache state holding a {type(value).__name__} cannot be saved")


def _decode(skeleton: Any, arrays: dict[str, mx.array]) -> Any:
    if "array" in skeleton:
        return arrays[skeleton["array"]]
    if "list" in skeleton:
        return [_decode(v, arrays) for v in skeleton["list"]]
    if "tuple" in skeleton:
        return tuple(_decode(v, arrays) for v in skeleton["tuple"])
    return skeleton["value"]


def _encode_draft(proposer: DFlashProposer, arrays: dict[str, mx.array]) -> dict[str, Any]:
    cache = proposer.cache
    for i in range(len(cache.keys)):
        arrays[f"d.k.{i}"] = cache.keys[i][..., : cache.stored, :]
        arrays[f"d.v.{i}"] = cache.values[i][..., : cache.stored, :]
    return {"layers": len(cache.keys), "offset": cache.offset, "stored": cache.stored}


def _decode_draft(proposer: DFlashProposer, saved: dict[str, Any], arrays: dict[str, mx.array]) -> None:
    cache = proposer.cache
    if saved["layers"] and saved["layers"] != cache.num_layers:
        raise ValueError(f"a drafter of {saved['layers']} layers, not {cache.num_layers}")
    cache.dropped = saved["offset"] - saved["stored"]  # positions a window no longer held
    if saved["layers"]:
        cache.append([arrays[f"d.k.{i}"] for i in range(saved["layers"])],
                     [arrays[f"d.v.{i}"] for i in range(saved["layers"])])
    if cache.offset != saved["offset"]:
        raise ValueError(f"the drafter's context ends at {cache.offset}, not {saved['offset']}")
