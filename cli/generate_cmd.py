"""`dflash-mlx generate`: one completion, as text or as one JSON object."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape

from mlx_dflash.auto.policy import (
    AUTO,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_TREE_BUDGET,
    DEFAULT_TREE_SHAPE,
    parse_block_size,
    parse_tree_budget,
)
from mlx_dflash.distributed.world import world_size
from mlx_dflash.errors import DFlashError

from .app import app, err_console, fail
from .calibrate_cmd import block_size_option, calibration_for, remember_acceptance
from .tree_options import TREE_BUDGET_HELP, TREE_SHAPE_HELP, tree_budget_option, tree_shape_option

JSON_SCHEMA_VERSION = 1


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise DFlashError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise DFlashError("--prompt-ids must list at least one non-negative token id")
    return ids


def prompt_ids(tokenizer, prompt: str | None, ids: str | None, chat: bool,
               system: str | None = None) -> list[int]:
    if (prompt is None) == (ids is None):
        raise DFlashError("give exactly one of --prompt and --prompt-ids")
    if ids is not None:
        if chat:
            raise DFlashError("--chat applies a chat template to --prompt text, not to --prompt-ids")
        return _parse_ids(ids)
    if not prompt:
        raise DFlashError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise DFlashError("--chat: this model's tokenizer has no chat template")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def _comm_ms(model, stats) -> float:
    """Distributed: estimated communication per cycle at this run's mean verify width (0 on one machine)."""
    from mlx_dflash.distributed.world import world
    from mlx_dflash.targets.model import as_target

    w = world()
    if w is None:
        return 0.0
    target = as_target(model)
    rows = max(1, round(sum(stats.block_sizes) / max(len(stats.block_sizes), 1)))
    return w.cycle_comm_ms(target.num_layers, rows, target.hidden_size)


@app.command()
def generate(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Target: short name (Qwen3-8B), Hugging Face repo id, mlx-lm directory or .gguf file (default: the embedded SmolLM2-135M-Instruct and its drafter, as in chat).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="DFlash drafter: directory, repo id or short name (default: the short name's or the embedded default's).")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text.")] = None,
    prompt_ids_: Annotated[str | None, typer.Option("--prompt-ids", help="Prompt as token ids, e.g. 1,2,3.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap --prompt in the model's chat template.")] = False,
    system: Annotated[str | None, typer.Option("--system", help="System message (with --chat).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Most tokens to generate.")] = 256,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Sampling temperature (0: greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling (0: off).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Top-k sampling (0: off).")] = 0,
    min_p: Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Min-p sampling (0: off).")] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Random seed (sampling is reproducible).")] = None,
    block_size: Annotated[str, typer.Option("--block-size", callback=block_size_option, help="Tokens per draft block: auto (chosen each cycle for the most tokens per second on this machine) or a fixed N.")] = DEFAULT_BLOCK_SIZE,
    tree_budget: Annotated[str, typer.Option("--tree-budget", callback=tree_budget_option, help=TREE_BUDGET_HELP)] = str(DEFAULT_TREE_BUDGET),
    tree_shape: Annotated[str, typer.Option("--tree-shape", callback=tree_shape_option, help=TREE_SHAPE_HELP)] = DEFAULT_TREE_SHAPE,
    draft_window: Annotated[int | None, typer.Option("--draft-window", min=1, help="Drafter attends only the last N context tokens.")] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Decode with the target alone (baseline; no prompt lookup either, unless --lookup).")] = False,
    lookup: Annotated[bool | None, typer.Option("--lookup/--no-lookup", help="Prompt lookup: also verify tokens read off the prompt and the reply so far, when auto expects them to pay (default: on, off with --no-draft).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 | float16 | bfloat16 (default: float32 on the CPU).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema in the README).")] = False,
) -> None:
    """Generate a completion with DFlash (or the target alone with --no-draft)."""
    import mlx_dflash
    from mlx_dflash.loading.resolve import choose_pair

    if (prompt is None) == (prompt_ids_ is None):  # before any model is loaded or converted
        raise DFlashError("give exactly one of --prompt and --prompt-ids")
    choice = choose_pair(model, draft, no_draft, lookup)
    for warning in choice.warnings:
        err_console.print(f"[yellow]{escape(warning)}[/]", highlight=False)
    target, tokenizer, drafter = mlx_dflash.load(choice.target, choice.draft, dtype=dtype)
    ids = prompt_ids(tokenizer, prompt, prompt_ids_, chat, system)
    size = parse_block_size(block_size)
    budget = parse_tree_budget(tree_budget)
    calibration = calibration_for(target, drafter, size, trees=budget == AUTO)
    tokens: list[int] = []
    event = None
    for event in mlx_dflash.stream_generate(
        target, tokenizer, ids, draft_model=drafter, max_tokens=max_tokens, temp=temp,
        top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, block_size=size,
        draft_window=draft_window, calibration=calibration, prompt_lookup=choice.lookup,
        tree_budget=budget, tree_shape=tree_shape,
    ):
        tokens.extend(event.tokens)
        if not as_json:
            print(event.text, end="", flush=True)
    remember_acceptance(target, drafter, calibration)
    stats = event.stats
    if as_json:
        print(json.dumps({
            "schema_version": JSON_SCHEMA_VERSION,
            "token_ids": tokens,
            "text": tokenizer.decode(tokens),
            "finish_reason": event.finish_reason,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.num_tokens,
            "acceptance_lengths": stats.acceptance_lengths,
            "tree_sizes": stats.tree_sizes,
            "tau": stats.tau,
            "prefill_tps": stats.prefill_tps,
            "generation_tps": stats.generation_tps,
            "peak_memory_gb": stats.peak_memory_gb,
            "block_size": size if drafter or choice.lookup else 1,
            "block_size_histogram": {str(k): v for k, v in stats.block_size_histogram.items()},
            "tree_budget": budget if drafter is not None else 0,
            "tree_shape": tree_shape,
            "predicted_tps": stats.predicted_tps,
            "draft": drafter is not None,
            "prompt_lookup": choice.lookup,
            "accepted_by_source": stats.accepted_by_source,
            "world_size": world_size(),
            "comm_ms_per_cycle": _comm_ms(target, stats),
        }))
        return
    print()
    err_console.print(
        f"[dim]{stats.num_tokens} tokens, prefill {stats.prefill_tps:.1f} tok/s, "
        f"decode {stats.generation_tps:.1f} tok/s, tau {stats.tau:.2f}, "
        f"peak memory {stats.peak_memory_gb:.2f} GB[/]", highlight=False,
    )
    if drafter is not None or choice.lookup:
        err_console.print(f"[dim]{block_size_summary(stats)}[/]", highlight=False)


def block_size_summary(stats) -> str:
    """'block sizes 1x40 16x3 (cycles per size), predicted 9.8 tok/s' for a status line (and how many
    cycles verified draft trees, when some did)."""
    sizes = " ".join(f"{size}x{count}" for size, count in stats.block_size_histogram.items())
    text = f"block sizes {sizes or '-'} (size x cycles)"
    if stats.predicted_tps is not None:
        text += f", cost model predicted {stats.predicted_tps:.1f} tok/s"
    trees = sum(1 for n in stats.tree_sizes if n)
    if trees:
        text += f", {trees} draft trees of up to {max(stats.tree_sizes)} nodes"
    if stats.accepted_by_source:
        text += ", accepted " + " ".join(f"{n} {source}" for source, n in sorted(stats.accepted_by_source.items()))
    return text


__all__ = ["generate", "fail"]
