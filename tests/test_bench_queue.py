"""benchmarks/bench_queue.py's timing of one row on several backends side by side
(`measure_group`): how many calls each backend gets and how they interleave."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_queue  # noqa: E402


class _Clock:
    """A clock whose every call 'takes' the next of `dts` seconds (the last one repeats) and
    logs the backend's name."""

    def __init__(self, name, dts, log):
        self.name, self.dts, self.log, self.k = name, list(dts), log, 0

    def __call__(self, fn):
        dt = self.dts[min(self.k, len(self.dts) - 1)]
        self.k += 1
        self.log.append(self.name)
        return dt, fn()


def _entry(name, dts, log, restores=None):
    restore = None if restores is None else (lambda: restores.append(name))
    return _Clock(name, dts, log), (lambda: name), restore


def test_calls_are_planned_from_the_faster_of_warm_up_and_first_call_and_interleaved():
    log, restores = [], []
    # slow: 0.1 s a call -> 0.5 / 0.1 = 5 calls; fast: a slow warm-up (0.2 s) then 0.01 s -> 15 (max)
    out = bench_queue.measure_group([_entry("slow", [0.1], log, restores), _entry("fast", [0.2, 0.01], log)],
                                    reps=3, max_reps=15, budget_s=0.5, max_s=10.0, slow_s=2.0, slow_reps=2)
    (t_slow, first_slow, w_slow), (t_fast, first_fast, w_fast) = out
    assert (first_slow, w_slow, first_fast, w_fast) == ("slow", 0.1, "fast", 0.2)
    assert len(t_slow) == 5 and len(t_fast) == 15
    assert t_fast == [0.01] * 15  # the warm-up is not a sample
    assert restores == ["slow"] * 6  # after each of its calls, warm-up included (the other has none)
    # warm-ups, then one sizing call each, then the rest interleaved: the slow side's 4 calls
    # are spread through the fast side's 14, never two in a row and never all at one end
    assert log[:4] == ["slow", "fast", "slow", "fast"]
    rest = log[4:]
    assert rest.count("slow") == 4 and rest.count("fast") == 14
    at = [i for i, b in enumerate(rest) if b == "slow"]
    assert all(b - a > 1 for a, b in zip(at, at[1:])), rest
    assert at[0] < 4 and at[-1] > len(rest) - 5, rest


def test_slow_and_over_limit_entries():
    log = []
    out = bench_queue.measure_group([_entry("over", [11.0], log), _entry("slow", [3.0, 2.5], log),
                                     _entry("fast", [0.05], log), _entry("hiccup", [0.05, 0.25, 0.05], log)],
                                    reps=3, max_reps=15, budget_s=0.5, max_s=10.0, slow_s=2.0, slow_reps=2)
    assert out[0][0] == [11.0] and log.count("over") == 1  # the warm-up alone, kept as its time
    assert out[1][0] == [2.5, 2.5]  # slow_reps timed calls, no sizing call
    assert len(out[2][0]) == 10  # 0.5 / 0.05
    assert len(out[3][0]) == 10  # a slowed first call: sized by its faster warm-up


def test_an_entry_stops_after_a_call_over_max_s():
    log = []
    out = bench_queue.measure_group([_entry("a", [1.0, 1.0, 12.0], log), _entry("b", [0.1], log)],
                                    reps=5, max_reps=15, budget_s=0.5, max_s=10.0, slow_s=2.0, slow_reps=2)
    assert out[0][0] == [1.0, 12.0] and log.count("a") == 3
    assert len(out[1][0]) == 5


def test_primed_calls_follow_an_untimed_call_of_the_same_entry():
    log, restores = [], []
    # every call 'takes' the next dt: the priming calls consume the odd ones, never sampled
    dts = [0.1, 0.9, 0.11, 0.9, 0.12, 0.9, 0.13, 0.9, 0.14]  # warm-up, then (primer, timed) pairs
    out = bench_queue.measure_group([_entry("a", dts, log, restores), _entry("b", [0.1], log)],
                                    reps=4, max_reps=4, budget_s=0.1, max_s=10.0, slow_s=2.0, slow_reps=2, prime=True)
    (ta, _, wa), (tb, _, wb) = out
    assert (wa, wb) == (0.1, 0.1) and len(tb) == 4
    assert ta == [0.11, 0.12, 0.13, 0.14]  # no primer's 0.9 among the samples
    assert log[:2] == ["a", "b"]  # warm-ups, unprimed
    rest = log[2:]
    assert len(rest) == 16 and all(rest[k] == rest[k + 1] for k in range(0, 16, 2)), rest
    assert restores == ["a"] * 9  # warm-up, 4 primers, 4 timed calls
    # the timed calls still take turns: no entry's two timed calls back to back after the sizing ones
    timed = rest[1::2]
    assert timed[:2] == ["a", "b"] and timed[2:].count("a") == timed[2:].count("b") == 3


