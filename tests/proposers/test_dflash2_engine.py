"""DFlash2 drafters in the engine: loading and converting (every key and shape checked), greedy
output token-identical to the target alone over every target family, and sampled output that
follows the target's distribution under speculative rejection sampling with the selector's q."""

from __future__ import annotations

import importlib
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers.distributions import PROMPT, exact_distributions, pvalues, sample_many
from helpers.families import FAMILIES, cached_target
from helpers.tiny import OracleProposer, drafter_config, greedy_reference, save_drafter, tiny_drafter, tiny_target
from helpers.tiny_dflash2 import tiny_dflash2
from mlx.utils import tree_flatten

from convert import ConvertOptions, convert
from mlx_dflash import stream_generate
from mlx_dflash.drafters.dflash import DFlashDraftModel
from mlx_dflash.drafters.dflash2 import DFlash2DraftModel
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading.loaders import load_drafter
from mlx_dflash.loading.resolve import KNOWN_PAIRS
from mlx_dflash.proposers.dflash2 import DFlash2Proposer
from mlx_dflash.proposers.factory import dflash_proposer
from mlx_dflash.targets.model import TargetModel

generate_module = importlib.import_module("mlx_dflash.generate")

SLIDING = dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6)
DRAFTERS = [  # sliding and full layers, causal and not, soft-capping on and off
    dict(SLIDING, softcap=20.0),
    dict(is_causal=True, softcap=None, kernel_size=3),
    dict(SLIDING, is_causal=False, softcap=None, output_multiplier=0.5),
]


def generated(model, tokenizer, prompt, draft, **kwargs):
    tokens, lengths = [], []
    for event in stream_generate(model, tokenizer, prompt, draft_model=draft, **kwargs):
        tokens += event.tokens
        lengths = event.stats.acceptance_lengths
    return tokens, lengths


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_is_lossless_with_dflash2(family, make_tokenizer):
    """A 16-token vocabulary, so random drafters are right often enough for every path to run."""
    model = cached_target(family, vocab=16)
    rng = np.random.default_rng(list(FAMILIES).index(family))
    accepted = 0
    for i, overrides in enumerate(DRAFTERS):
        drafter, _ = tiny_dflash2(model, seed=10 + i, top_k=5, **overrides)
        prompt = [int(t) for t in rng.integers(4, 16, int(rng.integers(1, 40)))]
        block_size, max_tokens = int(rng.integers(2, 9)), int(rng.integers(30, 60))
        reference = greedy_reference(model, prompt, max_tokens)
        tokens, lengths = generated(model, make_tokenizer(()), prompt, drafter, max_tokens=max_tokens,
                                    block_size=block_size)
        assert tokens == reference, (family, i)
        accepted += sum(lengths) - len(lengths)
    assert accepted > 0  # drafts were accepted, not only rejected


def _saved(tmp_path, target_model, **overrides):
    drafter, cfg = tiny_dflash2(target_model, seed=4, **overrides)
    return drafter, cfg, save_drafter(drafter, cfg, tmp_path / "dflash2")


def test_load_drafter_dispatches_on_architectures_and_checks_every_key(tmp_path):
    target_model = tiny_target("qwen3", seed=0)
    target = TargetModel(target_model)
    drafter, cfg, path = _saved(tmp_path, target_model, **SLIDING)
    loaded = load_drafter(path, target)
    assert isinstance(loaded, DFlash2DraftModel)
    assert loaded.args.selector_top_k == 6 and loaded.args.rope_theta == 10000.0
    ours, theirs = dict(tree_flatten(drafter.parameters())), dict(tree_flatten(loaded.parameters()))
    assert set(ours) == set(theirs) and any(k.startswith("candidate_selector.") for k in ours)
    for key in ours:
        np.testing.assert_array_equal(np.array(ours[key]), np.array(theirs[key]))
    assert isinstance(dflash_proposer(loaded, target, max_block_size=8), DFlash2Proposer)

    weights = dict(mx.load(str(path / "model.safetensors")))
    # Exports through nn.Embedding name the codebooks `<name>.weight`: the same drafter.
    renamed = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), renamed)
    assert isinstance(load_drafter(path, target), DFlash2DraftModel)

    for broken, message in [
        ({k: v for k, v in weights.items() if k != "candidate_selector.successor_codebook"},
         "missing candidate_selector.successor_codebook"),
        ({**weights, "layers.1.mlp_conv.base_kernel": mx.zeros((2, 3, 64))}, "layers.1.mlp_conv.base_kernel has shape"),
    ]:
        mx.save_safetensors(str(path / "model.safetensors"), broken)
        with pytest.raises(DFlashError, match=message):
            load_drafter(path, target)

    bad = dict(cfg, dflash_config={k: v for k, v in cfg["dflash_config"].items() if k != "selector_top_k"})
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(DFlashError, match="selector_top_k"):
        load_drafter(path, target)

    # A v1 drafter still loads as v1.
    v1 = save_drafter(tiny_drafter(target_model), drafter_config(target_model), tmp_path / "v1")
    assert type(load_drafter(v1, target)) is DFlashDraftModel


