"""Sampling (temperature > 0) stays exact on every decode path, not only the plain-attention one.

Each generated token is checked against the target alone: the target's own logits
for the actual prefix, filtered as mlx-lm's `make_sampler` filters them (top-p,
min-p, top-k, then temperature), give the distribution it must have been drawn
from. Its randomised probability integral transform (tokens ordered by decreasing
probability) is then Uniform(0, 1), independently for every token of every
generation; a chi-square test on its histogram pools thousands of tokens. A
drafting bias towards likely tokens or a stale recurrent state after a rollback
shows up as mass piling up near 0. Covered: hybrid (GatedDeltaNet: checkpoint and
mixer replay) and sliding-window (checkpoint and full replay) targets, top-k and
min-p, adaptive drafting, and a chat reply.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest
from helpers.distributions import P_BROKEN, pit_pvalue
from helpers.families import build
from helpers.tiny import EOS_ID, FakeTokenizer, adaptive_options, save_target
from mlx_lm.models.cache import ArraysCache

import mlx_dflash
from mlx_dflash.chat import ChatEngine, ChatSettings
from mlx_dflash.targets.model import TargetModel

generate_module = importlib.import_module("mlx_dflash.generate")

P_HONEST = 1e-4  # fixed seeds: every p-value is deterministic
N = 50  # generations per case (x 24 tokens); a greedy-oracle proposal costs most of the time


class SessionOracle:
    """Proposes the target's greedy next token after what the session has committed.

    It reads the committed tokens from the session itself (`history`), so plain steps
    (adaptive drafting, a budget of one) keep it in step.
    """

    def __init__(self, model, history=None):
        self.model, self.history = model, history
        self.target_layer_ids = [0]

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        seq = self.history()[: position + 1]
        assert seq[-1] == int(last_token.item())
        # One target pass per cycle (cheap): its greedy token, repeated to fill the block.
        guess = mx.argmax(self.model(mx.array([seq], dtype=mx.uint32))[0, -1]).astype(mx.uint32)
        return mx.repeat(guess[None], block_size - 1)

    def commit(self, features, position: int) -> None:
        pass

    def trim(self, num_positions: int) -> None:
        pass

    def state_arrays(self) -> list:
        return []


@pytest.fixture
def oracle(monkeypatch):
    """`oracle(model)`: a SessionOracle wired to the session stream_generate creates for it."""

    class Wired(generate_module.DecodingSession):
        def __init__(self, target, proposer=None, *args, **kwargs):
            super().__init__(target, proposer, *args, **kwargs)
            if isinstance(proposer, SessionOracle):
                proposer.history = lambda: self.tokens

    monkeypatch.setattr(generate_module, "DecodingSession", Wired)
    return SessionOracle


def generate_many(model, n: int, prompt: list[int], max_tokens: int, seed: int, block_size: int = 4, **options):
    """n sampled generations with a greedy-oracle proposer (often right, so drafts are accepted).

    Returns the outputs, (draft tokens accepted, draft tokens proposed), and the plain (undrafted) cycles.
    """
    mx.random.seed(seed)
    outputs, accepted, proposed, plain = [], 0, 0, 0
    for _ in range(n):
        tokens = []
        for event in mlx_dflash.stream_generate(
            model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=SessionOracle(model),
            max_tokens=max_tokens, **{"block_size": block_size, **options},
        ):
            tokens += event.tokens
            accepted += event.num_draft_accepted
        proposed += sum(event.stats.proposed_by_source.values())
        plain += event.stats.plain_cycles
        outputs.append(tokens)
    return outputs, (accepted, proposed), plain


# (target, sampling options, path exercised)
CASES = {
    "hybrid-top_k": ("qwen3_5", dict(temp=1.0, top_k=4)),
    "sliding_window-min_p": ("gemma3_text", dict(temp=0.9, min_p=0.1)),
    "hybrid-adaptive-top_p": ("qwen3_next", dict(temp=1.0, top_p=0.8, **adaptive_options())),
}
PROMPT = [5, 17, 33, 90, 41, 12, 7, 64, 100, 23, 51]  # longer than the sliding window (8)


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, model_type):
    if model_type not in models:
        models[model_type] = build(model_type, seed=3)
    return models[model_type]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tokens_follow_the_target_on_every_path(case, models, oracle):
    model_type, options = CASES[case]
    model = _model(models, model_type)
    outputs, (accepted, proposed), plain = generate_many(model, N, PROMPT, 24, seed=7, **options)
    sampling = {k: v for k, v in options.items() if k not in ("adaptive", "block_size")}
    p = pit_pvalue(model, [PROMPT] * len(outputs), outputs, seed=1, **sampling)
    assert p > P_HONEST, p
    # Drafts were accepted, and rejected (rollbacks ran). `auto` chooses by measured time, so only counts are asserted.
    assert 10 <= accepted <= proposed - 10, (accepted, proposed)
    if case.startswith("hybrid-adaptive"):
        assert plain > 0  # adaptive drafting mixed plain steps with drafting cycles
    # The filter matters here: the same tokens fail against the unfiltered distribution.
    assert pit_pvalue(model, [PROMPT] * len(outputs), outputs, seed=1, temp=sampling["temp"]) < P_BROKEN


@pytest.mark.slow
def test_a_stale_recurrent_state_is_detected(models, monkeypatch, oracle):
    """Control: a rollback that keeps the rejected drafts' GatedDeltaNet state fails the same test."""
    model = _model(models, "qwen3_5")

    def trim_only(self, cache, num_tokens, checkpoint=None, replay=None):
        for c in cache:
            if not isinstance(c, ArraysCache):
                c.trim(num_tokens)

    monkeypatch.setattr(TargetModel, "rollback", trim_only)
    outputs, _, _ = generate_many(model, N // 2, PROMPT, 24, seed=7, temp=1.0, top_k=20)
    assert pit_pvalue(model, [PROMPT] * len(outputs), outputs, seed=1, temp=1.0, top_k=20) < P_BROKEN


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    from helpers.tiny import tiny_target

    path = save_target(tiny_target("qwen3", seed=5), "qwen3", tmp_path_factory.mktemp("chat-target"))
    model, tokenizer, _ = mlx_dflash.load(str(path))
    return model, tokenizer


@pytest.mark.slow
def test_chat_replies_follow_the_target_with_top_k_and_min_p(chat_pair):
    model, tokenizer = chat_pair
    def settings():
        fixed = ChatSettings(temp=1.0, top_k=5, min_p=0.05, max_tokens=16, block_size=4)
        fixed.adaptive = False  # draft every cycle (where chat still has adaptive drafting)
        return fixed

    rendered = ChatEngine(model, tokenizer, None).render([{"role": "user", "content": "hi there"}])
    mx.random.seed(3)
    outputs, accepted = [], 0
    for _ in range(N):
        engine = ChatEngine(model, tokenizer, SessionOracle(model), settings())
        engine.draft_model.history = lambda engine=engine: engine.session.tokens
        turn = engine.send("hi there")
        try:
            while True:
                accepted += next(turn).event.num_draft_accepted
        except StopIteration as done:
            result = done.value
        assert engine.render(engine.conversation()[:-1]) == rendered
        outputs.append(result.tokens + ([EOS_ID] if result.finish_reason == "stop" else []))
    p = pit_pvalue(model, [rendered] * len(outputs), outputs, seed=2, temp=1.0, top_k=5, min_p=0.05)
    assert p > P_HONEST, p
    assert accepted > 0.1 * sum(len(o) for o in outputs), accepted  # drafts were accepted
    assert pit_pvalue(model, [rendered] * len(outputs), outputs, seed=2, temp=1.0) < P_BROKEN
