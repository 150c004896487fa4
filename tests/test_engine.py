"""Tests for gpu_sched.sim.engine: the serving simulator on small synthetic traces."""

import numpy as np
import pytest

from gpu_sched.config import SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.sim.engine import (COST_MODELS, ENGINE_CALLS, CostModel, NewTokenRatio, SimulationError,
                                  get_cost_model, replay)
from gpu_sched.sim.metrics import format_comparison, format_summary
from gpu_sched.sim.traces import Trace, TraceRequest, output_token_ids, synthetic_workload


def _run(trace, check=True, kv=20_000, make=ReferenceScheduler, cost="llama3-8b-h200", **cfg):
    return replay(trace, SchedulerConfig(**cfg), kv_tokens=kv, make_scheduler=make, cost_model=cost, check=check)


def _burst(n=30, **kw):
    """Requests that arrive together and share system prompts: ordering matters."""
    args = dict(request_rate=1000.0, turns=(1, 1), num_groups=3, system_prompt_len=256, user_len=(16, 64),
                output_len=(20, 60), seed=1)
    args.update(kw)
    return synthetic_workload(n, **args)


def _planned(trace):
    return sum(max(r.output_len, 1) for r in trace)


def test_small_trace_completes_with_integrity_checks():
    tr = synthetic_workload(30, seed=3)
    summary, reqs, steps = _run(tr, schedule_policy="lpm")
    assert summary["completed"] == len(tr) and summary["unfinished"] == 0
    assert summary["total_output_tokens"] == _planned(tr)  # conservation
    assert summary["check_wall_s"] is not None
    for r, t in zip(reqs, tr):
        assert r.rid == f"r{t.index}"
        assert r.first_token_s is not None and r.first_token_s > r.arrival_s  # TTFT > 0
        assert r.output_len == max(t.output_len, 1) == len(r.token_times)
        assert r.finish_s == r.token_times[-1]
        assert np.all(np.diff(r.token_times) > 0)
        assert 0 <= r.cached_tokens < r.input_len
    assert summary["mean_ttft_ms"] > 0
    assert {s.kind for s in steps} <= {"prefill", "decode", "idle"}
    assert all(b.t_s >= a.t_s for a, b in zip(steps, steps[1:]))
    assert steps[-1].running == 0
    assert len(summary["digest"]) == 64


def test_shared_prefixes_hit_the_cache():
    summary, reqs, _ = _run(synthetic_workload(30, seed=3), check=False, schedule_policy="lpm")
    assert summary["prefix_cache_hit_rate"] > 0.3
    assert sum(r.cached_tokens for r in reqs) == summary["cached_tokens"]


def test_retraction_with_a_tiny_kv_pool_still_completes():
    # clipping the max-new-tokens estimate makes admission under-reserve, so decode runs out
    tr = _burst(30, output_len=(100, 200))
    summary, reqs, steps = _run(tr, kv=2000, schedule_policy="lpm", clip_max_new_tokens=8)
    assert summary["retractions"] > 0
    assert summary["completed"] == len(tr)
    assert summary["total_output_tokens"] == _planned(tr)
    assert all(s.kv_used_tokens <= 2000 for s in steps)
    # a retracted request keeps its output: its tokens are still the planned stream, no repeats
    assert all(len(r.token_times) == r.output_len for r in reqs)


def test_every_scheduler_call_is_timed_and_counted():
    """The summary's "sched_calls_s" / "sched_calls_n" hold step() and every ENGINE_CALLS
    method: counts equal the calls the scheduler saw (retractions included), step()'s time is
    "sched_wall_s", and the summary text lists them with their total."""
    seen = dict.fromkeys(("step",) + ENGINE_CALLS, 0)
    depth = [0]  # the engine's calls only: retract_decode calls decode_fits itself

    class Counting(ReferenceScheduler):
        pass

    for name in seen:
        def counted(self, *a, _name=name, **k):
            seen[_name] += depth[0] == 0
            depth[0] += 1
            try:
                return getattr(ReferenceScheduler, _name)(self, *a, **k)
            finally:
                depth[0] -= 1
        setattr(Counting, name, counted)
    summary, _, _ = _run(_burst(30, output_len=(100, 200)), check=False, kv=2000, make=Counting,
                         schedule_policy="lpm", clip_max_new_tokens=8)
    assert summary["retractions"] > 0 and seen["retract_decode"] > 0
    assert summary["sched_calls_n"] == seen
    calls = summary["sched_calls_s"]
    assert set(calls) == set(seen) and all(v >= 0 for v in calls.values())
    assert calls["step"] == summary["sched_wall_s"] and calls["decode"] > 0 and calls["finish"] > 0
    text = format_summary(summary)
    assert f"retract_decode ({seen['retract_decode']} calls) (ms):" in text
    total = next(l for l in text.splitlines() if l.startswith("All scheduler calls (ms):"))
    assert total.endswith(f"{sum(calls.values()) * 1e3:.1f}")
    row = next(l for l in format_comparison({"lpm": summary}).splitlines() if l.startswith("Sched calls, all (ms)"))
    assert row.endswith(f"{sum(calls.values()) * 1e3:.2f}")


