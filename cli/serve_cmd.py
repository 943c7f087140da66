"""`dflash-mlx serve`: OpenAI- and Anthropic-compatible HTTP server (see mlx_dflash.server)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from mlx_dflash.auto.policy import DEFAULT_TREE_BUDGET, DEFAULT_TREE_SHAPE
from mlx_dflash.errors import DFlashError

from .app import app
from .tree_options import TREE_BUDGET_HELP, TREE_SHAPE_HELP, tree_budget_option, tree_shape_option

EMBEDDED_ID = "SmolLM2-135M-Instruct"


def _check_port(host: str, port: int) -> None:
    """Fail with one line before loading anything when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise DFlashError(f"cannot listen on {host}:{port}: {e.strerror}") from None


@app.command()
def serve(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Target: short name, Hugging Face repo id, mlx-lm directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="DFlash drafter: directory or repo id.")] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Serve the target alone (plain decoding; no prompt lookup either, unless --lookup).")] = False,
    lookup: Annotated[bool | None, typer.Option("--lookup/--no-lookup", help="Prompt lookup: also verify tokens read off each request's prompt, when auto expects them to pay (default: on, off with --no-draft).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8080,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="DFLASH_MLX_API_KEY", help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every /v1 request.")] = None,
    block_size: Annotated[str | None, typer.Option("--block-size", help="'auto' (default: chosen each cycle for the most tokens per second) or a fixed number of tokens per draft block.")] = None,
    tree_budget: Annotated[str, typer.Option("--tree-budget", callback=tree_budget_option, help=TREE_BUDGET_HELP + " Requests decoded together in a batch (--max-batch) verify linear blocks; a request decoded alone uses trees.")] = str(DEFAULT_TREE_BUDGET),
    tree_shape: Annotated[str, typer.Option("--tree-shape", callback=tree_shape_option, help=TREE_SHAPE_HELP)] = DEFAULT_TREE_SHAPE,
    max_tokens_default: Annotated[int, typer.Option("--max-tokens-default", min=1, help="Reply length when a request gives no max_tokens.")] = 512,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Temperature when a request gives none (0: greedy).")] = 0.0,
    prompt_cache_bytes: Annotated[int | None, typer.Option("--prompt-cache-bytes", min=0, help="Memory for caches kept across requests (0: no prompt cache; default: a quarter of the memory the models leave free, 256 MiB to 16 GiB).")] = None,
    prompt_cache_dir: Annotated[str | None, typer.Option("--prompt-cache-dir", envvar="MLX_DFLASH_PROMPT_CACHE_DIR", help="Folder for the prompt cache's disk tier: conversations evicted from memory, and on a clean stop the live ones, are written there (a file per conversation) and read back by later requests with the same models, after a restart too. 'off' (or 'none'): memory only. Default: prompt-cache under the mlx-dflash cache folder ($MLX_DFLASH_CACHE, else ~/.cache/mlx-dflash).")] = None,
    prompt_cache_disk_bytes: Annotated[int | None, typer.Option("--prompt-cache-disk-bytes", min=0, help="Disk space for those files, every model's counted; the least recently used go first (0: no disk tier; default: 8 GiB or a tenth of the free disk space, whichever is less).")] = None,
    served_name: Annotated[str | None, typer.Option("--served-model-name", help="Model id clients use (default: --model as given).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 | float16 | bfloat16 (default: float32 on the CPU).")] = None,
    quantize: Annotated[bool, typer.Option("--quantize", "-q", help="Quantize the target (see --q-bits).")] = False,
    q_bits: Annotated[int | None, typer.Option("--q-bits", min=2, max=8, help="Bits per weight when quantizing (default 4; implies --quantize).")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level (info shows every request).")] = "warning",
    allow_origin: Annotated[list[str] | None, typer.Option("--allow-origin", help="Let web pages from this origin (e.g. https://app.example.com) use the server; repeatable; '*' allows every origin. Without it, requests that browsers mark as coming from another site get 403 (loopback pages are allowed).")] = None,
    allow_host: Annotated[list[str] | None, typer.Option("--allow-host", help="Also answer requests for this host name (the Host header, e.g. box.lan; a port is ignored); repeatable; '*' answers every name. On a loopback --host (the default) only loopback names (localhost, 127.x.x.x, [::1]) are answered otherwise, so a web page that points its own name at this machine (DNS rebinding) gets 403; on another address every name is answered unless this option names some.")] = None,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", min=1, help="Largest request body taken; larger ones get 413.")] = 32 << 20,
    body_timeout: Annotated[float, typer.Option("--body-timeout", min=0.1, help="Seconds a request's whole body may take to arrive; a slower one gets 408 and its connection is closed.")] = 60.0,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="Requests that may wait for a place among the running ones (--max-batch); more get 503 (529 on /v1/messages) with Retry-After (0: no bound).")] = 32,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Requests decoded together: each cycle drafts and verifies a block for every one of them in one forward each (1: one request at a time, in arrival order). Every reply is what the request gets alone. Targets with sliding-window or recurrent layers, quantized K/V, DFlash2 drafters and drafters with a sliding window cannot be batched yet: their requests advance side by side, one cycle each in turn; so do requests with structured output, and sampled requests with a seed (a seeded sample repeats only as drawn alone). New requests also wait while the batched caches would pass --batch-bytes.")] = 8,
    batch_bytes: Annotated[int | None, typer.Option("--batch-bytes", min=1, help="Memory for the batched requests' caches, every row counted as long as the longest prompt plus max_tokens (default: half the memory the models and the prompt cache leave free).")] = None,
    max_tokens_cap: Annotated[int | None, typer.Option("--max-tokens-cap", min=1, help="Cut every reply's max_tokens to this (default: the context window); larger requests are served, shortened, never refused.")] = None,
    strict_model_name: Annotated[bool, typer.Option("--strict-model-name", help="Answer 404 to requests naming another model (default: serve them with this model; replies name it).")] = False,
) -> None:
    """Serve the model over OpenAI (/v1/chat/completions, /v1/completions, /v1/responses) and Anthropic (/v1/messages) APIs.

    Coding agents work against it: Claude Code (ANTHROPIC_BASE_URL=http://127.0.0.1:8080) and Codex (a provider with
    wire_api = "responses"); see docs/server.md. Up to --max-batch requests are decoded together; every greedy reply
    equals the target's own.
    Ctrl-C stops the server.
    """
    try:
        from mlx_dflash.server import Engine, EngineConfig
        from mlx_dflash.server.http.state import ServerState
        from mlx_dflash.server.runner import make_server
        from mlx_dflash.server.worker.prompt_disk import resolve_dir
    except ImportError as e:
        raise DFlashError(f"serve needs the server libraries ({e.name}): pip install 'mlx-dflash[serve]'") from None
    from mlx_dflash.auto.policy import AUTO, parse_block_size, parse_tree_budget

    from .calibrate_cmd import calibration_for, remember_acceptance
    from .chat_cmd import _load

    size = parse_block_size(block_size)
    disk_dir = resolve_dir(prompt_cache_dir)
    _check_port(host, port)
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    from mlx_dflash.distributed.world import world

    if world() is not None:
        raise DFlashError("serve does not run distributed (under mlx.launch) yet: serve on one machine, "
                          "or use generate, chat or bench across ranks")
    target, tokenizer, drafter, lines, prompt_lookup = _load(console, model, draft, no_draft, dtype,
                                                             quantize or q_bits is not None, q_bits or 4, lookup)
    calibration = calibration_for(target, drafter, size, trees=parse_tree_budget(tree_budget) == AUTO)
    engine = Engine(target, tokenizer, drafter, EngineConfig(block_size=size, tree_budget=parse_tree_budget(tree_budget),
                                                             tree_shape=tree_shape, prompt_cache_bytes=prompt_cache_bytes,
                                                             calibration=calibration, prompt_lookup=prompt_lookup,
                                                             max_queue=max_queue, max_batch=max_batch,
                                                             batch_bytes=batch_bytes,
                                                             prompt_cache_dir=str(disk_dir) if disk_dir else None,
                                                             prompt_cache_disk_bytes=prompt_cache_disk_bytes))
    model_id = served_name or model or EMBEDDED_ID
    aliases = {Path(model).name} if model else set()
    state = ServerState(engine, model_id, api_key=api_key, max_tokens_default=max_tokens_default,
                        temperature_default=temp, aliases=aliases - {model_id}, strict_model_name=strict_model_name,
                        max_tokens_cap=max_tokens_cap, max_body_bytes=max_body_bytes,
                        allow_origins=list(allow_origin or []), allow_hosts=list(allow_host or []),
                        body_timeout=body_timeout)
    for line in lines:
        console.print(line)
    disk = engine.prompt_cache.disk
    if disk is not None:
        console.print(escape(f"prompt cache on disk: {disk.dir} ({len(disk)} conversations of these models, "
                             f"{disk.nbytes / 2**30:.2f} of {disk.max_bytes / 2**30:.2f} GiB used)"))
    where = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    drafting = " and ".join(["DFlash"] * (drafter is not None) + ["prompt lookup"] * prompt_lookup)
    drafting = f"{drafting}, block size {engine.block_size}" if drafting else "plain decoding"
    if engine.tree_budget and drafter is not None:
        drafting += f", draft trees {engine.tree_budget} ({engine.tree_shape}) for requests decoded alone"
    drafting += f", up to {max_batch} requests together" if max_batch > 1 else ", one request at a time"
    console.print(escape(
        f"serving '{model_id}' ({drafting}) at {where}/v1: OpenAI chat/completions, completions and responses, "
        f"Anthropic messages{', API key required' if api_key else ''}; Ctrl-C stops"))
    try:
        make_server(state, host, port, log_level).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    remember_acceptance(target, drafter, calibration)
    console.print("server stopped")
