"""The run's results: what the clients saw summed up, the checks that fail, and the printed report."""

from __future__ import annotations

import math
from collections import Counter

from .record import Run

MIB = 1 << 20


def percentile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[max(math.ceil(q * len(ranked)) - 1, 0)] if ranked else float("nan")


def classify_follow_ups(follow_ups: list[dict], evictions: list[float] | None, samples: list, server: dict,
                        max_tokens: int) -> dict:
    """Lost: a follow-up with 0 cached prompt tokens although the cache evicted nothing between its previous
    turn's end and its own end; short: one whose cached tokens, though more than 0, do not cover its previous
    turn's prompt (which its own prompt begins with), under the same condition. A chat template's fixed
    preamble (SmolLM2's system prompt) is cached from any other conversation, so a lost conversation
    shows there as short, not as 0. Without the eviction log, /health's cache bytes stand in: nothing
    could have been evicted while they stayed below the budget less this conversation's size."""
    budget = server["prompt_cache_bytes"]
    lost, short, evicted, unknown = [], [], 0, 0
    cached_sum = prompt_sum = 0
    for f in follow_ups:
        if f["cached"] is None:
            unknown += 1
            continue
        cached_sum += f["cached"]
        prompt_sum += f["prompt_tokens"] or 0
        # The pending token (the prompt's last) is in no cache: one short of the previous prompt is whole.
        if f["cached"] > 0 and f["cached"] >= (f["previous_prompt_tokens"] or 0) - 1:
            continue
        window = (f["previous_end"] - 0.5, f["end"] + 0.5)
        if budget <= 0:
            evicted += 1
        elif evictions is not None:
            if any(window[0] <= t <= window[1] for t in evictions):
                evicted += 1
            else:
                (lost if f["cached"] == 0 else short).append(f)
        else:
            size = ((f["prompt_tokens"] or 0) + max_tokens) * server["token_bytes"]
            fullest = max((b for t, b, _ in samples if window[0] <= t <= window[1]), default=budget)
            if fullest + size > budget:
                evicted += 1
            else:
                (lost if f["cached"] == 0 else short).append(f)
    return {"follow_ups": len(follow_ups), "lost": len(lost), "lost_detail": lost[:10],
            "short": len(short), "short_detail": short[:10],
            "evicted_within_budget_rules": evicted, "cached_unreported": unknown,
            "cached_share_of_follow_up_prompts": cached_sum / prompt_sum if prompt_sum else None}


