"""Regenerated training replies are exactly the target's own greedy output."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.tiny import greedy_reference, save_target, tiny_target

from mlx_dflash.loading.loaders import load_target
from mlx_dflash.targets.model import TargetModel
from mlx_dflash.train.data import prompt_ids
from mlx_dflash.train.regenerate import batched_greedy, can_batch, regenerate


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_batched_greedy_equals_one_prompt_at_a_time(model_type):
    model = tiny_target(model_type, seed=11)
    target = TargetModel(model)
    assert can_batch(target)
    rng = np.random.default_rng(0)
    # Very different lengths: short rows carry a lot of left padding.
    prompts = [rng.integers(4, 128, size=n).tolist() for n in (3, 17, 9, 30, 1)]
    stop = {5}
    replies = batched_greedy(target, prompts, max_tokens=12, stop=stop, pad_id=0)
    for prompt, reply in zip(prompts, replies, strict=True):
        expected = greedy_reference(model, prompt, 12)
        cut = next((i for i, t in enumerate(expected) if t in stop), len(expected))
        assert reply == expected[:cut], (prompt, reply, expected)


def test_regenerate_keeps_prompts_replaces_replies_and_resumes(tmp_path):
    model = tiny_target("qwen3", seed=12)
    target_dir = save_target(model, "qwen3", tmp_path / "target")
    model, tokenizer = load_target(target_dir)
    target = TargetModel(model)
    conversations = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc" * n},
         {"role": "assistant", "content": "not the target's words"}, {"role": "user", "content": "more"},
         {"role": "assistant", "content": "dropped"}]
        for n in (4, 1, 7, 2, 30)
    ]
    batches = []
    out = list(regenerate(target, tokenizer, conversations, max_tokens=10, batch_size=2,
                          max_prompt_tokens=60, on_batch=batches.append))
    kept = [c for c in conversations if len(prompt_ids(tokenizer, c)) <= 60]
    assert len(out) == len(kept) == 4 and sum(batches) == 4 and batches == [2, 2]
    # Shortest prompts first; each keeps its prompt and gets the target's own reply.
    assert [len(c[1]["content"]) for c in out] == sorted(len(c[1]["content"]) for c in kept)
    for c in out:
        assert c[:2] == kept[[k[1]["content"] for k in kept].index(c[1]["content"])][:2]
        assert len(c) == 3 and c[2]["role"] == "assistant"
        prompt = prompt_ids(tokenizer, c)
        expected = greedy_reference(model, prompt, 10)
        stop = set(tokenizer.eos_token_ids)
        cut = next((i for i, t in enumerate(expected) if t in stop), len(expected))
        assert c[2]["content"] == tokenizer.decode(expected[:cut])
    # Resuming after the first batch gives the rest, unchanged.
    assert list(regenerate(target, tokenizer, conversations, max_tokens=10, batch_size=2, max_prompt_tokens=60,
                           skip=2)) == out[2:]


def test_regenerated_file_continues_after_an_interruption(tmp_path):
    from mlx_dflash.train.regenerate import regenerated_conversations

    model = tiny_target("qwen3", seed=13)
    model, tokenizer = load_target(save_target(model, "qwen3", tmp_path / "target"))
    target = TargetModel(model)
    conversations = [[{"role": "user", "content": "xy" * n}, {"role": "assistant", "content": "z"}]
                     for n in range(1, 8)]
    kwargs = dict(max_tokens=6, max_prompt_tokens=None, batch_size=3)
    reports = []
    full = regenerated_conversations(target, tokenizer, conversations, tmp_path / "a" / "regen.jsonl",
                                     progress=lambda d, t: reports.append((d, t)), **kwargs)
    assert len(full) == 7 and reports[0] == (0, 7) and reports[-1] == (7, 7)
    assert not (tmp_path / "a" / "regen.jsonl.partial").exists()
    # An interrupted run left three replies behind: the rest is generated, nothing twice.
    lines = (tmp_path / "a" / "regen.jsonl").read_text().splitlines()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "regen.jsonl.partial").write_text("\n".join(lines[:3]) + "\n")
    resumed = regenerated_conversations(target, tokenizer, conversations, tmp_path / "b" / "regen.jsonl", **kwargs)
    assert resumed == full
    assert (tmp_path / "b" / "regen.jsonl").read_text() == (tmp_path / "a" / "regen.jsonl").read_text()
    # A finished file is reused as it is.
    assert regenerated_conversations(target, tokenizer, [], tmp_path / "a" / "regen.jsonl", **kwargs) == full
