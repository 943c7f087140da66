"""The training corpus on disk: shards of token ids and a manifest; written where MLX is, read where PyTorch is.

A corpus folder holds `manifest.json` and shards `shard-NNNNN.npz` (np.savez_compressed).
A shard holds some prompts (token ids, and their ids in the corpus plan) and the target's
replies to them (token ids, the prompt each answers, its sample number: 0 greedy, 1.. sampled,
and the stop token that ended it or -1 at the length limit). Token ids are uint16 when the
vocabulary fits, else int32; sequences are stored flat with int64 offsets.

Writes are atomic (a temporary file, fsync, rename, fsync of the folder), and a shard
is written before the manifest that lists it: whenever a run is killed, every listed shard is
whole and matches its sha256, and a shard the manifest does not list is not part of the corpus.
`reused_replies` is what `torch_job run --replies` reads: a corpus (checked against the job) or
a run's replies.npz. This module needs numpy only (no MLX, no PyTorch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DFlashError
from .job_files import file_sha256, pack, read_replies, unpack

MANIFEST = "manifest.json"
FORMAT = "mlx-dflash-corpus/1"
TMP_SUFFIX = ".tmp"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npz"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every id fits (SmolLM2's 49,152 do), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


@dataclass
class Shard:
    """One shard's prompts and replies (reply i answers prompts[reply_prompt[i]])."""

    prompt_ids: list[int]
    prompts: list[list[int]]
    reply_prompt: list[int]
    reply_sample: list[int]
    replies: list[list[int]]
    reply_stop: list[int | None]

    @property
    def reply_tokens(self) -> int:
        return sum(len(r) for r in self.replies)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_atomically(tmp: Path, final: Path) -> None:
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_shard(folder: Path, index: int, shard: Shard, vocab_size: int) -> tuple[str, str, int]:
    """Write shard `index` atomically; returns (file name, sha256, bytes)."""
    dtype = token_dtype(vocab_size)
    p_flat, p_off = pack(shard.prompts)
    r_flat, r_off = pack(shard.replies)
    for flat in (p_flat, r_flat):
        if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
            raise DFlashError(f"a token id is outside the vocabulary of {vocab_size}")
    name = shard_name(index)
    final = folder / name
    tmp = folder / (name + TMP_SUFFIX)
    with tmp.open("wb") as f:
        np.savez_compressed(
            f, prompt_ids=np.asarray(shard.prompt_ids, dtype=np.int32), prompt_tokens=p_flat.astype(dtype),
            prompt_offsets=p_off, reply_prompt=np.asarray(shard.reply_prompt, dtype=np.int32),
            reply_sample=np.asarray(shard.reply_sample, dtype=np.int16), reply_tokens=r_flat.astype(dtype),
            reply_offsets=r_off, reply_stop=np.array([-1 if s is None else s for s in shard.reply_stop],
                                                     dtype=np.int32))
    _replace_atomically(tmp, final)
    return name, file_sha256(final), final.stat().st_size


def _offsets_ok(offsets: np.ndarray, flat: np.ndarray, count: int) -> bool:
    return (offsets.shape == (count + 1,) and int(offsets[0]) == 0 and int(offsets[-1]) == flat.size
            and bool(np.all(np.diff(offsets) >= 0)))


def read_shard(path: Path, sha256: str | None = None) -> Shard:
    """A shard, its sha256 checked first when given; DFlashError if it is not one this module wrote."""
    if sha256 is not None:
        if not path.is_file():
            raise DFlashError(f"{path}: listed in the manifest but missing")
        if file_sha256(path) != sha256:
            raise DFlashError(f"{path}: sha256 differs from the manifest's (damaged or replaced)")
    try:
        with np.load(path) as z:
            a = {k: z[k] for k in z.files}
        n, m = a["prompt_ids"].size, a["reply_prompt"].size
        ok = (_offsets_ok(a["prompt_offsets"], a["prompt_tokens"], n)
              and _offsets_ok(a["reply_offsets"], a["reply_tokens"], m)
              and a["reply_sample"].size == a["reply_stop"].size == m
              and (m == 0 or (a["reply_prompt"].min() >= 0 and a["reply_prompt"].max() < n)))
    except (OSError, KeyError, ValueError) as e:
        raise DFlashError(f"{path}: not a corpus shard ({e})") from None
    if not ok:
        raise DFlashError(f"{path}: not a corpus shard (inconsistent offsets or indices)")
    return Shard(prompt_ids=a["prompt_ids"].tolist(), prompts=unpack(a["prompt_tokens"], a["prompt_offsets"]),
                 reply_prompt=a["reply_prompt"].tolist(), reply_sample=a["reply_sample"].tolist(),
                 replies=unpack(a["reply_tokens"], a["reply_offsets"]),
                 reply_stop=[None if s < 0 else int(s) for s in a["reply_stop"].tolist()])


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Replace manifest.json atomically."""
    tmp = folder / (MANIFEST + TMP_SUFFIX)
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    _replace_atomically(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"{folder}: not a corpus folder ({e})") from None
    if manifest.get("format") != FORMAT:
        raise DFlashError(f"{folder}: manifest format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def is_corpus(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def read_corpus(folder: str | Path) -> tuple[dict[str, Any], list[list[int]], list[tuple[list[int], int | None]]]:
    """(manifest, prompt of each reply, (reply, stop token or None)) over every listed shard, sha256-checked.

    The pairs are those a run's replies.npz holds: a prompt with several replies appears once per reply.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    prompts: list[list[int]] = []
    replies: list[tuple[list[int], int | None]] = []
    for entry in manifest["shards"]:
        shard = read_shard(folder / entry["file"], entry["sha256"])
        if len(shard.replies) != entry["replies"] or shard.reply_tokens != entry["reply_tokens"]:
            raise DFlashError(f"{folder / entry['file']}: its counts differ from the manifest's")
        for p, reply, stop in zip(shard.reply_prompt, shard.replies, shard.reply_stop, strict=True):
            prompts.append(shard.prompts[p])
            replies.append((reply, stop))
    return manifest, prompts, replies


