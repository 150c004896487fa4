"""Large-queue benchmark: one scheduling step of the reference scheduler against `GpuScheduler`,
per policy, stage and queue length N = 2^min_exp .. 2^max_exp (or the lengths `--sizes` lists).

Rows are data (STYLE practice 9), one per (policy, stage, n, backend, device): median_s, p90_s,
us_per_req, ratio_to_ref (this median / the reference's median for the same policy, stage and
n measured in the same run; for graph/gstep, over the reference's whole step; None where the
reference was not run), speedup (its inverse: the table's column), reps, plus what the run
was (queue kind, warm-cache size, prompt cap, threads, torch version, run id, command). They are
appended to `--out` (a JSON list) and printed as a table; `plot_bench.py` draws them.

Setup (not timed)
  One scheduler per backend, holding
    * a warm prefix cache: the prompts of the first `--warm` trace requests, inserted with
      `seed_cache` (Mooncake, 2000 requests: 19.4M tokens, the size of the SGLang figures);
    * a running batch of `--running` short requests (seed_running) whose routing keys are
      drawn from the first half of `--routing-keys` keys (routing-key ordering reads them);
    * a waiting queue of N requests: the trace rows after the warm ones, cycled when N is
      larger than the trace (a cycled copy shares its prompt array with the original, so a 2^20
      queue fits in memory); priority uniform in 0..4, routing key uniform over the keys (one
      in eight none), enqueue time = queue position, max_new_tokens = the row's output length.
  The policy is switched by replacing `sched.config` (the warm cache is built once per backend;
  nothing in the schedulers caches config values besides the `random` policy's seed). Queued
  requests are entered the way `submit` does, without re-validating every prompt (they are
  validated once, when built): submit's copy of each prompt would not fit at 2^20.

What is timed (a warm-up call first, untimed; then `--budget-s` over the faster of the warm-up
and a first timed call, in timed calls, at least `--reps` and at most `--max-reps`, interleaved
with the other backends' calls: `measure_group`)
  order  `sched._order()`: the policy's ordering of the whole queue, including the prefix
         match of every request for lpm/dfs-weight (as SGLang's calc_priority). It does not
         change the queue list; lpm/dfs-weight matching splits and stamps tree nodes, and the
         splits happen in the warm-up, so timed calls see the same tree. GpuScheduler hashes
         each request's fill once (`_ensure_hashed`, kept in its row, as a request's hashes are
         computed once in its lifetime): that happens in the warm-up too, whose time every
         row keeps as `warmup_s`.
  order-churn  lpm/dfs-weight: the same ordering on a tree that changes before every call,
         as between a serving loop's steps: untimed, one more request's fill plus 32 fresh
         tokens is
         inserted (`seed_cache`, the same sequence on every backend), so the tree version
         moves and GpuScheduler's kept matches are checked against what changed (its change
         log) rather than trusted. Runs on a deep copy of the scheduler (untimed), so the
         other stages and the plan checks see the unchurned tree.
  order-served  fcfs with priority, and lof: the same ordering of the queue as a serving
         loop keeps it after a step, in the previous step's order (fcfs: by priority, then
         time, no longer in time order, so the time is a sort key too). On a deep copy of the
         scheduler whose queue is set to its own ordering (untimed). GpuScheduler knows its
         queue is in that order (`RowQueue.ordered`) and returns it as it is.
  order-arrivals  as order-served, with the newest 1% of the queue (at least one request)
         taken out of the served order and put behind it in time order, as after a step with
         arrivals since the one before (GpuScheduler sorts those and merges them into the
         ordered rest, `policy.merge_arrivals_host`, instead of sorting the queue). The
         warm-up call looks the arrivals' rows up and joins them to the queue's rows (once
         per arrival in a serving loop too); the timed calls time the ordering of that queue.
  admit  `sched._admission_loop(ordered, adder)` with a fresh `PrefillAdder` over the queue
         ordered once beforehand (untimed): R-STEP-3 alone.
  step   `sched.step(ratio)`: budgets, ordering, admission and the plan.
  step-served  the same step with the queue in the previous step's order, as a serving loop
         holds it between steps (`sched.step(ratio)` on a deep copy of the scheduler whose
         queue is set to its own ordering, untimed; every policy). Python's timsort passes
         over an ordered list in one pass, and GpuScheduler returns a queue it knows is in
         order (fcfs with priority, lof) as it is; the other policies order it as usual.
  graph  GpuScheduler only, every benchmarked policy: the recorded step alone
         (`GpuScheduler.capture()`, `gpu_sched.step.StepGraph`: prefix match, order and
         admission of the whole queue as one fixed-capacity device computation, capacity = n),
         inputs loaded by one untimed step: on CUDA one `CUDAGraph.replay()`, on CPU the same
         computation run eagerly. Compared with the reference's whole step.
  gstep  `sched.step(ratio)` through the recorded step: input copy, replay, one read-back, then
         the host's splits, locks and bookkeeping.
  After every admit/step call the state is restored, untimed (`Restorer`): the admitted
  requests' prefix locks are released, the queue list is put back, `prefilling`, `chunked` and
  `batch_is_full` are cleared. Admission allocates no KV (that happens in `complete_prefill`)
  and the KV pool is sized so that nothing is evicted, so this restores every count the next
  call reads; `check_integrity` runs after the restores at the smallest n to confirm it.

Timing: `time.perf_counter` on CPU; on CUDA, CUDA events around the call after a synchronize
(the events bracket the whole call, host work included). A warm-up over `--slow-s` gets `--slow-reps` timed calls only. A backend
stops for a policy once one call exceeds `--max-seconds`, or when GpuScheduler's per-request
device copies of the queue's fills would not fit in memory (`mem_ok`); the reference runs only
up to 2^ref_max_exp.
Loop order: n outermost, then policy, then stage; the backends time each (policy, stage, n) side by
side, their calls interleaved (`measure_group`), so a ratio compares samples taken over the same
seconds. `--deadline-s` cuts the largest sizes of every policy, never whole policies; rows are
saved after every n.

Sanity check: for n <= 2^check_max_exp the warm-up step's plan of every device backend is
compared field by field with the reference's (rows get plan_equal_ref; a mismatch is printed
with its first differing field): step and step-served each with the reference's plan of the
same stage, gstep with its step's.

Usage:
  python benchmarks/bench_queue.py [--queue mooncake|synthetic] [--min-exp 7] [--max-exp 20]
      [--ref-max-exp 15] [--max-seconds 60] [--policies fcfs,lof,routing-key,lpm,dfs-weight]
      [--stages order,admit,step] [--backends reference,torch-cpu[,torch-cuda,triton-cuda]]
      [--warm 2000] [--max-prompt-len N] [--out benchmarks/results/bench_queue_cpu.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from gpu_sched.config import SchedulerConfig
from gpu_sched.reference.adder import PrefillAdder
from gpu_sched.reference.scheduler import ReferenceScheduler
from gpu_sched.request import Request
from gpu_sched.row_queue import RowQueue
from gpu_sched.scheduler import GpuScheduler
from gpu_sched.step import GRAPH_POLICIES
from gpu_sched.sim.traces import TraceRequest, read_mooncake, synthetic_workload
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run by path or imported: its siblings
from bench_args import at_least, existing_rows, int_list, write_rows  # noqa: E402

#: the Mooncake trace in the shared folder beside the repository (../shared from its root)
DEFAULT_TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl")
POLICIES = {  # name -> SchedulerConfig overrides (the plain constructor: no lpm fallback, D3)
    "fcfs": dict(schedule_policy="fcfs", enable_priority_scheduling=True),
    "lof": dict(schedule_policy="lof"),
    "routing-key": dict(schedule_policy="routing-key"),
    "lpm": dict(schedule_policy="lpm"),
    "dfs-weight": dict(schedule_policy="dfs-weight"),
}
STAGES = ("order", "order-churn", "order-served", "order-arrivals", "admit", "step", "step-served", "graph", "gstep")
#: stages timed only on GpuScheduler, for the policies the recorded step covers
RECORDED_STAGES = ("graph", "gstep")
RATIO = 0.7  # new-token ratio passed to step (SGLang's initial value)


# ---- workload --------------------------------------------------------------------------------
@dataclass
class Workload:
    """Everything the schedulers are built from (host data only)."""

    name: str
    warm_prompts: List[np.ndarray]
    queue: List[Request]  # length 2^max_exp; a size-n run takes the first n
    running: List[Request]
    distinct: int  # distinct queue prompts before cycling
    max_len: int  # longest queued prompt [tokens]: the recorded step's max_len


def _cap(p: np.ndarray, cap: Optional[int]) -> np.ndarray:
    return p if cap is None or len(p) <= cap else p[:cap]


def build_workload(args, n_max: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    if args.queue == "mooncake":
        rows = read_mooncake(args.trace).requests
        if len(rows) <= args.warm:
            raise SystemExit(f"--warm {args.warm} leaves no queue rows in {args.trace} ({len(rows)} rows)")
    else:
        n_syn = args.warm + (args.distinct or 8192)
        rows = synthetic_workload(n_syn, seed=args.seed, num_groups=args.synthetic_groups).requests
    warm = [_cap(r.prompt_ids(), args.max_prompt_len) for r in rows[: args.warm]]
    qrows = rows[args.warm :]
    if args.distinct:
        qrows = qrows[: args.distinct]
    qrows = qrows[:n_max]
    protos = []
    for j, row in enumerate(qrows):  # validated once here; cycled copies share the prompt array
        protos.append(Request(rid=f"q{j}", prompt_ids=_cap(row.prompt_ids(), args.max_prompt_len),
                              max_new_tokens=max(1, row.output_len)))
    K = args.routing_keys
    keys = [f"key{k:03d}" for k in range(K)]
    prio = rng.integers(0, 5, n_max)
    kid = rng.integers(0, K, n_max)
    nokey = rng.random(n_max) < 0.125
    queue = []
    for i in range(n_max):
        r = copy.copy(protos[i % len(protos)])  # no __post_init__: the prompt is not copied
        r.rid, r.output_ids = f"q{i}", []
        r.priority, r.enqueue_time = int(prio[i]), float(i)
        r.routing_key = None if nokey[i] else keys[kid[i]]
        queue.append(r)
    running = []
    for j in range(args.running):
        toks = TraceRequest(index=10**9 + j, arrival_s=0.0, input_len=128, output_len=0).prompt_ids()
        running.append(Request(rid=f"run{j}", prompt_ids=toks, max_new_tokens=256,
                               routing_key=keys[j % max(1, K // 2)], priority=2, enqueue_time=-1.0))
    return Workload(args.queue, warm, queue, running, len(protos), max(len(p.prompt_ids) for p in protos))


# ---- schedulers ------------------------------------------------------------------------------
def parse_backend(spec: str):
    """'reference' | 'torch-cpu' | 'torch-cuda' | 'triton-cuda' -> (backend, device)."""
    if spec == "reference":
        return "reference", "cpu"
    be, _, dev = spec.partition("-")
    if be not in ("torch", "triton") or dev not in ("cpu", "cuda"):
        raise SystemExit(f"unknown backend {spec!r} (reference, torch-cpu, torch-cuda, triton-cuda)")
    if be == "triton" and dev == "cpu":
        raise SystemExit("triton-cpu would time Triton's interpreter, which measures nothing")
    return be, dev


def kv_pool_size(wl: Workload, running: int, headroom: int) -> int:
    """KV pool [tokens]: the warm cache's distinct tokens, the running requests' KV (400 each)
    and `headroom` free."""
    probe = ReferenceScheduler(SchedulerConfig(), sum(len(p) for p in wl.warm_prompts) + 1)
    return sum(probe.seed_cache(p) for p in wl.warm_prompts) + running * 400 + headroom


def make_scheduler(backend: str, device: str, wl: Workload, pool: int):
    cfg = SchedulerConfig(**POLICIES["fcfs"])
    if backend == "reference":
        s = ReferenceScheduler(cfg, pool)
    else:
        s = GpuScheduler(cfg, pool, backend=backend, device=device)
    cached = sum(s.seed_cache(p) for p in wl.warm_prompts)
    for r in wl.running:
        s.seed_running(copy.deepcopy(r))
    return s, cached


def set_queue(s, reqs: List[Request]) -> None:
    """`submit(reqs)` without its per-request validation (done once in build_workload)."""
    if type(s).submit is not ReferenceScheduler.submit:
        raise RuntimeError("the scheduler overrides submit(); set_queue would bypass it")
    for st in s.queue:
        del s.reqs[st.rid]
    # an empty queue of the scheduler's own (assigning a list only reorders a GpuScheduler's)
    s.queue = RowQueue(s) if isinstance(s, GpuScheduler) else []
    for r in reqs:
        st = s._state(r, None)
        s.reqs[r.rid] = st
        s.queue.append(st)


def queue_snapshot(s):
    """A copy of s.queue to put back after each timed call. GpuScheduler's queue (a RowQueue)
    is copied with its table rows looked up, as a serving loop's queue is between steps
    (its requests were hashed when a step first matched them), so the timed step does not hash
    it again: a serving loop's step hashes only the requests that arrived since the last one."""
    if isinstance(s, GpuScheduler):
        s._ensure_hashed(s._queue_rows(s.queue))
    return s.queue.copy()


