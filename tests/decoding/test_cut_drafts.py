"""Cycles that verify only a confident prefix of the draft: the policy is told each drafted position's
confidence (the drafter's probability of its argmax) after the draft, keeps a prefix, and decoding stays
exact: greedy equals the target alone, sampled output follows the target, the drafter's context holds
exactly the committed positions' features."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.distributions import P_BROKEN, pit_pvalue
from helpers.tiny import VOCAB, greedy_reference, tiny_drafter, tiny_target
from helpers.tree_oracles import LogitOracle, RankOracle, decode_cycles

from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.targets.model import TargetModel

PROMPT = [5, 17, 33, 90, 41, 12, 7, 64, 100, 23, 51]
P_HONEST = 1e-4


class ScriptedCut(FixedBlockSize):
    """Block 8, every draft cut to the next length of a script; what it was told is kept."""

    def __init__(self, lengths: list[int], size: int = 8):
        super().__init__(size)
        self.confident, self.lengths, self.told, self.kept = True, list(lengths), [], []

    def cut(self, confidences: list[float]) -> int:
        self.told.append(confidences)
        self.kept.append(self.lengths[len(self.kept) % len(self.lengths)])
        return self.kept[-1]


def run(target, proposer, max_tokens: int, policy, sampler=None):
    """Decode through `session.cycle`: (output tokens, the session, verified block sizes of drafting cycles)."""
    session, cycles = decode_cycles(target, proposer, PROMPT, max_tokens, policy, sampler)
    assert all(size == verified.inputs.shape[0] for size, verified in cycles)
    return session.tokens[len(PROMPT):], session, [size for size, _ in cycles if size > 1]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_through_cut_drafts_equals_the_target_alone(family):
    model = tiny_target(family, seed=4)
    target = TargetModel(model)
    reference = greedy_reference(model, PROMPT, 40)[:40]
    oracle = RankOracle(model, VOCAB, p_first=0.85, seed=2)
    policy = ScriptedCut([2, 5, 8, 3])
    out, session, sizes = run(target, oracle, 40, policy)
    assert out == reference
    assert len(policy.kept) == len(sizes) >= 8
    assert sizes[:-1] == policy.kept[:-1] and sizes[-1] <= policy.kept[-1]  # (the last one: the budget left)
    # What the policy was told: each drafted position's argmax probability under the drafter (the oracle
    # reads the committed tokens: the first cycle's pending token sits right after the prompt).
    expected = mx.softmax(oracle.draft_logits(mx.array([reference[0]]), len(PROMPT), 8), axis=-1).max(axis=-1)
    assert len(policy.told[0]) == 7
    assert policy.told[0] == pytest.approx(expected.tolist(), rel=1e-5)
    assert all(0.0 < c <= 1.0 for told in policy.told for c in told)


def test_a_real_drafter_after_cut_drafts_holds_what_a_linear_run_would():
    model = tiny_target("qwen3", seed=4)
    target = TargetModel(model)
    drafter = tiny_drafter(model, block_size=8)
    reference = greedy_reference(model, PROMPT, 24)[:24]
    out, session, sizes = run(target, make_proposer(target, drafter, 8), 24, ScriptedCut([3, 2, 6]))
    assert out == reference and set(sizes) <= {2, 3, 6}
    session.inject_pending()
    fresh = DecodingSession(target, make_proposer(target, drafter, 8))
    fresh.extend(session.tokens[:-1], make_sampler(0.0))  # the same committed tokens, fed linearly
    for ours, theirs in zip(session.proposer.state_arrays(), fresh.proposer.state_arrays(), strict=True):
        assert ours.shape == theirs.shape
        assert mx.allclose(ours, theirs, atol=1e-4).item()


def test_a_policy_that_is_not_confident_verifies_whole_drafts():
    model = tiny_target("qwen3", seed=4)
    policy = ScriptedCut([2])
    policy.confident = False
    out, _, sizes = run(TargetModel(model), RankOracle(model, VOCAB, p_first=0.85, seed=2), 24, policy)
    assert out == greedy_reference(model, PROMPT, 24)[:24]
    assert not policy.told and sizes[0] == 8


@pytest.mark.slow
def test_sampled_tokens_through_cut_drafts_follow_the_target():
    model = tiny_target("qwen3", seed=5)
    target = TargetModel(model)
    mx.random.seed(11)
    outputs, cut = [], 0
    for _ in range(40):
        policy = ScriptedCut([3, 6, 2], size=6)
        out, _, sizes = run(target, LogitOracle(model, VOCAB), 20, policy, make_sampler(1.0, top_k=6))
        outputs.append(out[:20])
        cut += sum(s < 6 for s in sizes)
    assert cut >= 40  # drafts were cut
    p = pit_pvalue(model, [PROMPT] * len(outputs), outputs, seed=1, temp=1.0, top_k=6)
    assert p > P_HONEST, p
    assert pit_pvalue(model, [PROMPT] * len(outputs), outputs, seed=1, temp=1.0) < P_BROKEN
