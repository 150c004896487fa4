"""GpuScheduler's queue and plan lists as row-table views (gpu_sched/row_queue.py): they read
like lists, and views an engine keeps (an old plan's queue_order, a copy of the queue) keep
their values when the rows under them are freed and reused for other requests."""

import random

import numpy as np
import pytest

from gpu_sched.config import SchedulerConfig
from gpu_sched.plan import PrefillPlan
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.request import Request
from gpu_sched.row_queue import LazyList, RowQueue
from gpu_sched.scheduler import GpuScheduler
from _scenarios import decode_pair


def reqs(n, start=0, seed=0):
    rng = random.Random(seed + start)
    return [Request(rid=f"r{start + i}", prompt_ids=[rng.randrange(5) for _ in range(rng.randrange(3, 40))],
                    max_new_tokens=rng.choice([2, 8, 30]), priority=rng.choice([None, 0, 3]), enqueue_time=float(i))
            for i in range(n)]


def test_queue_reads_like_a_list():
    s = GpuScheduler(SchedulerConfig(schedule_policy="lof", max_prefill_tokens=64), 2000)
    s.submit(reqs(30))
    s.step(0.5)
    q = s.queue
    assert isinstance(q, RowQueue) and len(q.rows) > 0 and not q.tail  # the step left rows only
    items = list(q)
    assert len(items) == len(q) > 0 and bool(q)
    assert [q[i] for i in range(len(q))] == items and q[-1] is items[-1] and q[-len(q)] is items[0]
    assert q[2:7] == items[2:7] and q[::2] == items[::2] and q[5:2] == []
    assert q == items and items == q and q != items[:-1] and q != "abc"
    assert repr(q) == repr(items)
    with pytest.raises(IndexError):
        q[len(q)]
    x = s._state(Request(rid="tail", prompt_ids=[1, 2], max_new_tokens=1), 0.0)
    q.append(x)  # the tail, before its row is looked up
    assert q[-1] is x and list(q) == items + [x] and q[len(items) - 1 : len(items) + 1] == [items[-1], x]
    head, rows = q.window(0, 3)
    assert head == items[:3] and rows is not None and list(rows) == list(q.rows[:3])
    assert q.window(len(items) - 1, len(items) + 1) == ([items[-1], x], None)
    assert list(q.after(4)) == items[4:] + [x]
    s.queue = items[::-1] + [x]  # a reordering can be assigned; rows are looked up at the next step
    assert isinstance(s.queue, RowQueue) and list(s.queue) == items[::-1] + [x]


def test_queue_assignment_only_reorders():
    """Assigning `sched.queue` reorders the waiting requests; anything else (an unknown item, a
    running request, a duplicate, a dropped request) raises, naming the request, and leaves the
    scheduler as it was: its next steps equal a reference scheduler's given the same reorder."""
    cfg = SchedulerConfig(schedule_policy="fcfs", max_prefill_tokens=64)
    s, ref = GpuScheduler(cfg, 2000), ReferenceScheduler(cfg, 2000)
    for x in (s, ref):
        x.submit(reqs(12))
    assert vars(s.step(0.5)) == vars(ref.step(0.5))
    for x in (s, ref):
        x.complete_prefill({r.rid: 1 for r in x.prefilling})
    running, waiting = s.running[0], list(s.queue)
    assert len(waiting) > 3
    other = GpuScheduler(cfg, 2000)
    other.submit(reqs(1, start=50))
    bad = [([1, 2], TypeError, "item 0 is int"), ("abc", TypeError, "sequence of request states"),
           (waiting + [running], ValueError, f"{running.rid!r} .item {len(waiting)}. is not waiting"),
           (waiting + [waiting[1]], ValueError, f"{waiting[1].rid!r} appears more than once"),
           (waiting[1:], ValueError, f"waiting request {waiting[0].rid!r} is missing"),
           (waiting[:-1] + list(other.queue), ValueError, "is not waiting in this scheduler"),
           ([], ValueError, f"missing .{len(waiting)} in all.")]
    for value, err, msg in bad:
        with pytest.raises(err, match=msg):
            s.queue = value
        assert list(s.queue) == waiting
    order = waiting[::-1]
    s.queue = order
    ref.queue = [ref.reqs[r.rid] for r in order]
    for _ in range(3):
        assert vars(s.step(0.5)) == vars(ref.step(0.5))
        for x in (s, ref):
            x.complete_prefill({r.rid: 1 for r in x.prefilling})


