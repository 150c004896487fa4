"""Sort-key kernels of the ordering policies (SPEC.md section 3) and the first-occurrence flags
of in-batch deprioritization (R-ORD-9).

Every key is an int64 whose ascending order is the policy's order, so one stable
`torch.sort` per key column orders the queue (the sort itself is torch's, not here):

- fcfs (R-ORD-4): `pk = priority` (sign +1) or `~priority` (sign -1), `tk` = the enqueue time
  as order-preserving int64 bits (for float64; ints are their own key). Bitwise-not reverses
  the order of every int64 without overflow, so an absent priority (-2^63 / 2^63-1) is safe.
- lof (R-ORD-5): `mk = ~max_new_tokens` (same order as `-max_new_tokens`), plus `pk`.
- routing-key (R-ORD-7): one packed key `g * 2^32 + (rank + 2^31)` with `g = m - count` for a
  request whose key is counted in the running batch (count >= 1) and `g = m` otherwise, where m
  is the number of running keys: that is the order of `(0, -count, rank)` / `(1, 0, rank)`.
- lpm (R-ORD-8): `INT64_MAX` when deprioritized, else `~matched`.
- R-ORD-9 grouping: an eligible request (checked and fill >= T) is deprioritized when an
  earlier eligible one has the same (namespace, head hash) (the torch form: a stable sort by
  (`a`, hash), `a = namespace` for an eligible request else `INT64_MIN`, and a compare
  with each sorted predecessor). No kernel sorts:
  `deprio_by_hash` finds the groups in a device hash table (`atomic_cas` claims) and the
  first queue index per group by `atomic_min`; with the (namespace, head) pairs interned as
  group ids, `deprio_by_group` needs no table either.

The torch backend in `gpu_sched.policy` computes the same keys with torch ops; tests hold the
two equal. Each kernel is private; its launcher checks dtypes, shapes, contiguity and device.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._utils import block_config, check_int, check_launch_device, check_tensor, grid_1d

INT_DTYPES = (torch.int32, torch.int64)
HASH_BLOCK = 128  # head_hashes_pool's default block: one request per lane
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: loop tests through `tl.reduce` with Triton's own combine function (as kernels/radix.py)
_MAX = tl.standard._elementwise_max


# ---- fcfs / lof ------------------------------------------------------------------------------
@triton.jit
def _order_bits(t, IS_FLOAT: tl.constexpr):
    """An int64 with the order of `t` (float64: -0.0 counts as +0.0, like Python's ==)."""
    if IS_FLOAT:
        t = tl.where(t == 0.0, 0.0, t)
        b = t.to(tl.int64, bitcast=True)
        return tl.where(b < 0, b ^ 0x7FFFFFFFFFFFFFFF, b)
    else:
        return t.to(tl.int64)


@triton.jit
def _fcfs_keys_kernel(prio_ptr, time_ptr, pk_ptr, tk_ptr, n,
                      NEGATE: tl.constexpr, TIME_IS_FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(prio_ptr + offs, mask=mask, other=0).to(tl.int64)
    if NEGATE:
        p = ~p
    t = tl.load(time_ptr + offs, mask=mask, other=0)
    tl.store(pk_ptr + offs, p, mask=mask)
    tl.store(tk_ptr + offs, _order_bits(t, TIME_IS_FLOAT), mask=mask)


def fcfs_keys(priority: torch.Tensor, enqueue_time: torch.Tensor, sign: int,
              *, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(pk, tk) int64 [n]: the R-ORD-4 key `(priority*sign, enqueue_time)` as two columns.

    priority int32/int64 [n]; enqueue_time float64/int32/int64 [n] (no NaN); sign +1 or -1.
    """
    where = "fcfs_keys"
    check_tensor(where, "priority", priority, INT_DTYPES)
    dev = check_launch_device(where, _fcfs_keys_kernel, priority)
    n = priority.numel()
    check_tensor(where, "enqueue_time", enqueue_time, (torch.float64,) + INT_DTYPES, numel=n, device=dev)
    if sign not in (1, -1) or isinstance(sign, bool):
        raise ValueError(f"{where}: sign must be +1 or -1, got {sign!r}")
    BLOCK, warps = block_config(block)
    pk = torch.empty(n, dtype=torch.int64, device=dev)
    tk = torch.empty(n, dtype=torch.int64, device=dev)
    _fcfs_keys_kernel[grid_1d(n, BLOCK)](
        priority, enqueue_time, pk, tk, n,
        NEGATE=sign < 0, TIME_IS_FLOAT=enqueue_time.dtype == torch.float64, BLOCK=BLOCK, num_warps=warps)
    return pk, tk


@triton.jit
def _lof_keys_kernel(max_new_ptr, prio_ptr, mk_ptr, pk_ptr, n,
                     HAS_PRIORITY: tl.constexpr, NEGATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    m = tl.load(max_new_ptr + offs, mask=mask, other=0).to(tl.int64)
    tl.store(mk_ptr + offs, ~m, mask=mask)
    if HAS_PRIORITY:
        p = tl.load(prio_ptr + offs, mask=mask, other=0).to(tl.int64)
        if NEGATE:
            p = ~p
        tl.store(pk_ptr + offs, p, mask=mask)


def lof_keys(max_new_tokens: torch.Tensor, priority: Optional[torch.Tensor] = None, sign: int = -1,
             *, block: Optional[int] = None) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(pk or None, mk) int64 [n]: the R-ORD-5 key `(priority*sign, -max_new_tokens)`."""
    where = "lof_keys"
    check_tensor(where, "max_new_tokens", max_new_tokens, INT_DTYPES)
    dev = check_launch_device(where, _lof_keys_kernel, max_new_tokens)
    n = max_new_tokens.numel()
    if priority is not None:
        check_tensor(where, "priority", priority, INT_DTYPES, numel=n, device=dev)
    if sign not in (1, -1) or isinstance(sign, bool):
        raise ValueError(f"{where}: sign must be +1 or -1, got {sign!r}")
    BLOCK, warps = block_config(block)
    mk = torch.empty(n, dtype=torch.int64, device=dev)
    pk = torch.empty(n, dtype=torch.int64, device=dev) if priority is not None else None
    _lof_keys_kernel[grid_1d(n, BLOCK)](
        max_new_tokens, priority if priority is not None else mk, mk, pk if pk is not None else mk, n,
        HAS_PRIORITY=priority is not None, NEGATE=sign < 0, BLOCK=BLOCK, num_warps=warps)
    return pk, mk


# ---- routing-key ------------------------------------------------------------------------------
@triton.jit
def _routing_count_kernel(ids_ptr, counts_ptr, m, num_ids, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < m
    k = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int64)
    valid = (k >= 0) & (k < num_ids)
    slot = tl.where(valid, k, num_ids)
    tl.atomic_add(counts_ptr + slot, tl.full([BLOCK], 1, tl.int64), mask=mask)


def routing_counts(running_key_ids: torch.Tensor, num_ids: int, *, block: Optional[int] = None) -> torch.Tensor:
    """Histogram int64 [num_ids + 1] of the running batch's key ids; the last slot gathers
    absent ids (-1) and ids outside [0, num_ids)."""
    where = "routing_counts"
    check_tensor(where, "running_key_ids", running_key_ids, INT_DTYPES)
    dev = check_launch_device(where, _routing_count_kernel, running_key_ids)
    check_int(where, "num_ids", num_ids, lo=0, hi=2**31 - 1)
    m = running_key_ids.numel()
    BLOCK, warps = block_config(block)
    counts = torch.zeros(num_ids + 1, dtype=torch.int64, device=dev)
    if m:
        _routing_count_kernel[grid_1d(m, BLOCK)](running_key_ids, counts, m, num_ids, BLOCK=BLOCK, num_warps=warps)
    return counts


@triton.jit
def _routing_keys_kernel(key_id_ptr, key_rank_ptr, counts_ptr, out_ptr, n, num_ids, m, empty_rank,
                         BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    k = tl.load(key_id_ptr + offs, mask=mask, other=-1).to(tl.int64)
    valid = mask & (k >= 0) & (k < num_ids)
    c = tl.load(counts_ptr + k, mask=valid, other=0)
    rank = tl.load(key_rank_ptr + k, mask=valid, other=0).to(tl.int64)
    rank = tl.where(valid, rank, empty_rank)
    g = tl.where(c > 0, m - c, m)
    tl.store(out_ptr + offs, g * 4294967296 + (rank + 2147483648), mask=mask)


def routing_keys(key_id: torch.Tensor, key_rank: torch.Tensor, counts: torch.Tensor, num_running: int,
                 empty_rank: int, *, block: Optional[int] = None) -> torch.Tensor:
    """Packed R-ORD-7 keys int64 [n] from the waiting key ids, the rank of each id, the running
    histogram (`routing_counts`) and the number of running requests m (so `count <= m`)."""
    where = "routing_keys"
    check_tensor(where, "key_id", key_id, INT_DTYPES)
    dev = check_launch_device(where, _routing_keys_kernel, key_id)
    check_tensor(where, "key_rank", key_rank, INT_DTYPES, device=dev)
    num_ids = key_rank.numel()
    check_tensor(where, "counts", counts, (torch.int64,), numel=num_ids + 1, device=dev)
    check_int(where, "num_running", num_running, lo=0, hi=2**30)
    check_int(where, "empty_rank", empty_rank, lo=-(2**31), hi=2**31 - 1)
    n = key_id.numel()
    BLOCK, warps = block_config(block)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    _routing_keys_kernel[grid_1d(n, BLOCK)](
        key_id, key_rank if num_ids else counts, counts, out, n, num_ids, num_running, empty_rank,
        BLOCK=BLOCK, num_warps=warps)
    return out


# ---- lpm ------------------------------------------------------------------------------------
@triton.jit
def _lpm_keys_kernel(matched_ptr, deprio_ptr, cap_ptr, valid_ptr, out_ptr, n, HAS_CAP: tl.constexpr,
                     HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(matched_ptr + offs, mask=mask, other=0).to(tl.int64)
    if HAS_CAP:
        x = tl.minimum(x, tl.load(cap_ptr + offs, mask=mask, other=0).to(tl.int64))
    d = tl.load(deprio_ptr + offs, mask=mask, other=0) != 0
    if HAS_VALID:
        d = d | (tl.load(valid_ptr + offs, mask=mask, other=0) == 0)
    tl.store(out_ptr + offs, tl.where(d, 0x7FFFFFFFFFFFFFFF, ~x), mask=mask)


def lpm_keys(matched: torch.Tensor, deprioritized: torch.Tensor, *, cap: Optional[torch.Tensor] = None,
             valid: Optional[torch.Tensor] = None, block: Optional[int] = None) -> torch.Tensor:
    """R-ORD-8 keys int64 [n]: INT64_MAX for a deprioritized request (or, when `valid` bool [n]
    is given, one that is not valid), else `~min(matched, cap)` (`cap` int [n], optional)."""
    where = "lpm_keys"
    check_tensor(where, "matched", matched, INT_DTYPES)
    dev = check_launch_device(where, _lpm_keys_kernel, matched)
    n = matched.numel()
    check_tensor(where, "deprioritized", deprioritized, (torch.bool,), numel=n, device=dev)
    if cap is not None:
        check_tensor(where, "cap", cap, INT_DTYPES, numel=n, device=dev)
    if valid is not None:
        check_tensor(where, "valid", valid, (torch.bool,), numel=n, device=dev)
    BLOCK, warps = block_config(block)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    d8 = deprioritized.view(torch.uint8)
    _lpm_keys_kernel[grid_1d(n, BLOCK)](matched, d8, matched if cap is None else cap,
                                        d8 if valid is None else valid.view(torch.uint8), out, n,
                                        HAS_CAP=cap is not None, HAS_VALID=valid is not None,
                                        BLOCK=BLOCK, num_warps=warps)
    return out


# ---- R-ORD-9 in-batch deprioritization ----------------------------------------------------------
def _check_deprio_args(where, kernel, prefix_len, fill_len, ids_name, ids, check_threshold, check_lo, threshold):
    """The R-ORD-9 launchers' common checks; returns (n, device)."""
    check_tensor(where, "prefix_len", prefix_len, INT_DTYPES)
    dev = check_launch_device(where, kernel, prefix_len)
    n = prefix_len.numel()
    check_tensor(where, "fill_len", fill_len, INT_DTYPES, numel=n, device=dev)
    check_tensor(where, ids_name, ids, INT_DTYPES, numel=n, device=dev)
    check_int(where, "check_threshold", check_threshold, lo=check_lo, hi=INT64_MAX)
    check_int(where, "threshold", threshold, lo=0, hi=INT64_MAX)
    return n, dev


# ---- R-ORD-9 by group ids: first queue index per group, no sort ----------------------------------
@triton.jit
def _group_rows(prefix_ptr, fill_ptr, group_ptr, n, check_threshold, threshold, BLOCK: tl.constexpr):
    """This program's queue indices, their group ids and which are eligible."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    pre = tl.load(prefix_ptr + offs, mask=mask, other=0).to(tl.int64)
    fill = tl.load(fill_ptr + offs, mask=mask, other=0).to(tl.int64)
    g = tl.load(group_ptr + offs, mask=mask, other=0).to(tl.int64)
    return offs, mask, g, mask & (pre <= check_threshold) & (fill >= threshold)


@triton.jit
def _group_first_kernel(prefix_ptr, fill_ptr, group_ptr, first_ptr, n, check_threshold, threshold,
                        BLOCK: tl.constexpr):
    offs, mask, g, eligible = _group_rows(prefix_ptr, fill_ptr, group_ptr, n, check_threshold, threshold, BLOCK)
    tl.atomic_min(first_ptr + g, offs, mask=eligible)  # integer min: order-independent


@triton.jit
def _group_later_kernel(prefix_ptr, fill_ptr, group_ptr, first_ptr, out_ptr, n, check_threshold, threshold,
                        BLOCK: tl.constexpr):
    offs, mask, g, eligible = _group_rows(prefix_ptr, fill_ptr, group_ptr, n, check_threshold, threshold, BLOCK)
    first = tl.load(first_ptr + g, mask=eligible, other=0)
    tl.store(out_ptr + offs, (eligible & (first < offs)).to(tl.uint8), mask=mask)


def deprio_by_group(prefix_len: torch.Tensor, fill_len: torch.Tensor, group: torch.Tensor, num_groups: int,
                    check_threshold: int, threshold: int, *, block: Optional[int] = None) -> torch.Tensor:
    """bool [n] in queue order: eligible (prefix_len <= check_threshold, which is >= 0, and
    fill_len >= threshold) and not the first eligible request of its group (group ids int
    [n] in [0, num_groups), not checked: no host read). Two passes: an `atomic_min` of each
    eligible queue index into its group's slot (exact in any order), then a compare."""
    n, dev = _check_deprio_args("deprio_by_group", _group_first_kernel, prefix_len, fill_len, "group", group,
                                check_threshold, 0, threshold)
    check_int("deprio_by_group", "num_groups", num_groups, lo=0, hi=INT64_MAX)
    BLOCK, warps = block_config(block)
    first = torch.full((max(num_groups, 1),), n, dtype=torch.int64, device=dev)
    out = torch.empty(n, dtype=torch.bool, device=dev)
    args = (prefix_len, fill_len, group, first)
    _group_first_kernel[grid_1d(n, BLOCK)](*args, n, check_threshold, threshold, BLOCK=BLOCK, num_warps=warps)
    _group_later_kernel[grid_1d(n, BLOCK)](*args, out.view(torch.uint8), n, check_threshold, threshold,
                                           BLOCK=BLOCK, num_warps=warps)
    return out


# ---- R-ORD-9 by (namespace, head hash) in a hash table: no sort -----------------------------------
# The groups are found in an open-addressing table of 2^k >= 2n slots made for the call: each
# eligible request claims its probe sequence's first free slot by `atomic_cas` of its queue
# index, unless the slot's owner has the same (namespace, hash), read from the inputs (which no
# program writes, so the compare is race-free); owners never change once set, so every request
# of a group stops at the same slot whatever the programs' order. The first queue index per
# slot is then an `atomic_min`. Slot TS (one past the table) is a dummy that inactive lanes
# address with a compare value it never holds (`atomic_cas` takes no mask).
@triton.jit
def _dedup_init_kernel(owner_ptr, first_ptr, m, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < m
    tl.store(owner_ptr + offs, tl.full([BLOCK], -1, tl.int64), mask=mask)
    tl.store(first_ptr + offs, tl.full([BLOCK], 9223372036854775807, tl.int64), mask=mask)


@triton.jit
def _dedup_rows(prefix_ptr, fill_ptr, valid_ptr, n, check_threshold, threshold, HAS_VALID: tl.constexpr,
                BLOCK: tl.constexpr):
    """This program's queue indices, its lanes in range, and which are eligible (checked,
    fill >= T, and valid)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    pre = tl.load(prefix_ptr + offs, mask=mask, other=0).to(tl.int64)
    fill = tl.load(fill_ptr + offs, mask=mask, other=0).to(tl.int64)
    eligible = mask & (pre <= check_threshold) & (fill >= threshold)
    if HAS_VALID:
        eligible = eligible & (tl.load(valid_ptr + offs, mask=mask, other=0) != 0)
    return offs, mask, eligible


@triton.jit
def _dedup_insert_kernel(prefix_ptr, fill_ptr, valid_ptr, ns_ptr, hh_ptr, owner_ptr, first_ptr, slot_ptr, n, TS,
                         check_threshold, threshold, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask, eligible = _dedup_rows(prefix_ptr, fill_ptr, valid_ptr, n, check_threshold, threshold, HAS_VALID,
                                       BLOCK)
    a = tl.load(ns_ptr + offs, mask=mask, other=0).to(tl.int64)
    h = tl.load(hh_ptr + offs, mask=mask, other=0)
    s = ((((a * -7046029254386353131) ^ h) * -7046029254386353131) >> 32) & (TS - 1)
    slot = tl.full([BLOCK], -1, tl.int64)
    active = eligible
    while tl.reduce(active.to(tl.int32), 0, _MAX) > 0:
        cmp = tl.where(active, -1, -2).to(tl.int64)
        old = tl.atomic_cas(owner_ptr + tl.where(active, s, TS), cmp, offs)
        seen = active & (old >= 0)
        same = (seen & (tl.load(ns_ptr + old, mask=seen, other=0).to(tl.int64) == a)
                & (tl.load(hh_ptr + old, mask=seen, other=0) == h))
        stop = (active & (old == -1)) | same
        slot = tl.where(stop, s, slot)
        active = active & ~stop
        s = tl.where(active, (s + 1) & (TS - 1), s)
    tl.atomic_min(first_ptr + slot, offs, mask=eligible)  # integer min: order-independent
    tl.store(slot_ptr + offs, slot, mask=mask)


@triton.jit
def _dedup_flags_kernel(prefix_ptr, fill_ptr, valid_ptr, first_ptr, slot_ptr, out_ptr, n, check_threshold,
                        threshold, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask, eligible = _dedup_rows(prefix_ptr, fill_ptr, valid_ptr, n, check_threshold, threshold, HAS_VALID,
                                       BLOCK)
    first = tl.load(first_ptr + tl.load(slot_ptr + offs, mask=eligible, other=0), mask=eligible, other=0)
    tl.store(out_ptr + offs, (eligible & (first < offs)).to(tl.uint8), mask=mask)


def deprio_by_hash(prefix_len: torch.Tensor, fill_len: torch.Tensor, namespace_id: torch.Tensor,
                   head_hash: torch.Tensor, check_threshold: int, threshold: int, *,
                   valid: Optional[torch.Tensor] = None, block: Optional[int] = None) -> torch.Tensor:
    """bool [n] in queue order, R-ORD-9 for T = threshold >= 1: eligible (prefix_len <=
    check_threshold, which is >= 0; fill_len >= T; valid[i] where `valid` bool [n] is given)
    and not the first eligible request, in queue order, of its (namespace_id, head_hash)
    group: what a stable sort by (namespace for an eligible request, else INT64_MIN; hash)
    and a compare with each sorted predecessor give (the torch form), without the sort. Three launches (a table of the next power of two >= 2n slots is reset,
    filled by `atomic_cas` claims with `atomic_min` of queue indices, read); no host read.
    namespace_id int [n], head_hash int64 [n]."""
    where = "deprio_by_hash"
    n, dev = _check_deprio_args(where, _dedup_insert_kernel, prefix_len, fill_len, "namespace_id", namespace_id,
                                check_threshold, 0, threshold)
    check_int(where, "threshold", threshold, lo=1, hi=INT64_MAX)
    check_tensor(where, "head_hash", head_hash, (torch.int64,), numel=n, device=dev)
    if valid is not None:
        check_tensor(where, "valid", valid, (torch.bool,), numel=n, device=dev)
    BLOCK, warps = block_config(block)
    TS = 1 << max(2 * n - 1, 1).bit_length()  # >= 2n: probe runs stay short
    owner = torch.empty(TS + 1, dtype=torch.int64, device=dev)  # + the dummy slot
    first = torch.empty(TS + 1, dtype=torch.int64, device=dev)
    slot = torch.empty(n, dtype=torch.int64, device=dev)
    out = torch.empty(n, dtype=torch.bool, device=dev)
    v8 = valid.view(torch.uint8) if valid is not None else prefix_len
    rows = (prefix_len, fill_len, v8)
    _dedup_init_kernel[grid_1d(TS + 1, BLOCK)](owner, first, TS + 1, BLOCK=BLOCK, num_warps=warps)
    if n == 0:
        return out
    _dedup_insert_kernel[grid_1d(n, BLOCK)](*rows, namespace_id, head_hash, owner, first, slot, n, TS,
                                            check_threshold, threshold, HAS_VALID=valid is not None,
                                            BLOCK=BLOCK, num_warps=warps)
    _dedup_flags_kernel[grid_1d(n, BLOCK)](*rows, first, slot, out.view(torch.uint8), n, check_threshold,
                                           threshold, HAS_VALID=valid is not None, BLOCK=BLOCK, num_warps=warps)
    return out


@triton.jit
def _mod_p31(x):
    """x mod (2^31 - 1) for 0 <= x < 2^62 without a division: 2^31 = 1 (mod p), so the bits
    from 31 up fold onto the low ones (twice: below 2^32, then at most p)."""
    P: tl.constexpr = 2147483647
    y = (x & P) + (x >> 31)
    y = (y & P) + (y >> 31)
    return tl.where(y >= P, y - P, y)


@triton.jit
def _head_hash_kernel(tok_ptr, toff_ptr, fill_ptr, w_ptr, out_ptr, n, ntok, T, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    start = tl.load(toff_ptr + offs, mask=mask, other=0)
    length = tl.minimum(tl.load(fill_ptr + offs, mask=mask, other=0), T)
    h1 = tl.zeros([BLOCK], tl.int64)
    h2 = tl.zeros([BLOCK], tl.int64)
    top = tl.maximum(ntok - 1, 0)
    for t in range(0, T):
        live = mask & (t < length)
        p = tl.minimum(tl.maximum(start + t, 0), top)
        x = tl.load(tok_ptr + p, mask=live, other=0).to(tl.int64)
        a = tl.where(live, (x & 65535) + 1, 0)  # the token's two limbs (`head_hashes`)
        b = tl.where(live, x >> 16, 0)
        # a limb <= 2^16 and a weight < 2^31: each product < 2^47, each sum of residues < 2^33
        h1 = _mod_p31(h1 + _mod_p31(a * tl.load(w_ptr + 4 * t).to(tl.int64))
                      + _mod_p31(b * tl.load(w_ptr + 4 * t + 2).to(tl.int64)))
        h2 = _mod_p31(h2 + _mod_p31(a * tl.load(w_ptr + 4 * t + 1).to(tl.int64))
                      + _mod_p31(b * tl.load(w_ptr + 4 * t + 3).to(tl.int64)))
    tl.store(out_ptr + offs, h1 * 2147483648 + h2, mask=mask)


def head_hashes_pool(tok: torch.Tensor, toff: torch.Tensor, fill: torch.Tensor, weights: torch.Tensor, modulus: int,
                     *, block: Optional[int] = None) -> torch.Tensor:
    """int64 [n]: `gpu_sched.policy.head_hashes` of each request's first T = weights.shape[0] / 2
    fill tokens read straight from the token pool (R-ORD-9's groups): request i's tokens at
    tok[toff[i] + t] (positions clamped into the pool; an empty pool reads token 0), the first
    min(fill[i], T) counting. tok int32 [K] (ids in [0, 2^31 - 1], as `head_hashes` takes them:
    Triton's `%` truncates where torch's floors, which only a negative id would show); toff,
    fill int64 [n]; weights float64 [2T, 2]
    (base^j mod p, below 2^31: `policy._hash_weights(2T)`; rows 2t and 2t+1 weigh token t's low
    and high 16-bit limbs); modulus p. Each term is reduced mod p before its sum (int64
    exact); the same values as the torch form's float64 matmuls."""
    where = "head_hashes_pool"
    check_tensor(where, "toff", toff, (torch.int64,))
    dev = check_launch_device(where, _head_hash_kernel, toff)
    n = toff.numel()
    check_tensor(where, "tok", tok, (torch.int32,), device=dev)
    check_tensor(where, "fill", fill, (torch.int64,), numel=n, device=dev)
    check_tensor(where, "weights", weights, (torch.float64,), ndim=2, device=dev)
    if weights.shape[1] != 2 or weights.shape[0] % 2:
        raise ValueError(f"{where}: weights must be [2T, 2], got {tuple(weights.shape)}")
    if modulus != 2**31 - 1:  # the kernel reduces by folding, which needs this Mersenne prime
        raise ValueError(f"{where}: modulus must be 2^31 - 1, got {modulus}")
    # one request per lane by default: a request walks T tokens, so many small programs keep
    # every SM busy (1024-wide blocks left 4 programs at 4k requests: 0.24 ms on an H200)
    BLOCK, warps = block_config(HASH_BLOCK if block is None else block)
    if tok.numel() == 0:  # an empty pool reads as token 0
        tok = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    _head_hash_kernel[grid_1d(n, BLOCK)](tok, toff, fill, weights, out, n, tok.numel(), weights.shape[0] // 2,
                                         BLOCK=BLOCK, num_warps=warps)
    return out


@triton.jit
def _valid_first_kernel(perm_ptr, n_ptr, out_ptr, Q, BLOCK: tl.constexpr):
    n = tl.load(n_ptr)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), 0)
    carry = zero
    for s in range(0, Q, BLOCK):
        k = s + tl.arange(0, BLOCK).to(tl.int64)
        m = k < Q
        p = tl.load(perm_ptr + k, mask=m, other=0)
        v = (m & (p < n)).to(tl.int64)
        before = carry + tl.cumsum(v, 0) - v  # valid entries before k
        tl.store(out_ptr + tl.where(v != 0, before, n + (k - before)), p, mask=m)
        carry += tl.sum(v, 0)


def valid_first(perm: torch.Tensor, n: torch.Tensor, *, block: Optional[int] = None) -> torch.Tensor:
    """int64 [Q]: the permutation `perm` of 0..Q-1 with its entries below n (the real queue
    entries; n an int64 0-d tensor on the device, 0 <= n <= Q) first and the padding after
    them, each part in perm's order (a stable partition, as a stable sort by `perm >= n`).
    One program over the blocks, carrying the count of real entries: no sort, no host read."""
    where = "valid_first"
    check_tensor(where, "perm", perm, (torch.int64,))
    dev = check_launch_device(where, _valid_first_kernel, perm)
    check_tensor(where, "n", n, (torch.int64,), ndim=0, device=dev, contiguous=False)
    BLOCK, warps = block_config(block)
    Q = perm.numel()
    out = torch.empty(Q, dtype=torch.int64, device=dev)
    _valid_first_kernel[(1,)](perm, n, out, Q, BLOCK=BLOCK, num_warps=warps)
    return out