def test_the_timing_wrapper_is_the_scheduler_to_its_users():
    """`_TimedCalls`: reads and writes reach the scheduler, step() is its own (untimed here),
    copies keep the counts (a deep copy wraps a deep copy of the scheduler), its own fields
    cannot be overwritten by mistake."""
    import copy

    from gpu_sched.request import Request
    from gpu_sched.sim.engine import _TimedCalls

    s = ReferenceScheduler(SchedulerConfig(), 100)
    w = _TimedCalls(s)
    w.submit([Request("a", [1, 2, 3], 4)])
    w.batch_is_full = True  # a write goes to the scheduler
    assert s.batch_is_full and w.kv_used == s.kv_used and w.step == s.step
    d = copy.deepcopy(w)
    d.submit([Request("b", [1, 2], 4)])
    assert (w.counts["submit"], d.counts["submit"]) == (1, 2)
    assert len(s.queue) == 1 and len(d._sched.queue) == 2 and d._sched is not s
    c = copy.copy(w)
    c.submit([Request("c", [1], 1)])
    assert len(s.queue) == 2 and (w.counts["submit"], c.counts["submit"]) == (1, 2)
    with pytest.raises(AttributeError, match="own"):
        w.seconds = {}


def test_same_run_same_digest():
    tr = _burst()
    a, _, _ = _run(tr, check=False, schedule_policy="lpm")
    b, _, _ = _run(tr, check=False, schedule_policy="lpm")
    assert a["digest"] == b["digest"] and a["digest_steps"] == b["digest_steps"] > 0
    assert a["mean_ttft_ms"] == b["mean_ttft_ms"]


def test_lpm_and_fcfs_decide_differently_on_shared_prefixes():
    tr = _burst(40)
    lpm, _, _ = _run(tr, check=False, schedule_policy="lpm", max_prefill_tokens=1024)
    fcfs, _, _ = _run(tr, check=False, schedule_policy="fcfs", max_prefill_tokens=1024)
    assert lpm["digest"] != fcfs["digest"]
    assert lpm["completed"] == fcfs["completed"] == len(tr)


def test_chunked_prefill_and_mixed_chunk():
    tr = _burst(20, system_prompt_len=1500)
    s1, r1, _ = _run(tr, schedule_policy="fcfs", chunked_prefill_size=256, max_prefill_tokens=256)
    s2, r2, _ = _run(tr, schedule_policy="fcfs", chunked_prefill_size=256, max_prefill_tokens=256,
                     enable_mixed_chunk=True)
    for s in (s1, s2):
        assert s["completed"] == len(tr) and s["total_output_tokens"] == _planned(tr)
    assert s1["digest"] != s2["digest"]  # mixed decode tokens change the budgets


def test_output_len_zero_finishes_after_prefill():
    tr = Trace("t", [TraceRequest(index=0, arrival_s=0.5, input_len=10, output_len=0, output_key=7),
                     TraceRequest(index=1, arrival_s=0.5, input_len=10, output_len=3, output_key=8)])
    summary, reqs, steps = _run(tr)
    assert [r.output_len for r in reqs] == [1, 3]
    assert reqs[0].finish_s == reqs[0].first_token_s
    assert steps[0].kind == "idle" and steps[0].t_s == 0.5  # the clock jumped to the first arrival
    assert summary["completed"] == 2


def test_generated_tokens_follow_the_output_stream():
    tr = Trace("t", [TraceRequest(index=0, arrival_s=0.0, input_len=20, output_len=5, output_key=11)])
    seen = {}

    class Spy(ReferenceScheduler):
        def finish(self, rids):
            for rid in rids:
                seen[rid] = list(self.reqs[rid].req.output_ids)
            super().finish(rids)

    _run(tr, make=Spy)
    assert seen["r0"] == output_token_ids(11, 0, 5).tolist()


