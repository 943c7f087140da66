"""Many replies at once with MLX: each prompt's greedy reply and some sampled ones, for the training corpus.

Prompts are left-padded and padding is masked out of every attention, as in
`regenerate.batched_greedy` (same families). Each prompt is prefilled once; its
K/V rows are then repeated for its greedy row and its sampled rows. Rows that
end (a stop token) are dropped from the batch in groups, so long replies do not
keep paying for finished ones.

A sampled row draws by the Gumbel-max rule (argmax of logits / temperature plus
Gumbel noise: plain temperature sampling, no top-k or top-p) with a key of its
own, made from (seed, prompt id, sample number) and split once per step; its
reply therefore does not depend on which rows share its batch or on the batch
size (up to floating-point ties).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..targets.model import TargetModel
from .regenerate import decoder_layers

# (reply tokens without the stop token, the stop token that ended it or None at the length limit)
Reply = tuple[list[int], int | None]


@dataclass(frozen=True)
class Sampling:
    """What each prompt gets: the greedy reply, then `sampled` replies at `temperature`, keys from `seed`."""

    sampled: int = 1
    temperature: float = 0.8
    seed: int = 0
    max_new_tokens: int = 384

    @property
    def replies_per_prompt(self) -> int:
        return 1 + self.sampled


def row_key(seed: int, prompt_id: int, sample: int) -> np.ndarray:
    """The MLX PRNG key (two uint32) of one sampled row: fixed by the corpus seed, the prompt and the sample."""
    return np.random.SeedSequence([seed, prompt_id, sample]).generate_state(2, dtype=np.uint32)


def _split_keys(keys: mx.array) -> tuple[mx.array, mx.array]:
    both = mx.vmap(mx.random.split)(keys)  # (N, 2, 2)
    return both[:, 0], both[:, 1]


def _gumbel(keys: mx.array, vocab: int) -> mx.array:
    return mx.vmap(lambda k: mx.random.gumbel(shape=(vocab,), key=k))(keys)


def _take_rows(cache: list, rows: mx.array) -> None:
    for c in cache:
        c.keys, c.values = c.keys[rows], c.values[rows]


def decode_replies(target: TargetModel, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int],
                   sampling: Sampling, *, stop: set[int], pad_id: int = 0) -> list[list[Reply]]:
    """For each prompt, its greedy reply then its `sampling.sampled` sampled replies.

    `prompt_ids` name the prompts in the corpus (they seed the sampled rows). A row stops at a
    stop token (kept apart from the reply) or after `max_new_tokens` tokens.
    """
    if len(prompts) != len(prompt_ids):
        raise ValueError("one prompt id per prompt")
    R = sampling.replies_per_prompt
    P = max(len(p) for p in prompts)
    keys_valid = mx.array([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    causal = mx.tril(mx.ones((P, P), dtype=mx.bool_))
    mask = (causal & keys_valid[:, None, :]) | mx.eye(P, dtype=mx.bool_)  # a padding query sees itself
    cache = target.make_cache()
    rows_in = mx.array([[pad_id] * (P - len(p)) + list(p) for p in prompts])
    hidden = decoder_layers(target, target.embed(rows_in), mask[:, None], cache)
    logits = target.logits(hidden[:, -1]).astype(mx.float32)
    if R > 1:  # row r is prompt r // R, greedy when r % R == 0
        everything = [logits, keys_valid, *(a for c in cache for a in (c.keys, c.values))]
        mx.eval(everything)
        logits, keys_valid = mx.repeat(logits, R, axis=0), mx.repeat(keys_valid, R, axis=0)
        for c in cache:
            c.keys, c.values = mx.repeat(c.keys, R, axis=0), mx.repeat(c.values, R, axis=0)
    n = len(prompts) * R
    greedy = mx.array([r % R == 0 for r in range(n)])
    keys = mx.array(np.stack([row_key(sampling.seed, int(prompt_ids[r // R]), r % R) for r in range(n)]))
    inv_temperature = 1.0 / max(sampling.temperature, 1e-6)
    replies: list[list[int]] = [[] for _ in range(n)]
    ended: list[int | None] = [None] * n
    live = list(range(n))  # the corpus row of each batch row
    done = [False] * n  # by batch row
    for step in range(sampling.max_new_tokens):
        tokens = mx.argmax(logits, axis=-1)
        if R > 1:
            keys, use = _split_keys(keys)
            drawn = mx.argmax(logits * inv_temperature + _gumbel(use, logits.shape[-1]), axis=-1)
            tokens = mx.where(greedy, tokens, drawn)
        for b, t in enumerate(tokens.tolist()):  # one sync per step: the tokens say which rows end
            if done[b]:
                continue
            if t in stop:
                done[b], ended[live[b]] = True, t
            else:
                replies[live[b]].append(t)
        finished = sum(done)
        if finished == len(live) or step == sampling.max_new_tokens - 1:
            break
        if 4 * finished >= len(live):  # drop ended rows once a quarter of the batch is idle
            keep = [b for b in range(len(live)) if not done[b]]
            index = mx.array(keep)
            _take_rows(cache, index)
            tokens, keys_valid, greedy, keys = tokens[index], keys_valid[index], greedy[index], keys[index]
            live, done = [live[b] for b in keep], [False] * len(keep)
        keys_valid = mx.concatenate([keys_valid, mx.ones((len(live), 1), dtype=mx.bool_)], axis=1)
        hidden = decoder_layers(target, target.embed(tokens[:, None]), keys_valid[:, None, None, :], cache)
        logits = target.logits(hidden[:, -1]).astype(mx.float32)
    return [[(replies[r], ended[r]) for r in range(i * R, (i + 1) * R)] for i in range(len(prompts))]
