"""The PyTorch trainer computes what the MLX trainer computes, and its job's output drafts losslessly here.

Forward (drafter and target), one optimizer step and the schedule are compared with
the MLX side on the same weights and batch; the GPU job runs end to end on the CPU at
tiny size, and what it writes converts with `dflash-mlx convert` and drafts.
"""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import EOS_ID, greedy_reference, save_target, self_reply_chat, tiny_drafter, tiny_target
from mlx.utils import tree_flatten

from mlx_dflash.targets.model import TargetModel
from mlx_dflash.train import recipe
from mlx_dflash.train.data import Example

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mlx_dflash.train import torch_job  # noqa: E402
from mlx_dflash.train.model import block_token_ids as mlx_block_ids  # noqa: E402
from mlx_dflash.train.model import draft_blocks as mlx_draft_blocks  # noqa: E402
from mlx_dflash.train.torch_model import TorchDFlashDrafter, block_token_ids, draft_blocks  # noqa: E402
from mlx_dflash.train.torch_target import load_torch_target  # noqa: E402
from mlx_dflash.train.torch_trainer import TorchTrainConfig, TorchTrainer  # noqa: E402

BLOCK = 8
TOL = 1e-4


def _np(x) -> np.ndarray:
    return np.array(x.astype(mx.float32)) if isinstance(x, mx.array) else x.detach().float().cpu().numpy()


def _close(a, b, tol: float = TOL) -> float:
    a, b = _np(a), _np(b)
    err = float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))
    assert err < tol, f"relative error {err:.2e}"
    return err


def _torch_drafter(mlx_drafter, config: dict) -> TorchDFlashDrafter:
    drafter = TorchDFlashDrafter(config)
    weights = {k: torch.tensor(np.array(v)) for k, v in tree_flatten(mlx_drafter.parameters())}
    drafter.load_state_dict(weights, strict=True)  # the z-lab names on both sides
    return drafter


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    """A tiny MLX target, the same weights as a Hugging Face model in PyTorch, and a random drafter."""
    from helpers.tiny import drafter_config

    model = tiny_target(request.param, seed=3)
    path = save_target(model, request.param, tmp_path_factory.mktemp(request.param) / "target")
    drafter = tiny_drafter(model, seed=4, num_layers=2, block_size=BLOCK)
    config = drafter_config(model, num_layers=2, block_size=BLOCK)
    return TargetModel(model), load_torch_target(path), drafter, config


def test_target_features_and_logits_equal_mlx(pair):
    target, torch_target, drafter, _ = pair
    tokens = np.random.default_rng(0).integers(4, 128, size=(2, 33))
    layers = drafter.target_layer_ids + [target.num_layers - 1]  # the last layer: before the final norm
    hidden, features = target.forward(mx.array(tokens), target.make_cache(), layers)
    t_hidden, t_features = torch_target.forward(torch.tensor(tokens), layers)
    _close(t_features, features)
    _close(torch_target.logits(t_hidden), target.logits(hidden))


def test_drafter_training_forward_equals_mlx(pair):
    target, torch_target, drafter, config = pair
    T = 40
    tokens = np.random.default_rng(1).integers(4, 128, size=(2, T))
    anchors = np.array([[0, 5, 9, 30, 36], [3, 4, 17, 20, 39]])  # overlapping, at 0, past the end
    _, features = target.forward(mx.array(tokens), target.make_cache(), drafter.target_layer_ids)
    ids = mlx_block_ids(mx.array(tokens), mx.array(anchors), BLOCK, drafter.mask_token_id)
    expected = target.logits(mlx_draft_blocks(drafter, target.embed(ids), features, mx.array(anchors)))

    t_drafter = _torch_drafter(drafter, config)
    t_tokens, t_anchors = torch.tensor(tokens), torch.tensor(anchors)
    _, t_features = torch_target.forward(t_tokens, drafter.target_layer_ids)
    t_ids = block_token_ids(t_tokens, t_anchors, BLOCK, drafter.mask_token_id)
    with torch.no_grad():
        got = torch_target.logits(draft_blocks(t_drafter, torch_target.embed(t_ids), t_features, t_anchors))
    _close(got, expected)


def test_greedy_replies_equal_mlx_batched_greedy(pair):
    from mlx_dflash.train.regenerate import batched_greedy

    target, torch_target, _, _ = pair
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 128, size=n).tolist() for n in (3, 9, 5)]
    expected = batched_greedy(target, prompts, max_tokens=12, stop={EOS_ID})
    got = torch_target.greedy(prompts, max_new_tokens=12, stop=[EOS_ID], pad_id=0)
    assert [r for r, _ in got] == expected
    for p, (reply, stop) in zip(prompts, got, strict=True):
        full = greedy_reference(target.model, p, len(reply) + 1)
        assert full[: len(reply)] == reply
        assert stop is None or full[len(reply)] == stop