class Restorer:
    """Undo an admit/step call (untimed): release the admitted requests' prefix locks, clear
    prefilling/chunked/batch_is_full, put the queue list back (step).

    On a GpuScheduler the first undo unlocks through the cache like the engine would; it then
    snapshots the tree's lock counts below `node_bound()` (the live node ids; the counts past
    it are zero), and later undos copy that snapshot back (one small memcpy instead of
    O(tree capacity) work per unlock; a copy of the whole capacity, 160 MB with a 20M-token
    pool, would flush the CPU's caches before each of our timed calls). This is exact because the warm-up call already made
    every split the call makes (matching is deterministic and splits are idempotent), so the
    later calls lock and unlock the same node ids."""

    def __init__(self, s, queue0=None):
        self.s, self.queue0, self.snap = s, queue0, None
        self.adder = None  # set by the admit stage

    def _admitted(self):
        return self.adder.can_run if self.adder is not None else self.s.prefilling

    def __call__(self):
        s = self.s
        admitted = self._admitted()
        if self.snap is None:
            nodes = [r.lock_node for r in admitted if r.lock_node is not None]
            if isinstance(s, GpuScheduler) and not s.cache.disable:
                t = s.cache.tree
                if nodes:  # one batched unlock (each unlock is O(tree capacity))
                    t.unlock(torch.tensor(nodes, dtype=torch.int64, device=s.device))
                b = t.node_bound()  # the live ids' prefix (see the docstring)
                self.snap = (b, t.lock_ref[:b].clone(), t.evictable_size.clone(), t.protected_size.clone())
            else:
                for node in nodes:
                    s.cache.dec_lock_ref(node)
        else:
            t = s.cache.tree
            b = self.snap[0]
            if t.node_bound() != b:
                raise RuntimeError("a timed call allocated tree nodes after the warm-up: the lock snapshot no longer covers them")
            t.lock_ref[:b].copy_(self.snap[1])
            t.evictable_size.copy_(self.snap[2])
            t.protected_size.copy_(self.snap[3])
        for r in admitted:
            r.lock_node = None
        s.prefilling = []
        s.chunked = None
        s.batch_is_full = False
        if self.queue0 is not None:
            s.queue = self.queue0.copy()