def test_cost_model_drives_simulated_time():
    unit = CostModel("unit", "test", fixed_s=1.0, prefill_token_s=0.0, decode_request_s=0.0, kv_token_s=0.0)
    tr = Trace("t", [TraceRequest(index=0, arrival_s=0.0, input_len=8, output_len=4, output_key=1)])
    summary, reqs, steps = _run(tr, cost=unit)
    assert reqs[0].token_times == [1.0, 2.0, 3.0, 4.0]  # one prefill step then three decode steps
    assert [s.kind for s in steps] == ["prefill", "decode", "decode", "decode"]
    m = COST_MODELS["llama3-8b-h200"]
    assert m.prefill_s(1000, 500) == pytest.approx(m.fixed_s + 1000 * m.prefill_token_s + 500 * m.kv_token_s)
    assert m.decode_s(8, 4000) == pytest.approx(m.fixed_s + 8 * m.decode_request_s + 4000 * m.kv_token_s)
    assert get_cost_model(m) is m
    with pytest.raises(ValueError, match="unknown cost model"):
        get_cost_model("nope")


def test_new_token_ratio_rule():
    r = NewTokenRatio(1.0)
    assert r.value == pytest.approx(0.7) and r.min_ratio == pytest.approx(0.098)
    for _ in range(600):
        r.decay()
    assert r.value == pytest.approx(r.min_ratio)
    r.decay()
    assert r.value == r.min_ratio
    r.after_retraction(out_tokens=100, n_running=3, max_new_tokens=999)
    assert r.value == pytest.approx((100 + 60) / 1000)
    r.after_retraction(out_tokens=5000, n_running=3, max_new_tokens=10)
    assert r.value == 1.0
    r.reset()
    assert r.value == pytest.approx(0.7)
    assert NewTokenRatio(2.0).init == 1.0


@pytest.mark.parametrize("args, exc, words", [
    ((100, 0, 999), ValueError, "n_running must be >= 1, got 0"),
    ((-1, 3, 999), ValueError, "out_tokens must be >= 0, got -1"),
    ((100, 3, -5), ValueError, "max_new_tokens must be >= 0, got -5"),
    ((100.0, 3, 999), TypeError, "out_tokens must be an int, got float"),
    ((100, True, 999), TypeError, "n_running must be an int, got bool"),
    ((100, 3, 2**126 + 1), ValueError, r"max_new_tokens must be <= \d+ \(2\^126\)"),
])
def test_new_token_ratio_refuses_bad_retraction_sums(args, exc, words):
    r = NewTokenRatio(1.0)
    r.decay()
    before = r.value
    with pytest.raises(exc, match=words):
        r.after_retraction(*args)
    assert r.value == before  # nothing changed


def test_new_token_ratio_takes_sums_past_int64():
    """The sums run over every running request, each max_new_tokens up to int64's largest (as
    `Request` takes it): two of them sum past int64, which the README's engine loop passes."""
    r = NewTokenRatio(1.0)
    r.after_retraction(5, 2, 2 * (2**63 - 1))
    assert r.value == (5 + 40) / (2 * (2**63 - 1) + 1)


def test_new_token_ratio_refuses_bad_conservativeness():
    with pytest.raises(TypeError, match="conservativeness must be a finite number > 0, got str 'abc'"):
        NewTokenRatio("abc")
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="conservativeness"):
            NewTokenRatio(bad)


def test_request_that_never_fits_is_named():
    tr = Trace("t", [TraceRequest(index=0, arrival_s=0.0, input_len=50, output_len=5, output_key=1),
                     TraceRequest(index=1, arrival_s=1.0, input_len=900, output_len=5, output_key=2)])
    with pytest.raises(SimulationError, match=r"request r1 .*can never be admitted"):
        _run(tr, kv=500)


@pytest.mark.parametrize("cfg, cause", [
    (dict(page_size=16, chunked_prefill_size=8), "chunked_prefill_size 8 is below page_size 16"),
    (dict(chunked_prefill_size=8, truncation_align_size=16), "chunked_prefill_size 8 is below truncation_align_size 16"),
    (dict(chunked_prefill_size=8), "the KV pool holds 500 tokens"),  # 900 tokens do not fit 500
])
def test_stall_names_its_cause(cfg, cause):
    """A chunk budget no prompt can use (below the page size, or below the truncation
    alignment for prompts longer than a chunk: R-ADM-3 step 7 refuses every chunk) is named as
    the cause, not the KV pool."""
    tr = Trace("t", [TraceRequest(index=0, arrival_s=0.0, input_len=900, output_len=5, output_key=1)])
    with pytest.raises(SimulationError, match=r"request r0 .*can never be admitted") as e:
        _run(tr, kv=500 if "KV" in cause else 20_000, **cfg)
    assert cause in str(e.value)


