"""Corners of the decode loop that the lossless suites do not reach on their own.

`keep`'s guard, `GenerationEvent.bonus_token`, the block-size rule, the draft/verify
time split under `profile`, `truncate` on sliding-window targets, and a target whose
K/V cache is quantized (the trimmable `QuantizedKVCache` rollback branch).
"""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from helpers.families import build
from helpers.tiny import VOCAB, FakeTokenizer, ScriptedProposer, adaptive_options, greedy_reference
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from mlx_lm.sample_utils import make_sampler

from mlx_dflash import stream_generate
from mlx_dflash.decoding.loop import GenerationEvent
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.decoding.stats import GenerationStats
from mlx_dflash.errors import DFlashError
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.proposers.factory import check_block_size
from mlx_dflash.targets.model import TargetModel

GREEDY = make_sampler(0.0)


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_keep_refuses_counts_outside_the_cycle_and_leaves_the_state(targets):
    model = targets("qwen3")
    target = TargetModel(model)
    prompt = [5, 9, 33, 17]
    reference = greedy_reference(model, prompt, 30)
    session = DecodingSession(target, ScriptedProposer(prompt + reference, VOCAB, 0.0))
    session.extend(prompt, GREEDY)
    verified = session.step(GREEDY, 6)
    assert len(verified.tokens) == 6
    for count in (0, -1, 7):
        with pytest.raises(ValueError, match="can keep 1..6 tokens"):
            session.keep(verified, count)
    assert session.tokens == prompt + reference[:1]  # nothing was committed or rolled back
    assert all(c.offset == len(prompt) + 6 for c in session.cache)  # the verify inputs still cached
    session.keep(verified, 3)
    assert session.tokens == prompt + reference[:4]
    assert all(c.offset == len(session.tokens) - 1 for c in session.cache)


def test_bonus_token_is_the_targets_own_token_of_a_full_cycle(targets):
    stats = GenerationStats()
    assert GenerationEvent([7, 8, 9], 2, "", stats).bonus_token == 9
    assert GenerationEvent([7, 8], 2, "", stats).bonus_token is None  # cut short before the target's token
    assert GenerationEvent([7], 0, "", stats).bonus_token == 7

    model = targets("qwen3")
    prompt = [5, 9, 33, 17]
    reference = greedy_reference(model, prompt, 40)

    def run(error_rate, stop=()):
        proposer = ScriptedProposer(prompt + reference, VOCAB, error_rate, seed=2)
        return list(stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=proposer,
                                    max_tokens=21, block_size=5, stop_tokens=stop))

    wrong = run(1.0)  # every draft rejected: each cycle's one token is the target's
    assert all(e.bonus_token == e.tokens[0] and e.num_draft_accepted == 0 for e in wrong[1:])
    right = run(0.0)  # every draft accepted: 4 drafts, then the target's token
    assert [len(e.tokens) for e in right] == [1, 5, 5, 5, 5]
    ends = [5, 10, 15, 20]
    assert [e.bonus_token for e in right[1:]] == [reference[i] for i in ends]
    # A stop token among the second cycle's drafts (outputs 6..9) cuts it before the target's token.
    i = next(i for i in range(6, 10) if reference[i] not in reference[:i])
    stopped = run(0.0, stop=(reference[i],))
    assert stopped[-1].finish_reason == "stop" and stopped[-1].tokens == reference[6:i]
    assert stopped[-1].bonus_token is None


def test_block_size_rule(targets, drafters):
    drafter = drafters("qwen3")  # trained for blocks of 8
    assert check_block_size(None, drafter) == 8
    assert check_block_size(5, drafter) == 5
    with pytest.raises(DFlashError, match="block size 9 exceeds the drafter's trained block size 8"):
        check_block_size(9, drafter)
    with pytest.raises(DFlashError, match=">= 1"):
        check_block_size(0, drafter)
    proposer = DFlashProposer(drafter, TargetModel(targets("qwen3")), max_block_size=8)
    with pytest.raises(DFlashError, match="trained block size 8"):
        check_block_size(12, proposer)
    custom = ScriptedProposer([1, 2, 3], VOCAB)  # declares no block size
    assert check_block_size(None, custom) == 16 and check_block_size(32, custom) == 32
    assert check_block_size(None, None) == 1 == check_block_size(6, None)  # nothing drafts
    with pytest.raises(DFlashError, match="exceeds the drafter's trained block size 8"):
        next(stream_generate(targets("qwen3"), FakeTokenizer(), [5, 6], draft_model=drafter, block_size=9))


class SlowProposer(ScriptedProposer):
    """Drafting that visibly costs time: the profile must put it under draft, not verify."""

    def propose(self, last_token, position, block_size):
        time.sleep(0.05)
        return super().propose(last_token, position, block_size)


