"""Shared fixtures: tiny random models (cached once per session), a fake tokenizer, markers.

Everything here runs on the CPU in fp32; no network, no real checkpoints.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import mlx_dflash  # noqa: F401

import atexit
import functools
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

from tiny import EOS_ID, VOCAB, FakeTokenizer, tiny_drafter, tiny_target  # noqa: E402,F401

# The families the core engine supports, each with its own weight seed (llama and
# mistral share a config, so equal seeds would give two identical models).
FAMILIES = {"qwen3": 0, "qwen3_moe": 1, "llama": 2, "mistral": 3, "qwen2": 4}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: statistical or end-to-end test taking several seconds")
    config.addinivalue_line("markers", "cli: runs the real `dflash-mlx` entry point in a subprocess")


@pytest.fixture
def tokenizer() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture
def make_tokenizer():
    return FakeTokenizer


@functools.cache
def cached_target(family: str, seed: int | None = None, num_layers: int = 4, vocab: int = VOCAB):
    """One tiny random target per (family, seed, depth, vocab) for the whole session.

    Models are never mutated by the engine, so sharing them between tests is safe.
    """
    return tiny_target(family, seed=FAMILIES[family] if seed is None else seed,
                       num_layers=num_layers, vocab=vocab)


@functools.cache
def cached_drafter(family: str, seed: int = 1, block_size: int = 8, mask_token_id: int = 3,
                   num_layers: int = 2):
    return tiny_drafter(cached_target(family), seed=seed, block_size=block_size,
                        mask_token_id=mask_token_id, num_layers=num_layers)


@pytest.fixture(scope="session")
def targets():
    """`targets(family, ...)` -> a cached tiny target of that family."""
    return cached_target


@pytest.fixture(scope="session")
def drafters():
    """`drafters(family, ...)` -> a cached tiny DFlash drafter for `targets(family)`."""
    return cached_drafter
