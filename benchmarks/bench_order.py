"""Queue-ordering benchmark: the reference (one request at a time, Python) against the device
functions of `gpu_sched.policy`, per policy and queue length.

Rows are data (STYLE practice 9): policy, n, backend, device, median_ms, us_per_req,
speedup_vs_ref (reference median / this median, both measured in this run; empty where the
reference was not run at that n). Printed as a table; `--out x.json` / `--out x.csv` saves them.

What is timed, per policy (inputs already built: columns on the device, ReqStates on the host):
  fcfs     priority scheduling on: key (priority*sign, enqueue_time)        R-ORD-4
  lof      priority scheduling on: key (priority*sign, -max_new_tokens)     R-ORD-5
  routing  64 running requests over 32 keys, 40 distinct waiting keys       R-ORD-7
  random   seeded permutation (reference: a numpy shuffle through order_queue) R-ORD-6
  lpm      head hashes of the first T=32 tokens + in-batch deprioritization + sort by
           -matched (reference: in_batch_deprioritized + the sort; matching is not timed
           on either side)                                                 R-ORD-8/9
  lpm-kept the same order as GpuScheduler runs it: a request's head hash is computed and
           interned with its namespace as a group id once per fill (kept in its row table,
           not timed), so a step runs only the deprioritization by group ids (a scatter-min,
           no sort) and one int32 sort (reference: the same as lpm, since it builds its
           in-batch tree again every step)                                 R-ORD-8/9
  dfs      dfs-weight over a random tree of n/4 nodes (reference: dfs_weight_order)  R-ORD-10

Usage: python benchmarks/bench_order.py [--sizes 1000,10000,100000,1000000]
       [--ref-max 100000] [--backends torch[,triton]] [--device cpu|cuda] [--threads k]
       [--out rows.json]
The triton backend needs a GPU (on CPU it would time Triton's interpreter, which is not a
measurement of anything); on CUDA each timing is synchronized.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter

import numpy as np
import torch

from gpu_sched import policy as P
from gpu_sched.config import SchedulerConfig
from gpu_sched.reference.policy import dfs_weight_order as ref_dfs, in_batch_deprioritized, order_queue
from gpu_sched.reference.radix_cache import KVPool, RadixCache, TreeNode
from gpu_sched.reference.state import ReqState
from gpu_sched.request import Request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run by path or imported: its siblings
from bench_args import at_least, int_list  # noqa: E402

POLICIES = ("fcfs", "lof", "routing", "random", "lpm", "lpm-kept", "dfs")
T = 32


def median_ms(fn, device, min_reps=3, budget_s=2.0):
    """Median wall time [ms] of fn() over at least min_reps runs (more while under budget)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up (also compiles Triton kernels)
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Workload:
    """One random queue of n requests in both forms (host ReqStates only when `host`)."""

    def __init__(self, n, device, host, seed=0):
        rng = np.random.default_rng(seed)
        self.n = n
        cfg = SchedulerConfig(enable_priority_scheduling=True)
        self.sign = cfg.priority_sign
        prio = rng.choice(np.array([0, 1, 2, 5, cfg.absent_priority], dtype=np.int64), n)
        times = rng.integers(0, max(1, n // 8), n).astype(np.float64)
        max_new = rng.choice(np.array([16, 128, 512, 2048], dtype=np.int64), n)
        nkeys = 40
        keys = rng.integers(-1, nkeys, n)
        run_keys = rng.integers(-1, 32, 64)
        ns = rng.integers(0, 2, n)
        # fills: one of 64 shared 32-token heads for 70%, else random; fill length >= T
        heads = rng.integers(0, 1000, (64, T))
        toks = np.where(rng.random((n, 1)) < 0.7, heads[rng.integers(0, 64, n)], rng.integers(0, 1000, (n, T)))
        fill_len = rng.integers(T - 4, 4 * T, n)
        prefix = rng.choice(np.array([0, 8, 31, 64]), n)
        matched = np.minimum(prefix, fill_len - 1)
        # dfs tree: N = n/4 nodes, parent of v drawn among earlier nodes (shallow and deep parts)
        N = max(2, n // 4)
        v = np.arange(1, N)
        near = np.maximum(v - 1 - rng.integers(0, 3, N - 1), 0)
        anywhere = (rng.random(N - 1) * v).astype(np.int64)
        parent = np.concatenate([[-1], np.where(rng.random(N - 1) < 0.5, near, anywhere)])
        child_rank = np.zeros(N, np.int64)
        seen = Counter()
        for i in range(1, N):  # host setup only, not timed
            child_rank[i] = seen[parent[i]]
            seen[parent[i]] += 1
        last = rng.integers(0, N, n)

        d = lambda a, dt=torch.int64: torch.as_tensor(a).to(device=device, dtype=dt)  # noqa: E731
        self.t_prio, self.t_time, self.t_max_new = d(prio), d(times, torch.float64), d(max_new, torch.int32)
        # key id i is the string f"k{i:02d}", so its lexicographic rank is i
        self.t_key, self.t_rank = d(keys, torch.int32), d(np.arange(nkeys), torch.int32)
        self.t_run = d(run_keys, torch.int32)
        self.t_ns, self.t_toks, self.t_fill = d(ns, torch.int32), d(toks, torch.int32), d(fill_len)
        self.t_prefix, self.t_matched = d(prefix), d(matched)
        self.t_parent, self.t_crank, self.t_last = d(parent), d(child_rank), d(last)

        if not host:
            return
        names = [f"k{r:02d}" for r in range(nkeys)]
        self.queue = []
        for i in range(n):
            fill = np.concatenate([toks[i], rng.integers(0, 1000, max(0, fill_len[i] - T))])
            fill = fill[: fill_len[i]].astype(np.int32)
            req = Request(rid=f"r{i}", prompt_ids=fill, max_new_tokens=int(max_new[i]),
                          routing_key=names[keys[i]] if keys[i] >= 0 else None,
                          extra_key=None if ns[i] == 0 else "ns1")
            r = ReqState(req, int(prio[i]), float(times[i]))
            r.prefix_len = int(prefix[i])
            r.num_matched = int(matched[i])
            self.queue.append(r)
        self.running = []
        for j, k in enumerate(run_keys):
            req = Request(rid=f"run{j}", prompt_ids=[1], max_new_tokens=1,
                          routing_key=names[k] if k >= 0 else None)
            self.running.append(ReqState(req, 0, 0.0))
        nodes = [TreeNode(np.zeros(0, np.int32), np.zeros(0, np.int64), None, 0, 0)]
        for i in range(1, N):
            node = TreeNode(np.zeros(1, np.int32), np.zeros(1, np.int64), nodes[parent[i]], 0, i)
            nodes[parent[i]].children[i] = node
            nodes.append(node)
        self.root = nodes[0]
        for r, v in zip(self.queue, last):
            r.last_node = nodes[v] if v else None

    # ---- reference -------------------------------------------------------------------------
    def reference(self, policy):
        q, empty = self.queue, RadixCache(KVPool(0), 1)
        if policy == "fcfs":
            cfg = SchedulerConfig(schedule_policy="fcfs", enable_priority_scheduling=True)
            return lambda: order_queue(q, cfg, empty, [], None)
        if policy == "lof":
            cfg = SchedulerConfig(schedule_policy="lof", enable_priority_scheduling=True)
            return lambda: order_queue(q, cfg, empty, [], None)
        if policy == "routing":
            cfg = SchedulerConfig(schedule_policy="routing-key")
            return lambda: order_queue(q, cfg, empty, self.running, None)
        if policy == "random":
            cfg = SchedulerConfig(schedule_policy="random")
            gen = np.random.default_rng(0)
            return lambda: order_queue(q, cfg, empty, [], lambda k: gen.permutation(k).tolist())
        if policy in ("lpm", "lpm-kept"):
            def run():
                dep = in_batch_deprioritized(q, 32, T)
                flag = {id(r): d for r, d in zip(q, dep)}
                return sorted(q, key=lambda r: float("inf") if flag[id(r)] else -r.num_matched)
            return run
        if policy == "dfs":
            return lambda: ref_dfs(self.root, q)
        raise ValueError(policy)

    # ---- device ----------------------------------------------------------------------------
    def device_fn(self, policy, backend):
        kw = {"backend": backend}
        if policy == "fcfs":
            return lambda: P.fcfs_priority_order(self.t_prio, self.t_time, self.sign, **kw)
        if policy == "lof":
            return lambda: P.lof_order(self.t_max_new, self.t_prio, self.sign, **kw)
        if policy == "routing":
            return lambda: P.routing_key_order(self.t_key, self.t_rank, self.t_run, -1, **kw)
        if policy == "random":
            gen = torch.Generator(device=self.t_prio.device).manual_seed(0)
            return lambda: P.random_order(self.n, gen, **kw)
        if policy == "lpm":
            def run():
                hh = P.head_hashes(self.t_toks, self.t_fill)
                dep = P.in_batch_deprioritize(self.t_prefix, self.t_fill, self.t_ns, hh, 32, T, **kw)
                return P.lpm_order(self.t_matched, dep, **kw)
            return run
        if policy == "lpm-kept":
            # once per request lifetime, not timed: the head hash, interned with the namespace
            # as a group id (GpuScheduler keeps it in its row table)
            hh = P.head_hashes(self.t_toks, self.t_fill)
            _, grp = torch.unique(torch.stack([self.t_ns.to(torch.int64), hh]), dim=1, return_inverse=True)
            G = int(grp.max()) + 1 if grp.numel() else 0
            matched = self.t_matched.to(torch.int32)  # token counts: int32 keys, as the scheduler

            def run():
                dep = P.in_batch_deprioritize_groups(self.t_prefix, self.t_fill, grp, G, 32, T, **kw)
                return P.lpm_order(matched, dep, **kw)
            return run
        if policy == "dfs":
            return lambda: P.dfs_weight_order(self.t_parent, self.t_crank, None, self.t_last, **kw)
        raise ValueError(policy)


def check(wl, policy, backends):
    """Refuse to time a device function that disagrees with the reference."""
    res = wl.reference(policy)()
    ordered = res.queue if hasattr(res, "queue") else res
    pos = {id(r): i for i, r in enumerate(wl.queue)}
    want = [pos[id(r)] for r in ordered]
    for be in backends:
        got = wl.device_fn(policy, be)().tolist()
        if got != want:
            i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            raise SystemExit(f"{policy}/{be} n={wl.n}: differs from the reference at index {i}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000,1000000")
    ap.add_argument("--ref-max", type=int, default=100_000, help="largest n the reference runs at")
    ap.add_argument("--backends", default="torch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--budget-s", type=float, default=2.0, help="timing budget per row [s]")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write rows to .json or .csv")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r} is not a torch device ({e})")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    backends = args.backends.split(",")
    if "triton" in backends and device.type == "cpu":
        ap.error("the triton backend is benchmarked on a GPU only (the CPU interpreter is not a measurement)")
    sizes = int_list(args.sizes, "--sizes", ap.error)
    at_least(args, ap.error, dict(threads=0))
    bad = [b for b in backends if b not in ("torch", "triton")]
    if bad:
        ap.error(f"unknown backend {bad[0]!r}; choose from torch, triton")
    # the other scripts' names for two of them
    policies = [{"routing-key": "routing", "dfs-weight": "dfs"}.get(p, p) for p in args.policies.split(",")]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        ap.error(f"unknown policy {bad[0]!r}; choose from {', '.join(POLICIES)} (routing-key, dfs-weight: "
                 f"routing, dfs)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    hdr = f"{'policy':8} {'n':>8} {'backend':9} {'median ms':>10} {'us/req':>8} {'speedup vs ref':>14}"
    print(f"# device {device} ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    print(hdr)
    print("-" * len(hdr))
    for n in sizes:
        wl = Workload(n, device, host=n <= args.ref_max)
        for pol in policies:
            ref_ms = None
            if n <= args.ref_max:
                ref_ms = median_ms(wl.reference(pol), torch.device("cpu"), budget_s=args.budget_s)
                rows.append(dict(policy=pol, n=n, backend="reference", device="cpu", median_ms=ref_ms,
                                 us_per_req=ref_ms * 1e3 / n, speedup_vs_ref=1.0))
            if n <= min(args.ref_max, 10_000) and pol != "random":
                check(wl, pol, backends)
            for be in backends:
                ms = median_ms(wl.device_fn(pol, be), device, budget_s=args.budget_s)
                rows.append(dict(policy=pol, n=n, backend=be, device=str(device), median_ms=ms,
                                 threads=torch.get_num_threads() if device.type == "cpu" else None,
                                 us_per_req=ms * 1e3 / n, speedup_vs_ref=None if ref_ms is None else ref_ms / ms))
            for r in rows[-(len(backends) + (ref_ms is not None)):]:
                sp = "" if r["speedup_vs_ref"] is None else f"{r['speedup_vs_ref']:.1f}x"
                print(f"{r['policy']:8} {r['n']:>8} {r['backend']:9} {r['median_ms']:>10.3f} "
                      f"{r['us_per_req']:>8.3f} {sp:>14}", flush=True)
    if args.out:
        for r in rows:
            r.update(torch=torch.__version__, python=sys.version.split()[0])
        if args.out.endswith(".csv"):
            with open(args.out, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))  # every row's keys
                w.writeheader()
                w.writerows(rows)
        else:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