def churned_order(s, fresh: int = 32):
    """(order call, churn) on a deep copy of s: churn inserts the fill of the k-th chosen
    queued request plus `fresh` new tokens (k-th call; the same on every backend) into the
    copy's cache, untimed, before each timed ordering."""
    c = copy.deepcopy(s)
    calls = iter(range(1 << 62))

    def churn():
        k = next(calls)
        r = c.queue[(k * 7919) % len(c.queue)]
        c.seed_cache(np.concatenate([r.fill(), np.random.default_rng(k).integers(0, 32000, fresh, dtype=np.int32)]))

    churn()  # the warm-up call sees a changed tree too
    return c._order, churn


def served_copy(s):
    """A deep copy of s whose queue is in the order s's ordering gives it, as a serving loop's
    queue is after a step (`order-served`, `order-arrivals`, `step-served`)."""
    c = copy.deepcopy(s)
    c.queue = c._order().queue
    return c


def served_order(s):
    """(order call, None) on `served_copy(s)` (`order-served`)."""
    return served_copy(s)._order, None


def arrivals_order(s, frac: float = 0.01):
    """(order call, None) on a deep copy of s whose queue is in the order s's ordering gives
    it, except its newest `frac` of requests (at least one), which are behind the rest in
    enqueue-time order: a serving loop's queue after arrivals (`order-arrivals`)."""
    c = served_copy(s)
    q = c.queue
    items = list(q)
    a = max(1, int(len(items) * frac))
    newest = sorted(items, key=lambda r: r.enqueue_time)[-a:]
    ids = {id(r) for r in newest}
    if isinstance(q, RowQueue):  # as a serving loop leaves it: the ordering's rows (known to be in
        # its order) without the newest, which wait behind them as submitted requests do
        sub = q.subset(np.array([id(r) not in ids for r in items], dtype=bool))
        sub.extend(newest)
        c.queue = sub
    else:
        c.queue = [r for r in items if id(r) not in ids] + newest
    return c._order, None


