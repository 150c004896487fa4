"""Where one `GpuScheduler.step` spends its time: phases, host syncs, torch ops.

bench_queue.py says how long a step takes; this says why, on the machine it runs on, so that a
session with a GPU learns in seconds what its host overhead is made of (on the H200 the whole
`step()` through the recorded graph took 10-100x the graph replay itself).

For one policy, queue size and backend it builds bench_queue's workload, takes a few untimed
steps (each undone, as in bench_queue), then reports:

- phases: inclusive wall time of the scheduler's parts (ordering, the recorded step's load /
  compute-or-replay / read-back, admission, the tree's splits and stamps, locks, plan lists),
  each bracketed by a device synchronize on CUDA so that time lands where it is spent;
- host syncs: on CUDA, `torch.cuda.set_sync_debug_mode("warn")` warnings by call site; on the
  CPU, the calls that would sync on CUDA (`item`, `tolist`, `cpu`, `nonzero`, boolean-mask
  indexing, `unique`, `bincount`, reading a tensor as a Python number/bool), by call site;
- torch ops: `torch.profiler` table of the step's operators by self CPU time (and CUDA time);
- graph recordings during the timed steps (a recorded step records again whenever a tensor it
  reads was reallocated; more than 0 here means every step pays a capture);
- with `--count-host-work`: the Python lines, Python calls and C calls (builtins, numpy and torch
  entry points) one step runs on the host, by function, for GpuScheduler and for the reference
  scheduler on the same workload (queue, running batch, warm cache; `sys.settrace` / `sys.setprofile`): counts, not times, so they are
  the same on any machine and at any load, where a timing on a shared CPU moves by +-30%.

Usage:
    python benchmarks/profile_step.py [--policy lpm] [--n 4096] [--backend torch|triton]
        [--device cpu|cuda] [--mode eager|graph] [--steps 5] [--count-host-work] [--out profile.json]
Rows/fields are data: `--out` writes phases, syncs, ops and graph recordings as JSON.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
import traceback
import warnings
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_queue as bq  # noqa: E402
from bench_args import at_least  # noqa: E402

from gpu_sched import radix  # noqa: E402
from gpu_sched.config import SchedulerConfig  # noqa: E402
from gpu_sched.reference.scheduler import ReferenceScheduler  # noqa: E402
from gpu_sched.scheduler import GpuScheduler  # noqa: E402
from gpu_sched.step import StepGraph  # noqa: E402

#: (owner, method, phase label): inclusive times; nested phases are also counted in their parents
PHASES = (
    (ReferenceScheduler, "step", "step"),
    (GpuScheduler, "_order", "order"),
    (GpuScheduler, "_full_match", "order.full_match"),
    (GpuScheduler, "_head_groups", "order.head_groups"),
    (StepGraph, "load", "graph.load"),
    (StepGraph, "compute", "graph.compute"),
    (StepGraph, "_record", "graph.record"),
    (StepGraph, "_read", "graph.read"),
    (GpuScheduler, "_admission_loop", "admission"),
    (GpuScheduler, "_static_admission", "admission.static"),
    (GpuScheduler, "_admit_run", "admission.admit_run"),
    (radix.FlatRadixTree, "_apply", "tree.apply (splits+stamps)"),
    (radix.FlatRadixTree, "lock", "tree.lock"),
    (GpuScheduler, "_unadmitted", "unadmitted"),
    (ReferenceScheduler, "_close", "close (plan lists)"),
)

#: calls that read device values on the host (would sync on CUDA)
_SYNC_NAMES = {"item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "unique", "_unique2",
               "unique_consecutive", "bincount", "__bool__", "__int__", "__index__", "__float__"}


def _site(skip_self: int = 1) -> str:
    """The innermost gpu_sched frame of the current stack as 'file:line function'."""
    for f in reversed(traceback.extract_stack()[:-skip_self]):
        if "gpu_sched" in f.filename and os.sep + "benchmarks" + os.sep not in f.filename:
            return f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
    return "?"


class SyncCounter(TorchFunctionMode):
    """Counts, by call site, the torch calls that read device values back (CPU proxy of CUDA
    syncs): a boolean-mask index, `repeat_interleave` without output_size and the names above."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        hit = name in _SYNC_NAMES
        if name == "__getitem__" and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            hit = True
        if hit:
            self.sites[f"{name} @ {_site(2)}"] += 1
        return func(*args, **kwargs)


