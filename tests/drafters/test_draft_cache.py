"""Cache invariants: target and draft caches after every cycle, windows, growth, chat truncation."""

from __future__ import annotations

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from helpers.families import assert_same_state, decode
from helpers.tiny import VOCAB, greedy_reference

from mlx_dflash import stream_generate
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.drafters.draft_cache import DraftContextCache
from mlx_dflash.drafters.injection import ContextInjector
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.model import TargetModel

generate_module = importlib.import_module("mlx_dflash.generate")


class NoisyOracleDFlash(DFlashProposer):
    """A real DFlash proposer (drafter, injector, draft cache) whose proposals are then
    replaced by the target's greedy continuation with errors, so that acceptance lengths
    vary although the tiny drafter is random."""

    def __init__(self, *args, sequence, error_rate, seed=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.sequence, self.error_rate = sequence, error_rate
        self.rng = np.random.default_rng(seed)

    def propose(self, last_token, position, block_size):
        drafted = super().propose(last_token, position, block_size)  # exercises the drafter
        assert drafted.shape == (block_size - 1,)
        out = []
        for k in range(1, block_size):
            true = self.sequence[position + k] if position + k < len(self.sequence) else 0
            out.append((true + 1) % VOCAB if self.rng.random() < self.error_rate else true)
        return mx.array(out, dtype=mx.uint32)


def record_sessions(monkeypatch) -> list[DecodingSession]:
    sessions: list[DecodingSession] = []

    class Recorded(DecodingSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sessions.append(self)

    monkeypatch.setattr(generate_module, "DecodingSession", Recorded)
    return sessions


def assert_session_invariants(session: DecodingSession, window: int | None):
    committed = len(session.tokens) - 1  # every token but the pending one is cached
    for c in session.cache:
        assert c.offset == committed, (c.offset, committed)
    draft = session.proposer.cache
    # Deferred injection: the drafter holds the committed positions but those still queued.
    assert draft.offset + session.pending_positions == committed, (draft.offset, session.pending_positions, committed)
    assert draft.stored + draft.max_block_size <= draft.capacity  # room for the next block
    if window is not None:  # bounded memory: the window, its slack and one block
        assert draft.capacity <= 2 * window + draft.max_block_size


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_caches_track_the_committed_tokens_after_every_cycle(family, window, targets, drafters,
                                                             make_tokenizer, monkeypatch):
    sessions = record_sessions(monkeypatch)
    model, drafter = targets(family), drafters(family)
    target = TargetModel(model)
    prompt = [int(t) for t in np.random.default_rng(1).integers(4, VOCAB, 30)]
    block_size, max_tokens = 8, 120
    reference = greedy_reference(model, prompt, max_tokens + block_size)
    proposer = NoisyOracleDFlash(drafter, target, max_block_size=block_size, window=window,
                                 sequence=prompt + reference, error_rate=0.15, seed=2)
    tokens = []
    for event in stream_generate(model, make_tokenizer(()), prompt, draft_model=proposer,
                                 max_tokens=max_tokens, block_size=block_size):
        tokens += event.tokens
        (session,) = sessions
        assert_session_invariants(session, window)
        assert session.tokens == prompt + tokens
    assert tokens == reference[:max_tokens]
    lengths = event.stats.acceptance_lengths
    assert len(set(lengths)) >= 4  # partial acceptances really happened (rollbacks of all sizes)


@pytest.mark.parametrize("window", [None, 6])
def test_invariants_through_stream_generate_with_a_drafter(window, targets, drafters, make_tokenizer,
                                                           monkeypatch):
    """The same through the public `draft_window=` option and a plain DFlash drafter."""
    sessions = record_sessions(monkeypatch)
    model, drafter = targets("qwen3"), drafters("qwen3")
    for _event in stream_generate(model, make_tokenizer(()), list(range(4, 60)), draft_model=drafter,
                                  max_tokens=25, block_size=5, draft_window=window):
        assert_session_invariants(sessions[0], window)
    assert sessions[0].proposer.cache.window == window


# ------------------------------------------------------------- DraftContextCache alone


def random_kv(rng, layers, n, kv_heads=2, head_dim=4):
    return ([mx.array(rng.standard_normal((1, kv_heads, n, head_dim)), dtype=mx.float32) for _ in range(layers)],
            [mx.array(rng.standard_normal((1, kv_heads, n, head_dim)), dtype=mx.float32) for _ in range(layers)])


@pytest.mark.parametrize("window", [None, 1, 5, 16, 64])
def test_attend_span_is_the_last_window_positions_plus_the_block(window):
    rng = np.random.default_rng(0 if window is None else window)
    layers, max_block = 2, 6
    cache = DraftContextCache(layers, 2, 4, max_block_size=max_block, window=window)
    all_keys = [np.zeros((1, 2, 0, 4))] * layers
    all_values = [np.zeros((1, 2, 0, 4))] * layers
    # Appends of every size: single tokens, whole blocks, and chunks longer than the window.
    for n in [3, 1, 1, 7, 0, 40, 2, 1, 130, 5, 1, 1, 64, 300, 2]:
        keys, values = random_kv(rng, layers, n)
        cache.append(keys, values)
        all_keys = [np.concatenate([a, np.array(k)], axis=2) for a, k in zip(all_keys, keys, strict=True)]
        all_values = [np.concatenate([a, np.array(v)], axis=2) for a, v in zip(all_values, values, strict=True)]
        total = all_keys[0].shape[2]
        assert cache.offset == total
        block = int(rng.integers(1, max_block + 1))
        bk, bv = random_kv(rng, layers, block)
        for layer in range(layers):
            k, v = cache.attend_span(layer, bk[layer], bv[layer])
            seen = total if window is None else min(window, total)
            np.testing.assert_array_equal(np.array(k), np.concatenate(
                [all_keys[layer][:, :, total - seen :], np.array(bk[layer])], axis=2))
            np.testing.assert_array_equal(np.array(v), np.concatenate(
                [all_values[layer][:, :, total - seen :], np.array(bv[layer])], axis=2))
        # The block's K/V are transient: nothing committed changed.
        assert cache.offset == total


def test_windowed_keys_equal_the_unwindowed_keys_of_the_same_positions(targets, drafters):
    """With a window, the drafter attends exactly the keys it would compute without one."""
    model, drafter = targets("qwen3"), drafters("qwen3")
    target = TargetModel(model)
    injector = ContextInjector(drafter)
    window, block = 9, 8
    full = DFlashProposer(drafter, target, max_block_size=block, injector=injector)
    windowed = DFlashProposer(drafter, target, max_block_size=block, window=window, injector=injector)
    rng = np.random.default_rng(3)
    width = len(drafter.target_layer_ids) * target.hidden_size
    position = 0
    for n in [4, 1, 3, 20, 1, 1, 7, 2]:
        features = mx.array(rng.standard_normal((1, n, width)), dtype=mx.float32)
        full.commit(features, position)
        windowed.commit(features, position)
        position += n
        bk, bv = random_kv(rng, 1, block, drafter.args.num_key_value_heads, drafter.args.head_dim)
        for layer in range(drafter.args.num_hidden_layers):
            kf, vf = full.cache.attend_span(layer, bk[0], bv[0])
            kw, vw = windowed.cache.attend_span(layer, bk[0], bv[0])
            seen = min(window, position) + block
            np.testing.assert_allclose(np.array(kw), np.array(kf)[:, :, -seen:], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(np.array(vw), np.array(vf)[:, :, -seen:], rtol=1e-6, atol=1e-6)
        # ... and drafts the same block from it when the context fits in the window.
        if position <= window:
            last = mx.array([7], dtype=mx.uint32)
            assert full.propose(last, position, block).tolist() == windowed.propose(last, position, block).tolist()


def test_growth_is_geometric():
    """Appending one position at a time reallocates O(log n) times, not O(n)."""
    cache = DraftContextCache(1, 1, 2, max_block_size=16)
    one = [mx.zeros((1, 1, 1, 2))]
    n = 5000
    for _ in range(n):
        cache.append(one, one)
    assert cache.offset == n
    assert cache.growths <= math.ceil(math.log2(n / 256)) + 2, cache.growths
    assert cache.capacity < 4 * n


def test_windowed_memory_is_bounded_and_compaction_amortised():
    window, n = 50, 5000
    cache = DraftContextCache(1, 1, 2, max_block_size=16, window=window)
    one = [mx.zeros((1, 1, 1, 2))]
    capacities = set()
    for _ in range(n):
        cache.append(one, one)
        capacities.add(cache.capacity)
    assert cache.offset == n
    assert cache.stored <= 2 * window
    assert max(capacities) <= 2 * window + 16
    # Each compaction frees at least ~window slots: at most n / window + O(1) copies.
    assert cache.growths <= n / window + 2, cache.growths


# ------------------------------------------------------------- chat-like truncation


def run_session(session, sampler, n, block_size):
    out = []
    while len(out) < n:
        verified = session.step(sampler, block_size)
        session.keep(verified, len(verified.tokens))
        out += verified.tokens
    return out


@pytest.mark.parametrize("window", [None, 64])
def test_truncate_then_extend_equals_a_fresh_session(window, targets, drafters):
    """Drop part of a reply, add a new turn: the continuation equals a fresh session's."""
    from mlx_lm.sample_utils import make_sampler

    model, drafter = targets("qwen3"), drafters("qwen3")
    target = TargetModel(model)
    greedy = make_sampler(0.0)
    block = 6
    turn1, turn2 = list(range(10, 40)), [50, 51, 52, 53]

    session = DecodingSession(target, DFlashProposer(drafter, target, max_block_size=block, window=window))
    session.extend(turn1, greedy)
    reply = run_session(session, greedy, 20, block)
    keep = len(turn1) + 1 + 7  # the first 8 reply tokens survive (one came from the prefill)
    session.truncate(keep)
    assert len(session.tokens) == keep
    assert all(c.offset == keep - 1 for c in session.cache)
    assert session.proposer.cache.offset == keep - 1
    session.extend(turn2, greedy)
    continued = run_session(session, greedy, 25, block)

    fresh = DecodingSession(target, DFlashProposer(drafter, target, max_block_size=block, window=window))
    history = session.tokens[:keep]
    assert history[: len(turn1)] == turn1 and reply[:7] == history[len(turn1) + 1 :]
    fresh.extend(history + turn2, greedy)
    expected = run_session(fresh, greedy, 25, block)
    assert session.tokens == fresh.tokens
    assert continued[:25] == expected[:25]
    assert continued[:25] == greedy_reference(model, history + turn2, 26)[1:26]
    # The truncated-and-refilled draft context equals the fresh one (same keys attended).
    for layer in range(drafter.args.num_hidden_layers):
        probe = mx.zeros((1, drafter.args.num_key_value_heads, 1, drafter.args.head_dim))
        a, _ = session.proposer.cache.attend_span(layer, probe, probe)
        b, _ = fresh.proposer.cache.attend_span(layer, probe, probe)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


def test_trim_forgets_the_last_positions_or_refuses():
    rng = np.random.default_rng(5)
    cache = DraftContextCache(1, 2, 4, max_block_size=4)
    keys, values = random_kv(rng, 1, 30)
    cache.append(keys, values)
    cache.trim(12)
    assert cache.offset == 18
    more_k, more_v = random_kv(rng, 1, 5)
    cache.append(more_k, more_v)
    k, _ = cache.attend_span(0, *[x[0] for x in random_kv(rng, 1, 2)])
    expected = np.concatenate([np.array(keys[0])[:, :, :18], np.array(more_k[0])], axis=2)
    np.testing.assert_array_equal(np.array(k)[:, :, :23], expected)

    windowed = DraftContextCache(1, 2, 4, max_block_size=4, window=8)
    for _ in range(10):
        windowed.append(*random_kv(rng, 1, 7))
    assert windowed.offset == 70
    windowed.trim(3)  # within what the window still holds
    assert windowed.offset == 67
    with pytest.raises(ValueError):  # positions compacted away cannot come back
        windowed.trim(windowed.stored + 1)
    assert windowed.offset == 67
    windowed.trim(67)  # everything: an empty cache again
    assert windowed.offset == 0


def test_truncate_past_a_compacted_window_recomputes(targets, drafters):
    """A chat drops more than a draft window still holds: the session rebuilds, consistently."""
    from mlx_lm.sample_utils import make_sampler

    target, drafter = TargetModel(targets("qwen3")), drafters("qwen3")
    greedy = make_sampler(0.0)
    session = DecodingSession(target, DFlashProposer(drafter, target, max_block_size=8, window=4))
    session.extend(list(range(10, 40)), greedy)
    session.truncate(12)  # 19 positions back: more than the 4 the window kept
    assert session.proposer.cache.offset == len(session.tokens) - 1 == session.cache[0].offset
    session.extend([50, 51], greedy)
    fresh = DecodingSession(target, DFlashProposer(drafter, target, max_block_size=8, window=4))
    fresh.extend(session.tokens[:-1], greedy)
    assert_same_state(session, fresh)  # target K/V and the draft window, not only the tokens
    history = session.tokens[:-1]
    reference = greedy_reference(target.model, history, 21)[1:]
    assert decode(session, greedy, 20, 8) == decode(fresh, greedy, 20, 8) == reference
    assert_same_state(session, fresh)


def test_injector_is_shared_until_the_drafter_weights_change(targets):
    """Generations reuse one stacked K/V weight; a weight update (training) rebuilds it."""
    from helpers.tiny import tiny_drafter

    drafter = tiny_drafter(targets("qwen3"), seed=9)
    first = ContextInjector.for_drafter(drafter)
    assert ContextInjector.for_drafter(drafter) is first
    layer = drafter.layers[1].self_attn
    layer.v_proj.weight = layer.v_proj.weight * 2.0
    rebuilt = ContextInjector.for_drafter(drafter)
    assert rebuilt is not first
    rows = layer.n_kv_heads * drafter.args.head_dim
    stacked = rebuilt.projection.weight
    assert mx.array_equal(stacked[3 * rows : 4 * rows], layer.v_proj.weight).item()


def test_quantized_drafter_injects_like_its_own_layers_and_stays_lossless(targets):
    """A quantized drafter: the stacked context projection equals each layer's own k/v_proj."""
    import mlx.nn as nn
    from helpers.tiny import FakeTokenizer, tiny_drafter

    model = targets("qwen3")
    drafter = tiny_drafter(model, seed=4)
    nn.quantize(drafter, group_size=32, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear) and p != "fc")
    assert hasattr(drafter.layers[0].self_attn.k_proj, "scales")
    injector = ContextInjector.for_drafter(drafter)
    context = mx.random.normal((1, 5, drafter.args.hidden_size))
    kv = injector.project(context)  # (1, 5, layers, 2, kv_heads, head_dim)
    for i, layer in enumerate(drafter.layers):
        for j, proj in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj)):
            own = proj(context).reshape(1, 5, layer.self_attn.n_kv_heads, -1)
            assert mx.allclose(kv[:, :, i, j], own, atol=1e-5).item()
    prompt = list(range(10, 50))
    ref = greedy_reference(model, prompt, 30)
    out = [t for e in stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=drafter,
                                      max_tokens=30) for t in e.tokens]
    assert out == ref
