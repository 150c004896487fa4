"""Differential tests of the device ordering (`gpu_sched.policy`) against the reference
(`gpu_sched.reference.policy.order_queue`, SPEC.md section 3): the same queue through both,
permutations compared exactly. Torch backend at 0, 1, 2, 127, 128, 129, 1000, 5000; Triton
backend (without CUDA in Triton's interpreter, `TRITON_INTERPRET=1` set by conftest.py; with
CUDA compiled, the tests' tensors on the GPU) at small sizes around its block. Heavy ties everywhere: few distinct priorities, lengths, keys.
"""

import itertools
import random

import numpy as np
import pytest
import torch

from gpu_sched import policy as P
from gpu_sched.config import INT64_MAX, INT64_MIN, SchedulerConfig
from gpu_sched.reference.policy import dfs_weight_order as ref_dfs_weight_order
from gpu_sched.reference.policy import in_batch_deprioritized, order_queue
from gpu_sched.reference.radix_cache import KVPool, RadixCache, TreeNode
from gpu_sched.reference.state import ReqState
from gpu_sched.request import Request

try:
    import triton  # noqa: F401,E402

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency
    HAVE_TRITON = False

TORCH_SIZES = [0, 1, 2, 127, 128, 129, 1000, 5000]
TRITON_SIZES = [0, 1, 2, 15, 16, 17, 127, 128, 129, 300, 1000, 5000]
TRITON_BLOCK = 16  # small block: the triton sizes straddle it and 8 * 16 + 1
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")


def _gen() -> torch.Generator:
    """A generator on the default device (CUDA under `cuda_default_device`): random tensors are
    drawn where the tests' tensors live."""
    return torch.Generator(device=torch.get_default_device())


# with CUDA the compiled kernels need CUDA tensors: the tests' tensors go there (conftest.py)
pytestmark = pytest.mark.usefixtures("cuda_default_device")

BACKEND_CASES = [pytest.param("torch", n, id=f"torch-{n}") for n in TORCH_SIZES] + [
    pytest.param("triton", n, id=f"triton-{n}", marks=needs_triton) for n in TRITON_SIZES
]


# ---- helpers --------------------------------------------------------------------------------------
def assert_perm_equal(got: torch.Tensor, want, what: str) -> None:
    got = got.tolist()
    want = [int(x) for x in want]
    assert len(got) == len(want), f"{what}: length {len(got)} != {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise AssertionError(f"{what}: first difference at index {i}: got {g}, want {w} "
                                 f"(got[{i}:{i + 5}]={got[i:i + 5]}, want[{i}:{i + 5}]={want[i:i + 5]})")


def ref_perm(queue, ordered):
    pos = {id(r): i for i, r in enumerate(queue)}
    return [pos[id(r)] for r in ordered]


def kw(backend):
    return {"backend": backend, "block": TRITON_BLOCK} if backend == "triton" else {"backend": backend}


PRIOS = [None, None, -5, 0, 0, 3, 3, 7, INT64_MAX, INT64_MIN, INT64_MIN + 1, INT64_MAX - 1]
TIMES = [0.0, -0.0, 0.5, 0.5, 1.0, 2.5, -3.0, 1e300, float("inf")]
KEYS = [None, "", "a", "b", "b", "ab", "c", "zz", "a0"]
NAMESPACES = [None, None, "ns1", "ns2"]


def make_queue(n, rng, low_first, *, prompts=None, with_prio=True):
    cfg = SchedulerConfig(schedule_low_priority_values_first=low_first)
    queue = []
    for i in range(n):
        prio = rng.choice(PRIOS) if with_prio else None
        prompt = prompts[i] if prompts is not None else [rng.randrange(3)]
        req = Request(rid=f"r{i}", prompt_ids=prompt, max_new_tokens=rng.choice([0, 1, 16, 16, 128, 4096]),
                      priority=prio, routing_key=rng.choice(KEYS), extra_key=rng.choice(NAMESPACES))
        queue.append(ReqState(req, prio if prio is not None else cfg.absent_priority, rng.choice(TIMES)))
    return queue


def empty_cache():
    return RadixCache(KVPool(0), 1)


def no_shuffle(n):  # pragma: no cover - random is tested separately
    return list(range(n))


# ---- R-ORD-4 fcfs with priority ------------------------------------------------------------------------
@pytest.mark.parametrize("backend,n", BACKEND_CASES)
@pytest.mark.parametrize("low_first", [False, True])
def test_fcfs_priority_matches_reference(backend, n, low_first):
    rng = random.Random(n * 2 + low_first)
    queue = make_queue(n, rng, low_first)
    cfg = SchedulerConfig(schedule_policy="fcfs", enable_priority_scheduling=True,
                          schedule_low_priority_values_first=low_first)
    want = ref_perm(queue, order_queue(queue, cfg, empty_cache(), [], no_shuffle).queue)
    prio = torch.tensor([r.priority for r in queue], dtype=torch.int64)
    t = torch.tensor([r.enqueue_time for r in queue], dtype=torch.float64)
    got = P.fcfs_priority_order(prio, t, cfg.priority_sign, **kw(backend))
    assert got.dtype == torch.int64
    assert_perm_equal(got, want, f"fcfs {backend} n={n} low_first={low_first}")


def test_fcfs_integer_times_and_int32_priority():
    rng = random.Random(7)
    n = 500
    prio = [rng.choice([-3, 0, 2, 2, 9]) for _ in range(n)]
    times = [rng.choice([5, 5, 1, -7, 2**62]) for _ in range(n)]
    want = sorted(range(n), key=lambda i: (-prio[i], times[i]))
    got = P.fcfs_priority_order(torch.tensor(prio, dtype=torch.int32), torch.tensor(times), -1)
    assert_perm_equal(got, want, "fcfs int times")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("low_first", [False, True])
