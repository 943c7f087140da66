"""Plain steps pipelined as mlx-lm's are: the next one is launched before this one's token is read.

A step launched ahead and then not taken (a stop token, a drafting cycle, a new chat turn,
a truncate, a consumer that stops iterating) must leave no trace: the output stays the
target's own and the cache holds exactly the committed tokens but the pending one.
"""

from __future__ import annotations

import pytest
from helpers.families import FAMILIES, build
from helpers.tiny import VOCAB, FakeTokenizer, ScriptedProposer, greedy_reference
from mlx_lm.sample_utils import make_sampler

from mlx_dflash import stream_generate
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.targets.model import TargetModel

GREEDY = make_sampler(0.0)
PROMPT = [5, 17, 33, 90, 41, 7]


def assert_cache_holds_committed(session: DecodingSession) -> None:
    assert not session.launched_ahead
    assert all(c.offset == len(session.tokens) - 1 for c in session.cache)


def decode(session: DecodingSession, new_tokens: list[int], max_tokens: int, stop=(), **kwargs):
    """stream_session's events, and at each one whether a step was in flight."""
    events, in_flight = [], []
    for event in stream_session(session, new_tokens, GREEDY, max_tokens=max_tokens, stop=set(stop),
                                detokenizer=FakeTokenizer(()).detokenizer, **kwargs):
        events.append(event)
        in_flight.append(session.launched_ahead)
    return [t for e in events for t in e.tokens], events, in_flight


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("with_drafter", [False, True])
def test_pipelined_plain_steps_are_the_targets_own(family, with_drafter, targets):
    model = targets(family)
    reference = greedy_reference(model, PROMPT, 24)
    target = TargetModel(model)
    useless = ScriptedProposer(PROMPT + reference, VOCAB, 1.0, target_layer_ids=[0, 2])
    session = DecodingSession(target, useless if with_drafter else None)
    tokens, events, in_flight = decode(session, PROMPT, 24, block_size=1)
    assert tokens == reference
    assert events[-1].stats.cycles == 23
    # At every cycle's event but the last, the next step was already computing.
    assert in_flight == [False] + [True] * 22 + [False]
    assert_cache_holds_committed(session)


def test_a_stop_token_drops_the_step_launched_after_it(targets):
    model = targets("qwen3")
    reference = greedy_reference(model, PROMPT, 40)
    stop = reference[12]
    end = reference.index(stop)
    target = TargetModel(model)
    session = DecodingSession(target)
    tokens, events, in_flight = decode(session, PROMPT, 40, stop=[stop], block_size=1)
    assert tokens == reference[:end]
    assert events[-1].finish_reason == "stop"
    assert in_flight[-1] is False and in_flight[-2] is True  # launched past the stop token, then dropped
    assert session.tokens == PROMPT + reference[: end + 1]
    assert_cache_holds_committed(session)
    # A new turn goes on exactly as in a session that never launched a step ahead.
    turn = [9, 11, 13]
    assert session.extend(turn, GREEDY) == DecodingSession(target).extend(PROMPT + reference[: end + 1] + turn, GREEDY)


def test_a_consumer_that_stops_iterating_leaves_a_usable_session(targets):
    model = targets("mistral")
    target = TargetModel(model)
    reference = greedy_reference(model, PROMPT, 30)
    session = DecodingSession(target)
    # A chat that breaks out of the stream keeps the generator around (not closed yet) ...
    events = stream_session(session, PROMPT, GREEDY, max_tokens=30, stop=set(),
                            detokenizer=FakeTokenizer(()).detokenizer, block_size=1)
    tokens = []
    for event in events:
        tokens.extend(event.tokens)
        if len(tokens) >= 10:
            break
    assert session.launched_ahead
    # ... and goes on with the session: the next turn sees only the committed tokens.
    turn = [21, 22]
    expected = DecodingSession(target).extend(PROMPT + reference[:10] + turn, GREEDY)
    assert session.tokens == PROMPT + reference[:10]
    assert session.extend(turn, GREEDY) == expected
    events.close()  # closing it later changes nothing
    assert session.tokens == PROMPT + reference[:10] + turn + [expected]
    assert_cache_holds_committed(session)


