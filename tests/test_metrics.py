"""Tests for gpu_sched.sim.metrics and gpu_sched.sim.plots on hand-computed records."""

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpu_sched.sim.metrics import (RequestRecord, StepRecord, format_comparison, format_summary,
                                   queue_bucket, summarize, write_results)
from gpu_sched.sim.plots import plot_comparison, plot_run


def _requests():
    return [
        # TTFT 100 ms, TPOT 0.2/3 s, ITL 50, 50, 100 ms, E2EL 300 ms
        RequestRecord("a", 0.0, 100, 4, 50, 0.1, 0.3, [0.1, 0.15, 0.2, 0.3]),
        # TTFT 200 ms, TPOT 100 ms, ITL 100 ms, E2EL 300 ms
        RequestRecord("b", 0.5, 200, 2, 0, 0.7, 0.8, [0.7, 0.8], retractions=1),
        # TTFT 400 ms, no TPOT/ITL (one token), E2EL 400 ms
        RequestRecord("c", 1.0, 100, 1, 100, 1.4, 1.4, [1.4]),
        # never prefilled: excluded from latencies, totals and hit rate
        RequestRecord("d", 1.2, 50, 0, 0, None, None, [], retractions=2),
    ]


def _steps():
    rows = [("idle", 0, 0, 1.0), ("prefill", 1, 100, 10), ("prefill", 3, 300, 20), ("decode", 2, 400, 30),
            ("decode", 0, 500, 5), ("prefill", 5, 800, 40), ("decode", 4, 600, 60)]
    return [StepRecord(t_s=0.2 * i, kind=k, duration_s=0.2, queue_len=q, running=1, kv_used_tokens=kv,
                       kv_pool_tokens=1000, prefill_tokens=10 * i, hit_tokens=5 * i,
                       sched_wall_s=us * (1 if k == "idle" else 1e-6))
            for i, (k, q, kv, us) in enumerate(rows)]


approx = pytest.approx


def test_latencies_match_hand_values_and_numpy():
    s = summarize(_requests(), _steps())
    ttft, tpot, itl, e2el = [100, 200, 400], [200 / 3, 100], [50, 50, 100, 100], [300, 300, 400]
    assert s["mean_ttft_ms"] == approx(700 / 3) and s["median_ttft_ms"] == approx(200)
    assert s["p90_ttft_ms"] == approx(360) and s["p99_ttft_ms"] == approx(396)  # linear interpolation
    assert s["std_ttft_ms"] == approx(math.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2) / 3))
    assert s["mean_tpot_ms"] == approx(250 / 3) and s["median_tpot_ms"] == approx(250 / 3)
    assert s["mean_itl_ms"] == approx(75) and s["median_itl_ms"] == approx(75) and s["p99_itl_ms"] == approx(100)
    assert s["mean_e2el_ms"] == approx(1000 / 3) and s["median_e2el_ms"] == approx(300)
    for key, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        a = np.asarray(vals, float)
        assert s[f"mean_{key}_ms"] == approx(a.mean()) and s[f"std_{key}_ms"] == approx(a.std())
        for p in (50, 90, 99):
            assert s[f"p{p}_{key}_ms"] == approx(np.percentile(a, p))


