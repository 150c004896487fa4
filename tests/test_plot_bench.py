"""benchmarks/plot_bench.py: every stage bench_queue.py writes gets its panel and table rows
(the recorded step's `graph` and `gstep` too), and sizes that are not powers of two keep
their own labels."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import plot_bench  # noqa: E402


def _rows():
    rows = []
    for n in (1000, 4096):
        for stage, backend, device, med in (("step", "reference", "cpu", 0.05), ("graph", "triton", "cuda", 3e-4),
                                            ("gstep", "triton", "cuda", 4e-3)):
            rows.append(dict(policy="lpm", stage=stage, n=n, backend=backend, device=device, median_s=med * n / 4096,
                             p90_s=med * n / 4096 * 1.1, us_per_req=med * 1e6 / 4096, run="r1",
                             ratio_to_ref=None if backend == "reference" else med / 0.05))
    return rows


def test_recorded_stages_are_drawn_and_tabled(tmp_path):
    rows = _rows()
    assert [s for s in plot_bench.STAGE_ORDER if s in ("graph", "gstep")] == ["graph", "gstep"]
    out = plot_bench.plot(rows, tmp_path / "p.png")
    assert Path(out).stat().st_size > 0
    table = plot_bench.markdown_table(rows)
    lines = table.splitlines()
    assert lines[0] == "| policy | stage | backend | 1,000 | 2^12 |"
    assert any(line.startswith("| lpm | graph | triton (cuda) |") for line in lines)
    assert "| lpm | gstep | triton (cuda) speedup | 12.5x | 12.5x |" in lines


def test_n_label():
    assert [plot_bench.n_label(n) for n in (1, 2, 4096, 1000, 100000)] == ["2^0", "2^1", "2^12", "1,000", "100,000"]


def test_every_benchmark_stage_is_drawn_in_bench_queues_order():
    """plot_bench's stage order names every stage bench_queue.py times, in its order: a stage
    it does not name would be left out of the plots and tables."""
    import bench_queue

    assert plot_bench.STAGE_ORDER == bench_queue.STAGES


@pytest.mark.parametrize("content,message", [
    (None, "no such file"), (b'{"a": 1}', "not a JSON list of benchmark rows"),
    (b"not json", "not a JSON list of benchmark rows"), (b"\xff\xfe", "not a JSON list of benchmark rows")])
def test_a_file_that_holds_no_rows_is_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "rows.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        plot_bench.main([str(path)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_markdown_to_stdout_is_the_table_alone(tmp_path, capsys):
    """`--markdown -` prints only the table on stdout (the PNG's path goes to stderr), so it
    can be redirected into a file; otherwise the written paths go to stdout."""
    import json

    path = tmp_path / "rows.json"
    path.write_text(json.dumps(_rows()))
    plot_bench.main([str(path), "--out", str(tmp_path / "p.png"), "--markdown", "-"])
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "| policy | stage | backend | 1,000 | 2^12 |"
    assert str(tmp_path / "p.png") in err and "p.png" not in out
    plot_bench.main([str(path), "--out", str(tmp_path / "q.png")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "q.png")
