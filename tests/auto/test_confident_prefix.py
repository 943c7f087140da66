"""`auto` verifying only the prefix of a linear draft that its confidence makes worth the price.

Simulated drafts: each position comes with the drafter's confidence and whether the target accepts
it; the drafter underestimates itself (accepted with probability sqrt(confidence)), and the text
alternates between stretches it drafts well and badly. Costs per regime are in plain steps, so
`auto` with cuts and without are compared side by side on the same draws.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_dflash.auto.confident_prefix import ConfidenceMap, best_prefix
from mlx_dflash.auto.policy import AutoBlockSize, candidate_sizes


def cpu_cost(size: int) -> float:  # this CPU: every verified input costs
    return 1.0 if size == 1 else 1.6 + 0.12 * size


def mac_cost(size: int) -> float:  # a Mac: a verify of 16 costs little more than a plain step
    return 1.0 if size == 1 else 1.3 + 0.015 * size


def informative(rng, depth: int, good: bool):
    confidence = rng.beta(2.0, 1.2, size=depth) if good else rng.beta(1.0, 2.0, size=depth)
    return confidence, rng.random(depth) < np.sqrt(confidence)


def uninformative(rng, depth: int, good: bool):
    return rng.random(depth), rng.random(depth) < (0.8 if good else 0.4)


def decode(policy: AutoBlockSize, cost, seed: int, drafts, replies: int = 12, max_tokens: int = 64) -> float:
    """Tokens per simulated plain step; the text changes every 24 tokens."""
    rng, done_all, seconds = np.random.default_rng(seed), 0, 0.0
    for _ in range(replies):
        policy.begin()
        done, position = 1, 0
        while done < max_tokens:
            size = policy.choose(max_tokens - done, position)
            confidence, accepted_at = drafts(rng, policy.max_block - 1, (position // 24) % 2 == 0)
            if policy.confident:
                size = policy.cut([float(c) for c in confidence[: size - 1]])
            accepted = next((k for k in range(size - 1) if not accepted_at[k]), size - 1)
            accepted = min(accepted, max_tokens - done - 1)
            policy.record(size, accepted, cost(size))
            done, position, seconds = done + accepted + 1, position + accepted + 1, seconds + cost(size)
        done_all += done
    return done_all / seconds


def test_the_kept_prefix_follows_what_each_confidence_has_been_worth():
    learnt = ConfidenceMap()
    assert learnt.rate(0.3, history=0.7) == pytest.approx(0.7)  # nothing seen: the position's history
    for _ in range(50):  # confident positions accepted, a doubtful one rejected, where 0.7 was expected of each
        learnt.observe([0.95, 0.95, 0.05], [0.7, 0.7, 0.7], 2)
    assert learnt.rate(0.97, history=0.7) > 0.95 and learnt.rate(0.02, history=0.7) < 0.1
    # A bin not seen yet: the history's word, scaled by the drafter's, relative to its typical confidence.
    told = (0.55 / learnt.typical) ** ConfidenceMap.TRUST
    assert 0.4 < learnt.typical < 0.8 and learnt.rate(0.55, history=0.7) == pytest.approx(0.7 * told)
    sizes, seconds = candidate_sizes(16), lambda L: cpu_cost(L)
    doubtful_third = [0.95, 0.95, 0.05] + [0.95] * 12
    assert best_prefix(doubtful_third, [0.7] * 15, learnt, sizes, seconds, rate=0.5) == 3
    assert best_prefix([0.95] * 15, [0.7] * 15, learnt, sizes, seconds, rate=0.5) == 16
    # Where a second position costs more than it may bring at the rate decoding runs at, the least is kept.
    assert best_prefix([0.02] * 15, [0.7] * 15, learnt, sizes, seconds, rate=0.5) == 2


@pytest.mark.parametrize("drafts,replies,goal", [
    (informative, 12, 1.02), (informative, 1, 1.03),  # a chat's policy learns what confidence is worth
    (uninformative, 12, 0.99), (uninformative, 1, 0.97),  # a drafter whose confidence says nothing
])
def test_cut_drafts_against_whole_drafts_where_each_verified_input_costs(drafts, replies, goal):
    cut, whole = [], []
    for seed in range(20):
        base = {L: (cpu_cost(L), 0.0) for L in candidate_sizes(16)}
        cut.append(decode(AutoBlockSize(16, base_costs=base), cpu_cost, seed, drafts, replies))
        whole.append(decode(AutoBlockSize(16, base_costs=base, cut_drafts=False), cpu_cost, seed, drafts, replies))
    assert np.mean(cut) >= goal * np.mean(whole), (cut, whole)


def test_no_cut_is_asked_where_a_wide_verify_costs_about_a_narrow_one():
    base = {L: (mac_cost(L), 0.0) for L in candidate_sizes(16)}
    policy = AutoBlockSize(16, base_costs=base)
    asked, cut = [], policy.cut
    policy.cut = lambda confidences: asked.append((len(confidences) + 1, cut(confidences))) or asked[-1][1]
    decode(policy, mac_cost, 0, informative)
    # One host read between draft and verify in 12 replies: the first draft's, for what the drafter
    # believes of it (`AutoBlockSize.BELIEF`), verified whole.
    assert len(asked) == 1 and asked[0][0] == asked[0][1] == 16
    assert sum(policy.confidence.expected) == 0  # no prefix was weighed