def test_lazy_list():
    made = []

    def make():
        made.append(1)
        return [10, 20, 30]

    v = LazyList(3, make, lambda i: (10, 20, 30)[i])
    assert len(v) == 3 and v[1] == 20 and v[-1] == 30 and not made  # one item: nothing made
    assert v == [10, 20, 30] and v[:2] == [10, 20] and made == [1]
    assert v != [10, 20] and list(v) == [10, 20, 30] and made == [1]  # made once


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "routing-key"])
def test_views_survive_row_reuse(policy, monkeypatch):
    """Tiny pools and row table: every few arrivals rebuild the pools and reuse the rows of
    finished and aborted requests. Plans and queue copies taken earlier must keep their rids,
    and every step must stay the reference's."""
    monkeypatch.setattr(GpuScheduler, "ROW_TABLE_MIN", 2)
    monkeypatch.setattr(GpuScheduler, "POOL_MIN_TOKENS", 64)
    cfg = SchedulerConfig(schedule_policy=policy, max_prefill_tokens=48, chunked_prefill_size=None,
                          enable_priority_scheduling=policy == "fcfs")
    ref, dev = ReferenceScheduler(cfg, 3000), GpuScheduler(cfg, 3000)
    kept = []  # (frozen rids, view) pairs
    pins = []
    for cls in (RowQueue, LazyList):
        monkeypatch.setattr(cls, "pin", lambda self, _f=cls.pin: (pins.append(1), _f(self))[1])
    n = 0
    rng = random.Random(7)
    for t in range(40):
        new = reqs(rng.randrange(1, 6), start=n, seed=t)
        for r in new:
            r.routing_key = rng.choice([None, "a", "b"])
        n += len(new)
        ref.submit(new, now=float(t))
        dev.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in new], now=float(t))
        pa, pb = ref.step(0.7, now=float(t)), dev.step(0.7, now=float(t))
        order = pb.queue_order  # read item by item: the view itself stays lazy
        assert pa.admitted == pb.admitted and pa.queue_order == [order[i] for i in range(len(order))], t
        assert pa.num_matched == pb.num_matched and pa.deprioritized == pb.deprioritized, t
        kept.append((list(pa.queue_order), pb.queue_order))
        kept.append(([r.rid for r in ref.queue], dev.queue.copy()))
        done = {r: 1 for r, _, _ in pa.admitted}
        ref.complete_prefill(done)
        dev.complete_prefill(done)
        fin = [r.rid for r in ref.running]
        ref.finish(fin)
        dev.finish(fin)
        if ref.queue and rng.random() < 0.3:
            gone = [ref.queue[rng.randrange(len(ref.queue))].rid]
            ref.abort(gone)
            dev.abort(gone)
        assert [r.rid for r in ref.queue] == [r.rid for r in dev.queue], t
    for want, view in kept:
        got = [getattr(x, "rid", x) for x in view]
        assert got == want
    assert pins  # views were pinned before their rows were reused
    assert np.all(dev._rt[1:, 0] >= 0)


def test_abort_drops_rows_and_tail():
    """abort() of waiting requests: by row (queue after a step) and from the tail (arrived
    since), the rest in order, as the reference."""
    cfg = SchedulerConfig(schedule_policy="fcfs", max_prefill_tokens=40)
    ref, dev = ReferenceScheduler(cfg, 2000), GpuScheduler(cfg, 2000)
    for s in (ref, dev):
        s.submit(reqs(12))
        s.step(0.5)
        done = {r.rid: 1 for r in s.prefilling}
        s.complete_prefill(done)
        s.submit(reqs(3, start=100))
    assert len(dev.queue.rows) > 3 and len(dev.queue.tail) == 3
    gone = [ref.queue[1].rid, ref.queue[-4].rid, ref.queue[-1].rid]
    for s in (ref, dev):
        s.abort(gone)
    assert [r.rid for r in dev.queue] == [r.rid for r in ref.queue]
    assert not set(gone) & {r.rid for r in dev.queue}
    assert ref.step(0.5).admitted == dev.step(0.5).admitted


