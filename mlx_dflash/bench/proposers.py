"""Benchmark-only proposers of known quality; never used by decoding outside `bench --oracle-q`.

`CorruptedGreedyProposer` proposes the target's own greedy continuation of the prompt,
each drafted position replaced by a wrong token with probability q: the acceptance a
drafter of that quality would reach, at almost no drafting cost. It shows where drafting
pays on a machine, and whether `--block-size auto` finds the best block size there.
It fits greedy decoding of the prompt it was built for only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from ..generate import stream_generate
from ..targets.model import as_target


class CorruptedGreedyProposer:
    """Drafts `sequence[position + 1:]` (prompt + greedy continuation), corrupted at rate q.

    Which positions are wrong is drawn once per sequence, not per draft: every block size
    meets the same wrong positions, as with a real drafter whose mistakes belong to the
    text, so that modes compare on equal terms (drawn per draft, a short run's luck
    differed from one block size to the next).
    """

    def __init__(self, sequence: list[int], vocab_size: int, q: float, seed: int = 0):
        self.sequence, self.vocab_size, self.q = sequence, vocab_size, q
        rng = np.random.default_rng([seed, len(sequence), sum(sequence) % 2**32])
        self.wrong = rng.random(len(sequence)) < q
        self.replacement = (np.asarray(sequence) + 1 + rng.integers(vocab_size - 1, size=len(sequence))) % vocab_size
        self.target_layer_ids = [0]  # the engine captures one layer's features; they go unused
        self.committed = 0

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        out = []
        for i in range(position + 1, position + block_size):
            if i >= len(self.sequence):
                out.append(0)
            else:
                out.append(int(self.replacement[i] if self.wrong[i] else self.sequence[i]))
        return mx.array(out, dtype=mx.uint32)

    def commit(self, features: Any, position: int) -> None:
        self.committed = position + features.shape[1]

    def trim(self, num_positions: int) -> None:
        self.committed -= num_positions

    def state_arrays(self) -> list[mx.array]:
        return []


class CorruptedGreedyFactory:
    """Per run: the prompt's greedy continuation (computed once per prompt, untimed) as a proposer.

    Used as `DFlashEngine(..., drafter=CorruptedGreedyFactory(...))`; the engine calls it
    before its clock starts.
    """

    references: dict[tuple[int, ...], list[int]] = {}  # shared by every q: one greedy pass per prompt

    def __init__(self, model: Any, tokenizer: Any, q: float, block_size: int = 16, seed: int = 0):
        self.model, self.tokenizer, self.q, self.block_size, self.seed = model, tokenizer, q, block_size, seed
        self.vocab_size = as_target(model).vocab_size

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> CorruptedGreedyProposer:
        key = (*prompt_ids, -max_tokens)
        if key not in self.references:
            self.references[key] = [t for e in stream_generate(self.model, self.tokenizer, prompt_ids,
                                                               max_tokens=max_tokens) for t in e.tokens]
        return self.proposer(list(prompt_ids) + self.references[key])

    def proposer(self, sequence: list[int]) -> CorruptedGreedyProposer:
        proposer = CorruptedGreedyProposer(sequence, self.vocab_size, self.q, self.seed)
        proposer.block_size = self.block_size  # the widest block `auto` may choose
        return proposer


def check_oracle_rates(rates: list[float], temp: float) -> None:
    if any(not 0.0 <= q <= 1.0 for q in rates):
        raise DFlashError(f"--oracle-q rates must lie in [0, 1], got {rates}")
    if rates and temp > 0:
        raise DFlashError("--oracle-q proposes the target's greedy continuation: it needs --temp 0")
