"""`write_json_atomic`: a reader sees the old file or the new one; a failed write leaves no trace."""

from __future__ import annotations

import json
import os

import pytest

from mlx_dflash.auto import acceptance_memory, calibration
from mlx_dflash.auto.policy import AcceptanceModel
from mlx_dflash.platform.files import write_json_atomic
from mlx_dflash.targets.model import TargetModel


def test_writes_and_replaces(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"x": 1})
    write_json_atomic(path, {"x": "é"}, indent=2, ensure_ascii=False)
    assert json.loads(path.read_text(encoding="utf-8")) == {"x": "é"}
    assert os.listdir(tmp_path) == ["a.json"]


def test_an_unserialisable_value_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"x": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"x": object()})
    assert json.loads(path.read_text()) == {"x": 1} and os.listdir(tmp_path) == ["a.json"]


def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"x": 1})

    refuse_replace(monkeypatch)
    with pytest.raises(OSError):
        write_json_atomic(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 1} and os.listdir(tmp_path) == ["a.json"]


def refuse_replace(monkeypatch):
    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)


def test_a_calibration_or_acceptance_memory_write_that_fails_leaves_the_old_file(
        targets, drafters, tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.DIR_ENV, str(tmp_path))
    target, drafter = TargetModel(targets("qwen3")), drafters("qwen3")
    key = calibration.calibration_key(target, drafter)
    old = calibration.Calibration(key, {1: (0.01, 0.0)}, 1.0)
    path = calibration.save_calibration(old)
    learnt = AcceptanceModel(drafter.block_size - 1)
    learnt.observe(drafter.block_size - 1, 1)
    assert acceptance_memory.remember(target, drafter, learnt) is None
    files = sorted(os.listdir(tmp_path))
    before = {name: (tmp_path / name).read_text() for name in files}
    refuse_replace(monkeypatch)
    with pytest.raises(OSError):
        calibration.save_calibration(calibration.Calibration(key, {1: (0.02, 0.0)}, 2.0))
    assert "No space left" in acceptance_memory.remember(target, drafter, learnt)
    assert sorted(os.listdir(tmp_path)) == files  # no temporary file left behind
    assert {name: (tmp_path / name).read_text() for name in files} == before
    assert calibration.load_calibration(key)[0].costs == old.costs and path.name in files