def test_fcfs_priority_order_of_a_queue_in_time_order(backend, low_first):
    """enqueue_time None (the caller saw the queue in non-decreasing time order): the same
    order as with the times, and as the reference's, equal times and absent priorities included."""
    rng = random.Random(11 + low_first)
    cfg = SchedulerConfig(schedule_policy="fcfs", enable_priority_scheduling=True,
                          schedule_low_priority_values_first=low_first)
    for n in (0, 1, 2, 300, 3000):
        queue = make_queue(n, rng, low_first)
        times = sorted(rng.choice([0.0, 1.0, 1.0, 2.5, 7.0, 7.0]) for _ in range(n))
        for r, t in zip(queue, times):
            r.enqueue_time = t
        if n > 2:  # small priorities too, so the sort by priority alone takes the narrow path
            for r in queue[: n // 2]:
                r.priority = rng.choice([0, 1, 2])
        want = ref_perm(queue, order_queue(queue, cfg, empty_cache(), [], no_shuffle).queue)
        prio = torch.tensor([r.priority for r in queue], dtype=torch.int64)
        t = torch.tensor(times, dtype=torch.float64)
        got = P.fcfs_priority_order(prio, None, cfg.priority_sign, **kw(backend))
        assert_perm_equal(got, want, f"fcfs in time order {backend} n={n}")
        assert_perm_equal(P.fcfs_priority_order(prio, t, cfg.priority_sign, **kw(backend)), want, "with times")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_stable_perm_on_the_cpu_equals_torch_sort(dtype):
    """The CPU's packed path (`host_perm`: the key less its minimum and the index packed into one
    uint32 / uint64 value, sorted) gives torch.sort(stable=True)'s permutation: spans at the
    32- and 64-bit packing limits (with n's index bits), the dtype's ends, ties; a key whose
    span and index need more than 64 bits goes to torch.sort (None from `host_perm`)."""
    info = torch.iinfo(dtype)
    rng = np.random.default_rng(info.bits)
    full = info.max - info.min  # the widest span of the dtype
    for n in (0, 1, 2, 63, 64, 1000, 40000):
        nb = max(n - 1, 0).bit_length()
        edge = [2 ** (b - nb) - 1 for b in (32, 33, 64, 65) if 2 ** (b - nb) - 1 <= full]
        for span in sorted({0, 1, 5, 2**8, 2**16 - 1, 2**16, 2**30, full, *edge}):
            los = [lo for lo in (info.min, -7, 0, info.max - span) if info.min <= lo <= info.max - span]
            for lo, uniform in itertools.product(los, (False, True)):
                # values over the whole span, or heavy ties at its two ends; both ends present
                if uniform:
                    v = rng.integers(0, span, size=n, dtype=np.uint64, endpoint=True)
                else:
                    v = np.where(rng.integers(0, 3, size=n) == 0, np.uint64(span), np.uint64(0))
                if n:
                    v[0], v[-1] = span, 0
                key = torch.from_numpy((v + np.uint64(lo % 2**64)).view(np.int64)).to(dtype)  # lo + v
                want = torch.sort(key, stable=True).indices
                got_np = P.host_perm(key.numpy())
                wide = _packed_span(key.numpy()).bit_length() + nb > 64
                assert (got_np is None) == (n >= 2 and wide), (n, span, lo)
                got = P._stable_perm(key)
                assert got.dtype == torch.int64 and torch.equal(got, want), (dtype, n, span, lo)
                desc = torch.sort(~key, stable=True).indices
                assert torch.equal(P._stable_perm(key, descending=True), desc), (dtype, n, span, lo)
                strided = key[::2]  # a non-contiguous view
                assert torch.equal(P._stable_perm(strided), torch.sort(strided, stable=True).indices)


@pytest.mark.parametrize("n", [2, 255, 256, 1000, 70000])
def test_packed_argsort_parts_at_the_type_limits(n):
    """`_packed_argsort` of one to three parts is the stable lexicographic order (np.lexsort)
    at every width sum around the radix-sorted uint8 / uint16 forms' limits (8, 9, 16, 17 bits,
    ties throughout) and past them (the packed uint32 / uint64 sort), with constant parts that
    take no bits."""
    rng = np.random.default_rng(n)
    for spans in ([1], [255], [256], [3, 31], [3, 63], [255, 255], [255, 256], [0, 7, 0], [7, 2**10, 1],
                  [2**16 - 1], [2**16], [15, 2**12], [2**20, 3], [2**31, 2**10]):
        parts = []
        for span in spans:
            off = rng.integers(0, span, size=n, dtype=np.uint64, endpoint=True)
            off[rng.integers(0, n)] = span  # the span is reached
            parts.append((off, span))
        want = np.lexsort([off for off, _ in reversed(parts)])  # last key of lexsort is primary
        got = P._packed_argsort(parts, n)
        assert got is not None and got.dtype == np.int64, spans
        assert np.array_equal(got, want), (n, spans)


@pytest.mark.parametrize("n", [2, 1000, 4096, 4097])
@pytest.mark.parametrize("descending", [False, True])
def test_host_perm_narrow_keys_at_their_limits(n, descending):
    """`host_perm`'s one- and two-byte branch (`_narrow_argsort`, taken before any packing) is
    the stable order by the key, ascending or descending, at spans around its limits (255 /
    256, 65535 / 65536, at any n), for int64 and int32 keys placed at
    their type's ends, where `hi - key` and `key - lo` would overflow were the span not small,
    and at 0 and 3, where non-negative values that fit the narrow type are cast as they are
    (complemented for descending order)."""
    rng = np.random.default_rng(n + descending)
    for dtype in (np.int64, np.int32):
        info = np.iinfo(dtype)
        for span in (0, 1, 255, 256, 2**16 - 1, 2**16):
            for base in (0, 3, -7, int(info.min), int(info.max) - span):
                off = rng.integers(0, span, size=n, endpoint=True)
                off[rng.integers(0, n)] = span
                key = (np.asarray(base, dtype=object) + off).astype(dtype)
                # the stable order by Python ints (no overflow): queue order among equal keys
                want = sorted(range(n), key=lambda i: -int(key[i]) if descending else int(key[i]))
                got = P.host_perm(key, descending)
                assert got is not None and got.dtype == np.int64, (dtype, span, base)
                assert got.tolist() == want, (dtype, span, base)


@pytest.mark.parametrize("descending", [False, True])
def test_host_perm_packed_offsets_at_type_ends(monkeypatch, descending):
    """`host_perm`'s packed branch for a large queue (`_packs_narrow`: the offsets made in
    uint32 from the key itself, wrapping modulo 2^32) is the stable order by the key for int64
    and int32 keys at their type's ends, negative and positive, with and without column
    bounds wider than the values (the offsets then start above 0)."""
    monkeypatch.setattr(P, "SIMD_SORT", True)
    n = P.PACKED_NARROW_MIN + 5
    rng = np.random.default_rng(11 + descending)
    for dtype in (np.int64, np.int32):
        info = np.iinfo(dtype)
        for span in (256, 4095, 2**16 - 1):
            for base in (0, 3, -7, int(info.min), int(info.max) - span):
                off = rng.integers(0, span, size=n, endpoint=True)
                off[:40] = off[40]  # a run of ties
                key = (np.asarray(base, dtype=object) + off).astype(dtype)
                want = np.argsort(-off if descending else off, kind="stable")
                assert P._packs_narrow(span, n)
                got = P.host_perm(key, descending)
                assert got.dtype == np.int64 and np.array_equal(got, want), (dtype, span, base)
                if base > int(info.min):  # bounds one below the values' least (same order)
                    got = P.host_perm(key, descending, bounds=(base - 1, base + span))
                    assert np.array_equal(got, want), (dtype, span, base, "bounds")


@pytest.mark.parametrize("simd", [False, True])
def test_narrow_argsort_packed_uint32_path(monkeypatch, simd):
    """`_narrow_argsort`'s packed branch (a key over 8 bits on `PACKED_NARROW_MIN` rows or more,
    with `SIMD_SORT`: key and row index in one uint32, numpy's unstable sort) is the stable
    argsort, and it falls back to the radix sort where key and index need over 32 bits
    (16-bit spans past 2^16 rows); forced on and off, whatever this CPU has."""
    monkeypatch.setattr(P, "SIMD_SORT", simd)
    rng = np.random.default_rng(7)
    lim = P.PACKED_NARROW_MIN
    for n in (lim - 1, lim, 70_000):
        for span in (255, 256, 4095, 2**16 - 1):
            off = rng.integers(0, span, size=n, endpoint=True)
            off[:50] = off[50]  # a run of ties
            want = np.argsort(off, kind="stable")
            got = P._narrow_argsort(off, span)
            assert got.dtype == np.int64 and np.array_equal(got, want), (n, span, simd)
            # through the two-part packing too (lof with priority): 3 + 8 bits
            if span == 255:
                pri = rng.integers(0, 7, size=n)
                want = np.lexsort([off, pri])
                got = P._packed_argsort([(pri, 6), (off, 255)], n)
                assert np.array_equal(got, want), (n, simd)


@pytest.mark.parametrize("descending", [False, True])
def test_host_perm_with_column_bounds(descending):
    """`host_perm(bounds=...)`: bounds that hold the key and span less than 2^16 stand in for
    its min and max (the scheduler's table-wide column bounds, wider than any one queue's
    keys); the order is the one without them. Wide bounds are ignored (min/max read)."""
    rng = np.random.default_rng(11)
    for n in (2, 300, 9000):
        for lo, hi in ((0, 4), (-3, 250), (100, 100 + 2**16 - 2), (-(2**40), 2**40)):
            key = rng.integers(max(lo, -1000), min(hi, 1000), size=n, endpoint=True)
            want = P.host_perm(key, descending)
            got = P.host_perm(key, descending, bounds=(lo, hi))
            assert np.array_equal(got, want), (n, lo, hi)
            assert np.array_equal(P.fcfs_perm_host(key, -1 if descending else 1, (lo, hi)),
                                  P.fcfs_perm_host(key, -1 if descending else 1))
            assert np.array_equal(P.lof_perm_host(key, bounds=(lo, hi)), P.lof_perm_host(key))


def test_routing_perm_host_dense_ranks():
    """`routing_perm_host(dense=True)` (the scheduler's permutation of string ranks, "" below
    them) equals the general form, which ranks any distinct ranks and empty_rank itself,
    with running ids absent, counted once or many times, and tied counts."""
    rng = np.random.default_rng(5)
    for K in (1, 3, 64, 700):
        for trial in range(6):
            n, m = int(rng.integers(1, 3000)), int(rng.integers(0, 80))
            qk = rng.integers(-1, K, size=n)
            run = rng.integers(-1, K, size=m) if trial % 3 else np.full(m, -1)
            dense = rng.permutation(K).astype(np.int64)
            want = P.routing_perm_host(qk, dense * 3 + 10, run, -5)  # same order, other values
            got = P.routing_perm_host(qk, dense, run, -1, dense=True)
            assert np.array_equal(got, want), (K, trial)
            with P.torch_forms():  # the torch ops, not the host form
                tw = P.routing_key_order(torch.from_numpy(qk), torch.from_numpy(dense), torch.from_numpy(run), -1)
            assert np.array_equal(got, tw.numpy()), (K, trial)


def test_routing_id_table_gather_equals_the_slot_table():
    """`routing_id_table` (the scheduler's table indexed by interned id, -1 reaching its last
    entry) gives every id in [-1, K) the slot table's key, in the narrow type of the span, so
    `rank_perm_host` of its gather is `routing_perm_from_table`'s order: at K around the
    uint8 / uint16 limits and the packed sort's queue sizes; None past 16 bits."""
    rng = np.random.default_rng(9)
    for K in (1, 33, 254, 255, 256, 3000):
        n = int(rng.integers(1, 600)) if K < 256 else P.PACKED_NARROW_MIN + 3
        qk = rng.integers(-1, K, size=n)
        qk[:3] = (-1, 0, K - 1)
        run = rng.integers(-1, K, size=40)
        t = P.routing_table_host(rng.permutation(K).astype(np.int64), run, -1, dense=True)
        assert t is not None
        by_id = P.routing_id_table(*t)
        assert by_id.dtype == (np.uint8 if t[1] < 256 else np.uint16) and by_id.size == K + 1
        assert np.array_equal(by_id[qk], np.take(t[0], qk + 1, mode="clip")), K
        assert np.array_equal(P.rank_perm_host(by_id[qk], t[1]), P.routing_perm_from_table(qk, *t)), K
    assert P.routing_id_table(np.zeros(65538, dtype=np.int64), 65536) is None


def _packed_span(key: np.ndarray) -> int:
    """The span host_perm packs: max - min, after an int64 key's ends (-2^63, 2^63 - 1) move
    next to its other values when it spans 2^32 or more."""
    if not key.size:
        return 0
    lo, hi = int(key.min()), int(key.max())
    if key.dtype == np.int64 and (lo == INT64_MIN or hi == INT64_MAX) and hi - lo >= 2**32:
        inner = key[(key != INT64_MIN) & (key != INT64_MAX)]
        if not inner.size:
            return 1 if lo != hi else 0
        lo = int(inner.min()) - 1 if lo == INT64_MIN else int(inner.min())
        hi = int(inner.max()) + 1 if hi == INT64_MAX else int(inner.max())
    return hi - lo


def _torch_forms(fn, *args, **kwargs):
    """fn on the CPU through its torch form (`policy.torch_forms`), not its numpy one."""
    with P.torch_forms():
        return fn(*args, **kwargs)


def _time_draws(rng, n):
    """Enqueue-time columns [n] of the kinds fcfs_time_perm_host packs or not: few values with
    ties (-0.0 and +0.0 among them), an epoch clock over an hour (packs), seconds from 0 and
    negatives (their float bits span too much), integer nanoseconds."""
    yield "ties", np.array([rng.choice([0.0, -0.0, 1.0, 2.5, 2.5]) for _ in range(n)])
    yield "epoch", 1.7e9 + np.array([rng.uniform(0, 3600) for _ in range(n)])
    yield "from0", np.array([float(rng.randrange(n + 1)) for _ in range(n)])
    yield "signed", np.array([rng.choice([-1e-300, -3.5, 0.0, 7e300, rng.uniform(-1e6, 1e6)]) for _ in range(n)])
    yield "int_ns", np.array([rng.randrange(-2**62, 2**62) for _ in range(n)], dtype=np.int64)


def _serving_queue(rng, prio, times, sign, arrivals=None):
    """(priority, time) columns as a serving loop holds them after a step: the previous
    order's remainder (sorted by priority * sign, then time) and `arrivals` behind it (default:
    half the rows; 0: the queue in order, as at a step with no arrival since the last)."""
    n = len(prio)
    h = n - (n // 2 if arrivals is None else min(arrivals, n))
    old = sorted(range(h), key=lambda i: (int(prio[i]) * sign, times[i]))[rng.randrange(min(h, 3) + 1):]
    idx = old + list(range(h, n))
    return prio[idx], times[idx]


@pytest.mark.parametrize("sign", [1, -1])
def test_fcfs_time_perm_host_any_queue_order(sign):
    """R-ORD-4 on a queue in any order (the host form GpuScheduler._order calls when the queue
    is not in time order): the stable order by (priority * sign, time), as Python's sort gives
    it, on each of its paths: both keys packed, priorities under 64 apart (runs from counts),
    few distinct priorities far apart (runs from the sorted column), over 64 distinct ones
    (one sort by time first), absent ones (the int64 ends) among small ones; priorities
    spanning the int64 range return None and fcfs_priority_order still orders them; on
    shuffled queues and serving-loop ones."""
    rng = random.Random(3 + sign)
    prio_kinds = {
        "small": lambda n: np.array([rng.choice([0, 1, 1, 4]) for _ in range(n)], dtype=np.int64),
        "apart": lambda n: np.array([rng.choice([-10**9, 5, 10**12]) for _ in range(n)], dtype=np.int64),
        "many": lambda n: np.array([rng.randrange(1000) for _ in range(n)], dtype=np.int64),
        "extreme": lambda n: np.array([rng.choice([INT64_MIN, 0, INT64_MAX]) for _ in range(n)], dtype=np.int64),
        "wide": lambda n: np.array([rng.choice([INT64_MIN + 1, 0, INT64_MAX - 1]) for _ in range(n)], dtype=np.int64),
    }
    checked = nones = 0
    for n in (0, 1, 2, 3, 17, 400, 3000):
        for pk, draw in prio_kinds.items():
            for tk, times in _time_draws(rng, n):
                prio = draw(n)
                for layout in ("shuffled", "serving", "in_order", "few_arrivals"):
                    arrivals = {"serving": None, "in_order": 0, "few_arrivals": rng.choice([1, 2, 5, n // 3])}
                    pr, tm = ((prio, times) if layout == "shuffled"
                              else _serving_queue(rng, prio, times, sign, arrivals[layout]))
                    want = sorted(range(len(pr)), key=lambda i: (int(pr[i]) * sign, tm[i]))
                    got = P.fcfs_time_perm_host(pr, tm, sign)
                    where = (n, pk, tk, layout, sign)
                    if got is None:
                        assert pk == "wide", where
                        nones += 1
                    else:
                        assert got.dtype == np.int64 and got.tolist() == want, where
                    k = P.fcfs_sorted_prefix(pr, tm, sign)  # the longest ordered prefix, exactly
                    key = [(int(pr[i]) * sign, tm[i]) for i in range(len(pr))]
                    assert all(key[i] <= key[i + 1] for i in range(k - 1)), where
                    assert k == len(pr) or key[k - 1] > key[k], where
                    full = P.fcfs_priority_order(torch.from_numpy(pr), torch.from_numpy(tm), sign)
                    assert full.tolist() == want, where
                    checked += 1
    assert checked == 7 * 5 * 5 * 4 and nones > 0


@pytest.mark.parametrize("desc", [False, True])
def test_merge_arrivals_host(desc):
    """A served queue's arrivals merged into its ordered rows (`merge_arrivals_host`, the
    served fcfs-with-priority and lof orderings): Python's stable order by (primary, descending
    when desc; secondary), for integer secondaries (lof's ~max_new_tokens, the int64 ends
    included) and float ones with ties and -0.0 / +0.0; 0 to all rows behind the ordered ones,
    few (one bisection each) and many arrivals (searches per priority run); None past 64
    distinct priorities among the arrivals."""
    rng = random.Random(5 + desc)
    checked = nones = 0
    for n in (1, 2, 5, 40, 300, 2000):
        for prios in ([0], [0, 1, 4], [INT64_MIN, 0, INT64_MAX], list(range(80))):
            for kind in ("int", "float"):
                pr = np.array([rng.choice(prios) for _ in range(n)], dtype=np.int64)
                if kind == "int":
                    sec = np.array([rng.choice([INT64_MIN, -3, 0, 0, 7, INT64_MAX]) for _ in range(n)], dtype=np.int64)
                else:
                    sec = np.array([rng.choice([-0.0, 0.0, 1.5, 1.5, -2.0, 1e300]) for _ in range(n)])
                key = [((-int(p) if desc else int(p)), float(x) if kind == "float" else int(x)) for p, x in zip(pr, sec)]
                for k in sorted({0, n // 2, n - min(n, 3), n - 1, n}):
                    head = sorted(range(k), key=lambda i: key[i])  # the served rows, in order
                    idx = head + list(range(k, n))
                    p2, s2 = pr[idx], sec[idx]
                    want = sorted(range(n), key=lambda i: key[idx[i]])
                    got = P.merge_arrivals_host(p2, s2, desc, k)
                    if got is None:
                        assert len(set(p2[k:].tolist())) > 64, (n, prios, kind, k)
                        nones += 1
                    else:
                        assert got.dtype == np.int64 and got.tolist() == want, (n, prios, kind, k)
                    checked += 1
    assert checked > 150 and nones > 0


@pytest.mark.parametrize("sign", [1, -1])
def test_absent_priorities_pack(sign):
    """Absent priorities resolve to an int64 end (SPEC section 1): mixed with small ones, the
    host forms still pack them into one sort (the ends moved next to the other values) and
    give Python's stable order; a key of ends only, or ends plus values spanning the type,
    too. Each checked against its torch form."""
    rng = random.Random(13 + sign)
    absent = INT64_MAX if sign > 0 else INT64_MIN
    for n in (2, 5, 300, 4000):
        for mix in ([0, 1, 2, 7], [absent], [INT64_MIN, INT64_MAX], [INT64_MIN + 1, 0, INT64_MAX - 1]):
            pr = np.array([rng.choice(mix + [absent]) for _ in range(n)], dtype=np.int64)
            mn = np.array([rng.randrange(1, 50) for _ in range(n)], dtype=np.int64)
            tm = np.array([rng.choice([0.0, 1.0, 5.0]) for _ in range(n)])
            where = (n, mix, sign)
            want = sorted(range(n), key=lambda i: int(pr[i]) * sign)
            got = P.fcfs_perm_host(pr, sign)
            if len(mix) < 3:  # spans that fit once the ends moved
                assert got is not None, where
            assert got is None or got.tolist() == want, where
            want = sorted(range(n), key=lambda i: (int(pr[i]) * sign, -int(mn[i])))
            got = P.lof_perm_host(mn, pr, sign)
            assert got is None or got.tolist() == want, where
            assert P.lof_order(torch.from_numpy(mn), torch.from_numpy(pr), sign).tolist() == want, where
            assert _torch_forms(P.lof_order, torch.from_numpy(mn), torch.from_numpy(pr), sign).tolist() == want
            want = sorted(range(n), key=lambda i: (int(pr[i]) * sign, tm[i]))
            got = P.fcfs_time_perm_host(pr, tm, sign)
            assert got is None or got.tolist() == want, where


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.usefixtures("cpu_default_device")
def test_host_forms_equal_torch_forms(dtype):
    """On the CPU, fcfs, lof and routing-key run as numpy calls (also called directly by the
    scheduler: `fcfs_perm_host`, `lof_perm_host`; keys as offsets from their
    minimum or maximum, one key or two packed with the index into one uint32 / uint64 sort when
    their bits fit, the routing table ranked in numpy); each gives the torch form's permutation
    exactly: spans either side of 2^8, 2^16 and (int64) the 64-bit packing limit, both signs
    and directions, the dtype's ends, ids outside [0, K), K either side of 2^16 - 2."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(7 + info.bits)

    def draw(n, span, lo, ties):
        v = torch.randint(0, (min(span, 6) if ties else span) + 1, (n,), generator=g, dtype=torch.int64)
        if n >= 2:
            v[0], v[-1] = span, 0  # both ends of the span present
        return (v + lo).to(dtype)

    spans = (0, 1, 4, 2**8 - 1, 2**8, 2**16 - 1, 2**16, 2**20) + ((2**40, 2**62) if info.bits == 64 else ())
    checked = 0
    for n in (0, 1, 2, 3, 300, 5000):
        for sp, sm in ((4, 50), (15, 15), (16, 15), (255, 255), (256, 255), (1, 2**15 - 1), (1, 2**15),
                       (2**15, 1)) + tuple(
                (a, b) for a, b in itertools.product(spans, spans) if (a * b) % 3 == 0):
            for lo, ties, sign in ((0, True, 1), (info.min, False, -1), (info.max - sp, True, -1), (-5, False, 1)):
                pr = draw(n, sp, lo, ties)
                mn = draw(n, sm, max(info.min, min(lo, info.max - sm)), not ties)
                t = torch.randint(0, 4, (n,), generator=g).to(torch.float64)
                # each call with the host form GpuScheduler._order calls directly (None: no form)
                for call, host_form in (
                        (lambda: P.fcfs_priority_order(pr, None, sign), lambda: P.fcfs_perm_host(pr.numpy(), sign)),
                        (lambda: P.fcfs_priority_order(pr, t, sign),
                         lambda: P.fcfs_time_perm_host(pr.numpy(), t.numpy(), sign)),
                        (lambda: P.lof_order(mn), lambda: P.lof_perm_host(mn.numpy())),
                        (lambda: P.lof_order(mn, pr, sign), lambda: P.lof_perm_host(mn.numpy(), pr.numpy(), sign))):
                    want = _torch_forms(call)
                    got = call()
                    assert got.dtype == torch.int64 and torch.equal(got, want), (dtype, n, sp, sm, lo, sign)
                    direct = host_form()
                    if direct is not None:
                        assert torch.equal(torch.from_numpy(direct), want), (dtype, n, sp, sm, lo, sign)
                    checked += 1
    assert checked > 1000
    for n, K, m in ((0, 3, 2), (1, 3, 2), (400, 3, 0), (400, 5, 6), (3000, 250, 40), (3000, 255, 40),
                    (3000, 2**16 - 3, 50), (3000, 2**16 - 2, 50), (3000, 2**16 + 5, 50)):
        for lo_ids in (False, True):
            key_id = torch.randint(-1, min(K, 40), (n,), generator=g).to(dtype)
            if lo_ids and n:  # odd ids: below -1, >= K, the dtype's ends
                odd = torch.tensor([-2, K, K + 9, info.max, info.min], dtype=dtype)
                key_id[::5] = odd[torch.arange(key_id[::5].numel()) % 5]
            rank = torch.randperm(K, generator=g).to(dtype)
            run = torch.randint(-1, min(K, 40), (m,), generator=g).to(dtype)
            for er in (-1, 0, 2**31 - 1):
                want = _torch_forms(P.routing_key_order, key_id, rank, run, er)
                assert torch.equal(P.routing_key_order(key_id, rank, run, er), want), (dtype, n, K, m, er)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.usefixtures("cpu_default_device")
def test_lpm_host_form_equals_torch_form(dtype):
    """lpm's host form (`lpm_perm_host`: one key per row, `max - matched`, the deprioritized
    at `max + 1`; uint8 / uint16 up to 16 bits, packed with the row index past that), called
    by `lpm_order` on the CPU and by the scheduler directly, gives the torch form's
    permutation: spans either side of 2^8 and 2^16, up to int32's largest, ties, no / some /
    all rows deprioritized; None for a negative length (outside the contract) and for keys
    that do not fit 64 bits with the row index, int64's largest length included, where
    `lpm_order` gives the torch form's permutation."""
    g = torch.Generator().manual_seed(11)
    checked = 0
    for n in (0, 1, 2, 3, 300, 5000):
        for span in (0, 1, 6, 254, 255, 256, 2**16 - 2, 2**16 - 1, 2**16, 2**20, 2**31 - 2):
            for dep_p in (0.0, 0.3, 1.0):
                m = torch.randint(0, span + 1, (n,), generator=g, dtype=torch.int64)
                if n >= 2:
                    m[0], m[-1] = span, 0
                dep = torch.rand(n, generator=g) < dep_p
                m = m.to(dtype)
                want = _torch_forms(P.lpm_order, m, dep)
                assert torch.equal(P.lpm_order(m, dep), want), (dtype, n, span, dep_p)
                direct = P.lpm_perm_host(m.numpy(), dep.numpy())
                assert direct is not None, (n, span)
                assert direct.dtype == np.int64 and direct.tolist() == want.tolist(), (dtype, n, span, dep_p)
                checked += 1
    assert checked == 6 * 11 * 3
    assert P.lpm_perm_host(np.array([3, -1, 2], dtype=np.int64), np.zeros(3, dtype=bool)) is None
    for top in (2**62, 2**63 - 1):  # 63 key bits + 2 index bits; a key of max + 1 past int64
        m = torch.tensor([top, 0, 5], dtype=torch.int64)
        for dep in (torch.zeros(3, dtype=torch.bool), torch.tensor([False, True, False])):
            assert P.lpm_perm_host(m.numpy(), dep.numpy()) is None, top
            assert torch.equal(P.lpm_order(m, dep), _torch_forms(P.lpm_order, m, dep)), top


# ---- R-ORD-5 lof ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,n", BACKEND_CASES)
@pytest.mark.parametrize("priority_on,low_first", [(False, False), (True, False), (True, True)])
def test_lof_matches_reference(backend, n, priority_on, low_first):
    rng = random.Random(n * 3 + priority_on + 2 * low_first)
    queue = make_queue(n, rng, low_first)
    cfg = SchedulerConfig(schedule_policy="lof", enable_priority_scheduling=priority_on,
                          schedule_low_priority_values_first=low_first)
    want = ref_perm(queue, order_queue(queue, cfg, empty_cache(), [], no_shuffle).queue)
    max_new = torch.tensor([r.max_new for r in queue], dtype=torch.int32)
    prio = torch.tensor([r.priority for r in queue], dtype=torch.int64) if priority_on else None
    got = P.lof_order(max_new, prio, cfg.priority_sign, **kw(backend))
    assert_perm_equal(got, want, f"lof {backend} n={n} prio={priority_on} low_first={low_first}")


# ---- R-ORD-7 routing-key ----------------------------------------------------------------------------
def routing_inputs(queue, running):
    strings = sorted({r.req.routing_key for r in list(queue) + list(running) if r.req.routing_key})
    ids = {s: i for i, s in enumerate(strings)}
    # ids in a shuffled interning order, so id != rank
    perm = list(range(len(strings)))
    random.Random(len(strings)).shuffle(perm)
    key_rank = [0] * len(strings)
    for rank, s in enumerate(strings):
        key_rank[perm[ids[s]]] = rank

    def id_of(r):
        k = r.req.routing_key
        return perm[ids[k]] if k else -1  # '' and absent both map to -1

    return (torch.tensor([id_of(r) for r in queue], dtype=torch.int32),
            torch.tensor(key_rank, dtype=torch.int32),
            torch.tensor([id_of(r) for r in running], dtype=torch.int32))


@pytest.mark.parametrize("backend,n", BACKEND_CASES)
@pytest.mark.parametrize("running_kind", ["none", "uncounted", "some", "many"])
def test_routing_key_matches_reference(backend, n, running_kind):
    rng = random.Random(n * 5 + len(running_kind))
    queue = make_queue(n, rng, False)
    m = {"none": 0, "uncounted": 3, "some": 4, "many": 40}[running_kind]
    running = make_queue(m, rng, False)
    for i, r in enumerate(running):
        if running_kind == "uncounted":
            r.req.routing_key = rng.choice([None, ""])
        elif running_kind == "some" and i == 0:
            r.req.routing_key = "only-running"  # a key no waiting request has
    cfg = SchedulerConfig(schedule_policy="routing-key")
    want = ref_perm(queue, order_queue(queue, cfg, empty_cache(), running, no_shuffle).queue)
    key_id, key_rank, run_ids = routing_inputs(queue, running)
    got = P.routing_key_order(key_id, key_rank, run_ids, -1, **kw(backend))
    assert_perm_equal(got, want, f"routing {backend} n={n} running={running_kind}")


def test_routing_key_no_interned_ids():
    got = P.routing_key_order(torch.full((5,), -1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                              torch.full((3,), -1, dtype=torch.int32))
    assert_perm_equal(got, range(5), "routing with no ids")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_routing_key_ids_outside_range_count_as_absent(backend, dtype):
    """Documented: ids outside [0, K) are absent, on both sides (also the dtype's extremes,
    where an id + 1 would wrap)."""
    K = 5
    big = torch.iinfo(dtype).max
    low = torch.iinfo(dtype).min
    gen = _gen().manual_seed(3)
    waiting = torch.randint(-1, K, (300,), generator=gen)
    odd = torch.tensor([-2, -7, K, K + 3, big, low])
    messy = waiting.clone()
    messy[::7] = odd[torch.arange(messy[::7].numel()) % odd.numel()]
    clean = torch.where((messy >= 0) & (messy < K), messy, -1)
    run = torch.tensor([0, 0, 3, 1, -1], dtype=torch.int64)
    run_messy = torch.cat([run, odd])
    rank = torch.tensor([4, 2, 0, 3, 1], dtype=dtype)
    want = P.routing_key_order(clean.to(dtype), rank, run.to(dtype), -1)
    got = P.routing_key_order(messy.to(dtype), rank, run_messy.to(dtype), -1, **kw(backend))
    assert_perm_equal(got, want.tolist(), f"routing {backend} {dtype} odd ids")
    # only odd ids running: nothing counted, queue order kept
    got = P.routing_key_order(messy.to(dtype), rank, odd.to(dtype), -1, **kw(backend))
    assert_perm_equal(got, range(300), f"routing {backend} {dtype} only odd running ids")


# ---- R-ORD-6 random ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 129, 5000])
def test_random_order_is_seeded_permutation(n):
    a = P.random_order(n, torch.Generator().manual_seed(11))
    b = P.random_order(n, torch.Generator().manual_seed(11))
    c = P.random_order(n, torch.Generator().manual_seed(12), backend="triton")
    assert a.dtype == torch.int64 and a.shape == (n,)
    assert torch.equal(a, b)
    # the generator's device decides the permutation's (a CPU generator here, whatever the default)
    assert torch.equal(torch.sort(a).values, torch.arange(n, device=a.device))
    assert torch.equal(torch.sort(c).values, torch.arange(n, device=c.device))
    if n > 100:
        assert not torch.equal(a, c)
        # and the reference accepts it as a shuffle
        queue = make_queue(n, random.Random(0), False)
        cfg = SchedulerConfig(schedule_policy="random")
        res = order_queue(queue, cfg, empty_cache(), [], lambda k: a.tolist())
        assert_perm_equal(a, ref_perm(queue, res.queue), "random via reference")


# ---- R-ORD-8/9 lpm and in-batch deprioritization ------------------------------------------------------
def prefix_workload(n, rng, ns_list=NAMESPACES):
    """A cache holding a few shared prefixes, and prompts that extend them (heavy sharing)."""
    bases = [[rng.randrange(4) for _ in range(rng.choice([0, 1, 3, 8, 40]))] for _ in range(6)]
    cache = RadixCache(KVPool(100_000), 1)
    for b in bases[:4]:
        for _ in range(2):
            key = np.array(b + [rng.randrange(3) for _ in range(rng.randrange(6))], np.int32)
            ns = rng.choice(ns_list)
            if len(key):
                cache.insert(key, lambda k: cache.pool.alloc(k), ns)
    prompts = []
    for _ in range(n):
        b = rng.choice(bases)
        tail = [rng.randrange(3) for _ in range(rng.choice([0, 1, 2, 5, 40]))]
        p = b + tail
        prompts.append(p if p else [rng.randrange(3)])
    return cache, prompts


def device_deprio_inputs(queue, T):
    ns_ids = {}
    ns = torch.tensor([ns_ids.setdefault(r.req.extra_key, len(ns_ids)) for r in queue], dtype=torch.int32)
    fills = [r.fill() for r in queue]
    toks = torch.zeros((len(queue), T), dtype=torch.int32)
    for i, f in enumerate(fills):
        k = min(T, len(f))
        toks[i, :k] = torch.from_numpy(f[:k].astype(np.int32))
    lengths = torch.tensor([len(f) for f in fills], dtype=torch.int64)
    prefix = torch.tensor([r.prefix_len for r in queue], dtype=torch.int64)
    return prefix, lengths, ns, P.head_hashes(toks, lengths)


DEPRIO_CASES = [(-1, 32), (32, 32), (0, 3), (8, 0), (10**6, 1), (40, 8), (3, 45)]


def threshold_cases(all_cases, triton_cases):
    """(backend, n, check, T): every threshold pair on torch, a subset in the interpreter."""
    out = []
    for c in BACKEND_CASES:
        backend, n = c.values
        for check, T in (all_cases if backend == "torch" else triton_cases):
            out.append(pytest.param(backend, n, check, T, id=f"{c.id}-check{check}-T{T}", marks=c.marks))
    return out


def deprio_case(seed, n, check, T):
    """(reference R-ORD-9 flags, device inputs) of a queue matched against a prefix cache."""
    rng = random.Random(seed)
    cache, prompts = prefix_workload(n, rng)
    queue = make_queue(n, rng, False, prompts=prompts)
    for r in queue:
        r.prefix_len, r.last_node = cache.match_prefix(r.fill(), r.req.extra_key)
    return in_batch_deprioritized(queue, check, T), device_deprio_inputs(queue, T)


@pytest.mark.parametrize("backend,n,check,T",
                         threshold_cases(DEPRIO_CASES, [(-1, 32), (0, 3), (8, 0), (40, 8)]))
def test_in_batch_deprioritize_matches_reference(backend, n, check, T):
    want, (prefix, lengths, ns, hh) = deprio_case(n * 7 + check + T, n, check, T)
    got = P.in_batch_deprioritize(prefix, lengths, ns, hh, check, T, **kw(backend))
    assert got.dtype == torch.bool
    assert_perm_equal(got.to(torch.int64), want, f"deprio {backend} n={n} check={check} T={T}")


@pytest.mark.parametrize("backend,n,check,T",
                         threshold_cases([(-1, 32), (32, 32), (40, 8), (8, 0)], [(-1, 32), (40, 8), (8, 0)]))
def test_lpm_matches_reference(backend, n, check, T):
    rng = random.Random(n * 11 + check + T)
    cache, prompts = prefix_workload(n, rng)
    queue = make_queue(n, rng, False, prompts=prompts)
    for i, r in enumerate(queue):  # logprob caps (R-ORD-8)
        if i % 5 == 0:
            r.req.return_logprob = True
            r.req.logprob_start_len = rng.choice([-1, 0, 2, 100])
    cfg = SchedulerConfig(schedule_policy="lpm", in_batch_prefix_caching_check_threshold=check,
                          in_batch_prefix_caching_deprioritize_threshold=T)
    res = order_queue(queue, cfg, cache, [], no_shuffle)
    want = ref_perm(queue, res.queue)
    dep = set(res.deprioritized)
    # the device path computes deprioritization itself from the match results
    prefix, lengths, ns, hh = device_deprio_inputs(queue, T)
    flags = P.in_batch_deprioritize(prefix, lengths, ns, hh, check, T, **kw(backend))
    assert_perm_equal(flags.to(torch.int64), [r.rid in dep for r in queue], f"lpm deprio {backend} n={n}")
    matched = torch.tensor([r.num_matched for r in queue], dtype=torch.int64)
    got = P.lpm_order(matched, flags, **kw(backend))
    assert_perm_equal(got, want, f"lpm {backend} n={n} check={check} T={T}")
    got32 = P.lpm_order(matched.to(torch.int32), flags, **kw(backend))  # int32 keys on torch
    assert_perm_equal(got32, want, f"lpm int32 {backend} n={n} check={check} T={T}")


def test_head_hashes_ignore_padding_and_separate_prefixes():
    toks = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 9], [1, 2, 0], [1, 2, 7], [0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([3, 5, 3, 2, 2, 3])
    h = P.head_hashes(toks, lens).tolist()
    assert h[0] == h[1] and h[0] != h[2]
    assert h[3] == h[4]  # padding after the length does not count
    assert h[5] != h[3]  # a real token 0 differs from padding
    # the documented formula, in Python ints
    g = _gen().manual_seed(4)
    toks = torch.randint(0, 2**31, (40, 150), generator=g, dtype=torch.int32)
    toks[:, 0] = 2**31 - 1  # the largest token id
    lens = torch.randint(0, 160, (40,), generator=g)

    def model(row, k):  # each token two characters, its low limb + 1 and its high limb
        out = 0
        for base in P._HASH_BASES:
            p = 2**31 - 1
            out = out * 2**31 + sum(((row[t] & 0xFFFF) + 1) * pow(base, 2 * t, p) + (row[t] >> 16) * pow(base, 2 * t + 1, p)
                                    for t in range(min(k, len(row)))) % p
        return out

    for T in (1, 37, 64, 65, 150):  # the float64 sums run in chunks of 64 positions
        want = [model(toks[i, :T].tolist(), int(lens[i])) for i in range(40)]
        assert_perm_equal(P.head_hashes(toks[:, :T], lens), want, f"head hash formula T={T}")
        # the host form (numpy, a new request's group on the CPU paths): the same values
        assert P.head_hashes_host(toks[:, :T].cpu().numpy(), lens.cpu().numpy()).tolist() == want, f"host T={T}"
    assert P.head_hashes(torch.zeros((0, 4), dtype=torch.int32), torch.zeros(0, dtype=torch.int64)).shape == (0,)
    assert P.head_hashes(torch.zeros((3, 0), dtype=torch.int32), torch.ones(3, dtype=torch.int64)).tolist() == [0, 0, 0]
    assert P.head_hashes_host(np.zeros((0, 4), dtype=np.int32), np.zeros(0, dtype=np.int64)).shape == (0,)
    assert P.head_hashes_host(np.zeros((3, 0), dtype=np.int32), np.ones(3, dtype=np.int64)).tolist() == [0, 0, 0]


def test_head_hashes_separate_token_ids_equal_mod_p():
    """Token ids 0 and 2^31 - 1 are equal modulo p = 2^31 - 1 (so id + 1 would hash them
    alike and put two different heads in one R-ORD-9 group); as limb pairs they differ:
    heads that differ only in such ids get different hashes in the torch and host forms,
    as do ids that differ only in their high limb."""
    M = 2**31 - 1
    rows = [[M, 5, 5], [0, 5, 5], [5, M, 0], [5, 0, M], [65536, 7, 7], [0, 7, 7], [1, 7, 7], [65537, 7, 7]]
    toks = torch.tensor(rows, dtype=torch.int64).to(torch.int32)
    lens = torch.full((len(rows),), 3)
    h = P.head_hashes(toks, lens).tolist()
    assert len(set(h)) == len(rows), h
    assert P.head_hashes_host(toks.numpy(), lens.numpy()).tolist() == h


# ---- R-ORD-10 dfs-weight ----------------------------------------------------------------------------
def flatten_tree(root):
    """BFS over `node.children` dict order: (parent, child_rank, depth) arrays, node 0 = root."""
    order, index = [root], {id(root): 0}
    parent, rank, depth = [-1], [0], [0]
    head = 0
    while head < len(order):
        node = order[head]
        for j, child in enumerate(node.children.values()):
            index[id(child)] = len(order)
            order.append(child)
            parent.append(index[id(node)])
            rank.append(j)
            depth.append(depth[index[id(node)]] + 1)
        head += 1
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return t(parent), t(rank), t(depth), index


def random_tree_workload(n, rng, *, page_size=1, n_inserts=60):
    cache = RadixCache(KVPool(1_000_000), page_size)
    alphabet = rng.choice([2, 3, 5])
    seqs = []
    for _ in range(n_inserts):
        if seqs and rng.random() < 0.7:
            s = rng.choice(seqs)[: rng.randrange(1, 12)] + [rng.randrange(alphabet) for _ in range(rng.randrange(1, 10))]
        else:
            s = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 16))]
        seqs.append(s)
        key = np.array(s, np.int32)
        ns = rng.choice(NAMESPACES)
        cache.insert(key, lambda k: cache.pool.alloc(k), ns)
    prompts = []
    for _ in range(n):
        if seqs and rng.random() < 0.85:
            s = rng.choice(seqs)
            s = s[: rng.randrange(1, len(s) + 1)] + [rng.randrange(alphabet) for _ in range(rng.randrange(0, 4))]
        else:
            s = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 8))]
        prompts.append(s)
    return cache, prompts


@pytest.mark.parametrize("backend,n", BACKEND_CASES)
@pytest.mark.parametrize("page_size", [1, 2])
def test_dfs_weight_matches_reference(backend, n, page_size):
    rng = random.Random(n * 13 + page_size)
    cache, prompts = random_tree_workload(n, rng, page_size=page_size)
    queue = make_queue(n, rng, False, prompts=prompts)
    cfg = SchedulerConfig(schedule_policy="dfs-weight", page_size=page_size)
    res = order_queue(queue, cfg, cache, [], no_shuffle)  # matches (and splits) in queue order
    want = ref_perm(queue, res.queue)
    parent, rank, depth, index = flatten_tree(cache.root)
    last = torch.tensor([index[id(r.last_node)] for r in queue], dtype=torch.int64)
    got = P.dfs_weight_order(parent, rank, depth, last, **kw(backend))
    assert_perm_equal(got, want, f"dfs {backend} n={n} P={page_size}")
    # a correct depth bound gives the same order in fewer rounds
    got2 = P.dfs_weight_order(parent, rank, None, last, max_depth=int(depth.max()), **kw(backend))
    assert_perm_equal(got2, want, f"dfs {backend} n={n} with max_depth")
    if backend == "torch":  # on the CPU that was the numpy form (rounds stop at the root); the torch form too
        assert_perm_equal(_torch_forms(P.dfs_weight_order, parent, rank, depth, last), want, f"dfs torch form n={n}")


def test_dfs_weight_shuffled_node_numbering_and_sibling_ties():
    """Nodes numbered in a random order (not BFS), siblings of equal weight, int32 inputs."""
    rng = random.Random(3)
    cache, prompts = random_tree_workload(700, rng, n_inserts=150)
    queue = make_queue(700, rng, False, prompts=prompts)
    res = order_queue(queue, SchedulerConfig(schedule_policy="dfs-weight"), cache, [], no_shuffle)
    want = ref_perm(queue, res.queue)
    parent, rank, depth, index = flatten_tree(cache.root)
    N = parent.numel()
    relabel = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(N - 1, generator=_gen().manual_seed(5))])
    new_parent = torch.full((N,), -1, dtype=torch.int64)
    new_parent[relabel[1:]] = relabel[parent[1:]]
    new_rank = torch.zeros(N, dtype=torch.int64)
    new_rank[relabel] = rank
    last = relabel[torch.tensor([index[id(r.last_node)] for r in queue])]
    for backend in ["torch"] + (["triton"] if HAVE_TRITON else []):
        got = P.dfs_weight_order(new_parent.to(torch.int32), new_rank.to(torch.int32), None, last.to(torch.int32),
                                 **kw(backend))
        assert_perm_equal(got, want, f"dfs relabelled {backend}")
    got = _torch_forms(P.dfs_weight_order, new_parent.to(torch.int32), new_rank.to(torch.int32), None,
                       last.to(torch.int32))
    assert_perm_equal(got, want, "dfs relabelled torch form")


