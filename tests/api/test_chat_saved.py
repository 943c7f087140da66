"""A chat saved with its caches and loaded in another engine goes on as if never saved, computing only
its new message (attention and hybrid targets); files that do not fit are refused; prefill progress."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from helpers.chat_turns import run_turn
from helpers.families import CountingTarget, build, cached_pair
from helpers.tiny import tiny_drafter, tiny_tokenizer

import mlx_dflash
from mlx_dflash.chat import ChatEngine, ChatSettings
from mlx_dflash.decoding import session as session_module
from mlx_dflash.decoding.session_file import SessionFileError
from mlx_dflash.errors import DFlashError
from mlx_dflash.targets.model import TargetModel

SPECIALS = {0, 1, 3}  # decode to markup that does not re-encode to the same ids
SECOND = "And a second one, please?"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def models():
    """Per family: a target and a drafter for it."""
    return {family: cached_pair(family) for family in ("qwen3", "qwen3_5")}


def first_turn(engine: ChatEngine) -> None:
    """A first turn whose reply re-renders to the ids generated (no special tokens in it)."""
    for i in range(12):
        result = run_turn(engine, f"Question {i}: what is a cache?")
        if not SPECIALS & set(result.tokens):
            return
        engine.reset()
    pytest.skip("no first reply free of special tokens")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])  # attention, hybrid (GatedDeltaNet)
def test_a_saved_chat_goes_on_as_if_never_saved(family, models, tokenizer, tmp_path):
    model, drafter = models[family]
    settings = ChatSettings(max_tokens=16, block_size=4, system="Be brief.")
    engine = ChatEngine(model, tokenizer, drafter, settings)
    first_turn(engine)
    path = tmp_path / "chat.safetensors"
    assert engine.save(path) == path.stat().st_size
    saved_tokens = len(engine.session.tokens)
    history, saved = list(engine.messages), replace(settings)
    engine.settings.max_tokens = 24
    unsaved = run_turn(engine, SECOND)  # the chat that never saved
    # Prompt lookup on or off, the file loads (its index is rebuilt from the tokens).
    for lookup in (True, False):
        target = CountingTarget(model)
        resumed = ChatEngine(target, tokenizer, drafter, ChatSettings(temp=0.5), prompt_lookup=lookup)
        resumed.load(path)
        assert resumed.messages == history and resumed.settings == saved
        assert len(resumed.session.tokens) == saved_tokens and target.fed == []
        resumed.settings.max_tokens = 24
        again = run_turn(resumed, SECOND)
        assert again.tokens == unsaved.tokens and again.reply == unsaved.reply
        # Only the new message is computed (after the pending token): "</s>" is one token.
        assert again.reused_tokens == saved_tokens and again.new_tokens == unsaved.new_tokens
        assert again.new_tokens <= len("</s><u>" + SECOND + "</s><a>") - 6
        # The prefill's forwards (cut where marks go) cover the pending token and the new message, no more.
        assert again.new_tokens + 1 in itertools.accumulate(target.fed) and target.fed[0] <= again.new_tokens + 1


def test_a_file_that_does_not_fit_is_refused_and_changes_nothing(models, tokenizer, tmp_path):
    model, drafter = models["qwen3"]
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=8))
    with pytest.raises(DFlashError, match="nothing to save"):
        engine.save(tmp_path / "empty.safetensors")
    run_turn(engine, "hello")
    path = tmp_path / "chat.safetensors"
    engine.save(path)
    other_model, other_drafter = models["qwen3_5"]
    refusals = [
        (ChatEngine(build("qwen3", seed=4), tokenizer, drafter), path, "another target model"),
        (ChatEngine(model, tokenizer, tiny_drafter(model, seed=9, block_size=6, target_layer_ids=[0, 3])), path,
         "another drafter"),
        (ChatEngine(model, tokenizer, None), path, "saved with a drafter; this chat has none"),
        (ChatEngine(other_model, tokenizer, other_drafter), path, "another target model"),
        (ChatEngine(model, tokenizer, drafter), tmp_path / "missing.safetensors", "no such file"),
    ]
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a session file at all")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    bare = tmp_path / "bare.safetensors"
    mlx_dflash.save_session(engine.session, bare, fingerprint=engine.fingerprint())  # a session, not a chat
    for bad, why in ((garbage, "not a session file"), (cut, "cut short"), (bare, "not a saved chat")):
        refusals.append((ChatEngine(model, tokenizer, drafter), bad, why))
    for chat, bad, why in refusals:
        run_turn(chat, "hi")
        messages, session = list(chat.messages), chat.session
        with pytest.raises(DFlashError, match=why):
            chat.load(bad)
        assert chat.messages == messages and chat.session is session  # as it was
    with pytest.raises(SessionFileError):
        mlx_dflash.load_session(path, engine._new_session, fingerprint="another")


def test_prefill_progress_is_told_chunk_by_chunk(models, tokenizer, monkeypatch):
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 16)
    model, drafter = models["qwen3"]
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=4))
    told: list[tuple[int, int]] = []
    engine.on_prefill = lambda fed, total: told.append((fed, total))
    for text in ("a long question " * 6, "and another long one " * 5):
        told.clear()
        result = run_turn(engine, text)
        total = result.new_tokens + (result.reused_tokens > 0)  # the pending token is computed too
        assert total > 16 * 3
        assert told == [(0, total)] + [(min(n, total), total) for n in range(16, total + 15, 16)]


def test_a_stop_during_a_long_prefill_ends_it_at_the_next_chunk(models, tokenizer, monkeypatch):
    """Ctrl-C while a long prompt is read: the message is dropped, the chunks fed stay cached."""
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 16)
    model, drafter = models["qwen3"]
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=6))
    run_turn(engine, "hello")
    history, before = list(engine.messages), len(engine.session.tokens)
    engine.on_prefill = lambda fed, total: engine.request_stop() if fed >= 32 else None
    text = "a long question, " * 6
    stopped = run_turn(engine, text)
    assert stopped.finish_reason == "interrupted" and stopped.tokens == [] and engine.messages == history
    assert len(engine.session.tokens) == before + 32  # two chunks fed (the pending token and 31 new ones, twice)
    engine.on_prefill = None
    again = run_turn(engine, text)  # sent again: goes on from the chunks fed
    assert again.reused_tokens == before + 32
    fresh = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=6))
    fresh.messages = list(history)
    assert run_turn(fresh, text).tokens == again.tokens


def test_the_python_api_saves_a_session_and_loads_it_into_a_fresh_one(models, tmp_path):
    from helpers.families import decode
    from mlx_lm.sample_utils import make_sampler

    from mlx_dflash.proposers.factory import make_proposer
    from mlx_dflash.session import DecodingSession

    model, drafter = models["qwen3"]
    target = TargetModel(model)

    def fresh(t=target) -> DecodingSession:
        return DecodingSession(t, make_proposer(t, drafter, 6))

    session = fresh()
    session.extend(list(range(10, 60)), make_sampler(0.0))
    path = tmp_path / "s.safetensors"
    assert mlx_dflash.save_session(session, path, metadata={"note": 1}) == path.stat().st_size  # its own fingerprint
    loaded, metadata = mlx_dflash.load_session(path, fresh())
    assert loaded.tokens == session.tokens and metadata == {"note": 1}
    assert decode(loaded, make_sampler(0.0), 12, 6) == decode(session, make_sampler(0.0), 12, 6)
    with pytest.raises(mlx_dflash.SessionFileError, match="other models"):
        mlx_dflash.load_session(path, fresh(TargetModel(build("qwen3", seed=4))))
