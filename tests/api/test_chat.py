"""The chat engine: cache reuse across turns, template re-rendering, interruption, overflow."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from helpers.chat_turns import run_turn
from helpers.families import CountingTarget
from helpers.tiny import EOS_ID, VOCAB, ScriptedProposer, greedy_reference, save_target, tiny_drafter, tiny_target

import mlx_dflash
from mlx_dflash.chat import ChatEngine, ChatSettings, ContextOverflowError, IncrementalText
from mlx_dflash.errors import DFlashError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target (with its tokenizer and chat template) and a random drafter for it."""
    model = tiny_target("qwen3", seed=0)
    path = save_target(model, "qwen3", tmp_path_factory.mktemp("target"))
    target, tokenizer, _ = mlx_dflash.load(str(path))
    return target, tokenizer, tiny_drafter(target, block_size=8)


@pytest.fixture(scope="module")
def endless(pair):
    """The same target with its end-of-sequence row zeroed: greedy replies never stop on their own."""
    target, tokenizer, _ = pair
    model = tiny_target("qwen3", seed=0)
    weight = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = mx.where(mx.arange(weight.shape[0])[:, None] == EOS_ID, 0.0, weight)
    mx.eval(model.parameters())
    return model, tokenizer, tiny_drafter(model, block_size=8)


def assert_consistent(engine: ChatEngine) -> None:
    """The caches hold every committed token but the pending one, as the session invariant says."""
    session = engine.session
    assert session.cache[0].offset == len(session.tokens) - 1
    if hasattr(session.proposer, "cache"):  # a DFlash proposer's draft context (plus queued features)
        assert session.proposer.cache.offset + session.pending_positions == len(session.tokens) - 1


def expected_reply(engine: ChatEngine, model, n: int) -> list[int]:
    """Ground truth: mlx-lm's own greedy decoding of the fully rendered conversation."""
    out = greedy_reference(model, engine.render(), n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def test_turn_two_prefills_only_its_new_tokens(pair):
    model, tokenizer, drafter = pair
    target = CountingTarget(model)
    engine = ChatEngine(target, tokenizer, drafter, ChatSettings(max_tokens=40))
    first = run_turn(engine, "hello there, how are you today?")
    committed = list(engine.session.tokens)
    assert first.reused_tokens == 0 and first.new_tokens == len(engine.render([engine.messages[0]]))
    target.fed.clear()
    offset = engine.session.cache[0].offset
    second = run_turn(engine, "and now?")
    full = engine.render(engine.messages[:-1])  # the conversation the second reply answered
    assert full[: len(committed)] == committed  # the template extends what was generated
    # Turn 2 computes the pending token plus the new tokens only, never the first turn again.
    assert second.reused_tokens == len(committed)
    # "</s>" is one (special) token; it is new too when the first reply did not end with it.
    assert second.new_tokens == len(full) - len(committed) == len("<u>and now?<a>") + 1 + (
        first.finish_reason != "stop")
    assert target.fed[0] == second.new_tokens + 1  # the pending token, then the new ones
    grown = second.new_tokens + len(second.tokens) + (second.finish_reason == "stop")
    assert engine.session.cache[0].offset == offset + grown
    assert_consistent(engine)
    fresh = ChatEngine(model, tokenizer, None, ChatSettings(max_tokens=40))
    fresh.messages = engine.messages[:-2]
    assert run_turn(fresh, "and now?").tokens == second.tokens


def test_next_turn_equals_fresh_session_and_target_alone(pair):
    model, tokenizer, drafter = pair
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=30))
    finishes = set()
    for text, limit in [("hello there", 200), ("second one", 5), ("third", 200)]:
        engine.settings.max_tokens = limit
        result = run_turn(engine, text)
        finishes.add(result.finish_reason)
        assert_consistent(engine)
        history = engine.messages[:-2]
        fresh = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=limit))
        fresh.messages = list(history)
        assert run_turn(fresh, text).tokens == result.tokens
        fresh.messages = list(history) + [{"role": "user", "content": text}]
        assert result.tokens == expected_reply(fresh, model, limit)
    assert finishes == {"stop", "length"}  # both ways a reply can end were followed by a turn


