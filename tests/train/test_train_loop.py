"""Training end to end on a tiny target: learning, exact resume, export round trip, the CLI."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import self_reply_chat
from mlx.utils import tree_flatten
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

from mlx_dflash.drafters.draft_cache import DraftContextCache
from mlx_dflash.drafters.injection import ContextInjector
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading.loaders import load_drafter, load_target
from mlx_dflash.targets.model import TargetModel
from mlx_dflash.train import TrainConfig, Trainer, export_drafter
from mlx_dflash.train.data import load_conversations, render
from mlx_dflash.train.evaluate import measure_tau

_register()
BLOCK = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and chat data whose replies are the target's own (learnable) greedy continuations."""
    root = tmp_path_factory.mktemp("train")
    target_dir, data = self_reply_chat(root, "qwen3", conversations=48, max_tokens=40)
    return root, str(target_dir), str(data)


def _config(setup, out: str, **kw) -> TrainConfig:
    root, target, data = setup
    base = dict(target=target, data=[data], out=str(root / out), layers=1, target_layers=[1, 2], block_size=BLOCK,
                steps=40, batch=4,
                lr=3e-3, warmup=0.1, seq_len=64, blocks_per_seq=16, heldout=6, eval_prompts=6, eval_max_tokens=32,
                save_every=0, eval_every=0, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_data_formats_and_assistant_mask(setup, tmp_path):
    _, target, data = setup
    _, tokenizer = load_target(target)
    share = tmp_path / "share.json"
    share.write_text(json.dumps([{"id": "x", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
        {"from": "human", "value": "ok"}, {"from": "gpt", "value": "bye"}]}, {"conversations": "junk"}]))
    (conv,) = load_conversations([share])
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
    example = render(tokenizer, conv, 100)
    text = tokenizer.decode(example.ids)
    assistant = tokenizer.decode([t for t, m in zip(example.ids, example.mask, strict=True) if m])
    assert text == "<u>hi</s><a>yo</s><u>ok</s><a>bye</s>"
    assert assistant == "yo</s>bye</s>"  # each reply and its end-of-turn marker, nothing else
    assert len(load_conversations([data])) == 48
    cut = render(tokenizer, conv, 9)
    assert len(cut.ids) == 9 and len(cut.mask) == 9
    with pytest.raises(DFlashError, match="no such data file"):
        load_conversations([tmp_path / "missing.jsonl"])
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{not json\n')
    with pytest.raises(DFlashError, match="line 2"):
        load_conversations([tmp_path / "bad.jsonl"])


@pytest.fixture(scope="module")
def learned(setup):
    """A drafter trained for 40 steps (once for the module), with its untrained tau and step losses."""
    trainer = Trainer(_config(setup, "learn"))
    untrained = trainer.evaluate().tau
    losses = []
    result = trainer.run(lambda e: losses.append(e.loss) if e.kind == "step" else None)
    return trainer, untrained, losses, result


def test_loss_falls_and_trained_drafter_beats_untrained(learned):
    trainer, untrained, losses, result = learned
    assert result.status == "finished" and result.step == 40 and len(losses) == 40
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    # Tau through the real engine on held-out prompts (never trained on).
    assert untrained < 1.5 and result.tau is not None and result.tau > untrained + 1.0, (untrained, result.tau)
    assert (result.drafter_dir / "config.json").exists()
    log = [json.loads(line) for line in (result.out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 41))


def test_resume_equals_straight_run(setup):
    straight = Trainer(_config(setup, "straight", steps=8))
    straight.run()

    def stop_at_4(event):
        if event.kind == "step" and event.step == 4:
            raise KeyboardInterrupt

    first = Trainer(_config(setup, "resumed", steps=8))
    assert first.run(stop_at_4).status == "interrupted"
    second = Trainer(_config(setup, "resumed", steps=8), resume=True)
    assert second.step == 4
    assert second.run().step == 8
    a = dict(tree_flatten(straight.drafter.parameters()))
    b = dict(tree_flatten(second.drafter.parameters()))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(np.array(a[key]), np.array(b[key]), atol=1e-5, rtol=1e-5, err_msg=key)
    # ... and the optimizer's moments too (the next step would differ otherwise).
    sa, sb = dict(tree_flatten(straight.optimizer.state)), dict(tree_flatten(second.optimizer.state))
    assert sa.keys() == sb.keys()
    for key in sa:
        np.testing.assert_allclose(np.array(sa[key]), np.array(sb[key]), atol=1e-5, rtol=1e-4, err_msg=key)


def test_a_resumed_run_changes_its_learning_rate_only_when_asked(setup):
    def stop_at_4(event):
        if event.kind == "step" and event.step == 4:
            raise KeyboardInterrupt

    def rates(name: str) -> list[float]:
        log = (setup[0] / name / "train_log.jsonl").read_text().splitlines()
        return [r["lr"] for r in map(json.loads, log) if "loss" in r]

    for name, lr, change in (("kept", 1e-2, ()), ("changed", 1e-2, ("lr",))):
        assert Trainer(_config(setup, name, steps=8)).run(stop_at_4).status == "interrupted"
        resumed = Trainer(_config(setup, name, steps=8, lr=lr), resume=True, change=change)
        assert resumed.config.lr == (lr if change else 3e-3)
        resumed.run()
    kept, changed = rates("kept"), rates("changed")
    assert len(kept) == len(changed) == 8 and kept[:4] == changed[:4]
    # The schedule is proportional to its peak: from step 5 on, the new peak's.
    np.testing.assert_allclose(np.array(changed[4:]) / np.array(kept[4:]), 1e-2 / 3e-3, rtol=1e-5)
    with pytest.raises(DFlashError, match="cannot change layers"):
        Trainer(_config(setup, "kept", steps=8), resume=True, change=("layers",))


def test_regenerated_training_data_and_target_initialisation(setup):
    trainer = Trainer(_config(setup, "regen", steps=2, regenerate=5, regenerate_max_tokens=12))
    path = trainer.out / "regenerated.jsonl"
    lines = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    assert len(lines) == 5 and trainer.stream.conversations == lines
    # The drafter starts from the target's final norm and top layer.
    top = trainer.target.inner.layers[-1]
    np.testing.assert_array_equal(np.array(trainer.drafter.norm.weight), np.array(trainer.target.inner.norm.weight))
    np.testing.assert_array_equal(np.array(trainer.drafter.layers[-1].self_attn.v_proj.weight),
                                  np.array(top.self_attn.v_proj.weight))
    assert trainer.run().step == 2


def test_resume_without_checkpoint_is_a_clear_error(setup):
    with pytest.raises(DFlashError, match="no checkpoint"):
        Trainer(_config(setup, "never-trained"), resume=True)


def _draft_logits(drafter, target: TargetModel, tokens: mx.array, anchor: int) -> mx.array:
    _, features = target.forward(tokens[None], target.make_cache(), drafter.target_layer_ids)
    args = drafter.args
    cache = DraftContextCache(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, max_block_size=BLOCK)
    ContextInjector(drafter)(features[:, :anchor], 0, cache)
    block = mx.array([[int(tokens[anchor])] + [args.mask_token_id] * (BLOCK - 1)], dtype=mx.uint32)
    return target.logits(drafter(target.embed(block), cache, anchor))


def test_export_round_trip(setup, tmp_path):
    trainer = Trainer(_config(setup, "export", steps=3))
    result = trainer.run()
    target = trainer.target
    tokens = mx.array(np.random.default_rng(2).integers(4, 128, size=30), dtype=mx.uint32)
    from mlx_dflash.train.evaluate import frozen_copy

    # The engine and the export take the drafter with the feature scale folded into fc.
    drafter = trainer.inference_drafter()
    reference = _draft_logits(frozen_copy(drafter), target, tokens, 20)
    run_export = load_drafter(result.drafter_dir, target)
    np.testing.assert_allclose(np.array(_draft_logits(run_export, target, tokens, 20)), np.array(reference),
                               atol=1e-5)
    path = export_drafter(drafter, tmp_path / "fp32", dtype=mx.float32)
    config = json.loads((path / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == trainer.args.mask_token_id
    assert config["dflash_config"]["target_layer_ids"] == trainer.args.target_layer_ids
    keys = set(mx.load(str(path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in keys)
    loaded = load_drafter(path, target)
    np.testing.assert_allclose(np.array(_draft_logits(loaded, target, tokens, 20)), np.array(reference), atol=1e-5)
    half = load_drafter(export_drafter(drafter, tmp_path / "fp16"), target, dtype=mx.float32)
    np.testing.assert_allclose(np.array(_draft_logits(half, target, tokens, 20)), np.array(reference),
                               atol=0.05, rtol=0.02)
    quant = load_drafter(export_drafter(drafter, tmp_path / "q8", dtype=mx.float32, quantize_bits=8,
                                        group_size=32), target)
    assert "quantization" in json.loads((tmp_path / "q8" / "config.json").read_text())
    q_logits = np.array(_draft_logits(quant, target, tokens, 20))
    np.testing.assert_allclose(q_logits, np.array(reference), atol=0.25)
    assert (q_logits.argmax(-1) == np.array(reference).argmax(-1)).mean() > 0.8


def test_quantized_drafter_keeps_the_fp32_drafters_tau(learned, tmp_path):
    """The engine-based tau measurement takes an exported 8-bit drafter, and 8 bits cost little acceptance."""
    trainer, _, _, _ = learned
    drafter = trainer.inference_drafter()
    quant = load_drafter(export_drafter(drafter, tmp_path / "q8", dtype=mx.float32, quantize_bits=8,
                                        group_size=32), trainer.target)
    assert hasattr(quant.layers[0].self_attn.q_proj, "scales")
    prompts = trainer.eval_prompts
    fp32 = measure_tau(trainer.target, trainer.tokenizer, drafter, prompts, max_tokens=32, block_size=BLOCK)
    q8 = measure_tau(trainer.target, trainer.tokenizer, quant, prompts, max_tokens=32, block_size=BLOCK)
    assert fp32.tau > 2.0, fp32.tau  # a drafter worth comparing
    assert q8.num_tokens == fp32.num_tokens  # lossless either way: the same greedy tokens
    assert abs(q8.tau - fp32.tau) <= 0.15 * fp32.tau, (q8.tau, fp32.tau)


def test_cli_trains_and_reports_bad_input(setup):
    root, target, data = setup
    out = root / "cli"
    result = CliRunner().invoke(app, [
        "train", "--target", target, "--data", data, "--out", str(out), "--layers", "1", "--block-size", "8",
        "--target-layers", "1,2", "--steps", "2", "--seq-len", "64", "--eval-prompts", "1",
    ])
    assert result.exit_code == 0, result.output
    assert "finished at step 2" in result.output
    assert (out / "drafter" / "model.safetensors").exists() and (out / "checkpoint" / "state.json").exists()
    missing = CliRunner().invoke(app, ["train", "--target", target, "--data", str(root / "nope.jsonl"), "--out",
                                       str(root / "cli2")])
    assert missing.exit_code != 0
    assert isinstance(missing.exception, DFlashError) and "no such data file" in str(missing.exception)
