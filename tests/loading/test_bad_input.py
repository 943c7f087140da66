"""Bad input fails with one clear sentence: mismatched pairs, broken files, empty prompts, bad flags.

Library errors are `DFlashError` (mismatches: `IncompatibleDrafterError`); the
CLI turns them into one `error:` line on stderr and a non-zero exit, never a
traceback. The CLI cases run the real `dflash-mlx` entry point in a
subprocess where it matters, and `main()` in-process for the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_target

from mlx_dflash import DFlashError, IncompatibleDrafterError, load, load_drafter, stream_generate
from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs
from mlx_dflash.targets.model import TargetModel

# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A saved tiny qwen3 target and a matching drafter (directories)."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target("qwen3", seed=0)
    config = drafter_config(target)
    drafter = DFlashDraftModel(ModelArgs.from_dict(config))
    return target, save_target(target, "qwen3", root / "target"), save_drafter(drafter, config, root / "drafter")


def save_variant(tmp_path: Path, target, name: str, **changes) -> Path:
    """A self-consistent drafter (weights match its config) whose config differs as given."""
    config = drafter_config(target)
    dflash = changes.pop("dflash_config", {})
    config.update(changes)
    config["dflash_config"].update(dflash)
    model = DFlashDraftModel(ModelArgs.from_dict(config))
    return save_drafter(model, config, tmp_path / name)


def broken_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if how == "no config":
        (dst / "config.json").unlink()
    elif how == "invalid json":
        (dst / "config.json").write_text('{"model_type": "qwen3", ')
    elif how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "garbage weights":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    elif how == "no weights":
        weights.unlink()
    elif how in ("missing key", "wrong shape"):
        tensors = mx.load(str(weights))
        key = "norm.weight" if "norm.weight" in tensors else "model.norm.weight"
        if how == "missing key":
            del tensors[key]
        else:
            tensors[key] = mx.zeros((3,))
        mx.save_safetensors(str(weights), tensors)
    else:
        raise AssertionError(how)
    return dst


# ------------------------------------------------------- drafter/target mismatch


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(hidden_size=32, head_dim=8), ["hidden size", "32", "64"]),
        (dict(vocab_size=200), ["vocabulary", "200", "128"]),
        (dict(dflash_config={"target_layer_ids": [1, 7]}), ["target_layer_ids", "7", "4 layers"]),
        (dict(dflash_config={"mask_token_id": 500}), ["mask_token_id", "500", "128"]),
    ],
    ids=["hidden", "vocab", "layers", "mask"],
)
def test_incompatible_drafter(pair, tmp_path, changes, words):
    target_model, target_dir, _ = pair
    path = save_variant(tmp_path, target_model, "drafter", **changes)
    for attempt in (lambda: load_drafter(path, TargetModel(target_model)),
                    lambda: load(target_dir, path)):
        with pytest.raises(IncompatibleDrafterError) as info:
            attempt()
        message = str(info.value)
        assert "\n" not in message
        # One sentence naming both sides and what disagrees.
        assert "drafter" in message and "target" in message, message
        for word in words:
            assert word in message, message


@pytest.mark.parametrize("how", ["no config", "invalid json", "truncated weights", "garbage weights",
                                 "no weights", "missing key", "wrong shape"])
def test_broken_drafter_files(pair, tmp_path, how):
    target_model, target_dir, drafter_dir = pair
    broken = broken_copy(drafter_dir, tmp_path / "drafter", how)
    with pytest.raises(DFlashError) as info:
        load_drafter(broken, TargetModel(target_model))
    message = str(info.value)
    assert str(broken) in message and "\n" not in message, message
    if how in ("missing key", "wrong shape"):
        assert "norm.weight" in message
    with pytest.raises(DFlashError):
        load(target_dir, broken)


@pytest.mark.parametrize("how", ["no config", "invalid json", "truncated weights", "garbage weights",
                                 "no weights", "missing key", "wrong shape"])
def test_broken_target_files(pair, tmp_path, how):
    _, target_dir, drafter_dir = pair
    broken = broken_copy(target_dir, tmp_path / "target", how)
    with pytest.raises(DFlashError) as info:
        load(broken, drafter_dir)
    message = str(info.value)
    assert str(broken) in message and "\n" not in message, message
    if how in ("missing key", "wrong shape"):
        assert "norm.weight" in message, message


def test_not_a_drafter(pair, tmp_path):
    target_model, _, drafter_dir = pair
    for name, edit in [("no dflash_config", lambda c: c.pop("dflash_config")),
                       ("no hidden_size", lambda c: c.pop("hidden_size")),
                       ("no mask id", lambda c: c["dflash_config"].pop("mask_token_id"))]:
        path = shutil.copytree(drafter_dir, tmp_path / name.replace(" ", "_"))
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(DFlashError):
            load_drafter(path, TargetModel(target_model))


def test_missing_paths(tmp_path):
    with pytest.raises(DFlashError, match="no such directory"):
        load(tmp_path / "nothing-here")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DFlashError):
        load(tmp_path / "file")
    with pytest.raises(DFlashError):
        load_drafter(tmp_path / "nothing-here")
    with pytest.raises(DFlashError):
        load("qwen3", dtype="float64")


# ------------------------------------------------------- the generation API


def test_empty_prompt_and_bad_options(targets, drafters, tokenizer):
    model, drafter = targets("qwen3"), drafters("qwen3")
    for prompt in ([], ""):
        with pytest.raises(DFlashError, match="empty"):
            list(stream_generate(model, tokenizer, prompt, draft_model=drafter))
    with pytest.raises(DFlashError, match="max_tokens"):
        list(stream_generate(model, tokenizer, [5, 6], max_tokens=-1))
    with pytest.raises(DFlashError, match="block size"):
        list(stream_generate(model, tokenizer, [5, 6], draft_model=drafter, block_size=0))
    with pytest.raises(ValueError, match="window"):
        list(stream_generate(model, tokenizer, [5, 6], draft_model=drafter, draft_window=0))
    assert list(stream_generate(model, tokenizer, [5, 6], max_tokens=0)) == []


# ------------------------------------------------------- the CLI


def entry_point() -> list[str]:
    script = Path(sys.executable).with_name("dflash-mlx")
    if script.exists():
        return [str(script)]
    found = shutil.which("dflash-mlx")
    return [found] if found else [sys.executable, "-c", "from mlx_dflash.cli.main import main; main()"]


def run_cli(*args: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                       MLX_DFLASH_CACHE=str(tmp_path / "dflash-cache"), COLUMNS="200", NO_COLOR="1")
    environment.update(env or {})
    return subprocess.run(entry_point() + list(args), capture_output=True, text=True, timeout=120,
                          env=environment)


def in_process_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`main()` as the entry point runs it, with argv patched; returns (exit code, stdout, stderr)."""
    from mlx_dflash.cli.main import main

    saved = sys.argv
    sys.argv = ["dflash-mlx", *args]
    try:
        with pytest.raises(SystemExit) as info:
            main()
            raise SystemExit(0)
    finally:
        sys.argv = saved
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else (0 if code is None else 1)), out, err


