"""The conformance scenarios (../shared/conformance) through the device scheduler: every
scenario with the torch backend, a spread sample with the Triton backend (interpreter on CPU)."""

import collections
import itertools
import os
from pathlib import Path

import pytest

from gpu_sched.conformance import read_scenarios, run_file, run_scenario
from gpu_sched.scheduler import GpuScheduler

SCENARIOS = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "scenarios.jsonl.gz"
DEVICE = os.environ.get("GPU_SCHED_TEST_DEVICE", "cpu")

pytestmark = pytest.mark.skipif(not SCENARIOS.exists(), reason="conformance scenarios not found")


def test_torch_backend_passes_every_scenario():
    lines = []
    passed, failed = run_file(SCENARIOS, lambda c, k, s: GpuScheduler(c, k, shuffle=s, backend="torch", device=DEVICE),
                              echo=lines.append)
    assert failed == 0, "\n".join(lines[:10])
    assert passed == 515


@pytest.mark.skipif(DEVICE == "cuda", reason="a CUDA graph recorded per scenario: too slow for gpu_check.sh; "
                                             "test_step_graph replays graphs on CUDA, CI runs this on the CPU")
def test_recorded_step_passes_every_scenario():
    """`GpuScheduler.capture()`: the recorded step decides every step that fits its capacities
    (every policy, random from the scenario's permutations; larger queues take the eager
    path)."""
    lines, graphs = [], []

    def make(c, k, s):
        sched = GpuScheduler(c, k, shuffle=s, backend="torch", device=DEVICE)
        graphs.append((c.effective_policy, sched.capture(queue_capacity=64, running_capacity=64)))
        return sched

    passed, failed = run_file(SCENARIOS, make, echo=lines.append)
    assert failed == 0, "\n".join(lines[:10])
    assert passed == 515
    runs = collections.Counter()
    for sched_policy, g in graphs:
        runs[sched_policy] += g.runs
    # steps it decided per policy (fcfs 105, lof 70, routing-key 65, lpm 95, dfs-weight 66, random 37 when written)
    assert min(runs[p] for p in ("fcfs", "lof", "routing-key", "lpm", "dfs-weight")) > 40, runs
    assert runs["random"] > 20, runs


def test_triton_backend_passes_a_sample():
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sample = list(itertools.islice(read_scenarios(SCENARIOS), 0, None, 13))  # 40 spread over families
    errors = []
    for sc in sample:
        out = run_scenario(sc, lambda c, k, s: GpuScheduler(c, k, shuffle=s, backend="triton", device=DEVICE))
        if out.error:
            errors.append(f"{out.id}: {out.error[:200]}")
    assert not errors, "\n".join(errors[:10])