def summarize(run: Run, server: dict, final: dict, mem: dict, idle: float | None, stopped: str) -> dict:
    rec, args = run.record, run.args
    health = rec.health
    start = run.end - args.seconds
    failed_health = [t for t, _ in rec.health_failures]
    hostile = {name: {"sent": c["sent"], "4xx": c["4xx"], "other": dict(c["other"]),
                      "max_seconds": round(max(c["latencies"], default=0.0), 3), "quarantined": c["quarantined"],
                      # when it timed out (seconds into the run) and whether /health went unanswered meanwhile
                      "timeouts": [{"at_s": round(t0 - start, 1),
                                    "health_unanswered": any(t0 <= t <= t1 + args.health_timeout
                                                             for t in failed_health)}
                                   for t0, t1 in c["timeouts"]]}
             for name, c in rec.hostile.items()}
    lost = classify_follow_ups(rec.follow_ups, final.get("evictions"), rec.health_samples, server, args.max_tokens)
    budget = server["batch_bytes"] + server["model_bytes"] + server["prompt_cache_bytes"]
    # What serving may add to the process as it was when ready (interpreter, libraries, models).
    added = server["batch_bytes"] + server["prompt_cache_bytes"] + server["buffer_cache_bytes"]
    maxrss = final.get("maxrss") or mem.get("hwm")
    growth = maxrss - server["rss_ready"] if maxrss and server.get("rss_ready") else None
    evictions = final.get("evictions")
    return {
        "machine": server["machine"], "target": server["target"], "drafter": server["drafter"],
        "tiny": server["tiny"],
        "settings": {"seconds": args.seconds, "clients": args.clients, "max_tokens": args.max_tokens,
                     "max_batch": server["max_batch"], "block_size": server["block_size"], "seed": args.seed,
                     "batch_bytes": server["batch_bytes"], "prompt_cache_bytes": server["prompt_cache_bytes"],
                     "model_bytes": server["model_bytes"], "max_body_bytes": server["max_body_bytes"],
                     "server_has_allow_hosts": server["has_allow_hosts"]},
        "served": dict(rec.served), "served_total": sum(rec.served.values()),
        "cancelled_mid_stream": rec.cancelled, "hung_up_before_first_event": rec.hangups,
        "cut_at_end": rec.cut_at_end, "timeouts": dict(rec.timeouts),
        "hostile": hostile, "hostile_sent": sum(c["sent"] for c in hostile.values()),
        "hostile_4xx": sum(c["4xx"] for c in hostile.values()),
        "five_xx": len(rec.five_xx), "five_xx_detail": rec.five_xx[:20],
        "stream_errors": len(rec.stream_errors), "stream_errors_detail": rec.stream_errors[:20],
        "unexpected": len(rec.unexpected), "unexpected_detail": rec.unexpected[:20],
        "conversations": lost, "prompt_cache_evictions": None if evictions is None else len(evictions),
        "memory": {"maxrss": maxrss, "rss_ready": server.get("rss_ready"), "mlx_peak": final.get("mlx_peak"),
                   "growth_since_ready": growth, "buffer_cache_peak": final.get("buffer_cache_peak"),
                   "added_budget": added, "growth_over_added_budget": growth / added if growth else None,
                   "budget": budget, "maxrss_over_budget": maxrss / budget if maxrss else None,
                   "mlx_peak_over_budget": final["mlx_peak"] / budget if final.get("mlx_peak") else None},
        "health": {"polls": len(health), "failures": len(rec.health_failures),
                   "failure_kinds": dict(Counter(kind for _, kind in rec.health_failures)),
                   "first_failure_at_s": round(min(failed_health) - start, 1) if failed_health else None,
                   "p50_ms": 1000 * percentile(health, 0.5), "p99_ms": 1000 * percentile(health, 0.99),
                   "max_ms": 1000 * max(health, default=float("nan"))},
        "idle_after_load_s": idle, "server_stop": stopped,
    }


def verdict(s: dict) -> list[str]:
    failures = []
    if s["five_xx"]:
        failures.append(f"{s['five_xx']} answers 5xx")
    if s["stream_errors"]:
        failures.append(f"{s['stream_errors']} errors inside streams")
    for name, c in s["hostile"].items():
        if c["sent"] and c["4xx"] < c["sent"]:
            failures.append(f"hostile '{name}': {c['sent'] - c['4xx']} of {c['sent']} not answered 4xx {c['other']}")
    if s["conversations"]["lost"] or s["conversations"]["short"]:
        failures.append(f"lost conversations: {s['conversations']['lost']} with 0 cached tokens, "
                        f"{s['conversations']['short']} more with fewer than their previous turn's prompt")
    if s["timeouts"]:
        failures.append(f"requests timed out: {s['timeouts']}")
    if s["unexpected"]:
        failures.append(f"{s['unexpected']} unexpected answers or transport errors")
    if s["health"]["failures"]:
        failures.append(f"/health failed {s['health']['failures']} times {s['health']['failure_kinds']}")
    if s["idle_after_load_s"] is None:
        failures.append("the server was not idle after the load (requests left running or waiting)")
    if s["server_stop"] != "stopped":
        failures.append(f"server stop: {s['server_stop']}")
    if not s["served_total"]:
        failures.append("no request completed")
    memory = s["memory"]
    for name, key in (("MLX peak", "mlx_peak_over_budget"), ("RSS growth", "growth_over_added_budget")):
        over = memory[key]
        if over is not None and over > 1:
            failures.append(f"{name} over its budget: {100 * over:.0f} %")
    return failures


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.0f} MiB"