def assert_one_error_line(code: int, out: str, err: str, *words: str) -> None:
    assert code != 0
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for word in words:
        assert word in errors[0], err


@pytest.mark.cli
def test_cli_unknown_model_and_empty_prompt(pair, tmp_path):
    _, target_dir, drafter_dir = pair
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", tmp_path=tmp_path)
    assert_one_error_line(result.returncode, result.stdout, result.stderr, str(tmp_path / "missing"))
    result = run_cli("generate", "--model", str(target_dir), "--draft", str(drafter_dir), "--prompt", "",
                     tmp_path=tmp_path)
    assert_one_error_line(result.returncode, result.stdout, result.stderr, "empty")


@pytest.mark.cli
def test_cli_invalid_flag(tmp_path):
    result = run_cli("generate", "--model", "x", "--bogus-flag", tmp_path=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    # Click's usage error: the problem is named on one line of stderr.
    assert [line for line in result.stderr.splitlines() if "No such option" in line and "--bogus-flag" in line]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "{missing}", "--prompt", "hi"], ["{missing}"]),
        (["--model", "org/not-cached-anywhere", "--prompt", "hi"], ["org/not-cached-anywhere"]),
        (["--model", "{target}", "--prompt-ids", ""], ["prompt"]),
        (["--model", "{target}", "--prompt-ids", "1,x,3"], ["--prompt-ids"]),
        (["--model", "{target}", "--prompt", "hi", "--prompt-ids", "1"], ["exactly one"]),
        (["--model", "{target}", "--draft", "{bad_drafter}", "--prompt", "hi"], ["hidden size"]),
        (["--model", "{target}", "--draft", "{missing}", "--prompt", "hi"], ["{missing}"]),
        (["--model", "{target}", "--prompt", "hi", "--dtype", "float64"], ["dtype"]),
    ],
    ids=["missing-dir", "missing-repo", "empty-ids", "bad-ids", "both-prompts", "mismatch", "missing-drafter",
         "dtype"],
)
def test_cli_errors_in_process(pair, tmp_path, capsys, monkeypatch, args, words):
    target_model, target_dir, _ = pair
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path / "dflash-cache"))
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    names = dict(missing=str(tmp_path / "missing"), target=str(target_dir),
                 bad_drafter=str(save_variant(tmp_path, target_model, "bad", hidden_size=32, head_dim=8)))
    code, out, err = in_process_cli(capsys, "generate", *[a.format(**names) for a in args])
    assert_one_error_line(code, out, err, *[w.format(**names) for w in words])


@pytest.mark.parametrize("args", [["generate", "--model", "x", "--max-tokens", "0"],
                                  ["generate", "--model", "x", "--temp", "-1"],
                                  ["generate", "--model", "x", "--block-size", "0"],
                                  ["generate", "--model", "x", "--block-size", "big"],
                                  ["generate", "--temp", "warm"],
                                  ["no-such-command"]])
def test_cli_usage_errors_in_process(capsys, args):
    code, out, err = in_process_cli(capsys, *args)
    assert code == 2
    assert "Traceback" not in out + err
    assert "Usage:" in err


def test_a_half_precision_moe_target_on_the_cpu_is_refused_with_a_reason(tmp_path):
    """MLX's CPU mixture-of-experts matmul is float32-only: `--dtype bfloat16` gets a clear error there,
    never MLX's raw one (where a backend computes it, the model simply loads)."""
    path = save_target(tiny_target("qwen3_moe"), "qwen3_moe", tmp_path / "moe")
    try:
        load(str(path), dtype="bfloat16")
    except DFlashError as e:
        assert "float32 only" in str(e) and "--dtype" in str(e)