def _small_workload(n):
    import argparse

    args = argparse.Namespace(queue="synthetic", trace=None, warm=32, max_prompt_len=256, distinct=64,
                              synthetic_groups=4, seed=3, routing_keys=8, running=8)
    return bench_queue.build_workload(args, n)


def _fcfs_stage(wl, backend: str, stage: str, policy: str = "fcfs"):
    """(scheduler, call) of a served-queue stage (fcfs with priority and lof only) on a
    scheduler holding wl's queue; the stage is None for the other policies and restores
    nothing."""
    from gpu_sched.config import SchedulerConfig

    s, _ = bench_queue.make_scheduler(backend, "cpu", wl, bench_queue.kv_pool_size(wl, 8, 10_000))
    bench_queue.set_queue(s, wl.queue)
    for pol in ("lpm", "routing-key"):
        s.config = SchedulerConfig(**bench_queue.POLICIES[pol])
        assert bench_queue.stage_fns(s, stage, wl.max_len) is None
    s.config = SchedulerConfig(**bench_queue.POLICIES[policy])
    fn, restore = bench_queue.stage_fns(s, stage, wl.max_len)
    assert restore is None
    return s, fn


def test_order_arrivals_times_a_served_queue_with_arrivals_behind_it():
    """`order-arrivals` (fcfs with priority, and lof): the served queue without its newest 1%,
    which wait behind it in time order (on GpuScheduler as submitted requests do: its tail,
    the rest known to be in order); every ordering of it gives the stable sort of the whole
    queue, the same on both backends."""
    wl = _small_workload(300)
    for policy, key in (("fcfs", lambda r: (-r.priority, r.enqueue_time)), ("lof", lambda r: -r.max_new_tokens)):
        orders = {}
        for backend in ("reference", "torch"):
            s, fn = _fcfs_stage(wl, backend, "order-arrivals", policy)
            q = fn.__self__.queue
            newest = sorted(wl.queue, key=lambda r: r.enqueue_time)[-3:]
            assert [r.rid for r in list(q)[-3:]] == [r.rid for r in newest]
            if backend == "torch":
                assert [r.rid for r in q.tail] == [r.rid for r in newest] and q.ordered[1] == len(q.rows)
            want = [r.rid for r in sorted(q, key=lambda x: key(x.req))]  # stable: the served order on ties
            for _ in range(2):  # repeatable: the timed calls leave the queue as it was
                assert [r.rid for r in fn().queue] == want
            orders[backend] = want
        assert orders["reference"] == orders["torch"], policy


def test_order_served_times_the_ordering_of_a_queue_kept_in_its_previous_order():
    wl = _small_workload(200)
    orders = {}
    for backend in ("reference", "torch"):
        s, fn = _fcfs_stage(wl, backend, "order-served")
        before = [r.rid for r in s.queue]
        assert [r.rid for r in s.queue] == before  # the copy is served, not s
        served = fn.__self__.queue
        # what the stage is for: the served queue is not in enqueue-time order, so time is a key
        times = [r.enqueue_time for r in served]
        assert times != sorted(times)
        out = [r.rid for r in fn().queue]
        # by priority (larger first, SGLang's default), then enqueue time: the same as the first ordering
        want = [r.rid for r in sorted(wl.queue, key=lambda r: (-r.priority, r.enqueue_time))]
        assert out == want == [r.rid for r in served]
        orders[backend] = out
    assert orders["reference"] == orders["torch"]


