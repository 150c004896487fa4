"""GpuScheduler (torch backend) against the reference scheduler over multi-step runs.

Both schedulers get the same arrivals, steps, prefills, decodes and finishes; after every call
the plans (every field) and the pool/cache sizes must be equal, the cache contents too
(compared as (prefix, key length, lock_ref) triples), and both integrity checks must pass.
`test_multi_step_runs_match_reference`: 12 random configs x 60 steps.
`test_200_step_runs_match_reference`: 200-step runs per policy (lpm, fcfs + priority with
preemption in both directions, dfs-weight, lof, routing-key, the cache disabled with ignore-EOS)
with retractions, preemptions, chunked prefills, aborts and arrivals interleaved.
"""

import random

import numpy as np
import pytest

from gpu_sched.config import SchedulerConfig
from gpu_sched.radix import FlatRadixTree
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.request import Request
from gpu_sched.scheduler import RT_FILL, RT_STAMP, RT_TOFF, GpuScheduler

from _scenarios import decode_pair, dev_triples, ref_triples


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


def run_pair(seed: int, steps: int, capture=None, config=None, request=None):
    """`steps` steps of a random workload on both schedulers (`config(rng)` and
    `request(rng, i, bases, vocab, now)` draw them: `random_config`, `make_request` by default),
    every plan, the queue, the pool sizes and the cache contents compared after each."""
    config, request = config or random_config, request or make_request
    rng = random.Random(seed)
    cfg = config(rng)
    kv = rng.choice([300, 800, 3000])
    ref = ReferenceScheduler(cfg, kv)
    dev = GpuScheduler(cfg, kv)
    if capture:
        dev.capture(**capture)
    vocab = rng.choice([3, 8, 50])
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(10, 120))] for _ in range(3)]
    goal = {}
    next_id = 0
    ratio = 0.7
    for t in range(steps):
        now = float(t)
        if rng.random() < 0.5:
            reqs = [request(rng, next_id + j, bases, vocab, now) for j in range(rng.randrange(1, 6))]
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
            ratio = decode_pair(ref, dev, rng, vocab, ratio)[0]
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


I64 = 2**63 - 1


def extreme_config(rng: random.Random) -> SchedulerConfig:
    """`random_config` with knobs at their bounds (config.PAGE_SIZE_MAX, config.TOKEN_KNOB_MAX for
    token counts, int64's ends for the others) where the device's int64 arithmetic would overflow were the
    bounds looser (the reference's Python ints never do)."""
    knobs = dict(
        max_prefill_tokens=[2**40, 2**40 - 1, 4096], clip_max_new_tokens=[2**40, 2**40 - 1, 0, 1],
        priority_scheduling_preemption_threshold=[I64, -I64 - 1, -1, 2**62], truncation_align_size=[2**40, 2**40 - 1],
        page_size=[2**20, 1024], max_running_requests=[I64, 1], prefill_max_requests=[I64],
        in_batch_prefix_caching_check_threshold=[I64], in_batch_prefix_caching_deprioritize_threshold=[I64])
    c = random_config(rng)
    ch = {k: rng.choice(v) for k, v in knobs.items() if rng.random() < 0.35}
    if c.chunked_prefill_size is not None and rng.random() < 0.3:
        ch["chunked_prefill_size"] = rng.choice([2**40, 2**39])
    return c.replace(**ch)


def extreme_request(rng, i, bases, vocab, now):
    """`make_request` with max_new_tokens and priorities at int64's ends now and then."""
    r = make_request(rng, i, bases, vocab, now)
    f = {k: getattr(r, k) for k in r.__dataclass_fields__}
    if rng.random() < 0.3:
        f["max_new_tokens"] = rng.choice([I64, I64 - 3, 2**62, 2**40])
    if rng.random() < 0.2:
        f["priority"] = rng.choice([I64, -I64 - 1])
    return Request(**f)


@pytest.mark.parametrize("seed", range(16))
def test_extreme_knobs_match_reference(seed):
    """Multi-step runs (`run_pair`) with knobs and request fields at their bounds: same plans,
    queue, pools and cache as the reference (a helper found the device admitting what the
    reference refused at CLIP = 2^63 - 1, and overflow errors past int64)."""
    run_pair(seed, steps=50, config=extreme_config, request=extreme_request)


@pytest.mark.parametrize("seed", [3, 4, 7])
@pytest.mark.parametrize("forms", ["torch-forms", "recorded"])
def test_extreme_knobs_match_reference_on_the_device_forms(seed, forms):
    """The same runs on the paths a GPU takes, on the CPU: every function's torch form
    (`policy.torch_forms`, the eager device path) and the recorded step (`capture`). A huge
    R-ORD-9 threshold T made them build [rows, T] head tensors (out of memory, or a size
    past int64); the heads' width now stops at the longest fill (or `max_len`)."""
    from gpu_sched.policy import torch_forms

    if forms == "recorded":
        run_pair(seed, steps=30, capture=dict(queue_capacity=64, running_capacity=64),
                 config=extreme_config, request=extreme_request)
    else:
        with torch_forms():
            run_pair(seed, steps=30, config=extreme_config, request=extreme_request)


# ---- 200-step runs per policy --------------------------------------------------------------------
# Each run interleaves arrivals (shared prefixes, some retracted-looking requests with outputs),
# steps, prefills (chunked), decodes with retraction under a tight pool, finishes and aborts of
# waiting requests; after every call both schedulers must agree on the plan (every field), the
# retracted rids, the queue, the pool/cache sizes and the cache contents, and pass integrity.
LONG_RUNS = {
    "lpm": dict(schedule_policy="lpm", page_size=1, chunked_prefill_size=48, max_prefill_tokens=160),
    "lpm-page4-mixed": dict(schedule_policy="lpm", page_size=4, chunked_prefill_size=64, enable_mixed_chunk=True,
                            max_running_requests=12, in_batch_prefix_caching_deprioritize_threshold=8),
    "fcfs-priority-preempt": dict(schedule_policy="fcfs", enable_priority_scheduling=True,
                                  enable_priority_preemption=True, priority_scheduling_preemption_threshold=1,
                                  max_running_requests=5, chunked_prefill_size=64),
    "fcfs-priority-low-first": dict(schedule_policy="fcfs", enable_priority_scheduling=True,
                                    schedule_low_priority_values_first=True, enable_priority_preemption=True,
                                    priority_scheduling_preemption_threshold=0, max_running_requests=4,
                                    page_size=4, chunked_prefill_size=None),
    "dfs-weight": dict(schedule_policy="dfs-weight", page_size=4, chunked_prefill_size=32, prefill_max_requests=3),
    "lof": dict(schedule_policy="lof", chunked_prefill_size=None, max_prefill_tokens=128, enable_priority_scheduling=True),
    "routing-key": dict(schedule_policy="routing-key", page_size=16, chunked_prefill_size=64,
                        truncation_align_size=32),
    "nocache-ignore-eos": dict(schedule_policy="lpm", disable_radix_cache=True, chunked_prefill_size=40),
    # R-ORD-6 with one stateful shuffle per scheduler, equal seeds (`seeded_shuffle`): the two
    # stay in step only if both call it at the same steps, an empty queue behind an in-flight
    # chunk included
    "random": dict(schedule_policy="random", chunked_prefill_size=32, max_prefill_tokens=256),
}


def seeded_shuffle(seed: int):
    """A stateful `shuffle(n)` (numpy's generator, seeded): every call draws once, for n = 0
    too, so two made with one seed return the same permutations only while they are called
    alike."""
    rng = np.random.default_rng(seed)
    return lambda n: np.random.default_rng(int(rng.integers(1 << 62))).permutation(n).tolist()


def _diff(a, b):
    fa, fb = plan_fields(a), plan_fields(b)
    for k in fa:
        if fa[k] != fb.get(k):
            return f"{k}: reference {fa[k]!r}, device {fb.get(k)!r}"
    return None


