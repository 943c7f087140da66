"""`--report DIR`: a Markdown report with PNG plots (needs matplotlib: `pip install mlx-dflash[report]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import DFlashError

INSTALL_HINT = "--report needs matplotlib: pip install 'mlx-dflash[report]' (or pip install matplotlib)"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise DFlashError(INSTALL_HINT) from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def cycle_text(cyc: dict[str, float] | None) -> str:
    """'212.0' ms per cycle, or '212.0 (50.1/150.2/11.7)' with the --profile split."""
    if not cyc:
        return "-"
    text = f"{cyc['total']:.1f}"
    if "draft" in cyc:
        text += " (" + "/".join(f"{cyc[k]:.1f}" for k in ("draft", "verify", "overhead")) + ")"
    return text


def sizes_text(histogram: dict[int, int]) -> str:
    """'1:40 16:3' (block size: cycles), the most used first."""
    return " ".join(f"{k}:{v}" for k, v in sorted(histogram.items(), key=lambda kv: -kv[1])) or "-"


def has_trees(rows: list[dict[str, Any]]) -> bool:
    """Whether any row is a draft-tree mode (the tables then show their tree sizes)."""
    return any(r.get("tree_budget") for r in rows)


def tree_text(row: dict[str, Any]) -> str:
    """'17.0 (40/52)': mean nodes of the cycles verified as trees (tree cycles / all cycles); '-' for none."""
    if not row.get("tree_budget"):
        return "-"
    if not row.get("tree_cycles"):
        return f"- (0/{row['cycles']})"
    return f"{row['mean_tree_size']:.1f} ({row['tree_cycles']}/{row['cycles']})"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    trees = has_trees(rows)
    head = ("| dataset | context | mode | tau | decode tok/s (median, min-max) | speedup vs mlx-lm | "
            "TTFT s | peak GB | ms per cycle (draft/verify/other) | block sizes (size:cycles) | "
            + ("tree nodes (tree cycles/cycles) | " if trees else "") + "predicted tok/s | mismatches |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        tps, sp, cyc = r["decode_tps"], r["speedup"], r["cycle_ms"]
        lines.append(
            f"| {r['dataset']} | {r['context'] or '-'} | {r['mode']} | {_fmt(r['tau'])} | "
            f"{tps['median']:.1f} ({tps['min']:.1f}-{tps['max']:.1f}) | "
            f"{_fmt(sp['median']) + 'x' if sp else '-'} | {r['ttft_s']['median']:.3f} | "
            f"{r['peak_memory_gb']:.2f} | {cycle_text(cyc)} | {sizes_text(r['block_size_histogram'])} | "
            + (f"{tree_text(r)} | " if trees else "") + f"{_fmt(r['predicted_tps'], 1)} | {r['mismatches']} |"
        )
    return lines


def _plot_acceptance(plt, rows: list[dict[str, Any]], out: Path) -> list[Path]:
    paths = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows if r["cycles"]):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        picked = [r for r in rows if r["dataset"] == dataset and r["cycles"] and not r["context"]]
        picked = picked or [r for r in rows if r["dataset"] == dataset and r["cycles"]]
        width = 0.8 / max(len(picked), 1)
        for i, r in enumerate(picked):
            hist = r["acceptance_histogram"]
            total = sum(hist) or 1
            label = f"{r['mode']}" + (f" ctx {r['context']}" if r["context"] else "") + f" (tau {r['tau']:.2f})"
            ax.bar([n + i * width for n in range(len(hist))], [c / total for c in hist], width, label=label)
        ax.set_xlabel("tokens committed per cycle")
        ax.set_ylabel("share of cycles")
        ax.set_title(f"Acceptance: {dataset}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"acceptance_{dataset}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _plot_speedup(plt, rows: list[dict[str, Any]], out: Path) -> Path | None:
    rows = [r for r in rows if r["speedup"] and not r["context"] and r["mode"] != "mlx-lm"]
    if not rows:
        return None
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(datasets)), 3.5))
    for i, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for j, dataset in enumerate(datasets):
            for r in rows:
                if r["dataset"] == dataset and r["mode"] == mode:
                    s = r["speedup"]
                    xs.append(j + i * width)
                    ys.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], label=mode, capsize=2)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(datasets))], datasets)
    ax.set_ylabel("decode speedup vs mlx-lm")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "speedup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_context(plt, rows: list[dict[str, Any]], out: Path) -> Path | None:
    overall = rows[-1]["dataset"] if rows else None  # rows end with "all" (or the only dataset)
    rows = [r for r in rows if r["context"] and r["dataset"] == overall]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["mean_prompt_tokens"], r["decode_tps"]["median"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_title("Decode speed as the context grows")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "context.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(data: dict[str, Any], directory: str | Path) -> Path:
    """Write README.md and PNG plots for a bench result (the `--json` document) into `directory`."""
    plt = _pyplot()
    out = Path(directory).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"{out}: cannot create the report directory ({e.strerror or e})") from None
    rows = data["summary"]
    cfg = data["config"]
    images = [*_plot_acceptance(plt, rows, out), _plot_speedup(plt, rows, out), _plot_context(plt, rows, out)]
    lines = [
        "# DFlash benchmark",
        "",
        f"Machine: {data['machine']}",
        "",
        f"Target `{cfg['model']}`, drafter `{cfg['draft']}`, datasets {', '.join(cfg['datasets'])}; "
        f"max tokens {cfg['max_tokens']}, temperature {cfg['temp']}, block sizes "
        f"{', '.join(map(str, cfg['block_sizes']))}"
        + (f", tree budgets {', '.join(map(str, cfg['tree_budgets']))} ({', '.join(cfg.get('tree_shapes') or [])})"
           if any(cfg.get("tree_budgets") or []) else "")
        + f", repeats {cfg['repeats']}.",
        "",
        *([f"Skipped: {'; '.join(cfg['skipped'])}.", ""] if cfg.get("skipped") else []),
        "```",
        data.get("command", ""),
        "```",
        "",
        "**Result: " + ("all greedy outputs identical across modes.**" if data["ok"] else
                        f"{len(data['failures'])} greedy mismatch(es): FAILED.**"),
        "",
        *_table(rows),
        "",
    ]
    if data["failures"]:
        lines += ["## Failures", "", *(f"- {f}" for f in data["failures"]), ""]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images if p is not None] + [""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path