def test_schedule_equals_mlx_schedule(tmp_path):
    from mlx_dflash.train.trainer import TrainConfig, Trainer

    config = TrainConfig(target="x", data=["x"], out=str(tmp_path), steps=50, warmup=0.1, lr=2e-3, min_lr_ratio=0.2)
    schedule = Trainer._schedule(type("T", (), {"config": config})())
    for step in (0, 1, 4, 5, 6, 20, 49, 50, 80):
        want = schedule(mx.array(step)).item()
        got = recipe.learning_rate(step, lr=2e-3, steps=50, warmup=0.1, min_lr_ratio=0.2)
        assert abs(got - want) < 1e-9 * max(1.0, want * 1e6), (step, got, want)


@pytest.fixture(scope="module")
def training_setup(tmp_path_factory):
    """A tiny llama target whose next token depends on the current one, and ShareGPT data of its own replies."""
    root = tmp_path_factory.mktemp("torchtrain")
    target_dir, data = self_reply_chat(root, "llama", conversations=40, max_tokens=30, sharegpt=True)
    return root, target_dir, data


def test_one_optimizer_step_equals_the_mlx_trainer(training_setup):
    from mlx_dflash.train.anchors import make_batch
    from mlx_dflash.train.trainer import TrainConfig, Trainer

    root, target_dir, data = training_setup
    config = TrainConfig(target=str(target_dir), data=[str(data)], out=str(root / "mlx"), layers=2,
                         target_layers=[1, 2], block_size=BLOCK, steps=20, batch=3, lr=3e-3, warmup=0.1,
                         seq_len=64, blocks_per_seq=6, heldout=4, eval_prompts=2, save_every=0, seed=0)
    trainer = Trainer(config)
    # The batch the MLX step will draw, drawn the same way from copies of its stream and RNG.
    stream, rng = copy.deepcopy(trainer.stream), copy.deepcopy(trainer.rng)
    batch = make_batch([stream.next() for _ in range(config.batch)], config.blocks_per_seq, rng, trainer.pad_id)

    torch_target = load_torch_target(target_dir)
    drafter_cfg = recipe.drafter_config(trainer.args)
    t_drafter = _torch_drafter(trainer.drafter, drafter_cfg)
    t_trainer = TorchTrainer(torch_target, t_drafter,
                             TorchTrainConfig(steps=20, batch=3, blocks_per_seq=6, lr=3e-3, warmup=0.1),
                             pad_id=trainer.pad_id, feature_scale=torch.tensor(np.array(trainer.feature_scale)))
    initial = {k: np.array(v) for k, v in tree_flatten(trainer.drafter.parameters())}
    loss, _, _ = trainer.train_step()
    # The MLX step drew the batch built above: its stream moved exactly as the copy did.
    assert trainer.stream.state() == stream.state()
    result = t_trainer.train_step(batch)
    assert abs(result.loss - loss) < TOL * max(1.0, abs(loss)), (result.loss, loss)
    mlx_weights = dict(tree_flatten(trainer.drafter.parameters()))
    torch_weights = t_drafter.state_dict()
    assert set(torch_weights) == set(mlx_weights)
    for name, value in mlx_weights.items():
        _close(torch_weights[name], value)
    # The step moved the weights, so equal weights are not merely equal starting points.
    assert max(float(np.abs(_np(mlx_weights[k]) - initial[k]).max()) for k in initial) > 1e-4


def test_feature_scale_equals_mlx(training_setup):
    from mlx_dflash.train.trainer import TrainConfig, Trainer

    root, target_dir, data = training_setup
    config = TrainConfig(target=str(target_dir), data=[str(data)], out=str(root / "scale"), layers=1,
                         target_layers=[1, 2], block_size=BLOCK, seq_len=64, heldout=4, seed=0)
    trainer = Trainer(config)
    stream = copy.deepcopy(trainer.stream)
    stream.restore({"epoch": 0, "index": 0})
    examples = [stream.next() for _ in range(8)]
    t_trainer = TorchTrainer(load_torch_target(target_dir), TorchDFlashDrafter(recipe.drafter_config(trainer.args)),
                             TorchTrainConfig())
    _close(t_trainer.measure_feature_scale(examples), trainer.feature_scale)


