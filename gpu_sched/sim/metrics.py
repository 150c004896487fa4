"""Serving metrics for `gpu-sched replay`, with the definitions of vLLM's `benchmark_serving`.

The simulator fills one `RequestRecord` per request and one `StepRecord` per engine step;
`summarize` turns them into a flat, JSON-serialisable dict whose latency keys follow vLLM's
result JSON (`mean_ttft_ms`, `p99_itl_ms`, ...). Latencies are reported in milliseconds,
scheduler times in microseconds, durations in (simulated) seconds. A statistic over no
values is `None`, never NaN, so `json.dumps(..., allow_nan=False)` always works.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["RequestRecord", "StepRecord", "summarize", "format_summary", "format_comparison",
           "format_rate_sweep", "strict_json", "write_results", "queue_bucket"]

PERCENTILES = (50, 90, 99)
LATENCIES = (("ttft", "Time to First Token", "TTFT"),
             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"),
             ("e2el", "End-to-end Latency", "E2EL"))


@dataclass
class RequestRecord:
    """One request; all times in simulated seconds, lengths in tokens."""
    rid: str
    arrival_s: float
    input_len: int                   # prompt tokens
    output_len: int                  # tokens generated (may be < planned if cut)
    cached_tokens: int               # prompt tokens served from the prefix cache at its first admission (extend_start)
    first_token_s: Optional[float]   # first output token time (None = never)
    finish_s: Optional[float]        # last token time (None = unfinished)
    token_times: list = field(default_factory=list)  # time of each output token (len == output_len)
    retractions: int = 0             # times retracted to free KV for decode (R-DEC-2)
    preemptions: int = 0             # times preempted by a higher-priority request (R-ADM-7)
    queued_s: float = 0.0            # time in the waiting queue: from arrival (and from each retraction or
                                     # preemption) to the start of the forward that prefills its first chunk
    priority: Optional[int] = None   # the request's priority (None: none given)
    routing_key: Optional[str] = None


@dataclass
class StepRecord:
    """One engine step; `t_s`/`duration_s` in simulated seconds, `sched_wall_s` in real seconds."""
    t_s: float              # simulated time at the end of the step
    kind: str               # "prefill", "decode" or "idle"
    duration_s: float       # simulated step duration
    queue_len: int          # waiting requests when the scheduler ran (at the step's start)
    running: int            # running requests after the step
    kv_used_tokens: int     # KV pool slots in use (private + cached)
    kv_pool_tokens: int
    prefill_tokens: int     # extend tokens prefilled in this step (sum of extend_end - extend_start)
    hit_tokens: int         # prefix-cache hit tokens of requests admitted this step
    sched_wall_s: float     # wall-clock seconds of the scheduler's own step()
    waiting: int = 0        # waiting requests after the step (not admitted, or preempted back)
    charged_s: float = 0.0  # simulated seconds the step waited for the scheduler before its forward
                            # (`replay(scheduler_time=...)`; 0 with "free"); t_s includes them
    kv_evictable_tokens: int = 0  # of kv_used_tokens, cached tokens no request holds (reusable, evictable)


def _num(x) -> Optional[float]:
    """Python float, or None for None/NaN/inf."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _clean(obj):
    """Recursively make `obj` strict-JSON-safe: NaN/inf -> None, numpy scalars/arrays -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return _num(obj)
    if obj is None or isinstance(obj, str):
        return obj
    return str(obj)


def _stats(values, scale: float, prefix: str, unit: str) -> dict:
    """mean/median/std/pNN of `values * scale` as `{f"mean_{prefix}_{unit}": ...}`."""
    a = np.asarray(values, dtype=float) * scale
    out = {f"mean_{prefix}_{unit}": None, f"median_{prefix}_{unit}": None, f"std_{prefix}_{unit}": None}
    out.update({f"p{p}_{prefix}_{unit}": None for p in PERCENTILES})
    if a.size:
        out[f"mean_{prefix}_{unit}"] = _num(np.mean(a))
        out[f"median_{prefix}_{unit}"] = _num(np.median(a))
        out[f"std_{prefix}_{unit}"] = _num(np.std(a))
        for p in PERCENTILES:
            out[f"p{p}_{prefix}_{unit}"] = _num(np.percentile(a, p))
    return out


def queue_bucket(queue_len: int) -> tuple[int, int]:
    """Power-of-two bucket (lo, hi) of a queue length: 0 -> (0, 0), 1 -> (1, 1), 5 -> (4, 7)."""
    if queue_len <= 0:
        return 0, 0
    lo = 1 << (int(queue_len).bit_length() - 1)
    return lo, 2 * lo - 1


def summarize(requests, steps, *, duration_s: Optional[float] = None) -> dict:
    """Summary metrics of a replay as a flat JSON-serialisable dict.

    Latency metrics (vLLM definitions, milliseconds, over completed requests, i.e. `finish_s`
    set): TTFT = first_token - arrival; TPOT = (finish - first_token) / (output_len - 1) for
    output_len > 1; ITL = every gap between consecutive `token_times`, pooled; E2EL = finish -
    arrival. Each has mean/median/std/p90/p99 (`np.percentile`, linear interpolation).
    `duration` (s) is `duration_s` if given, else first arrival to last finish; throughputs are
    per simulated second (None if the duration is 0). Token totals count completed requests.
    `prefix_cache_hit_rate` = sum cached_tokens / sum input_len over prefilled requests (those
    with a first token); `step_cache_hit_rate` = sum hit_tokens / (hit + prefill tokens) over
    steps. Queueing delay (`*_queue_delay_ms`, completed requests) is each request's
    `queued_s`: arrival to the start of the forward that prefills it (retried waits after a
    retraction or preemption added), so TTFT = queueing delay + prefill time for a request
    prefilled in one chunk and never retracted or preempted (waits after a request's first
    token count too: its queueing delay may then exceed its TTFT). `time_avg_queue_len` is the mean number of waiting requests over
    the duration (Little's law: the sum of every request's `queued_s` / duration);
    `time_avg_kv_usage` and `time_avg_kv_held` the pool's used share and the share held by
    requests (used minus the reusable, evictable cache), each step weighted by its simulated
    time (its wait for the scheduler and idle gaps included, from the first arrival on). `mean_queue_len` / `max_queue_len` (over each step's
    `queue_len`, the requests waiting when the scheduler ran) and `mean_kv_usage` /
    `max_kv_usage` are per-step figures, not averages over time: short decode steps
    dominate them. `retractions` counts R-DEC-2's retractions, `preemptions` R-ADM-7's
    priority preemptions. With priorities, `by_priority` gives per level (as a string key)
    the completed requests' count, mean and p99 TTFT and mean queueing delay. Scheduler
    time (`*_sched_us`, microseconds of real time) is over non-idle steps, also broken down
    by power-of-two queue-length bucket in `sched_us_by_queue_len` ({"4-7": {lo, hi, count,
    mean_us, p99_us}}, ordered by lower bound).
    """
    requests, steps = list(requests), list(steps)
    done = [r for r in requests if r.finish_s is not None]
    prefilled = [r for r in requests if r.first_token_s is not None]
    if duration_s is None:
        duration_s = (max(r.finish_s for r in done) - min(r.arrival_s for r in requests)) if done else 0.0
    n_in = sum(int(r.input_len) for r in done)
    n_out = sum(int(r.output_len) for r in done)
    duration_s = float(duration_s)  # Python floats: a subnormal duration gives inf (None), not a numpy warning
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    s = {"completed": len(done), "unfinished": len(requests) - len(done),
         "total_input_tokens": n_in, "total_output_tokens": n_out, "duration": _num(duration_s),
         "request_throughput": _num(rate(len(done))), "output_throughput": _num(rate(n_out)),
         "total_token_throughput": _num(rate(n_in + n_out))}

    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    tpot = [(r.finish_s - r.first_token_s) / (r.output_len - 1)
            for r in done if r.output_len > 1 and r.first_token_s is not None]
    itl = [g for r in done for g in np.diff(np.asarray(r.token_times, dtype=float)).tolist()]
    e2el = [r.finish_s - r.arrival_s for r in done]
    for (key, _, _), vals in zip(LATENCIES, (ttft, tpot, itl, e2el)):
        s.update(_stats(vals, 1e3, key, "ms"))

    cached = sum(int(r.cached_tokens) for r in prefilled)
    prompt = sum(int(r.input_len) for r in prefilled)
    hit, pre = sum(int(t.hit_tokens) for t in steps), sum(int(t.prefill_tokens) for t in steps)
    s.update({"prefilled_requests": len(prefilled), "cached_tokens": cached, "prefilled_input_tokens": prompt,
              "prefix_cache_hit_rate": _num(cached / prompt) if prompt else None,
              "step_cache_hit_rate": _num(hit / (hit + pre)) if hit + pre else None,
              "retractions": sum(int(r.retractions) for r in requests),
              "retracted_requests": sum(1 for r in requests if r.retractions > 0),
              "preemptions": sum(int(r.preemptions) for r in requests),
              "preempted_requests": sum(1 for r in requests if r.preemptions > 0)})
    s.update(_stats([r.queued_s for r in done], 1e3, "queue_delay", "ms"))

    q = np.asarray([t.queue_len for t in steps], dtype=float)
    pooled = [t for t in steps if t.kv_pool_tokens > 0]
    kv = np.asarray([t.kv_used_tokens / t.kv_pool_tokens for t in pooled], dtype=float)
    held = np.asarray([(t.kv_used_tokens - t.kv_evictable_tokens) / t.kv_pool_tokens for t in pooled], dtype=float)
    # each step's simulated time, its wait for the scheduler included, from the first arrival on
    # (the idle gap before it is outside the duration)
    t0 = min((r.arrival_s for r in requests), default=0.0)
    w = np.asarray([max(0.0, t.t_s - max(t.t_s - t.duration_s - t.charged_s, t0)) for t in pooled], dtype=float)
    timed = w.size and w.sum() > 0
    s.update({"steps": len(steps),
              "mean_queue_len": _num(q.mean()) if q.size else None,
              "max_queue_len": int(q.max()) if q.size else 0,
              "time_avg_queue_len": _num(sum(r.queued_s for r in requests) / duration_s) if duration_s > 0 else None,
              "mean_kv_usage": _num(kv.mean()) if kv.size else None,
              "max_kv_usage": _num(kv.max()) if kv.size else None,
              "time_avg_kv_usage": _num(np.average(kv, weights=w)) if timed else None,
              "time_avg_kv_held": _num(np.average(held, weights=w)) if timed else None})
    levels = sorted({r.priority for r in done if r.priority is not None})
    if levels:
        s["by_priority"] = {}
        for lv in levels:
            rs = [r for r in done if r.priority == lv]
            tt = np.asarray([r.first_token_s - r.arrival_s for r in rs if r.first_token_s is not None], dtype=float)
            s["by_priority"][str(lv)] = {
                "completed": len(rs), "mean_ttft_ms": _num(1e3 * tt.mean()) if tt.size else None,
                "p99_ttft_ms": _num(1e3 * np.percentile(tt, 99)) if tt.size else None,
                "mean_queue_delay_ms": _num(1e3 * np.mean([r.queued_s for r in rs]))}

    sched = [t for t in steps if t.kind != "idle"]
    us = np.asarray([t.sched_wall_s for t in sched], dtype=float) * 1e6
    s["sched_steps"] = len(sched)
    s["mean_sched_us"] = _num(us.mean()) if us.size else None
    s["median_sched_us"] = _num(np.percentile(us, 50)) if us.size else None
    s["p99_sched_us"] = _num(np.percentile(us, 99)) if us.size else None
    groups: dict = {}
    for t, u in zip(sched, us):
        groups.setdefault(queue_bucket(t.queue_len), []).append(u)
    s["sched_us_by_queue_len"] = {
        f"{lo}-{hi}": {"lo": lo, "hi": hi, "count": len(v), "mean_us": _num(np.mean(v)),
                       "p99_us": _num(np.percentile(v, 99))}
        for (lo, hi), v in sorted(groups.items())}
    return s


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, (bool, str)):
        return str(v)
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    return f"{float(v):.{digits}f}"


def format_summary(summary: dict, title: str = "Serving Benchmark Result", width: int = 50) -> str:
    """Fixed-width text table in the style of `vllm bench serve` (name left, value right)."""
    g = summary.get
    pct = lambda k: None if g(k) is None else 100.0 * g(k)  # noqa: E731
    lines = [f" {title} ".center(width, "=") if len(title) + 6 <= width else f"== {title} =="]  # a long title keeps its rule
    def row(name: str, v) -> None:  # the value right-aligned at `width`, however long the name
        text = _fmt(v)
        lines.append(f"{name}{text:>{max(width - len(name), len(text) + 1)}}")
    sec = lambda name: lines.append(f" {name} ".center(width, "-") if len(name) < width - 2 else name[:width])  # noqa: E731
    for name, k in (("Successful requests:", "completed"), ("Unfinished requests:", "unfinished"),
                    ("Benchmark duration (s):", "duration"), ("Total input tokens:", "total_input_tokens"),
                    ("Total generated tokens:", "total_output_tokens"),
                    ("Request throughput (req/s):", "request_throughput"),
                    ("Output token throughput (tok/s):", "output_throughput"),
                    ("Total token throughput (tok/s):", "total_token_throughput")):
        row(name, g(k))
    for key, long, short in LATENCIES + (("queue_delay", "Queueing Delay (waits for a prefill)", "QD"),):
        sec(long)
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("std", "Std"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", g(f"{stat}_{key}_ms"))
    sec("Prefix cache and queue")
    row("Prefix cache hit rate (%):", pct("prefix_cache_hit_rate"))
    row("Cached prompt tokens:", g("cached_tokens"))
    row("Retractions (R-DEC-2):", g("retractions"))
    row("Priority preemptions (R-ADM-7):", g("preemptions"))
    row("Queue length, time avg:", g("time_avg_queue_len"))
    row("Queue length, mean per step:", g("mean_queue_len"))
    row("Max queue length:", g("max_queue_len"))
    row("KV usage, time avg (%):", pct("time_avg_kv_usage"))
    row("KV held by requests, time avg (%):", pct("time_avg_kv_held"))
    row("KV usage, mean per step (%):", pct("mean_kv_usage"))
    row("Max KV usage (%):", pct("max_kv_usage"))
    for lv, b in (g("by_priority") or {}).items():
        row(f"  priority {lv} (n={b['completed']}) TTFT mean/p99 (ms):",
            f"{_fmt(b['mean_ttft_ms'], 1)}/{_fmt(b['p99_ttft_ms'], 1)}")
    sec("Scheduler time per step")
    row("Scheduling steps:", g("sched_steps"))
    row("Mean sched time (us):", g("mean_sched_us"))
    row("Median sched time (us):", g("median_sched_us"))
    row("P99 sched time (us):", g("p99_sched_us"))
    for label, b in (g("sched_us_by_queue_len") or {}).items():
        row(f"  queue {label} (n={b['count']}) mean/p99 (us):", f"{_fmt(b['mean_us'], 1)}/{_fmt(b['p99_us'], 1)}")
    calls = g("sched_calls_s")
    if calls:  # a replay's: step() and the engine's other scheduler calls, real seconds
        sec("Scheduler calls (real time)")
        counts = g("sched_calls_n") or {}
        for name, secs in calls.items():
            row(f"{name} ({counts.get(name, 0)} calls) (ms):", _fmt(secs * 1e3, 1))
        row("All scheduler calls (ms):", _fmt(sum(calls.values()) * 1e3, 1))
        if g("scheduler_time") not in (None, "free"):  # charged to the simulated clock
            row(f"Charged to the clock, {g('scheduler_time')} (ms):", _fmt((g("charged_sched_s") or 0.0) * 1e3, 1))
    if g("digest"):
        row("Decision digest:", str(g("digest"))[:12])
    lines.append("=" * width)
    return "\n".join(lines)


COMPARISON_ROWS = (("Requests completed", "completed"), ("Request throughput (req/s)", "request_throughput"),
                   ("Output throughput (tok/s)", "output_throughput"), ("Prefix cache hit rate (%)", "hit%"),
                   ("Mean TTFT (ms)", "mean_ttft_ms"), ("P99 TTFT (ms)", "p99_ttft_ms"),
                   ("Mean queueing delay (ms)", "mean_queue_delay_ms"),
                   ("Mean TPOT (ms)", "mean_tpot_ms"), ("Mean E2EL (ms)", "mean_e2el_ms"),
                   ("Sched mean (us/step)", "mean_sched_us"), ("Sched p99 (us/step)", "p99_sched_us"),
                   ("Sched calls, all (ms)", "calls_ms"),
                   ("Decision digest", "digest"))


#: the comparison row of the simulated time charged for the scheduler (only for charged runs)
CHARGED_ROW = ("Sched charged to clock (ms)", "charged_ms")


def _charged(summaries) -> bool:
    """Whether any of `summaries` was charged for the scheduler's time
    (`replay(scheduler_time=...)` other than "free")."""
    return any(s.get("scheduler_time") not in (None, "free") for s in summaries)


def _comparison_rows(summaries) -> tuple:
    """`COMPARISON_ROWS`, with the simulated time charged for the scheduler before the digest
    when any of `summaries` was charged."""
    if _charged(summaries):
        return COMPARISON_ROWS[:-1] + (CHARGED_ROW,) + COMPARISON_ROWS[-1:]
    return COMPARISON_ROWS


def format_comparison(summaries: dict) -> str:
    """One table with a column per run (`{run name: summary}`), e.g. per policy."""
    names = list(summaries)
    cells = []
    rows = _comparison_rows(summaries.values())
    for _, key in rows:
        row = []
        for n in names:
            s = summaries[n]
            if key == "digest":
                v = str(s["digest"])[:12] if s.get("digest") else None
            else:
                v = _metric(s, key)
            row.append(_fmt(v))
        cells.append(row)
    return _table([label for label, _ in rows], names, cells, 12)


def _table(labels, names, cells, min_width: int, title: Optional[str] = None) -> str:
    """A text table: a row per label, a right-aligned column per name (cells[row][column])."""
    lw = max(len(label) for label in labels) + 2
    cw = [max(min_width, len(n) + 2, *(len(r[i]) + 2 for r in cells)) for i, n in enumerate(names)]
    head = "Metric".ljust(lw) + "".join(n.rjust(w) for n, w in zip(names, cw))
    body = [label.ljust(lw) + "".join(c.rjust(w) for c, w in zip(r, cw)) for label, r in zip(labels, cells)]
    rule = "=" * len(head)
    return "\n".join([rule, *([title] if title else []), head, "-" * len(head), *body, rule])


#: the keys of a `seed_spread` that are not summary keys, as seeds.json / sweep.json explain them
DERIVED_KEYS = {"hit%": "prefix_cache_hit_rate x 100 (percent)",
                "calls_ms": "sum of sched_calls_s over every scheduler call, x 1000 (real milliseconds)",
                "charged_ms": "charged_sched_s x 1000 (simulated milliseconds)"}


def _metric(s: dict, key: str):
    if key == "charged_ms":
        return None if s.get("charged_sched_s") is None else 1e3 * s["charged_sched_s"]
    if key == "calls_ms":
        return None if not s.get("sched_calls_s") else 1e3 * sum(s["sched_calls_s"].values())
    if key == "hit%":
        return None if s.get("prefix_cache_hit_rate") is None else 100.0 * s["prefix_cache_hit_rate"]
    return s.get(key)


def seed_spread(per_seed: dict, rows=None) -> dict:
    """Across seeds, per run and metric of `rows` ((label, key) pairs; default
    `_comparison_rows`; the digest aside): mean, std (population; 0 for one seed), min, max and
    n over the seeds where the metric exists. per_seed: {seed: {run name: summary}}; returns
    {run name: {key: {...}}} (key "hit%" is the prefix-cache hit rate in percent)."""
    runs = list(next(iter(per_seed.values()))) if per_seed else []
    if rows is None:
        rows = _comparison_rows([s for by_run in per_seed.values() for s in by_run.values()])
    out = {}
    for run in runs:
        out[run] = {}
        for _, key in rows:
            if key == "digest":
                continue
            vals = [float(v) for v in (_metric(per_seed[sd][run], key) for sd in per_seed) if v is not None]
            out[run][key] = ({"mean": float(np.mean(vals)), "std": float(np.std(vals)), "min": min(vals),
                              "max": max(vals), "n": len(vals)} if vals else None)
    return out


def _spread_cell(stat: Optional[dict]) -> str:
    """One `seed_spread` statistic as a table cell: `mean +- std`, or n/a."""
    return "n/a" if stat is None else f"{_fmt(stat['mean'])} +- {_fmt(stat['std'])}"


def format_seed_spread(spread: dict, seeds) -> str:
    """`seed_spread` as one table: a column per run, `mean +- std` over the seeds."""
    names = list(spread)
    keys = set(spread[names[0]]) if names else set()
    rows = [(label, key) for label, key in COMPARISON_ROWS[:-1] + (CHARGED_ROW,) if key in keys]
    cells = [[_spread_cell(spread[n][key]) for n in names] for _, key in rows]
    return _table([label for label, _ in rows], names, cells, 16,
                  title=f"mean +- std (population, ddof=0) over seeds {', '.join(str(sd) for sd in seeds)}")


#: the rows of a rate sweep's table (`format_rate_sweep`): how serving changes with the load
SWEEP_ROWS = (("Request throughput (req/s)", "request_throughput"), ("Output throughput (tok/s)", "output_throughput"),
              ("Prefix cache hit rate (%)", "hit%"), ("Mean TTFT (ms)", "mean_ttft_ms"),
              ("P99 TTFT (ms)", "p99_ttft_ms"), ("Mean TPOT (ms)", "mean_tpot_ms"),
              ("Mean E2EL (ms)", "mean_e2el_ms"), ("Queue length, time avg", "time_avg_queue_len"),
              ("Sched mean (us/step)", "mean_sched_us"))


def sweep_rows(summaries) -> tuple:
    """`SWEEP_ROWS`, with the simulated time charged for the scheduler when any of `summaries`
    was charged."""
    return SWEEP_ROWS + (CHARGED_ROW,) if _charged(summaries) else SWEEP_ROWS


def format_rate_sweep(per_rate: dict, offered: dict, label=lambda x: f"{x:g}", seeds=None) -> str:
    """A rate sweep (`gpu-sched replay --rate-scales`) as one table: a column per run, a group
    of rows per metric of `sweep_rows`, one row per rate scale in each group, `x<label(scale)>`
    with the offered request rate [req/s] where there is one. per_rate: {rate scale: {run
    name: summary}}, or with `seeds` (--seeds too) {rate scale: `seed_spread` over them}, whose
    cells read `mean +- std`; offered: {rate scale: req/s or None} (the mean over the seeds)."""
    rates = list(per_rate)
    names = list(per_rate[rates[0]]) if rates else []
    if seeds is None:
        rows = sweep_rows([s for by_run in per_rate.values() for s in by_run.values()])
        cell = lambda x, n, key: _fmt(_metric(per_rate[x][n], key))  # noqa: E731
    else:
        rows = tuple(r for r in SWEEP_ROWS + (CHARGED_ROW,) if r[1] in per_rate[rates[0]][names[0]])
        cell = lambda x, n, key: _spread_cell(per_rate[x][n][key])  # noqa: E731
    at = {x: f"x{label(x)}" + (f" ({offered[x]:.3g} req/s)" if offered.get(x) is not None else "") for x in rates}
    width = max(28, *(len(lb) + 2 for lb, _ in rows))
    labels, cells = [], []
    for name, key in rows:
        for i, x in enumerate(rates):
            labels.append(f"{name if i == 0 else '':<{width}}{at[x]}")
            cells.append([cell(x, n, key) for n in names])
    brackets = ("; in brackets the offered rate, the mean arrival rate (requests - 1) / (last - first arrival)"
                if any(offered.get(x) is not None for x in rates) else "")
    over = ("" if seeds is None else f"; mean +- std (population) over seeds {', '.join(str(sd) for sd in seeds)}"
            + ("; the offered rate their mean" if brackets else ""))
    return _table(labels, names, cells, 12 if seeds is None else 16,
                  title=f"by load (xN: as --rate-scale N{brackets}{over})")


def strict_json(doc) -> str:
    """`doc` as strict JSON text (NaN and inf as null, numpy values as Python's: `_clean`),
    indented one space, as every file `gpu-sched replay --out` writes."""
    return json.dumps(_clean(doc), allow_nan=False, indent=1)


def write_results(out_dir, summary: dict, requests, steps, extra: Optional[dict] = None) -> Path:
    """Write `out_dir/results.json` (strict JSON, no NaN) and return its path.

    Layout: {"summary", "config": extra or {}, "steps": per-step arrays t_s (simulated s, the
    step's end), kind, duration_s (simulated s), queue_len, running, kv_used_tokens,
    kv_pool_tokens, prefill_tokens, hit_tokens, sched_wall_s (real s), waiting, charged_s
    (simulated s) (every
    `StepRecord` field), "requests": rows
    rid, arrival_s, first_token_s, finish_s, ttft_s, e2el_s (simulated s, None if absent),
    input_len, output_len, cached_tokens, retractions, preemptions, queued_s (simulated s),
    priority, routing_key}: enough to recompute every summary metric but ITL, whose per-token times (4M numbers for the Mooncake trace) stay in the
    `RequestRecord`s that `replay()` returns.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = list(steps)
    cols = tuple(f.name for f in fields(StepRecord))
    rows = [{"rid": r.rid, "arrival_s": r.arrival_s, "first_token_s": r.first_token_s, "finish_s": r.finish_s,
             "ttft_s": None if r.first_token_s is None else r.first_token_s - r.arrival_s,
             "e2el_s": None if r.finish_s is None else r.finish_s - r.arrival_s,
             "input_len": r.input_len, "output_len": r.output_len, "cached_tokens": r.cached_tokens,
             "retractions": r.retractions, "preemptions": r.preemptions, "queued_s": r.queued_s,
             "priority": r.priority, "routing_key": r.routing_key}
            for r in requests]
    doc = {"summary": summary, "config": extra or {},
           "steps": {c: [getattr(t, c) for t in steps] for c in cols}, "requests": rows}
    path = out / "results.json"
    path.write_text(strict_json(doc))
    return path
