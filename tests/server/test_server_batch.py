"""`serve --max-batch`: concurrent requests decoded together, each reply exactly its solo reply.

Requests are submitted to the engine before its worker starts, so they are all admitted at
once; replies are compared with the same requests served one at a time (`max_batch=1`) and
with mlx-lm's greedy decoding of the target.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers.engine_runs import expected, greedy_requests, prompts, serve_all
from helpers.families import HYBRID_CONFIGS, build
from helpers.serverkit import MODEL_ID, LiveServer, anthropic_client, openai_client, tiny_pair
from helpers.tiny import FakeTokenizer, greedy_reference, tiny_drafter

from mlx_dflash.decoding import session as session_module
from mlx_dflash.server import Engine, EngineConfig
from mlx_dflash.server.worker.jobs import GenerationRequest


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("batch"))


def test_concurrent_greedy_requests_are_batched_and_each_equals_its_solo_reply(pair):
    target, tokenizer, drafter = pair
    batched = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4, block_size=8))
    replies = serve_all(batched, greedy_requests())
    assert sum(batched._scheduler.batch.widths.values()) > 10  # they were decoded in batched cycles
    alone = serve_all(Engine(target, tokenizer, drafter, EngineConfig(max_batch=1, block_size=8)), greedy_requests())
    for reply, solo, request in zip(replies, alone, greedy_requests(), strict=True):
        assert reply.tokens == solo.tokens == expected(target, request)
        assert reply.text == solo.text and reply.finished.finish_reason == solo.finished.finish_reason


def test_stop_strings_and_logprobs_are_unchanged_by_batching(pair):
    target, tokenizer, drafter = pair
    requests = greedy_requests(top_logprobs=2)
    alone = serve_all(Engine(target, tokenizer, drafter, EngineConfig(max_batch=1)), requests)
    # A stop string from the middle of each solo reply.
    stops = [[tokenizer.decode(s.tokens[8:10])] if len(s.tokens) > 12 else [] for s in alone]
    requests = greedy_requests(top_logprobs=2)
    for r, stop in zip(requests, stops, strict=True):
        r.stops = stop
    solo = serve_all(Engine(target, tokenizer, drafter, EngineConfig(max_batch=1)), requests)
    requests = greedy_requests(top_logprobs=2)
    for r, stop in zip(requests, stops, strict=True):
        r.stops = stop
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=6))
    batched = serve_all(engine, requests)
    assert sum(engine._scheduler.batch.widths.values()) > 5  # the stop strings and logprobs were batched
    for b, s in zip(batched, solo, strict=True):
        assert b.text == s.text and b.finished.stop == s.finished.stop
        assert b.finished.finish_reason == s.finished.finish_reason
        ours = [lp for step in b.steps for lp in step.logprobs]
        theirs = [lp for step in s.steps for lp in step.logprobs]
        assert [lp.token for lp in ours] == [lp.token for lp in theirs]
        assert np.allclose([lp.logprob for lp in ours], [lp.logprob for lp in theirs], atol=1e-4)
        assert [[t for t, _ in lp.top] for lp in ours] == [[t for t, _ in lp.top] for lp in theirs]


def test_seeded_samples_repeat_beside_other_requests(pair):
    target, tokenizer, drafter = pair

    def requests():
        greedy = greedy_requests(seed=99)[:3]  # a greedy request's seed must not reseed the sample beside it
        sampled = [GenerationRequest(p, 30, temperature=0.9, top_p=0.95, seed=s)
                   for p, s in zip(prompts(4, (20, 35)), (7, 8), strict=True)]
        unseeded = [GenerationRequest(prompts(5, (15,))[0], 20, temperature=0.7)]
        return sampled[:1] + greedy + sampled[1:] + unseeded

    alone = serve_all(Engine(target, tokenizer, drafter, EngineConfig(max_batch=1)), requests())
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=6))
    together = serve_all(engine, requests())
    assert engine._scheduler.peak >= 3 and sum(engine._scheduler.batch.widths.values()) > 5  # beside a batch
    for i in (0, 1, 2, 3, 4):  # seeded samples and greedy replies repeat exactly
        assert together[i].tokens == alone[i].tokens, i
    assert together[5].finished.finish_reason == "length" and len(together[5].tokens) == 20


def test_a_cancelled_request_leaves_without_disturbing_the_rest(pair):
    target, tokenizer, drafter = pair
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=6))
    replies = serve_all(engine, greedy_requests(), cancel=4)
    assert replies[4].finished.finish_reason == "cancelled" and len(replies[4].tokens) < 40
    assert max(int(w) for w in engine._scheduler.batch.widths) > 1 and engine._scheduler.peak == 6
    for i, (reply, request) in enumerate(zip(replies, greedy_requests(), strict=True)):
        if i != 4:
            assert reply.tokens == expected(target, request)


def test_a_batched_conversation_goes_on_from_the_prompt_cache(pair):
    target, tokenizer, drafter = pair
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4))
    first = serve_all(engine, greedy_requests()[:4], stop=False)
    cycles = sum(engine._scheduler.batch.widths.values())
    assert cycles > 5
    follow = [GenerationRequest(r.prompt + reply.tokens + [9, 10, 11], 20)
              for r, reply in zip(greedy_requests()[:4], first, strict=True)]
    again = serve_all(engine, follow, stop=False)
    assert sum(engine._scheduler.batch.widths.values()) > cycles + 5  # the follow-ups were batched too
    engine.stop()
    for reply, request in zip(again, follow, strict=True):
        assert reply.finished.cached_tokens >= len(request.prompt) - 5
        assert reply.tokens == expected(target, request)


def chunked(pair, monkeypatch, requests: list[GenerationRequest]) -> list[str]:
    """Serve `requests` (prefilled in 16-token chunks) together; the order of their Steps, each checked exact."""
    target, tokenizer, drafter = pair
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 16)
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4))
    for reply, request in zip(serve_all(engine, requests), requests, strict=True):
        assert reply.tokens == expected(target, request)
    return [name for name, kind in engine.log if kind == "Step"]


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(pair, monkeypatch):
    order = chunked(pair, monkeypatch, [GenerationRequest(prompts(1, (5,))[0], 60),
                                        GenerationRequest(prompts(2, (200,))[0], 5)])
    assert order[order.index("0") : order.index("1")].count("0") >= 8  # between the 13 chunks of request 1's prefill


def test_a_short_prompt_does_not_wait_behind_a_long_prefill(pair, monkeypatch):
    order = chunked(pair, monkeypatch, [GenerationRequest(prompts(2, (300,))[0], 5),
                                        GenerationRequest(prompts(1, (5,))[0], 30)])
    assert order.index("1") < order.index("0")  # prefilled between the long prompt's chunks
    assert order[: order.index("0")].count("1") >= 5  # and decoding there


def test_admission_keeps_to_max_batch_and_the_memory_budget(pair):
    target, tokenizer, drafter = pair
    for config, most in ((EngineConfig(max_batch=1), 1), (EngineConfig(max_batch=3), 3),
                         (EngineConfig(max_batch=6, batch_bytes=1), 1)):
        engine = Engine(target, tokenizer, drafter, config)
        replies = serve_all(engine, greedy_requests())
        assert all(r.finished.finish_reason in ("stop", "length") for r in replies)
        assert engine._scheduler.peak == most, config  # the most requests running at once


@pytest.mark.parametrize("model_type", sorted(HYBRID_CONFIGS))
def test_targets_a_batch_cannot_take_decode_side_by_side_and_say_why(model_type, caplog):
    model = build(model_type, seed=1)
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
    tokenizer = FakeTokenizer(eos_token_ids=())
    requests = [GenerationRequest(p, n) for p, n in zip(prompts(3, (9, 30, 4)), (25, 14, 30), strict=True)]
    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        engine = Engine(model, tokenizer, drafter, EngineConfig(max_batch=4, prompt_cache_bytes=0))
        replies = serve_all(engine, requests)
    reason = "recurrent layers" if model_type.startswith("qwen3") else "sliding-window attention layers"
    assert any(reason in record.getMessage() for record in caplog.records)
    assert engine._scheduler.peak == 3 and not engine._scheduler.batch.widths
    for reply, request in zip(replies, requests, strict=True):
        assert reply.tokens == greedy_reference(model, request.prompt, request.max_tokens)


def test_both_apis_and_tools_under_concurrency(tmp_path):
    from helpers.scripted import CALL, TEMPLATE, WEATHER, scripted_pair

    pair = scripted_pair(tmp_path, template=TEMPLATE, strings=[CALL, "It is sunny."],
                         script=[(":", CALL), (CALL, "</s>"), ("=", "It is sunny."), ("It is sunny.", "</s>")])
    question = [{"role": "user", "content": "Weather in Paris?"}]
    with LiveServer(*pair, config=EngineConfig(max_batch=4)) as live:
        openai, anthropic = openai_client(live), anthropic_client(live)

        def chat(_):
            reply = openai.chat.completions.create(model=MODEL_ID, messages=question, tools=[WEATHER], max_tokens=16)
            return json.loads(reply.choices[0].message.tool_calls[0].function.arguments)

        def message(_):
            reply = anthropic.messages.create(model=MODEL_ID, messages=question, max_tokens=16, tools=[
                {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
            return next(b.input for b in reply.content if b.type == "tool_use")

        with ThreadPoolExecutor(6) as pool:
            calls = list(pool.map(chat, range(3))) + list(pool.map(message, range(3)))
        assert calls == [{"city": "Paris"}] * 6
        assert live.engine._scheduler.peak >= 2
        health = httpx.get(live.url + "/health").json()["batch"]
        assert health["max_batch"] == 4 and health["running"] == 0 and sum(health["cycles_by_width"].values()) > 0


def test_a_failing_batch_ends_its_requests_and_the_server_goes_on(pair, monkeypatch):
    from mlx_dflash.batching.batch import SessionBatch

    target, tokenizer, drafter = pair
    real_step, calls = SessionBatch.step, []

    def failing(self):
        calls.append(len(self))
        if len(calls) == 3:  # once, at the third batched cycle
            raise RuntimeError("out of memory (simulated)")
        real_step(self)

    monkeypatch.setattr(SessionBatch, "step", failing)
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4))
    replies = serve_all(engine, greedy_requests()[:3], stop=False)
    assert [r.finished.finish_reason for r in replies] == ["error"] * 3
    assert "out of memory (simulated)" in replies[0].finished.error
    assert calls[2] == 3
    again = serve_all(engine, greedy_requests()[:2])  # a fresh batch
    for reply, request in zip(again, greedy_requests()[:2], strict=True):
        assert reply.tokens == expected(target, request)