def _dfs_case(seed: int, n: int, n_inserts: int):
    """A random cache and queue of n: (the reference's dfs-weight permutation, parent, child
    rank, depth, last node per request) on the flattened tree."""
    rng = random.Random(seed)
    cache, prompts = random_tree_workload(n, rng, n_inserts=n_inserts)
    queue = make_queue(n, rng, False, prompts=prompts)
    want = ref_perm(queue, order_queue(queue, SchedulerConfig(schedule_policy="dfs-weight"), cache, [], no_shuffle).queue)
    parent, rank, depth, index = flatten_tree(cache.root)
    return want, parent, rank, depth, torch.tensor([index[id(r.last_node)] for r in queue], dtype=torch.int64)


def test_dfs_weight_unpacked_sibling_key(monkeypatch):
    """When (parent, -weight, child_rank) does not fit one int64 key (forced here by a smaller
    bound), both CPU forms sort siblings by two keys instead and give the reference's order."""
    want, parent, rank, depth, last = _dfs_case(17, 400, 80)
    monkeypatch.setattr(P, "INT64_MAX", 1)  # no packed sibling key
    assert_perm_equal(P.dfs_weight_order(parent, rank, depth, last), want, "dfs unpacked, numpy form")
    assert_perm_equal(_torch_forms(P.dfs_weight_order, parent, rank, depth, last), want, "dfs unpacked, torch form")


