"""The server's prompt cache: a conversation's second turn computes only its new tokens and equals
a cold run, for an attention, a hybrid (GatedDeltaNet) and a sliding-window target; LRU in bytes."""

from __future__ import annotations

import itertools

import openai
import pytest
from helpers.families import CountingTarget, build
from helpers.serverkit import MODEL_ID, LiveServer
from helpers.tiny import EOS_ID, greedy_reference, tiny_drafter, tiny_tokenizer

from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.server.worker.prompt_cache import PromptCache, session_bytes
from mlx_dflash.targets.model import TargetModel

SPECIALS = {0, 1, 3}  # decode to markup that does not re-encode to the same ids


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def prefilled(fed: list[int], family: str) -> int:
    """Positions the prefill computed: targets that cannot roll back take a prompt in two forwards
    (all but its last two positions, a copy kept, then those two), the others in one."""
    return fed[0] if family == "qwen3" else fed[0] + fed[1]


def reply_of(model, tokenizer, messages, n):
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    out = greedy_reference(model, prompt, n)
    return (out[: out.index(EOS_ID)] if EOS_ID in out else out), prompt


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3_text"])  # attention, hybrid, sliding window
def test_second_turn_computes_only_new_tokens_and_equals_a_cold_run(family, tokenizer):
    model = build(family, seed=3)
    target = CountingTarget(model)
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
    # A first question whose reply re-renders to the same ids (no special tokens in it).
    for i in range(12):
        first = [{"role": "user", "content": f"Question {i}: what is a cache?"}]
        ids, _ = reply_of(model, tokenizer, first, 16)
        if not SPECIALS & set(ids):
            break
    else:
        pytest.skip("no first reply free of special tokens")
    with LiveServer(target, tokenizer, drafter) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        one = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=16)
        assert one.choices[0].message.content == tokenizer.decode(ids)
        assert one.usage.prompt_tokens_details.cached_tokens == 0
        second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                          {"role": "user", "content": "And a second one, please?"}]
        expected, prompt = reply_of(model, tokenizer, second, 20)
        target.fed.clear()
        two = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=20)
        cached = two.usage.prompt_tokens_details.cached_tokens
        # Turn one's prompt and reply (all but the pending token) come from the cache.
        assert cached == one.usage.prompt_tokens + len(ids) - (len(ids) == 16)
        assert prefilled(target.fed, family) == len(prompt) - cached  # the prefill computed only the rest
        assert two.model_extra["dflash"]["cached_prompt_tokens"] == cached
        assert two.choices[0].message.content == tokenizer.decode(expected)  # equals the cold run


def _session(model_type: str, tokens: int) -> DecodingSession:
    from mlx_lm.sample_utils import make_sampler

    session = DecodingSession(TargetModel(build(model_type, seed=5)))
    session.extend(list(range(10, 10 + tokens)), make_sampler(0.0))
    return session


def test_lru_in_bytes_and_divergent_prefixes():
    sessions = [_session("qwen3", 20) for _ in range(3)]
    size = session_bytes(sessions[0])
    cache = PromptCache(2 * size, lambda: DecodingSession(sessions[0].target))
    for s in sessions:
        s.tokens[5] = 100 + len(cache)  # three distinct histories
        cache.store(s)
    assert len(cache) == 2 and cache.nbytes <= 2 * size  # the oldest went first
    newest = sessions[2]
    diverging = newest.tokens[:12] + [120, 121]
    session, cached = cache.fetch(diverging)
    assert cached == 12 and session.tokens == diverging[:13] and session is not newest
    assert len(cache) == 2  # the longer history stays for its own continuation
    extending = newest.tokens + [7, 8]
    session, cached = cache.fetch(extending)
    assert session is newest and cached == len(newest.tokens) - 1 and len(cache) == 1