def show(s: dict, failures: list[str]) -> None:
    st = s["settings"]
    print(f"\nmachine: {s['machine']}")
    print(f"target: {s['target']}\ndrafter: {s['drafter'] or 'none'}" + (" (tiny random models)" if s["tiny"] else ""))
    print(f"server: --max-batch {st['max_batch']}, block size {st['block_size']}, --batch-bytes "
          f"{mib(st['batch_bytes'])}, prompt cache {mib(st['prompt_cache_bytes'])}, models {mib(st['model_bytes'])}, "
          f"--max-body-bytes {mib(st['max_body_bytes'])}, Host check (allow_hosts): "
          f"{'present' if st['server_has_allow_hosts'] else 'absent'}")
    print(f"run: {st['seconds']:.0f} s, {st['clients']} clients, {st['max_tokens']} tokens max, greedy, "
          f"seed {st['seed']}")
    served = ", ".join(f"{k} {v}" for k, v in sorted(s["served"].items())) or "none"
    print(f"\nrequests served (200, stream completed): {s['served_total']} ({served}); follow-up turns "
          f"{s['conversations']['follow_ups']}")
    print(f"cancelled mid-stream {s['cancelled_mid_stream']}, hung up before the first event "
          f"{s['hung_up_before_first_event']}, cut at the end of the run {s['cut_at_end']}, timed out "
          f"{sum(s['timeouts'].values())}")
    print(f"hostile requests answered 4xx: {s['hostile_4xx']} of {s['hostile_sent']}")
    print("| case | sent | 4xx | other answers | slowest |\n|---|---|---|---|---|")
    for name, c in s["hostile"].items():
        other = ", ".join(f"{k} x{v}" for k, v in c["other"].items()) or "-"
        for t in c["timeouts"]:
            other += (f" (at {t['at_s']:.0f} s; not sent again; /health "
                      f"{'unanswered too: the server was held' if t['health_unanswered'] else 'answered meanwhile'})")
        print(f"| {name} | {c['sent']} | {c['4xx']} | {other} | {c['max_seconds']:.2f} s |")
    print(f"5xx answers: {s['five_xx']}; errors inside 200 streams: {s['stream_errors']}; other unexpected: "
          f"{s['unexpected']}")
    for line in s["five_xx_detail"] + s["stream_errors_detail"] + s["unexpected_detail"]:
        print(f"  {line[:240]}")
    c = s["conversations"]
    share = c["cached_share_of_follow_up_prompts"]
    print(f"lost conversations: {c['lost']} of {c['follow_ups']} follow-ups with 0 cached tokens, {c['short']} more "
          f"with fewer than their previous turn's prompt (no eviction since the previous turn); short after an "
          f"eviction: {c['evicted_within_budget_rules']}; prompt cache "
          f"evictions: {'n/a' if s['prompt_cache_evictions'] is None else s['prompt_cache_evictions']}; cached share "
          f"of follow-up prompts: {'n/a' if share is None else f'{100 * share:.0f} %'}")
    m = s["memory"]

    def ratio(r: float | None) -> str:
        return "n/a" if r is None else f"{100 * r:.0f} %"

    print(f"peak memory: maxrss {mib(m['maxrss'])} (at ready {mib(m['rss_ready'])}: the interpreter, libraries and "
          f"models; grown {mib(m['growth_since_ready'])} under load: {ratio(m['growth_over_added_budget'])} of batch "
          f"bytes + prompt cache + MLX buffer cache limit, {mib(m['added_budget'])}); MLX peak "
          f"{mib(m['mlx_peak'])}: {ratio(m['mlx_peak_over_budget'])} of batch bytes + models + prompt cache "
          f"({mib(m['budget'])}); MLX buffer cache peak {mib(m['buffer_cache_peak'])}")
    h = s["health"]
    failed = f" {h['failure_kinds']}, the first at {h['first_failure_at_s']:.0f} s" if h["failures"] else ""
    print(f"/health: {h['polls']} answers, p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, max "
          f"{h['max_ms']:.1f} ms; failed {h['failures']}{failed}")
    idle = s["idle_after_load_s"]
    print(f"idle after the load: {'no' if idle is None else f'yes, after {idle:.1f} s'}; server stop: "
          f"{s['server_stop']}")
    print("\nverdict: " + ("PASS" if not failures else "FAIL\n  " + "\n  ".join(failures)), flush=True)