def test_dfs_weight_sibling_stamps_with_rank_bound():
    """Creation-order stamps in place of child ranks (what the recorded step passes: sparse,
    far above N, `rank_bound` unbounded) order siblings as the ranks do: the same permutation
    on every backend and in the torch form; ranks above a given bound are refused."""
    want, parent, rank, _, last = _dfs_case(29, 500, 120)
    # a stamp increasing with the rank within each sibling group, with gaps and far above N
    N = parent.numel()
    stamps = (1 << 40) + rank * 1_000_003 + torch.randint(0, 1000, (N,), generator=_gen().manual_seed(2))
    assert bool((stamps >= N).all())
    for backend in ["torch"] + (["triton"] if HAVE_TRITON else []):
        got = P.dfs_weight_order(parent, stamps, None, last, rank_bound=P.INT64_MAX, **kw(backend))
        assert_perm_equal(got, want, f"dfs stamps {backend}")
    got = _torch_forms(P.dfs_weight_order, parent, stamps, None, last, rank_bound=P.INT64_MAX)
    assert_perm_equal(got, want, "dfs stamps torch form")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="rank_bound"):
            P.dfs_weight_order(parent, rank, None, last, rank_bound=bad)


def test_dfs_weight_100k_chain():
    """A chain of 10^5 nodes: no recursion; 17 pointer-jumping rounds. Compared with the
    reference walk over real TreeNodes and with the closed form (deepest node first)."""
    N = 100_000
    parent = torch.arange(-1, N - 1, dtype=torch.int64)
    rank = torch.zeros(N, dtype=torch.int64)
    g = _gen().manual_seed(1)
    n = 3000
    last = torch.randint(0, N, (n,), generator=g)
    last[:5] = torch.tensor([0, N - 1, N - 1, 0, 1])
    got = P.dfs_weight_order(parent, rank, None, last)
    closed = torch.sort(-last, stable=True).indices
    assert_perm_equal(got, closed.tolist(), "chain closed form")
    assert_perm_equal(_torch_forms(P.dfs_weight_order, parent, rank, None, last), closed.tolist(), "chain torch form")
    nodes = [TreeNode(np.zeros(0, np.int32), np.zeros(0, np.int64), None, 0, 0)]
    for i in range(1, N):
        node = TreeNode(np.zeros(1, np.int32), np.zeros(1, np.int64), nodes[-1], 0, i)
        nodes[-1].children[0] = node
        nodes.append(node)
    queue = make_queue(n, random.Random(1), False)
    for r, v in zip(queue, last.tolist()):
        r.last_node = nodes[v] if v else None
    want = ref_perm(queue, ref_dfs_weight_order(nodes[0], queue))
    assert_perm_equal(got, want, "chain vs reference")


