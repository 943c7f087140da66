"""The chat CLI tests' models: a tiny target and its drafter, saved as a user's checkpoints are."""

from __future__ import annotations

import pytest
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", root / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), root / "drafter")
    return str(target), str(drafter)
