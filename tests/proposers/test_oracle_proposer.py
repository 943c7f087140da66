"""The benchmark-only oracle proposer: wrong at rate q, at positions that belong to the text,
so that every block size meets the same mistakes."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_dflash.bench.proposers import CorruptedGreedyProposer

VOCAB = 1000


def drafts(proposer, position, size):
    return proposer.propose(None, position, size).tolist()


@pytest.mark.parametrize("q", [0.05, 0.5])
def test_wrong_positions_are_the_same_for_every_block_size_and_run(q):
    sequence = list(np.random.default_rng(3).integers(VOCAB, size=4000))
    a, b = CorruptedGreedyProposer(sequence, VOCAB, q), CorruptedGreedyProposer(sequence, VOCAB, q)
    for position in (0, 17, 1000, 3500):
        wide = drafts(a, position, 16)
        assert drafts(a, position, 4) == wide[:3] and drafts(b, position, 16) == wide  # order of calls aside
        assert drafts(a, position + 5, 8) == wide[5:12]
    proposed = drafts(a, 0, len(sequence))
    wrong = np.array(proposed) != np.array(sequence[1:])
    assert abs(wrong.mean() - q) < 0.03
    assert all(p != t for p, t, w in zip(proposed, sequence[1:], wrong, strict=True) if w)


def test_another_text_has_other_wrong_positions():
    rng = np.random.default_rng(4)
    one, two = list(rng.integers(VOCAB, size=300)), list(rng.integers(VOCAB, size=300))
    mask = [CorruptedGreedyProposer(s, VOCAB, 0.3).wrong for s in (one, two)]
    assert (mask[0] != mask[1]).any()
