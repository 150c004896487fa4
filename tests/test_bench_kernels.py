"""benchmarks/bench_kernels.py runs its cases end to end (a tiny dry run: on a CPU the Triton
launches run in the interpreter), its variants agree, and bad arguments are refused."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_kernels  # noqa: E402


def test_every_case_runs_and_variants_agree(tmp_path):
    out = tmp_path / "rows.json"
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels take CUDA tensors
    rows = bench_kernels.main(["--sizes", "20", "--reps", "1", "--device", dev, "--out", str(out)])
    assert {r["case"] for r in rows} == set(bench_kernels.CASES)
    assert len(rows) == 2 + 4 + 4 + 3 and all(r["us"] > 0 and r["n"] == 20 for r in rows)
    assert out.exists()


def test_variants_that_disagree_are_reported():
    with pytest.raises(AssertionError, match="sort n=3: the variants disagree"):
        bench_kernels.same([torch.tensor([0, 1, 2]), torch.tensor([0, 2, 1])], "sort n=3")


@pytest.mark.parametrize("argv,msg", [(["--cases", "sorts"], "unknown case"), (["--sizes", "0"], "--sizes must be comma-separated ints >= 1"),
                                      (["--sizes", "x"], "--sizes must be comma-separated ints >= 1"), (["--reps", "0"], "--reps must be >= 1")])
def test_bad_arguments_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit):
        bench_kernels.main(argv + ["--device", "cpu"])
    assert msg in capsys.readouterr().err
