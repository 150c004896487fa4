"""Replay on real Mooncake requests: the decision digest (every step's admitted rids, extend
ranges, chunked and preempted requests) is identical for the reference, torch and Triton
backends, for lpm, fcfs and dfs-weight. KV pool small enough that eviction, chunking and
retraction all happen."""

from pathlib import Path

import pytest
import torch

from gpu_sched.config import SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.scheduler import GpuScheduler
from gpu_sched.sim.engine import replay
from gpu_sched.sim.traces import read_mooncake

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def run(trace, policy, factory, kv=200_000):
    cfg = SchedulerConfig(schedule_policy=policy, chunked_prefill_size=8192, max_running_requests=64)
    summary, _, _ = replay(trace, cfg, kv_tokens=kv, make_scheduler=factory)
    return summary["digest"], summary


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_torch_backend_digest_equals_reference(policy):
    if not TRACE.exists():
        pytest.skip("Mooncake trace not found")
    trace = read_mooncake(TRACE, limit=80, rate_scale=4.0)
    a, sa = run(trace, policy, lambda c, k: ReferenceScheduler(c, k))
    b, sb = run(trace, policy, lambda c, k: GpuScheduler(c, k, backend="torch"))
    assert a == b
    assert sa["completed"] == sb["completed"] == 80


def test_triton_backend_digest_equals_reference():
    """Triton kernels: compiled on CUDA, else in the interpreter (conftest.py chose it)."""
    if not TRACE.exists():
        pytest.skip("Mooncake trace not found")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    trace = read_mooncake(TRACE, limit=12, rate_scale=4.0)
    a, _ = run(trace, "lpm", lambda c, k: ReferenceScheduler(c, k), kv=200_000)
    b, _ = run(trace, "lpm", lambda c, k: GpuScheduler(c, k, backend="triton", device=dev), kv=200_000)
    assert a == b


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_recorded_step_digest_equals_reference(policy):
    """`gpu-sched replay --capture N`: the recorded step (a CUDA graph on CUDA) decides like the
    reference over a real trace slice."""
    if not TRACE.exists():
        pytest.skip("Mooncake trace not found")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    trace = read_mooncake(TRACE, limit=40, rate_scale=4.0)
    a, _ = run(trace, policy, lambda c, k: ReferenceScheduler(c, k))
    graphs = []

    def make(c, k):
        s = GpuScheduler(c, k, backend="torch", device=dev)
        graphs.append(s.capture(queue_capacity=64, running_capacity=64))
        return s

    b, sb = run(trace, policy, make)
    assert a == b
    assert sb["completed"] == 40 and graphs[0].runs > 10
