"""Radix match benchmark: FlatRadixTree's batched match against the reference RadixCache
matching one request at a time, on the Mooncake conversation trace.

Setup (not timed): both trees are built from the first `--build` requests of the trace (512
tokens per hash id, derived from the id). Queued requests are sampled (with replacement, seeded)
from the `--pool` requests that follow; their tokens sit in one CSR token pool and their chunk
hashes are computed once per distinct prompt, as at submit.

Timed, per queue length n (`--sizes`):
  reference  `RadixCache.match_prefix` for each request in queue order (splits and stamps
             included). Above `--ref-max` requests the first `--ref-max` are timed and the time
             is scaled by n / ref-max (the row says `ref_extrapolated_from`).
  torch      one `FlatRadixTree.match_csr` call for the whole queue (binary search over the
             precomputed chunk hashes, in-chunk page steps, splits in rounds, stamps).
  triton     the same with backend="triton" (GPU only; the CPU interpreter is no measurement).
Each timing starts from a fresh copy of the built tree (copied outside the timing); the matched
lengths of the timed reference requests are checked against the batched result.

Per prompt length (`--lengths`): prompts of the trace with at least that many tokens, cut to
it, as a batch of `--len-batch`: the search alone ("search": binary search and page steps over
the precomputed hashes, no tree change), the full match on a fresh tree ("first": splits,
whose owner-array writes grow with the split head's length, and path stamps, which grow with
the path's node count), the same batch again on the split tree ("again": the queue re-matched
at a later step), and one request per call (latency, "single"); the max/min ratio over lengths
is printed for each (target: within 2x).

Rows are data (STYLE practice 9): printed as a table and written to `--out` (JSON).

Usage: python benchmarks/bench_radix.py [--build 1000] [--page-size 1] [--sizes 10000,100000]
       [--ref-max 20000] [--lengths 1024,4096,16384,32768] [--threads 1] [--device cpu|cuda]
       [--backends torch[,triton]] [--clock wall|cpu] [--out benchmarks/results/bench_radix.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpu_sched.radix import FlatRadixTree
from gpu_sched.reference.radix_cache import KVPool, RadixCache
from gpu_sched.sim.traces import BLOCK_TOKENS, read_mooncake

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run by path or imported: its siblings
from bench_args import at_least, int_list  # noqa: E402

sys.setrecursionlimit(100_000)  # deep copies of the reference tree recurse per level
ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


class Queue:
    """Distinct prompts in CSR form (tokens and chunk hashes) and per-request views into them."""

    def __init__(self, prompts, tree: FlatRadixTree, device):
        self.prompts = prompts
        lens = np.array([len(p) for p in prompts], dtype=np.int64)
        self.lens = lens
        self.starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        self.tokens = torch.from_numpy(np.concatenate(prompts).astype(np.int32)).to(device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        chs = [tree.prefix_hashes(self.tokens[s : s + n][None], torch.tensor([n], device=device), zero, tree.C)[0]
               for s, n in zip(self.starts.tolist(), lens.tolist())]
        counts = np.array([c.numel() for c in chs], dtype=np.int64)
        self.cstarts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.chunks = torch.cat(chs)
        self.device = device

    def batch(self, pick):
        dev = self.device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        ns = torch.zeros(len(pick), dtype=torch.int64, device=dev)
        return self.tokens, t(self.starts[pick]), t(self.lens[pick]), ns, self.chunks, t(self.cstarts[pick])


CLOCK = {"fn": time.perf_counter}  # --clock: wall (perf_counter) or cpu (this process's CPU time)


def timed(fn, device, setup, reps):
    """Median time [ms] of fn(state) over reps runs, each on a fresh setup() (untimed)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = CLOCK["fn"]
    times, out = [], None
    for _ in range(reps):
        state = setup()
        sync()
        t0 = clock()
        out = fn(state)
        sync()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times), out


