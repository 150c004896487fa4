"""What a cold CPU cache costs the host path: the same work timed warm and right after other work.

bench_queue.py interleaves the reference's and our calls, so each of our timed calls runs right
after a reference call, as a serving loop's scheduler step runs right after other work (the
model's launch code, the engine's bookkeeping). On the CPU that makes our step slower than the
same step repeated (session 35: 0.45 ms alone, 1.05-1.24 ms after a reference step, lpm at 10k
with real prompts). This script measures where that comes from, in two experiments:

- `calls`: one fixed sequence of 9 distinct numpy calls (add, multiply, minimum, remainder, take,
  cumsum, compare, flatnonzero, max) on int64 arrays of n elements, timed warm (right after the
  same sequence) and cold (right after writing a `--sweep-mib` buffer); `extra_us_per_call` is
  (cold - warm) / 9. If that extra is about the same for 10 elements as for 10,000, a cold call
  costs a fixed amount (numpy's and Python's code and metadata brought back into the cache), not
  an amount per byte of data.
- `step`: GpuScheduler's whole `step()` on bench_queue's workload (undone after each call by
  `bench_queue.Restorer`), timed right after the reference's step on the same queue
  (`after-reference`), after the buffer write (`after-write`), after a sleep (`after-sleep`) and
  after busy waits that touch almost no memory (`after-spin-<ms>ms`, `--spin-ms`), each in its
  own rotation with `warm` (right after our own step): the two conditions take turns
  call by call, so the machine's drift hits them alike. Separate rotations, because the
  reference's step slows our steps for longer than one step: with it in the same rotation, our
  step after a buffer write took 1.07 ms instead of 0.62 ms (lpm, 10k, real prompts).

Rows (printed; `--out` appends them to a JSON list): experiment, condition, n, median_us, p90_us,
reps, and for `calls` extra_us_per_call, for `step` the rotation it was timed in. Timing only: no plan is checked here (bench_queue.py
checks plans).

Usage:
    python benchmarks/bench_cold.py [--policy lpm] [--n 10000] [--max-prompt-len 2048 | 0 for real]
        [--queue mooncake|synthetic] [--trace PATH] [--warm 2000] [--distinct 0]
        [--reps 15] [--sweep-mib 64] [--sleep-ms 60] [--spin-ms 1,10,60] [--skip-step] [--out rows.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_queue as bq  # noqa: E402
from bench_args import existing_rows, write_rows  # noqa: E402

from gpu_sched.config import SchedulerConfig  # noqa: E402

CALLS_SIZES = (10, 1000, 10000)
N_CALLS = 9  # numpy calls in `call_sequence`


def call_sequence(n: int) -> Callable[[], int]:
    """A function making N_CALLS distinct numpy calls on int64 arrays of n elements."""
    x = np.arange(n, dtype=np.int64)
    y = x[::-1].copy()

    def run() -> int:
        a = x + y
        b = a * 3
        c = np.minimum(b, x)
        d = c.take(y % n)
        e = np.cumsum(d)
        g = e > 5
        h = np.flatnonzero(g)
        return h.size + int(e.max())

    return run


def spin(seconds: float) -> Callable[[], None]:
    """A busy wait of `seconds` that touches almost no memory (a clock read in a loop)."""

    def run() -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            pass

    return run


def timed_after(fn: Callable, pres: Dict[str, Callable], reps: int, undo: Callable = None) -> Dict[str, List[float]]:
    """Seconds of fn() right after each pre call, conditions taking turns; `undo` (untimed) after
    every fn() call."""
    out: Dict[str, List[float]] = {k: [] for k in pres}
    for _ in range(reps):
        for k, pre in pres.items():
            pre()
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
            if undo is not None:
                undo()
    return out


def row(experiment: str, condition: str, n: int, times: List[float], **extra) -> dict:
    return dict(experiment=experiment, condition=condition, n=n, median_us=statistics.median(times) * 1e6,
                p90_us=bq.p90(times) * 1e6, reps=len(times), **extra)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="lpm", choices=sorted(bq.POLICIES))
    ap.add_argument("--n", type=int, default=10000, help="waiting requests of the step experiment")
    ap.add_argument("--queue", choices=("mooncake", "synthetic"), default="mooncake")
    ap.add_argument("--trace", default=bq.DEFAULT_TRACE, help="Mooncake JSONL trace")
    ap.add_argument("--warm", type=int, default=2000, help="leading trace requests whose prompts seed the cache")
    ap.add_argument("--max-prompt-len", type=int, default=2048, help="cap prompts [tokens]; 0: real lengths")
    ap.add_argument("--distinct", type=int, default=0, help="distinct queue prompts (0: all the trace has)")
    ap.add_argument("--reps", type=int, default=15, help="timed calls per condition")
    ap.add_argument("--sweep-mib", type=int, default=64, help="buffer written before an after-write call [MiB]")
    ap.add_argument("--sleep-ms", type=float, default=60.0, help="sleep before an after-sleep call [ms]")
    ap.add_argument("--spin-ms", default="1,10,60",
                    help="comma-separated busy waits [ms], each an after-spin condition of the step experiment")
    ap.add_argument("--skip-step", action="store_true", help="only the calls experiment")
    ap.add_argument("--out", default=None, help="append rows to this JSON list")
    args = ap.parse_args(argv)
    for name in ("n", "reps", "sweep_mib"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompt_len < 0 or args.sleep_ms < 0:
        ap.error("--max-prompt-len and --sleep-ms must be >= 0")
    try:
        args.spin_ms = [float(x) for x in args.spin_ms.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--spin-ms must be comma-separated numbers, got {args.spin_ms!r}")
    if any(not 0 <= x < 10_000 for x in args.spin_ms):
        ap.error(f"--spin-ms values must be in [0, 10000), got {args.spin_ms}")
    args.old_rows = existing_rows(args.out, ap.error) if args.out else []  # before the run
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    sweep = np.ones((args.sweep_mib << 20) // 8, dtype=np.int64)

    def write_sweep():
        sweep.__iadd__(1)

    rows = []
    for n in CALLS_SIZES:
        seq = call_sequence(n)
        t = timed_after(seq, {"warm": seq, "after-write": write_sweep}, args.reps)
        warm, cold = statistics.median(t["warm"]), statistics.median(t["after-write"])
        for k, v in t.items():
            rows.append(row("calls", k, n, v, extra_us_per_call=(cold - warm) * 1e6 / N_CALLS))

    if not args.skip_step:
        ns = argparse.Namespace(seed=0, queue=args.queue, trace=args.trace, warm=args.warm, distinct=args.distinct,
                                max_prompt_len=args.max_prompt_len or None, routing_keys=32, running=64,
                                synthetic_groups=16)
        wl = bq.build_workload(ns, args.n)
        pool = bq.kv_pool_size(wl, ns.running, 1_000_000)
        fns = {}
        for backend in ("reference", "torch"):
            s, _ = bq.make_scheduler(backend, "cpu", wl, pool)
            bq.set_queue(s, wl.queue[: args.n])
            s.config = SchedulerConfig(**bq.POLICIES[args.policy])
            fns[backend] = bq.stage_fns(s, "step", wl.max_len)
        ours, undo = fns["torch"]
        ref, ref_undo = fns["reference"]

        def ref_step():
            ref()
            ref_undo()

        def own_step():
            ours()
            undo()

        for _ in range(3):  # warm-ups: first matches, hashing, allocations
            ref_step()
            own_step()
        others = {"after-reference": ref_step, "after-write": write_sweep,
                  "after-sleep": lambda: time.sleep(args.sleep_ms / 1e3)}
        for ms in args.spin_ms:
            others[f"after-spin-{ms:g}ms"] = spin(ms / 1e3)
        for name, pre in others.items():  # each in its own rotation with `warm` (see the docstring)
            t = timed_after(ours, {"warm": own_step, name: pre}, args.reps, undo)
            for k, v in t.items():
                rows.append(row("step", k, args.n, v, policy=args.policy, max_prompt_len=args.max_prompt_len,
                                rotation=name))

    print(f"{'experiment':10s} {'condition':16s} {'rotation':16s} {'n':>7s} {'median us':>10s} {'p90 us':>10s} "
          f"{'extra us/call':>14s}")
    for r in rows:
        extra = f"{r['extra_us_per_call']:14.2f}" if "extra_us_per_call" in r else ""
        print(f"{r['experiment']:10s} {r['condition']:16s} {r.get('rotation', ''):16s} {r['n']:7d} "
              f"{r['median_us']:10.1f} {r['p90_us']:10.1f} {extra}")
    if args.out:
        out = Path(args.out)
        old = args.old_rows
        meta = dict(run=time.strftime("%Y%m%dT%H%M%S"), sweep_mib=args.sweep_mib, sleep_ms=args.sleep_ms,
                    command="python benchmarks/bench_cold.py " + " ".join(sys.argv[1:] if argv is None else argv))
        write_rows(out, old + [dict(r, **meta) for r in rows])
        print(f"# {len(rows)} rows appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