@pytest.mark.parametrize("seed", range(6))
def test_dfs_weight_tiebreak_equals_split_chains(seed):
    """`tiebreak` orders matches that end inside a node as if the node were split (the recorded
    step's form, `StepGraph._dfs_weight_perm`): on random trees, with random whole and partial
    covers, the order equals the plain order on the tree with each node's distinct partial
    covers cut into a chain of single-child heads above its rest (a head takes the node's place
    in the child order), the requests at the head of their cover."""
    rng = random.Random(seed)
    N = rng.randrange(2, 60)
    parent = [-1] + [rng.randrange(i) for i in range(1, N)]
    key_len = [0] + [rng.randrange(1, 9) for _ in range(1, N)]
    kids = {}
    for v in range(1, N):
        kids.setdefault(parent[v], []).append(v)
    rank = [0] * N
    for vs in kids.values():
        for r, v in enumerate(rng.sample(vs, len(vs))):
            rank[v] = r
    n = rng.randrange(0, 80)
    node = [rng.randrange(N) if rng.random() < 0.9 else 0 for _ in range(n)]
    cover = [rng.randrange(1, key_len[v] + 1) if v else 0 for v in node]
    C = 100  # above every cover
    tb = [C - c if v and c < key_len[v] else 0 for v, c in zip(node, cover)]
    # the split tree: chain heads appended as new nodes
    sp_parent, sp_rank, head = list(parent), list(rank), {}
    for v in range(1, N):
        cuts = sorted({c for u, c in zip(node, cover) if u == v and c < key_len[v]})
        above, r = parent[v], rank[v]
        for c in cuts:
            head[(v, c)] = len(sp_parent)
            sp_parent.append(above)
            sp_rank.append(r)
            above, r = head[(v, c)], 0
        sp_parent[v], sp_rank[v] = above, r
    sp_last = [head.get((v, c), v) for v, c in zip(node, cover)]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    want = P.dfs_weight_order(t(sp_parent), t(sp_rank), None, t(sp_last)).tolist()
    # with its bound (C: the step's max_len + 1) the requests' two keys are packed into one
    bounds = (None, C) if seed % 2 else (None, C, 2**62)  # 2^62: too wide to pack, two sorts
    for backend in ["torch"] + (["triton"] if HAVE_TRITON else []):
        for bound in bounds:
            got = P.dfs_weight_order(t(parent), t(rank), None, t(node), tiebreak=t(tb), tiebreak_bound=bound,
                                     **kw(backend))
            assert_perm_equal(got, want, f"dfs tiebreak {backend} seed {seed} bound {bound}")
    for bound in bounds:
        got = _torch_forms(P.dfs_weight_order, t(parent), t(rank), None, t(node), tiebreak=t(tb),
                           tiebreak_bound=bound)
        assert_perm_equal(got, want, f"dfs tiebreak torch form seed {seed} bound {bound}")