def build(reqs, page_size, device):
    prompts = [r.prompt_ids() for r in reqs]
    distinct = len({h for r in reqs for h in r.hash_ids}) * BLOCK_TOKENS
    pool = KVPool(distinct + max(len(p) for p in prompts))
    ref = RadixCache(pool, page_size)
    tree = FlatRadixTree(page_size, max_nodes=2 * len(reqs) + 2, token_capacity=distinct + page_size, device=device)
    for p in prompts:
        slots = pool.alloc(len(p) // page_size * page_size)
        a = ref.insert(p, slots)
        pool.free(slots[:a])
        tree.insert(torch.from_numpy(p.astype(np.int32)), torch.from_numpy(slots), 0)
    return ref, tree


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--build", type=int, default=1000, help="requests inserted before matching")
    ap.add_argument("--pool", type=int, default=3000, help="later requests the queue is sampled from")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--ref-max", type=int, default=20000, help="largest n the reference runs in full")
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    ap.add_argument("--len-batch", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="torch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this process's CPU time (steadier on a shared CPU machine; CPU device only)")
    ap.add_argument("--out", default=None,
                    help="write the rows as JSON here (default: print only; the recorded rows are "
                         "benchmarks/results/bench_radix.json)")
    args = ap.parse_args(argv)
    at_least(args, ap.error, dict(build=1, pool=1, len_batch=1, reps=1, page_size=1, threads=0, ref_max=0, seed=0))
    sizes, lengths = int_list(args.sizes, "--sizes", ap.error), int_list(args.lengths, "--lengths", ap.error)
    bad = [b for b in args.backends.split(",") if b not in ("torch", "triton")]
    if bad:
        ap.error(f"unknown backend {bad[0]!r}; choose from torch, triton")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu":
        if device.type != "cpu":
            ap.error("--clock cpu measures the host process; use wall time on a GPU")
        CLOCK["fn"] = time.process_time
    backends = args.backends.split(",")
    if "triton" in backends and device.type == "cpu":
        ap.error("the triton backend is benchmarked on a GPU only (the CPU interpreter is not a measurement)")
    rng = np.random.default_rng(args.seed)
    trace = read_mooncake(args.trace)
    reqs = trace.requests
    P = args.page_size
    t0 = time.perf_counter()
    ref, tree = build(reqs[: args.build], P, device)
    build_s = time.perf_counter() - t0
    cache_tokens = int(tree.evictable_size)
    later = reqs[args.build : args.build + args.pool]
    t0 = time.perf_counter()
    queue = Queue([r.prompt_ids() for r in later], tree, device)
    hash_s = time.perf_counter() - t0
    meta = dict(device=str(device), threads=torch.get_num_threads() if device.type == "cpu" else None,
                clock=args.clock, page_size=P, chunk_tokens=tree.C, build_requests=args.build,
                cache_tokens=cache_tokens, torch=torch.__version__, python=sys.version.split()[0], cpu=platform.processor() or platform.machine())
    print(f"# {device}, {meta['threads']} threads, torch {torch.__version__}; page size {P}, chunk {tree.C} tokens; "
          f"{args.clock} clock")
    print(f"# tree: first {args.build} requests, {cache_tokens} cached tokens, built in {build_s:.1f} s; "
          f"queue sampled from the next {len(later)} requests (mean {queue.lens.mean():.0f} tokens), "
          f"chunk hashes in {hash_s:.1f} s (not timed)")
    rows = []
    hdr = f"{'n':>8} {'backend':10} {'median ms':>11} {'us/req':>9} {'ratio vs ref':>12}  note"
    print(hdr)
    print("-" * len(hdr))

    def emit(row):
        rows.append({**row, **meta})
        ratio = "" if row.get("speedup_vs_ref") is None else f"{row['speedup_vs_ref']:.1f}x"
        print(f"{row['n']:>8} {row['backend']:10} {row['median_ms']:>11.2f} {row['us_per_req']:>9.2f} {ratio:>12}  "
              f"{row.get('note', '')}", flush=True)

    # ---- batched match of a queue of n requests ---------------------------------------------
    for n in sizes:
        pick = rng.integers(0, len(later), n)
        ref_n = min(n, args.ref_max)

        def run_ref(cache):
            return [cache.match_prefix(queue.prompts[i])[0] for i in pick[:ref_n]]

        ref_ms, ref_m = timed(run_ref, torch.device("cpu"), lambda: copy.deepcopy(ref), args.reps)
        ref_ms_n = ref_ms * n / ref_n
        note = f"timed {ref_n} requests, scaled x{n / ref_n:g}" if ref_n < n else ""
        emit(dict(bench="match_queue", n=n, backend="reference", median_ms=ref_ms_n, us_per_req=ref_ms_n * 1e3 / n,
                  speedup_vs_ref=1.0, ref_extrapolated_from=ref_n if ref_n < n else None, note=note))
        args_b = queue.batch(pick)
        for be in backends:
            ms, (m, _) = timed(lambda t: t.match_csr(*args_b, backend=be), device, lambda: copy.deepcopy(tree),
                               args.reps)
            got = m[:ref_n].tolist()
            if got != ref_m:
                i = next(k for k, (a, b) in enumerate(zip(got, ref_m)) if a != b)
                raise AssertionError(f"{be}: request {i} matched {got[i]}, reference {ref_m[i]}")
            emit(dict(bench="match_queue", n=n, backend=be, median_ms=ms, us_per_req=ms * 1e3 / n,
                      speedup_vs_ref=ref_ms_n / ms, note=f"{n} queued, matched lengths equal the reference"))

    # ---- per-request cost against prompt length ----------------------------------------------
    print(f"\n{'length':>8} {'backend':10} {'search us/req':>13} {'first us/req':>12} {'again us/req':>12} "
          f"{'single us':>10}")
    per_len = {}
    for L in lengths:
        long_reqs = [r for r in reqs[args.build :] if r.input_len >= L] or [r for r in reqs if r.input_len >= L]
        sel = rng.choice(len(long_reqs), min(args.len_batch, len(long_reqs)), replace=False)
        lq = Queue([long_reqs[i].prompt_ids()[:L] for i in sel], tree, device)
        pick = rng.integers(0, len(sel), args.len_batch)
        args_b = lq.batch(pick)
        n_ref = min(200, args.len_batch)
        ref_ms, _ = timed(lambda c: [c.match_prefix(lq.prompts[i]) for i in pick[:n_ref]], torch.device("cpu"),
                          lambda: copy.deepcopy(ref), 1)
        rows.append({**dict(bench="match_length", prompt_len=L, n=n_ref, backend="reference", median_ms=ref_ms,
                            us_per_req=ref_ms * 1e3 / n_ref), **meta})
        print(f"{L:>8} {'reference':10} {ref_ms * 1e3 / n_ref:>12.2f}")
        for be in backends:
            # first match of the batch on a fresh tree (splits included), then the same batch again
            # on the split tree (a queue re-matched at every step), then one request per call
            tok, ts, ln, ns, ch, cs = args_b
            cnt = ln // tree.C
            search_ms, _ = timed(lambda t: t._find_csr(tok, ts, ln, ln, ns, ch, cs, cnt, int(cnt.max()), be), device,
                                 lambda: tree, 2 * args.reps + 1)  # the search alone: read-only
            ms, _ = timed(lambda t: t.match_csr(*args_b, backend=be), device, lambda: copy.deepcopy(tree), args.reps)
            work = copy.deepcopy(tree)
            work.match_csr(*args_b, backend=be)
            again_ms, _ = timed(lambda t: t.match_csr(*args_b, backend=be), device, lambda: work, 2 * args.reps + 1)
            single = [timed(lambda t: t.match_csr(*lq.batch(np.array([i])), backend=be), device, lambda: work, 1)[0]
                      for i in pick[:50]]
            vals = (search_ms * 1e3 / args.len_batch, ms * 1e3 / args.len_batch, again_ms * 1e3 / args.len_batch,
                    statistics.median(single) * 1e3)
            per_len.setdefault(be, []).append(vals)
            rows.append({**dict(bench="match_length", prompt_len=L, n=args.len_batch, backend=be, median_ms=ms,
                                search_us_per_req=vals[0], us_per_req=vals[1], again_us_per_req=vals[2],
                                single_request_us=vals[3]), **meta})
            print(f"{L:>8} {be:10} {vals[0]:>13.2f} {vals[1]:>12.2f} {vals[2]:>12.2f} {vals[3]:>10.1f}", flush=True)
    for be, vals in per_len.items():
        r = [max(v[k] for v in vals) / min(v[k] for v in vals) for k in range(4)]
        print(f"# {be}: max/min over lengths (target <= 2): search {r[0]:.2f}, first {r[1]:.2f}, again {r[2]:.2f}, "
              f"single {r[3]:.2f}")
        rows.append({**dict(bench="match_length_ratio", backend=be, search_max_over_min=r[0], first_max_over_min=r[1],
                            again_max_over_min=r[2], single_max_over_min=r[3]), **meta})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"# wrote {len(rows)} rows to {args.out}")
    return rows


if __name__ == "__main__":
    main()