def test_profile_splits_draft_and_verify_time(targets):
    model = targets("qwen3")
    prompt = [5, 9, 33, 17]
    reference = greedy_reference(model, prompt, 20)

    def run(profile: bool):
        proposer = SlowProposer(prompt + reference, VOCAB, 0.3, seed=4)
        events = list(stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=proposer,
                                      max_tokens=20, block_size=4, profile=profile))
        assert tokens_of(events) == reference
        return events[-1].stats

    stats = run(True)
    draft, verify = stats.timings["draft"], stats.timings["verify"]
    assert draft >= 0.05 * stats.cycles  # every cycle's sleep is counted as drafting
    assert 0 < verify < draft  # ... and none of it as verifying
    assert draft + verify <= stats.decode_time
    assert run(False).timings == {}  # no sync, no split, unless asked


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_truncate_on_a_sliding_window_target_recomputes_exactly(model_type):
    """A rotating (sliding-window) cache cannot be rewound: truncate rebuilds it, and decoding goes on exactly."""
    model = build(model_type, seed=2)
    target = TargetModel(model)
    prompt = list(range(20, 33))  # past the window of 8
    reference = greedy_reference(model, prompt, 24)
    session = DecodingSession(target, ScriptedProposer(prompt + reference, VOCAB, 0.3, seed=1, target_layer_ids=[1]))
    session.extend(prompt, GREEDY)
    while len(session.tokens) < len(prompt) + 20:
        verified = session.step(GREEDY, 5)
        session.keep(verified, len(verified.tokens))
    assert any(isinstance(c, RotatingKVCache) for c in session.cache)
    keep = len(prompt) + 6
    session.truncate(keep)
    assert session.tokens == (prompt + reference)[:keep]
    assert all(c.offset == keep - 1 for c in session.cache)
    assert session.proposer.committed == keep - 1
    turn = [40, 41, 42]
    session.extend(turn, GREEDY)
    history = session.tokens[:keep] + turn
    continued = greedy_reference(model, history, 21)
    session.proposer = ScriptedProposer(history + continued, VOCAB, 0.3, seed=2, target_layer_ids=[1])
    session.proposer.committed = len(session.tokens) - 1
    while len(session.tokens) < len(history) + 21:
        verified = session.step(GREEDY, 4)
        session.keep(verified, len(verified.tokens))
    assert session.tokens[len(history):len(history) + 21] == continued


def wide_head_target():
    """A tiny llama whose head dim (32) fits the 32-element quantization groups."""
    from helpers.tiny import _randomize, target_config
    from mlx_lm.utils import _get_classes

    config = dict(target_config("llama"), hidden_size=128)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _randomize(model, 3, scale=2.0)
    return model


class QuantizedCacheTarget(TargetModel):
    """A target whose attention caches store 8-bit keys and values (mlx-lm's QuantizedKVCache)."""

    def make_cache(self):
        return [QuantizedKVCache(group_size=32, bits=8) for _ in self.inner.layers]


def test_quantized_kv_cache_rolls_back_by_trimming():
    model = wide_head_target()
    target = QuantizedCacheTarget(model)
    prompt = [5, 9, 33, 17, 60, 2, 7]
    # Ground truth: mlx-lm's own greedy decoding over the same kind of cache.
    steps = generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=40, prompt_cache=target.make_cache())
    plain = [int(token) for token, _ in steps]
    assert plain != greedy_reference(model, prompt, 40)  # quantized K/V really change this target's output
    checked = []

    class Checking(ScriptedProposer):
        def propose(self, last_token, position, block_size):
            # After every rollback, each quantized cache holds exactly the committed positions.
            checked.append(all(isinstance(c, QuantizedKVCache) and c.offset == position for c in session.cache))
            return super().propose(last_token, position, block_size)

    session = DecodingSession(target, Checking(prompt + plain, VOCAB, 0.4, seed=6))
    assert target.checkpoint(session.cache) is None  # trimmable: no checkpoint, no replay
    session.extend(prompt, GREEDY)
    lengths = []
    while len(session.tokens) < len(prompt) + 40:
        verified = session.step(GREEDY, 6)
        session.keep(verified, min(len(verified.tokens), len(prompt) + 40 - len(session.tokens)))
        lengths.append(len(verified.tokens))
    assert session.tokens[len(prompt):] == plain
    assert checked and all(checked)
    assert 1 in lengths and max(lengths) > 1  # rejections (rollbacks) and acceptances both happened


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    from helpers.tiny import save_target, tiny_target

    import mlx_dflash

    path = save_target(tiny_target("qwen3", seed=0), "qwen3", tmp_path_factory.mktemp("chat-target"))
    model, tokenizer, _ = mlx_dflash.load(str(path))
    return model, tokenizer