def test_check_reports_the_first_violation():
    class Broken(ReferenceScheduler):
        calls = 0

        def check_integrity(self):
            Broken.calls += 1
            if Broken.calls == 3:
                raise AssertionError("pool accounting: a KV slot is owned twice or lost")
            super().check_integrity()

    with pytest.raises(SimulationError, match=r"engine step \d+ \(t=[0-9.]+ s\): integrity check failed.*owned twice"):
        _run(synthetic_workload(5), make=Broken)
    s, _, _ = _run(synthetic_workload(5), make=Broken, check=False)  # not called without check
    assert s["check_wall_s"] is None


@pytest.mark.parametrize("kv", [0, -1])
def test_bad_kv_tokens(kv):
    with pytest.raises(ValueError, match="kv_tokens"):
        _run(synthetic_workload(2), kv=kv)


def test_new_token_ratio_public_and_checked():
    """`gpu_sched.NewTokenRatio` is the simulator's tracker, made from a config's
    conservativeness; a conservativeness that is not a finite number > 0 is refused."""
    import gpu_sched
    from gpu_sched import SchedulerConfig

    assert gpu_sched.NewTokenRatio is NewTokenRatio
    r = NewTokenRatio.from_config(SchedulerConfig(schedule_conservativeness=0.5))
    assert r.init == 0.35 and r.value == 0.35
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="conservativeness must be a finite number > 0"):
            NewTokenRatio(bad)


# ---- what the step records say (hand-computed; cost constants are powers of two: exact sums) ----
_HAND = CostModel(name="hand", description="hand", fixed_s=0.5, prefill_token_s=0.25, decode_request_s=0.125,
                  kv_token_s=0.0)


def _hand_req(i, arrival, n_in, n_out, segments):
    return TraceRequest(index=i, arrival_s=arrival, input_len=n_in, output_len=n_out, output_key=i,
                        segments=tuple(segments))


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_step_records_count_the_tokens_prefilled_not_pages(backend):
    """At page size 4, r0 (10 tokens: 8 shared with r1, 2 its own) prefills 10 tokens and r1
    (the same 8, then 4 of its own), arriving once r0 is done, hits 8 and prefills 4. The
    step records hold 10 and 4 (the scheduler's input counter would say 12: it rounds each
    extend up to pages, R-ADM-2), so step_cache_hit_rate is 8 / 22, as prefix_cache_hit_rate;
    each prefill step costs 0.5 s + 0.25 s a token; `waiting` is 0 after both steps."""
    from gpu_sched import GpuScheduler

    make = ((lambda c, kv: ReferenceScheduler(c, kv)) if backend == "reference"
            else (lambda c, kv: GpuScheduler(c, kv, backend="torch", device="cpu")))
    trace = Trace(name="hand", requests=[_hand_req(0, 0.0, 10, 2, [(999, 0, 8), (1, 0, 2)]),
                                         _hand_req(1, 10.0, 12, 2, [(999, 0, 8), (2, 0, 4)])])
    s, reqs, steps = replay(trace, SchedulerConfig(page_size=4), kv_tokens=10_000, make_scheduler=make,
                            cost_model=_HAND)
    pre = [(t.prefill_tokens, t.hit_tokens, t.duration_s, t.waiting) for t in steps if t.kind == "prefill"]
    assert pre == [(10, 0, 3.0, 0), (4, 8, 1.5, 0)]
    assert s["step_cache_hit_rate"] == pytest.approx(8 / 22) and s["prefix_cache_hit_rate"] == pytest.approx(8 / 22)


def test_waiting_after_a_step_leaves_out_the_admitted():
    """`queue_len` counts the requests waiting when the scheduler ran; `waiting` those still
    waiting after the step: with max_running_requests 1 and three requests arriving at once,
    the first step sees 3 and leaves 2, and a later prefill step sees 2 and leaves 1."""
    trace = Trace(name="hand", requests=[_hand_req(i, 0.0, 4, 2, [(i, 0, 4)]) for i in range(3)])
    _, _, steps = replay(trace, SchedulerConfig(max_running_requests=1), kv_tokens=10_000,
                         make_scheduler=lambda c, kv: ReferenceScheduler(c, kv), cost_model=_HAND)
    pre = [(t.queue_len, t.waiting) for t in steps if t.kind == "prefill"]
    assert pre == [(3, 2), (2, 1), (1, 0)]


@pytest.mark.parametrize("arrivals,match", [((5.0, 0.0), "arrival_s 0.0 is before request 0's"),
                                            ((-10.0, 1.0), "must be >= 0")])
