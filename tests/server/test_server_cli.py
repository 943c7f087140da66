"""The real `dflash-mlx serve` process: startup line, a request, its Host and body-time options, Ctrl-C
shuts it down cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers.serverkit import free_port
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target

CLI = [sys.executable, "-c", "from mlx_dflash.cli.main import main; main()"]  # what the dflash-mlx script runs


@pytest.mark.cli
def test_serve_starts_answers_and_stops_on_ctrl_c(tmp_path):
    model = tiny_target("qwen3", seed=0)
    target = save_target(model, "qwen3", tmp_path / "target")
    drafter = save_drafter(tiny_drafter(model, block_size=8), drafter_config(model, block_size=8), tmp_path / "draft")
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HOME=str(tmp_path))
    proc = subprocess.Popen([*CLI, "serve", "--model", str(target), "--draft", str(drafter), "--port", str(port),
                             "--api-key", "k", "--max-batch", "3", "--allow-host", "box.lan", "--body-timeout", "1.5"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # model loading and imports: up to a minute on a busy machine
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
            assert proc.poll() is None, proc.stderr.read()
        assert httpx.get(url + "/health", timeout=5).json()["batch"]["max_batch"] == 3
        body = {"model": str(target), "prompt": "hello", "max_tokens": 5}
        reply = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"}, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] >= 1
        # --allow-host: that name is answered besides loopback ones; others are refused before any route.
        assert httpx.get(url + "/health", headers={"Host": f"box.lan:{port}"}, timeout=5).status_code == 200
        refused = httpx.get(url + "/health", headers={"Host": "evil.example"}, timeout=5)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "host_not_allowed"
        # --body-timeout: a body that stops arriving gets 408 after 1.5 s.
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            assert s.recv(1024).startswith(b"HTTP/1.1 408")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    serving = [line for line in err.splitlines() if line.startswith("serving")]
    assert len(serving) == 1 and f"127.0.0.1:{port}" in serving[0] and "API key required" in serving[0]
    assert "up to 3 requests together" in serving[0]
    assert "Traceback" not in err