def test_accepted_drafts_across_turns_match_plain_decoding(pair):
    """With a proposer that is often right, partially accepted blocks roll back across turns."""
    model, tokenizer, _ = pair
    turns = [("hello there", 200), ("first question", 12), ("what now?", 200), ("ok", 200)]
    plain = ChatEngine(model, tokenizer, None, ChatSettings(max_tokens=200))
    expected = []
    for text, limit in turns:
        plain.settings.max_tokens = limit
        expected.append(run_turn(plain, text).tokens)
    oracle = ScriptedProposer(list(plain.session.tokens), VOCAB, error_rate=0.25, target_layer_ids=[1, 2])
    oracle.block_size = 6
    engine = ChatEngine(model, tokenizer, oracle, ChatSettings(max_tokens=200))
    for (text, limit), want in zip(turns, expected, strict=True):
        engine.settings.max_tokens = limit
        assert run_turn(engine, text).tokens == want
        assert oracle.committed + engine.session.pending_positions == len(engine.session.tokens) - 1
        assert_consistent(engine)
    assert engine.totals.tau > 1.5 and max(engine.totals.acceptance_lengths) == 6


def test_template_that_rerenders_history_rolls_back(pair):
    """Like Qwen3 dropping thinking from past turns: the re-render diverges from what was generated."""
    model, tokenizer, drafter = pair
    saved = tokenizer._tokenizer.chat_template
    tokenizer._tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>"
        "{% if m['role'] == 'assistant' %}{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}"
        "</s>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    try:
        engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=20))
        first = run_turn(engine, "tell me something")
        assert len(first.tokens) > 3
        prompt_len = first.new_tokens
        second = run_turn(engine, "more")
        # Rolled back to the common prefix: the prompt and the first 3 reply tokens.
        assert second.reused_tokens == prompt_len + 3
        assert_consistent(engine)
        fresh = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=20))
        fresh.messages = engine.messages[:2]
        assert run_turn(fresh, "more").tokens == second.tokens
        fresh.messages = engine.messages[:3]
        assert second.tokens == expected_reply(fresh, model, 20)
    finally:
        tokenizer._tokenizer.chat_template = saved


def test_changed_system_message_rerenders_from_the_start(pair):
    model, tokenizer, drafter = pair
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=15, system="be brief"))
    run_turn(engine, "hi")
    engine.settings.system = "be verbose"
    result = run_turn(engine, "again")
    assert result.reused_tokens == 4  # only "<s>" (one special token) and "be " are common
    engine.messages.pop()
    assert result.tokens == expected_reply(engine, model, 15)


@pytest.mark.parametrize("keep_partial", [True, False])
def test_interrupted_reply_keeps_caches_consistent(endless, keep_partial):
    model, tokenizer, drafter = endless
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=25))
    run_turn(engine, "start")
    before = list(engine.session.tokens)
    engine.settings.max_tokens = 2000
    cut = run_turn(engine, "a long story please", stop_after=3, keep_partial=keep_partial)
    assert cut.finish_reason == "interrupted" and 0 < len(cut.tokens) < 2000
    assert_consistent(engine)
    if keep_partial:
        assert engine.messages[-1] == {"role": "assistant", "content": tokenizer.decode(cut.tokens)}
        assert len(engine.messages) == 4
    else:
        assert len(engine.messages) == 2 and engine.session.tokens == before
    engine.settings.max_tokens = 25
    after = run_turn(engine, "go on")
    fresh = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=25))
    fresh.messages = engine.messages[:-2]
    assert run_turn(fresh, "go on").tokens == after.tokens
    engine.messages.pop()
    assert after.tokens == expected_reply(engine, model, 25)


