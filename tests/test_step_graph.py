"""The fixed-capacity step (`gpu_sched.step.StepGraph`, `GpuScheduler.capture()`).

* `find_static` (fixed search rounds and probe windows) equals the data-dependent search on
  random trees, page sizes 1/4/16, lengths up to the bound;
* multi-step runs with the recorded step equal the reference scheduler (plans, queue, sizes,
  cache contents), for every policy (random with a shuffle shared with the reference), with
  capacities small enough that some steps overflow them and take the eager path; shorter runs
  with the triton backend (Triton's interpreter on a CPU);
* no host read inside the step: `StepGraph.compute` runs under a dispatch mode that raises on
  every op that reads tensor data back to the host or has a data-dependent shape;
* on CUDA: the same runs replay a CUDA graph (recorded at the first step, again only when a
  tensor it reads was reallocated), equal to the reference for 200 steps per configuration
  (skipped without CUDA).
"""

import os
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_sched import policy as PM
from gpu_sched.config import SchedulerConfig
from gpu_sched.radix import FlatRadixTree
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.request import Request
from gpu_sched.scheduler import GpuScheduler
from gpu_sched.step import GRAPH_POLICIES, StepGraph

from test_scheduler_differential import LONG_RUNS, run_long, run_pair

RECORDED_RUNS = sorted(k for k, v in LONG_RUNS.items()
                       if v.get("disable_radix_cache") or v["schedule_policy"] in GRAPH_POLICIES)


