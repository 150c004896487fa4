"""benchmarks/profile_step.py: the host-read counter and one small report (so that the tool a GPU
session relies on keeps working)."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import profile_step  # noqa: E402


def test_sync_counter_counts_reads_of_tensor_values():
    x = torch.arange(6)
    with profile_step.SyncCounter() as c:
        x.tolist()
        x[x > 2]  # boolean mask: nonzero inside
        x[torch.tensor([1, 2])]  # integer index: no read
        torch.repeat_interleave(x, x, output_size=15)
        torch.repeat_interleave(x, x)  # output size from the data
        (x * 2).sum()
        bool(x.any())
    names = sorted(k.split(" @ ")[0] for k in c.sites.elements())
    assert names == ["__bool__", "__getitem__", "repeat_interleave", "tolist"], names


def test_profile_report_of_a_recorded_step(tmp_path, capsys):
    out = tmp_path / "p.json"
    profile_step.main(["--policy", "lpm", "--n", "32", "--mode", "graph", "--steps", "1", "--queue", "synthetic",
                       "--warm", "20", "--top", "3", "--threads", "0", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["graph_recordings"] == 0 and rep["aten_calls"] > 0
    assert {"step", "order", "graph.compute", "graph.read", "admission"} <= set(rep["phases_s"]), rep["phases_s"]
    # the recorded step's one read-back (a host copy of its output, read as numpy) is found,
    # once, at its call site
    reads = {k: v for k, v in rep["syncs"].items() if "@ step.py" in k and k.endswith("_read")}
    assert list(reads.values()) == [1] and next(iter(reads)).startswith("numpy @"), rep["syncs"]
    assert "host syncs in one step" in capsys.readouterr().out


def test_bad_arguments_are_one_line_errors(capsys):
    """Counts below their floor, a --trace that is not there (only the default trace may be
    absent: then the synthetic queue) and CUDA without CUDA stop before any work."""
    import pytest

    cases = [(["--n", "0"], "--n must be >= 1"), (["--steps", "0"], "--steps must be >= 1"),
             (["--warm", "-1"], "--warm must be >= 0"), (["--trace", "/no/such.jsonl"], "no such file")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "torch sees no CUDA device"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            profile_step.main(["--device", "cpu"] + argv if "--device" not in argv else argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def _one(i):
    return len([i])


def _three():
    x = 0
    for i in range(3):
        x += _one(i)
    return x


def test_host_work_counts_calls_by_function():
    """Python calls and C calls are counted where they run (the counter's own call of
    sys.setprofile is not), lines by function, and the tracer is removed after the call."""
    w = profile_step.count_host_work(_three)
    rows = {r["function"]: r for r in w["by_function"]}
    assert rows["test_profile_step.py:_three"]["py_calls"] == 1 and rows["test_profile_step.py:_three"]["c_calls"] == 0
    assert rows["test_profile_step.py:_one"]["py_calls"] == 3 and rows["test_profile_step.py:_one"]["c_calls"] == 3
    assert set(rows) == {"test_profile_step.py:_three", "test_profile_step.py:_one"}, rows
    assert (w["py_calls"], w["c_calls"]) == (4, 3)
    assert w["lines"] == sum(r["lines"] for r in rows.values()) and rows["test_profile_step.py:_one"]["lines"] == 3
    assert sys.getprofile() is None


def test_profile_report_counts_both_schedulers_host_work(tmp_path, capsys):
    out = tmp_path / "p.json"
    profile_step.main(["--policy", "fcfs", "--n", "24", "--steps", "1", "--queue", "synthetic", "--warm", "10",
                       "--top", "40", "--threads", "0", "--count-host-work", "--out", str(out)])
    work = json.loads(out.read_text())["host_work"]
    for who, fn in (("gpu_sched", "scheduler.py:_admission_scan"), ("reference", "policy.py:order_queue")):
        w = work[who]
        assert w["lines"] > 0 and w["py_calls"] > 0, (who, w)
        assert fn in {r["function"] for r in w["by_function"]}, (who, w["by_function"])
    assert "host work of one step, counted" in capsys.readouterr().out