def run_long(name: str, seed: int, steps: int = 200, backend: str = "torch", capture=None, device="cpu",
             integrity: bool = True):
    """One 200-step run; `capture` (kwargs of GpuScheduler.capture) takes the recorded step.
    `integrity=False`: `check_integrity` (which enters the tree's deferred table entries) only
    at the end, so they build up over the run as in a serving loop; hits["deferred"] counts
    the steps that began with some."""
    rng = random.Random(f"{name}-{seed}")
    cfg = SchedulerConfig(**LONG_RUNS[name])
    kv = rng.choice([900, 1200])
    shuffles = [seeded_shuffle(seed), seeded_shuffle(seed)] if cfg.schedule_policy == "random" else [None, None]
    ref = ReferenceScheduler(cfg, kv, shuffle=shuffles[0])
    dev = GpuScheduler(cfg, kv, backend=backend, device=device, shuffle=shuffles[1])
    graph = dev.capture(**capture) if capture else None
    vocab = 6
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(16, 90))] for _ in range(3)]
    goal, next_id, ratio = {}, 0, 0.7
    ignore_p = 0.7 if cfg.disable_radix_cache else 0.1
    hits = {"admitted": 0, "chunked": 0, "preempted": 0, "retracted": 0, "finished": 0, "aborted": 0, "deferred": 0}

    def where(t, what):
        return f"{name} seed {seed} step {t}, {what}"

    def check(t, what, full=False, last=False):
        assert (ref.available, ref.evictable, ref.protected) == (dev.available, dev.evictable, dev.protected), \
            where(t, what) + f": sizes {(ref.available, ref.evictable, ref.protected)} != {(dev.available, dev.evictable, dev.protected)}"
        assert [r.rid for r in ref.queue] == [r.rid for r in dev.queue], where(t, what) + ": queues differ"
        if not full:
            return
        if not cfg.disable_radix_cache:
            ta, tb = ref_triples(ref.cache), dev_triples(dev.cache)
            assert ta == tb, where(t, what) + f": cache contents differ, only in reference {sorted(ta - tb)[:2]}, only in device {sorted(tb - ta)[:2]}"
        if integrity or last:
            ref.check_integrity()
            dev.check_integrity()

    for t in range(steps):
        now = float(t)
        if rng.random() < 0.3:
            reqs = []
            for _ in range(rng.choice([1, 1, 2, 4, 8])):
                r = make_request(rng, next_id, bases, vocab, now)
                r.ignore_eos = rng.random() < ignore_p
                if rng.random() < 0.05:
                    r.output_ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
                reqs.append(r)
                next_id += 1
                # most finish within a few tokens, some decode long enough to press on the pool
                goal[r.rid] = rng.randrange(1, 12) if rng.random() < 0.6 else rng.randrange(30, 90)
                if goal[r.rid] > 12 or rng.random() < 0.8:
                    r.max_new_tokens = goal[r.rid]
            ref.submit(reqs, now=now)
            dev.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=now)
        if ref.queue and rng.random() < 0.03:
            gone = [ref.queue[rng.randrange(len(ref.queue))].rid]
            ref.abort(gone)
            dev.abort(gone)
            hits["aborted"] += 1
        hits["deferred"] += dev.cache.tree._pend_n > 0
        pa, pb = ref.step(ratio, now=now), dev.step(ratio, now=now)
        d = _diff(pa, pb)
        assert d is None, where(t, "step") + ": " + d
        hits["admitted"] += len(pa.admitted)
        hits["chunked"] += pa.new_chunked_rid is not None
        hits["preempted"] += len(pa.preempted)
        check(t, "step", full=True)
        first = {rid: rng.randrange(vocab) for rid, s, e in pa.admitted}
        ref.complete_prefill(first)
        dev.complete_prefill(first)
        check(t, "complete_prefill")
        for _ in range(rng.choice([0, 1, 1, 2, 4])):  # decode steps between prefill steps
            if not ref.running:
                break
            fits_a = ref.decode_fits()
            fits_b = dev.decode_fits()
            assert fits_a == fits_b, where(t, "decode_fits")
            if not fits_a:
                ra, rb = ref.retract_decode(), dev.retract_decode()
                assert ra == rb, where(t, f"retract: {ra} != {rb}")
                hits["retracted"] += len(ra)
                ratio = min(1.0, ratio + 0.3)
            toks = {r.rid: rng.randrange(vocab) for r in ref.running}
            ref.decode(toks)
            dev.decode(toks)
            ratio = max(0.05, ratio - 0.03)
            check(t, "decode")
            done = [r.rid for r in ref.running
                    if len(r.req.output_ids) >= min(goal[r.rid], max(r.max_new, 1))]
            if done:
                ref.finish(done)
                dev.finish(done)
                hits["finished"] += len(done)
                check(t, "finish")
        check(t, "end of step", full=True, last=t == steps - 1)
    if graph is not None:
        hits["recorded"], hits["captures"] = graph.runs, graph.captures
    return hits


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_long_queue_runs_take_the_numpy_apply(policy, monkeypatch):
    """A run whose queue grows past SCALAR_BATCH (few running slots) orders through
    `FlatRadixTree._apply_host`: batches without a split by its numpy stamp walk, batches with
    splits by `_apply` handed the match ends it found; every step stays the reference's, cache
    contents and stamps included (they decide evictions)."""
    from gpu_sched.radix import SCALAR_BATCH, FlatRadixTree

    seen = {"numpy": 0, "splits": 0, "longest": 0, "small splits": 0}
    orig_host, orig_apply = FlatRadixTree._apply_host, FlatRadixTree._apply

    def spy(self, m, pos):
        seen["longest"] = max(seen["longest"], m.size)
        seen["numpy"] += m.size > SCALAR_BATCH
        return orig_host(self, m, pos)

    def spy_apply(self, m, pos, *a, ends=None, **k):
        if ends is not None and m.numel() > SCALAR_BATCH:  # handed over by `_apply_host`: a batch with splits
            seen["numpy"] -= 1
            seen["splits"] += 1
        elif ends is not None:  # a small batch whose walks found two or more splits
            seen["small splits"] += 1
        return orig_apply(self, m, pos, *a, ends=ends, **k)

    monkeypatch.setattr(FlatRadixTree, "_apply_host", spy)
    monkeypatch.setattr(FlatRadixTree, "_apply", spy_apply)
    monkeypatch.setitem(LONG_RUNS, "long-queue", dict(schedule_policy=policy, page_size=1, max_running_requests=3,
                                                      chunked_prefill_size=48))
    hits = run_long("long-queue", seed=5)
    assert seen["longest"] > SCALAR_BATCH and seen["numpy"] > 0 and seen["splits"] > 3, seen
    assert hits["admitted"] > 20 and hits["finished"] > 10, hits


@pytest.mark.parametrize("name", sorted(LONG_RUNS))
def test_200_step_runs_match_reference(name):
    hits = run_long(name, seed=0)
    # each run must exercise the interleavings it is there for
    assert hits["admitted"] > 60 and hits["finished"] > 40 and hits["aborted"] > 0, hits
    cfg = LONG_RUNS[name]
    if cfg.get("enable_priority_preemption"):
        assert hits["preempted"] > 0, hits
    elif not cfg.get("disable_radix_cache"):
        assert hits["retracted"] > 0, hits
    if cfg.get("chunked_prefill_size", 8192) is not None:
        assert hits["chunked"] > 0, hits