@pytest.mark.parametrize("disable_cache", [False, True])
def test_rows_reused_and_fills_hashed_when_needed(disable_cache, monkeypatch):
    """fcfs hashes only what admission reaches (not every arrival), and the rows of finished
    and aborted requests are reused: after a 400-request burst, 60 rounds of 20 arrivals (1,200
    more requests, about 20 live at a time) fit in the table the burst grew (cache on and off:
    the sweep does not depend on pool rebuilds)."""
    from gpu_sched.scheduler import RT_TOFF

    monkeypatch.setattr(GpuScheduler, "ROW_TABLE_MIN", 16)
    cfg = SchedulerConfig(schedule_policy="fcfs", max_prefill_tokens=200, disable_radix_cache=disable_cache)
    big = SchedulerConfig(schedule_policy="fcfs", max_prefill_tokens=20000, disable_radix_cache=disable_cache)
    s = GpuScheduler(cfg, 20000)
    s.submit(reqs(400, start=10_000))
    s.step(0.5)
    hashed = int((s._rt[s.queue.rows, RT_TOFF] >= 0).sum())
    assert hashed <= (0 if disable_cache else 2 * s.admit_window), hashed  # windows only
    s.abort([r.rid for r in list(s.queue)])
    s.complete_prefill({r.rid: 1 for r in s.prefilling})
    s.finish([r.rid for r in s.running])
    size = len(s._rt_owner)
    assert size >= 400
    s.config = big  # admits every arrival: few live requests from here on
    for t in range(60):
        s.submit(reqs(20, start=100 * t))
        s.step(0.5)
        s.complete_prefill({r.rid: 1 for r in s.prefilling})
        s.finish([r.rid for r in s.running])
        assert len(s.queue) + len(s.running) <= 40
    assert len(s._rt_owner) == size


def test_copies():
    import copy
    import pickle

    s = GpuScheduler(SchedulerConfig(schedule_policy="lpm", max_prefill_tokens=64), 2000)
    s.submit(reqs(20))
    plan = s.step(0.5)
    for v in (plan.queue_order, plan.num_matched):
        for c in (copy.copy(v), copy.deepcopy(v), pickle.loads(pickle.dumps(v))):
            assert type(c) is list and len(c) == len(v)
    assert copy.deepcopy(plan).queue_order == list(plan.queue_order)
    q = copy.copy(s.queue)  # a live view of the same scheduler
    assert isinstance(q, RowQueue) and q == s.queue and id(q) in s._views
    s2 = copy.deepcopy(s)  # the queue follows its scheduler
    assert isinstance(s2.queue, RowQueue) and s2.queue._s is s2
    assert [r.rid for r in s2.queue] == [r.rid for r in s.queue]
    for x in (s, s2):
        x.complete_prefill({r.rid: 1 for r in x.prefilling})
    assert s2.step(0.5).admitted == s.step(0.5).admitted


@pytest.mark.parametrize("policy", ["lpm", "lof"])
def test_plan_to_dict_is_plain_json(policy):
    """`PrefillPlan.to_dict()`: plain values json takes (the plan's LazyLists made into
    lists), equal field by field to the reference's."""
    import json

    cfg = SchedulerConfig(schedule_policy=policy, max_prefill_tokens=64)
    ref, dev = ReferenceScheduler(cfg, 2000), GpuScheduler(cfg, 2000)
    ref.submit(reqs(40))
    dev.submit(reqs(40))
    for _ in range(3):
        a, b = ref.step(0.5), dev.step(0.5)
        assert isinstance(b.queue_order, LazyList)  # json.dumps(b.queue_order) would raise
        da, db = a.to_dict(), b.to_dict()
        assert json.loads(json.dumps(db)) == json.loads(json.dumps(da))
        assert db == da and type(db["queue_order"]) is list
        assert db["admitted"] and all(type(x) is list for x in db["admitted"])
        back = PrefillPlan.from_dict(json.loads(json.dumps(db)))  # the round trip gives the plan back
        assert back == PrefillPlan.from_dict(da) and back.admitted == a.admitted
        assert back.to_dict() == da and back.budgets == a.budgets and back.stop == a.stop
        done = {rid: 1 for rid, _, _ in a.admitted}
        ref.complete_prefill(done)
        dev.complete_prefill(done)