def test_replay_refuses_unsorted_or_negative_arrivals(arrivals, match):
    """Requests are submitted in trace order from simulated time 0, so a trace built in code
    with an early request listed late (it would wait for the one before it) or a negative
    arrival (its wait would count from before the start) is refused, naming the request."""
    trace = Trace(name="hand", requests=[_hand_req(i, a, 4, 2, [(i, 0, 4)]) for i, a in enumerate(arrivals)])
    with pytest.raises(ValueError, match=match):
        replay(trace, SchedulerConfig(), kv_tokens=10_000, make_scheduler=lambda c, kv: ReferenceScheduler(c, kv))


@pytest.mark.parametrize("field,value,error,match", [
    ("segments", ((1, 0, 5),), ValueError, "its segments hold 5 tokens, input_len is 10"),
    ("segments", ((1, -3, 10),), ValueError, "segment start must be in"),
    ("segments", ((1, 0),), TypeError, "a segment must be a"),
    ("hash_ids", (-1,), ValueError, "hash_ids item must be in"),
    ("hash_ids", (1, 2, 3), ValueError, "hash_ids has 3 ids, input_len 10 needs"),
    ("hash_ids", (1.5,), TypeError, "hash_ids item must be an int"),
    ("hash_ids", "ab", TypeError, "hash_ids must be a tuple"),
    ("output_key", -1, ValueError, "output_key must be in"),
    ("output_key", 1.5, TypeError, "output_key must be an int"),
    ("index", "a", TypeError, "index must be an int"),
    ("routing_key", 3, TypeError, "routing_key must be a str or None"),
    ("priority", 2.0, TypeError, "priority must be an int")])
def test_replay_checks_code_built_trace_fields_first(field, value, error, match):
    """A code-built trace's prompt fields are checked before the replay starts, naming the
    request and the field (segments that did not add up to input_len once failed mid-run in
    complete_prefill, blaming the scheduler; a wrong hash-id count ran silently)."""
    base = dict(index=1, arrival_s=0.5, input_len=10, output_len=2, output_key=1)
    trace = Trace("t", [TraceRequest(index=0, arrival_s=0.0, input_len=5, output_len=1),
                        TraceRequest(**{**base, field: value})])
    with pytest.raises(error, match=rf"trace request 1: {match}"):
        replay(trace, SchedulerConfig(), kv_tokens=1000, make_scheduler=lambda c, kv: ReferenceScheduler(c, kv))


def test_cost_model_from_its_costs_alone():
    """README's cost fields alone make a CostModel (name and description were required, so
    the JSON file's fields as keywords raised TypeError); labels must be strings."""
    m = CostModel(fixed_s=0.005, prefill_token_s=3e-5, decode_request_s=2e-5, kv_token_s=1e-8)
    assert (m.name, m.description, m.prefill_s(10, 0)) == ("custom", "", 0.005 + 10 * 3e-5)
    with pytest.raises(TypeError, match="CostModel name must be a str"):
        CostModel(name=3, fixed_s=0.0, prefill_token_s=0.0, decode_request_s=0.0, kv_token_s=0.0)


# ---- the scheduler's own time charged to the simulated clock (`scheduler_time`) ------------------
class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _costly(clock, step_s, finish_s=0.0):
    """A reference scheduler whose step() and finish() take step_s / finish_s on `clock`."""
    class Costly(ReferenceScheduler):
        def step(self, *a, **k):
            clock.now += step_s
            return super().step(*a, **k)

        def finish(self, rids):
            clock.now += finish_s
            return super().finish(rids)
    return Costly


def _timed_run(mode, step_s, finish_s=0.0, trace=None):
    clock = _FakeClock()
    tr = trace if trace is not None else _burst(30)
    return replay(tr, SchedulerConfig(schedule_policy="lpm"), kv_tokens=20_000,
                  make_scheduler=_costly(clock, step_s, finish_s), scheduler_time=mode, clock=clock)


def test_scheduler_time_free_charges_nothing_and_keeps_the_digest():
    """The default charges nothing: the same decisions as without a clock, whatever the calls take."""
    want, _, _ = _run(_burst(30), check=False, schedule_policy="lpm")
    summary, _, steps = _timed_run("free", 0.5, 0.25)
    assert summary["digest"] == want["digest"] and summary["mean_ttft_ms"] == want["mean_ttft_ms"]
    assert summary["charged_sched_s"] == 0.0 and all(s.charged_s == 0.0 for s in steps)
    assert summary["sched_calls_s"]["step"] == pytest.approx(0.5 * summary["sched_calls_n"]["step"])


