"""The prompt cache's disk tier: a restarted server reads a conversation back from disk and replies
exactly as a cold run, for an attention target with a drafter and a hybrid (GatedDeltaNet) one; an
eviction from memory is written and read back; a foreign, damaged or cut-short file is skipped with
one log line; the folder keeps to its bound; the serve options."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from helpers.engine_runs import expected, prompts, serve_all
from helpers.families import cached_pair
from helpers.serverkit import free_port
from helpers.tiny import FakeTokenizer, drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.decoding.session_file import save_session
from mlx_dflash.server import Engine, EngineConfig
from mlx_dflash.server.worker import prompt_disk
from mlx_dflash.server.worker.jobs import GenerationRequest
from mlx_dflash.server.worker.prompt_cache import describe, session_bytes
from mlx_dflash.server.worker.prompt_disk import MIN_GAIN, PromptDisk, fingerprint_of
from mlx_dflash.targets.model import TargetModel

LOG = "mlx_dflash"


@pytest.fixture(scope="module")
def models():
    """family -> (target, drafter): an attention target with a DFlash drafter, and a hybrid one."""
    return {family: cached_pair(family) for family in ("qwen3", "qwen3_5")}


def engine_for(models, family: str, directory: Path | None, **config) -> Engine:
    model, drafter = models[family]
    batch = 4 if family == "qwen3" else 1  # hybrid targets are not batched
    return Engine(model, FakeTokenizer(), drafter,
                  EngineConfig(block_size=4, max_batch=batch, prompt_cache_dir=str(directory) if directory else None,
                               **config))


def conversation(seed: int, length: int = 400) -> GenerationRequest:
    return GenerationRequest(prompts(seed, (length,))[0], 10)


def next_turn(first: GenerationRequest, reply: list[int], seed: int) -> GenerationRequest:
    """The conversation's second turn: the first prompt, its reply and a few new tokens."""
    return GenerationRequest(first.prompt + reply + prompts(seed, (9,))[0], 12)


def session_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])  # attention with a drafter, hybrid recurrent
def test_a_restart_reads_the_conversation_from_disk_and_replies_as_a_cold_run(models, family, tmp_path):
    first = conversation(1)
    reply = serve_all(engine_for(models, family, tmp_path), [first])[0]  # its stop writes the live sessions
    assert len(session_files(tmp_path)) >= 1
    second = next_turn(first, reply.tokens, 2)
    # What memory gives without a restart (the second turn, then the first prompt again: a retry, which
    # goes back inside the conversation, to a mark on the hybrid target): the disk must give as much.
    warm = engine_for(models, family, None)
    serve_all(warm, [first], stop=False)
    in_memory = serve_all(warm, [second], stop=False)[0].finished.cached_tokens
    retried_in_memory = serve_all(warm, [first])[0].finished.cached_tokens
    restarted = engine_for(models, family, tmp_path)
    again = serve_all(restarted, [second])[0]
    assert again.finished.cached_tokens == in_memory >= 0.9 * len(second.prompt)
    assert again.tokens == expected(models[family][0], second)
    assert describe(restarted.prompt_cache)["disk"]["hits"] == 1
    retried = serve_all(engine_for(models, family, tmp_path), [first])[0]
    assert retried.finished.cached_tokens == retried_in_memory >= 0.9 * len(first.prompt)
    assert retried.tokens == expected(models[family][0], first)


def test_an_eviction_from_memory_is_written_and_a_later_request_reads_it(models, tmp_path):
    first, other = conversation(3), conversation(4)
    engine = engine_for(models, "qwen3", tmp_path)
    reply = serve_all(engine, [first], stop=False)[0]
    cache = engine.prompt_cache
    cache.max_bytes = cache.nbytes + 1  # the next conversation pushes the first one out of memory
    serve_all(engine, [other], stop=False)
    cache.disk.flush()  # the writer thread's work done
    assert len(cache) == 1 and len(cache.disk) == 1
    second = next_turn(first, reply.tokens, 5)
    again = serve_all(engine, [second])[0]
    assert again.finished.cached_tokens >= 0.9 * len(second.prompt)
    assert again.tokens == expected(models["qwen3"][0], second)
    assert cache.disk is not None and cache.disk.hits == 1


def _written(models, family: str, directory: Path, seed: int = 6) -> tuple[GenerationRequest, list[int]]:
    first = conversation(seed)
    reply = serve_all(engine_for(models, family, directory), [first])[0]
    return first, reply.tokens