def stage_fns(s, stage: str, max_len: int):
    """(call, restore) for one stage on scheduler s in its current state; None where the stage
    does not apply (the recorded step on the reference, or for a policy it does not record)."""
    if stage in RECORDED_STAGES:
        if not isinstance(s, GpuScheduler) or s.config.effective_policy not in GRAPH_POLICIES:
            return None
        queue0 = queue_snapshot(s)
        g = s._graph
        if g is None or g.Q != len(queue0):  # one recording serves both recorded stages
            g = s.capture(queue_capacity=len(queue0), running_capacity=max(1, len(s.running)), max_len=max_len)
        if stage == "gstep":
            return (lambda: s.step(RATIO)), Restorer(s, queue0)
        runs = g.runs
        s.step(RATIO)  # loads the inputs, records the graph on CUDA (untimed)
        Restorer(s, queue0)()
        if g.runs != runs + 1:
            raise RuntimeError("the recorded step was not taken")
        if s.device.type == "cuda":
            return g.graph.replay, None
        return g.compute, None
    if stage == "order":
        return s._order, None
    if stage == "order-churn":  # only the policies whose ordering matches the queue on the tree
        return churned_order(s) if s.config.effective_policy in ("lpm", "dfs-weight") else None
    if stage in ("order-served", "order-arrivals"):  # the orderings whose order lasts until arrivals:
        cfg = s.config  # fcfs with priority and lof (routing-key's follows the running batch)
        if cfg.effective_policy == "lof" or (cfg.effective_policy == "fcfs" and cfg.enable_priority_scheduling):
            return (served_order if stage == "order-served" else arrivals_order)(s)
        return None
    if stage == "step":
        return (lambda: s.step(RATIO)), Restorer(s, queue_snapshot(s))
    if stage == "step-served":  # a serving loop's step: the queue in the previous step's order
        c = served_copy(s)
        return (lambda: c.step(RATIO)), Restorer(c, queue_snapshot(c))
    ordered = s._order().queue
    restore = Restorer(s)

    def admit():
        restore.adder = adder = PrefillAdder(s.config, s.cache, s.pool, s.running, RATIO, 0)
        return s._admission_loop(ordered, adder)

    return admit, restore


