"""benchmarks/count_launches.py: the recorded step's kernel count (the figure that stands in for
its GPU cost on a machine without one) is counted, and stays where the fused kernels put it."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
pytest.importorskip("triton")
import count_launches  # noqa: E402

pytestmark = pytest.mark.no_poison  # counts torch ops: the poison's fills would count


def test_recorded_step_launch_counts(tmp_path, capsys):
    out = tmp_path / "rows.json"
    count_launches.main(["--policies", "fcfs,lpm,dfs-weight", "--n", "16", "--queue", "synthetic", "--warm", "20",
                         "--by-site", "--out", str(out)])
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    # 29, 30 and 53 when written (session 41); 157, 192 and ~250 in session 37 (dfs-weight's
    # pointer-jumping rounds, one launch each, grow with the tree: 61 on the Mooncake queue)
    for pol, most in (("fcfs", 32), ("lpm", 33), ("dfs-weight", 56)):
        r = rows[pol]
        total = r["torch_ops"] + r["triton_launches"]
        assert 0 < r["torch_ops"] and 0 < r["triton_launches"] and total <= most, (pol, r["sites"], r["triton"])
        # the fused launches are the ones counted: lock drops, the admission result
        assert {"_lock_first_kernel", "_result_kernel", "_prepare_kernel"} <= set(r["triton"]), r["triton"]
    assert "_head_hash_kernel" in rows["lpm"]["triton"]
    assert "[triton] _result_kernel" in capsys.readouterr().out


def test_counter_skips_views_and_counts_kernels():
    import torch

    x = torch.arange(8)
    with count_launches.LaunchCounter("line") as c:
        y = x.view(2, 4)[0]  # views: no kernel
        z = (y + 1) * 2  # two kernels
        torch.where(z > 3, z, 0)  # compare and where (the 0 wrapped: no kernel)
    assert sum(c.ops.values()) == 4, c.ops
    assert c.sites == {"?": 4}  # no gpu_sched frame calls them


@pytest.mark.parametrize("argv,message", [
    (["--n", "0"], "--n must be >= 1"), (["--warm", "-1"], "--warm must be >= 0"),
    (["--trace", "/no/such.jsonl"], "no such file")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        count_launches.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