@pytest.mark.parametrize("bad, err, words", [
    ({"admitted": [["a", 0]]}, ValueError, "admitted entry"),
    ({"admitted": [[1, 0, 2]]}, ValueError, "admitted entry"),
    ({"admitted": [["a", 0, True]]}, ValueError, "admitted entry"),
    ({"admited": []}, ValueError, "unknown fields"),
    ({"admitted": None}, ValueError, "admitted must be a list"),
    ({"admitted": "abc"}, ValueError, "admitted must be a list"),
    ({"preempted": "xy"}, ValueError, "preempted must be a list"),
    ({"queue_order": ["a", 1]}, ValueError, "queue_order entry 1 is not a rid"),
    ({"num_matched": [1, "2"]}, ValueError, "num_matched entry '2' is not an int"),
    ({"budgets": [1]}, ValueError, "budgets must be a dict"),
    ({"admitted": [["a", 5, 3]]}, ValueError, "admitted entry"),
    ({"admitted": [["a", -1, 3]]}, ValueError, "admitted entry"),
    ({"new_chunked_rid": 5}, ValueError, "new_chunked_rid must be a rid or None"),
    ({"ordered": "yes"}, ValueError, "ordered must be a bool"),
    ({"stop": "bogus"}, ValueError, "stop must be one of"),
    ({"available": -1}, ValueError, "available must be an int >= 0"),
    ({"log_hit_tokens": 1.5}, ValueError, "log_hit_tokens must be an int >= 0"),
    ([("admitted", [])], TypeError, "takes a dict"),
])
def test_plan_from_dict_refuses_what_to_dict_never_gives(bad, err, words):
    with pytest.raises(err, match=words):
        PrefillPlan.from_dict(bad)
    assert PrefillPlan.from_dict({}) == PrefillPlan()
    assert PrefillPlan.from_dict({"num_matched": None, "deprioritized": None}) == PrefillPlan()


@pytest.mark.parametrize("policy", ["fcfs", "lof"])
def test_column_bounds_hold_every_written_value(policy):
    """`GpuScheduler._col_bounds` (the priority and max_new_tokens columns' [lo, hi], read by
    the fcfs and lof orderings instead of a min/max pass) hold every value in every held
    request's row after submits, steps (rows rewritten as outputs grow), priority preemption
    (victims requeued with a new enqueue time) and aborts; and the orders stay the
    reference's, priorities absent (the type's ends: bounds too wide, min/max read) or not."""
    from gpu_sched.scheduler import RT_MAXNEW, RT_PRIO

    rng = random.Random(4)
    for with_absent in (False, True):
        cfg = SchedulerConfig(schedule_policy=policy, enable_priority_scheduling=True,
                              enable_priority_preemption=True, max_prefill_tokens=96)
        ref, dev = ReferenceScheduler(cfg, 3000), GpuScheduler(cfg, 3000)
        k = 0
        for step in range(25):
            new = [Request(rid=f"q{k + i}", prompt_ids=[rng.randrange(9) for _ in range(rng.randrange(2, 30))],
                           max_new_tokens=rng.choice([1, 5, 17, 300]),
                           priority=rng.choice([None, -4, 0, 7] if with_absent else [-4, 0, 7, 12]),
                           enqueue_time=float(step)) for i in range(rng.randrange(0, 9))]
            k += len(new)
            for s in (ref, dev):
                s.submit([Request(**{f: getattr(r, f) for f in r.__dataclass_fields__}) for r in new], now=float(step))
            pa, pb = ref.step(0.6), dev.step(0.6)
            assert pa.to_dict() == pb.to_dict(), step
            done = {rid: 1 for rid, _, _ in pa.admitted}
            ref.complete_prefill(done)
            dev.complete_prefill(done)
            if ref.running and step % 3 == 0:
                rid = ref.running[0].rid
                ref.finish([rid])
                dev.finish([rid])
            held = [r.dev_row for r in dev.reqs.values() if r.dev_row >= 0]
            for c in (RT_PRIO, RT_MAXNEW):
                lo, hi = dev._col_bounds[c]
                vals = dev._rt[held, c]
                assert vals.size and lo <= vals.min() and vals.max() <= hi, (c, step)