def test_scheduler_time_blocking_charges_every_call_before_the_forward():
    """blocking: a step waits for its own step() and the finishes since the previous forward; the
    clock moves by exactly that plus the forward between two busy steps."""
    step_s, finish_s = 0.004, 0.001
    free, _, _ = _timed_run("free", step_s, finish_s)
    summary, _, steps = _timed_run("blocking", step_s, finish_s)
    busy = [s for s in steps if s.kind != "idle"]
    assert busy and all(s.charged_s >= step_s - 1e-12 for s in busy)
    ks = []
    for s in busy:  # its own step() and a whole number of finishes
        k = (s.charged_s - step_s) / finish_s
        assert k == pytest.approx(round(k), abs=1e-6) and round(k) >= 0
        ks.append(round(k))
    # every finish is charged to the next step but the last one's (no step follows it); the
    # burst arrives at once, so no idle gap absorbs any
    assert sum(ks) == summary["sched_calls_n"]["finish"] - 1
    for a, b in zip(steps, steps[1:]):
        if a.kind != "idle" and b.kind != "idle":
            assert b.t_s - a.t_s == pytest.approx(b.charged_s + b.duration_s)
    total = sum(s.charged_s for s in steps)
    assert summary["charged_sched_s"] == pytest.approx(total)
    n_steps, n_fin = summary["sched_calls_n"]["step"], summary["sched_calls_n"]["finish"]
    assert step_s * len(busy) <= total <= step_s * n_steps + finish_s * n_fin + 1e-9
    assert summary["mean_ttft_ms"] > free["mean_ttft_ms"]  # every prefill waited for its step()
    assert summary["scheduler_time"] == "blocking"


def test_scheduler_time_overlap_charges_what_outlasts_the_previous_forward():
    step_s = 0.05  # longer than any forward of this small trace
    summary, _, steps = _timed_run("overlap", step_s)
    prev = None
    seen = 0
    for s in steps:
        if s.kind == "idle":
            prev = None
            continue
        if prev is None:  # after an idle gap (or at the start) nothing ran beside it
            assert s.charged_s == pytest.approx(step_s)
        else:
            assert s.charged_s == pytest.approx(max(0.0, step_s - prev.duration_s))
            seen += 1
        prev = s
    assert seen > 10
    assert summary["charged_sched_s"] == pytest.approx(sum(s.charged_s for s in steps))
    # after an idle gap mid-run nothing ran beside the step's calls either
    sparse = synthetic_workload(12, seed=2, request_rate=0.05, turns=(1, 1), output_len=(2, 4))
    _, _, steps = _timed_run("overlap", step_s, trace=sparse)
    after = [b for a, b in zip(steps, steps[1:]) if a.kind == "idle" and b.kind != "idle"]
    assert len(after) >= 5 and all(b.charged_s == pytest.approx(step_s) for b in after)
    # calls shorter than every forward are hidden entirely
    hidden, _, steps = _timed_run("overlap", 1e-7)
    assert sum(s.charged_s > 0 for s in steps if s.kind != "idle") <= sum(
        1 for a, b in zip([None] + steps, steps) if b.kind != "idle" and (a is None or a.kind == "idle"))


def test_scheduler_time_bad_values_are_refused():
    with pytest.raises(ValueError, match="scheduler_time must be one of free, blocking, overlap, got 'slow'"):
        replay(_burst(3), SchedulerConfig(), kv_tokens=20_000, make_scheduler=ReferenceScheduler,
               scheduler_time="slow")
    with pytest.raises(TypeError, match="clock must be a callable"):
        replay(_burst(3), SchedulerConfig(), kv_tokens=20_000, make_scheduler=ReferenceScheduler, clock=1.0)


def test_scheduler_time_blocking_lets_idle_gaps_absorb_the_calls_before_them():
    """Requests far apart: each finishes before the next arrives, so the finish calls run while
    the engine idles and the first step after the gap waits for its own step() alone."""
    sparse = synthetic_workload(12, seed=2, request_rate=0.05, turns=(1, 1), output_len=(2, 4))
    step_s, finish_s = 0.002, 0.5
    summary, _, steps = _timed_run("blocking", step_s, finish_s, trace=sparse)
    after_idle = [b for a, b in zip(steps, steps[1:]) if a.kind == "idle" and b.kind != "idle"]
    assert len(after_idle) >= 5
    assert all(s.charged_s == pytest.approx(step_s) for s in after_idle)
    assert summary["sched_calls_n"]["finish"] >= 5


