"""Shared fixtures: tiny random models (cached once per session), a fake tokenizer, markers.

Everything here runs on the CPU in fp32; no network, no real checkpoints. The helpers the tests
share (tiny models, scripted proposers, statistics, references, a live server) are in helpers/.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import mlx_dflash  # noqa: F401

import atexit
import os
import shutil
import tempfile

import pytest

# Tests must never reach the network, whatever a saved model path looks like.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `--block-size auto` calibrations of tiny test models stay out of the user's cache (and
# leave nothing behind).
if "MLX_DFLASH_CALIBRATION_DIR" not in os.environ:
    os.environ["MLX_DFLASH_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="mlx-dflash-calibration-")
    atexit.register(shutil.rmtree, os.environ["MLX_DFLASH_CALIBRATION_DIR"], ignore_errors=True)
# `serve` keeps no conversations on disk in the user's cache: tests that want the disk tier name a folder.
os.environ.setdefault("MLX_DFLASH_PROMPT_CACHE_DIR", "off")

from helpers.families import cached_drafter, cached_target  # noqa: E402
from helpers.tiny import FakeTokenizer  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: statistical or end-to-end test taking several seconds")
    config.addinivalue_line("markers", "cli: runs the real `dflash-mlx` entry point in a subprocess")


@pytest.fixture
def tokenizer() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture
def make_tokenizer():
    return FakeTokenizer


@pytest.fixture(scope="session")
def targets():
    """`targets(family, ...)` -> a cached tiny target of that family."""
    return cached_target


@pytest.fixture(scope="session")
def drafters():
    """`drafters(family, ...)` -> a cached tiny DFlash drafter for `targets(family)`."""
    return cached_drafter