@pytest.mark.parametrize("times", ["arrival", "shuffled", "late_batch"])
def test_queue_time_order_flag(times):
    """`RowQueue.in_time` (the rows known to be in enqueue-time order, so fcfs with priority
    sorts by priority alone) is never True for rows out of time order: batches whose times
    run in order, out of order within a batch, or below the queue's last time; after steps
    (the queue's rest), aborts (a masked queue), preemption's requeues and queue assignment.
    The plans stay the reference's."""
    from gpu_sched.scheduler import RT_TIME

    def check(dev):
        q = dev.queue
        rows = dev._queue_rows(q)  # what a step does first: the tail joins the rows
        if q.in_time:
            t = dev._rt[rows, RT_TIME].view(np.float64)
            assert (t[1:] >= t[:-1]).all(), times
        return q.in_time

    rng = random.Random(len(times))
    for same_priority in (False, True):
        cfg = SchedulerConfig(schedule_policy="fcfs", enable_priority_scheduling=True,
                              enable_priority_preemption=not same_priority, max_prefill_tokens=80)
        ref, dev = ReferenceScheduler(cfg, 3000), GpuScheduler(cfg, 3000)
        k, flags = 0, set()
        for step in range(30):
            m = rng.randrange(0, 7)
            ts = [float(step * 10 + i) for i in range(m)]
            if times == "shuffled":
                rng.shuffle(ts)
            elif times == "late_batch" and step % 4 == 3:  # the second half below the first
                ts = ts[m // 2 :] + ts[: m // 2]
            new = [Request(rid=f"q{k + i}", prompt_ids=[rng.randrange(9) for _ in range(rng.randrange(2, 30))],
                           max_new_tokens=rng.choice([1, 5, 17]), priority=0 if same_priority else rng.choice([0, 3]),
                           enqueue_time=ts[i]) for i in range(m)]
            k += m
            for part in (new[: m // 2], new[m // 2 :]):  # two submits, the rows joined after each
                for s in (ref, dev):
                    s.submit([Request(**{f: getattr(r, f) for f in r.__dataclass_fields__}) for r in part])
                dev._queue_rows(dev.queue)
                check(dev)
            if step % 5 == 4 and len(ref.queue) > 2:  # abort one waiting request: the masked queue
                rid = ref.queue[1].rid
                ref.abort([rid])
                dev.abort([rid])
            if step % 7 == 6:  # assignment (a reorder: the same requests)
                ref.queue = list(reversed(ref.queue))
                dev.queue = list(reversed(dev.queue))
            flags.add(check(dev))
            pa, pb = ref.step(0.6), dev.step(0.6)
            assert pa.to_dict() == pb.to_dict(), (times, step)
            done = {rid: 1 for rid, _, _ in pa.admitted}
            ref.complete_prefill(done)
            dev.complete_prefill(done)
        # known either way at times (an ordering's rest is unknown: fcfs with priority
        # reorders it; reversed assignments and out-of-order batches are known False)
        assert flags == {False, True, None}, flags


def _serve_both(a, b, plan, rng, ratio: float, finish: bool):
    """After a step of two schedulers with equal plans: the prefill completed, then a decode
    step of their running batches as `run_pair` (tests/test_scheduler_differential.py) runs
    it: a retraction (the same rids) when the batch does not fit, which raises the new-token
    ratio, and the ratio's decay; then, if `finish`, the first running request finishes.
    Returns (ratio, number retracted)."""
    done = {rid: 1 for rid, _, _ in plan.admitted}
    a.complete_prefill(done)
    b.complete_prefill(done)
    if not a.running:
        return ratio, 0
    ratio, out = decode_pair(a, b, rng, 9, ratio)
    if finish and a.running:
        rid = a.running[0].rid
        a.finish([rid])
        b.finish([rid])
    return ratio, len(out)


@pytest.mark.parametrize("disable_cache", [False, True])
def test_scalar_row_writes_equal_the_numpy_form(disable_cache):
    """A few requests' rows (up to `GpuScheduler.ROWS_SCALAR_MAX`: `_rows_scalar` and the
    small-tail `_queue_rows`, Python writes on a memoryview of the row table) are looked up,
    written, refreshed and flagged exactly as the numpy form does it: the same rows, table
    values, column bounds and time-order flag after every submit, over arrivals of 0..12
    (both forms in one run), out-of-order and absent priorities and times, routing keys and
    namespaces, retraction requeues (stale rows rewritten, new enqueue times), finishes and
    aborts (an emptied queue: the arrivals' own order decides the flag); the plans stay
    equal."""
    rng = random.Random(11 + disable_cache)
    cfg = SchedulerConfig(schedule_policy="fcfs", enable_priority_scheduling=True, max_prefill_tokens=80,
                          disable_radix_cache=disable_cache)
    a, b = GpuScheduler(cfg, 1500, hash_seed=1), GpuScheduler(cfg, 1500, hash_seed=1)  # rows hold hashes: one seed
    b.ROWS_SCALAR_MAX = 0  # the numpy form throughout
    k, retracted, ratio, flags = 0, 0, 0.7, set()
    for step in range(70):
        m = rng.choice([0, 1, 2, 5, 8, 12])
        ts = [float(step * 10 + rng.randrange(12)) for _ in range(m)]
        if step % 3 == 0:  # in order, ties included; else as drawn (often out of order)
            ts = sorted(ts) if step % 2 else [float(step * 10)] * m
        new = [Request(rid=f"q{k + i}", prompt_ids=[rng.randrange(9) for _ in range(rng.randrange(2, 40))],
                       max_new_tokens=rng.choice([1, 5, 17, 300]), priority=rng.choice([None, -2, 0, 3, 9]),
                       routing_key=rng.choice([None, "a", "b"]),
                       extra_key=rng.choice([None, "ns"]), enqueue_time=ts[i]) for i in range(m)]
        k += m
        if step % 6 == 5 and len(a.queue):  # an empty queue: the arrivals' own order decides the flag
            rids = [r.rid for r in a.queue]
            a.abort(rids)
            b.abort(rids)
        for s in (a, b):
            s.submit([Request(**{f: getattr(r, f) for f in r.__dataclass_fields__}) for r in new], now=float(step))
        ra, rb = a._queue_rows(a.queue), b._queue_rows(b.queue)
        assert np.array_equal(ra, rb) and np.array_equal(a._rt[ra], b._rt[rb]), step
        assert a.queue.in_time == b.queue.in_time and a._col_bounds == b._col_bounds, step
        flags.add(a.queue.in_time)
        pa, pb = a.step(ratio), b.step(ratio)
        assert pa.to_dict() == pb.to_dict(), step
        ratio, out = _serve_both(a, b, pa, rng, ratio, finish=step % 4 == 0)
        retracted += out
        if step % 9 == 8 and len(a.queue) > 1:
            rid = a.queue[0].rid
            a.abort([rid])
            b.abort([rid])
    assert retracted > 0 and k > 100  # requeues happened, rows were reused
    assert flags == {False, True, None}, flags


@pytest.mark.parametrize("policy,priority", [("fcfs", True), ("lof", False), ("lof", True)])
def test_served_queue_order_flag(policy, priority, monkeypatch):
    """`RowQueue.ordered` (an ordering's result known to be in its order, kept by R-STEP-4's
    slice, copies, aborts and the arrivals' consolidation) is never claimed for rows out of
    that order; with it a served fcfs-with-priority or lof queue is not sorted again: no
    arrival since the last step leaves it as it is, arrivals are merged in
    (`policy.merge_arrivals_host`). A serving loop against the reference: arrivals of 0-9
    requests a step (times in order, tied or out of order, some below the queue's last),
    aborts at the head and in the middle, retraction requeues, finishes, a reversed
    assignment, a switch of the priority direction and of the policy (the flag names its
    key, so neither is taken for the other's order); plans equal at every step."""
    import gpu_sched.policy as dpolicy
    from gpu_sched.scheduler import RT_MAXNEW, RT_PRIO, RT_TIME

    calls = {"merge": 0, "kept": 0}
    merge = dpolicy.merge_arrivals_host

    def counted(*a, **k):
        calls["merge"] += 1
        return merge(*a, **k)

    monkeypatch.setattr(dpolicy, "merge_arrivals_host", counted)

    def keys(dev, rows, flag):  # the sort key the flag names: (policy, priority sign or 0)
        name, sign = flag  # Python ints below: an absent priority is an int64 end
        pr = [p * sign for p in dev._rt[rows, RT_PRIO].tolist()]
        if name == "fcfs":
            return list(zip(pr, dev._rt[rows, RT_TIME].view(np.float64).tolist()))
        return list(zip(pr, (-dev._rt[rows, RT_MAXNEW]).tolist()))

    rng = random.Random(f"{policy}-{priority}")
    cfg = SchedulerConfig(schedule_policy=policy, enable_priority_scheduling=priority, max_prefill_tokens=90)
    ref, dev = ReferenceScheduler(cfg, 2000), GpuScheduler(cfg, 2000)
    k, ratio, retracted, claimed = 0, 0.2, 0, 0
    for step in range(90):
        m = rng.choice([0, 0, 1, 2, 3, 9])
        ts = [float(step * 10 + rng.randrange(12)) for _ in range(m)]
        if step % 3:
            ts = sorted(ts) if step % 2 else [float(step * 10 - 15)] * m  # in order; tied below the last
        new = [Request(rid=f"q{k + i}", prompt_ids=[rng.randrange(9) for _ in range(rng.randrange(2, 40))],
                       max_new_tokens=rng.choice([1, 5, 17, 300]), priority=rng.choice([None, -2, 0, 3]),
                       enqueue_time=ts[i]) for i in range(m)]
        k += m
        for s in (ref, dev):
            s.submit([Request(**{f: getattr(r, f) for f in r.__dataclass_fields__}) for r in new], now=float(step))
        if step % 11 == 10 and len(ref.queue) > 3:  # aborts: the head and one in the middle
            rids = [ref.queue[0].rid, ref.queue[len(ref.queue) // 2].rid]
            ref.abort(rids)
            dev.abort(rids)
        if step == 40:
            ref.queue = list(reversed(ref.queue))
            dev.queue = list(reversed(dev.queue))
        if step in (55, 70):  # the other priority direction, then the other policy and back
            other = {"fcfs": "lof", "lof": "fcfs"}[policy] if step == 55 else policy
            c = SchedulerConfig(schedule_policy=other, enable_priority_scheduling=priority,
                                schedule_low_priority_values_first=step == 55, max_prefill_tokens=90)
            ref.config = dev.config = c
        q = dev.queue
        rows = dev._queue_rows(q)
        if q.ordered is not None:  # what it claims holds: its first rows are in its key's order
            n_ok = q.ordered[1]
            key = keys(dev, rows[:n_ok], q.ordered[0])
            assert all(a <= b for a, b in zip(key, key[1:])), step
            claimed += n_ok > 0
        before = calls["merge"]
        pa, pb = ref.step(ratio), dev.step(ratio)
        assert pa.to_dict() == pb.to_dict(), step
        if q.ordered is not None and q.ordered[1] == len(rows) and calls["merge"] == before:
            calls["kept"] += 1
        ratio, out = _serve_both(ref, dev, pa, rng, ratio, finish=step % 3 == 0)
        retracted += out
    assert calls["merge"] > 5 and calls["kept"] > 5 and claimed > 20 and retracted > 0, (calls, claimed)


def test_routing_table_kept_while_the_batch_stays(monkeypatch):
    """R-ORD-7's slot table (`policy.routing_table_host`) is made again only when the running
    batch or the interned keys change (`GpuScheduler._routing_perm_host`): reorderings with
    the same batch reuse it; admissions, finishes, retractions, new keys and compactions that
    renumber the ids (`_rk_compact`, called every few steps here) each give a new one.
    A serving loop against the reference with keys drawn from a growing set; plans equal at
    every step, and the queue reordered between steps with the batch unchanged gives the
    reference's order too."""
    import gpu_sched.policy as dpolicy

    made = []
    table = dpolicy.routing_table_host
    monkeypatch.setattr(dpolicy, "routing_table_host", lambda *a, **k: made.append(1) or table(*a, **k))
    rng = random.Random(23)
    cfg = SchedulerConfig(schedule_policy="routing-key", max_prefill_tokens=90)
    ref, dev = ReferenceScheduler(cfg, 2000), GpuScheduler(cfg, 2000)
    k, ratio, compactions, reused = 0, 0.3, 0, 0
    for step in range(80):
        m = rng.choice([0, 1, 3, 6])
        new = [Request(rid=f"q{k + i}", prompt_ids=[rng.randrange(9) for _ in range(rng.randrange(2, 40))],
                       max_new_tokens=rng.choice([1, 5, 17, 300]),
                       routing_key=rng.choice([None, "", f"s{rng.randrange(step // 4 + 2)}", "a", f"u{k + i}", f"v{k + i}"]),
                       enqueue_time=float(step)) for i in range(m)]
        k += m
        for s in (ref, dev):
            s.submit([Request(**{f: getattr(r, f) for f in r.__dataclass_fields__}) for r in new], now=float(step))
        epoch = dev._rk_epoch
        if step % 5 == 2:  # as `_write_rows` does once the keys outgrow the rows: ids renumbered
            dev._rk_compact()
        pa, pb = ref.step(ratio), dev.step(ratio)
        assert pa.to_dict() == pb.to_dict(), step
        compactions += dev._rk_epoch > epoch
        if step % 4 == 0 and len(ref.queue) > 1:  # the same batch, the queue reversed: ordered again
            for s in (ref, dev):
                s.queue = list(reversed(s.queue))
            n_made = len(made)
            assert dev._order().queue == [dev.reqs[r.rid] for r in ref._order().queue], step
            reused += len(made) == n_made and dev._rk_table is not None and dev._rk_table[1] is not None
        ratio, _ = _serve_both(ref, dev, pa, rng, ratio, finish=step % 3 == 0)
    assert compactions > 10 and reused > 3 and len(made) > 10, (compactions, reused, len(made))


@pytest.mark.parametrize("priority_first", [True, False])
def test_a_kept_copy_of_the_queue_drops_stale_order_flags(priority_first):
    """A copy of the served queue kept across steps and assigned back (`RowQueue.copy`, the
    queue setter takes a RowQueue as it is) while one of its requests was admitted, retracted
    and requeued with a new enqueue time: its `ordered` / `in_time` flags were known for rows
    whose values have since been rewritten (`GpuScheduler._row_epoch`), so the ordering checks
    and sorts it as the reference does rather than trusting them (found in review: the copy
    claimed R-ORD-4's order, or time order with priority scheduling switched on after)."""
    import dataclasses

    def reqs():
        return [Request(rid="D", prompt_ids=[1, 2, 3, 4], max_new_tokens=8, priority=9, enqueue_time=0.0),
                Request(rid="E", prompt_ids=[1, 2, 3, 5], max_new_tokens=8, priority=8, enqueue_time=0.0),
                Request(rid="B", prompt_ids=list(range(10, 30)), max_new_tokens=8, priority=0, enqueue_time=0.0),
                Request(rid="A", prompt_ids=[5, 6, 7, 8], max_new_tokens=8, priority=0, enqueue_time=1.0)]

    cfg = SchedulerConfig(schedule_policy="fcfs", enable_priority_scheduling=priority_first, max_running_requests=2)
    ref, dev = ReferenceScheduler(cfg, 60), GpuScheduler(cfg, 60)

    def step(now):
        pa, pb = ref.step(0.1, now=now), dev.step(0.1, now=now)
        assert pa.to_dict() == pb.to_dict(), now
        for s in (ref, dev):
            s.complete_prefill({rid: 1 for rid, _, _ in pa.admitted})
        return pa

    for s in (ref, dev):
        s.submit(reqs(), now=1.0)
    step(1.0)  # D and E run; B, A wait
    saved = dev.queue.copy()
    assert [r.rid for r in saved] == ["B", "A"]
    assert saved.ordered if priority_first else saved.in_time  # what the copy claims
    if not priority_first:
        ref.config = dev.config = dataclasses.replace(cfg, enable_priority_scheduling=True)
    for s in (ref, dev):
        s.finish(["E"])
    assert step(2.0).admitted[0][0] == "B"
    while ref.decode_fits():
        for s in (ref, dev):
            s.decode({r.rid: 3 for r in s.running})
    assert ref.retract_decode() == dev.retract_decode() == ["B"]  # requeued: a new enqueue time
    for s in (ref, dev):
        s.submit([Request(rid="F", prompt_ids=[9, 9], max_new_tokens=8, priority=7, enqueue_time=3.0)], now=3.0)
    assert [rid for rid, _, _ in step(5.0).admitted] == ["F"]  # B's row rewritten; B and A wait
    for s in (ref, dev):
        s.finish(["F"])
    ref.queue = [ref.reqs[r.rid] for r in saved]  # the same waiting requests, in the copy's order
    dev.queue = saved
    pa = step(6.0)
    assert list(pa.queue_order) == ["A", "B"] and pa.admitted[0][0] == "A"