def test_sizes_lists_the_queue_lengths_and_rows_carry_them(tmp_path):
    """`--sizes 30,70`: rows at exactly those n (not powers of two), the reference and the torch
    backend side by side with the ratio, the step's plans compared (n <= 2^check_max_exp)."""
    import json

    import pytest

    out = tmp_path / "rows.json"
    args = ["--queue", "synthetic", "--warm", "20", "--distinct", "60", "--sizes", "70,30", "--policies", "fcfs,lpm",
            "--stages", "order,step", "--backends", "reference,torch-cpu", "--reps", "1", "--max-reps", "1",
            "--budget-s", "0.01", "--check-max-exp", "7", "--out", str(out)]
    rows = bench_queue.main(args)
    assert json.loads(out.read_text()) == rows
    got = {(r["policy"], r["stage"], r["n"], r["backend"]) for r in rows}
    assert got == {(p, st, n, b) for p in ("fcfs", "lpm") for st in ("order", "step") for n in (30, 70)
                   for b in ("reference", "torch")}
    for r in rows:
        assert r["ratio_to_ref"] is not None and r["ratio_to_ref"] > 0
        if r["backend"] == "torch" and r["stage"] == "step":
            assert r["plan_equal_ref"] is True
    for bad in ("10,x", "0,5"):
        with pytest.raises(SystemExit) as e:
            bench_queue.main(args[:5] + ["--sizes", bad] + args[7:])
        assert e.value.code == 2


def test_step_restore_puts_the_tree_back_exactly():
    """The step stage's undo (`Restorer`, untimed): after every timed call the tree's lock
    counts (its whole capacity, not only the node-id prefix the snapshot holds), evictable and
    protected sizes are what they were before the first call (the first undo unlocks through
    the tree, later ones copy its snapshot back), and every call gives the same plan, for
    policies that admit on a warm cache."""
    from gpu_sched.config import SchedulerConfig

    wl = _small_workload(120)
    pool = bench_queue.kv_pool_size(wl, 8, 10_000)
    s, _ = bench_queue.make_scheduler("torch", "cpu", wl, pool)
    bench_queue.set_queue(s, wl.queue)
    t = s.cache.tree
    for pol in ("lpm", "fcfs", "dfs-weight"):
        s.config = SchedulerConfig(**bench_queue.POLICIES[pol])
        call, restore = bench_queue.stage_fns(s, "step", wl.max_len)
        before = (t.lock_ref.clone(), int(t.evictable_size), int(t.protected_size))
        plans = []
        for k in range(4):
            plan = call()
            assert plan.admitted, pol  # the calls lock something for the undo to release
            assert int(t.protected_size) > before[2], pol
            restore()
            state = (t.lock_ref.clone(), int(t.evictable_size), int(t.protected_size))
            assert torch.equal(state[0], before[0]) and state[1:] == before[1:], (pol, k)
            plans.append(plan.to_dict())
        assert all(p == plans[0] for p in plans), pol