def test_scheduler_time_blocking_charges_what_an_idle_gap_cannot_absorb():
    """Calls longer than the idle gap after them: the gap hides its own length of them and the
    rest delays the next step (a finish of 100 s before gaps of seconds)."""
    sparse = synthetic_workload(12, seed=2, request_rate=0.2, turns=(1, 1), output_len=(1, 2))
    step_s, finish_s = 0.002, 100.0
    summary, _, steps = _timed_run("blocking", step_s, finish_s, trace=sparse)
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if a.kind == "idle" and b.kind != "idle"]
    assert len(pairs) >= 2
    late = 0
    for gap, s in pairs:
        assert 0 < gap.duration_s < finish_s
        left = s.charged_s - step_s  # the pending finishes' time past the gap, if any
        if left > 1e-9:
            k = (left + gap.duration_s) / finish_s  # whole finishes, less the gap
            assert k == pytest.approx(round(k), abs=1e-9) and round(k) >= 1
            late += 1
        else:
            assert left == pytest.approx(0.0, abs=1e-9)
    assert late >= 1
    free, _, _ = _timed_run("free", step_s, finish_s, trace=sparse)
    assert summary["mean_e2el_ms"] > free["mean_e2el_ms"] + 1e3


class _Seen:
    """make_scheduler that records every submitted Request's max_new_tokens."""

    def __init__(self):
        self.max_new = []

    def __call__(self, config, kv):
        sched = ReferenceScheduler(config, kv)
        submit = sched.submit

        def spy(reqs, now=None):
            reqs = list(reqs)
            self.max_new += [r.max_new_tokens for r in reqs]
            return submit(reqs, now=now)

        sched.submit = spy
        return sched