@pytest.mark.parametrize("name", sorted(set(LONG_RUNS) - {"nocache-ignore-eos"}))
@pytest.mark.parametrize("seed", [0, 1])
def test_runs_with_deferred_table_entries_match_reference(name, seed, monkeypatch):
    """The tree's deferred hash-table entries (`FlatRadixTree.DEFER_ENTRIES`: a host insert
    enters each new leaf's first page end only) left to build up across steps, as in a
    serving loop (no `check_integrity`, which enters them, until the end): every plan,
    queue, size and cache content equals the reference's: a step's searches are walks (the
    tree's first page ends only) and lpm's and dfs-weight's kept matches are checked by
    their pool positions (`FlatRadixTree._check_at_positions`), where an array search of
    many rows reads the whole table (every entry entered first)."""
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 0)  # deferred even where the table is read every step
    hits = run_long(name, seed=seed, integrity=False)
    assert hits["deferred"] > 25 and hits["admitted"] > 60 and hits["finished"] > 40, hits


@pytest.mark.parametrize("name", ["lpm", "fcfs-priority-preempt", "nocache-ignore-eos", "lpm-page4-mixed"])
@pytest.mark.parametrize("lead", [True, False], ids=["lead", "array"])
def test_admission_windows_match_reference(name, lead, monkeypatch):
    """Admission scans windows of 2, 4, 8, ... ordered requests (`GpuScheduler.admit_window`),
    fixed or starting from the previous step's admission count (`adaptive_window`): most loops
    cross several windows, eager and recorded, and every step stays the reference's. Windows
    past SCALAR_WINDOW on the host paths are decided by `_window_lead`, or with `lead` off by
    `admit_step_host`."""
    monkeypatch.setattr(GpuScheduler, "LEAD_WINDOWS", lead)
    monkeypatch.setattr(GpuScheduler, "admit_window", 2)
    monkeypatch.setattr(GpuScheduler, "adaptive_window", False)
    hits = run_long(name, seed=3)
    assert hits["admitted"] > 60, hits
    monkeypatch.setattr(GpuScheduler, "adaptive_window", True)  # first windows sized by the last step
    hits = run_long(name, seed=5)
    assert hits["admitted"] > 60, hits
    hits = run_long(name, seed=4, capture=dict(queue_capacity=32, running_capacity=32))
    assert hits["recorded"] > 10, hits


def test_huge_max_new_tokens_decide_as_the_reference(monkeypatch):
    """A request whose max_new_tokens is 2^63 - 1, with clip_max_new_tokens at its bound
    (config.TOKEN_KNOB_MAX, 2^40): a large window's int64 prefix sums (`_window_lead`) hold
    reservations of up to 2^40 each without wrapping, and the plan is the reference's (the
    refused request stops the loop)."""
    monkeypatch.setattr(GpuScheduler, "SCALAR_WINDOW", 0)  # every window large
    big = 2**63 - 1
    cfg = SchedulerConfig(schedule_policy="fcfs", clip_max_new_tokens=2**40, chunked_prefill_size=None,
                          max_prefill_tokens=10**6)
    plans = []
    for S in (ReferenceScheduler, GpuScheduler):
        s = S(cfg, 100000)
        reqs = [Request(rid=f"r{i}", prompt_ids=[7, i + 1], max_new_tokens=1) for i in range(33)]
        reqs.append(Request(rid="reserve", prompt_ids=[9, 9, 9, 9], max_new_tokens=60000))
        reqs.append(Request(rid="huge", prompt_ids=list(range(100, 100 + 50000)), max_new_tokens=big))
        reqs += [Request(rid=f"t{i}", prompt_ids=[8, i + 1], max_new_tokens=1) for i in range(100)]
        s.submit(reqs, now=0.0)
        plans.append(s.step(1.0))
    assert plans[0].stop == "add_no_token" and len(plans[0].admitted) == 34, (plans[0].stop, len(plans[0].admitted))
    assert plans[1].admitted == plans[0].admitted and plans[1].stop == plans[0].stop
    assert plans[1].budgets == plans[0].budgets


def test_window_after_a_loop_that_admitted_nothing(monkeypatch):
    """On the host paths a loop after one that admitted nothing starts with a window of
    SCALAR_WINDOW requests (decided one at a time) instead of `admit_window`: while the
    KV pool is full, step after step refuses the first request; the plans stay the reference's."""
    windows = []
    scalar, static = GpuScheduler._scalar_admission, GpuScheduler._static_admission
    monkeypatch.setattr(GpuScheduler, "_scalar_admission",
                        lambda self, rest, *a, **k: windows.append(("scalar", len(rest))) or scalar(self, rest, *a, **k))
    monkeypatch.setattr(GpuScheduler, "_static_admission",
                        lambda self, rest, *a, **k: windows.append(("static", len(rest))) or static(self, rest, *a, **k))
    scheds = [ReferenceScheduler(SchedulerConfig(), 400), GpuScheduler(SchedulerConfig(), 400)]
    for s in scheds:  # each its own Request objects: a step appends to their output_ids
        first = [Request(rid="big", prompt_ids=list(range(1, 331)), max_new_tokens=2)]
        first += [Request(rid=f"s{k}", prompt_ids=[1000 + 10 * k + j for j in range(10)], max_new_tokens=2)
                  for k in range(3)]
        queued = [Request(rid=f"r{i}", prompt_ids=[5000 + 60 * i + j for j in range(60)], max_new_tokens=2)
                  for i in range(300)]
        s.submit(first, now=0.0)
        assert [x[0] for x in s.step(1.0).admitted] == ["big", "s0", "s1", "s2"]
        s.complete_prefill({r.rid: 7 for r in first})
        s.submit(queued, now=1.0)
    windows.clear()
    for k in range(2):  # a finish makes room, but not enough for a 60-token prompt
        plans = []
        for s in scheds:
            s.finish([f"s{k}"])
            plans.append(s.step(1.0))
        assert plans[0].admitted == plans[1].admitted == [], plans[1].admitted
        assert plans[0].stop == plans[1].stop and list(plans[0].queue_order) == list(plans[1].queue_order)
    # after the loop that admitted four: an eighth more than that (`adaptive_window`); after
    # the one that admitted none: SCALAR_WINDOW, not admit_window (256)
    assert windows == [("scalar", 5), ("scalar", GpuScheduler.SCALAR_WINDOW)], windows
    plans = []
    for s in scheds:
        s.finish(["big"])
        plans.append(s.step(1.0))
    assert plans[0].admitted == plans[1].admitted and plans[0].admitted, plans[0].admitted
    assert plans[0].budgets == plans[1].budgets


@pytest.mark.parametrize("pmax", [None, 2])
def test_small_window_matches_only_the_rows_the_loop_reaches(pmax, monkeypatch):
    """A small window's rows are matched as the loop reaches them (`_ScalarMatcher`): a loop
    that stops at its fifth request (or third, at prefill_max_requests 2) searches those rows
    and not the window's other 15 or 17; the request it stops at is re-matched first, as the
    reference re-matches before add_one_req, so its match (which splits a cached node) is
    applied. Plans, budgets and cache sizes stay the reference's step after step."""
    searched = []  # rows searched (every row here is fresh: each takes the walk, `_find_lazy`)
    find, walk = GpuScheduler._find_rows_scalar, GpuScheduler._find_lazy
    monkeypatch.setattr(GpuScheduler, "_find_rows_scalar",
                        lambda self, rows, capped: searched.extend(rows.tolist()) or find(self, rows, capped))
    monkeypatch.setattr(GpuScheduler, "_find_lazy",
                        lambda self, row, capped=True: searched.append(row) or walk(self, row, capped))
    cfg = SchedulerConfig(schedule_policy="fcfs", chunked_prefill_size=None, max_prefill_tokens=250,
                          prefill_max_requests=pmax)
    scheds = [ReferenceScheduler(cfg, 100000), GpuScheduler(cfg, 100000)]
    for s in scheds:
        s.seed_cache(np.arange(1, 301, dtype=np.int32))
        # each shares 40 + 7i tokens with the cached one (its match ends inside that node), then 60 of its own
        s.submit([Request(rid=f"r{i}", prompt_ids=list(range(1, 41 + 7 * i)) + [5000 + i] * 60, max_new_tokens=4)
                  for i in range(20)], now=0.0)
    for step in range(4):
        searched.clear()
        plans = [s.step(1.0) for s in scheds]
        assert plan_fields(plans[1]) == plan_fields(plans[0]), step
        if step == 0:
            stop_at = 4 if pmax is None else 2
            assert [a[0] for a in plans[0].admitted] == [f"r{i}" for i in range(stop_at)]
            assert plans[0].stop == "add_other"
            assert len(searched) == stop_at + 1, searched  # the admitted rows and the one it stops at
        for s in scheds:
            s.complete_prefill({rid: 7 for rid, _, _ in plans[0].admitted})
        scheds[1].check_integrity()