def test_throughput_cache_retractions_queue_kv():
    s = summarize(_requests(), _steps())
    assert (s["completed"], s["unfinished"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (400, 7)
    assert s["duration"] == approx(1.4)  # first arrival 0.0 -> last finish 1.4
    assert s["request_throughput"] == approx(3 / 1.4)
    assert s["output_throughput"] == approx(5.0)
    assert s["total_token_throughput"] == approx(407 / 1.4)
    assert s["prefix_cache_hit_rate"] == approx(150 / 400) and s["cached_tokens"] == 150
    assert s["step_cache_hit_rate"] == approx(1 / 3)  # hit 5i vs prefill 10i
    assert (s["retractions"], s["retracted_requests"]) == (3, 2)
    assert s["mean_queue_len"] == approx(15 / 7) and s["max_queue_len"] == 5
    assert s["mean_kv_usage"] == approx(2.7 / 7) and s["max_kv_usage"] == approx(0.8)
    s2 = summarize(_requests(), _steps(), duration_s=2.0)
    assert s2["duration"] == 2.0 and s2["output_throughput"] == approx(3.5)


def test_scheduler_time_and_buckets():
    s = summarize(_requests(), _steps())
    us = [10, 20, 30, 5, 40, 60]  # the idle step (1 s) is excluded
    assert s["sched_steps"] == 6
    assert s["mean_sched_us"] == approx(27.5) and s["median_sched_us"] == approx(25)
    assert s["p99_sched_us"] == approx(np.percentile(us, 99))
    b = s["sched_us_by_queue_len"]
    assert list(b) == ["0-0", "1-1", "2-3", "4-7"]
    assert [b[k]["count"] for k in b] == [1, 1, 2, 2]
    assert b["2-3"]["mean_us"] == approx(25) and b["4-7"]["mean_us"] == approx(50)
    assert b["4-7"]["p99_us"] == approx(np.percentile([40, 60], 99)) and (b["4-7"]["lo"], b["4-7"]["hi"]) == (4, 7)
    assert [queue_bucket(q) for q in (0, 1, 2, 3, 4, 7, 8, 1000)] == [
        (0, 0), (1, 1), (2, 3), (2, 3), (4, 7), (4, 7), (8, 15), (512, 1023)]


def test_empty_inputs():
    s = summarize([], [])
    assert s["completed"] == 0 and s["total_output_tokens"] == 0 and s["sched_steps"] == 0
    assert s["mean_ttft_ms"] is None and s["request_throughput"] is None and s["prefix_cache_hit_rate"] is None
    assert s["sched_us_by_queue_len"] == {}
    json.dumps(s, allow_nan=False)
    # requests that never finished: no latencies, no NaN
    s = summarize([RequestRecord("x", 0.0, 10, 0, 0, None, None, [])], [])
    assert s["completed"] == 0 and s["duration"] == 0.0 and s["p99_e2el_ms"] is None
    json.dumps(s, allow_nan=False)
    assert "n/a" in format_summary(s) and "n/a" in format_comparison({"empty": s})


def test_write_results_round_trip(tmp_path):
    reqs, steps = _requests(), _steps()
    s = summarize(reqs, steps)
    path = write_results(tmp_path / "run", s, reqs, steps, extra={"policy": "lpm", "bad": float("nan")})
    assert path == tmp_path / "run" / "results.json"
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["summary"] == json.loads(json.dumps(s))
    assert doc["config"] == {"policy": "lpm", "bad": None}
    assert doc["steps"]["queue_len"] == [0, 1, 3, 2, 0, 5, 4] and len(doc["steps"]["sched_wall_s"]) == 7
    assert set(doc["steps"]) == {f.name for f in dataclasses.fields(StepRecord)}
    # every summary metric but ITL (the per-token times stay in the records) recomputed from the file
    back_steps = [StepRecord(**{k: doc["steps"][k][i] for k in doc["steps"]}) for i in range(len(steps))]
    back_reqs = [RequestRecord(**{k: r[k] for k in (f.name for f in dataclasses.fields(RequestRecord))
                                  if k != "token_times"}) for r in doc["requests"]]
    again = json.loads(json.dumps(summarize(back_reqs, back_steps)))
    assert {k: v for k, v in again.items() if "itl" not in k} == {k: v for k, v in doc["summary"].items() if "itl" not in k}
    assert any("itl" in k for k in again)
    rows = {r["rid"]: r for r in doc["requests"]}
    assert rows["a"]["ttft_s"] == approx(0.1) and rows["c"]["e2el_s"] == approx(0.4)
    assert rows["d"]["ttft_s"] is None and rows["d"]["e2el_s"] is None and rows["a"]["cached_tokens"] == 50
    assert json.load(open(write_results(tmp_path / "empty", summarize([], []), [], [])))["requests"] == []


def test_format_summary_and_comparison():
    s = summarize(_requests(), _steps())
    text = format_summary(s)
    assert "Serving Benchmark Result" in text.splitlines()[0] and text.splitlines()[-1] == "=" * 50
    long = "Replay: conversation_trace, routing-key (16 routing keys), torch"  # past the width: still a rule
    assert format_summary(s, title=long).splitlines()[0] == f"== {long} =="
    for needle in ("233.33", "396.00", "75.00", "333.33", "37.50", "27.50", "2.14", "Successful requests:"):
        assert needle in text, needle
    line = next(l for l in text.splitlines() if l.startswith("Mean TTFT (ms):"))
    assert len(line) == 50 and line.endswith("233.33")  # value right-aligned
    s1 = dict(s, digest="0123456789abcdef0123")
    s2 = dict(summarize(_requests()[:1], _steps()[:2]), digest="fedcba9876543210")
    table = format_comparison({"fcfs": s1, "dfs-weight": s2})
    head = table.splitlines()[1]
    assert "fcfs" in head and "dfs-weight" in head
    assert "0123456789ab" in table and "0123456789abc" not in table and "fedcba987654" in table
    hit = next(l for l in table.splitlines() if l.startswith("Prefix cache hit rate"))
    assert "37.50" in hit and "50.00" in hit
    assert "233.33" in next(l for l in table.splitlines() if l.startswith("Mean TTFT"))


def test_plots_write_pngs(tmp_path):
    reqs, steps = _requests(), _steps()
    paths = plot_run(tmp_path / "p", reqs, steps, title="lpm")
    assert len(paths) == 4
    for p in paths + plot_run(tmp_path / "e", [], []):
        assert p.suffix == ".png" and p.stat().st_size > 0 and p.read_bytes()[:4] == b"\x89PNG"
    s = summarize(reqs, steps)
    p = plot_comparison(tmp_path / "c", {"fcfs": s, "lpm": s, "empty": summarize([], [])})
    assert p.exists() and p.read_bytes()[:4] == b"\x89PNG"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10), st.lists(st.floats(0, 1), max_size=5),
                          st.integers(1, 500), st.booleans()), max_size=8))
