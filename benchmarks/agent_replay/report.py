"""The replay's report: one line per request (phase, agent, prompt and cached tokens, share cached, time to first
token), the verdict per goal for each target, and the JSON document.

Goals (issue 50): every turn after the first, and every new session with the same system prompt and tools,
reads at least 90 % of its prompt from the cache; after a restart on the same --prompt-cache-dir, the first
turn reads at least 90 % (from disk: the memory tier is empty) with a time to first token at most 0.3x the
cold one. The cold reference for that turn is its session's first turn's time to first token scaled by the
prompts' token counts (a cold prefill of the longer prompt takes at least that long, so the check errs on the
strict side). `ideal` is the share a perfect cache would read on a later turn: the previous turn's prompt and
reply over this prompt (below 90 % when a turn adds more than a tenth of the prompt, as at a small
--system-tokens). Sub-agents are shown, not judged: their system prompt differs, so only a shared beginning can
be reused.
"""

from __future__ import annotations

from typing import Any

CACHED_GOAL = 0.9
DISK_TTFT_GOAL = 0.3
COLUMNS = (("target", 9), ("phase", 24), ("agent", 11), ("prompt", 7), ("cached", 7), ("cached%", 7),
           ("ideal%", 6), ("TTFT s", 7), ("prefill s", 9), ("note", 0))


def share(row: dict) -> float | None:
    """The share of the prompt read from the cache, or None when the server did not say."""
    if not row.get("prompt_tokens") or row.get("cached") is None:
        return None
    return row["cached"] / row["prompt_tokens"]


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def header() -> str:
    return "  ".join(f"{name:<{width}}" if i < 3 else f"{name:>{width}}"
                     for i, (name, width) in enumerate(COLUMNS)).rstrip()


def line(row: dict) -> str:
    """One request's line of the table."""
    pct = share(row)
    values = [row["target"], row["phase"], row["agent"], _cell(row.get("prompt_tokens")), _cell(row.get("cached")),
              "-" if pct is None else f"{100 * pct:.1f}",
              "-" if row.get("ideal") is None else f"{100 * row['ideal']:.1f}", _cell(row.get("ttft")),
              _cell(row.get("prefill_s")),
              row.get("error") or row.get("note") or ""]
    cells = zip(values, COLUMNS, strict=True)
    return "  ".join(f"{v:<{w}}" if i < 3 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(cells)).rstrip()


def _judge(rows: list[dict], label: str) -> dict:
    """Every row at least CACHED_GOAL cached: PASS, FAIL (naming the rows below), or NOT MEASURED."""
    if not rows:
        return {"goal": label, "verdict": "NOT MEASURED", "detail": "no such requests"}
    short = [r for r in rows if (share(r) or 0.0) < CACHED_GOAL]
    detail = ", ".join(f"{r['agent']} {r['phase']}: {_pct(r)}" for r in short) or \
        f"lowest {min(100 * (share(r) or 0) for r in rows):.1f} %"
    if short and all(r.get("ideal") is not None and (share(r) or 0) >= r["ideal"] - 0.02 for r in short):
        detail += ("; the cache read all it could (within 2 points of ideal): at this scale a turn adds more "
                   f"than {1 - CACHED_GOAL:.0%} of its prompt")
    return {"goal": label, "verdict": "FAIL" if short else "PASS", "detail": detail}


def _pct(row: dict) -> str:
    pct = share(row)
    if row.get("error") or pct is None:
        return row.get("error") or "no usage"
    ideal = row.get("ideal")
    return f"{100 * pct:.1f} %" + ("" if ideal is None else f" (ideal {100 * ideal:.1f} %)")


def _restart_goal(rows: list[dict], restart_note: str | None) -> dict:
    label = f"after a restart the first turn reads >= {CACHED_GOAL:.0%} from disk, TTFT <= {DISK_TTFT_GOAL}x cold"
    if restart_note and not any(r["kind"] == "restart_turn" for r in rows):
        return {"goal": label, "verdict": "NOT MEASURED", "detail": restart_note}
    checks, failed = [], False
    for row in (r for r in rows if r["kind"] == "restart_turn"):
        first = next((r for r in rows if r["agent"] == row["agent"] and r["kind"] == "first_turn"), None)
        cold = None
        if first and first.get("ttft") and first.get("prompt_tokens") and row.get("prompt_tokens"):
            cold = first["ttft"] * row["prompt_tokens"] / first["prompt_tokens"]
        row["cold_ttft_estimate"] = cold
        ratio = row["ttft"] / cold if cold and row.get("ttft") is not None else None
        ok = (share(row) or 0) >= CACHED_GOAL and ratio is not None and ratio <= DISK_TTFT_GOAL
        failed |= not ok
        checks.append(f"{row['agent']}: {_pct(row)} cached, TTFT {_cell(row.get('ttft'))} s = "
                      f"{'-' if ratio is None else f'{ratio:.2f}'}x cold (est. {_cell(cold)} s)")
    if not checks:
        return {"goal": label, "verdict": "NOT MEASURED", "detail": "no request after the restart"}
    detail = "; ".join(checks) + (f" ({restart_note})" if restart_note else "")
    return {"goal": label, "verdict": "FAIL" if failed else "PASS", "detail": detail}


def verdicts(rows: list[dict], restart_note: str | None) -> list[dict]:
    """The goals' verdicts for one target's rows (each row has a `kind`: first_turn, later_turn, new_session,
    subagent, restart_turn, restart_session)."""
    return [
        _judge([r for r in rows if r["kind"] == "later_turn"],
               f"every turn after the first reads >= {CACHED_GOAL:.0%} from the cache"),
        _judge([r for r in rows if r["kind"] in ("new_session", "restart_session")],
               f"every new session with the same system prompt + tools reads >= {CACHED_GOAL:.0%} from the cache"),
        _restart_goal(rows, restart_note),
    ]


def show_verdicts(target: str, results: list[dict]) -> None:
    print(f"\nverdicts, {target}:")
    for v in results:
        print(f"  {v['verdict']:<12} {v['goal']}\n  {'':<12} {v['detail']}")
