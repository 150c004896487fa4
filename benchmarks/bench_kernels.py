"""Block-size and key-width choices of the recorded step's costliest launches, timed side by side.

The 2026-12-04 H200 profile of lpm's recorded step at 4k waiting (benchmarks/README.md) put
most of its 0.33 ms in a few launches: two `torch.sort` calls (32 us each: up to 4096 entries
torch sorts in one thread block), `admission_prepare` (30 us in 1024-wide blocks, 94 us in
4096-wide ones), the lock drops' partial covers and R-ORD-9's head hashes. This script times
the alternatives for each on one device, in one run, so that a lent GPU's few minutes decide
them (`gpu_check.sh` runs it):

  sort       torch.sort(stable=True) of int64 keys against the same values as int32
  head_hash  `kernels.sort_keys.head_hashes_pool` (T = 32) in blocks of 64 .. 1024
  prepare    `kernels.admission.admission_prepare` in blocks of 256 .. 4096
  lock_drops `kernels.radix.lock_drops` with the default blocks (`scan_config`'s wide walk past
             1024 requests) against explicit 1024- and 128-wide ones

Caveats: lock_drops' explicit blocks change its per-request and per-node launches too, not only
the partial-covers walk; an explicit block of 4096 runs 8 warps (`block_config`), where
`scan_config`'s default wide walk runs 16.

Rows: case, variant, n, device, us (mean microseconds per call over --reps calls after 3
warm-up calls; CUDA events on CUDA, perf_counter elsewhere). Every variant of a case returns
the same values (checked), so only the time differs. On a CPU the Triton launches need
TRITON_INTERPRET=1 and time the interpreter: a dry run of the script, not a measurement.

Usage:
  python benchmarks/bench_kernels.py [--sizes 4096,131072] [--reps 50] [--device cuda] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Callable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_args import at_least, int_list  # noqa: E402
from bench_queue import Clock  # noqa: E402
from gpu_sched import admission as S  # noqa: E402
from gpu_sched import policy as P  # noqa: E402
from gpu_sched.kernels import admission as KA  # noqa: E402
from gpu_sched.kernels import radix as KR  # noqa: E402
from gpu_sched.kernels import sort_keys as SK  # noqa: E402


def time_call(fn: Callable[[], object], reps: int, dev: torch.device) -> float:
    """Mean microseconds per call of fn over `reps` calls, after 3 untimed ones: the calls run
    back to back inside one `bench_queue.Clock` reading (one pair of CUDA events on CUDA)."""
    for _ in range(3):
        fn()
    seconds, _ = Clock(dev.type)(lambda: [fn() for _ in range(reps)])
    return seconds * 1e6 / reps


def same(outs: List[torch.Tensor], case: str) -> None:
    for o in outs[1:]:
        if not torch.equal(o.to(torch.int64), outs[0].to(torch.int64)):
            raise AssertionError(f"{case}: the variants disagree")


def case_sort(n: int, dev: torch.device, g: torch.Generator):
    keys = torch.randint(0, max(n, 1), (n,), generator=g, device=dev)
    k32 = keys.to(torch.int32)
    return {"int64": lambda: torch.sort(keys, stable=True).indices,
            "int32": lambda: torch.sort(k32, stable=True).indices}


def case_head_hash(n: int, dev: torch.device, g: torch.Generator):
    T, stride = 32, 48
    tok = torch.randint(0, 2**31 - 1, (n * stride + 1,), generator=g, device=dev).to(torch.int32)
    toff = torch.arange(n, device=dev) * stride
    fill = torch.randint(0, 2048, (n,), generator=g, device=dev)
    w = P._hash_weights(2 * T, dev)
    return {f"block{b}": (lambda b=b: SK.head_hashes_pool(tok, toff, fill, w, P._HASH_MOD, block=b))
            for b in (64, 128, 256, 1024)}


def case_prepare(n: int, dev: torch.device, g: torch.Generator):
    rng = random.Random(n)
    cfg = S.StepConfig(page_size=4, clip=50, chunking=True)

    def col(lo, hi):
        return torch.tensor([rng.randrange(lo, hi) for _ in range(n)], dtype=torch.int64, device=dev)

    pre = col(0, 10) * 4
    fill, out, maxn, drop = pre + col(1, 60), col(0, 5), col(1, 90), col(0, 9)
    ie = col(0, 10) < 3
    sv = torch.tensor([10**9, 10**6, 40, 60, 10**7, 10**7, 3, 2, 1, 0, n, 0, 0, 0, 0], dtype=torch.int64,
                      device=dev)
    ratio = torch.tensor(0.7, dtype=torch.float64, device=dev)

    def run(b):
        return KA.admission_prepare(cfg, fill, out, prompt=fill - out, maxn=maxn, pre=pre, drop=drop, ie=ie,
                                    sv=sv, ratio=ratio, chunked=False, block=b).exI
    return {f"block{b}": (lambda b=b: run(b)) for b in (256, 1024, 2048, 4096)}


def case_lock_drops(n: int, dev: torch.device, g: torch.Generator):
    rng = random.Random(n + 1)
    N = max(n, 2)
    parent = [-1] + [rng.randrange(0, i) for i in range(1, N)]
    key_len = [0] + [rng.randrange(1, 40) for _ in range(1, N)]
    last = [rng.randrange(0, N) for _ in range(n)]
    cover = [rng.randint(1, key_len[v]) if v else 0 for v in last]

    def ten(xs, dtype=torch.int64):
        return torch.tensor(xs, dtype=dtype, device=dev)

    args = (ten(parent), ten(key_len), torch.zeros(N, dtype=torch.int64, device=dev),
            torch.ones(N, dtype=torch.bool, device=dev), ten(last), ten(cover), ten([v > 0 for v in last], torch.bool))
    return {"default": lambda: KR.lock_drops(*args), "block1024": lambda: KR.lock_drops(*args, block=1024),
            "block128": lambda: KR.lock_drops(*args, block=128)}


CASES = {"sort": case_sort, "head_hash": case_head_hash, "prepare": case_prepare, "lock_drops": case_lock_drops}


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,131072", help="queue lengths n, comma-separated")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    ap.add_argument("--reps", type=int, default=50, help="timed calls per variant (default %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the rows as a JSON list")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}: choose from {', '.join(CASES)}")
    sizes = int_list(args.sizes, "--sizes", ap.error)
    at_least(args, ap.error, dict(reps=1))
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # before any case is timed
        ap.error("the Triton variants on the CPU need TRITON_INTERPRET=1 (and then time the interpreter)")
    rows = []
    print(f"{'case':<11} {'variant':<10} {'n':>8} {'us':>10}")
    for n in sizes:
        for case in cases:
            g = torch.Generator(device=dev).manual_seed(n)
            variants = CASES[case](n, dev, g)
            same([fn() for fn in variants.values()], f"{case} n={n}")
            for name, fn in variants.items():
                us = time_call(fn, args.reps, dev)
                rows.append(dict(case=case, variant=name, n=n, device=str(dev), us=us, reps=args.reps))
                print(f"{case:<11} {name:<10} {n:>8} {us:>10.1f}", flush=True)
        if args.out:  # after every size: a run cut by its time limit keeps what it measured
            Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