def test_job_end_to_end_converts_and_drafts_losslessly(training_setup, tmp_path):
    """prepare (MLX) -> run (PyTorch, CPU) -> `dflash-mlx convert` -> drafting equals the target alone."""
    from mlx_dflash.cli.main import _register, app
    from typer.testing import CliRunner

    from mlx_dflash.generate import stream_generate
    from mlx_dflash.loading.loaders import load_drafter, load_target

    root, target_dir, data = training_setup
    job = tmp_path / "job"
    assert torch_job.main(["prepare", "--target", str(target_dir), "--data", str(data), "--out", str(job),
                           "--layers", "1", "--target-layers", "1,2", "--block-size", str(BLOCK),
                           "--heldout", "4"]) == 0
    spec = json.loads((job / "job.json").read_text())
    assert spec["drafter"]["dflash_config"]["target_layer_ids"] == [1, 2] and spec["stop"] == [EOS_ID]
    out = tmp_path / "out"
    # Shards of at most 40 kB force the sharded layout the GPU run writes (16 MiB there).
    code = torch_job.main(["run", "--job", str(job), "--target", str(target_dir), "--out", str(out),
                           "--device", "cpu", "--no-autocast", "--minutes", "0.3", "--regen-minutes", "0.1",
                           "--max-new-tokens", "24", "--regen-batch", "8", "--batch", "4", "--blocks-per-seq", "8",
                           "--lr", "3e-3", "--export-margin-seconds", "5", "--shard-bytes", "40000"])
    assert code == 0
    drafter_dir = out / "drafter"
    shards = sorted(drafter_dir.glob("*.safetensors"))
    assert len(shards) > 1 and all(p.stat().st_size <= 40000 + 4096 for p in shards)
    assert (drafter_dir / "model.safetensors.index.json").exists()
    replies = np.load(out / "replies.npz")
    assert len(replies["reply_offsets"]) - 1 == len(replies["reply_stop"]) > 0
    log = (out / "log.txt").read_text()
    done = json.loads(log.strip().splitlines()[-1].split("] ", 1)[1])
    assert done["event"] == "done" and done["steps"] > 5
    assert done["tau_block"] > 1.5  # this target's next token follows its current one: easy to learn

    # A second run keeps the first run's replies and regenerates none of their prompts.
    again = tmp_path / "again"
    assert torch_job.main(["run", "--job", str(job), "--target", str(target_dir), "--out", str(again),
                           "--device", "cpu", "--no-autocast", "--minutes", "0.1", "--regen-minutes", "0",
                           "--max-new-tokens", "24", "--batch", "4", "--blocks-per-seq", "8",
                           "--export-margin-seconds", "2", "--replies", str(out / "replies.npz"),
                           "--eval-prompts", "1"]) == 0
    reused = (again / "log.txt").read_text()
    kept = len(replies["reply_stop"])
    assert f"regenerate: {kept} replies reused, {spec['train_prompts'] - kept} prompts to go" in reused
    assert len(np.load(again / "replies.npz")["reply_stop"]) == kept  # no budget: nothing new

    _register()
    converted = tmp_path / "converted"
    result = CliRunner().invoke(app, ["convert", str(drafter_dir), str(converted)])
    assert result.exit_code == 0, result.output
    model, tokenizer = load_target(target_dir)
    draft = load_drafter(converted)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
    tokens, lengths = [], []
    for event in stream_generate(model, tokenizer, prompt, draft_model=draft, max_tokens=24, block_size=BLOCK):
        tokens.extend(event.tokens)
        if event.stats is not None:
            lengths = event.stats.acceptance_lengths
    assert tokens == greedy_reference(model, prompt, len(tokens))
    assert np.mean(lengths) > 1.0  # the converted drafter drafts tokens the target accepts


def test_examples_mark_the_reply_and_its_stop_token():
    examples = torch_job._examples([[5, 6, 7], [8]], [([9, 10], 2), ([11], None)], seq_len=100)
    assert examples == [Example([5, 6, 7, 9, 10, 2], [False] * 3 + [True] * 3)]  # one-token reply dropped


def test_every_turn_prompts_start_with_the_first_turn_prompt(training_setup):
    from mlx_dflash.loading.loaders import load_target
    from mlx_dflash.train.data import prompt_ids, turn_prompts

    _, target_dir, _ = training_setup
    _, tokenizer = load_target(target_dir)
    conversation = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"},
                    {"role": "user", "content": "ef"}, {"role": "assistant", "content": "gh"}]
    first, second = turn_prompts(tokenizer, conversation)
    assert first == prompt_ids(tokenizer, conversation)
    # The second prompt holds the first exchange (the data's reply) as history, then the new user turn.
    assert second[: len(first)] == first
    assert "cd" in tokenizer.decode(second[len(first):]) and "ef" in tokenizer.decode(second[len(first):])
