"""benchmarks/bench_cold.py: the warm / cold timings of numpy call sequences and of one step
(rows and their fields; no timing is asserted)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_cold  # noqa: E402


def test_rows_for_every_condition(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--queue", "synthetic", "--warm", "10", "--distinct", "32", "--n", "32", "--policy", "lpm",
            "--reps", "2", "--sweep-mib", "1", "--sleep-ms", "0", "--spin-ms", "0.5", "--out", str(out)]
    assert bench_cold.main(argv) == 0
    rows = json.loads(out.read_text())
    calls = [r for r in rows if r["experiment"] == "calls"]
    steps = [r for r in rows if r["experiment"] == "step"]
    assert {(r["condition"], r["n"]) for r in calls} == {(c, n) for c in ("warm", "after-write")
                                                         for n in bench_cold.CALLS_SIZES}
    others = {"after-reference", "after-write", "after-sleep", "after-spin-0.5ms"}
    assert {(r["rotation"], r["condition"]) for r in steps} == {(o, c) for o in others for c in ("warm", o)}
    for r in rows:
        assert r["reps"] == 2 and 0 < r["median_us"] <= r["p90_us"] and r["command"].endswith(str(out))
    for n in bench_cold.CALLS_SIZES:  # one extra per size, from that size's two medians
        pair = {r["condition"]: r for r in calls if r["n"] == n}
        extra = (pair["after-write"]["median_us"] - pair["warm"]["median_us"]) / bench_cold.N_CALLS
        assert pair["warm"]["extra_us_per_call"] == pytest.approx(extra)
    assert all(r["n"] == 32 and r["policy"] == "lpm" for r in steps)
    assert "after-reference" in capsys.readouterr().out
    assert bench_cold.main(argv[:-2] + ["--skip-step", "--out", str(out)]) == 0  # appends
    assert len(json.loads(out.read_text())) == len(rows) + len(calls)


@pytest.mark.parametrize("argv, words", [(["--n", "0"], "--n must be >= 1"),
                                         (["--reps", "0"], "--reps must be >= 1"),
                                         (["--sleep-ms", "-1"], "must be >= 0"),
                                         (["--spin-ms", "1,x"], "comma-separated numbers"),
                                         (["--spin-ms", "-5"], "in [0, 10000)")])
def test_bad_arguments_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        bench_cold.parse_args(argv)
    assert words in capsys.readouterr().err
