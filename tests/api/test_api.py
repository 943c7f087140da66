"""The public surface: `load`/`load_drafter` variants (local and Hub cache), `generate`, the JSON CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import drafter_config, greedy_reference, save_drafter, save_target, tiny_drafter, tiny_target

from mlx_dflash import DFlashError, generate, load, load_drafter, stream_generate
from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs, default_target_layer_ids
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.model import TargetModel

JSON_KEYS = {"token_ids", "text", "acceptance_lengths", "tau", "prefill_tps", "generation_tps",
             "peak_memory_gb", "finish_reason", "prompt_tokens", "generation_tokens"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-pair")
    target = tiny_target("qwen3", seed=0)
    drafter = tiny_drafter(target, seed=1, block_size=6)
    config = drafter_config(target, block_size=6)
    return target, save_target(target, "qwen3", root / "target"), save_drafter(drafter, config, root / "drafter")


# ----------------------------------------------------------------- the Python API


def test_generate_and_stream_generate(pair, tokenizer):
    target_model, target_dir, drafter_dir = pair
    model, hf_tokenizer, drafter = load(target_dir, drafter_dir)
    assert drafter.block_size == 6 and drafter.target_layer_ids == [1, 2]
    prompt = [10, 20, 30, 40]
    reference = greedy_reference(model, prompt, 24)
    events = list(stream_generate(model, hf_tokenizer, prompt, draft_model=drafter, max_tokens=24))
    tokens = [t for e in events for t in e.tokens]
    expected = reference[: reference.index(2)] if 2 in reference else reference
    assert tokens == expected
    # The text of the events is the decoded tokens; `generate` returns the same text.
    assert "".join(e.text for e in events) == hf_tokenizer.decode(tokens)
    assert generate(model, hf_tokenizer, prompt, draft_model=drafter, max_tokens=24) == hf_tokenizer.decode(tokens)
    stats = events[-1].stats
    assert stats.prompt_tokens == len(prompt) and stats.num_tokens == len(tokens)
    assert stats.tau == pytest.approx(sum(stats.acceptance_lengths) / max(len(stats.acceptance_lengths), 1))
    # A string prompt goes through the tokenizer.
    text = generate(model, hf_tokenizer, "hello", draft_model=drafter, max_tokens=8)
    ids = hf_tokenizer.encode("hello")
    ref = greedy_reference(model, ids, 8)
    assert text == hf_tokenizer.decode(ref[: ref.index(2)] if 2 in ref else ref)


# ----------------------------------------------------------------- drafter loading variants


def saved_variant(path: Path, target, edit) -> tuple[Path, DFlashDraftModel]:
    """A drafter with random weights whose config.json is edited by `edit(config)`."""
    config = drafter_config(target, block_size=8)
    drafter = tiny_drafter(target, seed=4, block_size=8)
    edit(config)
    save_drafter(drafter, config, path)
    return path, drafter


def test_block_size_inside_dflash_config(tmp_path, monkeypatch):
    target = tiny_target("qwen3")

    def edit(config):
        del config["block_size"]
        config["dflash_config"]["block_size"] = 5

    path, _ = saved_variant(tmp_path / "d", target, edit)
    drafter = load_drafter(path, TargetModel(target))
    assert drafter.block_size == 5
    # ... and it is the default block size of a generation (a seeded sample verifies the drafter's block
    # every cycle; greedy `auto` chooses by measured time, which this check must not depend on).
    blocks = []
    propose = DFlashProposer.propose

    def spy(self, last_token, position, block_size):
        blocks.append(block_size)
        return propose(self, last_token, position, block_size)

    monkeypatch.setattr(DFlashProposer, "propose", spy)
    list(stream_generate(target, _NoEos(), [5, 6, 7], draft_model=drafter, max_tokens=20, temp=0.7, seed=0))
    assert blocks and max(blocks) == 5


class _NoEos:
    eos_token_ids: set = set()

    class detokenizer:  # noqa: N801  (the attribute name mlx-lm uses)
        last_segment = ""

        @staticmethod
        def reset():
            pass

        @staticmethod
        def add_token(token):
            pass

        @staticmethod
        def finalize():
            pass


def test_rope_parameters_instead_of_rope_theta(tmp_path):
    """transformers-5 configs nest the base: it must be used, not the 10000 default."""
    target = tiny_target("qwen3")
    t = TargetModel(target)

    def nested(config):
        del config["rope_theta"]
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}

    def flat(config):
        config["rope_theta"] = 5000.0

    nested_path, _ = saved_variant(tmp_path / "nested", target, nested)
    flat_path, _ = saved_variant(tmp_path / "flat", target, flat)
    a, b = load_drafter(nested_path, t), load_drafter(flat_path, t)
    assert a.args.rope_theta == b.args.rope_theta == 5000.0
    assert a.rope.base == pytest.approx(5000.0)
    # Same weights, same base: the same hidden states at a late position.
    features = mx.array(np.random.default_rng(0).standard_normal((1, 40, 2 * t.hidden_size)), dtype=mx.float32)
    out = []
    for drafter in (a, b):
        proposer = DFlashProposer(drafter, t, max_block_size=8)
        proposer.commit(features, 0)
        block = mx.array([[9] + [3] * 7], dtype=mx.uint32)
        out.append(np.array(drafter(t.embed(block), proposer.cache, 40)))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-6, atol=1e-6)


def test_default_target_layers():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_missing_target_layer_ids_use_the_default_rule(tmp_path):
    target = tiny_target("qwen3", num_layers=36)  # tiny width, real depth

    def edit(config):
        del config["dflash_config"]["target_layer_ids"]
        del config["num_target_layers"]

    config = drafter_config(target, num_layers=5, target_layer_ids=[1, 9, 17, 25, 33])
    drafter = DFlashDraftModel(ModelArgs.from_dict(config))
    edit(config)
    save_drafter(drafter, config, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", TargetModel(target))
    assert loaded.target_layer_ids == [1, 9, 17, 25, 33]
    # With num_target_layers in the config, no target is needed to resolve them.
    config["num_target_layers"] = 36
    save_drafter(drafter, config, tmp_path / "d2")
    assert load_drafter(tmp_path / "d2").target_layer_ids == [1, 9, 17, 25, 33]



def test_a_half_precision_drafter_loads_in_the_dtype_it_will_run_in(tmp_path):
    """A bfloat16 checkpoint (the shipped drafter's) loads in float32 on the CPU, where MLX's half-precision
    matmuls are slower; beside a target, in the target's dtype, as `load` pairs them."""
    target = tiny_target("qwen3")
    config = drafter_config(target)
    drafter = DFlashDraftModel(ModelArgs.from_dict(config))
    drafter.set_dtype(mx.bfloat16)
    path = save_drafter(drafter, config, tmp_path / "d")
    assert mx.default_device() == mx.cpu  # this suite runs on MLX's CPU backend
    assert load_drafter(path).fc.weight.dtype == mx.float32
    target.set_dtype(mx.float16)
    assert load_drafter(path, TargetModel(target)).fc.weight.dtype == mx.float16
    assert load_drafter(path, TargetModel(target), dtype=mx.bfloat16).fc.weight.dtype == mx.bfloat16

# ----------------------------------------------------------------- the Hugging Face cache


def publish_to_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay `source`'s files out as huggingface_hub does: blobs, a snapshot of links, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40-hex commit id
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # no newline: huggingface_hub reads it verbatim
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache in a temporary directory.

    huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE into module constants when it is
    first imported, which happened long before this test (mlx-lm and transformers import
    it), so setting the environment alone is too late for this process. The library reads
    `constants.HF_HUB_CACHE` and `constants.HF_HUB_OFFLINE` at call time, so we set the
    environment (for code that reads it lazily, and for subprocesses) and patch those
    constants too; monkeypatch restores both. The assertions below check that the files
    really came from this cache, so a stale setting could not pass unnoticed.
    """
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_drafter_from_a_hub_repo_id(pair, hub_cache):
    target_model, target_dir, drafter_dir = pair
    snapshot = publish_to_hub_cache(hub_cache, "some-org/tiny-DFlash", drafter_dir)
    drafter = load_drafter("some-org/tiny-DFlash", TargetModel(target_model))
    local = load_drafter(drafter_dir, TargetModel(target_model))
    assert drafter.block_size == local.block_size == 6
    for (key, a), (_, b) in zip(sorted(_flat(drafter).items()), sorted(_flat(local).items()), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=key)
    assert snapshot.resolve().is_relative_to(hub_cache.resolve())
    # A repo that is not cached fails with one sentence, offline, without trying the network.
    with pytest.raises(DFlashError, match="some-org/not-there"):
        load_drafter("some-org/not-there")


def test_target_and_drafter_from_hub_repo_ids(pair, hub_cache, tokenizer):
    target_model, target_dir, drafter_dir = pair
    publish_to_hub_cache(hub_cache, "some-org/tiny-target", target_dir)
    publish_to_hub_cache(hub_cache, "some-org/tiny-DFlash", drafter_dir)
    model, hf_tokenizer, drafter = load("some-org/tiny-target", "some-org/tiny-DFlash")
    assert drafter is not None
    prompt = [11, 12, 13]
    tokens = [t for e in stream_generate(model, tokenizer, prompt, draft_model=drafter, max_tokens=10)
              for t in e.tokens]
    ref = greedy_reference(target_model, prompt, 10)
    assert tokens == (ref[: ref.index(2)] if 2 in ref else ref)


def _flat(module):
    from mlx.utils import tree_flatten

    return dict(tree_flatten(module.parameters()))


# ----------------------------------------------------------------- the CLI (real entry point)


def run_cli(*args: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("dflash-mlx")
    command = [str(script)] if script.exists() else [sys.executable, "-c",
                                                      "from mlx_dflash.cli.main import main; main()"]
    environment = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hf-cache"),
                       MLX_DFLASH_CACHE=str(tmp_path / "dflash-cache"), COLUMNS="200")
    environment.update(env or {})
    result = subprocess.run(command + list(args), capture_output=True, text=True, timeout=180, env=environment)
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.mark.cli
@pytest.mark.slow
def test_cli_json_matches_no_draft(pair, tmp_path):
    target_model, target_dir, drafter_dir = pair
    prompt = [33, 34, 35, 36, 37]
    reference = greedy_reference(target_model, prompt, 40)
    max_tokens = 40 if 2 not in reference else reference.index(2)  # a run that ends by length
    assert max_tokens >= 10
    common = ["generate", "--model", str(target_dir), "--prompt-ids", ",".join(map(str, prompt)),
              "--max-tokens", str(max_tokens), "--json"]
    drafted = run_cli(*common, "--draft", str(drafter_dir), "--block-size", "5", tmp_path=tmp_path)
    plain = run_cli(*common, "--no-draft", tmp_path=tmp_path)
    assert drafted.returncode == 0, drafted.stderr
    assert plain.returncode == 0, plain.stderr
    a, b = json.loads(drafted.stdout), json.loads(plain.stdout)  # exactly one JSON object on stdout
    for obj in (a, b):
        assert JSON_KEYS <= set(obj), sorted(JSON_KEYS - set(obj))
        assert obj["finish_reason"] == "length"
        assert len(obj["token_ids"]) == obj["generation_tokens"] == max_tokens
        assert sum(obj["acceptance_lengths"]) + 1 == len(obj["token_ids"])
        assert obj["prompt_tokens"] == len(prompt)
        assert obj["tau"] == pytest.approx(sum(obj["acceptance_lengths"]) / len(obj["acceptance_lengths"]))
        assert obj["peak_memory_gb"] >= 0 and obj["prefill_tps"] > 0 and obj["generation_tps"] > 0
        assert isinstance(obj["text"], str)
    assert a["token_ids"] == b["token_ids"] == reference[:max_tokens]
    assert max(a["acceptance_lengths"]) <= 5
    assert set(b["acceptance_lengths"]) == {1}
    assert a["text"] == b["text"]


@pytest.mark.cli
@pytest.mark.slow
def test_cli_resolves_hub_repo_ids_from_the_environment(pair, tmp_path):
    """In a fresh process the environment alone points huggingface_hub at the cache."""
    target_model, target_dir, drafter_dir = pair
    cache = tmp_path / "hf-cache"
    publish_to_hub_cache(cache, "some-org/tiny-target", target_dir)
    publish_to_hub_cache(cache, "some-org/tiny-DFlash", drafter_dir)
    result = run_cli("generate", "--model", "some-org/tiny-target", "--draft", "some-org/tiny-DFlash",
                     "--prompt-ids", "11,12,13", "--max-tokens", "6", "--json", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    ref = greedy_reference(target_model, [11, 12, 13], 6)
    assert json.loads(result.stdout)["token_ids"] == (ref[: ref.index(2)] if 2 in ref else ref)
