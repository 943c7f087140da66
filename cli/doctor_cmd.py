"""`dflash-mlx doctor`: the checks to run first on a new machine, and to paste into a bug report."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .app import app, err_console

SPEED_PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example."


def _speed(model: str | None, draft: str | None, no_draft: bool, tokens: int) -> dict[str, Any]:
    import mlx_dflash
    from mlx_dflash.doctor import speed_check
    from mlx_dflash.loading.resolve import choose_pair

    choice = choose_pair(model, draft, no_draft)
    target, tokenizer, drafter = mlx_dflash.load(choice.target, choice.draft)
    if getattr(tokenizer, "chat_template", None):
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": SPEED_PROMPT}],
                                                    add_generation_prompt=True))
    else:
        prompt = list(tokenizer.encode(SPEED_PROMPT))
    result = speed_check(target, tokenizer, drafter, prompt, max_tokens=tokens, lookup=choice.lookup)
    return {"model": choice.target, "draft": choice.draft, "source": choice.source, **result}


def run_checks(model: str | None, draft: str | None, no_draft: bool, tokens: int, speed: bool,
               status: Any) -> dict[str, Any]:
    import mlx.core as mx

    from mlx_dflash.doctor import default_dtype, environment, kernel_checks, lossless_check

    report: dict[str, Any] = {"schema_version": 1, "environment": environment()}
    status.update("kernel self-checks")
    report["kernels"] = kernel_checks([mx.bfloat16, mx.float16, mx.float32])
    report["lossless"] = []
    for dtype in dict.fromkeys([default_dtype(), mx.float16]):
        status.update(f"lossless check in {str(dtype).removeprefix('mlx.core.')}")
        report["lossless"].append(lossless_check(dtype))
    report["speed"] = {"skipped": "--no-speed"}
    if speed:
        status.update("speed check (loading the model)")
        try:
            report["speed"] = _speed(model, draft, no_draft, tokens)
        except Exception as e:  # noqa: BLE001 - a report names what failed instead of stopping
            report["speed"] = {"error": f"{type(e).__name__}: {e}"}
    failed = [f"kernel {k['kernel']} {k.get('dtype', '')}".strip() for k in report["kernels"] if k["passed"] is False]
    failed += [f"lossless {c['dtype']}" for c in report["lossless"] if not c["passed"]]
    if "error" in report["speed"]:
        failed.append("speed")
    report["failed"] = failed
    report["ok"] = not failed
    return report


def _mark(passed: bool | None) -> str:
    return "[dim]skipped[/]" if passed is None else "[green]pass[/]" if passed else "[bold red]FAIL[/]"


def render(report: dict[str, Any], console: Console) -> None:
    env = report["environment"]
    table = Table(title="mlx-dflash doctor", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    memory = env["memory_bytes"]
    working = env["recommended_working_set_bytes"]
    table.add_row("device", f"{env['device']} ({env['architecture']}, {env['backend']}), {env['os']}")
    table.add_row("memory", (f"{memory / 2**30:.1f} GiB" if memory else "unknown")
                  + (f", recommended working set {working / 2**30:.1f} GiB" if working else ""))
    table.add_row("versions", ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    table.add_row("kernels", f"MLX_DFLASH_KERNELS={env['kernel_mode']}, backend {env['kernel_backend'] or 'none'}")
    for k in report["kernels"]:
        detail = (k.get("skipped") or k.get("error")
                  or f"max error {k['max_error']:.2g} (tolerance {k['tolerance']:.2g})")
        label = f"  {k['kernel']}" + (f" {k['dtype']} d{k['head_dim']}" if "dtype" in k else "")
        table.add_row(label, f"{_mark(k['passed'])} {escape(detail)}")
    for check in report["lossless"]:
        flips = [c for c in check["cases"] if not c["identical"]]
        detail = f"{len(check['cases']) - len(flips)}/{len(check['cases'])} runs identical to the target alone"
        for c in flips:
            detail += (f"; prompt {c['prompt']} block {c['block_size']}: differs at token {c['position']}, "
                       f"top-2 gap {c['top2_gap']:.3g} ({'a near-tie' if c['near_tie'] else 'NOT a near-tie'})")
        table.add_row(f"lossless {check['dtype']}", f"{_mark(check['passed'])} {escape(detail)}")
    speed = report["speed"]
    if "target" in speed:
        for name in ("target", "dflash"):
            run = speed[name]
            table.add_row(f"speed {name}", f"{run['tok_per_s']:.1f} tok/s, tau {run['tau']:.2f}, "
                          f"block sizes {run['block_sizes']}")
        table.add_row("speedup", f"{speed['speedup']}x over {speed['dflash']['tokens']} tokens "
                      f"({escape(speed['source'])}); same tokens as the target alone: {speed['same_tokens']}")
    else:
        table.add_row("speed", escape(speed.get("error") or speed.get("skipped", "")))
    console.print(table)
    verdict = "[green]all checks passed[/]" if report["ok"] else \
        f"[bold red]failed:[/] {escape(', '.join(report['failed']))}"
    console.print(verdict)


@app.command()
def doctor(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Target for the speed check (default: the embedded SmolLM2 pair).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="Drafter for the speed check.")] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Speed check with prompt lookup alone.")] = False,
    tokens: Annotated[int, typer.Option("--tokens", min=8, max=4096, help="Tokens per speed run.")] = 64,
    speed: Annotated[bool, typer.Option("--speed/--no-speed", help="Run the speed check (loads the model).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Check this machine: device, memory and versions; each custom kernel against its pure-MLX twin;
    greedy DFlash against the target alone on a tiny built-in pair, in the device's default dtype and
    in float16; and a short speed check. Exit status 1 when a check failed. Paste its output
    (`--json`) into bug reports."""
    with err_console.status("checking", spinner="dots") as status:
        report = run_checks(model, draft, no_draft, tokens, speed, status)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console())
    if not report["ok"]:
        raise typer.Exit(1)