def test_kept_capped_match_checked_against_the_whole_fill():
    """A capped match kept by an admission window (here: fcfs, lpm falling back at a queue
    over `lpm_fallback_queue_len`) holds the fill's hash one page past the cap, so when the
    next step orders by lpm and checks it against the whole fill (`_full_match`,
    `check_matches`), a cached page past the cap refuses it and the row is searched again:
    the full match, its stamps and R-ORD-9's deprioritized list stay the reference's."""
    X = list(range(1, 34))  # cached whole; r1's capped match (max_prefix_len 32) ends one page short
    cfg = SchedulerConfig(schedule_policy="lpm", lpm_fallback_queue_len=2, prefill_max_requests=1,
                          chunked_prefill_size=None)
    scheds = [ReferenceScheduler(cfg, 100000), GpuScheduler(cfg, 100000)]
    for s in scheds:
        s.seed_cache(np.array(X, dtype=np.int32))
        s.submit([Request(rid="r0", prompt_ids=[900 + i for i in range(10)], max_new_tokens=4),
                  Request(rid="r1", prompt_ids=X, max_new_tokens=4),
                  Request(rid="r2", prompt_ids=X[:32] + [777, 778, 779], max_new_tokens=4)], now=0.0)
    for step in range(3):
        plans = [s.step(1.0) for s in scheds]
        assert plans[1].to_dict() == plans[0].to_dict(), step
        assert plans[0].active_policy == ("fcfs" if step == 0 else "lpm"), step
        for s in scheds:
            s.complete_prefill({rid: 7 for rid, _, _ in plans[0].admitted})
    scheds[1].check_integrity()


def test_unadmitted_slice_and_general_filter():
    """R-STEP-4 on GpuScheduler: a leading run of admitted requests (after the in-flight chunk)
    is cut off as a slice; anything else gives the reference's filter."""
    ref, dev = ReferenceScheduler(SchedulerConfig(), 1000), GpuScheduler(SchedulerConfig(), 1000)
    for s in (ref, dev):
        s.submit([Request(rid=f"r{i}", prompt_ids=[1, 2, 3], max_new_tokens=4) for i in range(6)], now=0.0)
    for s in (ref, dev):
        q = list(s.queue)
        chunk = s._state(Request(rid="c", prompt_ids=[5, 6], max_new_tokens=4), 0.0)
        s.chunked = chunk
        cases = [[], q[:2], [chunk] + q[:3], q[1:3], [q[4], q[0]], [chunk, q[2]], q]
        got = [[r.rid for r in s._unadmitted(q, c)] for c in cases]
        want = [[r.rid for r in q if all(r is not x for x in c)] for c in cases]
        assert got == want, (type(s).__name__, got, want)
        s.chunked = None


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "array"])
@pytest.mark.parametrize("name", ["fcfs-priority-preempt", "lof", "routing-key"])
def test_kept_capped_matches_checked_in_windows(name, scalar, monkeypatch):
    """Policies that do not match while ordering keep each admission window's capped matches
    (`_checked_find` or `_ScalarMatcher`, tree version -2) and check them at the next step
    instead of searching: across a 200-step run with inserts, evictions and retractions
    between steps, kept matches must be both accepted and refused (the tree moved under
    them), and every step stays the reference's. `scalar`: small windows decided one request
    at a time (their checks by two lookups, `_ScalarMatcher.holds`), else every window by the
    array forms (`check_matches`)."""
    from gpu_sched.radix import FlatRadixTree
    from gpu_sched.scheduler import _ScalarMatcher

    seen = {"ok": 0, "refused": 0}
    if scalar:
        orig_holds = _ScalarMatcher.holds

        def spy_holds(self, *a):
            ok, pos = orig_holds(self, *a)
            seen["ok" if ok else "refused"] += 1
            return ok, pos

        monkeypatch.setattr(_ScalarMatcher, "holds", spy_holds)
    else:
        monkeypatch.setattr(GpuScheduler, "SCALAR_WINDOW", 0)
    orig = FlatRadixTree.check_matches

    def spy(self, lengths, guess, *a, **k):
        ok, pos = orig(self, lengths, guess, *a, **k)
        hinted = guess >= 0
        seen["ok"] += int((ok & hinted).sum())
        seen["refused"] += int((~ok & hinted).sum())
        return ok, pos

    monkeypatch.setattr(FlatRadixTree, "check_matches", spy)
    hits = run_long(name, seed=1)
    assert hits["admitted"] > 60, hits
    assert seen["ok"] > 20 and seen["refused"] > 0, seen


@pytest.mark.parametrize("per_row", [0, 1 << 40])
@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_kept_full_matches_by_log_or_by_lookups(name, per_row, monkeypatch):
    """Kept full matches are re-validated by the change log (`unchanged`) or, past
    `LOG_PER_ROW` logged hashes per row, by two lookups a row (`check_matches`): either way
    every step of a 200-step run stays the reference's, and the path asked for is taken."""
    from gpu_sched.radix import FlatRadixTree

    seen = {"log": 0, "lookups": 0}
    orig_un, orig_cm = FlatRadixTree.unchanged, FlatRadixTree.check_matches

    def un(self, since, *a, **k):
        seen["log"] += since.numel() > 0  # an empty log keeps every row without a test
        return orig_un(self, since, *a, **k)

    def cm(self, lengths, guess, *a, **k):
        seen["lookups"] += int((guess >= 0).sum())
        return orig_cm(self, lengths, guess, *a, **k)

    monkeypatch.setattr(GpuScheduler, "LOG_PER_ROW", per_row)
    monkeypatch.setattr(FlatRadixTree, "unchanged", un)
    monkeypatch.setattr(FlatRadixTree, "check_matches", cm)
    hits = run_long(name, seed=2)
    assert hits["admitted"] > 60, hits
    if per_row == 0:  # any logged hash at all sends the rows to lookups
        assert seen["log"] == 0 and seen["lookups"] > 50, seen
    else:
        assert seen["log"] > 10, seen


@pytest.mark.parametrize("name", ["lpm", "lpm-page4-mixed"])
def test_head_group_table_restarts_keep_decisions(name, monkeypatch):
    """R-ORD-9 group ids are interned once per fill; when the intern table outgrows the row
    table it starts anew and every row's id is recomputed when next needed. With no slack
    the table restarts at nearly every lpm step: decisions must stay the reference's."""
    restarts = []
    clear = dict.clear

    class CountingDict(dict):
        def clear(self):
            restarts.append(len(self))
            clear(self)

    orig = GpuScheduler.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        self._hg_id = CountingDict()

    monkeypatch.setattr(GpuScheduler, "__init__", init)
    monkeypatch.setattr(GpuScheduler, "HEAD_GROUP_SLACK", -(4 * 1024) + 8)  # restart past 8 ids (1024 rows)
    run_long(name, seed=1, steps=120)
    assert len(restarts) > 3, restarts