# ---- timing ----------------------------------------------------------------------------------
class Clock:
    """Seconds of one call: perf_counter on CPU, CUDA events (after a synchronize) on CUDA."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self, fn: Callable):
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn()
            return time.perf_counter() - t0, out
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3, out


def measure_group(entries, reps: int, max_reps: int, budget_s: float, max_s: float, slow_s: float,
                  slow_reps: int, prime: bool = False):
    """Time one row's call on several backends side by side. entries: (clock, fn, restore) per
    backend. Returns (times, warm-up result, warm-up seconds) per entry.

    Warm-up calls first, in order. An entry whose warm-up took over max_s keeps the warm-up as
    its one time; over slow_s it gets slow_reps timed calls; else one timed call and the
    warm-up size it (the faster of the two, t): budget_s / t calls in all, clamped to
    reps..max_reps. The calls are interleaved evenly (an entry's k-th of R runs at fraction
    (k + 0.5) / R of the sequence), so every backend's samples span the same stretch of time
    and a slow phase of a shared machine touches each side alike. An entry stops after a call
    over max_s.

    `prime`: every timed call after the warm-up comes right after an untimed call of the same
    entry (and its restore), so it runs on that entry's own warm state rather than right after
    another backend's call (`--prime`; see benchmarks/bench_cold.py for what the gap costs).
    Timed calls still take turns as above."""
    out, plan = [], []

    def call(i, timed=True):
        clock, fn, restore = entries[i]
        if prime and timed:
            call(i, timed=False)
        dt, res = clock(fn)
        if restore:
            restore()
        return dt, res

    for i in range(len(entries)):
        t, first = call(i, timed=False)
        out.append(([], first, t))
    for i, (times, first, t) in enumerate(out):
        if t > max_s:
            times.append(t)
            continue
        if t > slow_s:
            R = slow_reps
        else:  # a first timed call: a warm-up may include one-time work, either may be slowed
            dt, _ = call(i)
            times.append(dt)
            if dt > max_s:
                continue
            R = min(max_reps, max(reps, math.ceil(budget_s / max(min(t, dt), 1e-9))))
        plan += [((k + 0.5) / R, i) for k in range(len(times), R)]
    stopped = set()
    for _, i in sorted(plan):
        if i in stopped:
            continue
        dt, _ = call(i)
        out[i][0].append(dt)
        if dt > max_s:
            stopped.add(i)
    return out


def p90(xs: List[float]) -> float:
    return float(np.percentile(np.asarray(xs), 90)) if len(xs) > 1 else xs[0]


def first_diff(a: dict, b: dict) -> Optional[str]:
    for k in a:
        if a[k] != b.get(k):
            va, vb = a[k], b.get(k)
            if isinstance(va, list) and isinstance(vb, list):
                i = next((i for i, (x, y) in enumerate(zip(va, vb)) if x != y), min(len(va), len(vb)))
                return (f"{k}[{i}]: reference {va[i] if i < len(va) else '<end>'!r} vs "
                        f"{vb[i] if i < len(vb) else '<end>'!r} (lengths {len(va)}, {len(vb)})")
            return f"{k}: reference {va!r} vs {vb!r}"
    return None


def mem_ok(s, n: int, device: str, frac: float = 0.5) -> Optional[str]:
    """Refuse a size whose match buffers would not fit: GpuScheduler keeps each queued request's
    fill and chunk hashes on the device and concatenates the queue's fills (CSR) for a batched
    match, ~16 bytes per queued token in all (its host copies share the prompt arrays)."""
    if not isinstance(s, GpuScheduler):
        return None
    tokens = sum(st.fill_len for st in s.queue)
    need = 16 * tokens
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
        free = info.get("MemAvailable", 0)
    if need > frac * free:
        return f"{tokens} queued tokens need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


# ---- main ------------------------------------------------------------------------------------
def default_backends() -> str:
    b = ["reference", "torch-cpu"]
    if torch.cuda.is_available():
        b += ["torch-cuda", "triton-cuda"]
    return ",".join(b)


def print_row(r: dict) -> None:
    ratio = "" if not r.get("speedup") else f"{r['speedup']:.3g}x"
    med = "-" if r["median_s"] is None else f"{r['median_s']:.4g}"
    p = "-" if r["p90_s"] is None else f"{r['p90_s']:.4g}"
    us = "-" if r["us_per_req"] is None else f"{r['us_per_req']:.3g}"
    chk = {True: "ok", False: "DIFF", None: ""}[r.get("plan_equal_ref")]
    print(f"{r['policy']:11} {r['stage']:14} {r['n']:>8} {r['backend']:9} {r['device']:5} {med:>10} {p:>10} "
          f"{us:>9} {ratio:>9} {r['reps']:>4} {chk:>4} {r.get('note') or ''}", flush=True)


HEADER = (f"{'policy':11} {'stage':14} {'n':>8} {'backend':9} {'dev':5} {'median s':>10} {'p90 s':>10} "
          f"{'us/req':>9} {'speedup':>9} {'reps':>4} {'plan':>4}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=(
        "Large-queue benchmark: one scheduling step (and its ordering and admission stages) of the "
        "reference scheduler against GpuScheduler, per policy, stage and queue length; rows as JSON. "
        "See benchmarks/README.md."))
    ap.add_argument("--queue", choices=("mooncake", "synthetic"), default="mooncake",
                    help="queue prompts from the Mooncake trace, or synthetic shared-prefix groups")
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    ap.add_argument("--warm", type=int, default=2000, help="leading trace requests whose prompts seed the cache")
    ap.add_argument("--max-prompt-len", type=int, default=None, help="cap prompts [tokens] (default or 0: real)")
    ap.add_argument("--distinct", type=int, default=0,
                    help="distinct queue prompts before cycling (0: every trace row after the warm ones; "
                         "synthetic: 8192)")
    ap.add_argument("--synthetic-groups", type=int, default=16, help="shared system prompts (synthetic queue)")
    ap.add_argument("--min-exp", type=int, default=7, help="smallest queue length 2^k (default %(default)s)")
    ap.add_argument("--max-exp", type=int, default=20, help="largest queue length 2^k (default %(default)s)")
    ap.add_argument("--sizes", default=None,
                    help="queue lengths N, comma-separated (e.g. 1000,10000,100000), instead of "
                         "2^min_exp .. 2^max_exp; the --*-max-exp limits still apply as 2^k")
    ap.add_argument("--ref-max-exp", type=int, default=15, help="largest 2^k the reference runs at")
    ap.add_argument("--eager-max-exp", type=int, default=None,
                    help="largest 2^k GpuScheduler's eager stages (order, admit, step) run at "
                         "(default: no limit; the recorded stages run at every size)")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="stop a backend/policy past this per call")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, from: " + ", ".join(POLICIES))
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated, from: " + ", ".join(STAGES) + " (default: all; graph and gstep, the recorded step, mean a CUDA graph only on CUDA)")
    ap.add_argument("--backends", default=default_backends(),
                    help="comma-separated: reference, torch-cpu, torch-cuda, triton-cuda (default: the ones this machine runs)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per row at least (default %(default)s)")
    ap.add_argument("--max-reps", type=int, default=15, help="timed calls per row at most (default %(default)s)")
    ap.add_argument("--budget-s", type=float, default=1.0,
                    help="a row's timed calls: this over the faster of its warm-up and first call, "
                         "within --reps..--max-reps")
    ap.add_argument("--slow-s", type=float, default=2.0, help="a warm-up call over this gets --slow-reps calls")
    ap.add_argument("--prime", action="store_true",
                    help="precede every timed call with an untimed call of the same backend: each backend timed "
                         "on its own warm state, not right after the other's call (rows get primed=true)")
    ap.add_argument("--slow-reps", type=int, default=2, help="timed calls of a row whose warm-up took over --slow-s")
    ap.add_argument("--running", type=int, default=64, help="running-batch size")
    ap.add_argument("--routing-keys", type=int, default=32, help="distinct routing keys among the requests")
    ap.add_argument("--kv-headroom", type=int, default=1_000_000,
                    help="KV pool = warm-cache tokens + this (free slots; nothing is evicted)")
    ap.add_argument("--check-max-exp", type=int, default=9, help="compare plans with the reference up to 2^k")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload draws (priorities, routing keys)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new row after this many seconds from launch (rows so far are kept)")
    ap.add_argument("--out", default=None, help="append rows to this JSON list (saved after every n)")
    ap.add_argument("--run-id", default=None,
                    help="the rows' `run` field (default: the start time); reuse one to continue a run "
                         "in a second invocation (plot_bench keeps the last row of each key)")
    args = ap.parse_args(argv)
    at_least(args, ap.error, dict(reps=1, max_reps=1, routing_keys=1, warm=0, running=0, distinct=0, seed=0,
                                  threads=0, max_prompt_len=0))
    if args.max_reps < args.reps:
        ap.error(f"--max-reps ({args.max_reps}) must be >= --reps ({args.reps}), the calls a row takes at least")
    if args.max_prompt_len == 0:  # as bench_cold.py: 0 keeps the real lengths
        args.max_prompt_len = None
    old = existing_rows(args.out, ap.error) if args.out else []  # before the run, not at its end
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    stages = args.stages.split(",")
    for st in stages:
        if st not in STAGES:
            ap.error(f"unknown stage {st!r}; choose from {', '.join(STAGES)}")
    stages.sort(key=STAGES.index)  # eager stages first, then the recorded ones
    backends = [parse_backend(b) for b in args.backends.split(",")]
    if any(d == "cuda" for _, d in backends) and not torch.cuda.is_available():
        ap.error("a cuda backend was asked for but torch.cuda.is_available() is False")
    if args.sizes:
        sizes = sorted(set(int_list(args.sizes, "--sizes", ap.error)))
    else:
        sizes = [2 ** e for e in range(args.min_exp, args.max_exp + 1)]
    if not sizes:
        ap.error(f"--min-exp {args.min_exp} is above --max-exp {args.max_exp}: no queue length")
    n_max = sizes[-1]

    t_start = time.perf_counter()
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S")
    meta = dict(queue=args.queue, warm=args.warm, max_prompt_len=args.max_prompt_len, primed=args.prime,
                running=args.running, threads=torch.get_num_threads(), torch=torch.__version__,
                python=sys.version.split()[0], host=platform.node(),
                cpu=platform.processor() or platform.machine(), run=run_id,
                command="python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    wl = build_workload(args, n_max)
    print(f"# {args.queue} queue: {wl.distinct} distinct prompts, warm cache from {args.warm} requests, "
          f"prompt cap {args.max_prompt_len}, {torch.get_num_threads()} torch threads; "
          f"workload built in {time.perf_counter() - t0:.1f} s", flush=True)
    pool = kv_pool_size(wl, args.running, args.kv_headroom)

    rows: List[dict] = []
    ref_med: Dict[tuple, float] = {}
    ref_plan: Dict[tuple, dict] = {}
    problems: List[str] = []
    out = Path(args.out) if args.out else None

    def save():
        if out is None:
            return
        write_rows(out, old + rows)

    scheds = []
    for backend, device in backends:
        t0 = time.perf_counter()
        s, cached = make_scheduler(backend, device, wl, pool)
        scheds.append((backend, device, s, cached, Clock(device)))
        print(f"# {backend}/{device}: warm cache {cached} tokens, KV pool {pool}, built in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    if args.prime:
        print("# --prime: every timed call right after an untimed call of the same backend", flush=True)
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    stopped = set()  # (backend, device, policy) past --max-seconds or out of memory
    out_of_time = False
    for n in sizes:
        live = [x for x in scheds if not (x[0] == "reference" and n > 2 ** args.ref_max_exp)
                and not all((x[0], x[1], p) in stopped for p in policies)]
        for backend, device, s, cached, clock in live:
            set_queue(s, wl.queue[:n])
        for pol in policies:
            if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
                out_of_time = True
                break
            here = []  # the backends timing this policy at this n
            for x in live:
                backend, device, s = x[:3]
                if (backend, device, pol) in stopped:
                    continue
                why = mem_ok(s, n, device) if pol in ("lpm", "dfs-weight") else None
                if why:
                    print(f"# {backend}/{device} {pol} stops at n={n}: {why}", flush=True)
                    stopped.add((backend, device, pol))
                    continue
                s.config = SchedulerConfig(**POLICIES[pol])
                here.append(x)
            for st in stages:
                group = []  # (backend, device, scheduler, cached, (clock, fn, restore))
                for backend, device, s, cached, clock in here:
                    if (backend, device, pol) in stopped:
                        continue
                    if isinstance(s, GpuScheduler) and st not in RECORDED_STAGES:
                        if args.eager_max_exp is not None and n > 2 ** args.eager_max_exp:
                            continue
                        s._graph = None  # these stages time the eager path
                    fns = stage_fns(s, st, wl.max_len)
                    if fns is not None:
                        group.append((backend, device, s, cached, (clock, *fns)))
                results = measure_group([g[4] for g in group], args.reps, args.max_reps, args.budget_s,
                                        args.max_seconds, args.slow_s, args.slow_reps, prime=args.prime)
                # the reference's row first: the others' ratios read its median
                for (backend, device, s, cached, _), (times, first, warm_t) in sorted(
                        zip(group, results), key=lambda gr: gr[0][0] != "reference"):
                    med = statistics.median(times)
                    key = (pol, st, n)
                    row = dict(policy=pol, stage=st, n=n, backend=backend, device=device, median_s=med,
                               p90_s=p90(times), us_per_req=med * 1e6 / n, reps=len(times), warmup_s=warm_t,
                               ratio_to_ref=None, plan_equal_ref=None, cache_tokens=cached, **meta)
                    if backend == "reference":
                        ref_med[key] = med
                        row["ratio_to_ref"] = 1.0
                        if st in ("step", "step-served") and n <= 2 ** args.check_max_exp:
                            ref_plan[(pol, st, n)] = dict(vars(first))
                    elif key in ref_med:
                        row["ratio_to_ref"] = med / ref_med[key]
                    elif st in RECORDED_STAGES and (pol, "step", n) in ref_med:
                        row["ratio_to_ref"] = med / ref_med[(pol, "step", n)]  # against the whole step
                    if row["ratio_to_ref"]:
                        row["speedup"] = 1.0 / row["ratio_to_ref"]
                    plan_key = (pol, "step" if st == "gstep" else st, n)  # the recorded step against the eager one's
                    if st in ("step", "step-served", "gstep") and backend != "reference" and plan_key in ref_plan:
                        d = first_diff(ref_plan[plan_key], dict(vars(first)))
                        row["plan_equal_ref"] = d is None
                        if d:
                            problems.append(f"{backend}/{device} {pol} n={n}: step plan differs from the "
                                            f"reference: {d}")
                            row["note"] = d[:80]
                    if n == sizes[0] and st == "step":
                        s.check_integrity()  # the restores left a consistent state
                    rows.append(row)
                    print_row(row)
                    if max(times) > args.max_seconds or warm_t > args.max_seconds:
                        stopped.add((backend, device, pol))
                        print(f"# {backend}/{device} {pol}: a call took over {args.max_seconds} s at n={n}; "
                              f"larger n skipped", flush=True)
                # the stage's scheduler copies (order-churn, order-served, order-arrivals,
                # step-served: each a copy of the whole tree, GBs with a 20M-token pool) are
                # cycles (a scheduler and its queue views) that only the cyclic collector frees:
                # freed now, untimed (a 4-size run was killed for memory at 24 GB without it)
                del group, results
                gc.collect()
            for backend, device, s, cached, clock in here:
                if isinstance(s, GpuScheduler):
                    s._graph = None  # its buffers hold this n's queue
        for backend, device, s, cached, clock in live:
            set_queue(s, [])
        save()
        if out_of_time:
            print(f"# --deadline-s {args.deadline_s} reached after n={n}; stopping", flush=True)
            break

    for p in problems:
        print("PROBLEM:", p)
    if out is not None:
        save()
        print(f"# {len(rows)} rows appended to {out}")
    return rows


if __name__ == "__main__":
    # a plan that differs from the reference's fails the run (status 1: gpu_check.sh records it)
    sys.exit(1 if any(r.get("plan_equal_ref") is False for r in main()) else 0)