def test_random_records_match_numpy(rows):
    reqs = []
    for i, (arr, wait, gaps, inp, done) in enumerate(rows):
        times = list(np.cumsum([arr + wait] + gaps)) if done else []
        reqs.append(RequestRecord(str(i), arr, inp, len(times), inp // 2, times[0] if times else None,
                                  times[-1] if times else None, times))
    s = summarize(reqs, [])
    json.dumps(s, allow_nan=False)
    fin = [r for r in reqs if r.finish_s is not None]
    assert s["completed"] == len(fin)
    if fin:
        assert s["mean_e2el_ms"] == approx(np.mean([(r.finish_s - r.arrival_s) * 1e3 for r in fin]))
        itl = np.concatenate([np.diff(r.token_times) for r in fin]) * 1e3
        assert s["mean_itl_ms"] == (approx(itl.mean()) if itl.size else None)


def test_tiny_duration_gives_no_throughput_and_no_warning():
    """A duration so small that a rate overflows (a subnormal float) reads as no throughput,
    quietly (numpy's scalar divide used to warn of the overflow)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = summarize(_requests(), _steps(), duration_s=np.float64(5e-324))
    assert s["request_throughput"] is None and s["output_throughput"] is None


def test_queueing_delay_time_averages_preemptions_and_priority_levels():
    """Hand-checked: the queueing delay's statistics over completed requests, the time-average
    queue length as Little's law gives it (every request's queued_s / duration), the KV usage
    and held share weighted by step duration, preemptions apart from retractions, and the
    per-priority table."""
    reqs = [
        RequestRecord("a", 0.0, 100, 2, 0, 0.3, 0.5, [0.3, 0.5], queued_s=0.1, priority=1),
        RequestRecord("b", 0.5, 100, 1, 0, 1.5, 1.5, [1.5], queued_s=0.7, preemptions=2, priority=0),
        RequestRecord("c", 1.0, 100, 1, 0, 2.0, 2.0, [2.0], queued_s=0.4, retractions=1, priority=1),
        RequestRecord("d", 1.5, 100, 0, 0, None, None, [], queued_s=0.3),  # unfinished: only in the time average
    ]
    # an idle gap, then two steps; the second waited 0.5 s for the scheduler (charged) before
    # its 1 s forward; a step before the first arrival would count only from it
    steps = [StepRecord(0.5, "idle", 0.5, 0, 0, 400, 1000, 0, 0, 0.0, kv_evictable_tokens=400),
             StepRecord(0.5, "prefill", 0.0, 1, 1, 400, 1000, 100, 0, 1e-5, kv_evictable_tokens=100),
             StepRecord(2.0, "decode", 1.0, 2, 1, 800, 1000, 0, 0, 1e-5, charged_s=0.5, kv_evictable_tokens=600)]
    s = summarize(reqs, steps)
    assert s["duration"] == approx(2.0)
    assert s["mean_queue_delay_ms"] == approx(400) and s["p99_queue_delay_ms"] == approx(np.percentile([100, 700, 400], 99))
    assert s["time_avg_queue_len"] == approx((0.1 + 0.7 + 0.4 + 0.3) / 2.0)
    assert s["time_avg_kv_usage"] == approx((0.4 * 0.5 + 0.8 * 1.5) / 2.0)
    assert s["time_avg_kv_held"] == approx((0.0 * 0.5 + 0.2 * 1.5) / 2.0)
    assert s["mean_kv_usage"] == approx(1.6 / 3) and s["mean_queue_len"] == approx(1.0)  # per step, unweighted
    late = [dataclasses.replace(r, arrival_s=r.arrival_s + 0.25) for r in reqs]  # the first arrival at 0.25 s
    assert summarize(late, steps)["time_avg_kv_usage"] == approx((0.4 * 0.25 + 0.8 * 1.5) / 1.75)
    assert (s["retractions"], s["retracted_requests"], s["preemptions"], s["preempted_requests"]) == (1, 1, 2, 1)
    assert s["by_priority"] == {
        "0": {"completed": 1, "mean_ttft_ms": approx(1000), "p99_ttft_ms": approx(1000), "mean_queue_delay_ms": approx(700)},
        "1": {"completed": 2, "mean_ttft_ms": approx(650), "p99_ttft_ms": approx(np.percentile([300, 1000], 99)),
              "mean_queue_delay_ms": approx(250)}}
    text = format_summary(s)
    for label in ("Mean QD (ms):", "Priority preemptions (R-ADM-7):", "Queue length, time avg:",
                  "KV held by requests, time avg (%):", "priority 0 (n=1) TTFT mean/p99 (ms):"):
        assert label in text
    assert "by_priority" not in summarize(_requests(), _steps())  # no request has a priority