def test_dfs_weight_tiebreak_by_hand():
    """root -> X (8 tokens) -> Y: requests C (X to 2 tokens), B (X to 4), A (all of X), D (X to
    4), E (nothing), F (Y). Split, X would be a chain [0, 2) -> [2, 4) -> [4, 8) -> Y: post-order
    F, A, then B and D (queue order), C, E. Without the tiebreak all of X's go in queue order."""
    parent, rank = torch.tensor([-1, 0, 1]), torch.zeros(3, dtype=torch.int64)
    node = torch.tensor([1, 1, 1, 1, 0, 2])
    tb = torch.tensor([9 - 2, 9 - 4, 0, 9 - 4, 0, 0])
    for backend in ["torch"] + (["triton"] if HAVE_TRITON else []):
        assert P.dfs_weight_order(parent, rank, None, node, tiebreak=tb, **kw(backend)).tolist() == [5, 2, 1, 3, 0, 4]
        assert P.dfs_weight_order(parent, rank, None, node, **kw(backend)).tolist() == [5, 0, 1, 2, 3, 4]
    assert _torch_forms(P.dfs_weight_order, parent, rank, None, node, tiebreak=tb).tolist() == [5, 2, 1, 3, 0, 4]
    with pytest.raises(ValueError, match="tiebreak"):
        P.dfs_weight_order(parent, rank, None, node, tiebreak=tb[:3])
    with pytest.raises(ValueError, match="tiebreak_bound needs a tiebreak"):
        P.dfs_weight_order(parent, rank, None, node, tiebreak_bound=10)
    with pytest.raises(ValueError, match="tiebreak_bound must be an int >= 1"):
        P.dfs_weight_order(parent, rank, None, node, tiebreak=tb, tiebreak_bound=0)


