"""Bad input to `dflash-mlx convert`: one clear line, non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from mlx.utils import tree_flatten


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    from mlx_dflash.cli.main import main

    monkeypatch.setattr(sys, "argv", ["dflash-mlx", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    return exc.value.code, err


def assert_refused(code: int, err: str, dst: Path, *needles: str) -> None:
    assert code not in (0, None), err
    assert "Traceback" not in err
    assert err.strip().startswith("error:") and len(err.strip().splitlines()) <= 3, err  # one line, maybe wrapped
    flat = " ".join(err.split())
    for needle in needles:
        assert needle in flat, flat
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")], "temp dir left behind"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_target(tiny_target("qwen3"), "qwen3", tmp_path_factory.mktemp("t") / "qwen3")


def copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


def test_converts_and_force_overwrites(monkeypatch, capsys, tmp_path, target_dir):
    dst = tmp_path / "out"
    code, err = run_cli(monkeypatch, capsys, "convert", str(target_dir), str(dst), "--dtype", "float16")
    assert code == 0, err
    assert json.loads((dst / "config.json").read_text())["mlx_dflash"]["options"]["dtype"] == "float16"
    assert mx.load(str(dst / "model.safetensors"))["model.norm.weight"].dtype == mx.float16
    code, err = run_cli(monkeypatch, capsys, "convert", str(target_dir), str(dst), "--force")
    assert code == 0, err
    assert mx.load(str(dst / "model.safetensors"))["model.norm.weight"].dtype == mx.float32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_missing_config(monkeypatch, capsys, tmp_path, target_dir):
    src = copy_dir(target_dir, tmp_path / "src")
    (src / "config.json").unlink()
    code, err = run_cli(monkeypatch, capsys, "convert", str(src), str(tmp_path / "out"))
    assert_refused(code, err, tmp_path / "out", "missing config.json")


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_bad_safetensors(monkeypatch, capsys, tmp_path, target_dir, damage):
    src = copy_dir(target_dir, tmp_path / "src")
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x13\x00garbage" * 100)
    code, err = run_cli(monkeypatch, capsys, "convert", str(src), str(tmp_path / "out"))
    assert_refused(code, err, tmp_path / "out", "model.safetensors", "corrupt or truncated safetensors")


def test_shape_mismatch_against_config(monkeypatch, capsys, tmp_path, target_dir):
    src = copy_dir(target_dir, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(config))
    code, err = run_cli(monkeypatch, capsys, "convert", str(src), str(tmp_path / "out"))
    assert_refused(code, err, tmp_path / "out", "mlp.gate_proj.weight has shape (128, 64)", "implies (96, 64)")


def test_unsupported_architecture(monkeypatch, capsys, tmp_path, target_dir):
    src = copy_dir(target_dir, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "no_such_llm"
    (src / "config.json").write_text(json.dumps(config))
    code, err = run_cli(monkeypatch, capsys, "convert", str(src), str(tmp_path / "out"))
    assert_refused(code, err, tmp_path / "out", "unsupported architecture 'no_such_llm'")


class NeedsCode:
    """Unpickling this needs the class: code execution, which weights_only refuses."""

    def __init__(self):
        self.payload = [1, 2, 3]


def test_pickle_that_needs_code_is_refused(monkeypatch, capsys, tmp_path, target_dir):
    torch = pytest.importorskip("torch", reason="needs the torch extra")
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((target_dir / "config.json").read_text())
    torch.save({"model.norm.weight": torch.ones(64), "extra": NeedsCode()}, src / "pytorch_model.bin")
    code, err = run_cli(monkeypatch, capsys, "convert", str(src), str(tmp_path / "out"))
    assert_refused(code, err, tmp_path / "out", "pytorch_model.bin", "refused", "code execution")


def test_destination_exists(monkeypatch, capsys, tmp_path, target_dir):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, err = run_cli(monkeypatch, capsys, "convert", str(target_dir), str(dst))
    assert code == 1 and "already exists" in err and "--force" in err and "Traceback" not in err
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


def test_unknown_short_name(monkeypatch, capsys, tmp_path):
    code, err = run_cli(monkeypatch, capsys, "convert", "Qwen3-9B", str(tmp_path / "out"))
    assert_refused(code, err, tmp_path / "out", "unknown model short name 'Qwen3-9B'", "did you mean")


def test_incompatible_drafter_target_pair(monkeypatch, capsys, tmp_path):
    other = tiny_target("llama", num_layers=4)
    drafter = tiny_drafter(other)
    src = save_drafter(drafter, drafter_config(other), tmp_path / "drafter")
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    (narrow / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 32, "vocab_size": 128,
                                                   "num_hidden_layers": 4}))
    code, err = run_cli(monkeypatch, capsys, "convert", str(src), str(tmp_path / "out"), "--target", str(narrow))
    assert_refused(code, err, tmp_path / "out", "drafter hidden size 64 != target narrow hidden size 32")


@pytest.mark.parametrize("failure", ["no_space", "permission", "interrupt"])
def test_write_failure_leaves_nothing(monkeypatch, capsys, tmp_path, target_dir, failure):
    def broken_save(path, arrays, metadata=None):
        Path(path).write_bytes(b"partial")  # something is on disk when the failure hits
        if failure == "interrupt":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC if failure == "no_space" else errno.EACCES, "simulated")

    monkeypatch.setattr(mx, "save_safetensors", broken_save)
    dst = tmp_path / "out"
    code, err = run_cli(monkeypatch, capsys, "convert", str(target_dir), str(dst))
    if failure == "interrupt":
        assert code == 130 and not dst.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
        return
    message = "no space left on device" if failure == "no_space" else "permission denied"
    assert_refused(code, err, dst, f"cannot write {dst}", message)


def test_drafter_converts_and_roundtrips_its_weights(monkeypatch, capsys, tmp_path, target_dir):
    from mlx_dflash import load_drafter

    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    src = save_drafter(drafter, drafter_config(target), tmp_path / "drafter")
    dst = tmp_path / "out"
    code, err = run_cli(monkeypatch, capsys, "convert", str(src), str(dst), "--target", str(target_dir),
                        "-q", "--q-bits", "4", "--q-group-size", "32")
    assert code == 0, err
    loaded = load_drafter(dst)
    assert loaded.layers[0].mlp.up_proj.bits == 4 and not hasattr(loaded.fc, "scales")
    assert dict(tree_flatten(loaded.fc.parameters()))["weight"].tolist() == drafter.fc.weight.tolist()
