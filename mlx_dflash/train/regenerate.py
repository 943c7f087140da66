"""Regenerate the assistant replies of training data with the target itself.

A drafter is judged on how well it predicts the target's own greedy output;
replies written by another model teach it something else (and a block label
past the first position is then conditioned on tokens the target would not
have produced). Each conversation keeps its prompt (everything before its
first assistant turn) and gets the target's greedy reply instead.

Plain-attention families decode many prompts at once: prompts are left-padded
and padding is masked out of every attention (RoPE is relative, so a row's
shifted positions do not change its scores). Other families decode one prompt
at a time through the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..generate import stream_generate
from ..targets.model import TargetModel
from .data import Conversation, prompt_ids

# Families whose layers take one (B, 1, L, S) mask for every layer, with no sliding window.
BATCHED_FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral")


def can_batch(target: TargetModel) -> bool:
    return target.model_type in BATCHED_FAMILIES and not getattr(target.args, "sliding_window", None)


def decoder_layers(target: TargetModel, h: mx.array, mask: mx.array, cache: list[Any]) -> mx.array:
    """The decoder layers and final norm over embeddings `h`, under one boolean `mask` (B, 1, L, S) for every layer."""
    for layer, c in zip(target.inner.layers, cache, strict=True):
        h = layer(h, mask, c)
    return target.inner.norm(h)


def batched_greedy(target: TargetModel, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                   stop: set[int], pad_id: int = 0) -> list[list[int]]:
    """Greedy replies (stop token excluded) for several prompts decoded together."""
    P = max(len(p) for p in prompts)
    rows = [[pad_id] * (P - len(p)) + list(p) for p in prompts]
    # keys_valid[b, s]: position s of row b is a real token (padding is never attended).
    keys_valid = mx.array([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    causal = mx.tril(mx.ones((P, P), dtype=mx.bool_))
    # A padding query still sees itself, so no softmax row is empty.
    mask = (causal & keys_valid[:, None, :]) | mx.eye(P, dtype=mx.bool_)
    cache = target.make_cache()
    hidden = decoder_layers(target, target.embed(mx.array(rows)), mask[:, None], cache)
    next_tokens = mx.argmax(target.logits(hidden[:, -1]), axis=-1)
    replies: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_tokens):
        # One sync per step: the tokens decide which rows are finished.
        for b, t in enumerate(next_tokens.tolist()):
            if not done[b]:
                done[b] = t in stop
                if not done[b]:
                    replies[b].append(t)
        if all(done) or step == max_tokens - 1:
            break
        keys_valid = mx.concatenate([keys_valid, mx.ones((len(prompts), 1), dtype=mx.bool_)], axis=1)
        hidden = decoder_layers(target, target.embed(next_tokens[:, None]), keys_valid[:, None, None, :], cache)
        next_tokens = mx.argmax(target.logits(hidden[:, -1]), axis=-1)
    return replies


def _one_greedy(target: TargetModel, tokenizer: Any, prompt: Sequence[int], max_tokens: int) -> list[int]:
    tokens: list[int] = []
    for event in stream_generate(target, tokenizer, list(prompt), max_tokens=max_tokens):
        tokens.extend(event.tokens)
    return tokens


def regenerate(target: TargetModel, tokenizer: Any, conversations: Sequence[Conversation], *,
               max_tokens: int = 256, max_prompt_tokens: int | None = None, batch_size: int = 16,
               skip: int = 0, on_batch: Callable[[int], None] | None = None,
               on_start: Callable[[int], None] | None = None) -> Iterator[Conversation]:
    """Each conversation's prompt with the target's greedy reply.

    Replies come out in order of prompt length (ties in input order), which keeps
    the padding of a batch small and the order deterministic: `skip` resumes after
    that many replies. Prompts over `max_prompt_tokens` are left out; `on_start`
    receives how many replies there will be in all.
    """
    stop = set(tokenizer.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    items = [(c, prompt_ids(tokenizer, c)) for c in conversations]
    if max_prompt_tokens is not None:
        items = [(c, p) for c, p in items if len(p) <= max_prompt_tokens]
    items.sort(key=lambda item: len(item[1]))
    if on_start is not None:
        on_start(len(items))
    step = batch_size if can_batch(target) else 1
    for start in range(skip, len(items), step):
        chunk = items[start:start + step]
        prompts = [p for _, p in chunk]
        if step > 1:
            replies = batched_greedy(target, prompts, max_tokens=max_tokens, stop=stop, pad_id=pad_id)
        else:
            replies = [_one_greedy(target, tokenizer, p, max_tokens) for p in prompts]
        for (conversation, _), reply in zip(chunk, replies, strict=True):
            first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
            yield [*conversation[:first], {"role": "assistant", "content": tokenizer.decode(reply)}]
        if on_batch is not None:
            on_batch(len(chunk))


REGENERATED = "regenerated.jsonl"


def _read_jsonl(path: Path) -> list[Conversation]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def regenerated_conversations(target: TargetModel, tokenizer: Any, conversations: Sequence[Conversation],
                              path: Path, *, max_tokens: int, max_prompt_tokens: int | None, batch_size: int,
                              progress: Callable[[int, int], None] | None = None) -> list[Conversation]:
    """The regenerated conversations, written to `path` (JSONL of {"messages"}) and reused from there.

    Replies are appended to `path`.partial as each batch finishes, so an interrupted
    run continues where it stopped; the file is renamed into place when complete.
    """
    if path.exists():
        return _read_jsonl(path)
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    done = _read_jsonl(partial) if partial.exists() else []
    total = 0

    def started(n: int) -> None:
        nonlocal total
        total = n
        if progress is not None:
            progress(len(done), total)

    with partial.open("a") as f:
        for conversation in regenerate(target, tokenizer, conversations, max_tokens=max_tokens,
                                       max_prompt_tokens=max_prompt_tokens, batch_size=batch_size, skip=len(done),
                                       on_start=started):
            f.write(json.dumps({"messages": conversation}) + "\n")
            done.append(conversation)
            if progress is not None and (len(done) % batch_size == 0 or len(done) == total):
                f.flush()
                progress(len(done), total)
    partial.rename(path)
    return done
