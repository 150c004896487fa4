"""Ordering of the waiting queue on the device (SPEC.md section 3, R-ORD-4..11) as pure tensor
functions.

Inputs are column tensors of the waiting queue in its current order (length n); every function
returns an int64 permutation `perm` [n] with `queue[perm]` the new order. On a device nothing
here reads a value back to the host (no `.item()`, `.tolist()`, `.cpu()`, `nonzero`): sizes
come from tensor shapes, and "no reordering" cases pick the identity with `torch.where` on the
device (CPU tensors may take host forms, below).

How the orders are built (one idea per policy):
- Every key is made an integer (int64; lpm's lengths keep their int32) whose ascending order
  is the policy's order: a priority times `sign = -1` is `~priority` (bitwise-not reverses
  every int64 order without overflowing on the absent priorities -2^63 / 2^63-1); `-x` is
  `~x`; a float64 time becomes order-preserving int64 bits. Keys are computed by
  `gpu_sched.kernels.sort_keys` (backend "triton") or by the same formulas in torch (backend
  "torch"); the two agree bit for bit.
- A key that fits one int64 is sorted once with `torch.sort(stable=True)`: ties keep queue
  order (R-ORD-11). Two full 64-bit parts (priority and time, priority and max-new) do not fit
  one int64 together, so they are sorted least-significant part first, each sort stable (LSD):
  two sorts, where rank-compressing both parts first would cost three.
- routing-key packs (group, -count, rank) into one int64; lpm packs the deprioritized flag in.
- In-batch deprioritization (R-ORD-9) is "first occurrence per (namespace, first T tokens)":
  a stable sort by (group, head hash) and a compare with the sorted predecessor.
- dfs-weight (R-ORD-10) is a post-order position per node from subtree weights and sibling
  prefix sums, both computed by pointer jumping (see `gpu_sched.kernels.dfs_weight`) in
  `(N-1).bit_length()` rounds, or `max_depth.bit_length()` given a depth bound, instead of one
  round per tree level (a 10^5-deep chain takes 17 rounds); then one stable sort of the
  requests by position.

On CPU tensors (outside `torch.compile`, `HOST_PATHS` on) the integer-key sorts (one key or
two packed with the row index into one uint32/uint64 value, `host_perm` / `host_lex_perm`;
keys of 16 bits or fewer by numpy's stable radix sort instead, `_narrow`)
and the fcfs, lof and routing-key orders run as numpy calls on views of the tensors: there is
no device to sync with, and a numpy call costs 1-3 us where a torch CPU op costs 5-15 us,
which is most of an ordering's time below a few thousand requests. An int64 key holding the
absent priorities' ends among small values has the ends moved next to the others first, so it
still packs (`_squeeze_ends`). fcfs with priority on a queue out of time order (a serving
loop's queue after a step) packs (priority, time bits) when they fit, else sorts by priority
and then each priority's run by time (`fcfs_time_perm_host`). The torch forms run everywhere
else (CUDA, `meta`, compiled graphs); `test_host_forms_equal_torch_forms` checks the two give
one order.

`backend="triton"` runs the key and tree passes as Triton kernels (CUDA tensors, or any tensors
with `TRITON_INTERPRET=1` set before the kernels are imported); sorts and scans are torch's.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Optional, Tuple

import numpy as np
import torch

from .kernels._utils import check_tensor, gather

__all__ = [
    "BACKENDS",
    "fcfs_priority_order",
    "lof_order",
    "routing_key_order",
    "random_order",
    "lpm_order",
    "in_batch_deprioritize",
    "head_hashes",
    "head_hashes_host",
    "dfs_weight_order",
]

BACKENDS = ("torch", "triton")
INT_DTYPES = (torch.int32, torch.int64)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# head hash: two polynomial hashes modulo the prime 2^31-1 with different bases, combined
# into 62 bits; computed exactly (see head_hashes). Fixed bases: a scheduler keeps the group
# ids of its rows' heads, and a pickled one must find the same hashes in another process
# (a crafted collision could only merge two R-ORD-9 groups, an ordering, never a KV, matter).
_HASH_MOD = 2**31 - 1
_HASH_BASES = (1000003, 998244353)


# ---- helpers ------------------------------------------------------------------------------------
def _kernels(backend: str, family: str):
    """The kernel module of `family` for backend "triton", None for "torch"."""
    if backend == "torch":
        return None
    if backend != "triton":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if family == "sort_keys":
        from .kernels import sort_keys as mod
    else:
        from .kernels import dfs_weight as mod
    return mod


def _check_sign(sign) -> int:
    if isinstance(sign, bool) or sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    return int(sign)


#: False sends CPU tensors through the torch forms too, here and in the modules that import
#: `_host` (`admission`: lock drops and the eager admission's checks; `radix`: table probes
#: and walks); `torch_forms()` switches it off for a block
HOST_PATHS = True


@contextlib.contextmanager
def torch_forms():
    """Within the block every function takes its torch form, CPU tensors included: the
    recorded step (`gpu_sched.step.StepGraph.compute`) runs what a CUDA graph records on any
    device, and tests compare the two forms on the CPU."""
    global HOST_PATHS
    old, HOST_PATHS = HOST_PATHS, False
    try:
        yield
    finally:
        HOST_PATHS = old


def host_ok() -> bool:
    """Whether the host paths (numpy on views of CPU tensors, which may read values: there is
    no device to sync with) may run now: `HOST_PATHS` on and not inside `torch.compile`. For a
    caller that knows its tensors are on the CPU (a flag kept at construction: a
    `torch.device`'s `.type` builds a string per call, some 30 us on a cold cache)."""
    return HOST_PATHS and not torch.compiler.is_compiling()


class HostViews:
    """numpy views of an owner's CPU tensors (or its numpy arrays, their own views), by
    attribute name, made once per tensor: the
    tensors are written in place, and `.numpy()` costs 5-15 us per call on a cold cache against
    a dict read here. Each entry is [tensor, numpy view, memoryview of it or None]
    (`mv`, made on first use). A view is made anew when the attribute holds another tensor (a rebuilt
    table or pool). Not copied with its owner: a copy, deep copy or pickle starts empty and
    makes its own views of the copied tensors (copied views would hold their data apart)."""

    def __init__(self):
        self._views = {}

    def __reduce__(self):
        return HostViews, ()

    def get(self, owner, name: str) -> np.ndarray:
        t = getattr(owner, name)
        e = self._views.get(name)
        if e is None or e[0] is not t:
            e = self._views[name] = [t, t if isinstance(t, np.ndarray) else t.numpy(), None]
        return e[1]

    def mv(self, owner, name: str) -> memoryview:
        """A memoryview of `get(owner, name)`, 1-d: indexing it gives a Python int or bool,
        ~3x cheaper than `ndarray.item` and ~5x cheaper than `int(a[i])`, for the scalar walks
        (one read per tree node on a path); writes go to the tensor's memory as the view's do.
        A contiguous array of more dimensions is viewed flat in its memory order (the
        scheduler's column-major row table: row r's column c is item c * rows + r; a 2-d
        view's reads cost 4x); RuntimeError for one that is not contiguous."""
        e = self._views.get(name)
        if e is None or e[0] is not getattr(owner, name):
            self.get(owner, name)
            e = self._views[name]
        if e[2] is None:
            a = e[1]
            if a.ndim > 1:
                if not (a.flags.c_contiguous or a.flags.f_contiguous):
                    raise RuntimeError(f"{name}: a flat view needs a contiguous array")
                a = a.ravel(order="K")  # a view: no copy of a contiguous array
            e[2] = memoryview(a)
        return e[2]

    def held(self, owner, name: str) -> bool:
        """Whether a view of the tensor now in `owner.name` is kept."""
        e = self._views.get(name)
        return e is not None and e[0] is getattr(owner, name)

    def drop(self, name: str) -> None:
        """Forget the view of `name` (its old tensor is freed now, not at the next `get`)."""
        self._views.pop(name, None)


def _host(t: torch.Tensor) -> bool:
    """Whether t may take the host paths: `host_ok()` and t on the CPU (`t.is_cpu`: cheaper
    than `t.device.type` on a cold cache)."""
    return t.is_cpu and host_ok()


def _stable_perm(key: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """Permutation sorting `key` ascending (descending: by `~key`, i.e. largest first), ties in
    index order.

    Integer keys on the CPU, outside `torch.compile`, go through `host_perm` when their span
    and index fit 64 bits together (any key of int32 or narrower, int64 ones spanning less than
    2^(64 - bits(n))); everything else (other devices included) is `torch.sort(stable=True)`.
    Both give the one stable order."""
    if key.dtype in INT_DTYPES and _host(key):
        perm = host_perm(key.numpy(), descending)
        if perm is not None:
            return torch.from_numpy(perm)
    return torch.sort(_neg(key) if descending else key, stable=True).indices


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _offsets(k: np.ndarray, descending: bool = False, lo=None, hi=None):
    """(offsets, span) of an integer key [n >= 1]: `k - min` (descending: `max - k`) as the
    unsigned type of k's width, and span = max - min (a Python int). Exact for every span:
    it is below 2^width, and the subtraction wraps modulo 2^width where it overflows. An int64
    key holding its type's ends and spanning 2^32 or more has those ends moved next to its
    other values first (`_squeeze_ends`: the same order, a span that may pack). `lo`, `hi`:
    k's min and max when the caller has them already (not read again)."""
    if lo is None:
        lo, hi = k.min(), k.max()
    if k.dtype == np.int64 and (lo == INT64_MIN or hi == INT64_MAX) and int(hi) - int(lo) >= 2**32:
        k, lo, hi = _squeeze_ends(k)
    off = (hi - k) if descending else (k - lo)
    return off.view(_UNSIGNED[k.itemsize]), int(hi) - int(lo)


def _squeeze_ends(k: np.ndarray):
    """(k', min, max) of an int64 key holding -2^63 or 2^63 - 1 (absent priorities resolve to
    them, SPEC section 1): those ends moved next to the other values (-2^63 to one below
    their minimum, 2^63 - 1 to one above their maximum), which keeps every comparison, so a
    queue mixing absent and small priorities still packs into one sort."""
    ends = (k == INT64_MIN) | (k == INT64_MAX)
    inner = k[~ends]
    lo = int(inner.min()) - 1 if inner.size else 0
    hi = int(inner.max()) + 1 if inner.size else 1
    out = np.where(k == INT64_MIN, lo, np.where(k == INT64_MAX, hi, k))
    return out, out.min(), out.max()


def _packed_argsort(parts, n: int) -> Optional[np.ndarray]:
    """Stable ascending argsort (int64 [n]) of the key made of `parts`, most significant first:
    each (offsets, span) non-negative with offsets <= span. Parts of 16 bits or fewer in all
    are packed into one uint8 / uint16 value per row and sorted by numpy's stable argsort,
    which is a radix sort for those types (`_narrow`: 4-16 ns per row). Wider parts and each
    row's index are packed into one uint32 / uint64 value per row, most significant first; the
    values are distinct, so numpy's default (unstable) sort gives the stable order, then the
    index is read back from the low bits. Parts that are all constant: queue order. None
    when a packed sort would need more than 64 bits (the parts' and those of n - 1)."""
    nb = max(n - 1, 0).bit_length()
    widths = [span.bit_length() for _, span in parts]
    kb = sum(widths)
    if kb == 0:  # every part constant: queue order
        return np.arange(n, dtype=np.int64)
    if _narrow((1 << kb) - 1):  # numpy's stable sort of these is a radix sort
        return _narrow_argsort(_pack_parts(parts, widths, np.uint8 if kb <= 8 else np.uint16), (1 << kb) - 1)
    total = nb + kb
    if total > 64:
        return None
    ut = np.uint32 if total <= 32 else np.uint64
    return _sort_with_index(_pack_parts(parts, widths, ut), nb)


def _sort_with_index(key: np.ndarray, nb: int) -> np.ndarray:
    """Stable ascending argsort (int64 [n]) of an unsigned key [n] whose values fit its type
    shifted left by nb = bits(n - 1): key and row index packed into one value per row, which
    are distinct, so numpy's default (unstable) sort gives the stable order; the index is read
    back from the low bits. The key is packed and sorted in place (the caller's own array)."""
    ut = key.dtype.type
    key <<= ut(nb)  # in place: every caller passes a fresh array (one 1M-row temporary less)
    key |= np.arange(key.size, dtype=ut)
    key.sort()
    key &= ut((1 << nb) - 1)
    return key.astype(np.int64)


def _narrow(span: int) -> bool:
    """Whether a key of this span (offsets in [0, span]) is sorted as uint8 / uint16 by
    `_narrow_argsort` (numpy's radix sort) rather than packed with the row index, at any queue
    size. On the CI-class CPU (AMD EPYC, numpy 2.4: its unstable sort is not vectorized there) a
    uint16 radix argsort costs 4-16 ns per row from 4k to 1M rows, the packed uint32 / uint64
    sort 18-64 ns (a CPU where numpy's sort is vectorized had the packed sort ahead from about
    16k rows, by 1.4x: the radix sort is the safer side of the two)."""
    return span < 65536


def _simd_sort_available() -> bool:
    """Whether numpy sorts 32-bit integers with its AVX-512 sorting networks (x86-simd-sort,
    dispatched when the CPU has AVX512_SKX)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy 1.x
        try:
            from numpy.core._multiarray_umath import __cpu_features__
        except ImportError:
            return False
    return bool(__cpu_features__.get("AVX512_SKX"))


#: numpy's unstable sort of 32-bit integers is vectorized on this CPU (`_narrow_argsort`)
SIMD_SORT = _simd_sort_available()
#: from this many rows, with `SIMD_SORT`, a uint16 key packed with its row index into one
#: uint32 value sorts faster than numpy's radix argsort (measured on an AVX-512 Xeon, numpy
#: 2.4, per row: 5.2 vs 7.3 ns at 8k rows, 5.1 vs 10.9 ns at 64k; the radix sort's passes
#: over 2-byte keys and 8-byte indices leave the caches as the queue grows)
PACKED_NARROW_MIN = 8192


def _narrow_dtype(span: int):
    """(the unsigned type of a narrow key's offsets in [0, span] (span < 65536), its largest
    value)."""
    return (np.uint8, 255) if span < 256 else (np.uint16, 65535)


def _packs_narrow(span: int, n: int) -> bool:
    """Whether `_narrow_argsort` sorts n offsets of this span packed with the row index (a key
    over 8 bits, `PACKED_NARROW_MIN` rows or more, `SIMD_SORT`, key and index within 32 bits)."""
    return span >= 256 and n >= PACKED_NARROW_MIN and SIMD_SORT and span.bit_length() + (n - 1).bit_length() <= 32


def _narrow_argsort(off: np.ndarray, span: int) -> np.ndarray:
    """Stable argsort (int64 [n]) of offsets in [0, span], span < 65536, as one uint8 / uint16
    value per row (numpy's radix sort); with `SIMD_SORT`, a key over 8 bits on
    `PACKED_NARROW_MIN` rows or more whose bits and the row index's fit 32 is packed with the
    index into one uint32 value per row and sorted by numpy's vectorized sort instead (the
    values are distinct, so the unstable sort gives the stable order). `host_perm` and
    `rank_perm_host` call it directly for one narrow key: a 1k-row order spends about 10 us
    less in glue than through `_offsets` and `_packed_argsort`."""
    n = off.size
    if _packs_narrow(span, n):
        return _sort_with_index(off.astype(np.uint32), (n - 1).bit_length())
    # the method: ~1 us less glue; a key already of the narrow type is sorted as it is (no copy)
    return off.astype(_narrow_dtype(span)[0], copy=False).argsort(kind="stable")


def _pack_parts(parts, widths, ut):
    """The parts' offsets packed into one unsigned value of type ut per row, most significant
    part first (parts of width 0 take no bits)."""
    key = None
    for (off, _), w in zip(parts, widths):
        if w:
            o = off.astype(ut)
            key = o if key is None else (key << ut(w)) | o
    return key


def rank_perm_host(key: np.ndarray, span: int) -> np.ndarray:
    """Stable ascending permutation (int64 [n]) of a key of ranks in [0, span] (no min/max
    pass): one packed sort (`_packed_argsort`), or numpy's stable argsort when the ranks and
    the row index do not fit 64 bits together."""
    if _narrow(span):  # without `_packed_argsort`'s glue
        return _narrow_argsort(key, span)
    perm = _packed_argsort([(key, span)], key.size)
    return perm if perm is not None else np.argsort(key, kind="stable")


def host_perm(key: np.ndarray, descending: bool = False, bounds=None) -> Optional[np.ndarray]:
    """`_stable_perm` of an integer numpy key [n] (int64 [n]), or None when its span and n - 1
    need more than 64 bits together (`_packed_argsort`). `bounds`: optional (lo, hi), ints
    that hold every value of key (a table column's bounds, `GpuScheduler._col_bounds`); when
    they span less than 2^16 they stand in for key's min and max (no pass over the key: the
    same order, the offsets only shifted)."""
    if key.size < 2:
        return np.zeros(key.size, dtype=np.int64)
    if bounds is not None and _narrow(bounds[1] - bounds[0]):
        lo, hi = bounds
    else:
        lo, hi = key.min(), key.max()
    lo, hi = int(lo), int(hi)
    span = hi - lo
    if _narrow(span):  # priorities, max-new lengths: without the `_offsets` glue
        ut, top = _narrow_dtype(span)
        if lo >= 0 and hi <= top and not _packs_narrow(span, key.size):
            # the values are their own narrow key for the radix sort: one cast, and for
            # descending order its complement in place (an int64 subtraction with a Python
            # scalar costs more than the cast and the sort's glue)
            u = key.astype(ut)
            if descending:
                np.invert(u, out=u)
            return u.argsort(kind="stable")
        if _packs_narrow(span, key.size):  # a large queue: the offsets made in uint32, where they are
            # packed with the row index (an int64 offset array and its cast cost ~1 ms at 1M rows);
            # the arithmetic wraps modulo 2^32, exact since every offset lies in [0, span]
            off = key.astype(np.uint32)
            if descending:
                np.subtract(np.uint32(hi & 0xFFFFFFFF), off, out=off)
            elif lo:
                off -= np.uint32(lo & 0xFFFFFFFF)
            return _sort_with_index(off, (key.size - 1).bit_length())
        return _narrow_argsort((hi - key) if descending else (key - lo), span)
    return _packed_argsort([_offsets(key, descending, lo, hi)], key.size)


def host_lex_perm(primary: np.ndarray, secondary: np.ndarray, desc_primary: bool = False,
                  desc_secondary: bool = False) -> Optional[np.ndarray]:
    """`_lex_perm` of two integer numpy keys [n]: both packed into one sort when their spans and
    n - 1 fit 64 bits together, else None."""
    n = primary.size
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    return _packed_argsort([_offsets(primary, desc_primary), _offsets(secondary, desc_secondary)], n)


def _lex_perm(primary: torch.Tensor, secondary: torch.Tensor, desc_primary: bool = False,
              desc_secondary: bool = False) -> torch.Tensor:
    """Stable permutation by (primary, secondary), each ascending or descending: two stable
    sorts, least significant first. On the host, two integer keys whose spans fit 64 bits with
    the index are one packed sort (`host_lex_perm`)."""
    if primary.dtype in INT_DTYPES and secondary.dtype in INT_DTYPES and _host(primary):
        perm = host_lex_perm(primary.numpy(), secondary.numpy(), desc_primary, desc_secondary)
        if perm is not None:
            return torch.from_numpy(perm)
    p1 = _stable_perm(secondary, desc_secondary)
    return gather(p1, _stable_perm(gather(primary, p1), desc_primary))


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _time_bits(t: torch.Tensor) -> torch.Tensor:
    """int64 with the order of t (float64 bits made monotone: negatives' magnitude bits
    flipped; -0.0 folded into +0.0 first, IEEE -0.0 + 0.0 == +0.0). Integer keys, because
    torch sorts them several times faster than floats on the CPU. No NaN by contract."""
    if t.dtype != torch.float64:
        return t
    b = (t + 0.0).view(torch.int64)
    return b ^ ((b >> 63) & INT64_MAX)


def _neg(x: torch.Tensor, sign: int = -1) -> torch.Tensor:
    """x (sign +1) or ~x (sign -1: reverses every integer order, no overflow), in x's own
    dtype (int32 sorts faster than int64; ascending sorts faster than descending ones)."""
    return x if sign > 0 else ~x


# ---- R-ORD-4 fcfs with priority ------------------------------------------------------------------
def fcfs_priority_order(priority: torch.Tensor, enqueue_time: Optional[torch.Tensor], sign: int,
                        *, backend: str = "torch", block: Optional[int] = None) -> torch.Tensor:
    """R-ORD-4 with priority scheduling on: stable order by `(priority * sign, enqueue_time)`.

    Args:
        priority: int64 (or int32) [n], absent priorities already resolved to the last possible
            value (`+2^63-1` when low values go first, else `-2^63`; SPEC section 1).
        enqueue_time: float64 [n] (no NaN) or int64 [n] (e.g. nanoseconds); or None when the
            caller knows the queue is already in enqueue-time order (non-decreasing; a queue
            appended to as requests arrive): the order is then the stable order by
            `priority * sign` alone (equal times keep queue order either way), one sort.
        sign: +1 when low priority values go first, else -1.
    Returns: int64 permutation [n].
    """
    sign = _check_sign(sign)
    check_tensor("fcfs_priority_order", "priority", priority, INT_DTYPES, contiguous=False)
    if enqueue_time is None:  # the priority key alone is one torch op on either backend
        _kernels(backend, "sort_keys")  # validates backend
        return _stable_perm(priority, descending=sign < 0)
    check_tensor("fcfs_priority_order", "enqueue_time", enqueue_time, (torch.float64,) + INT_DTYPES,
                 numel=priority.numel(), device=priority.device, contiguous=False)
    k = _kernels(backend, "sort_keys")
    if k is None:
        if _host(priority):
            perm = fcfs_time_perm_host(priority.numpy(), enqueue_time.numpy(), sign)
            if perm is not None:
                return torch.from_numpy(perm)
        return _lex_perm(priority, _time_bits(enqueue_time), desc_primary=sign < 0)
    pk, tk = k.fcfs_keys(_contig(priority), _contig(enqueue_time), sign, block=block)
    return _lex_perm(pk, tk)


def fcfs_perm_host(priority: np.ndarray, sign: int, bounds=None) -> Optional[np.ndarray]:
    """`fcfs_priority_order(priority, None, sign)`'s host form on a numpy column (the queue in
    enqueue-time order): int64 [n], or None when the key does not pack (`host_perm`; `bounds`
    as there)."""
    return host_perm(priority, descending=sign < 0, bounds=bounds)


def _monotone_bits(t: np.ndarray) -> np.ndarray:
    """`_time_bits` on numpy: int64 with the order of float64 t, -0.0 folded into +0.0;
    integer t as it is."""
    if t.dtype != np.float64:
        return t
    b = (t + 0.0).view(np.int64)
    return b ^ ((b >> 63) & INT64_MAX)


def fcfs_sorted_prefix(priority: np.ndarray, enqueue_time: np.ndarray, sign: int) -> int:
    """Length of the longest prefix of a queue already in R-ORD-4 order (by priority * sign,
    then time; equal keys in any order, as a stable sort keeps them): n when the whole queue
    is, as a serving loop's queue is at a step with no arrival since the last one (the
    previous order's remainder). Numpy columns [n] as `fcfs_time_perm_host` takes them;
    priorities compared as they are (the int64 ends of absent ones included, no overflow)."""
    n = priority.size
    if n < 2:
        return n
    p0, p1 = priority[:-1], priority[1:]
    ok = (p0 > p1) if sign < 0 else (p0 < p1)
    ok |= (p0 == p1) & (enqueue_time[:-1] <= enqueue_time[1:])
    i = int(ok.argmin())  # the first pair out of order, if any
    return n if ok[i] else i + 1


def _merge_tail(priority: np.ndarray, enqueue_time: np.ndarray, desc: bool, k: int,
                tail_perm: np.ndarray) -> Optional[np.ndarray]:
    """The stable order (int64 [n]) by (priority, descending when `desc`; then enqueue_time,
    ascending) of a queue whose first k rows are in that order already and whose rest is
    ordered by `tail_perm` (int64 [n - k], indices into the rest): each tail row goes after
    every head row whose key is at most its own (a stable sort keeps the earlier head row
    first on ties), found by binary searches within the head's run of its priority. R-ORD-4
    passes its columns; R-ORD-5 (lof) passes priorities or zeros and ~max_new_tokens as the
    second key (`merge_arrivals_host`). None when the tail holds over 64 distinct priorities
    (one search per run)."""
    n, m = priority.size, tail_perm.size
    hk = priority[:k] if not desc else ~priority[:k]  # the head's priority key, ascending
    tp = priority[k:][tail_perm]
    tt = enqueue_time[k:][tail_perm]
    tk = tp if not desc else ~tp
    ht = enqueue_time[:k]
    if m <= 32:  # a few arrivals: one bisection each within its priority's head rows (per-run
        # searches, below, cost about as much from ~32 arrivals: at 8k rows 32 vs 40 us for 10
        # arrivals, 44 vs 47 us for 32, session 46)
        his = np.searchsorted(hk, tk, "right").tolist()
        hv = memoryview(np.ascontiguousarray(ht))  # its items as Python numbers: ~50 ns a probe, not ~150
        pos = np.array([bisect.bisect_right(hv, x, lo, hi) + j for j, (x, lo, hi) in
                        enumerate(zip(tt.tolist(), np.searchsorted(hk, tk, "left").tolist(), his))],
                       dtype=np.int64)
        return _interleave(n, k, pos, tail_perm)
    starts = np.flatnonzero(tk[1:] != tk[:-1]) + 1  # the tail's priority runs
    if starts.size > 64:
        return None
    starts = np.concatenate(([0], starts))
    v = tk[starts]
    # each run's priority in the head: rows lo..hi-1, by time there
    bounds = zip(starts.tolist(), starts[1:].tolist() + [m], np.searchsorted(hk, v, "left").tolist(),
                 np.searchsorted(hk, v, "right").tolist())
    pos = np.arange(m)  # + the tail rows' places in the head: their places in the merged order
    for a, b, lo, hi in bounds:
        pos[a:b] += np.searchsorted(ht[lo:hi], tt[a:b], "right") + lo
    return _interleave(n, k, pos, tail_perm)


def _interleave(n: int, k: int, pos: np.ndarray, tail_perm: np.ndarray) -> np.ndarray:
    """int64 [n]: the tail's rows (k + tail_perm) at the strictly increasing places `pos`,
    the head's rows 0..k-1 in order at the others."""
    out = np.empty(n, dtype=np.int64)
    head = np.ones(n, dtype=bool)
    head[pos] = False
    out[pos] = tail_perm + k
    out[head] = np.arange(k)
    return out


#: up to this many arrivals behind a served queue are sorted by `np.lexsort` (2-3 us for
#: 10-80 rows, 15 us for 655, against 27-45 us through the packed sort's min/max passes and
#: glue; the packed sort wins from a few thousand rows: 257 vs 374 us at 4096)
LEXSORT_TAIL_MAX = 1024


def fcfs_time_perm_host(priority: np.ndarray, enqueue_time: np.ndarray, sign: int,
                        sorted_prefix: Optional[int] = None) -> Optional[np.ndarray]:
    """`fcfs_priority_order(priority, enqueue_time, sign)`'s host form on numpy columns [n]
    (int priorities, float64 or int times, no NaN) of a queue in any order, as a serving loop's
    queue is after its first step: the previous order's remainder (by priority, then time)
    with new arrivals behind it.

    A queue whose rows past its ordered prefix (`fcfs_sorted_prefix`; `sorted_prefix` when
    the caller has it) are at most half of it: only those are sorted, then merged into the
    prefix (`_merge_tail`): O(n) work and the tail's sort, not a sort of the queue. Else both
    keys (the time as its float bits made monotone, `_time_bits`) are packed into one
    sort when their spans and n - 1 fit 64 bits (the times of an epoch-based clock over hours
    do). Else the stable packed sort by priority, then each priority's run sorted stably by
    time (numpy's timsort: about linear on such a queue, whose runs are a few sorted pieces
    each), or, over 64 distinct priorities, one stable sort by time before the one by priority.
    int64 [n], or None when the priority's span and n - 1 do not fit 64 bits."""
    n = priority.size
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    desc = sign < 0
    k = fcfs_sorted_prefix(priority, enqueue_time, sign) if sorted_prefix is None else sorted_prefix
    if k == n:
        return np.arange(n, dtype=np.int64)
    if 2 * k >= n:  # a short tail: sort it alone, merge it in
        if n - k <= LEXSORT_TAIL_MAX:
            out = merge_arrivals_host(priority, enqueue_time, desc, k)
        else:
            tail = _fcfs_time_sort(priority[k:], enqueue_time[k:], desc)
            out = None if tail is None else _merge_tail(priority, enqueue_time, desc, k, tail)
        if out is not None:
            return out
    return _fcfs_time_sort(priority, enqueue_time, desc)


def merge_arrivals_host(primary: np.ndarray, secondary: np.ndarray, desc: bool, k: int) -> Optional[np.ndarray]:
    """The stable order (int64 [n]) by (primary, descending when `desc`; then secondary,
    ascending) of a queue whose first k rows are in that order already, as a served queue is
    with its arrivals behind it: the n - k others sorted by `np.lexsort` (stable) and merged
    in (`_merge_tail`), O(n) numpy work and no sort of the queue. Integer primary [n];
    secondary [n] integer or float64 without NaN (-0.0 equals +0.0, as in a stable sort by
    value). R-ORD-4 takes (priority, enqueue time), R-ORD-5 (priority, ~max_new_tokens). None
    when the arrivals hold over 64 distinct primary values."""
    tp = primary[k:]
    tail = np.lexsort((secondary[k:], ~tp if desc else tp))
    return _merge_tail(primary, secondary, desc, k, tail)


def _fcfs_time_sort(priority: np.ndarray, enqueue_time: np.ndarray, desc: bool) -> Optional[np.ndarray]:
    """`fcfs_time_perm_host`'s sort of a whole queue (n >= 2), by the packed keys or by
    priority runs (its docstring): int64 [n], or None where the priorities do not pack."""
    n = priority.size
    t_lo, t_hi = _monotone_bits(np.array([enqueue_time.min(), enqueue_time.max()])).tolist()
    t_span = t_hi - t_lo
    p_lo, p_hi = int(priority.min()), int(priority.max())
    if (n - 1).bit_length() + t_span.bit_length() + (p_hi - p_lo).bit_length() <= 64:
        return host_lex_perm(priority, _monotone_bits(enqueue_time), desc_primary=desc)
    perm = host_perm(priority, descending=desc)
    if perm is None:
        return None
    if p_hi - p_lo < 64:  # each priority's run from the counts, no gather
        cnt = np.bincount(priority - p_lo, minlength=p_hi - p_lo + 1)
        cnt = cnt[::-1] if desc else cnt  # in the sorted order's direction
        bounds = np.cumsum(cnt)[cnt > 0].tolist()
    else:
        ps = priority[perm]
        cuts = np.flatnonzero(ps[1:] != ps[:-1]) + 1
        if cuts.size > 64:  # many priorities: one sort by time, then the stable one by priority
            by_time = np.argsort(enqueue_time, kind="stable")
            return by_time[host_perm(priority[by_time], descending=desc)]
        bounds = cuts.tolist() + [n]
    tp = enqueue_time[perm]
    a = 0
    for b in bounds:
        if b - a > 1:
            perm[a:b] = perm[a:b][np.argsort(tp[a:b], kind="stable")]
        a = b
    return perm


# ---- R-ORD-5 lof -------------------------------------------------------------------------------
def lof_order(max_new_tokens: torch.Tensor, priority: Optional[torch.Tensor] = None, sign: int = -1,
              *, backend: str = "torch", block: Optional[int] = None) -> torch.Tensor:
    """R-ORD-5: stable order by `-max_new_tokens`, or by `(priority * sign, -max_new_tokens)`
    when `priority` (int64 [n], absent ones resolved) is given (priority scheduling on)."""
    where = "lof_order"
    check_tensor(where, "max_new_tokens", max_new_tokens, INT_DTYPES, contiguous=False)
    n = max_new_tokens.numel()
    if priority is not None:
        sign = _check_sign(sign)
        check_tensor(where, "priority", priority, INT_DTYPES, numel=n, device=max_new_tokens.device,
                     contiguous=False)
    k = _kernels(backend, "sort_keys")
    if k is None:
        if priority is None:
            return _stable_perm(max_new_tokens, descending=True)
        return _lex_perm(priority, max_new_tokens, desc_primary=sign < 0, desc_secondary=True)
    pk, mk = k.lof_keys(_contig(max_new_tokens), None if priority is None else _contig(priority),
                        sign, block=block)
    return _stable_perm(mk) if pk is None else _lex_perm(pk, mk)


def lof_perm_host(max_new_tokens: np.ndarray, priority: Optional[np.ndarray] = None,
                  sign: int = -1, bounds=None) -> Optional[np.ndarray]:
    """`lof_order`'s host form on numpy columns: int64 [n], or None when the keys do not pack
    (`host_perm`, `host_lex_perm`). `bounds`: optional (lo, hi) of max_new_tokens, as
    `host_perm` takes them (read without priority)."""
    if priority is None:
        return host_perm(max_new_tokens, descending=True, bounds=bounds)
    return host_lex_perm(priority, max_new_tokens, desc_primary=sign < 0, desc_secondary=True)


# ---- R-ORD-7 routing-key -------------------------------------------------------------------------
def routing_key_order(key_id: torch.Tensor, key_rank: torch.Tensor, running_key_ids: torch.Tensor,
                      empty_rank: int = -1, *, backend: str = "torch",
                      block: Optional[int] = None) -> torch.Tensor:
    """R-ORD-7: requests whose key is held by the running batch first (most running first),
    then the others, each group by key string; identity when no running key is counted.

    Args:
        key_id: int32/int64 [n], the waiting requests' interned routing-key ids; -1 = absent.
            The caller maps the empty string '' to -1 too: SGLang neither counts '' nor
            absent keys, and sorts both as "" among the uncounted.
        key_rank: int32/int64 [K], rank of each id's string in lexicographic order (equal
            strings share one id; ranks in int32 range).
        running_key_ids: int32/int64 [m], the running batch's key ids, -1 for absent or ''.
        empty_rank: the rank "" sorts at: below every rank of a non-empty key (default -1).
    Ids outside [0, K) count as absent. Returns: int64 permutation [n].
    """
    where = "routing_key_order"
    check_tensor(where, "key_id", key_id, INT_DTYPES, contiguous=False)
    dev = key_id.device
    check_tensor(where, "key_rank", key_rank, INT_DTYPES, device=dev, contiguous=False)
    check_tensor(where, "running_key_ids", running_key_ids, INT_DTYPES, device=dev, contiguous=False)
    if isinstance(empty_rank, bool) or not isinstance(empty_rank, int) or not -(2**31) <= empty_rank < 2**31:
        raise ValueError(f"{where}: empty_rank must be an int in int32 range, got {empty_rank!r}")
    n, K, m = key_id.numel(), key_rank.numel(), running_key_ids.numel()
    if m > 2**30:
        raise ValueError(f"{where}: at most 2^30 running requests fit the packed key, got {m}")
    k = _kernels(backend, "sort_keys")
    if k is None and _host(key_id):
        return torch.from_numpy(routing_perm_host(key_id.numpy(), key_rank.numpy(), running_key_ids.numpy(),
                                                  empty_rank))
    if k is None:
        # the packed key of each id is a table over slots 0 (absent), 1..K (ids 0..K-1) and
        # K+1 (ids >= K, absent too): per request one gather and one sort
        slot = (running_key_ids + 1).clamp_(0, K + 1)
        counts = torch.zeros(K + 2, dtype=torch.int64, device=dev).index_add_(0, slot, torch.ones_like(slot,
                                                                                         dtype=torch.int64))
        counts[:: K + 1] = 0  # absent running keys are not counted
        e = torch.full((1,), empty_rank, dtype=torch.int64, device=dev)
        ranks = torch.cat([e, key_rank.to(torch.int64), e])
        # (m - count) * 2^32 + rank + 2^31 (count 0: group m, the uncounted); all zero when no
        # running key is counted, so the stable sort keeps queue order
        table = torch.add(ranks, counts, alpha=-(2**32)).add_(m * 2**32 + 2**31).mul_(counts.any())
        # the table's values by their rank among its K+2 entries (same order and ties): keys
        # below K+2 instead of up to m * 2^32, fewer bits for the sort to pass over
        table = torch.searchsorted(torch.sort(table).values, table)
        return _stable_perm(gather(table, (key_id + 1).clamp_(0, K + 1)))
    counts = k.routing_counts(_contig(running_key_ids), K, block=block)
    key = k.routing_keys(_contig(key_id), _contig(key_rank), counts, m, empty_rank, block=block)
    any_counted = counts[:K].sum() > 0
    return torch.where(any_counted, _stable_perm(key), torch.arange(n, device=dev))


def routing_perm_host(key_id: np.ndarray, key_rank: np.ndarray, running_key_ids: np.ndarray,
                      empty_rank: int, dense: bool = False) -> np.ndarray:
    """`routing_key_order`'s torch branch on host arrays, in numpy calls of 1-3 us instead of
    torch CPU ops of 5-15 us: the key table of the slots (`routing_table_host`), then per
    request one clipped gather of it and one packed sort (`rank_perm_host`, no min/max pass).
    `dense` as `routing_table_host` takes it. Returns int64 [n]."""
    t = routing_table_host(key_rank, running_key_ids, empty_rank, dense)
    if t is None:
        return np.arange(key_id.size, dtype=np.int64)
    return routing_perm_from_table(key_id, *t)


def routing_table_host(key_rank: np.ndarray, running_key_ids: np.ndarray, empty_rank: int,
                       dense: bool = False) -> Optional[Tuple[np.ndarray, int]]:
    """R-ORD-7's sort key per slot (0: absent, 1..K: ids 0..K-1, K+1: ids >= K, absent too),
    which depends on the running batch and the key strings only, not on the queue: the rank,
    in [0, span], of `(c_max - count) * (K + 2) + r` among the slots' values (same order and
    ties), r the slot's string rank made dense in [0, K] ("" included), count its running
    requests; this orders counted keys by count descending, then by string, and the uncounted
    (count 0) after them by string. Ranked so that span <= K + 1: one byte per request's key
    for up to 254 keys (`_narrow_argsort`'s radix sort on uint8). `dense`: the caller's
    key_rank is a permutation of 0..K-1 and empty_rank < 0 (the scheduler's own rank table),
    so r is key_rank + 1 without a sort. Returns (table int64 [K + 2], span), or None when no
    running key is counted (the order is the queue's)."""
    K = key_rank.size
    slot = running_key_ids + 1  # a new int64 array (np.clip costs ~7 us at any size)
    np.minimum(slot, K + 1, out=slot)
    np.maximum(slot, 0, out=slot)
    # absent running keys (slots 0 and K+1) are not counted
    counts = np.bincount(slot, minlength=K + 2)
    counts[0] = counts[K + 1] = 0
    c_max = int(counts.max())
    if not c_max:
        return None
    if dense:  # in place: (c_max - count) * (K + 2), plus the ranks shifted by one
        table = c_max - counts
        table *= K + 2
        table[1:K + 1] += key_rank
        table[1:K + 1] += 1
    else:
        r = np.empty(K + 2, dtype=np.int64)
        r[0] = r[K + 1] = empty_rank
        r[1:K + 1] = key_rank
        r = np.searchsorted(np.sort(r), r)  # same order and ties, values in [0, K + 1]
        table = (c_max - counts) * (K + 2) + r
    table = np.searchsorted(np.sort(table), table)  # ranks: same order and ties, in [0, K + 1]
    return table, K + 1


def routing_id_table(table: np.ndarray, span: int) -> Optional[np.ndarray]:
    """`routing_table_host`'s slot table (int64 [K + 2], ranks in [0, span]) indexed by key id
    instead of slot, in the narrow type of span (`_narrow_dtype`): [K + 1], entry i < K is id
    i's key and entry K, which id -1 reaches as a negative index, the absent key's. For ids
    known to lie in [-1, K) (the scheduler's interned ids): one gather, `table[key_id]`, gives
    each request's narrow sort key without the `key_id + 1` and the int64 result (at 1M
    requests 0.6 ms against 3 ms). None when span is not narrow (`_narrow`)."""
    if not _narrow(span):
        return None
    K = table.size - 2
    t = np.empty(K + 1, dtype=_narrow_dtype(span)[0])
    t[:K] = table[1 : K + 1]
    t[K] = table[0]
    return t


def routing_perm_from_table(key_id: np.ndarray, table: np.ndarray, span: int) -> np.ndarray:
    """The stable order (int64 [n]) of requests with interned key ids `key_id` by the slot key
    `routing_table_host` made: one clipped gather (mode="clip" sends ids below -1 to slot 0 and
    ids >= K to slot K+1: absent, as the torch clamp) and one sort of ranks in [0, span]."""
    return rank_perm_host(np.take(table, key_id + 1, mode="clip"), span)


# ---- R-ORD-6 random ----------------------------------------------------------------------------
def random_order(n: int, generator: torch.Generator, *, backend: str = "torch") -> torch.Tensor:
    """R-ORD-6: a uniformly random permutation of n on the generator's device
    (`torch.randperm`); the same seed gives the same permutation. Both backends use torch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"random_order: n must be an int >= 0, got {n!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"random_order: generator must be a torch.Generator, got {type(generator).__name__}")
    return torch.randperm(n, generator=generator, device=generator.device)


# ---- R-ORD-8 lpm -------------------------------------------------------------------------------
def lpm_order(matched: torch.Tensor, deprioritized: torch.Tensor,
              *, cap: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
              backend: str = "torch", block: Optional[int] = None) -> torch.Tensor:
    """R-ORD-8: stable order by `-matched` (capped match lengths, int32/int64 [n] >= 0), the
    deprioritized requests (bool [n], R-ORD-9) last in queue order. `cap` (int [n]): the
    lengths are min(matched, cap) (max_prefix_len, R-STEP-3.4); `valid` (bool [n]): a request
    that is not valid sorts with the deprioritized (a padded queue's padding); backend
    "triton" reads both in its key launch."""
    where = "lpm_order"
    check_tensor(where, "matched", matched, INT_DTYPES, contiguous=False)
    check_tensor(where, "deprioritized", deprioritized, (torch.bool,), numel=matched.numel(),
                 device=matched.device, contiguous=False)
    k = _kernels(backend, "sort_keys")
    if k is not None:
        return _stable_perm(k.lpm_keys(_contig(matched), _contig(deprioritized),
                                       cap=None if cap is None else _contig(cap),
                                       valid=None if valid is None else _contig(valid), block=block))
    if cap is not None:
        matched = torch.minimum(matched, cap)
    if valid is not None:
        deprioritized = deprioritized | ~valid
    if _host(matched):
        perm = lpm_perm_host(matched.numpy(), deprioritized.numpy())
        if perm is not None:
            return torch.from_numpy(perm)
    # in matched's own dtype: ~m = -m-1 < 0 for m >= 0, so 0 puts the deprioritized last, and
    # the keys span only max(m) + 1 (int32 sorts ~2x faster than int64 in torch; on the CPU the
    # span and the index pack into one value, `host_perm`)
    return _stable_perm(torch.where(deprioritized, 0, ~matched))


def lpm_perm_host(matched: np.ndarray, deprioritized: np.ndarray) -> Optional[np.ndarray]:
    """`lpm_order`'s host form on numpy columns [n] (matched >= 0, any int dtype; bool flags):
    int64 [n], or None when a length is negative (outside the contract: `lpm_order`'s torch
    form decides), max(matched) + 1 does not fit int64, or the key and the row index need more
    than 64 bits together (the torch form decides those too). One key per row,
    `max - matched` (the longest first) and `max + 1` for the deprioritized (last): up to 16
    bits sorted as uint8 / uint16 by numpy's stable radix argsort (`_narrow_argsort`), wider
    (real prompts: matches up to ~126k tokens) packed with the row index (`_packed_argsort`;
    at 10k rows ~30 us against ~50 us for the torch form)."""
    n = matched.size
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    top = int(matched.max()) + 1  # the deprioritized rows' key
    if matched.min() < 0 or top > INT64_MAX:  # the key must fit int64 (then `_packed_argsort` may still refuse)
        return None
    off = np.subtract(top - 1, matched, dtype=np.int64)
    off[deprioritized] = top
    if _narrow(top):
        return _narrow_argsort(off, top)
    return _packed_argsort([(off, top)], n)


def deprioritize_groups_host(prefix_len: np.ndarray, fill_len: np.ndarray, group,
                             check_threshold: int, threshold: int) -> np.ndarray:
    """`in_batch_deprioritize_groups`'s host form on numpy columns [n] (arguments already
    checked by the caller): bool [n]. The first occurrence of each group among the eligible
    rows (with a warm cache few have a match within check_threshold) by a stable argsort of
    their ids. `group`: int [n] ids, or a function of the eligible rows' indices (int64 [k])
    returning their ids (int [k]), called only when two or more rows are eligible (one is
    its group's first whatever its id): a caller that computes ids on demand
    (`GpuScheduler`, which hashes a fill into its pools for its head's id) skips the rows
    that are not, and a lone eligible row stays unhashed until a path needs its fill."""
    n = prefix_len.size
    if check_threshold == -1:
        return np.zeros(n, dtype=bool)
    checked = prefix_len <= check_threshold
    if threshold == 0:
        return checked
    e = np.flatnonzero(checked & (fill_len >= threshold))
    out = np.zeros(n, dtype=bool)
    if e.size > 1:  # one eligible row is its group's first: no ids needed
        out[e] = True
        g = group(e) if callable(group) else group[e]
        o = np.argsort(g, kind="stable")  # each group's rows in queue order
        gs = g[o]
        first = np.ones(e.size, dtype=bool)
        first[1:] = gs[1:] != gs[:-1]
        out[e[o[first]]] = False  # each group's first stays
    return out


# ---- R-ORD-9 in-batch deprioritization -----------------------------------------------------------
_WEIGHTS: dict = {}  # (T, device) -> head_hashes' weight table, made once
_WEIGHTS_HOST: dict = {}  # T -> head_hashes_host's int64 weight table


def _hash_weights(T: int, dev: torch.device) -> torch.Tensor:
    """float64 [T, 2]: W[t, j] = base_j^t mod p (entries < 2^31), by square-and-multiply on the
    device (no host-to-device copy, so a graph capture may make it). Kept per (T, device)
    after the first call: some 50 small kernels fewer in every later one (a recorded step
    makes it in its warm-up runs); made afresh while torch.compile traces."""
    key = (T, str(dev))
    keep = not torch.compiler.is_compiling() and dev.type != "meta"
    if keep and key in _WEIGHTS:
        return _WEIGHTS[key]
    pos = torch.arange(T, device=dev)
    cols = []
    for base in _HASH_BASES:
        w = torch.ones(T, dtype=torch.int64, device=dev)
        b = base
        for bit in range(max(T - 1, 0).bit_length()):
            w = torch.where((pos >> bit) & 1 == 1, w * b % _HASH_MOD, w)
            b = b * b % _HASH_MOD
        cols.append(w)
    W = torch.stack(cols, dim=1).to(torch.float64)
    if keep:
        _WEIGHTS[key] = W
    return W


def head_hashes(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 [n]: a 62-bit hash of each row's first T tokens (T = tokens.shape[1]).

    tokens int32 [n, T], ids in [0, 2^31-1] (row i: the first min(len_i, T) fill tokens,
    then any padding);
    lengths int [n]. Positions at or past `lengths[i]` do not count, so padding never matters.
    Each token is two characters, its 16-bit limbs: a_t = (token_t & 0xFFFF) + 1 and
    b_t = token_t >> 16 (both 0 for a position past the length), so distinct tokens are
    distinct character pairs (token + 1 itself would not be: 2^31 = 1 mod p makes ids 0 and
    2^31 - 1 equal). With p = 2^31 - 1: `h_k = sum_t (a_t * B_k^(2t) + b_t * B_k^(2t+1)) mod p`
    for the two bases B_k, and the hash is `h_1 * 2^31 + h_2`. A row's hash does not depend on
    T beyond its length (the weights of a position are the same at any width). Equal prefixes
    give equal hashes; two different ones collide with probability about (2T/2^31)^2 over
    random bases (`_HASH_BASES` are fixed: see there).
    """
    where = "head_hashes"
    check_tensor(where, "tokens", tokens, INT_DTYPES, ndim=2, contiguous=False)
    n, T = tokens.shape
    check_tensor(where, "lengths", lengths, INT_DTYPES, numel=n, device=tokens.device, contiguous=False)
    dev = tokens.device
    M = _HASH_MOD
    pos = torch.arange(T, device=dev)
    W = _hash_weights(2 * T, dev)
    Wa, Wb = W[0::2], W[1::2]  # the low and high limbs' weights, B^(2t) and B^(2t+1)
    # a limb (<= 2^16) times a weight (< 2^31) is < 2^47, so a float64 matmul over up to 64
    # positions sums integers below 2^53: exact in any summation order; then reduce mod p in int64
    acc = torch.zeros((n, len(_HASH_BASES)), dtype=torch.int64, device=dev)
    for c in range(0, T, 64):  # chunks of 64 positions bound the float64 sums and the memory
        tok = tokens[:, c:c + 64]
        live = pos[None, c:c + 64] < lengths.to(torch.int64)[:, None]
        s_lo = (torch.where(live, (tok & 0xFFFF) + 1, 0).to(torch.float64) @ Wa[c:c + 64]).to(torch.int64) % M
        s_hi = (torch.where(live, tok >> 16, 0).to(torch.float64) @ Wb[c:c + 64]).to(torch.int64) % M
        acc = (acc + s_lo + s_hi) % M
    return acc[:, 0] * 2**31 + acc[:, 1]


def head_hashes_pool(tok: torch.Tensor, toff: torch.Tensor, fill: torch.Tensor, T: int,
                     *, backend: str = "torch") -> torch.Tensor:
    """`head_hashes` of each request's first T fill tokens, read from a token pool (R-ORD-9):
    request i's fill starts at tok[toff[i]] (positions clamped into the pool; an empty pool
    reads token 0) and min(fill[i], T) of them count. tok int32 [K]; toff, fill int64 [n];
    T >= 1. backend "triton": one launch (`kernels.sort_keys.head_hashes_pool`); else a
    gather of the [n, T] heads and `head_hashes`. int64 [n]."""
    dev = toff.device
    if backend == "triton":
        from .kernels.sort_keys import head_hashes_pool as kernel

        return kernel(tok.contiguous(), toff.contiguous(), fill.contiguous(), _hash_weights(2 * T, dev), _HASH_MOD)
    cols = (toff[:, None] + torch.arange(T, device=dev)).clamp(0, max(tok.numel() - 1, 0))
    heads = tok[cols] if tok.numel() else torch.zeros((toff.numel(), T), dtype=torch.int32, device=dev)
    return head_hashes(heads, torch.minimum(fill, torch.full_like(fill, T)))


def head_hashes_host(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`head_hashes` on numpy arrays (the host paths: a new request's group id in its first
    step, without ~20 small torch ops): tokens int [n, T] (ids in [0, 2^31-1]), lengths int
    [n]; int64 [n], the same values. Each term x_t * w_t (< 2^62) is reduced before the sum
    over T positions, so the sums are exact in int64 for any T < 2^32."""
    n, T = tokens.shape
    if T == 0:
        return np.zeros(n, dtype=np.int64)
    M = _HASH_MOD
    w = _WEIGHTS_HOST.get(T)
    if w is None:  # [2T, 2], < 2^31: rows 2t and 2t+1 weigh position t's low and high limbs
        w = _WEIGHTS_HOST[T] = _hash_weights(2 * T, torch.device("cpu")).numpy().astype(np.int64)
    live = np.arange(T)[None, :] < np.asarray(lengths, dtype=np.int64)[:, None]
    t = tokens.astype(np.int64)
    a = np.where(live, (t & 0xFFFF) + 1, 0)
    b = np.where(live, t >> 16, 0)
    acc = ((a[:, :, None] * w[None, 0::2] % M).sum(axis=1) + (b[:, :, None] * w[None, 1::2] % M).sum(axis=1)) % M
    return acc[:, 0] * 2**31 + acc[:, 1]


def in_batch_deprioritize(prefix_len: torch.Tensor, fill_len: torch.Tensor, namespace_id: torch.Tensor,
                          head_hash: torch.Tensor, check_threshold: int, threshold: int,
                          *, valid: Optional[torch.Tensor] = None, backend: str = "torch",
                          block: Optional[int] = None) -> torch.Tensor:
    """R-ORD-9 closed form, bool [n] in queue order.

    Checked: `prefix_len <= check_threshold` (nobody when check_threshold == -1). Among
    checked requests with `fill_len >= T` grouped by (namespace, first T tokens), the first in
    queue order keeps its place and every later one is deprioritized; T == 0 deprioritizes
    every checked request, the first included (SGLang's check: a match of 0 tokens in the
    empty scratch tree already reaches T; SPEC R-ORD-9's closed form, which keeps the first,
    does not cover T == 0; the reference does the same).

    Args:
        prefix_len, fill_len: int [n] (match length from R-ORD-8, len(fill)).
        namespace_id: int [n] interned namespace (extra_key) ids; INT64_MIN is reserved.
        head_hash: int64 [n], a hash of the first T fill tokens (`head_hashes`); only read
            where fill_len >= T.
        check_threshold: >= -1; threshold T >= 0 (host ints, from the config).
        valid: bool [n] or None: rows where it is False take no part (not checked: never
            deprioritized, never a group's first), as a recorded step's padding.
    On backend "triton" with T >= 1 the groups are found in a device hash table
    (`kernels.sort_keys.deprio_by_hash`: three launches, no sort).

    Raises:
        ValueError: check_threshold < -1 or threshold < 0 (or not ints); TypeError/ValueError
            from the tensor checks (dtype, length, device).
    """
    where = "in_batch_deprioritize"
    check_tensor(where, "prefix_len", prefix_len, INT_DTYPES, contiguous=False)
    n, dev = prefix_len.numel(), prefix_len.device
    check_tensor(where, "fill_len", fill_len, INT_DTYPES, numel=n, device=dev, contiguous=False)
    check_tensor(where, "namespace_id", namespace_id, INT_DTYPES, numel=n, device=dev, contiguous=False)
    check_tensor(where, "head_hash", head_hash, (torch.int64,), numel=n, device=dev, contiguous=False)
    for name, v, lo in (("check_threshold", check_threshold, -1), ("threshold", threshold, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= INT64_MAX:
            raise ValueError(f"{where}: {name} must be an int in [{lo}, 2^63-1], got {v!r}")
    if valid is not None:
        check_tensor(where, "valid", valid, (torch.bool,), numel=n, device=dev, contiguous=False)
    k = _kernels(backend, "sort_keys")
    if check_threshold == -1:  # nobody is checked (host-known: no sort needed)
        return torch.zeros(n, dtype=torch.bool, device=dev)
    if k is not None and threshold > 0:
        return k.deprio_by_hash(_contig(prefix_len), _contig(fill_len), _contig(namespace_id),
                                _contig(head_hash), check_threshold, threshold,
                                valid=None if valid is None else _contig(valid), block=block)
    pre = prefix_len.to(torch.int64)  # T == 0 (every checked request) and the torch form
    checked = (pre <= check_threshold) & (check_threshold != -1)
    if valid is not None:
        checked = checked & valid
    if threshold == 0:
        return checked
    eligible = checked & (fill_len.to(torch.int64) >= threshold)
    a = torch.where(eligible, namespace_id.to(torch.int64), INT64_MIN)
    perm = _lex_perm(a, head_hash)
    a_s, h_s = gather(a, perm), gather(head_hash.to(torch.int64), perm)
    later = torch.zeros(n, dtype=torch.bool, device=dev)
    later[1:] = (a_s[1:] == a_s[:-1]) & (h_s[1:] == h_s[:-1])
    later &= a_s != INT64_MIN
    return torch.empty_like(later).scatter_(0, perm, later)


def in_batch_deprioritize_groups(prefix_len: torch.Tensor, fill_len: torch.Tensor, group: torch.Tensor,
                                 num_groups: int, check_threshold: int, threshold: int,
                                 *, backend: str = "torch", block: Optional[int] = None) -> torch.Tensor:
    """R-ORD-9 as `in_batch_deprioritize`, bool [n] in queue order, with each request's
    (namespace, first T fill tokens) given as an interned group id instead of (namespace id,
    head hash): the first eligible request of each group is found by a scatter-min of queue
    indices (an `atomic_min` kernel on backend "triton"), no sort. On CPU tensors
    (`_host`) by `deprioritize_groups_host`: a stable argsort of the eligible rows' ids only
    (with a warm cache few have a match within check_threshold). T == 0 deprioritizes every
    checked request, as `in_batch_deprioritize` says.

    Args:
        prefix_len, fill_len: int [n] (match length from R-ORD-8, len(fill)).
        group: int [n], equal ids iff equal (namespace, first T tokens) among requests with
            fill_len >= T; ids lie in [0, num_groups) (a precondition, not checked on the
            device: checking would read back to the host). Only read where fill_len >= T.
        num_groups: host int >= 0, the size of the id space (a table of that many slots).
        check_threshold: >= -1; threshold T >= 0 (host ints, from the config).
    Raises:
        ValueError: a threshold or num_groups out of range; TypeError/ValueError from the
            tensor checks (dtype, length, device).
    """
    where = "in_batch_deprioritize_groups"
    check_tensor(where, "prefix_len", prefix_len, INT_DTYPES, contiguous=False)
    n, dev = prefix_len.numel(), prefix_len.device
    check_tensor(where, "fill_len", fill_len, INT_DTYPES, numel=n, device=dev, contiguous=False)
    check_tensor(where, "group", group, INT_DTYPES, numel=n, device=dev, contiguous=False)
    for name, v, lo in (("check_threshold", check_threshold, -1), ("threshold", threshold, 0),
                        ("num_groups", num_groups, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= INT64_MAX:
            raise ValueError(f"{where}: {name} must be an int in [{lo}, 2^63-1], got {v!r}")
    if check_threshold == -1:  # nobody is checked
        return torch.zeros(n, dtype=torch.bool, device=dev)
    checked = prefix_len <= check_threshold
    if threshold == 0:
        return checked
    k = _kernels(backend, "sort_keys")
    if k is not None:
        return k.deprio_by_group(_contig(prefix_len), _contig(fill_len), _contig(group), num_groups,
                                 check_threshold, threshold, block=block)
    if _host(prefix_len):  # numpy: the first occurrences among the (few) eligible rows
        return torch.from_numpy(deprioritize_groups_host(prefix_len.numpy(), fill_len.numpy(), group.numpy(),
                                                         check_threshold, threshold))
    eligible = checked & (fill_len >= threshold)
    idx = torch.arange(n, device=dev)
    g = torch.where(eligible, group.to(torch.int64), 0)  # ids are read only where eligible
    first = torch.full((max(num_groups, 1),), n, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, g, torch.where(eligible, idx, n), reduce="amin")
    return eligible & (gather(first, g) < idx)


# ---- R-ORD-10 dfs-weight ----------------------------------------------------------------------------
def _sibling_offsets(parent: torch.Tensor, weight: torch.Tensor, skey: torch.Tensor,
                     child_rank: Optional[torch.Tensor]) -> torch.Tensor:
    """Per node, the summed weight of the siblings ordered before it (heavier first, ties by
    child_rank): a stable sort into sibling runs and a segmented exclusive prefix sum."""
    N = parent.numel()
    order = _stable_perm(skey) if child_rank is None else _lex_perm(skey, child_rank.to(torch.int64))
    w_s = gather(weight, order)
    p_s = gather(parent.to(torch.int64), order)
    excl = torch.cumsum(w_s, 0) - w_s
    idx = torch.arange(N, device=parent.device)
    first = torch.ones(N, dtype=torch.bool, device=parent.device)
    first[1:] = p_s[1:] != p_s[:-1]
    seg0 = torch.cummax(torch.where(first, idx, 0), 0).values
    off_s = excl - gather(excl, seg0)
    return torch.empty_like(off_s).scatter_(0, order, off_s)


def child_order_ranks(parent: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Each node's rank among its siblings by child order, dfs-weight's `child_rank` (R-ORD-10):
    parent int [N] (-1: root or detached), order int [N] (a node's place in its parent's child
    order, ascending). Two stable sorts (order, then parent) and a segmented rank; static
    shapes. int64 [N]."""
    N = parent.numel()
    dev = parent.device
    idx = torch.sort(order, stable=True).indices
    idx = idx[torch.sort(parent[idx], stable=True).indices]  # by parent, then child order
    ps = parent[idx]
    first = torch.ones(N, dtype=torch.bool, device=dev)
    first[1:] = ps[1:] != ps[:-1]
    ar = torch.arange(N, device=dev)
    return torch.empty_like(ar).scatter_(0, idx, ar - torch.cummax(torch.where(first, ar, 0), 0).values)


def dfs_weight_perm_host(parent: np.ndarray, child_rank: np.ndarray, last_node: np.ndarray,
                         rounds: int, tiebreak: Optional[np.ndarray] = None,
                         rank_bound: Optional[int] = None, in_range: bool = False) -> np.ndarray:
    """`dfs_weight_order`'s torch form on numpy arrays (parent, child_rank int [N >= 1],
    last_node int [n]; arguments checked by the caller, parent values in [-1, N)), step for step: subtree weights by
    `rounds` pointer-jumping rounds, sibling offsets by one stable sort and a segmented
    prefix sum, starts by `rounds` more rounds, then the stable order of the request bases
    (and `tiebreak`, when given). A round after every pointer has reached the root changes
    nothing, so the rounds stop there (about log2 of the tree depth rounds instead of log2 N).
    `rank_bound`: child_rank's values are below it (default N); any sibling sort key that
    orders siblings as their ranks do gives the same permutation (ties: by node index), e.g.
    a tree's creation-order stamps (`GpuScheduler._dfs_weight_perm_host`). `in_range`: the
    caller knows every last_node is in [0, N) (a tree's own ids), so they are not clamped.
    int64 permutation [n]."""
    N, n = parent.size, last_node.size
    p64 = parent.astype(np.int64, copy=False)
    ln = last_node.astype(np.int64, copy=False)
    if not in_range:  # -1 (no match) and ids outside the tree count at the root
        ln = np.where((ln >= 0) & (ln < N), ln, 0)
    own = np.bincount(ln, minlength=N).astype(np.int64, copy=False)
    # the pointer-jumping rounds on N + 1 slots: a parentless node points at slot N, which
    # points at itself and collects (and passes on) only what no node reads; a round is a
    # few calls without masks (a cold numpy call costs 5-9 us: benchmarks/bench_cold.py)
    anc0 = np.append(np.where(p64 < 0, N, p64), N)
    s = np.zeros(N + 1, dtype=np.float64)  # counts below 2^53 (n requests): exact as float64
    s[:N] = own
    anc = anc0
    for _ in range(rounds):
        if anc.min() == N:  # every pointer at the top: a further round changes nothing
            break
        s = s + np.bincount(anc, weights=s, minlength=N + 1)
        anc = anc.take(anc)
    weight = s[:N].astype(np.int64)
    skey = (p64 + 1) * (n + 1) + (n - weight)
    rank64 = child_rank.astype(np.int64, copy=False)
    # by (skey, child_rank): one packed key when it fits int64, else the two keys
    R = N if rank_bound is None else int(rank_bound)
    pack_rank = (N + 1) * (n + 1) * R <= INT64_MAX
    order = host_perm(skey * R + rank64) if pack_rank else host_lex_perm(skey, rank64)
    if order is None:  # the key and the row index do not fit one packed sort
        order = np.lexsort((rank64, skey))
    # per node the weight of the siblings sorted before it (a segmented exclusive prefix sum)
    w_s, p_s = weight[order], p64[order]
    excl = np.cumsum(w_s) - w_s
    first = np.ones(N, dtype=bool)
    first[1:] = p_s[1:] != p_s[:-1]
    seg0 = np.maximum.accumulate(np.where(first, np.arange(N), 0))
    off = np.empty(N, dtype=np.int64)
    off[order] = excl - excl[seg0]
    t = np.zeros(N + 1, dtype=np.int64)  # slot N stays 0: it adds nothing to whoever points at it
    t[:N] = off
    anc = anc0
    for _ in range(rounds):
        if anc.min() == N:
            break
        t = t + t.take(anc)
        anc = anc.take(anc)
    base = (t[:N] + weight - own)[ln]
    if tiebreak is not None:
        tb = tiebreak.astype(np.int64, copy=False)
        perm = host_lex_perm(base, tb)
        return perm if perm is not None else np.lexsort((tb, base))
    perm = host_perm(base)
    return perm if perm is not None else np.argsort(base, kind="stable")


def dfs_weight_order(parent: torch.Tensor, child_rank: torch.Tensor, depth: Optional[torch.Tensor],
                     last_node: torch.Tensor, *, max_depth: Optional[int] = None, backend: str = "torch",
                     block: Optional[int] = None, tiebreak: Optional[torch.Tensor] = None,
                     rank_bound: Optional[int] = None, tiebreak_bound: Optional[int] = None) -> torch.Tensor:
    """R-ORD-10: depth-first from the root, heavier children first (ties: child order), each
    node's own requests (queue order) after its descendants'. No recursion, no per-node loop.

    Args:
        parent: int [N], parent node index; -1 for the root, which is node 0. Other nodes with
            parent -1 count as detached and must carry no requests.
        child_rank: int [N], position of each node in its parent's child order, in
            [0, rank_bound). Any key that orders each node's siblings as their child order
            does (ties: node index) gives the same permutation, e.g. the tree's creation-order
            stamps (`StepGraph._dfs_weight_perm`), with no ranking pass.
        depth: int [N] or None; only its shape is checked (the passes do not need it; kept so
            callers holding a device tree pass what they have).
        last_node: int [n], each waiting request's last matched node; -1 (no match) is the root.
        max_depth: optional host bound on the tree depth: the passes take
            `max_depth.bit_length()` rounds instead of `(N - 1).bit_length()`. A bound below the
            true depth gives a wrong order (it is not checked: checking would sync).
        tiebreak: optional int [n]: the requests of one node go in ascending tiebreak, ties in
            queue order (by default queue order alone). The recorded step orders a match that
            ends inside a node without splitting it (`StepGraph`): a split would make a chain
            of single-child nodes above the node's rest, each emitted after the one below, so
            such a match counts at the node itself and goes after the node's own requests,
            deeper covers first (tiebreak 0 for whole covers, `C - cover` for partial ones,
            C above every cover: the step passes `max_len + 1`).
        rank_bound: child_rank's values are below it (default N). The siblings' sort packs
            (parent, weight, child_rank) into one int64 key when `(N + 1) * (n + 1) *
            rank_bound` fits, else sorts by two keys.
        tiebreak_bound: optional, with `tiebreak`: its values are in [0, tiebreak_bound) (not
            checked: that would read them). The requests are then ordered by one packed key
            `base * tiebreak_bound + tiebreak` (one sort instead of two) when `(n + 1) *
            tiebreak_bound` fits int64.
    Returns: int64 permutation [n].

    weight = own requests in the subtree; start(v) = start(parent) + weights of the siblings
    before v; v's own requests go to start(v) + weight(v) - own(v) onwards (post-order).
    """
    where = "dfs_weight_order"
    check_tensor(where, "parent", parent, INT_DTYPES, contiguous=False)
    N, dev = parent.numel(), parent.device
    if N < 1:
        raise ValueError(f"{where}: the tree needs at least the root (node 0), got N = 0")
    check_tensor(where, "child_rank", child_rank, INT_DTYPES, numel=N, device=dev, contiguous=False)
    if depth is not None:
        check_tensor(where, "depth", depth, INT_DTYPES, numel=N, device=dev, contiguous=False)
    check_tensor(where, "last_node", last_node, INT_DTYPES, device=dev, contiguous=False)
    n = last_node.numel()
    if tiebreak is not None:
        check_tensor(where, "tiebreak", tiebreak, INT_DTYPES, numel=n, device=dev, contiguous=False)
    if max_depth is None:
        rounds = (N - 1).bit_length()
    elif isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"{where}: max_depth must be an int >= 0, got {max_depth!r}")
    else:
        rounds = max_depth.bit_length()
    if tiebreak_bound is not None:
        if isinstance(tiebreak_bound, bool) or not isinstance(tiebreak_bound, int) or tiebreak_bound < 1:
            raise ValueError(f"{where}: tiebreak_bound must be an int >= 1, got {tiebreak_bound!r}")
        if tiebreak is None:
            raise ValueError(f"{where}: tiebreak_bound needs a tiebreak")
    pack_tb = tiebreak_bound is not None and (n + 1) * tiebreak_bound <= INT64_MAX
    if rank_bound is None:
        rank_bound = N
    elif isinstance(rank_bound, bool) or not isinstance(rank_bound, int) or rank_bound < 1:
        raise ValueError(f"{where}: rank_bound must be an int >= 1, got {rank_bound!r}")
    k = _kernels(backend, "dfs_weight")
    if k is None and _host(parent):
        pn = parent.numpy()
        if int(pn.max()) >= N:  # a host read: there is no device to sync with
            raise ValueError(f"{where}: parent values must be node indices below N = {N} (-1: none), "
                             f"got {int(pn.max())}")
        return torch.from_numpy(dfs_weight_perm_host(pn, child_rank.numpy(), last_node.numpy(), rounds,
                                                     None if tiebreak is None else tiebreak.numpy(),
                                                     rank_bound=rank_bound))
    # one packed sibling key (parent, -weight, child_rank) when it fits int64, else two sorts;
    # the packing multiplies by N (the kernel's form), which holds every rank below N
    pack_rank = rank_bound <= N and (N + 1) * (n + 1) * N <= INT64_MAX
    p64 = parent.to(torch.int64)
    if k is None:
        ln = last_node.to(torch.int64)
        ln = torch.where((ln >= 0) & (ln < N), ln, 0)
        own = torch.zeros(N, dtype=torch.int64, device=dev).scatter_add_(0, ln, torch.ones_like(ln))
        s, anc = own, p64
        for _ in range(rounds):
            up = anc >= 0
            a = torch.where(up, anc, N)
            s = torch.cat([s, s.new_zeros(1)]).scatter_add_(0, a, s)[:N]
            anc = torch.where(up, gather(anc, a.clamp(max=N - 1)), -1)
        weight = s
        skey = (p64 + 1) * (n + 1) + (n - weight)
        if pack_rank:
            skey = skey * N + child_rank.to(torch.int64)
        off = _sibling_offsets(parent, weight, skey, None if pack_rank else child_rank)
        t, anc = off, p64
        for _ in range(rounds):
            up = anc >= 0
            a = anc.clamp(min=0)
            t = t + torch.where(up, gather(t, a), 0)
            anc = torch.where(up, gather(anc, a), -1)
        base = gather(t + weight - own, ln)
        if pack_tb:  # bases are below n + 1
            return _stable_perm(base * tiebreak_bound + tiebreak.to(torch.int64))
    else:
        ln = _contig(last_node)
        own, weight = k.subtree_weights(ln, _contig(p64), rounds, block=block)
        skey = k.sibling_keys(_contig(parent), _contig(child_rank), weight, n, pack_rank=pack_rank, block=block)
        order = _stable_perm(skey) if pack_rank else _lex_perm(skey, child_rank.to(torch.int64))
        off = k.sibling_offsets(_contig(order), _contig(p64), weight, block=block)
        t, anc = off, _contig(p64)
        for _ in range(rounds):
            t, anc = k.start_round(t, anc, block=block)
        if pack_tb:
            return _stable_perm(k.request_bases(ln, t, weight, own, tiebreak=_contig(tiebreak),
                                                tiebreak_bound=tiebreak_bound, block=block))
        base = k.request_bases(ln, t, weight, own, block=block)
    return _stable_perm(base) if tiebreak is None else _lex_perm(base, tiebreak.to(torch.int64))