@pytest.mark.parametrize("recorded", [False, True])
def test_routing_key_table_stays_bounded_with_per_session_keys(monkeypatch, recorded):
    """Routing keys are often per session: every request here has its own (plus a few shared
    ones). Keys no row holds are dropped (`_rk_compact`) once the table outgrows the row
    table; decisions stay the reference's and the table stays bounded. `recorded`: through
    the recorded step, whose key ranks are uploaded again after every new key and compaction."""
    monkeypatch.setattr(GpuScheduler, "ROUTING_KEY_SLACK", -(2 * 1024) + 16)  # past 16 keys (1024 rows)
    rng = random.Random(5)
    cfg = SchedulerConfig(schedule_policy="routing-key", max_prefill_tokens=256, max_running_requests=16)
    ref, dev = ReferenceScheduler(cfg, 4000), GpuScheduler(cfg, 4000)
    graph = dev.capture(queue_capacity=1024, running_capacity=16) if recorded else None
    bases = [[rng.randrange(8) for _ in range(40)] for _ in range(3)]
    sizes, next_id = [], 0
    for t in range(150):
        reqs = []
        for _ in range(rng.randrange(1, 6)):
            r = make_request(rng, next_id, bases, 8, float(t))
            r.routing_key = rng.choice([f"session-{next_id}", "a", "b", None])
            reqs.append(r)
            next_id += 1
        ref.submit(reqs, now=float(t))
        dev.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=float(t))
        assert _diff(ref.step(0.7, now=float(t)), dev.step(0.7, now=float(t))) is None, f"step {t}"
        first = {r.rid: 1 for r in ref.prefilling}
        ref.complete_prefill(first)
        dev.complete_prefill(first)
        done = [r.rid for r in ref.running if rng.random() < 0.5]
        if done:
            ref.finish(done)
            dev.finish(done)
        assert [r.rid for r in ref.queue] == [r.rid for r in dev.queue]
        sizes.append(len(dev._rk_names))
        # held requests' keys, at most 16 more, and the last arrival batch's
        assert len(dev._rk_names) <= len(dev.reqs) + 16 + 5, (t, len(dev._rk_names), len(dev.reqs))
    assert len(dev._rt_owner) == 1024 and next_id > 300
    assert sum(b < a for a, b in zip(sizes, sizes[1:])) > 5  # compacted again and again
    if recorded:
        assert graph.runs > 100, graph.runs


@pytest.mark.parametrize("low_first", [False, True])
def test_fcfs_priority_with_enqueue_times_out_of_queue_order(low_first):
    """R-ORD-4 when callers stamp enqueue times that do not follow submission order (a trace
    replayed out of order): GpuScheduler sorts by time too (its one-sort path is only for a
    queue already in time order) and plans as the reference does; then in-order arrivals."""
    rng = random.Random(5 + low_first)
    cfg = SchedulerConfig(schedule_policy="fcfs", enable_priority_scheduling=True,
                          schedule_low_priority_values_first=low_first, max_prefill_tokens=40)
    ref, dev = ReferenceScheduler(cfg, 400), GpuScheduler(cfg, 400)
    for step in range(6):
        times = [rng.choice([0.0, 1.0, 1.0, 3.0, 9.0]) + (0 if step % 2 else step) for _ in range(12)]
        reqs = [Request(rid=f"s{step}r{i}", prompt_ids=[rng.randrange(5) for _ in range(rng.randrange(1, 9))],
                        max_new_tokens=4, priority=rng.choice([None, 0, 1, 1, 2]), enqueue_time=t)
                for i, t in enumerate(times)]
        for s in (ref, dev):
            s.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=float(step))
        pa, pb = ref.step(0.7, now=float(step)), dev.step(0.7, now=float(step))
        assert plan_fields(pa) == plan_fields(pb), f"step {step}"
        assert [r.rid for r in ref.queue] == [r.rid for r in dev.queue]
        first = {rid: 7 for rid, _, _ in pa.admitted}
        ref.complete_prefill(first)
        dev.complete_prefill(first)
    assert len(ref.queue) > 12  # the budget left requests waiting across steps


def test_routing_key_order_on_many_keys_equals_reference():
    """R-ORD-7 through GpuScheduler's host form (`_routing_perm_host`: running keys counted by
    string, the queue's distinct keys ranked once) against the reference, on key sets where
    string order matters ("B" < "a" < "ab" < "b" < "é"), ties in the running counts, running
    keys no queued request has, absent and "" keys on both sides, and no counted key at all."""
    rng = random.Random(21)
    alphabet = ["B", "a", "ab", "b", "é", "k1", "k10", "k2", None, ""]
    checked = 0
    for trial in range(60):
        cfg = SchedulerConfig(schedule_policy="routing-key")
        ref, dev = ReferenceScheduler(cfg, 100_000), GpuScheduler(cfg, 100_000)
        m = rng.choice([0, 1, 3, 12])
        run_keys = [rng.choice(alphabet if trial % 5 else [None, ""]) for _ in range(m)]
        for i, k in enumerate(run_keys):
            for s in (ref, dev):
                s.seed_running(Request(f"r{i}", [1 + i, 2], 4, output_ids=[3], routing_key=k, enqueue_time=0))
        n = rng.choice([1, 2, 40, 300])
        reqs = [Request(f"q{j}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))], 4,
                        routing_key=rng.choice(alphabet)) for j in range(n)]
        for s in (ref, dev):
            s.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=0.0)
        want = [r.rid for r in ref._order().queue]
        got = [r.rid for r in dev._order().queue]
        assert got == want, (trial, run_keys)
        checked += 1
    assert checked == 60


def test_child_ranks_compacted_tree():
    """dfs-weight's compacted tree for the torch forms (`GpuScheduler._child_ranks`: live nodes
    root first, parents remapped, siblings ranked by child order), on a cache with splits and
    evictions (dead ids among the live ones)."""
    from gpu_sched import policy as P

    rng = random.Random(5)
    s = GpuScheduler(SchedulerConfig(schedule_policy="dfs-weight"), 20_000)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    for _ in range(60):
        b = rng.choice(bases)
        s.seed_cache(b[: rng.randrange(1, len(b) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))])
    s.cache.tree.evict(150)
    with P.torch_forms():
        got = s._child_ranks()
    parent, rank, remap = (x.tolist() for x in got)
    assert parent[0] == -1 and len(parent) > 30 and -1 in remap  # evicted ids left holes
    by_parent = {}
    for v, p in enumerate(parent):
        by_parent.setdefault(p, []).append(rank[v])
    assert all(sorted(r) == list(range(len(r))) for r in by_parent.values())  # ranks 0..k-1 per parent


def test_fill_hashing_host_form_equals_torch_form_and_copies_keep_their_own_pools():
    """`_ensure_hashed` on the host paths (the chunk sums on the fill arrays, written into the
    CSR pools through their numpy views) leaves the same pools and row offsets as its torch
    form (`chunk_hashes_flat`, tensor writes), one fill at a time and in batches, through pool
    rebuilds; a deep copy's later fills go to the copy's pools only."""
    import copy

    import numpy as np
    import torch

    from gpu_sched import policy as P

    rng = random.Random(11)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(5, 300))] for _ in range(6)]
    # one hash seed: the two schedulers' hashes are compared
    scheds = [GpuScheduler(SchedulerConfig(schedule_policy="lpm", page_size=4), 100_000, hash_seed=3) for _ in range(2)]
    for s in scheds:
        s.POOL_MIN_TOKENS = 256  # rebuilds after a few fills
    for i in range(40):
        reqs = [make_request(rng, 100 * i + j, [bases[rng.randrange(6)]], 50, float(i)) for j in range(rng.choice([1, 1, 3]))]
        for k, s in enumerate(scheds):
            s.submit([copy.deepcopy(r) for r in reqs])
            rows = s._queue_rows(s.queue)
            if k:
                with P.torch_forms():
                    s._ensure_hashed(rows)
            else:
                s._ensure_hashed(rows)
        if i % 7 == 6:
            for s in scheds:
                s.abort([r.rid for r in s.queue][:3])
    (a, b) = scheds
    assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a._pools(), b._pools()))
    assert np.array_equal(a._rt[:, :], b._rt[:, :])
    assert a._qviews.held(a, "_qtok")  # the host path wrote through views
    a._rt_mv()  # a flat view of a's table is kept: the copy must not write through it
    twin = copy.deepcopy(a)
    before = [x.clone() for x in a._pools()]
    rt_before = a._rt.copy()
    r = make_request(rng, 9999, [bases[0]], 50, 99.0)
    twin.submit([r])
    row = int(twin._queue_rows(twin.queue)[-1])
    assert np.array_equal(a._rt, rt_before)  # the copy's row went to its own table
    assert int(twin._rt[row, RT_FILL]) == len(r.prompt_ids) and int(twin._rt[row, RT_TOFF]) == -1
    twin._ensure_hashed(np.array([row]))
    off, n = int(twin._rt[row, RT_TOFF]), len(r.prompt_ids)
    assert twin._pools()[0].numpy()[off : off + n].tolist() == list(r.prompt_ids)  # landed in the copy's pool
    assert all(torch.equal(x, y) for x, y in zip(a._pools(), before))
    assert np.array_equal(twin._pools()[0].numpy()[: a._qtop[0]], before[0].numpy())