def test_a_damaged_or_foreign_file_is_skipped_with_one_line_and_the_reply_is_exact(models, tmp_path, caplog):
    first, reply = _written(models, "qwen3", tmp_path)
    (ours,) = session_files(tmp_path)
    second = next_turn(first, reply, 7)
    model = models["qwen3"][0]
    # Another model's file, under its own name: never read, left alone.
    foreign = tmp_path / ("f" * 16 + "-" + "0" * 32 + ".safetensors")
    foreign.write_bytes(ours.read_bytes())
    # A file cut short, under our name: removed with one line at start.
    whole = ours.read_bytes()
    ours.write_bytes(whole[: len(whole) // 2])
    with caplog.at_level(logging.INFO, logger=LOG):
        engine = engine_for(models, "qwen3", tmp_path)
        again = serve_all(engine, [second])[0]
    assert again.finished.cached_tokens == 0 and again.tokens == expected(model, second)
    damaged = [r for r in caplog.records if "removed a damaged" in r.msg]
    others = [r for r in caplog.records if "of other models" in r.msg]
    assert len(damaged) == 1 and len(others) == 1
    assert foreign.exists() and not ours.exists()
    # A file whose header reads but whose arrays do not fit this target (another family's, under our
    # fingerprint and name): skipped when read, with one line, and removed; the reply is exact.
    hybrid = DecodingSession(TargetModel(models["qwen3_5"][0]))
    hybrid.extend(first.prompt + reply, make_sampler(0.0))
    fingerprint = engine.prompt_cache.disk.fingerprint
    misfit = engine.prompt_cache.disk._path(np.asarray(hybrid.tokens, dtype=np.int64))
    for path in set(session_files(tmp_path)) - {foreign}:
        path.unlink()  # the conversation that engine's stop wrote
    save_session(hybrid, misfit, fingerprint=fingerprint, metadata={"rewindable": True, "marks": []})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOG):
        engine = engine_for(models, "qwen3", tmp_path)
        assert len(engine.prompt_cache.disk) == 1
        again = serve_all(engine, [second])[0]
    assert again.finished.cached_tokens == 0 and again.tokens == expected(model, second)
    skipped = [r for r in caplog.records if "was skipped" in r.msg]
    assert len(skipped) == 1 and not misfit.exists()


def test_a_changed_model_reads_nothing(models, tmp_path):
    first, reply = _written(models, "qwen3", tmp_path, seed=8)
    model, drafter = models["qwen3"]
    other_drafter = tiny_drafter(model, seed=9, block_size=6, target_layer_ids=[0, 3])
    assert fingerprint_of(TargetModel(model), drafter) != fingerprint_of(TargetModel(model), other_drafter)
    engine = Engine(model, FakeTokenizer(), other_drafter,
                    EngineConfig(block_size=4, prompt_cache_dir=str(tmp_path)))
    assert len(engine.prompt_cache.disk) == 0 and engine.prompt_cache.disk.nbytes > 0  # counted, not read
    second = next_turn(first, reply, 10)
    again = serve_all(engine, [second])[0]
    assert again.finished.cached_tokens == 0 and again.tokens == expected(model, second)


def _session(target: TargetModel, seed: int, length: int = 300) -> DecodingSession:
    session = DecodingSession(target)
    session.extend(prompts(seed, (length,))[0], make_sampler(0.0))
    return session


def test_the_bound_keeps_the_most_recently_used_files_and_reads_pay_their_margin(models, tmp_path):
    target = TargetModel(models["qwen3"][0])
    sessions = [_session(target, seed) for seed in (11, 12, 13)]
    size = session_bytes(sessions[0])
    disk = PromptDisk(tmp_path, int(2.5 * size), fingerprint_of(target))
    disk.write_all([(s, size) for s in sessions])  # the newest two fit the bound
    assert len(disk) == 2 and disk.nbytes <= disk.max_bytes
    assert disk.best(sessions[0].tokens + [5]) is None  # the oldest was left out
    keep, path = disk.best(sessions[1].tokens + [5])
    assert keep == len(sessions[1].tokens)
    assert disk.load(path, lambda: DecodingSession(target)).tokens == sessions[1].tokens  # now the most recent
    disk.write(_session(target, 14))
    disk.flush()
    assert len(disk) == 2 and disk.best(sessions[2].tokens + [5]) is None  # the least recently used went
    assert disk.best(sessions[1].tokens + [5]) is not None
    # A file is read only when it keeps MIN_GAIN tokens more than memory does.
    assert disk.best(sessions[1].tokens + [5], memory=keep - MIN_GAIN) is not None
    assert disk.best(sessions[1].tokens + [5], memory=keep - MIN_GAIN + 1) is None
    # A longer conversation's file replaces the one it goes on from (it serves every prompt that one does).
    longer = _session(target, 12, length=320)
    assert longer.tokens[:300] == sessions[1].tokens[:300]
    disk.write(longer)
    disk.flush()
    assert len(disk) == 2 and disk.best(sessions[1].tokens + [5])[0] == len(sessions[1].tokens)
    assert len(session_files(tmp_path)) == 2


def test_only_the_tiers_own_files_are_touched(models, tmp_path):
    """Another program's file in the folder is never counted or deleted, whatever the bound; a temporary
    file is deleted once its writer is gone, and left while it lives."""
    import subprocess
    import sys

    target = TargetModel(models["qwen3"][0])
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 4096)
    name = "0123456789abcdef-" + "0" * 32 + ".safetensors"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".{name}.{int(gone.stdout)}.0badc0de.partial.safetensors"
    live = tmp_path / f".{name}.{os.getpid()}.0badc0de.partial.safetensors"
    orphan.write_bytes(b"half")
    live.write_bytes(b"half")
    disk = PromptDisk(tmp_path, 1, fingerprint_of(target))
    disk.write_all([(_session(target, 17), 0)])
    assert disk.nbytes == 0 and len(disk) == 0  # the only file that would fit a 1-byte bound: none
    assert weights.exists() and live.exists() and not orphan.exists()


