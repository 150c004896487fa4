"""GpuScheduler (torch backend) against the reference scheduler over multi-step runs.

Both schedulers get the same arrivals, steps, prefills, decodes and finishes; after every call
the plans (every field) and the pool/cache sizes must be equal, the cache contents too
(compared as (prefix, key length, lock_ref) triples), and both integrity checks must pass.
"""

import random

import numpy as np
import pytest

from gpu_sched.config import SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.request import Request
from gpu_sched.scheduler import GpuScheduler


def ref_triples(cache):
    out = set()
    for n in cache._nodes():
        if n is not cache.root:
            ns, toks = cache.node_prefix(n)
            out.add(((ns, toks), len(n.key), n.lock_ref))
    return out


def dev_triples(cache):
    names = {v: k for k, v in cache._ns.items()}
    return {((names[ns], toks), ln, lk) for (ns, toks), ln, lk in cache.tree.triples()}


def plan_fields(p):
    d = dict(vars(p))
    return d


def random_config(rng: random.Random) -> SchedulerConfig:
    prio = rng.random() < 0.3
    chunk = rng.choice([None, 16, 64, 256])
    return SchedulerConfig(
        schedule_policy=rng.choice(["fcfs", "lof", "lpm", "dfs-weight", "routing-key"]),
        page_size=rng.choice([1, 1, 4, 16]),
        max_prefill_tokens=rng.choice([64, 256, 4096]),
        chunked_prefill_size=chunk,
        max_running_requests=rng.choice([None, 3, 8, 64]),
        enable_priority_scheduling=prio,
        schedule_low_priority_values_first=rng.random() < 0.5,
        enable_priority_preemption=prio and rng.random() < 0.5,
        priority_scheduling_preemption_threshold=rng.choice([0, 1, 10]),
        disable_radix_cache=rng.random() < 0.1,
        enable_mixed_chunk=rng.random() < 0.2,
        prefill_max_requests=rng.choice([None, None, 2, 5]),
        truncation_align_size=rng.choice([None, None, 8]),
        lpm_fallback_queue_len=rng.choice([None, 4]),
    )


def make_request(rng, i, bases, vocab, now):
    base = bases[rng.randrange(len(bases))]
    prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    return Request(
        rid=f"r{i}", prompt_ids=prompt, max_new_tokens=rng.choice([1, 2, 5, 20, 300]),
        ignore_eos=rng.random() < 0.2, priority=rng.choice([None, 0, 1, 5, 20, -3]),
        routing_key=rng.choice([None, "", "a", "b", "c"]), extra_key=rng.choice([None, None, "ns1"]),
        return_logprob=rng.random() < 0.1, logprob_start_len=rng.choice([-1, 3, 10]), enqueue_time=now,
    )


def run_pair(seed: int, steps: int):
    rng = random.Random(seed)
    cfg = random_config(rng)
    kv = rng.choice([300, 800, 3000])
    ref = ReferenceScheduler(cfg, kv)
    dev = GpuScheduler(cfg, kv)
    vocab = rng.choice([3, 8, 50])
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(10, 120))] for _ in range(3)]
    goal = {}
    next_id = 0
    ratio = 0.7
    for t in range(steps):
        now = float(t)
        if rng.random() < 0.5:
            reqs = [make_request(rng, next_id + j, bases, vocab, now) for j in range(rng.randrange(1, 6))]
            next_id += len(reqs)
            for r in reqs:
                goal[r.rid] = rng.randrange(1, 8)
            ref.submit(reqs, now=now)
            dev.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=now)
        pa, pb = ref.step(ratio, now=now), dev.step(ratio, now=now)
        fa, fb = plan_fields(pa), plan_fields(pb)
        if cfg.schedule_policy == "random":
            fa.pop("queue_order"), fb.pop("queue_order")
        assert fa == fb, f"seed {seed} step {t}: " + ", ".join(
            f"{k}: {fa[k]!r} != {fb[k]!r}" for k in fa if fa[k] != fb.get(k))
        first = {rid: 7 for rid, s, e in pa.admitted}
        ref.complete_prefill(first)
        dev.complete_prefill(first)
        if ref.running and rng.random() < 0.7:
            if not ref.decode_fits():
                ra, rb = ref.retract_decode(), dev.retract_decode()
                assert ra == rb
                ratio = min(1.0, ratio + 0.1)
            else:
                assert dev.decode_fits()
            toks = {r.rid: rng.randrange(vocab) for r in ref.running}
            ref.decode(toks)
            dev.decode(toks)
            ratio = max(0.1, ratio - 0.05)
        done = [r.rid for r in ref.running if len(r.req.output_ids) >= goal[r.rid]]
        if done:
            ref.finish(done)
            dev.finish(done)
        assert (ref.available, ref.evictable, ref.protected) == (dev.available, dev.evictable, dev.protected), f"seed {seed} step {t}"
        assert [r.rid for r in ref.queue] == [r.rid for r in dev.queue]
        assert ref_triples(ref.cache) == dev_triples(dev.cache), f"seed {seed} step {t}: cache contents differ"
        ref.check_integrity()
        dev.check_integrity()


@pytest.mark.parametrize("seed", range(12))
def test_multi_step_runs_match_reference(seed):
    run_pair(seed, steps=60)
