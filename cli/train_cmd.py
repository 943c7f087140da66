"""`dflash-mlx train`: train a DFlash drafter for a target, with live progress."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from mlx_dflash.errors import DFlashError

from .app import app, err_console


def _parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise DFlashError(f"--target-layers must be comma-separated layer indices, got {text!r}") from None
    if not ids:
        raise DFlashError("--target-layers must name at least one layer")
    return ids


@app.command()
def train(
    target: Annotated[str, typer.Option("--target", "-t", help="Target: mlx-lm model directory or Hugging Face repo id.")],
    data: Annotated[list[Path], typer.Option("--data", help="Chat data: ShareGPT JSON/JSONL(.gz) or {\"messages\"} JSONL; repeatable.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (checkpoint, log, exported drafter).")],
    layers: Annotated[int, typer.Option("--layers", min=1, help="Draft layers.")] = 2,
    block_size: Annotated[int, typer.Option("--block-size", min=2, help="Tokens per draft block.")] = 16,
    target_layers: Annotated[str | None, typer.Option("--target-layers", help="Target layers to read, e.g. 1,14,27 (default: the reference rule).")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 1000,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Sequences per micro-batch.")] = 1,
    accum: Annotated[int, typer.Option("--accum", min=1, help="Micro-batches per optimizer step.")] = 1,
    lr: Annotated[float | None, typer.Option("--lr", min=0.0, help="Peak learning rate (AdamW, warm-up then cosine; default 6e-4). With --resume: the saved one unless given.")] = None,
    warmup: Annotated[float, typer.Option("--warmup", min=0.0, max=1.0, help="Warm-up fraction of the steps.")] = 0.04,
    seq_len: Annotated[int, typer.Option("--seq-len", min=8, help="Tokens per training sequence (longer ones are cut).")] = 512,
    blocks_per_seq: Annotated[int, typer.Option("--blocks-per-seq", min=1, help="Draft blocks (anchors) per sequence.")] = 32,
    labels: Annotated[str, typer.Option("--labels", help="target: learn the target's greedy predictions; data: the data's tokens.")] = "target",
    max_minutes: Annotated[float | None, typer.Option("--max-minutes", min=0.0, help="Wall-clock budget; stops, saves and exports when spent.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue exactly from the checkpoint in --out.")] = False,
    eval_every: Annotated[int, typer.Option("--eval-every", min=0, help="Measure tau with the engine every N steps (0: at the end only).")] = 0,
    eval_prompts: Annotated[int, typer.Option("--eval-prompts", min=0, help="Held-out prompts per tau measurement.")] = 4,
    save_every: Annotated[int, typer.Option("--save-every", min=0, help="Checkpoint every N steps (0: at the end only).")] = 100,
    regenerate: Annotated[int, typer.Option("--regenerate", min=0, help="Rewrite the replies of this many training conversations with the target's own greedy output first (0: train on the data's replies). Kept in OUT/regenerated.jsonl; an interrupted run continues it.")] = 0,
    regenerate_max_tokens: Annotated[int, typer.Option("--regenerate-max-tokens", min=1, help="Longest regenerated reply, in tokens.")] = 384,
    regenerate_batch: Annotated[int, typer.Option("--regenerate-batch", min=1, help="Prompts decoded together while regenerating.")] = 16,
    init_from_target: Annotated[bool, typer.Option("--init-from-target/--random-init", help="Start draft layers from the target's top layers (and its final norm), or from random weights.")] = True,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16 (float32 on the CPU).")] = "float32",
    seed: Annotated[int, typer.Option("--seed", help="Seed for weights, data order and anchors.")] = 0,
) -> None:
    """Train a DFlash drafter: frozen target, drafter on its hidden states, z-lab format export."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mlx_dflash.train import TrainConfig, Trainer, TrainEvent
    from mlx_dflash.train.trainer import DEFAULT_LR

    config = TrainConfig(
        target=target, data=[str(p) for p in data], out=str(out), layers=layers, block_size=block_size,
        target_layers=_parse_layers(target_layers), steps=steps, batch=batch, accum=accum, lr=DEFAULT_LR if lr is None else lr, warmup=warmup,
        seq_len=seq_len, blocks_per_seq=blocks_per_seq, labels=labels, dtype=dtype, seed=seed,
        max_minutes=max_minutes, save_every=save_every, eval_every=eval_every, eval_prompts=eval_prompts,
        regenerate=regenerate, regenerate_max_tokens=regenerate_max_tokens, regenerate_batch=regenerate_batch,
        init_from_target=init_from_target,
    )
    err_console.print(escape(f"loading {target} and the data ..."), highlight=False)
    with Progress(TextColumn("[bold]regenerate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=False) as regen_progress:
        regen_task = None

        def on_regenerate(done: int, total: int) -> None:
            nonlocal regen_task
            if regen_task is None:
                regen_task = regen_progress.add_task("regenerate", total=total)
            regen_progress.update(regen_task, completed=done)

        trainer = Trainer(config, resume=resume, on_regenerate=on_regenerate, change=("lr",) if lr is not None else ())
    a = trainer.args
    err_console.print(
        f"drafter: {a.num_hidden_layers} layers, block {a.block_size}, target layers {a.target_layer_ids}, "
        f"mask token {a.mask_token_id}; starting at step {trainer.step}", highlight=False,
    )
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=err_console,
    )
    task = progress.add_task("train", total=trainer.config.steps, completed=trainer.step, info="")

    def report(event: TrainEvent) -> None:
        if event.kind == "step":
            acc = event.accuracy
            shown = " ".join(f"{x:.2f}" for x in acc[:4])
            progress.update(task, completed=event.step, info=(
                f"loss {event.loss:.3f}  acc[1..4] {shown}  lr {event.lr:.2e}  {event.tokens_per_s:.0f} tok/s"))
        elif event.kind == "eval":
            progress.console.print(escape(f"step {event.step}: tau {event.tau:.2f} ({event.message})"), highlight=False)
        elif event.kind == "checkpoint":
            progress.console.print(f"[dim]step {event.step}: checkpoint {escape(str(event.path))}[/]", highlight=False)

    with progress:
        result = trainer.run(report)
    where = f", drafter in {result.drafter_dir}" if result.drafter_dir else ""
    tau = f", tau {result.tau:.2f}" if result.tau is not None else ""
    err_console.print(
        f"{result.status} at step {result.step} after {result.elapsed / 60:.1f} min{tau}{where}", highlight=False,
    )
    if result.status == "interrupted":
        err_console.print(escape(f"resume with: dflash-mlx train ... --out {out} --resume"), highlight=False)
        raise typer.Exit(130)


__all__ = ["train"]
