"""How many kernels the recorded scheduling step launches: torch ops and Triton launches.

On a GPU the recorded step (`GpuScheduler.capture()`, one CUDA graph) costs about a few
microseconds per graph node whatever its size at small queues: the H200 run of 2026-11-30 put
its floor at about 1 ms for some 550 nodes. This counts the nodes on any machine, the CPU
included, by running `StepGraph.compute()` once (on the CPU with the triton backend, Triton's
interpreter runs the kernels) under a dispatch mode that counts the aten ops that launch a
kernel (views, allocations and reshapes excluded; a CPU scalar wrapped for `torch.where` too)
and a hook that counts Triton launches. A torch op can be several kernels on a GPU (a
`torch.sort` is a few radix passes); a Triton launch is one.

For each policy it builds bench_queue's workload (n waiting requests, the Mooncake queue or
synthetic shared-prefix groups), records the step and prints: policy, n, backend, torch ops,
Triton launches, and with `--by-site` where the torch ops come from (file:function, or
file:function:line op with `--by-line`).

Usage:
    python benchmarks/count_launches.py [--policies fcfs,lpm,...] [--n 256]
        [--backend triton|torch] [--queue mooncake|synthetic] [--by-site | --by-line] [--out rows.json]
Without CUDA it sets TRITON_INTERPRET=1 itself (before triton is imported). Rows are data
(STYLE practice 9): `--out` appends one row per policy to a JSON list.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback

if "torch" not in sys.modules:  # before triton is imported: the interpreter on a machine without CUDA
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_queue as bq  # noqa: E402
from bench_args import at_least, existing_rows, write_rows  # noqa: E402

from gpu_sched.config import SchedulerConfig  # noqa: E402

#: aten ops that launch no kernel: views, metadata, allocations (a graph's memory is allocated
#: when it is recorded), and the wrapping of a Python scalar for an op's other argument
NO_KERNEL = {"view", "as_strided", "slice", "select", "unbind", "unsqueeze", "squeeze", "expand", "detach", "alias",
             "t", "permute", "transpose", "_reshape_alias", "_unsafe_view", "split", "split_with_sizes", "chunk",
             "empty", "empty_like", "new_empty", "empty_strided", "lift_fresh", "set_", "resize_", "as_strided_",
             "result_type", "is_nonzero", "sym_size", "sym_numel", "sym_stride", "scalar_tensor"}


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops by name and by call site, and Triton launches by kernel
    (the aten ops a Triton launch makes inside the interpreter are not counted)."""

    def __init__(self, site: str = "function"):
        super().__init__()
        self.ops, self.sites, self.triton = collections.Counter(), collections.Counter(), collections.Counter()
        self.site, self._in_triton = site, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL and not self._in_triton:
            self.ops[name] += 1
            if self.site != "none":
                self.sites[self._where(name)] += 1
        return func(*args, **(kwargs or {}))

    def _where(self, op: str) -> str:
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "gpu_sched" in f.filename or os.sep + "kernels" + os.sep in f.filename]
        if not frames:
            return "?"
        f = frames[-1]
        at = f"{os.path.basename(f.filename)}:{f.name}"
        return f"{at}:{f.lineno} {op}" if self.site == "line" else at

    def hook_triton(self):
        """Count launches through the JIT / interpreter entry point; returns the undo."""
        import triton.runtime.jit as jit

        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # pragma: no cover
            InterpretedFunction = None
        undo = []
        for cls in (jit.JITFunction, InterpretedFunction):
            if cls is None or not hasattr(cls, "run"):
                continue
            orig = cls.run

            def run(fn_self, *a, __orig=orig, **k):
                name = getattr(getattr(fn_self, "fn", None), "__name__", None) or getattr(fn_self, "__name__", "?")
                self.triton[name] += 1
                self._in_triton = True
                try:
                    return __orig(fn_self, *a, **k)
                finally:
                    self._in_triton = False

            cls.run = run
            undo.append((cls, orig))

        def restore():
            for cls, orig in undo:
                cls.run = orig

        return restore


