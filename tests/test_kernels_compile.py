"""Every Triton kernel the kernel tests launch compiles for an NVIDIA GPU (sm_90), on a machine
without one (`benchmarks/compile_kernels.py`): the interpreter that runs the kernels on a CPU
never compiles them, and accepts code the compiler refuses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend is not installed")
def test_every_launched_kernel_compiles_for_sm90(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_kernels.py"), "--archs", "90",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    rows = json.loads(out.read_text())
    kernels = {row["kernel"] for row in rows}
    assert not any(row["error"] for row in rows), tail
    # the kernels of every family: ordering keys, dfs-weight, radix tree, admission, ignore-EOS, preemption
    for name in ("sort_keys._dedup_insert_kernel", "dfs_weight._match_node_kernel", "dfs_weight._sibling_run_kernel",
                 "radix._find_kernel", "admission._round_kernel", "ignore_eos.", "preempt."):
        assert any(name in k for k in kernels), (name, sorted(kernels))
    assert len(kernels) >= 39, sorted(kernels)
