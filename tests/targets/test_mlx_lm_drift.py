"""The load-time self-check against mlx-lm drift, and the mlx-lm range it was tested with.

`mlx_dflash/targets/families.py` rebuilds each family's forward from mlx-lm's parts (private ones
included). If a future mlx-lm changed those parts, our forward would decode a
different model than `model(x)` without an error; `check_forward` must refuse it.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import mlx_lm
import pytest
from helpers.families import HYBRID_CONFIGS, build
from helpers.paths import REPO
from helpers.tiny import FAMILY_CONFIGS, save_target, tiny_target
from packaging.specifiers import SpecifierSet

from mlx_dflash.errors import DFlashError
from mlx_dflash.loading.loaders import load_target
from mlx_dflash.targets import model as target_module
from mlx_dflash.targets.model import MLX_LM_TESTED, TargetModel, check_forward

PYPROJECT = REPO / "pyproject.toml"


def test_installed_mlx_lm_is_inside_the_declared_tested_range():
    declared = re.findall(r'^\s*"(mlx-lm[^"]*)"', PYPROJECT.read_text(), flags=re.MULTILINE)
    assert declared == [f"mlx-lm{MLX_LM_TESTED}"]  # pyproject.toml and the self-check name one range
    spec = SpecifierSet(MLX_LM_TESTED)
    assert any(s.operator == "<" for s in spec), "the tested range needs an upper bound"
    assert mlx_lm.__version__ in spec, (mlx_lm.__version__, MLX_LM_TESTED)


@pytest.mark.parametrize("model_type", sorted(set(FAMILY_CONFIGS) | set(HYBRID_CONFIGS)))
def test_every_family_passes_the_self_check(model_type):
    check_forward(TargetModel(build(model_type)))


def _masks_without_causality(inner, h, cache):
    return [None] * len(inner.layers)  # what a drifted mask helper might silently produce


def _embed_slightly_off(inner, tokens):
    return inner.embed_tokens(tokens) * 1.0001


@pytest.mark.parametrize("alteration", [dict(build_masks=_masks_without_causality),
                                        dict(embed=_embed_slightly_off)], ids=["masks", "embed"])
def test_an_altered_family_is_refused_naming_the_versions(alteration):
    target = TargetModel(tiny_target("qwen3"))
    target.family = dataclasses.replace(target.family, **alteration)
    with pytest.raises(DFlashError) as e:
        check_forward(target)
    message = str(e.value)
    assert "\n" not in message
    assert f"mlx-lm {mlx_lm.__version__}" in message and MLX_LM_TESTED in message and "qwen3" in message


def test_load_target_runs_the_self_check(tmp_path, monkeypatch):
    path = save_target(tiny_target("llama", seed=2), "llama", tmp_path / "target")
    model, _ = load_target(str(path))  # the real family passes
    assert isinstance(model(mx.array([[5, 6]])), mx.array)
    real = target_module.family_for

    def drifted(model_type):
        return dataclasses.replace(real(model_type), build_masks=_masks_without_causality)

    monkeypatch.setattr(target_module, "family_for", drifted)
    with pytest.raises(DFlashError, match="differs from the model's own"):
        load_target(str(path))
