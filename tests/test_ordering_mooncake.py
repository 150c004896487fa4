"""Ordering on real Mooncake prefixes (R-ORD-8/9/10): the GpuScheduler's device ordering
(batched hash match, in-batch deprioritization, lpm / dfs-weight sort) against the reference,
with an empty cache and with a cache warmed by earlier requests of the trace."""

from pathlib import Path

import pytest

from gpu_sched.config import SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.request import Request
from gpu_sched.scheduler import GpuScheduler
from gpu_sched.sim.traces import read_mooncake

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


@pytest.fixture(scope="module")
def trace():
    if not TRACE.exists():
        pytest.skip("Mooncake trace not found beside the project")
    return read_mooncake(TRACE, limit=700)


def requests(rows, tag, cut=None):
    out = []
    for r in rows:
        p = r.prompt_ids()
        out.append(Request(rid=f"{tag}{r.index}", prompt_ids=p[:cut] if cut else p, max_new_tokens=r.output_len or 1,
                           enqueue_time=r.arrival_s))
    return out


@pytest.mark.parametrize("policy,warm,page_size", [
    ("lpm", False, 1), ("lpm", True, 1), ("lpm", True, 16), ("dfs-weight", True, 1), ("dfs-weight", False, 16)])
def test_device_ordering_equals_reference_on_mooncake(trace, policy, warm, page_size):
    cfg = SchedulerConfig(schedule_policy=policy, page_size=page_size)
    kv = 6_000_000
    ref, dev = ReferenceScheduler(cfg, kv), GpuScheduler(cfg, kv)
    if warm:
        for r in trace.requests[:400]:
            toks = r.prompt_ids()
            ref.seed_cache(toks)
            dev.seed_cache(toks)
    # a queue of later requests; half of them cut short so matches end inside cached nodes
    rows = trace.requests[400:700]
    reqs = requests(rows[:150], "a") + requests(rows[150:], "b", cut=700)
    ref.submit(reqs)
    dev.submit([Request(rid=r.rid, prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens,
                        enqueue_time=r.enqueue_time) for r in reqs])
    a, b = ref._order(), dev._order()
    assert [r.rid for r in a.queue] == [r.rid for r in b.queue]
    assert a.num_matched == b.num_matched
    assert a.deprioritized == b.deprioritized
    if not warm:
        # every Mooncake prompt starts with hash block 0: all but the first share T tokens
        assert len(a.deprioritized) == len(reqs) - 1
    else:
        assert sum(a.num_matched) > 0
    assert ref.cache.evictable_size == dev.cache.evictable_size