def test_max_new_tokens_is_one_cap_for_all_and_cuts_outputs():
    """replay(max_new_tokens=N): every request is submitted with max_new_tokens N and
    generates min(its output length, N) tokens; lof, whose key is max_new_tokens, then has
    nothing to sort by and decides as fcfs, where with each request's own output length it
    does not."""
    tr = _burst(30, output_len=(20, 60))
    seen = _Seen()
    cfg = SchedulerConfig(schedule_policy="lof")
    s, reqs, _ = replay(tr, cfg, kv_tokens=20_000, make_scheduler=seen, max_new_tokens=32, check=True)
    assert seen.max_new == [32] * len(tr) and s["max_new_tokens"] == 32
    assert [r.output_len for r in reqs] == [min(max(t.output_len, 1), 32) for t in tr]
    assert s["total_output_tokens"] == sum(min(max(t.output_len, 1), 32) for t in tr)
    fcfs = replay(tr, SchedulerConfig(), kv_tokens=20_000, make_scheduler=ReferenceScheduler, max_new_tokens=32)[0]
    assert s["digest"] == fcfs["digest"]
    own = replay(tr, cfg, kv_tokens=20_000, make_scheduler=ReferenceScheduler)[0]
    assert own["digest"] != replay(tr, SchedulerConfig(), kv_tokens=20_000, make_scheduler=ReferenceScheduler)[0]["digest"]
    assert own["max_new_tokens"] is None
    for bad, err in ((0, ValueError), (2**24 + 1, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(err, match="max_new_tokens"):
            replay(tr, cfg, kv_tokens=20_000, make_scheduler=ReferenceScheduler, max_new_tokens=bad)


class _Waits:
    """make_scheduler that recomputes every request's queueing delay from the scheduler's own
    calls: a wait starts at submission (its enqueue time, the arrival), at a preemption or a
    retraction (the step's time), and ends at the step that admits the request (with
    scheduler time free, its forward starts then)."""

    def __init__(self):
        self.start, self.total, self.now = {}, {}, None

    def __call__(self, config, kv):
        sched = ReferenceScheduler(config, kv)
        submit, step, retract = sched.submit, sched.step, sched.retract_decode

        def on_submit(reqs, now=None):
            reqs = list(reqs)
            for r in reqs:
                self.start[r.rid] = r.enqueue_time
            return submit(reqs, now=now)

        def on_step(ratio, now=None):
            plan = step(ratio, now=now)
            self.now = now
            for rid in plan.preempted:
                self.start[rid] = now
            for rid, _, _ in plan.admitted:
                if rid in self.start:
                    self.total[rid] = self.total.get(rid, 0.0) + now - self.start.pop(rid)
            return plan

        def on_retract():
            rids = retract()
            for rid in rids:
                self.start[rid] = self.now
            return rids

        sched.submit, sched.step, sched.retract_decode = on_submit, on_step, on_retract
        return sched


@pytest.mark.parametrize("case", ["chunked", "retractions", "preemptions"])
def test_queueing_delay_equals_the_waits_the_scheduler_saw(case):
    """Each request's queued_s is the sum of its waits as the scheduler's calls show them
    (from arrival, preemption or retraction to the admitting step), the time-average queue
    length is their sum over the duration (Little's law), and the KV share held by requests
    is the used share less the evictable cache, averaged over the steps' times."""
    from gpu_sched.sim.traces import assign_keys

    cfg = {"chunked": dict(schedule_policy="lpm", chunked_prefill_size=512),
           "retractions": dict(schedule_policy="lpm", clip_max_new_tokens=8),
           "preemptions": dict(enable_priority_scheduling=True, enable_priority_preemption=True,
                               priority_scheduling_preemption_threshold=0, max_running_requests=4)}[case]
    tr = _burst(40, output_len=(100, 200) if case == "retractions" else (20, 60))
    if case == "preemptions":
        tr = assign_keys(tr, priority_levels=4, seed=0)
    waits = _Waits()
    s, reqs, steps = replay(tr, SchedulerConfig(**cfg), kv_tokens=2000 if case == "retractions" else 20_000,
                            make_scheduler=waits)
    moved = {"chunked": 0, "retractions": s["retractions"], "preemptions": s["preemptions"]}[case]
    assert case == "chunked" or moved > 0
    assert sum(r.queued_s > 0 for r in reqs) > len(reqs) // 2  # a burst: most requests wait
    for r in reqs:
        assert r.queued_s == pytest.approx(waits.total.get(r.rid, 0.0), abs=1e-12), r.rid
        if not (r.retractions or r.preemptions):
            assert r.queued_s <= r.first_token_s - r.arrival_s + 1e-12
    assert s["time_avg_queue_len"] == pytest.approx(sum(waits.total.values()) / s["duration"])
    assert s["mean_queue_delay_ms"] == pytest.approx(1e3 * np.mean([waits.total.get(r.rid, 0.0) for r in reqs]))
    assert any(t.kv_evictable_tokens > 0 for t in steps) and all(
        0 <= t.kv_evictable_tokens <= t.kv_used_tokens for t in steps)
    t0 = min(r.arrival_s for r in reqs)  # from the first arrival: the idle gap before it is outside the run
    w = np.array([max(0.0, t.t_s - max(t.t_s - t.duration_s, t0)) for t in steps])
    held = np.array([(t.kv_used_tokens - t.kv_evictable_tokens) / t.kv_pool_tokens for t in steps])
    assert s["time_avg_kv_held"] == pytest.approx(float((w * held).sum() / w.sum()))


def test_queueing_delay_ends_as_the_forward_starts_when_the_scheduler_is_charged():
    """With the scheduler's time charged (blocking), a wait ends when the forward that
    prefills the request starts, after the charge: at a prefill step's t_s - duration_s."""
    ticks = iter(range(10**9))
    tr = _burst(30)
    s, reqs, steps = replay(tr, SchedulerConfig(schedule_policy="lpm"), kv_tokens=20_000,
                            make_scheduler=ReferenceScheduler, scheduler_time="blocking",
                            clock=lambda: next(ticks) * 1e-4)
    assert s["charged_sched_s"] > 0
    starts = np.array([t.t_s - t.duration_s for t in steps if t.kind == "prefill"])
    for r in reqs:
        assert np.abs(starts - (r.arrival_s + r.queued_s)).min() < 1e-9, r.rid


def test_retraction_sums_use_the_requests_max_new_tokens(monkeypatch):
    """After a retraction the new-token ratio is reset from the running requests' max_new_tokens
    (R-DEC-1): with --max-new-tokens N, N for each of them, not their output lengths."""
    seen = []
    orig = NewTokenRatio.after_retraction

    def spy(self, out, n, max_new):
        seen.append((n, max_new))
        return orig(self, out, n, max_new)

    monkeypatch.setattr(NewTokenRatio, "after_retraction", spy)
    tr = _burst(30, output_len=(100, 200))
    s, _, _ = replay(tr, SchedulerConfig(schedule_policy="lpm", clip_max_new_tokens=8), kv_tokens=2000,
                     make_scheduler=ReferenceScheduler, max_new_tokens=150)
    assert s["retractions"] > 0 and seen and all(m == 150 * n for n, m in seen)


def test_priority_preemptions_are_counted_apart_from_retractions():
    from gpu_sched.sim.traces import assign_keys

    tr = assign_keys(_burst(40, output_len=(40, 80)), priority_levels=4, seed=0)
    s, reqs, _ = _run(tr, schedule_policy="fcfs", enable_priority_scheduling=True, enable_priority_preemption=True,
                      priority_scheduling_preemption_threshold=0, max_running_requests=4)
    assert s["preemptions"] > 0 and s["preemptions"] == sum(r.preemptions for r in reqs)
    assert s["retractions"] == sum(r.retractions for r in reqs) == 0
    assert [r.priority for r in reqs] == [t.priority for t in tr]
    assert set(s["by_priority"]) == {str(p) for p in {t.priority for t in tr}}