def count_host_work(fn: Callable[[], object], top: int = 25) -> dict:
    """What one call of fn runs on the host, counted: Python lines (`sys.settrace` line
    events), Python calls and C calls (`sys.setprofile` c_call events: builtins and the entry
    points of numpy and torch), in all and by function ("file.py:function"; C calls by the
    Python function that made them). Returns dict(lines, py_calls, c_calls, by_function=[dict(
    function, lines, py_calls, c_calls)] for the `top` functions with the most lines)."""
    lines, calls, ccalls = collections.Counter(), collections.Counter(), collections.Counter()

    def name(frame) -> str:
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"

    def trace(frame, event, arg):
        if event == "call":
            calls[name(frame)] += 1
        elif event == "line":
            lines[name(frame)] += 1
        return trace

    own = sys._getframe().f_code  # its own call of sys.setprofile is not counted

    def profile(frame, event, arg):
        if event == "c_call" and frame.f_code is not own:
            ccalls[name(frame)] += 1

    old_trace, old_profile = sys.gettrace(), sys.getprofile()
    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(old_profile)
        sys.settrace(old_trace)
    funcs = set(lines) | set(calls) | set(ccalls)
    ranked = sorted(funcs, key=lambda f: (-lines[f], -calls[f], -ccalls[f], f))[:top]
    return dict(lines=sum(lines.values()), py_calls=sum(calls.values()), c_calls=sum(ccalls.values()),
                by_function=[dict(function=f, lines=lines[f], py_calls=calls[f], c_calls=ccalls[f]) for f in ranked])