def _static_case(P, device="cpu"):
    """A tree with shared prefixes and 60 CSR queries on it: (tree, tok, toff, L, ns, ch, coff),
    all on `device`."""
    rng = random.Random(P)
    tree = FlatRadixTree(P, max_nodes=4096, token_capacity=1 << 14, device=device)
    bases = [[rng.randrange(5) for _ in range(rng.randrange(1, 300))] for _ in range(6)]
    seqs = []
    for _ in range(60):
        b = bases[rng.randrange(len(bases))]
        seqs.append(b[: rng.randrange(len(b) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(0, 40))])
    ten = lambda xs, dtype=torch.int64: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    for s in seqs[:30]:
        if len(s) >= P:
            tree.insert(ten(s, torch.int32), torch.arange(len(s), device=device), 0)
    ns = [rng.randrange(2) * 0 for _ in seqs]
    lens = [len(s) for s in seqs]
    tok = ten([t for s in seqs for t in s] + [0], torch.int32)
    toff = ten([sum(lens[:i]) for i in range(len(seqs))])
    L = ten(lens)
    nsv = ten(ns)
    chs, coff = [], []
    for s, o in zip(seqs, toff.tolist()):
        coff.append(sum(c.numel() for c in chs))
        h = tree.prefix_hashes(ten(s or [0], torch.int32)[None], ten([len(s)]), ten([0]), tree.C)[0]
        chs.append(h[: len(s) // tree.C])
    return tree, tok, toff, L, nsv, torch.cat(chs), ten(coff)


@pytest.mark.parametrize("P", [1, 4, 16])
def test_find_static_equals_search(P):
    tree, tok, toff, L, nsv, ch, coff = _static_case(P)
    max_len = int(L.max())
    cnt = L // tree.C
    want = tree._find_csr(tok, toff, L, L, nsv, ch, coff, cnt, int(cnt.max()))  # on a CPU: `_search_host`
    with PM.torch_forms():  # the torch rounds of `_search`: the same answer
        torch_form = tree._find_csr(tok, toff, L, L, nsv, ch, coff, cnt, int(cnt.max()))
    assert torch.equal(torch_form[0], want[0]) and torch.equal(torch_form[1], want[1])
    got = tree.find_static(tok, toff, L, nsv, ch, coff, max_len)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(want[0].max()) > 0  # the trees share prefixes: matches happen
    # a shorter bound than a length would be wrong; exactly the longest length is enough
    got2 = tree.find_static(tok, toff, L, nsv, ch, coff, max_len + 1000)
    assert torch.equal(got2[0], want[0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("P", [1, 4, 16])
def test_find_static_cap_valid_and_out(P, backend):
    """`find_static(cap=, valid=, out=)` (the recorded step's capped and padded searches,
    read in the search launch on triton) equals the search of the lengths formed first."""
    # compiled Triton kernels take CUDA tensors: on a GPU the triton case runs there
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    tree, tok, toff, L, nsv, ch, coff = _static_case(P, dev)
    rng = random.Random(100 + P)
    n = L.numel()
    cap = torch.tensor([rng.choice([-3, 0, 1, P, 2 * P + 1, 50, 10**6]) for _ in range(n)], device=dev)
    valid = torch.tensor([rng.random() < 0.8 for _ in range(n)], device=dev)
    Lc = torch.where(valid, torch.minimum(L, cap).clamp(min=0), 0)
    cnt = Lc // tree.C
    want = tree._find_csr(tok, toff, Lc, Lc, nsv, ch, coff, cnt, max(int(cnt.max()), 0))
    assert int(want[0].max()) > 0 and bool((want[0] < tree._find_csr(tok, toff, L, L, nsv, ch, coff, L // tree.C,
                                                                  int((L // tree.C).max()))[0]).any())
    max_len = int(L.max())
    out = (torch.full((n,), 7, dtype=torch.int64, device=dev), torch.full((n,), 7, dtype=torch.int64, device=dev))
    with PM.torch_forms():
        got = tree.find_static(tok, toff, L, nsv, ch, coff, max_len, cap=cap, valid=valid, out=out, backend=backend)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    # each argument alone
    with PM.torch_forms():
        m, _ = tree.find_static(tok, toff, L, nsv, ch, coff, max_len, valid=valid, backend=backend)
        assert torch.equal(m, torch.where(valid, tree.find_static(tok, toff, L, nsv, ch, coff, max_len)[0], 0))
        m, _ = tree.find_static(tok, toff, L, nsv, ch, coff, max_len, cap=cap, backend=backend)
        Lk = torch.minimum(L, cap).clamp(min=0)
        assert torch.equal(m, tree.find_static(tok, toff, Lk, nsv, ch, coff, max_len)[0])


#: benchmarks/gpu_check.sh sets GPU_SCHED_TEST_DEVICE=cuda: the CPU runs (CI has them) make way
#: for the CUDA ones in its few minutes
cpu_runs = pytest.mark.skipif(os.environ.get("GPU_SCHED_TEST_DEVICE") == "cuda", reason="CPU runs: CI covers them")


@cpu_runs
@pytest.mark.parametrize("name", RECORDED_RUNS)
def test_recorded_step_runs_match_reference(name):
    hits = run_long(name, seed=1, capture=dict(queue_capacity=32, running_capacity=24))
    assert hits["recorded"] > 10, hits  # the recorded step decided many steps
    assert hits["admitted"] > 60, hits


@cpu_runs
@pytest.mark.parametrize("name", ["lpm-page4-mixed", "dfs-weight", "routing-key", "nocache-ignore-eos"])
def test_recorded_step_runs_triton(name):
    """The recorded step's triton kernels (the interpreter on a CPU) over 40 steps."""
    hits = run_long(name, seed=4, steps=40, backend="triton", capture=dict(queue_capacity=32, running_capacity=24))
    assert hits["recorded"] > 10, hits


@cpu_runs
@pytest.mark.parametrize("name", ["lpm", "fcfs-priority-preempt", "nocache-ignore-eos"])
def test_row_store_and_pool_rebuilds(name, monkeypatch):
    """A row store of 8 slots, token pools of 64 tokens and a row table of 2 rows: the store
    starts over, the scheduler's pools are rebuilt (moving every request's offsets) and its
    row table grows, again and again, and every step is still the reference's."""
    monkeypatch.setattr(StepGraph, "MIN_STORE", 8)
    monkeypatch.setattr(GpuScheduler, "POOL_MIN_TOKENS", 64)
    monkeypatch.setattr(GpuScheduler, "ROW_TABLE_MIN", 2)
    hits = run_long(name, seed=7, capture=dict(queue_capacity=8, running_capacity=24))
    assert hits["recorded"] >= 5, hits


@cpu_runs
@pytest.mark.parametrize("name", ["lpm", "fcfs-priority-preempt", "lpm-page4-mixed"])
def test_recorded_window_then_host_windows(name, monkeypatch):
    """A recorded admission of 2 entries: a step that admits both goes on eagerly on the host
    from the third ordered request (windows of 1, 2, 4, ...), and every step is still the
    reference's."""
    monkeypatch.setattr(GpuScheduler, "admit_window", 1)
    ran, after = [False], []
    run, step = StepGraph.run, GpuScheduler.step
    static, scalar = GpuScheduler._static_admission, GpuScheduler._scalar_admission

    def run_(g):
        ran[0] = True
        return run(g)

    def step_(self, *a, **k):
        ran[0] = False
        return step(self, *a, **k)

    def hook(window):  # either form of a host window (small ones: `_scalar_admission`)
        def window_(self, rest, *a, **k):
            if ran[0]:  # a host window in a step the recorded step decided first
                after.append(len(rest))
            return window(self, rest, *a, **k)
        return window_

    monkeypatch.setattr(StepGraph, "run", run_)
    monkeypatch.setattr(GpuScheduler, "step", step_)
    monkeypatch.setattr(GpuScheduler, "_static_admission", hook(static))
    monkeypatch.setattr(GpuScheduler, "_scalar_admission", hook(scalar))
    hits = run_long(name, seed=3, capture=dict(queue_capacity=32, running_capacity=24, admit_window=2))
    assert hits["recorded"] > 10, hits
    assert len(after) > 5 and max(after) > 1, (after, hits)


def test_recorded_window_default_and_checks():
    cfg = SchedulerConfig(max_prefill_tokens=1000)
    s = GpuScheduler(cfg, 100)
    assert s.capture(queue_capacity=4096).W == 1000  # a prefill token per admitted request at least
    assert s.capture(queue_capacity=64).W == 64
    assert s.capture(queue_capacity=4096, admit_window=8).W == 8
    for bad, err in ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="admit_window"):
            s.capture(admit_window=bad)


@cpu_runs
@pytest.mark.parametrize("seed", range(6))
def test_recorded_step_random_configs(seed):
    run_pair(100 + seed, steps=60, capture=dict(queue_capacity=16, running_capacity=64))


class NoHostRead(TorchDispatchMode):
    """Raises on ops that read data to the host or whose output shape depends on data."""

    BANNED = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "unique_", "repeat_interleave",
              "bincount", "item")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(b in name for b in self.BANNED):
            raise AssertionError(f"host read in the step: {name}")
        if name.startswith(("aten.index.", "aten.index_put", "aten._index_put")):
            for t in args[1]:  # the indices: a boolean mask means nonzero inside
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                    raise AssertionError(f"boolean-mask indexing in the step: {name}")
        return func(*args, **(kwargs or {}))


def _loaded_graph(cfg: SchedulerConfig, seed: int, backend: str = "torch"):
    rng = random.Random(seed)
    s = GpuScheduler(cfg, 4000, backend=backend)
    g = s.capture(queue_capacity=64, running_capacity=16, max_len=512)
    base = [rng.randrange(7) for _ in range(200)]
    s.seed_cache(base[:150])
    reqs = [Request(rid=f"r{i}", prompt_ids=base[: rng.randrange(1, 200)] + [rng.randrange(7) for _ in range(rng.randrange(1, 30))],
                    max_new_tokens=rng.randrange(1, 50), priority=rng.randrange(3), ignore_eos=rng.random() < 0.5)
            for i in range(40)]
    s.submit(reqs, now=0.0)
    s.step(0.7)  # fills the pools and records nothing on CPU
    assert g.runs == 1
    return s, g


@pytest.mark.parametrize("policy,extra", [("lpm", {}), ("fcfs", {"enable_priority_scheduling": True}),
                                          ("lof", {}), ("lpm", {"disable_radix_cache": True}), ("dfs-weight", {}),
                                          ("routing-key", {}), ("random", {}),
                                          ("lpm", {"backend": "triton"}), ("fcfs", {"backend": "triton"})])
def test_step_has_no_host_read(policy, extra):
    extra = dict(extra)
    backend = extra.pop("backend", "torch")
    if backend == "triton" and torch.cuda.is_available():
        # a CPU scheduler's triton kernels need the interpreter; on CUDA the graph capture in
        # test_cuda_graph_replay_matches_reference is the proof (a capture fails on a host sync)
        pytest.skip("triton on CPU tensors runs only in the interpreter")
    cfg = SchedulerConfig(schedule_policy=policy, chunked_prefill_size=64, max_prefill_tokens=256,
                          in_batch_prefix_caching_deprioritize_threshold=8, **extra)
    s, g = _loaded_graph(cfg, 3, backend)
    before = g.out.clone()
    with NoHostRead():
        g.compute()
    assert torch.equal(g.out, before)  # same inputs, same step
    with pytest.raises(AssertionError, match="host read"):
        with NoHostRead():
            int(g.out[0])  # the mode does catch a host read


def test_capture_arguments_checked():
    s = GpuScheduler(SchedulerConfig(), 100)
    with pytest.raises(ValueError, match="queue_capacity"):
        s.capture(queue_capacity=0)
    with pytest.raises(ValueError, match="running_capacity"):
        s.capture(running_capacity=-1)
    with pytest.raises(ValueError, match="max_len"):
        s.capture(max_len=0)
    for name, bad in (("queue_capacity", None), ("queue_capacity", 4.0), ("running_capacity", True),
                      ("max_len", 1.5), ("max_len", "x"), ("admit_window", True)):
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            s.capture(**{name: bad})
    assert s.capture(admit_window=10**6, queue_capacity=64).W == 64  # capped at the capacity


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_fill_over_max_len_takes_eager_path(policy):
    """A waiting fill longer than capture's max_len would outrun the recorded step's search
    and tree rounds: that step takes the eager path, and decides as the reference does."""
    cfg = SchedulerConfig(schedule_policy=policy, max_prefill_tokens=4096, chunked_prefill_size=None)
    ref, dev = ReferenceScheduler(cfg, 256), GpuScheduler(cfg, 256)
    g = dev.capture(queue_capacity=16, running_capacity=8, max_len=64)
    base = [i % 7 for i in range(2000)]

    def submit(reqs, t):
        for s in (ref, dev):
            s.submit([Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs], now=t)

    submit([Request(rid="w", prompt_ids=base[:60], max_new_tokens=1)], 0.0)
    assert vars(ref.step(0.7)) == vars(dev.step(0.7)) and g.runs == 1  # 60 tokens: within the bound
    for s in (ref, dev):
        s.complete_prefill({"w": 1})
        s.finish(["w"])
    submit([Request(rid="a", prompt_ids=base[:1500], max_new_tokens=1),
            Request(rid="b", prompt_ids=base[:40] + [9], max_new_tokens=1),
            Request(rid="c", prompt_ids=[9, 9], max_new_tokens=1)], 1.0)
    pa, pb = vars(ref.step(0.7)), vars(dev.step(0.7))
    assert pa == pb and g.runs == 1, (pa, pb)
    if policy != "fcfs":
        assert pa["queue_order"] == ["a", "b", "c"]  # a matches 60 tokens, b 40


def _random_run(capture, shuffle=None, seed=0, steps=40):
    """Plans (as dicts) of a `steps`-step random-policy run of a GpuScheduler: arrivals, steps
    (queues of 0 to ~30, some steps with only the in-flight chunk), prefills and finishes."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(schedule_policy="random", random_seed=5, chunked_prefill_size=16, max_prefill_tokens=64)
    s = GpuScheduler(cfg, 2000, shuffle=shuffle)
    g = s.capture(queue_capacity=24, running_capacity=64) if capture else None
    plans, nid = [], 0
    for t in range(steps):
        reqs = [Request(rid=f"r{nid + j}", prompt_ids=[rng.randrange(5) for _ in range(rng.randrange(1, 40))],
                        max_new_tokens=rng.randrange(1, 8)) for j in range(rng.choice([0, 0, 1, 3, 8]))]
        nid += len(reqs)
        if reqs:
            s.submit(reqs, now=float(t))
        plan = s.step(0.7, now=float(t))
        plans.append(plan.to_dict())
        s.complete_prefill({rid: 1 for rid, _, _ in plan.admitted})
        done = [r.rid for r in s.running if len(r.req.output_ids) >= 2]
        if done:
            s.finish(done)
    return plans, g


def test_random_recorded_draws_what_the_eager_path_draws():
    """R-ORD-6 in the recorded step: the permutation is drawn from the scheduler's seeded
    generator exactly as the eager step draws it, so both decide every step alike (the queue
    order included); queues over the capacity take the eager path in between."""
    eager, _ = _random_run(capture=False)
    recorded, g = _random_run(capture=True)
    assert recorded == eager
    assert g.runs > 15 and any(len(p["queue_order"]) > 24 for p in eager)  # some steps went eager
    assert len({tuple(p["queue_order"]) for p in eager if len(p["queue_order"]) > 3}) > 5  # orders vary


@pytest.mark.parametrize("capture", [None, False, True])
def test_random_shuffle_checked(capture):
    """A `shuffle=` whose result is not a permutation of range(n) raises a ValueError naming
    it, one holding a non-integer (a float, an array row) a TypeError, on the eager path and
    in the recorded step's inputs, before the step changes anything; the reference (capture
    None) checks it alike (one check, `reference.policy.checked_shuffle`)."""
    def make(shuffle):
        if capture is None:
            return ReferenceScheduler(SchedulerConfig(schedule_policy="random"), 1000, shuffle=shuffle)
        return GpuScheduler(SchedulerConfig(schedule_policy="random"), 1000, shuffle=shuffle)

    s = make(lambda n: [0] * n)
    if capture:
        s.capture(8, 8)
    s.submit([Request(rid=r, prompt_ids=[1, 2, 3], max_new_tokens=4) for r in "ab"], now=0.0)
    with pytest.raises(ValueError, match=r"shuffle\(2\) returned \[0, 0\].*not a permutation of range\(2\)"):
        s.step(0.5)
    assert [r.rid for r in s.queue] == ["a", "b"] and not s.running and s.available == 1000
    for bad, shown in ((lambda n: [float(i) for i in range(n)], r"0\.0 \(float\) at 0"),
                       (lambda n: np.arange(n).reshape(n, 1), r"\(ndarray\) at 0")):
        s = make(bad)
        if capture:
            s.capture(8, 8)
        s.submit([Request(rid=r, prompt_ids=[1, 2, 3], max_new_tokens=4) for r in "ab"], now=0.0)
        with pytest.raises(TypeError, match=r"shuffle\(2\) returned .*" + shown + ", not an integer index"):
            s.step(0.5)
        assert [r.rid for r in s.queue] == ["a", "b"] and not s.running


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("name,backend", [("lpm-page4-mixed", "torch"), ("fcfs-priority-preempt", "torch"),
                                          ("lpm", "triton"), ("nocache-ignore-eos", "triton"),
                                          ("dfs-weight", "triton"), ("routing-key", "triton"), ("random", "torch")])
def test_cuda_graph_replay_matches_reference(name, backend):
    """200 steps with the step recorded in a CUDA graph and replayed, equal to the reference
    scheduler after every call; at least 30 steps replayed (the others had nothing to decide or
    overflowed the capacities), re-recorded only when the tree or pools were reallocated."""
    hits = run_long(name, seed=2, backend=backend, device="cuda",
                    capture=dict(queue_capacity=48, running_capacity=48, max_len=4096))
    assert hits["recorded"] >= 30, hits
    print(name, backend, hits)
