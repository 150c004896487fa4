"""What the scheduler's own time costs a served trace: the same replay with each backend, each
`--scheduler-time` mode and each preset, one after the other, in one table.

`gpu-sched replay --scheduler-time blocking|overlap` charges the scheduler's real call time to
the simulated engine's clock (`gpu_sched.sim.engine.replay`): blocking, all of it before each
forward (SGLang's normal event loop); overlap, what outlasts the previous forward (its overlap
loop); free, nothing (decisions only, the default). This runs every (preset, backend, mode)
combination through the main job's own command (`gpu_sched.cli.main`, in process, `--out` to
a scratch folder) and prints, per run: requests per second, prefix-cache hit rate, mean and
p99 TTFT [s], the scheduler calls' real time [s], the simulated time charged for them [s]
and the decision digest. README.md's Results ("What SGLang's lpm fallback and the
scheduler's own time cost") tables the equivalent `gpu-sched replay` runs over the whole
Mooncake trace; this script's own run over it is in `results/bench_sched_time_cpu.json`.

Charged runs depend on this machine's speed and load: run with the other cores idle, and
compare runs made one after the other. `--check` is not offered: its walks between steps slow
the scheduler's later calls (README).

Rows are data (STYLE practice 9): one per run with run_id, commit, trace, limit, policy,
preset, backend, scheduler_time, req_per_s, hit_rate (fraction), mean_ttft_s, p99_ttft_s,
mean_queue_len, mean_sched_us, calls_s, charged_s, digest. `--out x.json` appends them to a
JSON list.

Usage:
  python benchmarks/bench_sched_time.py [--trace PATH | --synthetic-requests N] [--limit N] [--policy lpm]
      [--presets default,sglang] [--backends reference,torch] [--modes free,blocking,overlap]
      [--out rows.json]
Without --trace it replays the built-in synthetic workload.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_sched.cli import BACKENDS, _commit, main as cli_main  # noqa: E402
from gpu_sched.sim.engine import SCHEDULER_TIME_MODES  # noqa: E402
from bench_args import existing_rows, write_rows  # noqa: E402

PRESETS = ("default", "sglang")


def _names(raw: str, allowed, flag: str) -> list:
    names = [x.strip() for x in raw.split(",")]
    if not names or len(set(names)) != len(names) or not all(x in allowed for x in names):
        raise SystemExit(f"bench_sched_time: {flag} takes distinct names of {', '.join(allowed)}, got {raw!r}")
    return names


def one_run(args, preset: str, backend: str, mode: str, scratch: Path) -> dict:
    """One replay through `gpu-sched replay` (in process, its printout swallowed); its row."""
    out = scratch / f"{preset}-{backend}-{mode}"
    argv = ["replay", "--no-progress", "--policy", args.policy, "--preset", preset, "--backend", backend,
            "--scheduler-time", mode, "--out", str(out)]
    if args.trace:
        argv += ["--trace", args.trace]
    else:
        argv += ["--synthetic-requests", str(args.synthetic_requests)]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(argv)
    if rc != 0:
        raise SystemExit(f"bench_sched_time: gpu-sched {' '.join(argv)} exited {rc}")
    s = json.loads((out / "results.json").read_text())["summary"]
    return {"trace": args.trace or f"synthetic ({args.synthetic_requests} requests)", "limit": args.limit, "policy": args.policy, "preset": preset,
            "backend": backend, "scheduler_time": mode, "req_per_s": s["request_throughput"],
            "hit_rate": s["prefix_cache_hit_rate"], "mean_ttft_s": s["mean_ttft_ms"] / 1e3,
            "p99_ttft_s": s["p99_ttft_ms"] / 1e3, "mean_queue_len": s["mean_queue_len"],
            "mean_sched_us": s["mean_sched_us"], "calls_s": sum(s["sched_calls_s"].values()),
            "charged_s": s["charged_sched_s"], "digest": s["digest"]}


def table(rows) -> str:
    head = ("preset", "backend", "scheduler time", "req/s", "hit %", "mean TTFT s", "p99 TTFT s", "calls s",
            "charged s", "digest")
    # 5 significant digits: a light synthetic load's TTFTs are tens of ms, a loaded trace's minutes
    cells = [(r["preset"], r["backend"], r["scheduler_time"], f"{r['req_per_s']:.4g}", f"{100 * r['hit_rate']:.2f}",
              f"{r['mean_ttft_s']:.5g}", f"{r['p99_ttft_s']:.5g}", f"{r['calls_s']:.4g}", f"{r['charged_s']:.4g}",
              r["digest"][:12]) for r in rows]
    w = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    line = lambda c: "  ".join(x.rjust(n) for x, n in zip(c, w))  # noqa: E731
    return "\n".join([line(head), "  ".join("-" * n for n in w), *map(line, cells)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="Mooncake .jsonl or Azure .csv trace (default: synthetic)")
    p.add_argument("--limit", type=int, default=None, help="keep the trace's first N requests")
    p.add_argument("--synthetic-requests", type=int, default=400, help="requests of the synthetic workload")
    p.add_argument("--policy", default="lpm")
    p.add_argument("--presets", default="default,sglang", help=f"comma-separated: {', '.join(PRESETS)}")
    p.add_argument("--backends", default="reference,torch", help=f"comma-separated: {', '.join(BACKENDS)}")
    p.add_argument("--modes", default="free,blocking,overlap",
                   help=f"--scheduler-time modes, comma-separated: {', '.join(SCHEDULER_TIME_MODES)}")
    p.add_argument("--out", default=None, help="append the rows to this JSON list")
    args = p.parse_args(argv)
    presets = _names(args.presets, PRESETS, "--presets")
    backends = _names(args.backends, BACKENDS, "--backends")
    modes = _names(args.modes, SCHEDULER_TIME_MODES, "--modes")
    old = existing_rows(args.out, p.error) if args.out else []  # before the runs
    run_id, commit = time.strftime("%Y%m%dT%H%M%S"), _commit()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for preset, backend, mode in itertools.product(presets, backends, modes):
            t0 = time.perf_counter()
            row = one_run(args, preset, backend, mode, Path(scratch))
            rows.append(dict(row, run_id=run_id, commit=commit))
            print(f"{preset} {backend} {mode}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        write_rows(args.out, old + rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