def test_a_drafting_cycle_or_truncate_after_a_launched_step_drops_it(targets):
    model = targets("llama")
    reference = greedy_reference(model, PROMPT, 30)
    session = DecodingSession(TargetModel(model), ScriptedProposer(PROMPT + reference, VOCAB, 0.0))
    session.extend(PROMPT, GREEDY)
    for _ in range(3):
        session.keep(session.step(GREEDY, 1, ahead=True), 1)
    assert session.launched_ahead  # the fourth plain step is in flight ...
    session.prepare(6)
    verified = session.step(GREEDY, 6)  # ... but the loop drafts instead
    session.keep(verified, len(verified.tokens))
    assert len(session.tokens) == len(PROMPT) + 4 + 6  # the oracle's block was accepted whole
    assert session.tokens == PROMPT + reference[:10]
    assert_cache_holds_committed(session)
    session.keep(session.step(GREEDY, 1, ahead=True), 1)
    session.truncate(len(session.tokens) - 2)  # a launched step is dropped before rewinding
    assert_cache_holds_committed(session)
    assert session.extend(reference[len(session.tokens) - len(PROMPT):14], GREEDY) == reference[14]


def test_sampled_pipelined_steps_follow_the_seed(targets):
    model = targets("qwen2")

    def run(seed: int, **kwargs) -> list[int]:
        return [t for e in stream_generate(model, FakeTokenizer(eos_token_ids=()), PROMPT, max_tokens=30,
                                           temp=1.0, seed=seed, **kwargs) for t in e.tokens]

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "gemma3_text"])
def test_targets_whose_cache_cannot_drop_a_position_do_not_launch_ahead(model_type):
    model = build(model_type)
    session = DecodingSession(TargetModel(model))
    assert not session.can_launch_ahead
    reference = greedy_reference(model, PROMPT, 12)
    tokens, _, in_flight = decode(session, PROMPT, 12, block_size=1)
    assert tokens == reference
    assert not any(in_flight)


def test_a_draft_after_plain_steps_is_charged_for_the_backlog_it_injects(targets):
    """`cycle` times the backlog's injection as the drafting cycle's cost (the first draft after
    a run of plain steps pays for them), and each cycle is recorded once, with its size."""
    import time as clock

    from mlx_dflash.decoding.block_size import FixedBlockSize

    class SlowInjection(ScriptedProposer):
        def commit(self, features, position):
            clock.sleep(0.05)  # a batch of features costs this much to inject
            super().commit(features, position)

    class Script(FixedBlockSize):
        def __init__(self, sizes):
            super().__init__(1)
            self.sizes, self.records = list(sizes), []

        def choose(self, limit, position, offers=None):
            return self.sizes.pop(0)

        def promise_plain(self):
            return False

        def record(self, size, accepted, seconds):
            self.records.append((size, seconds))

    model = targets("qwen3")
    reference = greedy_reference(model, PROMPT, 20)
    session = DecodingSession(TargetModel(model), SlowInjection(PROMPT + reference, VOCAB, target_layer_ids=[0, 2]))
    session.extend(PROMPT, GREEDY)
    policy = Script([1, 1, 1, 4])
    for _ in range(4):
        session.cycle(GREEDY, policy, budget=100, stop=set())
    assert [size for size, _ in policy.records] == [1, 1, 1, 4]
    plain = max(seconds for _, seconds in policy.records[:3])
    assert policy.records[3][1] >= 0.05 + 0.5 * plain  # the injection of three queued positions
    assert session.tokens == PROMPT + reference[: len(session.tokens) - len(PROMPT)]
