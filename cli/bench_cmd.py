"""`dflash-mlx bench`: DFlash against the target alone (mlx-lm and our own engine), per dataset."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mlx_dflash.auto.policy import AUTO, parse_tree_budget, parse_tree_shape
from mlx_dflash.errors import DFlashError

from .app import app, err_console
from .calibrate_cmd import calibration_for, progress_line


def parse_contexts(text: str | None) -> list[int | None]:
    """'1k,4k,8k' -> [1024, 4096, 8192] (plain numbers are tokens)."""
    if not text:
        return [None]
    out: list[int | None] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            n = int(float(part[:-1]) * 1024) if part.lower().endswith("k") else int(part)
        except ValueError:
            raise DFlashError(f"--context takes token counts like 1k,4k,8k or 512; got {part!r}") from None
        if n < 1:
            raise DFlashError(f"--context lengths must be positive, got {part!r}")
        out.append(n)
    return out or [None]


def parse_block_sizes(values: list[str] | None) -> list[int | str]:
    """'auto,16,8' -> ['auto', 16, 8] (repeatable, comma-separated; 1 is a plain step every cycle)."""
    sizes: list[int | str] = []
    for v in values or []:
        for part in v.replace(" ", "").split(","):
            if part:
                if part.lower() != AUTO and (not part.isdigit() or int(part) < 1):
                    raise DFlashError(f"--block-size takes auto or integers >= 1, got {part!r}")
                sizes.append(AUTO if part.lower() == AUTO else int(part))
    return list(dict.fromkeys(sizes))


def _parts(values: list[str] | None) -> list[str]:
    return [part for v in values or [] for part in v.replace(" ", "").split(",") if part]


def parse_tree_budgets(values: list[str] | None) -> list[int | str]:
    """'0,16,auto' -> [0, 16, 'auto'] (repeatable, comma-separated; 0: linear blocks)."""
    try:
        return list(dict.fromkeys(parse_tree_budget(part) for part in _parts(values)))
    except DFlashError as e:
        raise DFlashError(f"--tree-budget takes 0, auto or node counts like 16,32: {e}") from None


def parse_tree_shapes(values: list[str] | None) -> list[str]:
    """'spine,paper' -> ['spine', 'paper'] (repeatable, comma-separated)."""
    try:
        return list(dict.fromkeys(parse_tree_shape(part) for part in _parts(values)))
    except DFlashError as e:
        raise DFlashError(f"--tree-shape: {e}") from None


def parse_rates(text: str | None) -> list[float]:
    try:
        return [float(x) for x in (text or "").replace(" ", "").split(",") if x]
    except ValueError:
        raise DFlashError(f"--oracle-q takes rates like 0.05,0.2,0.5; got {text!r}") from None


def _cell(spread: dict | None, fmt: str, suffix: str = "") -> str:
    if not spread:
        return "-"
    text = f"{spread['median']:{fmt}}{suffix}"
    if spread["max"] > spread["min"]:
        text += f" [dim]({spread['min']:{fmt}}-{spread['max']:{fmt}})[/]"
    return text


def _paired_cell(paired: dict | None) -> str:
    if not paired:
        return "-"
    return f"{paired['ratio']:.2f}x [dim]({paired['low']:.2f}-{paired['high']:.2f})[/]"


def results_table(rows: list[dict]) -> Table:
    from mlx_dflash.bench.report import cycle_text, has_trees, sizes_text, tree_text

    trees = has_trees(rows)  # a column of tree sizes only when a tree mode ran
    table = Table(title="dflash-mlx bench (median over repeats, range in brackets; vs target: pooled over the "
                        "same runs, 90% interval in brackets)", header_style="bold")
    for name, justify in [("dataset", "left"), ("ctx", "right"), ("mode", "left"), ("tau", "right"),
                          ("decode tok/s", "right"), ("speedup", "right"), ("vs target", "right"),
                          ("TTFT s", "right"), ("peak GB", "right"), ("ms/cycle", "right"),
                          ("block sizes", "left"), *([("tree nodes", "right")] if trees else []),
                          ("pred tok/s", "right"), ("ok", "center")]:
        table.add_column(name, justify=justify, no_wrap=name in ("dataset", "mode", "ok"))
    for r in rows:
        cyc = r["cycle_ms"]
        table.add_row(
            r["dataset"], str(r["context"] or "-"), r["mode"], f"{r['tau']:.2f}" if r["tau"] is not None else "-",
            _cell(r["decode_tps"], ".1f"), _cell(r["speedup"], ".2f", "x") if r["mode"] != "mlx-lm" else "-",
            _paired_cell(r["paired_vs_target"]) if r["mode"] != "target" else "-",
            _cell(r["ttft_s"], ".3f"), f"{r['peak_memory_gb']:.2f}", cycle_text(cyc),
            sizes_text(r["block_size_histogram"]), *([tree_text(r)] if trees else []),
            f"{r['predicted_tps']:.1f}" if r["predicted_tps"] is not None else "-",
            "[green]yes[/]" if not r["mismatches"] else f"[bold red]{r['mismatches']} differ[/]",
        )
    return table


@app.command()
def bench(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Target: short name, Hugging Face repo id, mlx-lm directory or .gguf file (default: the embedded SmolLM2-135M-Instruct and its drafter, as in chat).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="DFlash drafter: directory, repo id or short name (default: the short name's or the embedded default's; without one only the target-alone modes run).")] = None,
    dataset: Annotated[list[str] | None, typer.Option("--dataset", help="gsm8k | math500 | humaneval | mbpp | mt-bench (the paper's five) | code-comment-humaneval | code-rename-mbpp | summary-sharegpt | passage-qa (input-grounded: replies copy their prompt) | FILE (.jsonl/.json/.txt); repeatable.")] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Directory with local copies of the datasets (default: download from the Hub).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=0, help="First N prompts of each dataset (0: all).")] = 10,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Most tokens to generate per turn.")] = 256,
    block_size: Annotated[list[str] | None, typer.Option("--block-size", help="Block size(s) to compare: auto and/or N, repeat or comma-separate, e.g. auto,16,8,4,1 (default: auto).")] = None,
    tree_budget: Annotated[list[str] | None, typer.Option("--tree-budget", help="Draft-tree budget(s) to compare at every --block-size: 0 (linear blocks), N (trees of N nodes) or auto (auto weighs trees too; a fixed block size then stays linear), e.g. 0,16,32,auto (default: 0). A drafter or target that cannot verify trees: its N modes are skipped with a note, auto runs linear.")] = None,
    tree_shape: Annotated[list[str] | None, typer.Option("--tree-shape", help="Draft-tree shape(s): spine | paper, repeat or comma-separate (default: spine).")] = None,
    oracle_q: Annotated[str | None, typer.Option("--oracle-q", help="Benchmark-only proposers of known quality: the target's own greedy continuation with each position wrong at rate q (the same positions for every block size), e.g. 0.05,0.2,0.5 (greedy only; each at every --block-size).")] = None,
    profile: Annotated[bool, typer.Option("--profile", help="Split each cycle into draft/verify/other time (one extra host sync per cycle: not the loop users run).")] = False,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Sampling temperature (0: greedy, outputs checked identical).")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (each mode starts from it).")] = 0,
    think: Annotated[bool | None, typer.Option("--think/--no-think", help="Thinking on/off where the chat template has it (default: the template's).")] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs of every prompt (medians and range over them).")] = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every per-prompt record and the summary to FILE.")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Write a Markdown report with PNG plots to DIR (needs matplotlib).")] = None,
    context: Annotated[str | None, typer.Option("--context", help="Long-context sweep: pad prompts to these lengths, e.g. 1k,4k,8k.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 | float16 | bfloat16 (default: float32 on the CPU).")] = None,
    lookup: Annotated[bool, typer.Option("--lookup/--no-lookup", help="Also run prompt lookup alone (lookup-auto) and beside the drafter (dflash+lookup-auto, the defaults of chat, generate and serve).")] = True,
) -> None:
    """Benchmark DFlash and prompt lookup against the target alone: tau, speedup, TTFT, memory; greedy outputs must match.

    Modes: mlx-lm and target (the target alone), lookup-auto (prompt lookup alone), dflash-SIZE (the
    drafter alone) and dflash+lookup-auto (both, chosen each cycle: what users get by default)."""
    import mlx_dflash
    from mlx_dflash.auto.calibration import measure
    from mlx_dflash.bench import BenchConfig, DFlashEngine, MlxLmEngine, build_document, load_prompts, run_bench
    from mlx_dflash.bench.engines import tree_refusal
    from mlx_dflash.bench.modes import combinations, drop_refused
    from mlx_dflash.bench.proposers import CorruptedGreedyFactory, check_oracle_rates
    from mlx_dflash.distributed.world import is_main_process
    from mlx_dflash.drafters.dflash import DEFAULT_BLOCK_SIZE as DEFAULT_DRAFT_BLOCK
    from mlx_dflash.loading.resolve import choose_pair

    if report is not None:
        from mlx_dflash.bench.report import _pyplot

        _pyplot()  # fail before the long run, not after it
    contexts = parse_contexts(context)
    sizes = parse_block_sizes(block_size)
    budgets = parse_tree_budgets(tree_budget) or [0]
    shapes = parse_tree_shapes(tree_shape) or [parse_tree_shape(None)]
    rates = parse_rates(oracle_q)
    check_oracle_rates(rates, temp)
    names = dataset or ["gsm8k"]
    prompts = [p for name in names for p in load_prompts(name, data_dir, limit=limit or None)]
    choice = choose_pair(model, draft)
    target, tokenizer, drafter = mlx_dflash.load(choice.target, choice.draft, dtype=dtype)
    if sizes and drafter is None and not rates:
        raise DFlashError("--block-size needs a --draft (or --oracle-q)")
    if any(budgets) and drafter is None:
        raise DFlashError("--tree-budget needs a --draft (a DFlash drafter drafts the trees)")
    sizes = sizes or [AUTO]

    modes = combinations(sizes, budgets, shapes)  # (block size, tree budget, shape): linear ones have budget 0
    skipped: list[str] = []
    if drafter is not None and any(t for _, t, _ in modes):
        refused = tree_refusal(target, drafter)
        modes, skipped = drop_refused(modes, refused)
        if not modes:  # nothing asked for can run: say so before the long run
            raise DFlashError(f"no mode left to run: {'; '.join(skipped)} (add 0 to --tree-budget for linear blocks)")
        for line in skipped:
            err_console.print(f"[yellow]skipped:[/] {escape(line)}", highlight=False)
        if refused and AUTO in budgets:
            err_console.print(escape(f"note: --tree-budget auto runs linear blocks here: {refused}"), highlight=False)
    # No acceptance remembered from earlier runs: every run of the benchmark starts alike.
    calibration = calibration_for(target, drafter, AUTO, recall=False, trees=AUTO in budgets) if AUTO in sizes else None
    engines = [MlxLmEngine(target, tokenizer), DFlashEngine(target, tokenizer, None)]
    if lookup:
        engines.append(DFlashEngine(target, tokenizer, None, AUTO, lookup=True))
    if drafter is not None:
        engines += [DFlashEngine(target, tokenizer, drafter, b, calibration=calibration, profile=profile,
                                 tree_budget=t, tree_shape=s) for b, t, s in modes]
        if lookup and AUTO in sizes:  # what users get by default, with each tree setting of auto's
            engines += [DFlashEngine(target, tokenizer, drafter, AUTO, calibration=calibration, profile=profile,
                                     lookup=True, tree_budget=t, tree_shape=s) for b, t, s in modes if b == AUTO]
    widest = drafter.block_size if drafter is not None else DEFAULT_DRAFT_BLOCK
    oracle_calibration = None
    if rates and AUTO in sizes:  # what its cycles cost (no drafter runs), as a user's calibration would say
        probe = CorruptedGreedyFactory(target, tokenizer, 1.0, widest).proposer([])
        with progress_line("calibrating block sizes for the oracle proposers") as progress:
            oracle_calibration = measure(target, None, proposer=probe, progress=progress)
    for q in rates:  # clearly labelled: "oracle-q..." modes are not a drafter
        oracle = CorruptedGreedyFactory(target, tokenizer, q, widest)
        engines += [DFlashEngine(target, tokenizer, oracle, min(b, widest) if b != AUTO else b,
                                 f"oracle-q{q:g}-{b if b == AUTO else f'b{b}'}", calibration=oracle_calibration,
                                 profile=profile) for b in sizes]
    config = BenchConfig(max_tokens=max_tokens, temp=temp, seed=seed, repeats=repeats, think=think,
                         contexts=contexts)
    total = sum(len(p.turns) for p in prompts) * repeats * len(contexts)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task("warming up", total=total)

        def step(prompt, turn) -> None:
            progress.update(task, advance=1, description=f"{prompt.dataset} {prompt.id}")

        result = run_bench(engines, tokenizer, prompts, config, step)
    settings = {
        "model": model or choice.target, "draft": choice.draft, "datasets": names, "data_dir": str(data_dir) if data_dir else None,
        "limit": limit, "max_tokens": max_tokens, "block_sizes": sizes, "oracle_q": rates, "profile": profile,
        "temp": temp, "seed": seed, "think": think, "repeats": repeats,
        "contexts": [c for c in contexts if c], "dtype": dtype, "modes": [e.name for e in engines], "lookup": lookup,
        "tree_budgets": budgets, "tree_shapes": shapes, "skipped": skipped,
    }
    command = "dflash-mlx bench " + shlex.join(
        [*(["--model", model] if model else []), *(["--draft", draft] if draft else []), *(a for n in names for a in ("--dataset", n)),
         *(["--data-dir", str(data_dir)] if data_dir else []), "--limit", str(limit),
         "--max-tokens", str(max_tokens), "--block-size", ",".join(map(str, sizes)),
         *(["--tree-budget", ",".join(map(str, budgets))] if tree_budget else []),
         *(["--tree-shape", ",".join(shapes)] if tree_shape else []),
         *(["--oracle-q", ",".join(f"{q:g}" for q in rates)] if rates else []), *(["--profile"] if profile else []),
         "--temp", str(temp), "--seed", str(seed), "--repeats", str(repeats),
         *(["--think" if think else "--no-think"] if think is not None else []),
         *(["--context", context] if context else []), *([] if lookup else ["--no-lookup"])]
    )
    doc = build_document(result, settings, command)
    console = Console()
    if not console.is_terminal:  # logs and pipes: keep each row on one line
        console = Console(width=200)
    console.print(results_table(doc["summary"]))
    if not is_main_process():  # distributed: rank 0 alone writes the files
        json_path = report = None
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(doc, indent=1))
        except OSError as e:
            raise DFlashError(f"{json_path}: cannot write ({e.strerror or e})") from None
        err_console.print(escape(f"records written to {json_path}"), highlight=False)
    if report is not None:
        from mlx_dflash.bench.report import write_report

        err_console.print(escape(f"report written to {write_report(doc, report)}"), highlight=False)
    if not result.ok:
        for failure in result.failures:
            err_console.print(f"[bold red]mismatch:[/] {escape(str(failure))}", highlight=False)
        raise typer.Exit(1)


__all__ = ["bench", "parse_block_sizes", "parse_contexts", "parse_tree_budgets", "parse_tree_shapes"]
