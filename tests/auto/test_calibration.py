"""Calibration: measured once per machine and model shapes, cached, stale or corrupt files ignored
with a warning; its costs seed `--block-size auto`."""

from __future__ import annotations

import json

import pytest

from mlx_dflash.auto import calibration as cal
from mlx_dflash.auto.policy import AutoBlockSize, candidate_sizes, make_policy
from mlx_dflash.targets.model import TargetModel


@pytest.fixture
def pair(targets, drafters, tmp_path, monkeypatch):
    monkeypatch.setenv(cal.DIR_ENV, str(tmp_path))
    return TargetModel(targets("qwen3")), drafters("qwen3")


def test_measure_cache_and_reuse(pair, monkeypatch):
    target, drafter = pair
    calls = []
    calibration, warning = cal.calibrate(target, drafter, progress=lambda done, total: calls.append((done, total)))
    assert warning is None
    assert sorted(calibration.costs) == candidate_sizes(drafter.block_size)
    assert all(a > 0 and b >= 0 for a, b in calibration.costs.values())
    ordered = [calibration.costs[size] for size in sorted(calibration.costs)]
    assert all(x[0] <= y[0] and x[1] <= y[1] for x, y in zip(ordered, ordered[1:], strict=False))  # monotone
    assert calls[-1][0] == calls[-1][1] == len(cal.CONTEXTS) * len(calibration.costs) * (cal.REPEATS + 1)
    assert cal.cache_file(calibration.key).is_file()

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although a calibration was cached")

    monkeypatch.setattr(cal, "measure", no_measuring)
    again, warning = cal.calibrate(target, drafter)
    assert warning is None and again.costs == calibration.costs
    policy = make_policy("auto", drafter.block_size, again)
    assert isinstance(policy, AutoBlockSize) and policy.costs.base == again.costs


def test_the_key_names_what_costs_depend_on(pair, targets, drafters):
    target, drafter = pair
    key = cal.calibration_key(target, drafter)
    assert key["target"]["dtype"] == "mlx.core.float32" and key["target"]["quantization"] == "none"
    other = cal.calibration_key(TargetModel(targets("llama")), drafters("llama"))
    assert other != key and cal.cache_file(other) != cal.cache_file(key)
    assert "MLX" in key["machine"]


@pytest.mark.parametrize("damage", ["corrupt", "stale", "negative"])
def test_unusable_files_are_ignored_with_a_warning(pair, damage):
    target, drafter = pair
    key = cal.calibration_key(target, drafter)
    path = cal.cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    good = {"version": cal.VERSION, "key": key, "costs": {"1": [0.01, 0.0], "8": [0.02, 0.0]}}
    if damage == "corrupt":
        path.write_text("{not json")
    elif damage == "stale":
        path.write_text(json.dumps({**good, "key": {**key, "machine": "another machine"}}))
    else:
        path.write_text(json.dumps({**good, "costs": {"1": [-1.0, 0.0]}}))
    loaded, warning = cal.load_calibration(key)
    assert loaded is None and warning and str(path) in warning
    assert ("stale" in warning) == (damage == "stale")
    calibration, again = cal.calibrate(target, drafter)  # measured afresh, the warning passed on
    assert calibration is not None and again == warning
    assert cal.load_calibration(key)[0].costs == calibration.costs


def test_draft_trees_are_measured_when_asked_and_price_auto_trees(pair, targets, drafters, monkeypatch):
    target, drafter = pair
    plain, _ = cal.calibrate(target, drafter)
    assert plain.tree_costs is None  # not asked: not measured
    calls = []
    calibration, warning = cal.calibrate(target, drafter, trees=True,  # asked: measured again, with trees
                                         progress=lambda done, total: calls.append((done, total)))
    assert warning is None and sorted(calibration.tree_costs) == [16, 32, 64]
    assert all(a > 0 and b >= 0 for a, b in calibration.tree_costs.values())
    assert calls[-1][0] == calls[-1][1] == len(cal.CONTEXTS) * (len(calibration.costs) + 3) * (cal.REPEATS + 1)
    saved = json.loads(cal.cache_file(calibration.key).read_text())
    assert {int(b) for b in saved["tree_costs"]} == {16, 32, 64}

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although trees were cached")

    monkeypatch.setattr(cal, "measure", no_measuring)
    again, _ = cal.calibrate(target, drafter, trees=True)
    assert again.tree_costs == calibration.tree_costs
    policy = make_policy("auto", drafter.block_size, again, tree_budget="auto")
    a, b = again.tree_costs[32]
    assert policy.trees.seconds(32, policy.costs, policy.sizes, 100) == pytest.approx(a + 100 * b)


def test_a_pair_without_trees_is_calibrated_once_with_none(pair, monkeypatch):
    target, drafter = pair
    monkeypatch.setattr(cal.DecodingSession, "tree_refusal", lambda self: "a recurrent cache")
    calibration, _ = cal.calibrate(target, drafter, trees=True)
    assert calibration.tree_costs == {}  # measured: none (not None: asking again measures nothing new)
    monkeypatch.setattr(cal, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert cal.calibrate(target, drafter, trees=True)[0].tree_costs == {}