def test_row_write_of_one_request_equals_the_batch_write():
    """`_write_rows` of one request (one indexed write) leaves the row the batch form leaves:
    priorities, enqueue times, namespaces, routing keys, ignore-EOS and max_prefix_len."""
    import numpy as np

    rng = random.Random(3)
    bases = [[rng.randrange(50) for _ in range(20)]]
    for disable in (False, True):
        cfg = SchedulerConfig(schedule_policy="fcfs", disable_radix_cache=disable)
        a, b = GpuScheduler(cfg, 10_000), GpuScheduler(cfg, 10_000)
        reqs = [make_request(rng, i, bases, 50, rng.random() * 1e6) for i in range(40)]
        a.submit(reqs)
        b.submit([Request(**vars(r)) for r in reqs])
        sa, sb = [a.reqs[r.rid] for r in reqs], [b.reqs[r.rid] for r in reqs]
        for st in sa:
            st.dev_row = a._new_row(st)
            a._write_rows([st])
        for st in sb:
            st.dev_row = b._new_row(st)
        b._write_rows(sb)
        ra = a._rt[[st.dev_row for st in sa]]
        rb = b._rt[[st.dev_row for st in sb]]
        ra[:, RT_STAMP] = rb[:, RT_STAMP] = 0  # one stamp per write call
        assert np.array_equal(ra, rb)


def test_step_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """`GpuScheduler.pause_gc`: the collector is off during `step` and back in its earlier
    state after it, also when the step raises; with pause_gc False it is left alone."""
    import gc

    seen = []
    s = GpuScheduler(SchedulerConfig(schedule_policy="lpm"), 10_000)
    order = s._order
    monkeypatch.setattr(s, "_order", lambda: (seen.append(gc.isenabled()), order())[1])
    was = gc.isenabled()
    try:
        gc.enable()
        for i in range(3):
            s.submit([Request(f"r{i}", list(range(5 + i)), max_new_tokens=4)])
            plan = s.step(0.5)
            s.complete_prefill({rid: 7 for rid, _, _ in plan.admitted})
            assert gc.isenabled() and plan.admitted
        assert seen == [False] * 3
        with pytest.raises(ValueError):
            s.step(0.0)  # refused before anything changes
        assert gc.isenabled()
        gc.disable()
        s.submit([Request("off", [1, 2, 3], max_new_tokens=4)])
        plan = s.step(0.5)
        s.complete_prefill({rid: 7 for rid, _, _ in plan.admitted})
        assert not gc.isenabled()  # left off, as it was
        gc.enable()
        s.pause_gc = False
        s.submit([Request("on", [4, 5, 6], max_new_tokens=4)])
        s.step(0.5)
        assert seen[-1] is True and gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_dfs_weight_host_form_on_tree_ids_equals_torch_form():
    """dfs-weight's host order (`GpuScheduler._dfs_weight_perm_host`: the tree's own ids,
    dead slots detached, siblings by creation-order stamps, no compaction) equals its torch
    form (the compacted tree of `_child_ranks`, `dfs_weight_order`'s torch passes) on caches
    with splits, evictions (dead ids among the live ones) and re-used slots, for random
    last-node assignments including the root."""
    import torch

    from gpu_sched import policy as P

    for seed in range(4):
        rng = random.Random(seed)
        s = GpuScheduler(SchedulerConfig(schedule_policy="dfs-weight"), 20_000)
        bases = [[rng.randrange(50) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
        tree = s.cache.tree
        for _ in range(12):  # creation stamps run far past the node ids; old and new siblings
            for _ in range(40):
                b = rng.choice(bases)
                s.seed_cache(b[: rng.randrange(1, len(b) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))])
            tree.evict(rng.randrange(100, 400))
        alive = tree._np("alive")[: tree.node_bound()]
        live = np.flatnonzero(alive)
        assert (~alive).any() and live.size > 30  # dead ids among the live ones
        assert int(tree._np("order")[live].max()) > 2 * tree.node_bound()
        for trial in range(8):
            few = rng.sample(live.tolist(), rng.choice([3, 10, live.size]))
            if trial % 2:  # ties and near-ties of weight
                last = torch.tensor([rng.choice(few) for _ in range(rng.randrange(1, 200))])
            else:  # one request on each of some nodes: sibling weights differ by one
                last = torch.tensor(rng.sample(live.tolist(), rng.randrange(1, live.size)))
            got = torch.from_numpy(s._dfs_weight_perm_host(last.numpy()))
            with P.torch_forms():
                want = s._ranked_perm("dfs-weight", None, None, last)
            assert torch.equal(got, want), (seed, trial)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_lazy_first_match_equals_the_pooled_search(page_size, monkeypatch):
    """`GpuScheduler._find_lazy` (an admission window's first match of a row whose fill is not
    hashed: a walk of the tree on the fill's tokens, `FlatRadixTree._walk_scalar`) finds the
    length and position the search over the pooled, fully hashed fill finds, and the same
    hashes where `check_matches` probes them (at the length when it is over 0, one page on
    when that is within the capped length), for matches that end at a node's end, inside a
    node (split or not) and across several nodes, namespaces and capped lengths; and a fcfs
    run whose first matches all take it makes the reference's plans."""
    from gpu_sched.scheduler import RT_CAP, RT_FILL

    rng = random.Random(page_size)
    bases = [[rng.randrange(1, 30000) for _ in range(rng.randrange(50, 900))] for _ in range(4)]

    def requests(tag):
        out = []
        for i in range(40):
            b = rng.choice(bases)
            prompt = b[: rng.randrange(0, len(b) + 1)] + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 300))]
            out.append(Request(rid=f"{tag}{i}", prompt_ids=prompt, max_new_tokens=4, extra_key=rng.choice([None, None, "ns1"])))
        return out

    def seeded(s):
        for k, b in enumerate(bases):
            s.seed_cache(b, extra_key="ns1" if k == 3 else None)
            s.seed_cache(b[: len(b) // 2] + [7] * 40)
        return s

    cfg = SchedulerConfig(schedule_policy="fcfs", page_size=page_size)
    s = seeded(GpuScheduler(cfg, 400_000))
    s.submit(requests("q"), now=0.0)
    rows = s._queue_rows(s.queue)
    P = page_size
    assert (s._rt[rows, RT_TOFF] < 0).all()  # not hashed: every row takes the walk
    got = {c: np.stack([np.array(s._find_lazy(int(r), c), dtype=np.int64) for r in rows], axis=1)
           for c in (True, False)}  # capped at max_prefix_len (admission) and full-length (ordering)
    s._ensure_hashed(rows)
    for capped in (True, False):
        want = s._find_rows_scalar(rows, capped=capped)  # hashed: the pooled search
        Lq = (np.minimum(s._rt[rows, RT_FILL], s._rt[rows, RT_CAP]) if capped else s._rt[rows, RT_FILL]) // P * P
        assert want[0].max() > 2 * 33 and (want[0] == 0).any()  # long matches, and misses at the root
        assert ((want[0] > 0) & (want[0] < Lq)).sum() > 5  # matches that stop before the searched length
        g = got[capped]
        assert np.array_equal(g[:2], want[:2]), capped
        h1 = want[0] > 0
        assert np.array_equal(g[2][h1], want[2][h1]), capped
        h2 = want[0] + P <= s._rt[rows, RT_FILL] // P * P  # the fill's own tokens reach it (past the cap too)
        assert np.array_equal(g[3][h2], want[3][h2]), capped
    # whole steps with every first match a walk (windows of many fresh rows too), against the reference
    monkeypatch.setattr(GpuScheduler, "LAZY_FIND_TOKENS", 16)
    cfg = SchedulerConfig(schedule_policy="fcfs", page_size=page_size, max_prefill_tokens=700,
                          chunked_prefill_size=None)
    ref, dev = seeded(ReferenceScheduler(cfg, 400_000)), seeded(GpuScheduler(cfg, 400_000))
    reqs = requests("r")
    for s in (ref, dev):
        s.submit([Request(**{f: getattr(r, f) for f in r.__dataclass_fields__}) for r in reqs], now=0.0)
    admitted = 0
    for step in range(12):
        pa, pb = ref.step(0.5), dev.step(0.5)
        assert pa.to_dict() == pb.to_dict(), step
        admitted += len(pa.admitted)
        done = {rid: 1 for rid, _, _ in pa.admitted}
        ref.complete_prefill(done)
        dev.complete_prefill(done)
    assert admitted > 10


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_one_arrival_ordering_equals_the_array_path(policy, page_size):
    """`GpuScheduler._order_one` (lpm / dfs-weight ordering of a queue of one request without a
    kept match, in Python) leaves what the array path leaves: the same order result (capped
    length, R-ORD-9's outcome with T == 0 and T > 0, check thresholds -1, 0 and above every
    match), the row's kept-match columns, and the tree's splits, stamps, creation ids and
    clock; whole runs of single arrivals (most taking it) make the reference's plans."""
    from gpu_sched.scheduler import RT_H1, RT_H2, RT_MLEN, RT_MPOS, RT_MVER

    cols = [RT_MVER, RT_MLEN, RT_MPOS, RT_H1, RT_H2]
    taken = 0
    for seed, (T, check) in enumerate([(0, 0), (0, 10**6), (0, -1), (3, 10**6), (32, 32), (8, 0)]):
        rng = random.Random(seed)
        cfg = SchedulerConfig(schedule_policy=policy, page_size=page_size, max_prefill_tokens=64,
                              chunked_prefill_size=None, in_batch_prefix_caching_deprioritize_threshold=T,
                              in_batch_prefix_caching_check_threshold=check)
        # one hash seed: the rows' kept hashes are compared
        ref, fast, slow = ReferenceScheduler(cfg, 3000), GpuScheduler(cfg, 3000, hash_seed=5), GpuScheduler(cfg, 3000, hash_seed=5)
        slow._order_one = lambda policy, rows: None  # the array path throughout
        calls = []
        one = fast._order_one
        fast._order_one = lambda policy, rows: calls.append(one(policy, rows)) or calls[-1]
        bases = [[rng.randrange(1, 9) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
        for s in (ref, fast, slow):
            s.seed_cache(bases[0][:40])
        for t in range(40):
            b = rng.choice(bases)
            r = Request(rid=f"r{t}", prompt_ids=b[: rng.randrange(len(b) + 1)] + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 9))],
                        max_new_tokens=rng.choice([1, 3]), enqueue_time=float(t), extra_key=rng.choice([None, "ns"]))
            for s in (ref, fast, slow):
                s.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__})], now=float(t))
            if rng.random() < 0.3:  # a second arrival now and then: the array path on both
                continue
            rows = fast._queue_rows(fast.queue)
            plans = [s.step(0.7, now=float(t)) for s in (ref, fast, slow)]
            assert plan_fields(plans[0]) == plan_fields(plans[1]) == plan_fields(plans[2]), (seed, t)
            ta, tb = fast.cache.tree, slow.cache.tree
            assert (ta.clock, ta.next_cid) == (tb.clock, tb.next_cid), (seed, t)
            b_ = ta.node_bound()
            for name in ("parent", "key_len", "key_off", "last_access", "cid", "lock_ref"):
                assert np.array_equal(ta._np(name)[:b_], tb._np(name)[:b_]), (seed, t, name)
            # the same row numbers on both (same arrivals, same frees); versions are numbered
            # across trees, so a kept match's is compared as "this tree's current one or not"
            ka, kb = fast._rt[rows][:, cols], slow._rt[rows][:, cols]
            assert np.array_equal(ka[:, 0] == ta.version, kb[:, 0] == tb.version), (seed, t)
            assert np.array_equal(ka[:, 1:], kb[:, 1:]), (seed, t)
            first = {rid: 5 for rid, _, _ in plans[0].admitted}
            for s in (ref, fast, slow):
                s.complete_prefill(first)
                done = [x.rid for x in s.running]
                s.finish(done)
        taken += sum(c is not None for c in calls)
    assert taken > 50  # most single-arrival steps took the Python path


