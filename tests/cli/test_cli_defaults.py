"""Every command that takes --model defaults to the embedded pair as chat does; GGUF targets are stored
as float32 on the CPU; no user-facing message loses bracketed text to Rich markup."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from helpers.tiny_gguf import write_llama_gguf
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

from mlx_dflash.loading import resolve
from mlx_dflash.platform.files import CACHE_ENV

_register()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", root / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), root / "drafter")
    return target, drafter


@pytest.fixture
def embedded(pair, monkeypatch):
    """The embedded default pair, played by the tiny pair (the real one is tested in test_resolve)."""
    target, drafter = pair
    monkeypatch.setattr(resolve, "embedded_default_target", lambda: Path(target))
    monkeypatch.setattr(resolve, "embedded_default_drafter", lambda: Path(drafter))
    return pair


def _generate(*args: str) -> dict:
    result = CliRunner().invoke(app, ["generate", "--prompt-ids", "1,2,3", "--max-tokens", "12", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_without_model_uses_the_embedded_pair(embedded):
    target, drafter = embedded
    default = _generate()
    assert default["draft"] is True
    explicit = _generate("--model", str(target), "--draft", str(drafter))
    same = ("token_ids", "text", "finish_reason", "prompt_tokens", "draft", "block_size")
    assert {k: default[k] for k in same} == {k: explicit[k] for k in same}
    plain = _generate("--no-draft")
    assert plain["draft"] is False and plain["token_ids"] == default["token_ids"]
    assert default["prompt_lookup"] is True and plain["prompt_lookup"] is False  # --no-draft: the target alone
    assert set(plain["block_size_histogram"]) == {"1"} and plain["accepted_by_source"] == {}
    looked_up = _generate("--no-draft", "--lookup")
    assert looked_up["prompt_lookup"] is True and looked_up["token_ids"] == default["token_ids"]
    assert set(looked_up["accepted_by_source"]) <= {"lookup"}
    assert _generate("--no-lookup")["prompt_lookup"] is False


def test_bench_without_model_uses_the_embedded_pair(embedded, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say something.\nCount to three.\n")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--dataset", str(prompts), "--limit", "1", "--max-tokens", "6",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and any(m.startswith("dflash") for m in doc["config"]["modes"])
    assert "--model" not in doc["command"]  # the command reproduces the run as given


def test_choose_pair_rules(embedded):
    target, drafter = embedded
    assert resolve.choose_pair(None, None).draft == str(drafter)
    assert resolve.choose_pair(None, None, no_draft=True).draft is None
    given = resolve.choose_pair(str(target), None)
    assert given.draft is None and given.warnings and given.source == "as given"
    short = resolve.choose_pair("Qwen3-8B", None)
    assert short.draft == "z-lab/Qwen3-8B-DFlash-b16" and short.target == "Qwen3-8B"


def test_a_gguf_target_is_stored_as_float32_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 3}
    gguf_file = write_llama_gguf(tmp_path / "m.gguf", meta, 4)
    entry = resolve.target_source(gguf_file)
    options = json.loads((entry / "config.json").read_text())["mlx_dflash"]["options"]
    assert options["dtype"] == "float32" and options["dequantize"] is True
    assert resolve.target_source(gguf_file) == entry  # converted once


def _run(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    from mlx_dflash.cli.main import main

    monkeypatch.setattr(sys, "argv", ["dflash-mlx", *args])
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


def test_bracketed_paths_and_extras_survive_the_error_path(monkeypatch, capsys, tmp_path):
    missing = tmp_path / "[bracketed]" / "model"
    code, err = _run(monkeypatch, capsys, "generate", "-m", str(missing), "-p", "hi")
    assert code == 1 and str(missing) in "".join(err.splitlines()), err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an install without the report extra
    code, err = _run(monkeypatch, capsys, "bench", "--report", str(tmp_path / "r"))
    assert code == 1 and "pip install 'mlx-dflash[report]'" in " ".join(err.split()), err


def test_bracketed_paths_survive_in_chat_and_convert_output(pair, monkeypatch, capsys, tmp_path):
    target, drafter = pair
    odd = tmp_path / "[odd] dir"
    odd.mkdir()
    dst = odd / "[v1]"
    code, err = _run(monkeypatch, capsys, "convert", str(target), str(dst))
    assert code in (0, None) and str(dst) in "".join(err.splitlines()), err
    # mlx-lm finds weights with glob, so it cannot load from such a path: said plainly.
    code, err = _run(monkeypatch, capsys, "generate", "-m", str(dst), "-p", "hi")
    assert code == 1 and "glob" in err and "[v1]" in err, err
    saved = odd / "[chat].json"
    result = CliRunner().invoke(app, ["chat", "--model", str(target), "--draft", str(drafter), "--max-tokens", "2"],
                                input=f"hi\n/save {saved}\n")
    assert result.exit_code == 0, result.output
    assert str(saved) in "".join(result.output.splitlines()) and saved.is_file()