def test_copies_keep_their_state_when_the_original_is_written_in_place():
    """One copy serves the prompt cache's clones and the target's checkpoints (nested caches too)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    from mlx_dflash.targets.model import copy_cache

    ones = mx.ones((1, 2, 3, 4))
    nested = CacheList(KVCache(), ArraysCache(1))
    nested[0].update_and_fetch(ones, ones)
    nested[1][0] = mx.zeros((1, 3))
    clone = copy_cache(nested)
    nested[0].update_and_fetch(2 * ones, 2 * ones)  # written into the same buffer, in place
    assert clone[0].offset == 3 and clone[0].keys[..., 3:6, :].sum().item() == 0
    assert clone[1][0] is not nested[1][0]
    target = TargetModel(build("qwen3"))
    window = RotatingKVCache(max_size=4)
    window.update_and_fetch(ones, ones)
    saved = target.checkpoint([window])
    window.update_and_fetch(3 * ones[..., :1, :], 3 * ones[..., :1, :])  # in place, into the ring
    assert mx.array_equal(saved.states[0][0], ones).item()


def test_hybrid_divergence_starts_cold():
    session = _session("qwen3_5", 12)
    cache = PromptCache(1 << 30, lambda: DecodingSession(session.target))
    cache.store(session)
    fresh, cached = cache.fetch(session.tokens[:6] + [99, 98])
    assert cached == 0 and fresh.tokens == [] and len(cache) == 1  # a recurrent state cannot be rewound


def test_swapping_the_pending_token_equals_a_cold_run():
    """A prompt that leaves a hybrid session only at its pending token reuses every cached position."""
    from mlx_lm.sample_utils import make_sampler

    session = _session("qwen3_5", 12)
    cache = PromptCache(1 << 30, lambda: DecodingSession(session.target))
    cache.store(session)
    other = (session.tokens[-1] + 1) % 100 + 4
    prompt = session.tokens[:-1] + [other, 50, 51]
    reused, cached = cache.fetch(prompt)
    assert reused is session and cached == len(prompt) - 3 and reused.tokens[-1] == other
    greedy = make_sampler(0.0)
    warm = reused.extend(prompt[len(reused.tokens):], greedy)
    cold = DecodingSession(session.target)
    assert warm == cold.extend(prompt, greedy)
    assert reused.tokens == cold.tokens


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3_text"])
def test_a_rerendered_reply_still_reuses_the_whole_first_prompt(family, tokenizer):
    """The client sends back a reply that differs from what was generated (as templates that strip
    thinking do): everything up to it still comes from the cache, in every family."""
    model = build(family, seed=4)
    target = CountingTarget(model)
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
    first = [{"role": "user", "content": "Tell me about caches."}]
    with LiveServer(target, tokenizer, drafter) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        one = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=12)
        reply = one.choices[0].message.content
        edited = ("x" if not reply.startswith("x") else "y") + reply[1:]
        second = first + [{"role": "assistant", "content": edited}, {"role": "user", "content": "Go on."}]
        expected, prompt = reply_of(model, tokenizer, second, 16)
        target.fed.clear()
        two = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=16)
    # Targets that cannot roll back keep each prompt but its last two positions (the copy that also serves
    # the same prompt asked again).
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached == one.usage.prompt_tokens - (0 if family == "qwen3" else 2)
    assert prefilled(target.fed, family) == len(prompt) - cached
    assert two.choices[0].message.content == tokenizer.decode(expected)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])  # recurrent, sliding window
def test_a_new_session_with_the_same_system_prompt_reuses_it_on_unrewindable_targets(family, tokenizer):
    """An agent's second session (or a sub-agent) shares the system prompt and tools but not the first
    user message: the caches come back from the mark kept where that message opened, and the reply
    equals a cold run's."""
    model = build(family, seed=5)
    target = CountingTarget(model)
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
    system = {"role": "system", "content": "You are a careful coding agent. Tools: read, edit, run. " * 3}
    one = [system, {"role": "user", "content": "Fix the failing test."}]
    two = [system, {"role": "user", "content": "Explain main.py please."}]
    with LiveServer(target, tokenizer, drafter) as live:
        live.engine.prompt_cache.openers = {tokenizer.get_vocab()["<"]}  # this template opens messages with '<'
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        client.chat.completions.create(model=MODEL_ID, messages=one, max_tokens=8)
        expected, prompt = reply_of(model, tokenizer, two, 12)
        target.fed.clear()
        reply = client.chat.completions.create(model=MODEL_ID, messages=two, max_tokens=12)
    shared = len(tokenizer.apply_chat_template([system], add_generation_prompt=False))  # up to the user's '<'
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached == shared
    # The prefill's forwards (cut at marks and at the copy) cover exactly the rest of the prompt.
    assert len(prompt) - cached in itertools.accumulate(target.fed) and target.fed[0] < len(prompt) - cached + 1
    assert reply.choices[0].message.content == tokenizer.decode(expected)


def test_a_hybrid_session_an_error_left_mid_cycle_goes_back_to_its_latest_mark():
    from helpers.families import decode

    from mlx_dflash.decoding.prefix_marks import mark_positions
    from mlx_dflash.decoding.sampling import make_sampler
    from mlx_dflash.proposers.dflash import DFlashProposer
    from mlx_dflash.server.worker.prompt_cache import recover

    greedy = make_sampler(0.0)
    model = build("qwen3_5", seed=6)
    target = TargetModel(model)
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
    prompt = [1, 5, 9, 7, 4, 4, 8, 2, 6, 7, 3, 9, 9, 5, 11, 12]

    def session():
        return DecodingSession(target, DFlashProposer(drafter, target, max_block_size=6))

    broken = session()
    broken.mark_at = set(mark_positions(prompt, 0, {7}, every=0))
    broken.extend(prompt, greedy)
    broken.step(greedy, 6)  # the verify pass wrote past the committed tokens; no `keep` follows (an error)
    assert recover(broken)
    assert broken.tokens == prompt[:10]  # back to the mark before the second opener
    fresh = session()
    fresh.extend(prompt[:9], greedy)
    fresh.tokens[-1] = prompt[9]
    broken.extend(prompt[10:], greedy)
    fresh.extend(prompt[10:], greedy)
    assert decode(broken, greedy, 8, 4) == decode(fresh, greedy, 8, 4)
    assert not recover(session())  # nothing committed, no mark: not reusable
