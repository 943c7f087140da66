"""Draft trees in `serve`: a request decoded alone verifies trees as the engine's tree budget says and
replies as without them; batched requests verify linear blocks and reply as alone; a budget the pair
cannot verify is refused when the engine is built, "auto" is not."""

from __future__ import annotations

import pytest
from helpers.engine_runs import expected, greedy_requests, serve_all
from helpers.families import cached_pair
from helpers.serverkit import MODEL_ID, LiveServer, openai_client, tiny_pair

from mlx_dflash.batching.batch import SessionBatch
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.errors import DFlashError
from mlx_dflash.server import Engine, EngineConfig
from mlx_dflash.server.worker.jobs import GenerationRequest


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("trees"))


def test_a_lone_request_with_a_tree_budget_replies_as_without(pair):
    model, tokenizer, drafter = pair
    request = GenerationRequest([1, 5, 9, 2, 7, 3], 40)
    replies = {}
    for budget in (0, 16):
        engine = Engine(model, tokenizer, drafter, EngineConfig(block_size=8, tree_budget=budget, max_batch=1,
                                                                prompt_cache_bytes=0))
        (replies[budget],) = serve_all(engine, [request])
    linear, trees = replies[0], replies[16]
    assert trees.tokens == linear.tokens == expected(model, request)
    assert set(linear.finished.stats.tree_sizes) == {0}
    sizes = trees.finished.stats.tree_sizes
    assert set(sizes) <= {0, 16} and sizes.count(16) >= len(sizes) - 2


def test_the_reply_over_http_counts_its_tree_cycles(pair):
    model, tokenizer, drafter = pair
    config = EngineConfig(block_size=8, tree_budget=16, tree_shape="paper", prompt_cache_bytes=0)
    with LiveServer(model, tokenizer, drafter, config=config) as live:
        reply = openai_client(live).completions.create(model=MODEL_ID, prompt=[1, 5, 9, 2, 7, 3], max_tokens=24)
    assert reply.choices[0].text == tokenizer.decode(expected(model, GenerationRequest([1, 5, 9, 2, 7, 3], 24)))
    extension = reply.model_extra["dflash"]
    assert extension["cycles"] >= extension["tree_cycles"] >= extension["cycles"] - 2 > 0


def test_batched_requests_verify_linear_blocks_and_reply_as_alone(pair, monkeypatch):
    model, tokenizer, drafter = pair
    widths, steps = [], []  # rows of each batched cycle; (in a batch, a tree) of each session step
    batch_step, session_step = SessionBatch.step, DecodingSession.step

    def record_batch(self):
        widths.append(len(self.rows))
        return batch_step(self)

    def record_step(self, *args, tree=None, **kwargs):
        steps.append((self.batch is not None, tree is not None))
        return session_step(self, *args, tree=tree, **kwargs)

    monkeypatch.setattr(SessionBatch, "step", record_batch)
    monkeypatch.setattr(DecodingSession, "step", record_step)
    engine = Engine(model, tokenizer, drafter, EngineConfig(block_size=8, tree_budget=16, max_batch=3,
                                                            prompt_cache_bytes=0))
    requests = greedy_requests()[:3]
    replies = serve_all(engine, requests)
    for request, reply in zip(requests, replies, strict=True):
        assert reply.tokens == expected(model, request)
    assert max(widths, default=0) >= 2  # they were batched
    assert (True, True) not in steps and (False, True) in steps  # trees only for a request decoded alone


def test_an_engine_refuses_an_explicit_budget_a_hybrid_cannot_verify(pair):
    _, tokenizer, _ = pair
    model, drafter = cached_pair("qwen3_5")
    with pytest.raises(DFlashError, match="tree budget 16: qwen3_5 targets verify linear blocks only"):
        Engine(model, tokenizer, drafter, EngineConfig(block_size=6, tree_budget=16, prompt_cache_bytes=0))
    engine = Engine(model, tokenizer, drafter, EngineConfig(block_size=6, tree_budget="auto", prompt_cache_bytes=0))
    assert engine.tree_budget == "auto"
