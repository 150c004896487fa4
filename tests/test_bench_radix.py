"""benchmarks/bench_radix.py's argument checks: one line and status 2 before the trace is read
(it used to end in ZeroDivisionError or StatisticsError after the build)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_radix  # noqa: E402


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "0"], "--sizes must be comma-separated ints >= 1"), (["--lengths", "x"], "--lengths must be"),
    (["--reps", "0"], "--reps must be >= 1"), (["--build", "0"], "--build must be >= 1"),
    (["--len-batch", "0"], "--len-batch must be >= 1"), (["--threads", "-1"], "--threads must be >= 0"),
    (["--backends", "foo"], "unknown backend 'foo'")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_radix.main(argv + ["--device", "cpu"])
    assert e.value.code == 2 and message in capsys.readouterr().err