def test_order_arrivals_times_a_served_queue_with_its_newest_requests_behind():
    """`order-arrivals`: the served order less its newest 1% (at least one), those behind it
    in time order; the ordering puts them back (both backends, the same order)."""
    wl = _small_workload(300)
    orders = {}
    for backend in ("reference", "torch"):
        s, fn = _fcfs_stage(wl, backend, "order-arrivals")
        q = list(fn.__self__.queue)
        a = max(1, len(q) // 100)
        newest = sorted(wl.queue, key=lambda r: r.enqueue_time)[-a:]
        assert [r.rid for r in q[-a:]] == [r.rid for r in newest]
        want = [r.rid for r in sorted(wl.queue, key=lambda r: (-r.priority, r.enqueue_time))]
        assert [r.rid for r in q] != want  # the arrivals are out of place
        out = [r.rid for r in fn().queue]
        assert out == want
        orders[backend] = out
    assert orders["reference"] == orders["torch"]


def test_step_served_steps_a_copy_whose_queue_is_in_its_previous_order():
    """`step-served`: the step on a deep copy of the scheduler whose queue holds its own
    ordering (as a serving loop keeps it between steps), undone after each call; the plan is
    the fresh queue's step plan, on both backends and every policy, and the benchmarked
    scheduler's queue is left as it was (the later stages and policies see it unordered)."""
    from gpu_sched.config import SchedulerConfig
    from gpu_sched.row_queue import RowQueue

    wl = _small_workload(150)
    plans = {}
    for backend in ("reference", "torch"):
        s, _ = bench_queue.make_scheduler(backend, "cpu", wl, bench_queue.kv_pool_size(wl, 8, 10_000))
        bench_queue.set_queue(s, wl.queue)
        before = [r.rid for r in s.queue]
        for pol in ("fcfs", "lof", "routing-key", "lpm"):
            s.config = SchedulerConfig(**bench_queue.POLICIES[pol])
            call, restore = bench_queue.stage_fns(s, "step-served", wl.max_len)
            c = call.__closure__[0].cell_contents  # the copy the stage steps
            assert c is not s
            served = [r.rid for r in c.queue]
            assert served == [r.rid for r in s._order().queue]  # its queue: the ordering's result
            if backend == "torch" and pol in ("fcfs", "lof"):
                assert isinstance(c.queue, RowQueue) and c.queue.ordered is not None  # known to be in order
            got = []
            for _ in range(3):
                plan = call()
                assert plan.admitted, (backend, pol)
                restore()
                assert [r.rid for r in c.queue] == served
                got.append(plan.to_dict())
            assert all(p == got[0] for p in got)
            fresh_call, fresh_restore = bench_queue.stage_fns(s, "step", wl.max_len)
            fresh = fresh_call().to_dict()
            fresh_restore()
            assert got[0]["admitted"] == fresh["admitted"] and got[0]["queue_order"] == fresh["queue_order"], (backend, pol)
            plans[backend, pol] = got[0]
            assert [r.rid for r in s.queue] == before
    for pol in ("fcfs", "lof", "routing-key", "lpm"):
        assert plans["reference", pol] == plans["torch", pol], pol


def test_a_plan_that_differs_from_the_reference_fails_the_command(tmp_path):
    """The command (as gpu_check.sh runs it) exits 1 when a backend's step plan differs from the
    reference's, after printing PROBLEM and writing its rows; 0 when every plan is equal."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--queue", "synthetic", "--warm", "20", "--distinct", "60", "--sizes", "40", "--policies", "fcfs",
            "--stages", "step", "--backends", "reference,torch-cpu", "--reps", "1", "--max-reps", "1",
            "--budget-s", "0.01", "--check-max-exp", "7"]
    code = ("import runpy, sys\n"
            "from gpu_sched.scheduler import GpuScheduler\n"
            "step = GpuScheduler.step\n"
            "def short(self, *a, **k):  # one admitted request dropped from the plan\n"
            "    p = step(self, *a, **k)\n"
            "    p.admitted = list(p.admitted)[:-1]\n"
            "    return p\n"
            "if sys.argv[1] == 'bad':\n    GpuScheduler.step = short\n"
            "sys.argv = ['bench_queue.py'] + sys.argv[2:]\n"
            "runpy.run_path('benchmarks/bench_queue.py', run_name='__main__')\n")
    for mode, rc in (("bad", 1), ("good", 0)):
        out = tmp_path / f"{mode}.json"
        r = subprocess.run([sys.executable, "-c", code, mode] + args + ["--out", str(out)], cwd=root,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == rc, r.stdout[-2000:] + r.stderr[-2000:]
        assert ("PROBLEM:" in r.stdout) == (mode == "bad") and out.stat().st_size > 0


@pytest.mark.parametrize("content,message", [
    ('{"a": 1}', "holds a JSON dict, not a list of rows"), ("not json", "is not a JSON list of rows"),
    (None, "is a folder, not a JSON file"), ("UNDER_A_FILE", "cannot write in")])
def test_an_out_file_it_cannot_append_to_stops_the_run_before_it_starts(tmp_path, capsys, content, message):
    """--out that is a folder, holds no JSON list or lies under a file: argparse's one-line
    error (status 2) before the workload is built, where the run's end used to fail and lose
    its rows."""
    out = tmp_path / "rows.json"
    if content is None:
        out.mkdir()
    elif content == "UNDER_A_FILE":
        (tmp_path / "f").write_text("")
        out, content = tmp_path / "f" / "sub" / "rows.json", None
    else:
        out.write_text(content)
    with pytest.raises(SystemExit) as e:
        bench_queue.main(["--queue", "synthetic", "--sizes", "30", "--out", str(out)])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert content is None or out.read_text() == content


def test_bad_counts_are_one_line_errors(capsys):
    for argv, message in ((["--reps", "-1"], "--reps must be >= 1"), (["--warm", "-5"], "--warm must be >= 0"),
                          (["--routing-keys", "0"], "--routing-keys must be >= 1"),
                          (["--reps", "5", "--max-reps", "2"], "--max-reps (2) must be >= --reps (5)")):
        with pytest.raises(SystemExit) as e:
            bench_queue.main(["--queue", "synthetic", "--sizes", "30"] + argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