def totals(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's totals over its shard entries."""
    keys = ("prompts", "replies", "prompt_tokens", "reply_tokens", "bytes")
    out: dict[str, Any] = {"shards": len(shards), **{k: sum(int(s[k]) for s in shards) for k in keys}}
    out["seconds"] = round(sum(float(s["seconds"]) for s in shards), 1)
    return out


def write_corpus(folder: str | Path, prompts: Sequence[Sequence[int]], replies: Sequence[tuple[list[int], int | None]],
                 *, vocab_size: int, shard_prompts: int, info: dict[str, Any]) -> dict[str, Any]:
    """A corpus of given (prompt, (reply, stop)) pairs, replies grouped under their prompt (first seen first).

    For corpora made elsewhere than by `corpus make` (the smoke run's); `info` goes into the manifest
    as it is (it should hold `stop`, and `target` with `sha256` where known).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[int, ...], list[tuple[list[int], int | None]]] = {}
    for prompt, reply in zip(prompts, replies, strict=True):
        groups.setdefault(tuple(prompt), []).append(reply)
    keys = list(groups)
    entries = []
    for index, start in enumerate(range(0, len(keys), shard_prompts)):
        shard = Shard(prompt_ids=list(range(start, start + len(keys[start:start + shard_prompts]))), prompts=[],
                      reply_prompt=[], reply_sample=[], replies=[], reply_stop=[])
        for j, key in enumerate(keys[start:start + shard_prompts]):
            shard.prompts.append(list(key))
            for sample, (reply, stop) in enumerate(groups[key]):
                shard.reply_prompt.append(j)
                shard.reply_sample.append(sample)
                shard.replies.append(list(reply))
                shard.reply_stop.append(stop)
        name, sha, size = write_shard(folder, index, shard, vocab_size)
        entries.append({"index": index, "file": name, "prompts": len(shard.prompts), "replies": len(shard.replies),
                        "prompt_tokens": sum(map(len, shard.prompts)), "reply_tokens": shard.reply_tokens,
                        "bytes": size, "sha256": sha, "seconds": 0.0})
    manifest = {"format": FORMAT, **info, "shards": entries, "totals": totals(entries)}
    write_manifest(folder, manifest)
    return manifest


def _check_corpus(manifest: dict[str, Any], job: dict[str, Any], where: str) -> None:
    """Refuse a corpus made by another target, with other stop tokens or another held-out split than the job's."""
    corpus_target = manifest.get("target", {}).get("sha256")
    if job.get("target_sha256") and corpus_target and corpus_target != job["target_sha256"]:
        raise DFlashError(f"{where}: made with another target than the job's (sha256 differs)")
    if sorted(manifest.get("stop", [])) != sorted(job["stop"]):
        raise DFlashError(f"{where}: stop tokens {manifest.get('stop')}, the job's are {job['stop']}")
    split = manifest.get("prompts", {})
    theirs = {"seed": split.get("split_seed"), "heldout": split.get("heldout"),
              "data": [d["file"] for d in manifest["data"]] if "data" in manifest else None}
    for key, value in theirs.items():
        if value is not None and key in job and job[key] != value:
            raise DFlashError(f"{where}: made with {key} {value!r}, the job with {job[key]!r} "
                              "(held-out conversations could leak into training)")


def reused_replies(source: str, job: dict[str, Any], eval_prompts: Sequence[Sequence[int]], log: Callable[[str], None]
                   ) -> tuple[list[list[int]], list[tuple[list[int], int | None]], bool]:
    """(prompts, replies, whether they come from a corpus folder) of `--replies`: none, a replies.npz or a corpus.

    A corpus is checked against the job (`_check_corpus`) and shard by shard against its manifest's
    sha256; replies to a held-out prompt are left out.
    """
    if not source:
        return [], [], False
    path = Path(source)
    if not is_corpus(path):
        prompts, replies = read_replies(path)
        return prompts, replies, False
    manifest, prompts, replies = read_corpus(path)
    _check_corpus(manifest, job, str(path))
    held = {tuple(p) for p in eval_prompts}
    keep = [i for i, p in enumerate(prompts) if tuple(p) not in held]
    log(f"corpus: {path}, {len(manifest['shards'])} shards (sha256 checked), {len(keep)} replies, "
        f"{sum(len(replies[i][0]) for i in keep)} reply tokens; {len(prompts) - len(keep)} to held-out prompts "
        "left out")
    return [prompts[i] for i in keep], [replies[i] for i in keep], True
