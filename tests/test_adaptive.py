"""Adaptive drafting: picks the cheaper kind of cycle, and never changes the output."""

from __future__ import annotations

import pytest
from tiny import VOCAB, ScriptedProposer, greedy_reference

from mlx_dflash.adaptive import AdaptiveDrafting
from mlx_dflash.generate import stream_generate


def _drive(policy: AdaptiveDrafting, cycles: int, cost, full: int = 16) -> list[int]:
    """Run the policy against a synthetic cost model: cost(block) -> (tokens, seconds)."""
    sizes = []
    for _ in range(cycles):
        size = policy.block_size(full)
        sizes.append(size)
        policy.record(size, *cost(size))
    return sizes


def test_a_drafter_that_does_not_pay_is_mostly_skipped():
    # Drafting: 1 token for 1.8 time units (a 16-token verify plus the draft); plain: 1 for 1.
    policy = AdaptiveDrafting(probe_every=16)
    sizes = _drive(policy, 200, lambda b: (1, 1.8) if b > 1 else (1, 1.0))
    assert not policy.drafting_pays
    assert sizes[:4] == [16, 16, 1, 1]  # measure both kinds first (one warm-up cycle each)
    # Only probes draft, after 16, 32, 64, then every 128 plain cycles.
    probes = [i for i, size in enumerate(sizes) if size == 16 and i >= 4]
    assert len(probes) == 3 and probes[0] - 4 in (15, 16, 17), probes
    assert [b - a for a, b in zip(probes, probes[1:], strict=False)] == [33, 65], probes


def test_a_drafter_that_pays_keeps_drafting():
    policy = AdaptiveDrafting(probe_every=16)
    sizes = _drive(policy, 200, lambda b: (4, 1.8) if b > 1 else (1, 1.0))
    assert policy.drafting_pays
    assert sizes[4:].count(1) == 3  # plain probes only, ever rarer


def test_the_choice_follows_a_change_in_acceptance():
    policy = AdaptiveDrafting(probe_every=8, smoothing=0.5)
    _drive(policy, 60, lambda b: (6, 2.0) if b > 1 else (1, 1.0))
    assert policy.drafting_pays
    # The text turns hard to predict: drafting now yields one token per cycle.
    sizes = _drive(policy, 60, lambda b: (1, 2.0) if b > 1 else (1, 1.0))
    assert not policy.drafting_pays and sizes[-20:].count(1) >= 15
    # ... and easy again: the next probes notice.
    sizes = _drive(policy, 60, lambda b: (6, 2.0) if b > 1 else (1, 1.0))
    assert policy.drafting_pays and sizes[-20:].count(16) >= 15


def test_block_size_one_stays_one():
    policy = AdaptiveDrafting()
    assert _drive(policy, 5, lambda b: (1, 1.0), full=1) == [1] * 5


class _Priced(AdaptiveDrafting):
    """Real decoding, synthetic prices: a drafting cycle costs 1.5 plain steps."""

    def record(self, block_size: int, num_tokens: int, seconds: float) -> None:
        super().record(block_size, num_tokens, 1.5 if block_size > 1 else 1.0)


@pytest.mark.parametrize("error_rate", [1.0, 0.0, 0.3])
def test_adaptive_decoding_is_lossless(error_rate, targets, make_tokenizer):
    model = targets("qwen3")
    prompt = [5, 17, 33, 90, 41]
    max_tokens = 120
    reference = greedy_reference(model, prompt, max_tokens + 8)
    proposer = ScriptedProposer(prompt + reference, VOCAB, error_rate=error_rate, seed=1)
    policy = _Priced(probe_every=8)
    tokens, stats = [], None
    for event in stream_generate(model, make_tokenizer(()), prompt, draft_model=proposer, max_tokens=max_tokens,
                                 block_size=8, adaptive=policy):
        tokens.extend(event.tokens)
        stats = event.stats
    assert tokens == reference[:max_tokens]
    assert sum(stats.acceptance_lengths) + 1 == max_tokens
    if error_rate == 1.0:  # every draft is wrong: plain steps take over
        assert not policy.drafting_pays and stats.plain_cycles > 0.7 * stats.cycles
    elif error_rate == 0.0:  # every draft is right: 8 tokens per 1.5 beats 1 per 1
        assert policy.drafting_pays and stats.plain_cycles <= 3
    else:
        assert 0 < stats.plain_cycles < stats.cycles