def count(policy: str, n: int, backend: str, queue: str, trace: str, warm: int, site: str = "function") -> dict:
    """Build the workload, record the step for `policy`, count one `compute()`."""
    wargs = argparse.Namespace(seed=0, queue=queue, trace=trace, warm=warm, distinct=0, max_prompt_len=2048,
                               routing_keys=32, running=64, synthetic_groups=16)
    wl = bq.build_workload(wargs, n)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    s, _ = bq.make_scheduler(backend, device, wl, pool=bq.kv_pool_size(wl, 64, 1_000_000))
    s.config = SchedulerConfig(**bq.POLICIES[policy])
    bq.set_queue(s, wl.queue[:n])
    if bq.stage_fns(s, "graph", wl.max_len) is None:  # records the step, loads its inputs
        raise SystemExit(f"policy {policy} has no recorded step")
    g = s._graph
    g.compute()  # compiled kernels and cached tables before counting
    c = LaunchCounter(site)
    restore = c.hook_triton()
    t0 = time.perf_counter()
    try:
        with c:
            g.compute()
    finally:
        restore()
    return dict(policy=policy, n=n, backend=backend, device=device, queue=queue, torch_ops=sum(c.ops.values()),
                triton_launches=sum(c.triton.values()), ops=dict(c.ops.most_common()),
                triton=dict(c.triton.most_common()), sites=dict(c.sites.most_common()),
                seconds=time.perf_counter() - t0, run=time.strftime("%Y%m%dT%H%M%S"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="fcfs,lof,routing-key,lpm,dfs-weight",
                    help="comma-separated, from: " + ", ".join(sorted(bq.POLICIES)))
    ap.add_argument("--n", type=int, default=256, help="waiting requests")
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--queue", default="mooncake", choices=("mooncake", "synthetic"))
    ap.add_argument("--trace", default=None, help=f"Mooncake trace (default {bq.DEFAULT_TRACE}; synthetic if absent)")
    ap.add_argument("--warm", type=int, default=500, help="trace requests cached before the queue")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--by-site", action="store_true", help="torch ops by file:function")
    g.add_argument("--by-line", action="store_true", help="torch ops by file:function:line and op")
    ap.add_argument("--out", default=None, help="append the rows to this JSON list")
    args = ap.parse_args(argv)
    at_least(args, ap.error, dict(n=1, warm=0))
    if args.trace is not None and not os.path.isfile(args.trace):  # only the default may be absent
        ap.error(f"--trace {args.trace}: no such file")
    args.trace = args.trace or bq.DEFAULT_TRACE
    old = existing_rows(args.out, ap.error) if args.out else []  # before the run
    pols = args.policies.split(",")
    for p in pols:
        if p not in bq.POLICIES:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(sorted(bq.POLICIES))}")
    if args.queue == "mooncake" and not os.path.exists(args.trace):
        print(f"# no trace at {args.trace}: synthetic queue", flush=True)
        args.queue = "synthetic"
    site = "line" if args.by_line else "function" if args.by_site else "none"
    rows = []
    print(f"{'policy':11} {'n':>6} {'backend':8} {'torch ops':>9} {'triton':>7} {'total':>6}")
    for p in pols:
        r = count(p, args.n, args.backend, args.queue, args.trace, args.warm, site)
        rows.append(r)
        print(f"{p:11} {args.n:>6} {args.backend:8} {r['torch_ops']:>9} {r['triton_launches']:>7} "
              f"{r['torch_ops'] + r['triton_launches']:>6}", flush=True)
        if site != "none":
            for k, v in r["sites"].items():
                print(f"    {v:4d} {k}")
            for k, v in r["triton"].items():
                print(f"    {v:4d} [triton] {k}")
    if args.out:
        write_rows(args.out, old + rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