@pytest.mark.parametrize("form", ["reference", "host", "torch-forms", "recorded", "triton"])
def test_in_flight_chunk_with_more_mixed_tokens_than_the_chunk_size(form):
    """enable_mixed_chunk with more running requests than chunked_prefill_size leaves rem_chunk
    < 0, and R-ADM-5 read literally gives the in-flight chunk a negative extend range (a plan
    PrefillPlan.from_dict refuses, and complete_prefill could not allocate it: the scheduler
    was stuck). Every form gives it no tokens instead, as at rem_chunk 0, and the chunk goes on
    once the running batch is small enough (a helper's finding, session 51)."""
    import contextlib

    from gpu_sched.plan import PrefillPlan
    from gpu_sched.policy import torch_forms

    cfg = SchedulerConfig(chunked_prefill_size=2, enable_mixed_chunk=True)

    def make(kind):
        s = ReferenceScheduler(cfg, 1000) if kind == "reference" else GpuScheduler(
            cfg, 1000, backend="triton" if kind == "triton" else "torch")
        for i in range(3):
            s.seed_running(Request(rid=f"run{i}", prompt_ids=[5, i], output_ids=[1], max_new_tokens=10))
        s.seed_chunked(Request(rid="c", prompt_ids=[7] * 20, max_new_tokens=10), 4)
        if kind == "recorded":
            s.capture(queue_capacity=8, running_capacity=8)
        return s

    ref, s = make("reference"), make(form)
    ends = []
    with torch_forms() if form == "torch-forms" else contextlib.nullcontext():
        for k in range(3):
            pa, pb = ref.step(0.7), s.step(0.7)
            assert plan_fields(pa) == plan_fields(pb), k
            (rid, a, b), = pb.admitted
            assert rid == "c" and pb.chunked_rid_after == "c" and a <= b
            assert PrefillPlan.from_dict(pb.to_dict()).to_dict() == pb.to_dict()
            ends.append(b)
            for x in (ref, s):
                x.complete_prefill({})
                x.check_integrity()
                x.finish([x.running[0].rid])  # the batch shrinks: 2, 1, 0 running after
    assert ends == [4, 4, 5], ends  # rem_chunk -1, 0, then 2 - 1 = 1 token