def test_a_full_disk_logs_one_line_and_the_cache_goes_on(models, tmp_path, caplog, monkeypatch):
    target = TargetModel(models["qwen3"][0])
    disk = PromptDisk(tmp_path, 1 << 30, fingerprint_of(target))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prompt_disk, "write_session", full)
    with caplog.at_level(logging.INFO, logger=LOG):
        for seed in (15, 16):
            disk.write(_session(target, seed))
        disk.flush()
    assert len([r for r in caplog.records if "could not be written" in r.msg]) == 1
    assert len(disk) == 0 and not list(tmp_path.iterdir())


# -- the serve options --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-options")
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", root / "target")
    drafter = save_drafter(tiny_drafter(model), drafter_config(model), root / "drafter")
    return target, drafter


def _serve_engine(saved_pair, monkeypatch, *args: str) -> Engine:
    """The engine `dflash-mlx serve ARGS` builds (the HTTP server is not started)."""
    from mlx_dflash.server import runner

    built = {}

    class NoServer:
        def run(self):
            pass

    def make_server(state, *rest, **kwargs):
        built["engine"] = state.engine
        return NoServer()

    monkeypatch.setattr(runner, "make_server", make_server)
    target, drafter = saved_pair
    _register()
    result = CliRunner().invoke(app, ["serve", "--model", str(target), "--draft", str(drafter), "--block-size", "4",
                                      "--port", str(free_port()), *args])
    assert result.exit_code == 0, result.output
    return built["engine"]


def test_serve_options_name_the_folder_and_its_bound_or_turn_it_off(saved_pair, monkeypatch, tmp_path):
    engine = _serve_engine(saved_pair, monkeypatch, "--prompt-cache-dir", str(tmp_path / "here"),
                           "--prompt-cache-disk-bytes", "123456789")
    disk = engine.prompt_cache.disk
    assert disk.dir == tmp_path / "here" and disk.max_bytes == 123456789
    assert _serve_engine(saved_pair, monkeypatch, "--prompt-cache-dir", "off").prompt_cache.disk is None
    assert _serve_engine(saved_pair, monkeypatch, "--prompt-cache-dir", str(tmp_path),
                         "--prompt-cache-disk-bytes", "0").prompt_cache.disk is None
    assert _serve_engine(saved_pair, monkeypatch, "--prompt-cache-dir", str(tmp_path),
                         "--prompt-cache-bytes", "0").prompt_cache.disk is None  # no memory cache, no disk tier
    # The default: prompt-cache under the project's cache folder, at most 8 GiB.
    monkeypatch.delenv(prompt_disk.DIR_ENV, raising=False)
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path / "cache"))
    disk = _serve_engine(saved_pair, monkeypatch).prompt_cache.disk
    assert disk.dir == tmp_path / "cache" / "prompt-cache" and 0 < disk.max_bytes <= 8 << 30
    monkeypatch.setenv(prompt_disk.DIR_ENV, "off")  # what the tests set: nothing in the user's cache
    assert _serve_engine(saved_pair, monkeypatch).prompt_cache.disk is None
    assert os.environ[prompt_disk.DIR_ENV] == "off"