def test_dfs_weight_edge_cases():
    root_only = torch.tensor([-1])
    for backend in ["torch"] + (["triton"] if HAVE_TRITON else []):
        assert P.dfs_weight_order(root_only, torch.zeros(1, dtype=torch.int64), None,
                                  torch.zeros(0, dtype=torch.int64), **kw(backend)).tolist() == []
        # out-of-range and -1 last nodes count at the root
        got = P.dfs_weight_order(torch.tensor([-1, 0]), torch.tensor([0, 0]), None,
                                 torch.tensor([-1, 1, 5, 1, 0]), **kw(backend))
        assert got.tolist() == [1, 3, 0, 2, 4]
    with pytest.raises(ValueError, match="at least the root"):
        P.dfs_weight_order(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None,
                           torch.zeros(0, dtype=torch.int64))


# ---- API checks -------------------------------------------------------------------------------------
def test_bad_arguments_raise_clear_errors():
    x = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="backend must be one of"):
        P.lpm_order(x, torch.zeros(4, dtype=torch.bool), backend="cuda")
    with pytest.raises(ValueError, match="sign must be"):
        P.fcfs_priority_order(x, torch.zeros(4, dtype=torch.float64), 0)
    with pytest.raises(TypeError, match="enqueue_time must have dtype"):
        P.fcfs_priority_order(x, torch.zeros(4, dtype=torch.float32), 1)
    with pytest.raises(ValueError, match="must have 4 elements"):
        P.lpm_order(x, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="deprioritized must have dtype bool"):
        P.lpm_order(x, x)
    with pytest.raises(ValueError, match="check_threshold"):
        P.in_batch_deprioritize(x, x, x, x, -2, 1)
    with pytest.raises(ValueError, match="max_depth"):
        P.dfs_weight_order(torch.tensor([-1]), torch.zeros(1, dtype=torch.int64), None, x[:0], max_depth=-1)


def test_non_contiguous_inputs():
    rng = random.Random(2)
    prio = torch.tensor([rng.choice([0, 1, 2]) for _ in range(400)])[::2]
    t = torch.tensor([float(rng.choice([0, 1])) for _ in range(400)], dtype=torch.float64)[::2]
    want = sorted(range(200), key=lambda i: (-int(prio[i]), float(t[i])))
    for backend in ["torch"] + (["triton"] if HAVE_TRITON else []):
        assert_perm_equal(P.fcfs_priority_order(prio, t, -1, **kw(backend)), want, f"strided {backend}")


# ---- no host synchronization ----------------------------------------------------------------------
def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)