@pytest.mark.parametrize("windows", ["one", "many"])
@pytest.mark.parametrize("form", ["scalar", "static", "torch-forms", "recorded", "triton"])
def test_one_chunk_a_step_in_and_across_admission_windows(form, windows):
    """A truncation_align_size that is not a multiple of the page size leaves room for a second
    chunk after the first; SPEC.md's R-ADM-3.7 would chunk it and make it the new chunked
    request, leaving the first cut short and not the chunked request (complete_prefill could
    not finish it: KeyError, half-applied; a helper's finding, session 51). Both schedulers
    refuse the second chunk (OTHER), in one admission window (each form's own rule: the
    scalar loop, the static admission's host and torch forms, the recorded step, triton's
    round kernel) and, with windows of one request, across windows (the rule then holds for
    the scheduler's loop over windows); against the reference, then complete_prefill and a
    second step."""
    import contextlib

    from gpu_sched.policy import torch_forms

    cfg = SchedulerConfig(page_size=3, chunked_prefill_size=9, truncation_align_size=5)
    reqs = [Request(rid=x, prompt_ids=[i + 1] * 10, max_new_tokens=4) for i, x in enumerate("abc")]
    ref = ReferenceScheduler(cfg, 1000)
    s = GpuScheduler(cfg, 1000, backend="triton" if form == "triton" else "torch")
    if windows == "many":
        s.admit_window, s.adaptive_window = 1, False
    if form != "scalar":
        s.SCALAR_WINDOW = 0
    if form == "recorded":
        s.capture(queue_capacity=8, running_capacity=8, admit_window=1 if windows == "many" else 8)
    for x in (ref, s):
        x.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=0.0)
    with torch_forms() if form == "torch-forms" else contextlib.nullcontext():
        for step in range(2):
            pa, pb = ref.step(0.7), s.step(0.7)
            assert plan_fields(pa) == plan_fields(pb), (form, step)
            if step == 0:
                assert pb.admitted == [("a", 0, 3)] and pb.new_chunked_rid == "a" and pb.stop == "add_other"
            for x in (ref, s):
                x.complete_prefill({rid: 1 for rid, a, b in pb.admitted if b == 10})
                x.check_integrity()
    assert pb.admitted[0] == ("a", 3, 10), pb.admitted  # the chunk goes on (R-ADM-5: not page-aligned)


@pytest.mark.parametrize("form", ["scalar", "static", "triton"])
def test_one_chunk_a_step_on_the_ignore_eos_path(form):
    """R-ADM-6's chunk (the cache disabled, an ignore-EOS request) after a chunk cut short by
    truncation_align_size: refused too (SPEC.md would make it the new chunked request)."""
    cfg = SchedulerConfig(disable_radix_cache=True, chunked_prefill_size=64, truncation_align_size=48)
    reqs = [Request(rid="a", prompt_ids=[1] * 100, max_new_tokens=5),
            Request(rid="b", prompt_ids=[2] * 100, max_new_tokens=5, ignore_eos=True)]
    ref = ReferenceScheduler(cfg, 1000)
    s = GpuScheduler(cfg, 1000, backend="triton" if form == "triton" else "torch")
    if form != "scalar":
        s.SCALAR_WINDOW = 0
    for x in (ref, s):
        x.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=0.0)
    pa, pb = ref.step(0.7), s.step(0.7)
    assert plan_fields(pa) == plan_fields(pb)
    assert (pb.admitted, pb.new_chunked_rid, pb.stop) == ([("a", 0, 48)], "a", "add_other")
    for x in (ref, s):
        x.complete_prefill({})
        x.check_integrity()


@pytest.mark.parametrize("forms", ["host", "torch-forms"])
def test_head_groups_separate_token_ids_equal_mod_p(forms):
    """R-ORD-9 groups by the first T fill tokens: heads that differ only in token ids 0 and
    2^31 - 1 (equal modulo the head hash's prime) are different groups, as the reference's
    token comparison says (before the limb hash, GpuScheduler put them in one group and
    deprioritized one; `prefill_max_requests=2` makes the order visible in the admitted ids).
    On the host paths and on the torch forms the recorded step runs."""
    from gpu_sched import policy as P

    M = 2**31 - 1
    cfg = SchedulerConfig(schedule_policy="lpm", prefill_max_requests=2)
    prompts = {"a": [M] + [5] * 40, "b": [0] + [5] * 40, "c": [7] * 41}
    plans = []
    for S in (ReferenceScheduler, GpuScheduler):
        s = S(cfg, 10_000) if S is ReferenceScheduler else S(cfg, 10_000, backend="torch", device="cpu")
        s.submit([Request(rid=k, prompt_ids=p, max_new_tokens=4) for k, p in prompts.items()], now=0.0)
        if S is GpuScheduler and forms == "torch-forms":
            with P.torch_forms():
                plans.append(plan_fields(s.step(1.0)))
        else:
            plans.append(plan_fields(s.step(1.0)))
    assert plans[0] == plans[1]
    assert list(plans[0]["deprioritized"]) == []


def _colliding_prompts(B2: int, n: int = 128, lo: int = 64, seed: int = 1):
    """Two prompts that differ from position `lo` on, only by token ids 0 and 2^31 - 1 (equal
    modulo the first hash's prime p1, so its component cannot tell them apart), chosen by a
    birthday search over the second component with base B2 so that their prefix hashes at
    depth n are equal."""
    from gpu_sched.radix import P2

    M = 2**31 - 1
    w = [pow(B2, n - 1 - k, P2) for k in range(n)]
    pos = list(range(lo, n))[:48]
    rng, seen = np.random.default_rng(seed), {}
    while True:  # two subsets of positions whose weights sum alike mod p2
        mask = int(rng.integers(1, 1 << len(pos)))
        s = sum(w[pos[j]] for j in range(len(pos)) if mask >> j & 1) % P2
        if seen.get(s, mask) != mask:
            other = seen[s]
            break
        seen[s] = mask
    a, b = [5] * n, [5] * n
    for j, k in enumerate(pos):
        d = (mask >> j & 1) - (other >> j & 1)
        if d:
            a[k], b[k] = (M, 0) if d > 0 else (0, M)
    return a, b


def test_prefix_hash_bases_are_secret_by_default():
    """Prefix matching trusts the tree's 62-bit prefix hashes. With bases anyone can know (the
    tree's default seed 0), two prompts can be crafted in under a second whose hashes collide
    at depth 128 while they differ from token 64 on, and the second would reuse the first's
    KV for tokens 64..127. GpuScheduler draws its seed from the OS's entropy by default, so
    the pair crafted for seed 0 matches as the reference matches it (64 tokens); an explicit
    `hash_seed` makes the bases reproducible; bad seeds are refused."""
    from gpu_sched.radix import FlatRadixTree

    known = FlatRadixTree(page_size=1, max_nodes=4, token_capacity=4)  # seed 0's bases
    a, b = _colliding_prompts(known.B2)
    cfg = SchedulerConfig(schedule_policy="lpm", page_size=64)
    plans = []
    for s in (ReferenceScheduler(cfg, 100_000), GpuScheduler(cfg, 100_000)):
        s.submit([Request(rid="a", prompt_ids=a, max_new_tokens=1)], now=0.0)
        s.step(1.0)
        s.complete_prefill({"a": 9})
        s.finish(["a"])  # a's 128 tokens enter the cache
        # ten of them: the array search (one or two take the scalar walk, which compares tokens)
        s.submit([Request(rid=f"b{i}", prompt_ids=b + [9, i], max_new_tokens=1) for i in range(10)], now=1.0)
        plans.append(plan_fields(s.step(1.0)))
    assert plans[0] == plans[1] and plans[0]["admitted"][0] == ("b0", 64, 130)
    seeds = {GpuScheduler(cfg, 100).hash_seed for _ in range(3)}
    assert len(seeds) == 3 and all(isinstance(x, int) and x >= 0 for x in seeds)
    t1, t2 = (GpuScheduler(cfg, 100, hash_seed=7).cache.tree for _ in range(2))
    assert (t1.B1, t1.B2) == (t2.B1, t2.B2) != (known.B1, known.B2)
    for bad in (-1, 1.5, True, "7", np.int64(-1)):
        with pytest.raises(ValueError, match="hash_seed must be None or an int >= 0"):
            GpuScheduler(cfg, 100, hash_seed=bad)
    assert type(GpuScheduler(cfg, 100, hash_seed=np.int64(7)).hash_seed) is int