def _turn(engine, text):
    turn, events = engine.send(text), []
    while True:
        try:
            events.append(next(turn))
        except StopIteration as done:
            return done.value, events


def test_chat_splits_each_cycle_into_drafted_and_target_text(chat_pair):
    from mlx_dflash.chat import ChatEngine, ChatSettings

    model, tokenizer = chat_pair
    settings = ChatSettings(max_tokens=30, block_size=5)
    settings.adaptive = False  # draft every cycle (where chat still has adaptive drafting)
    rendered = ChatEngine(model, tokenizer, None).render([{"role": "user", "content": "hello"}])
    expected = greedy_reference(model, rendered, 30)
    proposer = ScriptedProposer(rendered + expected, tokenizer.vocab_size, 0.3, seed=5)
    engine = ChatEngine(model, tokenizer, proposer, settings)
    result, events = _turn(engine, "hello")
    assert "".join(e.text for e in events) == result.reply
    for e in events:
        drafted = e.event.tokens[: e.event.num_draft_accepted]
        assert e.draft_text == tokenizer.decode(drafted)
        assert e.target_text == tokenizer.decode(e.event.tokens[len(drafted):])
    assert any(e.draft_text and e.target_text for e in events)  # cycles with both kinds of token
    assert any(not e.draft_text and e.target_text for e in events)  # ... and cycles the target alone wrote


def test_chat_sync_with_nothing_in_common_starts_afresh(chat_pair):
    """When the re-rendered conversation shares no token with the session, the session is rebuilt."""
    from mlx_dflash.chat import ChatEngine, ChatSettings

    class Preamble(ChatEngine):
        preamble = [40]

        def render(self, messages=None):
            return self.preamble + super().render(messages)

    model, tokenizer = chat_pair
    engine = Preamble(model, tokenizer, None, ChatSettings(max_tokens=12))
    first, _ = _turn(engine, "one")
    assert engine.session.tokens[0] == 40
    engine.preamble = [41]  # e.g. a changed template: not even the first token is shared
    second, _ = _turn(engine, "two")
    assert second.reused_tokens == 0
    full = engine.render(engine.conversation()[:-1])
    assert second.new_tokens == len(full)
    expected = greedy_reference(model, full, 12)
    assert second.tokens == expected[: len(second.tokens)]
    assert engine.session.tokens[: len(full)] == full
    assert all(c.offset == len(engine.session.tokens) - 1 for c in engine.session.cache)
    # sync itself: nothing shared gives the whole rendering back, on an empty session
    other = [42, 43, 44]
    assert engine.sync(other) == other and engine.session.tokens == []


class TruthfulDFlash(DFlashProposer):
    """A real DFlash proposer (the drafter runs and costs its real time) whose block is then
    replaced by the target's own continuation: drafting that pays whatever the machine."""

    def __init__(self, *args, sequence, **kwargs):
        super().__init__(*args, **kwargs)
        self.sequence = sequence

    def propose(self, last_token, position, block_size):
        mx.eval(super().propose(last_token, position, block_size))
        return mx.array(self.sequence[position + 1 : position + block_size], dtype=mx.uint32)


class SlowDFlash(DFlashProposer):
    """The random drafter's own drafts (they rarely land), drafted 50 ms slower than they need."""

    def propose(self, last_token, position, block_size):
        time.sleep(0.05)
        return super().propose(last_token, position, block_size)


@pytest.mark.parametrize("pays", [True, False])
def test_adaptive_drafting_on_measured_time(targets, drafters, pays):
    """No synthetic prices: a real tiny pair, the wall-clock timing path, the cheaper kind chosen."""
    model, drafter = targets("qwen3"), drafters("qwen3", block_size=16)
    target = TargetModel(model)
    prompt = [5, 17, 33, 90, 41]
    reference = greedy_reference(model, prompt, 170)
    proposer = (TruthfulDFlash(drafter, target, max_block_size=16, sequence=prompt + reference) if pays
                else SlowDFlash(drafter, target, max_block_size=16))
    events = list(stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=proposer,
                                  max_tokens=150, **{"block_size": 16, **adaptive_options()}))
    assert tokens_of(events) == reference[:150]
    stats = events[-1].stats
    # Wall-clock costs on a machine shared with other work are noisy: the margins are wide (a policy
    # that ignores the measured time drafts ~95% of the slow drafter's cycles).
    if pays:  # 16 tokens per drafting cycle: drafting stays chosen but for probes of plain steps
        assert stats.plain_cycles <= 0.5 * stats.cycles, (stats.plain_cycles, stats.cycles)
    else:  # ~1 token per drafting cycle that costs 50 ms more than a plain step: plain steps take over
        assert stats.plain_cycles >= 0.5 * stats.cycles, (stats.plain_cycles, stats.cycles)
