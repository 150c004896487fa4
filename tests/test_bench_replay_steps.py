"""benchmarks/bench_replay_steps.py: per-queue-size step times of a replay, reference and torch
side by side (a small synthetic replay; rows, table and the digest check)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_replay_steps  # noqa: E402


def test_rows_per_bucket_and_backend(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--synthetic-requests", "40", "--runs", "2", "--warmup-requests", "5", "--out", str(out)]
    assert bench_replay_steps.main(argv) == 0
    rows = json.loads(out.read_text())
    buckets = [r for r in rows if r["bucket"] not in ("all", "call")]
    assert {r["backend"] for r in rows} == {"reference", "torch"}
    assert buckets and len(buckets) % 2 == 0
    for r in buckets:
        assert len(r["runs_us"]) == 2 and r["mean_us"] > 0 and r["count"] > 0 and r["lo"] <= r["hi"]
        if r["backend"] == "reference":
            assert r["speedup_vs_ref"] == pytest.approx(1.0)
    # one count per bucket: the schedules are the same (same digest), so are the queue lengths
    by = {}
    for r in buckets:
        by.setdefault(r["bucket"], set()).add(r["count"])
    assert all(len(c) == 1 for c in by.values())
    assert len({r["digest"] for r in rows}) == 1
    whole = {r["backend"]: r for r in rows if r["bucket"] == "all"}
    assert whole["torch"]["sched_wall_s"] > 0 and whole["reference"]["wall_s"] > 0
    # every engine call, per backend: the same counts (same schedule); the calls add up to calls_s
    calls = [r for r in rows if r["bucket"] == "call"]
    assert {r["call"] for r in calls} == {"step", "submit", "complete_prefill", "decode_fits", "retract_decode",
                                          "decode", "finish"}
    for b in ("reference", "torch"):
        mine = {r["call"]: r for r in calls if r["backend"] == b}
        assert mine["step"]["seconds"] == pytest.approx(whole[b]["sched_wall_s"])
        assert mine["finish"]["count"] > 0 and mine["decode"]["seconds"] > 0 and len(mine["step"]["runs_s"]) == 2
        assert whole[b]["calls_s"] >= whole[b]["sched_wall_s"]
        ref_all = whole["reference"]["calls_s"]
        assert whole[b]["calls_speedup_vs_ref"] == pytest.approx(ref_all / whole[b]["calls_s"])
        # each run's totals: the call rows' runs_s summed run by run, and that run's ratio
        per_run = [sum(r["runs_s"][k] for r in calls if r["backend"] == b) for k in range(2)]
        assert whole[b]["calls_runs_s"] == pytest.approx(per_run)
        assert whole[b]["sched_runs_s"] == pytest.approx(mine["step"]["runs_s"])
        assert whole[b]["calls_speedup_runs"] == pytest.approx(
            [x / y for x, y in zip(whole["reference"]["calls_runs_s"], per_run)])
    assert len({(r["call"], r["count"]) for r in calls}) == len(calls) // 2
    table = capsys.readouterr().out
    assert "x torch" in table and "reference us" in table and "complete_prefill" in table
    assert "all scheduler calls" in table
    # a second run appends
    assert bench_replay_steps.main(argv[:-2] + ["--runs", "1", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())) > len(rows)


@pytest.mark.parametrize("backends, words", [("torch,reference", "start with reference"),
                                             ("reference,reference", "each backend once"),
                                             ("reference,cuda", "unknown backend")])
def test_bad_backends_refused(backends, words, capsys):
    with pytest.raises(SystemExit):
        bench_replay_steps.parse_args(["--backends", backends])
    assert words in capsys.readouterr().err


def test_different_decisions_are_not_compared(monkeypatch):
    calls = iter(range(100))
    real = bench_replay_steps.replay

    def replay(*a, **k):  # every timed replay reports another digest
        s, r, st = real(*a, **k)
        return dict(s, digest=f"{next(calls):064d}"), r, st

    monkeypatch.setattr(bench_replay_steps, "replay", replay)
    with pytest.raises(SystemExit, match="decisions differ"):
        bench_replay_steps.main(["--synthetic-requests", "10", "--runs", "1", "--warmup-requests", "2"])