def test_convert_round_trip_and_quantize_recipe(tmp_path, make_tokenizer):
    target_model = cached_target("qwen3", vocab=16)
    target = TargetModel(target_model)
    drafter, cfg, src = _saved(tmp_path, target_model, top_k=5, group_size=16, **SLIDING)
    exact = convert(src, tmp_path / "plain", ConvertOptions(dtype="float32"))
    assert exact.kind == "drafter"
    loaded = load_drafter(exact.path, target)
    for key, value in tree_flatten(drafter.parameters()):
        np.testing.assert_array_equal(np.array(dict(tree_flatten(loaded.parameters()))[key]), np.array(value))

    quant = convert(src, tmp_path / "q4", ConvertOptions(dtype="float32", quantize=True, q_bits=4, q_group_size=32))
    q = load_drafter(quant.path, target)
    layer = q.layers[0]
    assert layer.self_attn.q_proj.bits == 4 and hasattr(layer.mlp.down_proj, "scales")
    for dense in (layer.attention_conv.kernel_projection, layer.mlp_conv.kernel_projection,
                  q.candidate_selector.hidden_projection, q.fc):
        assert not hasattr(dense, "scales")
    original = dict(tree_flatten(drafter.parameters()))
    for key in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                "layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight"):
        np.testing.assert_array_equal(np.array(dict(tree_flatten(q.parameters()))[key]), np.array(original[key]))
    prompt = [5, 9, 4, 12, 7]
    tokens, _ = generated(target_model, make_tokenizer(()), prompt, q, max_tokens=30, block_size=6)
    assert tokens == greedy_reference(target_model, prompt, 30)


def test_known_pairs_name_dflash2_drafters():
    v2 = [p for p in KNOWN_PAIRS if p.dflash == 2]
    assert ("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2") in [(p.target, p.drafter) for p in v2]
    assert all(p.dflash == 1 for p in KNOWN_PAIRS if not p.drafter.endswith("DFlash2"))