def _wrap_phases(acc: dict, sync):
    """Patch PHASES with timers; returns the undo."""
    saved = []
    for owner, name, label in PHASES:
        f = getattr(owner, name)
        saved.append((owner, name, f))

        @functools.wraps(f)
        def timed(*a, __f=f, __label=label, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return __f(*a, **k)
            finally:
                sync()
                acc[__label] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def undo():
        for owner, name, f in saved:
            setattr(owner, name, f)

    return undo


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="lpm", choices=sorted(bq.POLICIES))
    ap.add_argument("--n", type=int, default=4096, help="waiting requests")
    ap.add_argument("--backend", default="torch", choices=("torch", "triton"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", default="eager", choices=("eager", "graph"),
                    help="eager step, or step() through the recorded step (StepGraph)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 2 untimed ones)")
    ap.add_argument("--queue", choices=("mooncake", "synthetic"), default="mooncake")
    ap.add_argument("--trace", default=None, help=f"Mooncake trace (default {bq.DEFAULT_TRACE}; synthetic if absent)")
    ap.add_argument("--warm", type=int, default=500)
    ap.add_argument("--max-prompt-len", type=int, default=2048)
    ap.add_argument("--top", type=int, default=25, help="rows of the op table (and of --count-host-work's tables)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave as is)")
    ap.add_argument("--count-host-work", action="store_true",
                    help="also count the Python lines, Python calls and C calls of one step, ours and the "
                         "reference scheduler's on the same workload (counts: the same at any machine load)")
    ap.add_argument("--out", default=None, help="write the report as JSON")
    args = ap.parse_args(argv)
    at_least(args, ap.error, dict(n=1, steps=1, warm=0, max_prompt_len=1, top=0, threads=0))
    if args.trace is not None and not os.path.isfile(args.trace):  # only the default may be absent
        ap.error(f"--trace {args.trace}: no such file")
    args.trace = args.trace or bq.DEFAULT_TRACE
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.backend == "triton" and args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("the triton backend on the CPU needs TRITON_INTERPRET=1 (and then times the interpreter)")
    if args.queue == "mooncake" and not os.path.exists(args.trace):
        print(f"# no trace at {args.trace}: synthetic queue", flush=True)
        args.queue = "synthetic"
    wargs = argparse.Namespace(seed=0, queue=args.queue, trace=args.trace, warm=args.warm, distinct=0,
                               max_prompt_len=args.max_prompt_len, routing_keys=32, running=64,
                               synthetic_groups=16)
    wl = bq.build_workload(wargs, args.n)
    pool = bq.kv_pool_size(wl, 64, 1_000_000)  # the reference of --count-host-work gets the same
    s, cached = bq.make_scheduler(args.backend, args.device, wl, pool=pool)
    s.config = SchedulerConfig(**bq.POLICIES[args.policy])
    bq.set_queue(s, wl.queue[: args.n])
    stage = "gstep" if args.mode == "graph" else "step"
    fns = bq.stage_fns(s, stage, wl.max_len)
    if fns is None:
        raise SystemExit(f"policy {args.policy} has no recorded step (graph mode): use --mode eager")
    fn, restore = fns
    cuda = s.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(s.device)) if cuda else (lambda: None)

    def one():
        fn()
        sync()
        restore()

    for _ in range(2):  # kernels compiled, graph recorded, matches hinted
        one()
    g = s._graph
    captures0 = g.captures if g is not None else 0

    # 1. plain wall time per step (no instrumentation)
    plain = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        fn()
        sync()
        plain.append(time.perf_counter() - t0)
        restore()

    # 2. phases
    acc = collections.defaultdict(float)
    undo = _wrap_phases(acc, sync)
    try:
        for _ in range(args.steps):
            one()
    finally:
        undo()
    phases = {k: v / args.steps for k, v in acc.items()}

    # 3. host syncs of one step
    syncs = collections.Counter()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
                sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        restore()
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs[f"{os.path.basename(w.filename)}:{w.lineno}"] += 1
        sync_kind = "cuda sync debug mode"
    else:
        counter = SyncCounter()
        with counter:
            fn()
        restore()
        syncs = counter.sites
        sync_kind = "cpu proxy (reads of tensor values)"

    # 4. operator table of one step
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync()
    restore()
    captures = (g.captures if g is not None else 0) - captures0

    # 5. host work of one step, counted (ours, then the reference's on the same workload)
    work = None
    if args.count_host_work:
        work = {"gpu_sched": count_host_work(fn, args.top)}
        restore()
        ref, _ = bq.make_scheduler("reference", "cpu", wl, pool=pool)
        ref.config = s.config
        bq.set_queue(ref, wl.queue[: args.n])
        rfn, rrestore = bq.stage_fns(ref, "step", wl.max_len)
        rfn()  # the same untimed first step as ours had
        rrestore()
        work["reference"] = count_host_work(rfn, args.top)
        rrestore()
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    n_ops = sum(e.count for e in events if e.key.startswith("aten::"))

    med = sorted(plain)[len(plain) // 2]
    print(f"# {args.policy} n={args.n} backend={args.backend} device={s.device} mode={args.mode}: "
          f"step median {med * 1e3:.3f} ms over {args.steps} (plain), graph recordings during the "
          f"timed steps: {captures}, aten calls per step: {n_ops}")
    print("\n## phases (inclusive ms per step; nested ones also count in their parents)")
    for label, v in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"{v * 1e3:10.3f}  {label}")
    print(f"\n## host syncs in one step: {sum(syncs.values())} ({sync_kind})")
    for site, c in syncs.most_common(30):
        print(f"{c:6d}  {site}")
    print(f"\n## torch ops of one step (by {sort_by})")
    print(events.table(sort_by=sort_by, row_limit=args.top, max_name_column_width=40))
    if work is not None:
        print("\n## host work of one step, counted (Python lines / Python calls / C calls)")
        for who, w in work.items():
            print(f"{who}: {w['lines']} lines, {w['py_calls']} Python calls, {w['c_calls']} C calls")
            for row in w["by_function"]:
                print(f"{row['lines']:8d} {row['py_calls']:6d} {row['c_calls']:6d}  {row['function']}")
    if args.out:
        report = dict(policy=args.policy, n=args.n, backend=args.backend, device=str(s.device), mode=args.mode,
                      steps=args.steps, step_median_s=med, step_times_s=plain, graph_recordings=captures,
                      aten_calls=n_ops, phases_s=phases, syncs=dict(syncs), sync_kind=sync_kind,
                      ops=[dict(name=e.key, count=e.count, self_cpu_us=e.self_cpu_time_total,
                                self_device_us=getattr(e, "self_device_time_total", 0.0))
                           for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: 4 * args.top]],
                      host_work=work, torch=torch.__version__,
                      gpu=torch.cuda.get_device_name() if cuda else None)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