def test_torch_backend_compiles_without_graph_breaks():
    """fullgraph=True fails on any host read (.item(), .tolist(), .cpu(), nonzero, data-dependent
    shapes): every torch-backend function traces as one graph. (`random_order` is a single
    torch.randperm; dynamo does not trace Generator arguments, so it is not compiled here.)"""
    n = 257
    g = _gen().manual_seed(0)
    prio = torch.randint(-2, 3, (n,), generator=g)
    t = torch.randint(0, 4, (n,), generator=g).to(torch.float64)
    max_new = torch.randint(0, 4, (n,), generator=g)
    key_id = torch.randint(-1, 5, (n,), generator=g, dtype=torch.int32)
    key_rank = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    run = torch.randint(-1, 5, (9,), generator=g, dtype=torch.int32)
    matched = torch.randint(0, 5, (n,), generator=g)
    dep = torch.rand(n, generator=g) < 0.3
    ns = torch.randint(0, 2, (n,), generator=g)
    toks = torch.randint(0, 3, (n, 4), generator=g, dtype=torch.int32)
    lengths = torch.randint(0, 6, (n,), generator=g)
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 5, 5])
    crank = torch.tensor([0, 0, 1, 0, 1, 0, 0, 1])
    last = torch.randint(0, 8, (n,), generator=g)
    cases = [
        (lambda: P.fcfs_priority_order(prio, t, -1), ()),
        (lambda: P.lof_order(max_new, prio, 1), ()),
        (lambda: P.lof_order(max_new), ()),
        (lambda: P.routing_key_order(key_id, key_rank, run), ()),
        (lambda: P.lpm_order(matched, dep), ()),
        (lambda: P.lpm_order(matched.to(torch.int32), dep), ()),
        (lambda: P.in_batch_deprioritize(matched, lengths, ns, P.head_hashes(toks, lengths), 3, 2), ()),
        (lambda: P.in_batch_deprioritize_groups(matched, lengths, key_id.clamp(min=0), 5, 3, 2), ()),
        (lambda: P.dfs_weight_order(parent, crank, None, last), ()),
    ]
    for fn, _ in cases:
        assert torch.equal(_compiled(fn)(), fn())


def test_torch_backend_runs_on_meta_tensors():
    """Shapes and dtypes propagate on `meta` tensors (no data at all, so no host read can
    happen). torch.sort and cummax have meta kernels; every function runs on meta."""
    n = 100
    m = lambda dt=torch.int64, *s: torch.empty(s or (n,), dtype=dt, device="meta")  # noqa: E731
    assert P.fcfs_priority_order(m(), m(torch.float64), -1).shape == (n,)
    assert P.lof_order(m(torch.int32), m(), 1).shape == (n,)
    assert P.routing_key_order(m(torch.int32), m(torch.int32, 7), m(torch.int32, 3)).shape == (n,)
    assert P.lpm_order(m(), m(torch.bool)).shape == (n,)
    hh = P.head_hashes(m(torch.int32, n, 8), m())
    assert P.in_batch_deprioritize(m(), m(), m(torch.int32), hh, 32, 8).shape == (n,)
    assert P.in_batch_deprioritize_groups(m(), m(), m(torch.int32), 40, 32, 8).shape == (n,)
    assert P.dfs_weight_order(m(torch.int64, 50), m(torch.int64, 50), None, m()).device.type == "meta"


def _groups(ns, hh):
    """Interned (namespace, head hash) ids as the scheduler keeps them, in a shuffled id space."""
    pairs = torch.stack([ns.to(torch.int64), hh])
    _, inv = torch.unique(pairs, dim=1, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    shuffle = torch.randperm(G + 3, generator=_gen().manual_seed(G))[:G]  # ids need not be dense
    return (shuffle[inv] if G else inv), G + 3


@pytest.mark.parametrize("backend,n,check,T",
                         threshold_cases(DEPRIO_CASES, [(-1, 32), (0, 3), (8, 0), (40, 8)]))
def test_in_batch_deprioritize_groups_matches_reference(backend, n, check, T):
    want, (prefix, lengths, ns, hh) = deprio_case(n * 13 + check + T, n, check, T)
    group, G = _groups(ns, hh)
    # rows too short to be eligible may carry any id, even out of range: never read
    group = torch.where(lengths >= T, group, 10**12)
    got = P.in_batch_deprioritize_groups(prefix, lengths, group, G, check, T, **kw(backend))
    assert got.dtype == torch.bool
    assert_perm_equal(got.to(torch.int64), want, f"deprio groups {backend} n={n} check={check} T={T}")
    if backend == "torch":  # on the CPU that was the numpy form; the torch form too
        got = _torch_forms(P.in_batch_deprioritize_groups, prefix, lengths, group, G, check, T)
        assert_perm_equal(got.to(torch.int64), want, f"deprio groups torch form n={n} check={check} T={T}")
        # the numpy form as the scheduler calls it (all thresholds, T == 0 and check == -1 too)
        got = P.deprioritize_groups_host(prefix.cpu().numpy(), lengths.cpu().numpy(), group.cpu().numpy(), check, T)
        assert got.dtype == np.bool_ and got.tolist() == [bool(w) for w in want], (n, check, T)
        # ids on demand, as GpuScheduler passes them: asked once, for the eligible rows only,
        # and not at all for a single eligible row (its group's first whatever its id)
        asked = []
        gn = group.cpu().numpy()

        def ids(e):
            asked.append(e.copy())
            return gn[e]

        got = P.deprioritize_groups_host(prefix.cpu().numpy(), lengths.cpu().numpy(), ids, check, T)
        assert got.tolist() == [bool(w) for w in want], (n, check, T)
        eligible = np.flatnonzero((prefix.cpu().numpy() <= check) & (lengths.cpu().numpy() >= T)) if check >= 0 and T > 0 else []
        assert len(asked) == (1 if len(eligible) > 1 else 0), (n, check, T)
        if asked:
            assert asked[0].tolist() == list(eligible)
    if n > 100 and check >= 8 and T > 0:
        assert 0 < sum(want) < n  # both outcomes occur


def test_in_batch_deprioritize_groups_rejects_bad_args():
    x = torch.zeros(4, dtype=torch.int64)
    for kwargs in ({"num_groups": -1}, {"check_threshold": -2}, {"threshold": -1}):
        args = {"num_groups": 2, "check_threshold": 3, "threshold": 1, **kwargs}
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            P.in_batch_deprioritize_groups(x, x, x, args["num_groups"], args["check_threshold"], args["threshold"])
    with pytest.raises((TypeError, ValueError), match="group"):
        P.in_batch_deprioritize_groups(x, x, x.float(), 2, 3, 1)


@pytest.mark.parametrize("bad", [3, 7])
@pytest.mark.usefixtures("cpu_default_device")
def test_dfs_weight_order_refuses_a_parent_past_the_tree(bad):
    """A parent index of N or more names no node: a ValueError naming the value, not an
    IndexError (or, at exactly N, a quiet order) from inside the passes."""
    parent = torch.tensor([-1, 0, bad])
    with pytest.raises(ValueError, match=f"parent values must be node indices below N = 3.*got {bad}"):
        P.dfs_weight_order(parent, torch.arange(3), None, torch.tensor([0, 1, 2, 2, 1]))
    with pytest.raises(ValueError, match="max_depth must be an int >= 0"):
        P.dfs_weight_order(torch.tensor([-1, 0, 1]), torch.arange(3), None, torch.tensor([2]), max_depth=-1)


def test_host_views_of_a_numpy_table_are_flat_in_its_memory_order():
    """`HostViews.mv` of an owner's numpy array (the scheduler's column-major row table): one
    flat memoryview of its memory (row r's column c at c * rows + r for a column-major
    table), reads and writes landing in the array; remade when the attribute holds another
    array or after `drop`; a copy starts empty; a non-contiguous array is refused."""
    import copy

    class Owner:
        pass

    o, views = Owner(), P.HostViews()
    o.rt = np.arange(5 * 3, dtype=np.int64).reshape(5, 3, order="F") * 7
    mv = views.mv(o, "rt")
    assert [mv[c * 5 + r] for r in range(5) for c in range(3)] == o.rt.ravel().tolist()
    mv[2 * 5 + 4] = -1
    assert o.rt[4, 2] == -1 and views.mv(o, "rt") is mv
    o.rt = np.ones((2, 2), dtype=np.int64, order="C")  # another array: its own view
    assert views.mv(o, "rt") is not mv and views.mv(o, "rt")[3] == 1
    views.drop("rt")
    assert not views.held(o, "rt")
    assert copy.deepcopy(views)._views == {}
    o.rt = np.zeros((4, 4), dtype=np.int64)[:, ::2]
    with pytest.raises(RuntimeError, match="contiguous"):
        views.mv(o, "rt")


@pytest.mark.parametrize("T", [1, 5, 64, 100])
def test_head_hashes_do_not_depend_on_the_width_past_the_longest_fill(T):
    """R-ORD-9's head hashes of the first min(fill, T) tokens: the same at width T and at any
    width W from the longest such prefix up (positions past a row's length count nothing), so
    the scheduler hashes at width min(T, longest fill rounded up to a power of two) however
    large T is (fills 0, below, at and above T; the host and torch forms)."""
    rng = np.random.default_rng(T)
    fills = np.array([0, 1, max(T - 1, 0), T, T + 3, 2 * T + 7])
    tokens = rng.integers(0, 2**31 - 1, size=(fills.size, 2 * T + 7), dtype=np.int64).astype(np.int32)
    lens = np.minimum(fills, T)
    want = P.head_hashes_host(tokens[:, :T], lens)
    for W in sorted({max(int(lens.max()), 1), 1 << max(int(lens.max()) - 1, 0).bit_length(), T}):
        if W > T:
            continue
        assert np.array_equal(P.head_hashes_host(tokens[:, :W], lens), want), W
        got = P.head_hashes(torch.from_numpy(tokens[:, :W].copy()), torch.from_numpy(lens))
        assert np.array_equal(got.numpy(), want), W
