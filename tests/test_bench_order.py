"""benchmarks/bench_order.py: its rows to CSV (every row's keys: the reference's rows have no
`threads`), the other scripts' policy names, and one-line errors for bad arguments."""

import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_order  # noqa: E402


def test_rows_to_csv_with_the_reference_first(tmp_path):
    out = tmp_path / "rows.csv"
    rows = bench_order.main(["--sizes", "48", "--policies", "routing-key,fcfs", "--budget-s", "0.01",
                             "--device", "cpu", "--out", str(out)])
    with open(out, newline="") as f:
        got = list(csv.DictReader(f))
    assert [(r["policy"], r["backend"]) for r in got] == [(r["policy"], r["backend"]) for r in rows] == [
        ("routing", "reference"), ("routing", "torch"), ("fcfs", "reference"), ("fcfs", "torch")]
    assert got[0]["threads"] == "" and got[1]["threads"] != ""


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "0"], "--sizes must be comma-separated ints >= 1"), (["--sizes", "abc"], "--sizes must be comma-separated ints >= 1"),
    (["--backends", "foo"], "unknown backend 'foo'"), (["--device", "foo"], "--device 'foo' is not a torch device"),
    (["--policies", "fcfs,foo"], "unknown policy 'foo'"), (["--threads", "-1"], "--threads must be >= 0"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_order.main(["--device", "cpu"] + argv if "--device" not in argv else argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