@pytest.mark.parametrize("how", ["close", "keyboard-interrupt"])
def test_reply_abandoned_by_the_caller(endless, how):
    """Closing the stream at a yield, or an exception thrown into it (hard Ctrl-C), stays correct."""
    model, tokenizer, drafter = endless
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=500))
    turn = engine.send("once upon a time")
    shown = [next(turn).event.tokens for _ in range(3)]
    if how == "close":
        turn.close()
    else:
        with pytest.raises(KeyboardInterrupt):
            turn.throw(KeyboardInterrupt)
    assert engine.messages[-1]["content"] == tokenizer.decode(sum(shown, []))
    engine.settings.max_tokens = 20
    result = run_turn(engine, "and then?")
    assert_consistent(engine)
    engine.messages.pop()
    assert result.tokens == expected_reply(engine, model, 20)


def test_context_overflow_is_a_clear_error_and_reset_recovers(pair):
    model, tokenizer, drafter = pair
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=1000), max_context=60)
    first = run_turn(engine, "x" * 20)
    # The reply is capped by the room left in the context, never run past it.
    assert len(engine.session.tokens) <= 60
    assert first.finish_reason in ("stop", "length")
    kept = list(engine.messages)
    with pytest.raises(ContextOverflowError, match="/reset"):
        run_turn(engine, "y" * 40)
    assert engine.messages == kept
    engine.reset()
    assert engine.messages == [] and engine.session.tokens == []
    assert run_turn(engine, "short").finish_reason in ("stop", "length")


def test_totals_histogram_and_block_size_limits(pair):
    model, tokenizer, drafter = pair
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=20))
    a = run_turn(engine, "one")
    b = run_turn(engine, "two")
    totals = engine.totals
    assert totals.turns == 2
    assert totals.acceptance_lengths == a.stats.acceptance_lengths + b.stats.acceptance_lengths
    assert sum(totals.histogram) == len(totals.acceptance_lengths)
    assert totals.generated_tokens == len(a.tokens) + len(b.tokens)
    assert engine.settings.block_size == "auto" and engine.max_block_size == 8  # auto up to the trained block
    assert sum(totals.block_size_histogram.values()) == len(totals.acceptance_lengths)
    assert max(totals.block_size_histogram) <= 8
    with pytest.raises(DFlashError, match="exceeds the drafter's trained block size 8"):
        engine.set_block_size(9)
    with pytest.raises(DFlashError, match="exceeds the drafter's trained block size 8"):
        ChatEngine(model, tokenizer, drafter, ChatSettings(block_size=9))
    engine.set_block_size(1)  # block 1: the target decodes alone, still through the session
    c = run_turn(engine, "three")
    assert set(c.stats.acceptance_lengths) <= {1}
    plain = ChatEngine(model, tokenizer, None, prompt_lookup=False)
    assert plain.settings.block_size == 1
    with pytest.raises(DFlashError, match="no drafter"):
        plain.set_block_size(4)
    looked_up = ChatEngine(model, tokenizer, None)  # prompt lookup alone: auto, or a fixed size up to 16
    assert looked_up.settings.block_size == "auto" and looked_up.max_block_size == 16
    looked_up.set_block_size(4)
    with pytest.raises(DFlashError, match="at most 16"):
        looked_up.set_block_size(17)


