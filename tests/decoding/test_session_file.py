"""A session written to a file and read back goes on exactly as the session itself would, on every
cache kind (K/V with a drafter, recurrent with marks, rotating); a foreign or damaged file is refused
with `SessionFileError`, and nothing half-written is left."""

from __future__ import annotations

import pytest
from helpers.families import build, cached_drafter, cached_target, decode
from helpers.tiny import tiny_drafter

from mlx_dflash.decoding.prefix_marks import mark_positions
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.decoding.session_file import (
    SessionFileError,
    load_session,
    model_fingerprint,
    read_header,
    save_session,
)
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.proposers.lookup import PromptLookup
from mlx_dflash.targets.model import TargetModel

GREEDY = make_sampler(0.0)
OPENER = 7
PROMPT = [1, 5, 9, OPENER, 4, 4, 8, 2, 6, OPENER, 3, 9, 9, 5, 11, 12, OPENER, 10, 2, 1, 9, 9, 5, 11]


def pair(family: str):
    if family == "qwen3":
        return TargetModel(cached_target("qwen3")), cached_drafter("qwen3")
    model = build(family, seed=2)
    return TargetModel(model), tiny_drafter(model)


def maker(target, drafter):
    return lambda: DecodingSession(target, DFlashProposer(drafter, target, max_block_size=8), lookup=PromptLookup())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss"])  # K/V, recurrent, rotating
def test_a_saved_session_goes_on_as_the_live_one(family, tmp_path):
    target, drafter = pair(family)
    new = maker(target, drafter)
    live = new()
    live.mark_at = set(mark_positions(PROMPT, 0, {OPENER}, every=0))
    live.extend(PROMPT, GREEDY)
    decode(live, GREEDY, 5, 4)
    fingerprint = model_fingerprint(target, drafter)
    path = tmp_path / "s.safetensors"
    size = save_session(live, path, fingerprint=fingerprint, metadata={"turns": 1})
    assert size == path.stat().st_size and [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]
    header = read_header(path)
    assert header.tokens == live.tokens and header.metadata == {"turns": 1}
    loaded, metadata = load_session(path, new, fingerprint=fingerprint)
    assert metadata == {"turns": 1} and loaded.tokens == live.tokens
    assert [m.length for m in loaded.marks] == [m.length for m in live.marks]
    assert loaded.lookup.propose(loaded.tokens, 4) == live.lookup.propose(live.tokens, 4)  # rebuilt from tokens
    assert decode(loaded, GREEDY, 10, 4) == decode(live, GREEDY, 10, 4)
    if not live.rewindable:  # the marks came back too: both go back to the second opener alike
        live.truncate(10)
        loaded.truncate(10)
        assert loaded.cache is not None and decode(loaded, GREEDY, 6, 4) == decode(live, GREEDY, 6, 4)


def test_other_models_and_damaged_files_are_refused(tmp_path):
    target, drafter = pair("qwen3")
    new = maker(target, drafter)
    live = new()
    live.extend(PROMPT, GREEDY)
    path = tmp_path / "s.safetensors"
    fingerprint = model_fingerprint(target, drafter)
    save_session(live, path, fingerprint=fingerprint)
    other = model_fingerprint(TargetModel(cached_target("qwen3", seed=9)), drafter)
    assert other != fingerprint and model_fingerprint(target, drafter) == fingerprint
    with pytest.raises(SessionFileError, match="other models"):
        load_session(path, new, fingerprint=other)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SessionFileError):
        load_session(tmp_path / "cut.safetensors", new, fingerprint=fingerprint)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(SessionFileError):
        read_header(tmp_path / "junk.safetensors")
    hybrid, hybrid_drafter = pair("qwen3_5")  # a file of one target's caches does not fit another's
    with pytest.raises(SessionFileError):
        load_session(path, maker(hybrid, hybrid_drafter), fingerprint=fingerprint)


def test_a_session_that_cannot_be_saved_leaves_no_file(tmp_path):
    target, _ = pair("qwen3")
    session = DecodingSession(target, object())  # not a DFlash v1 proposer
    session.tokens = [1, 2, 3]
    with pytest.raises(SessionFileError):
        save_session(session, tmp_path / "s.safetensors", fingerprint="x")
    assert list(tmp_path.iterdir()) == []
