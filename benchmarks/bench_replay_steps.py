"""Serving-loop step times by queue size, and every scheduler call's total: one trace
replayed through the reference and the device backends, each step's `step()` time grouped by
the waiting queue's length, then each kind of call the engine makes.

`bench_queue.py` times a step on a fixed queue of n requests; a serving loop's steps are
different: most queues are small (SGLang turns lpm off above 128 waiting requests), most steps
find the batch full and return at once, and the steps that matter hash new arrivals, check
kept matches after the cache changed, and admit a few requests or none. This replays a trace
(`gpu_sched.sim.engine.replay`, the main job's engine) with each backend, `--runs` times,
backends alternating within each run so their samples span the same minutes, and prints per
power-of-two queue bucket (`sched_us_by_queue_len` of the replay's summary): the step count,
each backend's mean step time [us] (the median over runs of the run means) and the speedup
reference / backend; then the same for every scheduler call the engine makes (`step()` and
`ENGINE_CALLS`: submit, complete_prefill, decode_fits, retract_decode, decode, finish; total
milliseconds per run, median over runs), the scheduler's whole cost to a serving loop: a
device tree inserts and evicts cached prefixes at a higher cost per token than the
reference's on a CPU, which `step()` alone does not show. Steps that find nothing to do (an
empty queue, a full batch) are counted in the buckets as they are in the replay summary. Each
backend first replays the trace's first `--warmup-requests` requests, untimed (a serving
process is warm). The decision digests must agree across backends and runs (else the script
stops: the numbers would compare different schedules).

Rows are data (STYLE practice 9): one per (bucket, backend) with count, mean_us (median over
runs), runs_us (each run's mean), speedup_vs_ref; one per (call, backend) with bucket "call",
call, count, seconds (median over runs), runs_s, speedup_vs_ref; plus one row per backend for
the whole run (bucket "all": wall_s, sched_wall_s and calls_s medians, count = the steps that
admitted or preempted (the digest's), speedup_vs_ref = reference / backend for step() and
calls_speedup_vs_ref for all calls). `--out x.json` appends them to a JSON list.

Usage:
  python benchmarks/bench_replay_steps.py [--trace PATH] [--limit 2000] [--policy lpm]
      [--page-size 1] [--kv-tokens N] [--backends reference,torch] [--runs 2] [--out rows.json]
Without --trace it replays the built-in synthetic workload (`gpu-sched replay`'s default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from gpu_sched.cli import BACKENDS, config_from_args, load_trace, make_scheduler_factory
from gpu_sched.config import SchedulerConfig
from gpu_sched.sim.engine import replay
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run by path or imported: its siblings
from bench_args import at_least, existing_rows, write_rows  # noqa: E402

DEFAULT_TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None, help=f"Mooncake .jsonl or Azure .csv trace (e.g. {DEFAULT_TRACE}); "
                    "default: the built-in synthetic workload")
    ap.add_argument("--limit", type=int, default=None, help="keep the first N requests (default: all)")
    ap.add_argument("--synthetic-requests", type=int, default=400, help="requests of the synthetic workload")
    ap.add_argument("--policy", default="lpm", help="schedule policy (default lpm)")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=1_000_000, help="KV pool size [tokens]")
    ap.add_argument("--backends", default="reference,torch", help="comma-separated, the reference first")
    ap.add_argument("--runs", type=int, default=2, help="replays per backend (alternating)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the device backends")
    ap.add_argument("--warmup-requests", type=int, default=100,
                    help="an untimed replay of the first N requests per backend first (default 100)")
    ap.add_argument("--out", default=None, help="append rows to this JSON list")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",")]
    if not backends or backends[0] != "reference" or len(set(backends)) != len(backends):
        ap.error(f"--backends must start with reference and name each backend once, got {args.backends!r}")
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        ap.error(f"unknown backend {bad[0]!r} (one of {', '.join(BACKENDS)})")
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    if "triton" in backends:  # the device backends run on the CPU here: triton would be its interpreter
        ap.error("the triton backend is timed on a GPU only; this script runs the device backends on the CPU")
    at_least(args, ap.error, dict(limit=0, synthetic_requests=0, warmup_requests=0, threads=0, page_size=1, kv_tokens=1))
    args.old_rows = existing_rows(args.out, ap.error) if args.out else []  # before the run
    args.backend_list = backends
    return args


def _trace_args(args) -> argparse.Namespace:
    """The fields `gpu_sched.cli.load_trace` and `config_from_args` read, as `gpu-sched replay`
    would have them for these options."""
    from gpu_sched.cli import build_parser

    argv = ["replay", "--policy", args.policy, "--page-size", str(args.page_size),
            "--synthetic-requests", str(args.synthetic_requests)]
    if args.trace:
        argv += ["--trace", args.trace]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    return build_parser().parse_args(argv)


def run(args) -> List[dict]:
    rargs = _trace_args(args)
    trace = load_trace(rargs)
    if not trace.requests:
        raise SystemExit(f"no requests to replay in {trace.source or trace.name}")
    config: SchedulerConfig = config_from_args(rargs)
    max_len = max(r.input_len + max(r.output_len, 1) for r in trace.requests)
    factories = {b: make_scheduler_factory(b, None, 0, max_len, args.threads or None) for b in args.backend_list}
    summaries: Dict[str, List[dict]] = {b: [] for b in args.backend_list}
    # warm-up, untimed: a replay of the first requests per backend (lazy imports, first calls
    # of numpy/torch functions, allocator growth), as a serving process is warm after minutes
    head = type(trace)(**{**vars(trace), "requests": trace.requests[: args.warmup_requests]})
    for b in args.backend_list:
        f = factories[b]
        replay(head, config, kv_tokens=args.kv_tokens, make_scheduler=lambda c, kv, f=f: f(c, kv))
    for k in range(args.runs):
        for b in args.backend_list:
            f = factories[b]
            summary, _, _ = replay(trace, config, kv_tokens=args.kv_tokens, make_scheduler=lambda c, kv, f=f: f(c, kv))
            summaries[b].append(summary)
            print(f"# run {k + 1}/{args.runs} {b}: wall {summary['wall_s']:.2f} s, step() {summary['sched_wall_s']:.2f} s, "
                  f"digest {summary['digest'][:12]}", file=sys.stderr, flush=True)
    digests = {s["digest"] for ss in summaries.values() for s in ss}
    if len(digests) != 1:
        raise SystemExit(f"the backends' decisions differ (digests {sorted(d[:12] for d in digests)}): not compared")
    meta = {"trace": trace.name, "requests": len(trace.requests), "policy": config.schedule_policy,
            "page_size": config.page_size, "kv_tokens": args.kv_tokens, "runs": args.runs,
            "digest": digests.pop()[:12], "run_id": time.strftime("%Y%m%dT%H%M%S"), "command": " ".join(sys.argv)}
    rows = []
    ref = args.backend_list[0]
    buckets = summaries[ref][0]["sched_us_by_queue_len"]
    for label, b0 in buckets.items():
        ref_mean = statistics.median(s["sched_us_by_queue_len"][label]["mean_us"] for s in summaries[ref])
        for b in args.backend_list:
            runs_us = [s["sched_us_by_queue_len"][label]["mean_us"] for s in summaries[b]]
            mean = statistics.median(runs_us)
            rows.append(dict(meta, bucket=label, lo=b0["lo"], hi=b0["hi"], count=b0["count"], backend=b,
                             mean_us=mean, runs_us=runs_us, speedup_vs_ref=ref_mean / mean if mean else None))
    ref_calls = {name: statistics.median(s["sched_calls_s"][name] for s in summaries[ref])
                 for name in summaries[ref][0]["sched_calls_s"]}
    for name, ref_s in ref_calls.items():  # the engine's every call, step() included: the whole cost
        for b in args.backend_list:
            runs_s = [s["sched_calls_s"][name] for s in summaries[b]]
            secs = statistics.median(runs_s)
            rows.append(dict(meta, bucket="call", call=name, backend=b, count=summaries[b][0]["sched_calls_n"][name],
                             seconds=secs, runs_s=runs_s, speedup_vs_ref=ref_s / secs if secs else None))
    # each run's totals (the reference's run k ran next to ours: their ratio is that run's), medians
    sched_runs = {b: [s["sched_wall_s"] for s in summaries[b]] for b in args.backend_list}
    calls_runs = {b: [sum(s["sched_calls_s"].values()) for s in summaries[b]] for b in args.backend_list}
    ref_sched, ref_all = statistics.median(sched_runs[ref]), statistics.median(calls_runs[ref])
    for b in args.backend_list:
        sched, calls_s = statistics.median(sched_runs[b]), statistics.median(calls_runs[b])
        rows.append(dict(meta, bucket="all", backend=b, count=summaries[b][0]["digest_steps"],
                         wall_s=statistics.median(s["wall_s"] for s in summaries[b]), sched_wall_s=sched,
                         calls_s=calls_s, speedup_vs_ref=ref_sched / sched if sched else None,
                         calls_speedup_vs_ref=ref_all / calls_s if calls_s else None,
                         sched_runs_s=sched_runs[b], calls_runs_s=calls_runs[b],
                         calls_speedup_runs=[r / c if c else None for r, c in zip(calls_runs[ref], calls_runs[b])]))
    return rows


def print_table(rows: List[dict], backends: List[str]) -> None:
    by = {(r["bucket"], r["backend"]): r for r in rows}
    labels = list(dict.fromkeys(r["bucket"] for r in rows if r["bucket"] not in ("all", "call")))
    head = f"{'queue':>11} {'steps':>6}" + "".join(f" {b + ' us':>14}" for b in backends)
    head += "".join(f" {'x ' + b:>10}" for b in backends[1:])
    print(head)
    print("-" * len(head))
    for label in labels:
        line = f"{label:>11} {by[(label, backends[0])]['count']:>6}"
        line += "".join(f" {by[(label, b)]['mean_us']:>14.1f}" for b in backends)
        line += "".join(f" {_ratio(by[(label, b)]['speedup_vs_ref'])}" for b in backends[1:])
        print(line)
    calls = {(r["call"], r["backend"]): r for r in rows if r["bucket"] == "call"}
    head = f"{'call':>16} {'calls':>7}" + "".join(f" {b + ' ms':>14}" for b in backends)
    head += "".join(f" {'x ' + b:>10}" for b in backends[1:])
    print(head)
    print("-" * len(head))
    for name in dict.fromkeys(c for c, _ in calls):
        line = f"{name:>16} {calls[(name, backends[0])]['count']:>7}"
        line += "".join(f" {calls[(name, b)]['seconds'] * 1e3:>14.1f}" for b in backends)
        line += "".join(f" {_ratio(calls[(name, b)]['speedup_vs_ref'])}" for b in backends[1:])
        print(line)
    for b in backends:
        r = by[("all", b)]
        print(f"# {b}: wall {r['wall_s'] * 1e3:.1f} ms, step() {r['sched_wall_s'] * 1e3:.1f} ms"
              + (f" (speedup {_ratio(r['speedup_vs_ref']).strip()})" if b != backends[0] else "")
              + f", all scheduler calls {r['calls_s'] * 1e3:.1f} ms"
              + (f" (speedup {_ratio(r['calls_speedup_vs_ref']).strip()})" if b != backends[0] else ""))


def _ratio(x: Optional[float]) -> str:
    return f"{x:>9.2f}x" if x is not None else f"{'n/a':>10}"


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(f"# {rows[0]['trace']}, {rows[0]['requests']} requests, {rows[0]['policy']}, page size "
          f"{rows[0]['page_size']}, {args.runs} runs per backend, digest {rows[0]['digest']}")
    print_table(rows, args.backend_list)
    if args.out:
        write_rows(args.out, args.old_rows + rows)
        print(f"# {len(rows)} rows appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