class CountingTokenizer:
    """A tokenizer that counts the token ids every `decode` is handed (the rest passes through)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, *args, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_decoding_work_stays_linear_in_the_reply_length(endless):
    """Each cycle decodes its new tokens (and a little context), never the whole reply again."""
    model, tokenizer, drafter = endless
    counting = CountingTokenizer(tokenizer)
    engine = ChatEngine(model, counting, drafter, ChatSettings(max_tokens=600, block_size=2))
    turn = engine.send("tell me a long story")
    pieces = []
    while True:
        try:
            event = next(turn)
        except StopIteration as done:
            result = done.value
            break
        pieces.append(event.text)
    assert len(result.tokens) == 600 and result.stats.cycles > 200
    assert "".join(pieces) == result.reply == tokenizer.decode(result.tokens)
    # Decoding the reply so far twice a cycle hands decode ~cycles * length tokens (here ~360000).
    assert counting.decoded <= 8 * len(result.tokens)


def test_incremental_text_holds_back_incomplete_characters():
    def decode(ids):  # byte-level: a multi-byte character split across tokens decodes to U+FFFD
        return bytes(ids).decode("utf-8", errors="replace")

    text = "héllo wörld, 3 € — 東京 🙂!"
    data = list(text.encode())
    for chunk in (1, 2, 3, 5):
        pieces = IncrementalText(decode)
        told = [pieces.add(data[i:i + chunk]) for i in range(0, len(data), chunk)]
        assert "".join(told) == text and not any("\ufffd" in piece for piece in told)


def test_incremental_text_keeps_a_leading_space_the_context_decides():
    vocab = ["\u2581Once", "\u2581upon", "\u2581a", "\u2581time", ",", "\u2581there", "\u2581was"]

    def decode(ids):  # SentencePiece-like: a word's space is dropped at the start of the text
        text = "".join(vocab[i] for i in ids).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text

    ids = list(range(len(vocab)))
    for chunk in (1, 2, 3):
        pieces = IncrementalText(decode)
        told = "".join(pieces.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
        assert told == decode(ids) == "Once upon a time, there was"


def test_the_store_step_the_chat_and_the_server_share():
    """Stopped at a yield the session is kept; an exception inside a cycle marks it unusable."""
    from mlx_dflash.decoding.stream_guard import guarded

    def run(how: str) -> list:
        log = []

        def stream():
            try:
                yield from range(5)
            finally:
                log.append("closed")

        def consumer():
            with guarded(stream(), lambda consistent: log.append(consistent)) as events:
                for i in events:
                    yield i
                    if how == "break" and i == 1:
                        break
                    if how == "raise" and i == 1:
                        raise KeyboardInterrupt

        outer = consumer()
        try:
            for i in outer:
                if how == "close" and i == 1:
                    outer.close()
        except KeyboardInterrupt:
            pass
        return log

    assert run("break") == run("close") == run("end") == ["closed", True]
    assert run("raise") == ["closed", False]


def test_a_dropped_turn_on_a_hybrid_target_goes_back_to_its_mark_without_recomputing(tmp_path):
    """A stopped reply dropped with its message (keep_partial=False) rolls a GatedDeltaNet session back
    to the mark kept before the turn: the next turn computes only its own message, and equals a chat
    that never had the dropped turn."""
    from helpers.families import build
    from helpers.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(tmp_path / "tok")
    model = build("qwen3_5", seed=3)
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])

    def chat():
        target = CountingTarget(model)
        return ChatEngine(target, tokenizer, drafter, ChatSettings(max_tokens=12, temp=0.0)), target

    def finish(turn):
        while True:
            try:
                next(turn)
            except StopIteration as done:
                return done.value

    engine, target = chat()
    finish(engine.send("What is a cache?"))
    before = list(engine.session.tokens)
    dropped = engine.send("Something long I will stop.", keep_partial=False)
    next(dropped)  # the prefill and the first tokens
    dropped.close()  # stopped, and dropped with its message
    assert engine.session.tokens == before and engine.session.marks
    target.fed.clear()
    third = finish(engine.send("Another question?"))
    assert third.new_tokens + 1 in itertools.accumulate(target.fed)  # no recomputation of the first turn
    assert target.fed[0] <= third.new_tokens + 1
    reference, _ = chat()
    finish(reference.send("What is a cache?"))
    assert finish(reference.send("Another question?")).tokens == third.tokens
