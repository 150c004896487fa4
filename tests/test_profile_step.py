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
    # the recorded step's one read-back is found, at its call site
    assert any(k.startswith("tolist @ step.py") and k.endswith("_read") for k in rep["syncs"]), rep["syncs"]
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
