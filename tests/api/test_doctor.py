"""`dflash-mlx doctor`: one report of the device, the kernels' self-checks, losslessness and speed;
exit status 1 when a check failed (so a broken kernel, a broken engine or a broken load show)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import mlx.core as mx
import pytest
from helpers.emulate_metal import EmulatedKernel, compiler_available
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

from mlx_dflash import doctor, kernels
from mlx_dflash.kernels import _common, self_check

_register()


def test_doctor_json_runs_here_and_names_its_checks():
    result = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "doctor", "--json", "--no-speed"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["failed"] == []
    env = report["environment"]
    assert env["versions"]["mlx"] == mx.__version__ and env["backend"] in ("cpu", "metal", "cuda")
    assert env["memory_bytes"] > 0
    assert {k["kernel"] for k in report["kernels"]} == {"dflash_context_kv", "dflash_block_qk"}
    assert [c["dtype"] for c in report["lossless"]] == ["float32", "float16"]  # this CPU's default, then float16
    assert all(c["passed"] and len(c["cases"]) == 6 for c in report["lossless"])
    assert report["speed"] == {"skipped": "--no-speed"}


def test_the_speed_check_runs_a_given_pair(tmp_path):
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", tmp_path / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), tmp_path / "drafter")
    result = CliRunner().invoke(app, ["doctor", "--json", "--model", str(target), "--draft", str(drafter),
                                      "--tokens", "12"])
    assert result.exit_code == 0, result.output
    speed = json.loads(result.stdout)["speed"]
    assert speed["target"]["tokens"] == speed["dflash"]["tokens"] == 12
    assert speed["same_tokens"] is True
    # The ratio of the two runs' reported rates (each measured, so only their ratio can be checked).
    rates = speed["dflash"]["tok_per_s"], speed["target"]["tok_per_s"]
    assert min(rates) > 0 and speed["speedup"] == pytest.approx(rates[0] / rates[1], abs=2e-3)
    assert speed["dflash"]["tau"] >= 1.0 and speed["prompt_tokens"] > 0
    assert sum(speed["target"]["block_sizes"].values()) >= 11  # the target alone: plain steps only
    assert set(speed["target"]["block_sizes"]) == {"1"}


def test_a_model_that_does_not_load_fails_the_report(tmp_path):
    result = CliRunner().invoke(app, ["doctor", "--json", "--model", str(tmp_path / "missing"), "--tokens", "8"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["failed"] == ["speed"] and "error" in report["speed"]


def test_a_lossless_failure_is_caught_and_a_near_tie_is_not_called_one(monkeypatch):
    real = doctor.stream_generate

    def corrupted(model, tokenizer, prompt, **kwargs):
        for event in real(model, tokenizer, prompt, **kwargs):
            if kwargs.get("draft_model") is not None and event.tokens:
                event.tokens = [(event.tokens[0] + 1) % doctor.FIXTURE_VOCAB] + event.tokens[1:]
            yield event

    monkeypatch.setattr(doctor, "stream_generate", corrupted)
    check = doctor.lossless_check(mx.float32)
    assert check["passed"] is False
    case = check["cases"][0]
    assert case["identical"] is False and case["position"] == 0
    assert case["near_tie"] is False and case["top2_gap"] > case["near_tie_bound"]

    import mlx_dflash.cli.doctor_cmd as doctor_cmd

    monkeypatch.setattr(doctor_cmd, "run_checks", lambda *a: {**_report(), "ok": False, "failed": ["lossless"]})
    result = CliRunner().invoke(app, ["doctor", "--no-speed"])
    assert result.exit_code == 1 and "failed" in result.stdout


def _report() -> dict:
    return {"schema_version": 1, "environment": doctor.environment(), "kernels": [], "lossless": [],
            "speed": {"skipped": "--no-speed"}}


@pytest.mark.skipif(not compiler_available(), reason="g++ is needed to emulate the Metal kernels")
@pytest.mark.parametrize("broken", [False, True])
def test_kernel_checks_report_each_kernel_and_dtype(monkeypatch, tmp_path, broken):
    def build(spec, kind):
        if broken and spec.name == "dflash_block_qk":
            spec = dataclasses.replace(spec, name=spec.name + "_bad",
                                       header=spec.header.replace("sum_sq / D + eps", "sum_sq + eps"))
        return EmulatedKernel(spec, tmp_path)

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.setattr(_common, "compiled", build)
    results = doctor.kernel_checks([mx.bfloat16, mx.float16, mx.float32], head_dims=(64,))
    self_check.forget()
    assert len(results) == 6
    for r in results:
        assert r["head_dim"] == 64 and r["dtype"] in ("bfloat16", "float16", "float32")
        assert r["passed"] is not (broken and r["kernel"] == "dflash_block_qk"), r


def test_the_fixture_is_built_from_fixed_seeds():
    """The same weights every time (so every machine checks the same pair), another seed other ones."""
    first, again, other = (doctor.tiny_fixture(mx.float32, seed=s) for s in (0, 0, 1))
    weight = first.target.model.embed_tokens.weight
    assert weight.shape == (doctor.FIXTURE_VOCAB, 256)
    assert mx.array_equal(weight, again.target.model.embed_tokens.weight)
    assert mx.array_equal(first.drafter.fc.weight, again.drafter.fc.weight)
    assert not mx.array_equal(weight, other.target.model.embed_tokens.weight)
    assert first.drafter.args.head_dim == 128  # the kernels' shape class on real drafters
