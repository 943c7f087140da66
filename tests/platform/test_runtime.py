"""The runtime a Mac needs: threads, the generation stream, the wired limit, memory sizing.

Since MLX 0.31.2 a lazy graph built on one thread cannot be evaluated on another (the
error that broke mlx-lm's server twice on Macs, the second time only with sliding-window
caches); this machine's CPU backend shows it too. The server decodes on a worker thread,
so these tests hand it lazily loaded weights (lazy rope tables included) and prompt-cache
entries made on another thread, for every cache family, and check the replies against the
target alone.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from helpers.families import HYBRID_CONFIGS
from helpers.tiny import FakeTokenizer, greedy_reference, target_config, tiny_drafter, tiny_target
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from mlx_dflash import stream_generate
from mlx_dflash.auto import acceptance_memory
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.drafters.dflash import DFlashDraftModel
from mlx_dflash.platform import runtime
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.server import Engine, EngineConfig
from mlx_dflash.server.worker import prompt_cache
from mlx_dflash.server.worker.jobs import Finished, GenerationRequest
from mlx_dflash.targets.model import TargetModel

PROMPT = [5, 17, 42, 9, 77, 31, 8, 64, 12, 90, 33, 21, 6, 44, 19, 23]
FAMILIES = ["qwen3", "gpt_oss", "gemma3_text", "qwen3_5"]  # attention, sliding window (2), hybrid


def config_of(model_type: str) -> dict:
    return target_config(model_type) if model_type == "qwen3" else HYBRID_CONFIGS[model_type]


def lazily_loaded(model_type: str, tmp_path) -> tuple:
    """(lazy target, lazy drafter, their evaluated twins): built and loaded from files on this
    thread with nothing evaluated, as `mlx_lm.load(..., lazy=True)` leaves a model."""
    if model_type == "qwen3":
        source = tiny_target("qwen3", seed=3)
    else:
        from helpers.families import build

        source = build(model_type, seed=3)
    drafter_source = tiny_drafter(source, seed=4, block_size=8, target_layer_ids=[0, 2])
    mx.save_safetensors(str(tmp_path / "t.safetensors"), dict(tree_flatten(source.parameters())))
    mx.save_safetensors(str(tmp_path / "d.safetensors"), dict(tree_flatten(drafter_source.parameters())))
    model_cls, args_cls = _get_classes(config_of(model_type))
    lazy = model_cls(args_cls.from_dict(config_of(model_type)))
    lazy.load_weights(str(tmp_path / "t.safetensors"))
    lazy_drafter = DFlashDraftModel(drafter_source.args)
    lazy_drafter.load_weights(str(tmp_path / "d.safetensors"))
    return lazy, lazy_drafter, source, drafter_source


def run_job(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], Finished]:
    tokens, done = [], threading.Event()
    result: list[Finished] = []

    def emit(item) -> None:
        if isinstance(item, Finished):
            result.append(item)
            done.set()
        else:
            tokens.extend(item.tokens)

    engine.submit(GenerationRequest(prompt=prompt, max_tokens=max_tokens), emit)
    assert done.wait(120), "the worker never finished"
    return tokens, result[0]


def test_this_machine_shows_the_thread_rule():
    """What the server must avoid: evaluating, on a worker, a graph built on another thread."""
    lazy = mx.ones((3,)) * 2
    errors = []
    worker = threading.Thread(target=lambda: errors.append(_eval_error(lazy)))
    worker.start()
    worker.join()
    if errors[0] is None:
        pytest.skip("this MLX lets threads share streams (before 0.31.2)")
    assert "Stream" in errors[0]


def _eval_error(x: mx.array) -> str | None:
    try:
        mx.eval(x)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_server_worker_decodes_lazy_weights_and_cached_prompts_from_another_thread(model_type, tmp_path):
    lazy, lazy_drafter, source, _ = lazily_loaded(model_type, tmp_path)
    reference = greedy_reference(source, PROMPT + [50, 51, 52], 12)

    engine = Engine(lazy, FakeTokenizer(eos_token_ids=()), lazy_drafter, EngineConfig(block_size=4))
    # A prompt's session built and cached here, on the main thread, for the worker to take over.
    cached = engine._new_session()
    cached.extend(PROMPT, lambda logprobs: mx.argmax(logprobs, axis=-1))
    engine.prompt_cache.store(cached)
    engine.start()
    try:
        tokens, finished = run_job(engine, PROMPT + [50, 51, 52], 12)
        assert finished.finish_reason == "length", finished.error
        assert tokens == reference
        assert finished.cached_tokens > 0  # the main thread's session was used
        again, finished = run_job(engine, PROMPT + [50, 51, 52], 12)  # the worker's own cached prompt
        assert again == reference and finished.finish_reason == "length", finished.error
    finally:
        engine.stop()


def test_decoding_runs_on_the_generation_stream(monkeypatch, targets):
    seen = []
    original = DecodingSession.cycle
    with mx.stream(runtime.generation_stream):
        wanted = str(mx.default_stream(mx.default_device()))
    assert wanted != str(mx.default_stream(mx.default_device()))

    def cycle(self, *args, **kwargs):
        seen.append(str(mx.default_stream(mx.default_device())))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecodingSession, "cycle", cycle)
    model = targets("qwen3")
    out = [t for e in stream_generate(model, FakeTokenizer(eos_token_ids=()), PROMPT, max_tokens=6, block_size=1,
                                      prompt_lookup=False) for t in e.tokens]
    assert out == greedy_reference(model, PROMPT, 6)
    assert seen and set(seen) == {wanted}


def test_the_wired_limit_is_the_recommended_working_set_while_decoding(monkeypatch, targets, drafters, caplog):
    model, drafter = targets("qwen3"), drafters("qwen3")
    size = runtime.model_bytes(model, drafter)
    calls = []
    limit = [0]

    def set_wired_limit(n: int) -> int:
        calls.append(n)
        old, limit[0] = limit[0], n
        return old

    def during():
        for _ in stream_generate(model, FakeTokenizer(), PROMPT, draft_model=drafter, max_tokens=4):
            yield limit[0]

    monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 10 * size,
                                                     "memory_size": 16 * size})
    assert set(during()) == {10 * size} and calls == [10 * size, 0] and not caplog.records
    calls.clear()
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": size + 1})
    with caplog.at_level("WARNING", logger="mlx_dflash"):
        assert set(during()) == {size + 1}
    assert calls == [size + 1, 0]
    [record] = caplog.records
    assert "recommended working set" in record.getMessage()
    calls.clear()
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "cpu"})  # no recommendation: left alone
    assert set(during()) == {0} and calls == []


def test_the_prompt_cache_is_sized_from_the_device_memory(monkeypatch, targets):
    model = targets("qwen3")
    size = runtime.model_bytes(model)
    gib = 1 << 30
    for usable, expected in ((16 * gib, 4 * gib), (200 * gib, 16 * gib), (size + gib // 4, 256 << 20)):
        monkeypatch.setattr(mx, "device_info", lambda u=usable: {"max_recommended_working_set_size": u})
        got = runtime.default_prompt_cache_bytes(model)
        assert abs(got - min(max((usable - size) // 4, 256 << 20), 16 * gib)) <= 1
        assert abs(got - expected) <= size  # the models' bytes are small here
    monkeypatch.setattr(mx, "device_info", lambda: {})  # a CPU: the physical memory
    assert runtime.device_memory()[1] is not None and runtime.device_memory()[1] > 0
    engine = Engine(model, FakeTokenizer(), None, EngineConfig())
    assert engine.prompt_cache.max_bytes == runtime.default_prompt_cache_bytes(model)


def test_evicted_sessions_give_their_buffers_back(targets, drafters):
    model, drafter = targets("qwen3"), drafters("qwen3")
    target = TargetModel(model)

    def session(prompt):
        made = DecodingSession(target, DFlashProposer(drafter, target, max_block_size=8))
        made.extend(prompt, lambda logprobs: mx.argmax(logprobs, axis=-1))
        return made

    first = session(PROMPT * 4)
    engine = Engine(model, FakeTokenizer(), drafter, EngineConfig(prompt_cache_bytes=1))
    engine.prompt_cache.max_bytes = int(1.5 * prompt_cache.session_bytes(first))
    engine.prompt_cache.store(first)
    del first
    second = session(PROMPT[::-1] * 4)
    engine.prompt_cache.store(second)  # the first one goes
    assert len(engine.prompt_cache) == 1
    assert mx.get_cache_memory() == 0  # its buffers went back to the system, not to MLX's cache


def test_the_acceptance_fingerprint_does_not_copy_the_model():
    big = mx.random.normal((4096, 4096)).astype(mx.bfloat16)  # 32 MiB; a float32 copy would be 64 MiB
    holder = DFlashDraftModel.__new__(DFlashDraftModel)
    import mlx.nn as nn

    nn.Module.__init__(holder)
    holder.embed = nn.Linear(4096, 4096, bias=False)
    holder.embed.weight = big
    mx.eval(holder.parameters())
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    first = acceptance_memory._fingerprint(holder)
    assert mx.get_peak_memory() - before < 1 << 20
    big2 = big + mx.array(1.0, dtype=mx.bfloat16)
    holder.embed.weight = big2
    assert acceptance_memory._fingerprint(holder) != first  # still tells weights apart
