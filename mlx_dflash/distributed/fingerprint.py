"""What a rank is about to run, described cheaply enough to compare before any weights load.

A description holds the package versions, each model directory's config.json, a hash of
each of its tokenizer files, and a fingerprint of each safetensors file: its name, its size
and a hash of its header (tensor names, dtypes, shapes and offsets, read as the 8-byte
little-endian length and the JSON after it). The tensor data is never read, so describing a
100 GB checkpoint takes milliseconds; the price is that two files whose tensors have equal
names, dtypes and shapes but different values (another fine-tune of the same architecture,
a flipped byte) fingerprint the same.

Nothing here raises on a bad file: a missing or unreadable file is described as such, so
that ranks compare it like any other difference instead of one rank failing alone while the
others wait for it in a collective.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import struct
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("mlx", "mlx-lm", "mlx-dflash")
TOKENIZER_PATTERNS = ("tokenizer*", "vocab.*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                      "chat_template*", "generation_config.json", "*.tiktoken", "spiece.model")
# The converted cache's provenance block (`mlx_dflash` in config.json) names the source's absolute
# path, which differs between machines holding the same conversion; the weights are compared anyway.
PROVENANCE_KEY = "mlx_dflash"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


def installed_versions() -> dict[str, str]:
    """The installed version of each package in `PACKAGES` ("not installed" where absent)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    if versions["mlx-dflash"] == "not installed":  # run from a source tree
        from ..version import __version__

        versions["mlx-dflash"] = __version__
    return versions


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def safetensors_header_digest(path: Path) -> str:
    """A hash of the file's safetensors header (canonical JSON: key order and padding do not count),
    or a short note saying why there is none. Reads at most the header, never the tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return "unreadable: shorter than a safetensors header"
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, MAX_HEADER_BYTES):
                return "unreadable: header length past the end of the file"
            header = json.loads(f.read(length))
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "unreadable: header is not JSON"
    return _sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())


def weight_fingerprint(directory: Path) -> dict[str, dict[str, Any]]:
    """For each *.safetensors file: {name: {"size": bytes, "header": `safetensors_header_digest`}}."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        try:
            size = path.stat().st_size
        except OSError:
            size = -1
        out[path.name] = {"size": size, "header": safetensors_header_digest(path)}
    return out


def tokenizer_digests(directory: Path) -> dict[str, str]:
    """A hash of each tokenizer file (`TOKENIZER_PATTERNS`), by name."""
    out = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in TOKENIZER_PATTERNS):
            try:
                out[path.name] = _sha256(path.read_bytes())
            except OSError as e:
                out[path.name] = f"unreadable: {e.strerror or e}"
    return out


def model_config(directory: Path) -> dict[str, Any] | str:
    """config.json's content without the converted cache's provenance block, or why it is unusable."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        return "missing"
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return "unreadable"
    if not isinstance(config, dict):
        return "not a JSON object"
    config.pop(PROVENANCE_KEY, None)
    return config


def describe_model(directory: Path) -> dict[str, Any]:
    """One model directory: its config, tokenizer file hashes and weight fingerprint."""
    if not directory.is_dir():
        return {"config": "no such directory", "tokenizer": {}, "weights": {}}
    return {"config": model_config(directory), "tokenizer": tokenizer_digests(directory),
            "weights": weight_fingerprint(directory)}


def describe(target: Path, drafter: Path | None = None) -> dict[str, Any]:
    """What this process is about to run: package versions, the target and the drafter (None: no drafter)."""
    return {"versions": installed_versions(), "target": describe_model(target),
            "drafter": describe_model(drafter) if drafter is not None else None}


def canonical(description: dict[str, Any]) -> str:
    """The description as one canonical JSON text (equal descriptions, equal texts)."""
    return json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