@pytest.fixture(scope="module")
def sampling_pair():
    from helpers.distributions import SEED, VOCAB

    model = tiny_target("qwen3", seed=SEED, vocab=VOCAB, num_layers=2)
    drafter, _ = tiny_dflash2(model, seed=3, num_layers=2, top_k=6, block_size=4, softcap=None,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    return model, drafter


@pytest.mark.slow
def test_sampled_dflash2_follows_the_target_distribution(sampling_pair, make_tokenizer):
    """Rejection sampling with the selector's q: the first three tokens' distributions are the target's."""
    model, drafter = sampling_pair
    target = TargetModel(model)
    proposers = []

    def fresh(model_, prompt):
        assert prompt == PROMPT
        proposers.append(dflash_proposer(drafter, target, max_block_size=4))
        return proposers[-1]

    n = 700  # ~10 ms per 3-token generation here
    exact = exact_distributions(model, 0.8, 0.8)
    samples, accepted = sample_many(model, make_tokenizer(()), n, 21, fresh, temp=0.8, top_p=0.8)
    assert accepted > 0.06 * n, accepted  # the drafter's tokens really were accepted
    p = pvalues(samples, exact)
    assert min(p.values()) > 1e-4, p


def test_dflash2_on_the_emulated_kernel_path_matches_the_pure_path(tmp_path, monkeypatch):
    """Context injection and the block Q/K preparation run through the (host-emulated) Metal
    kernels for DFlash2 layers too, masks and convolutions included: same hidden states, same draft."""
    from helpers.emulate_metal import EmulatedKernel, compiler_available

    from mlx_dflash import kernels
    from mlx_dflash.kernels import _common

    if not compiler_available():
        pytest.skip("g++ is needed to emulate the Metal kernels")
    target_model = tiny_target("qwen3", seed=0)
    target = TargetModel(target_model)
    drafter, cfg = tiny_dflash2(target_model, seed=5, **SLIDING)
    features = mx.random.normal((1, 14, 2 * target.hidden_size), key=mx.random.key(2))
    last = mx.array([40], dtype=mx.uint32)

    def draft_step():
        proposer = dflash_proposer(drafter, target, max_block_size=cfg["block_size"])
        proposer.commit(features[:, :9], 0)
        proposer.commit(features[:, 9:], 9)
        block = mx.concatenate([last, proposer._masks])
        hidden = drafter(drafter.embed(target, block[None]), proposer.cache, 14)
        draft = proposer.propose(last, 14, cfg["block_size"])
        mx.eval(hidden, draft)
        return np.array(hidden), np.array(draft)

    pure_hidden, pure_draft = draft_step()
    launches = []

    def emulated(spec, kind):
        launches.append(spec.name)
        return EmulatedKernel(spec, tmp_path)

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.setattr(_common, "compiled", emulated)
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    kernels.self_check.forget()
    kernel_hidden, kernel_draft = draft_step()
    kernels.self_check.forget()
    # Each kernel's one self-check launch, then the engine's own.
    assert launches.count("dflash_context_kv") == 1 + 2 and launches.count("dflash_block_qk") == 1 + 2 * 3
    np.testing.assert_allclose(kernel_hidden, pure_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(kernel_draft, pure_draft)


def test_rejection_sampling_accepts_more_than_sample_and_match(make_tokenizer):
    """The same oracle drafter at temperature 1: verified by rejection sampling with its q, it
    accepts far more per cycle than its greedy draft does under sample-and-match."""
    from helpers.tiny_dflash2 import OracleSampledProposer

    from mlx_dflash.decoding.sampling import TargetSampler

    model = cached_target("qwen3", vocab=16)
    prompt = [5, 9, 4, 12, 7]
    taus = {}
    for name, cls in (("rejection", OracleSampledProposer), ("sample-and-match", OracleProposer)):
        lengths = []
        for seed in range(3):
            *_, last = stream_generate(model, make_tokenizer(()), prompt, draft_model=cls(model, prompt),
                                       max_tokens=40, temp=1.0, seed=seed, block_size=5)
            lengths += last.stats.acceptance_lengths
        taus[name] = sum(lengths) / len(lengths)
    assert isinstance(generate_module.make_sampler(1.0), TargetSampler)
    assert taus["rejection"] > taus["sample-and-match"] + 0.5, taus


def test_generate_and_bench_commands_run_a_dflash2_drafter(tmp_path):
    """`dflash-mlx generate` and `bench` take a DFlash2 drafter directory as they take a v1 one."""
    from helpers.tiny import save_target
    from mlx_dflash.cli.main import _register, app
    from typer.testing import CliRunner

    _register()
    model = tiny_target("qwen3", seed=0)
    target_dir = save_target(model, "qwen3", tmp_path / "target")
    _, _, drafter_dir = _saved(tmp_path, model, **SLIDING)

    def run(*args: str) -> dict:
        result = CliRunner().invoke(app, ["generate", "-m", str(target_dir), "--prompt-ids", "5,6,7,8",
                                          "--max-tokens", "16", "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    greedy = run("-d", str(drafter_dir), "--block-size", "6")
    assert greedy["draft"] is True and greedy["token_ids"] == run("--no-draft")["token_ids"]
    sampled = run("-d", str(drafter_dir), "--block-size", "6", "--temp", "0.8", "--top-p", "0.9", "--seed", "3")
    assert sampled["token_ids"] and sampled["finish_reason"] in ("stop", "length")

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say something.\n")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "-m", str(target_dir), "-d", str(drafter_dir), "--dataset",
                                      str(prompts), "--limit", "1", "--max-tokens", "6", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["ok"] is True
