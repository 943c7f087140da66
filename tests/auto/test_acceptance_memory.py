"""What `auto` learnt of a drafter's acceptance is kept per target + drafter pair and seeds the
next run, so that a short one-shot generation does not pay to learn it again."""

from __future__ import annotations

import json

import pytest
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

from mlx_dflash.auto import acceptance_memory as memory
from mlx_dflash.auto import calibration as cal
from mlx_dflash.auto.calibration import Calibration
from mlx_dflash.auto.policy import AcceptanceModel, candidate_sizes, make_policy
from mlx_dflash.targets.model import TargetModel

_register()


@pytest.fixture
def pair(targets, drafters, tmp_path, monkeypatch):
    monkeypatch.setenv(cal.DIR_ENV, str(tmp_path))
    return TargetModel(targets("qwen3")), drafters("qwen3")


def learnt(depth: int, rate: float, cycles: int = 200) -> AcceptanceModel:
    model = AcceptanceModel(depth)
    for i in range(cycles):  # a deterministic drafter: the first position accepted at `rate`
        model.observe(depth, 1 if (i * rate) % 1 + rate >= 1 else 0)
    return model


def test_remembered_acceptance_comes_back_scaled_down(pair):
    target, drafter = pair
    depth = drafter.block_size - 1
    assert memory.recall(target, drafter) is None  # nothing yet
    weak = learnt(depth, 0.1)
    assert memory.remember(target, drafter, weak) is None
    back = memory.recall(target, drafter)
    assert back is not None and back.depth == depth
    assert max(back.reached) == pytest.approx(memory.SEED_WEIGHT)  # fresh evidence takes over quickly
    assert back.accepted[0] / back.reached[0] == pytest.approx(weak.accepted[0] / weak.reached[0])


def test_another_drafter_or_a_damaged_file_recalls_nothing(pair, targets, drafters):
    target, drafter = pair
    memory.remember(target, drafter, learnt(drafter.block_size - 1, 0.5))
    other = drafters("qwen3", seed=7)  # same shapes, other weights
    assert memory.memory_file(target, other) != memory.memory_file(target, drafter)
    assert memory.recall(target, other) is None
    wider = drafters("qwen3", block_size=16)
    assert memory.recall(target, wider) is None
    path = memory.memory_file(target, drafter)
    path.write_text("{not json")
    assert memory.recall(target, drafter) is None
    path.write_text(json.dumps({"version": memory.VERSION, "reached": [1.0] * 7, "accepted": [2.0] * 7}))
    assert memory.recall(target, drafter) is None  # more accepted than reached: not ours


def test_a_remembered_weak_drafter_starts_with_plain_steps(pair):
    target, drafter = pair
    depth = drafter.block_size - 1
    costs = {L: (0.05 + 0.01 * (L - 1) + 0.02 * (L > 1), 0.0) for L in (1, 2, 3, 4, 6, 8)}
    fresh = make_policy("auto", drafter.block_size, Calibration({}, costs))
    assert fresh.choose(100, 10) > 1  # nothing known: try the drafter
    remembered = Calibration({}, costs, acceptance=learnt(depth, 0.02))
    assert [make_policy("auto", drafter.block_size, remembered).choose(100, 10) for _ in range(3)] == [1, 1, 1]
    policy = make_policy("auto", drafter.block_size, remembered)
    policy.record(3, 2, 0.08)
    assert remembered.acceptance.reached[0] > 0  # the policies share and update the calibration's model


def test_generate_remembers_between_runs(tmp_path, monkeypatch):
    monkeypatch.setenv(cal.DIR_ENV, str(tmp_path / "calibration"))
    # Drafting priced as cheap as a plain step, so that the short run drafts and learns.
    monkeypatch.setattr(cal, "measure", lambda target, drafter, **kw: Calibration(
        cal.calibration_key(target, drafter), {L: (0.01, 0.0) for L in candidate_sizes(drafter.block_size)}))
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", tmp_path / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), tmp_path / "drafter")
    run = ["generate", "-m", str(target), "-d", str(drafter), "--prompt-ids", "5,6,7", "--max-tokens", "12", "--json"]
    first = CliRunner().invoke(app, run)
    assert first.exit_code == 0, first.output
    files = sorted((tmp_path / "calibration").glob("acceptance-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert sum(saved["reached"]) > 0
    second = CliRunner().invoke(app, run)
    assert second.exit_code == 0
    assert json.loads(second.output)["token_ids"] == json.loads(first.output)["token_ids"]  # speed only
    fixed = CliRunner().invoke(app, [*run, "--block-size", "4"])
    assert fixed.exit_code == 0 and sorted((tmp_path / "calibration").glob("acceptance-*.json")) == files
