"""benchmarks/bench_sched_time.py: the same replay per preset, backend and --scheduler-time
mode, in one table (a small synthetic replay)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_sched_time  # noqa: E402


def test_rows_per_preset_backend_and_mode(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--synthetic-requests", "40", "--presets", "default", "--backends", "reference,torch",
            "--modes", "free,blocking", "--out", str(out)]
    assert bench_sched_time.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["scheduler_time"]) for r in rows] == [
        ("reference", "free"), ("reference", "blocking"), ("torch", "free"), ("torch", "blocking")]
    free = [r for r in rows if r["scheduler_time"] == "free"]
    assert len({r["digest"] for r in free}) == 1  # free: the backends decide alike
    assert all(r["charged_s"] == 0.0 and r["calls_s"] > 0 for r in free)
    for r in rows:
        if r["scheduler_time"] == "blocking":  # every call charged but those an idle gap hid
            assert 0 < r["charged_s"] <= r["calls_s"] + 1e-9
        assert r["policy"] == "lpm" and r["preset"] == "default" and r["mean_ttft_s"] > 0
        assert 0 <= r["hit_rate"] <= 1 and len(r["digest"]) == 64 and r["run_id"]
    table = capsys.readouterr().out
    assert "charged s" in table and "blocking" in table
    assert bench_sched_time.main(argv[:-6] + ["--presets", "sglang", "--backends", "reference", "--modes", "free",
                                              "--out", str(out)]) == 0
    more = json.loads(out.read_text())
    assert len(more) == len(rows) + 1 and more[-1]["preset"] == "sglang"


@pytest.mark.parametrize("flag, value", [("--modes", "free,slow"), ("--backends", "gpu"), ("--presets", "vllm")])
def test_bad_names_are_refused(flag, value):
    with pytest.raises(SystemExit, match=f"{flag} takes distinct names"):
        bench_sched_time.main([flag, value])


def test_out_is_checked_before_any_run(tmp_path, capsys):
    """--out as the other benchmarks take it (`bench_args.existing_rows`): a folder or a file
    that is not a JSON list is refused before any run (exit 2, naming it); missing folders
    are made."""
    (tmp_path / "text.json").write_text("not json")
    for bad, msg in ((tmp_path, "is a folder, not a JSON file"), (tmp_path / "text.json", "is not a JSON list")):
        with pytest.raises(SystemExit) as e:
            bench_sched_time.main(["--synthetic-requests", "5", "--out", str(bad)])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    out = tmp_path / "missing" / "rows.json"
    assert bench_sched_time.main(["--synthetic-requests", "5", "--presets", "default", "--backends", "reference",
                                  "--modes", "free", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 1
