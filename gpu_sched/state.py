"""Device state: the request table as structure-of-arrays tensors (DESIGN.md "Device state").

`RequestTable` holds every request given to it (waiting, running, chunked) in fixed
capacity columns, one tensor each, plus one int32 token pool holding each request's `fill`
(SPEC section 0). `GpuScheduler` does not use it: it keeps its own numpy row table
(mirrored on the device by `gpu_sched.step` after `capture()`); `tests/test_state.py` tests this one.
Capacities are fixed at construction and no tensor is ever reallocated, so a
CUDA graph captured over these tensors stays valid.

Who owns what:
  * The table's methods are the only writers of `valid`, `rid`, `prompt_len`, `output_len`,
    `tok_off`, `tok_cap` and `routing_key_id`; those are mirrored in host numpy arrays so
    that validation (live slot? room left?) never reads the device.
  * Code that computes on the table's columns may write `state`, `prefix_len`,
    `last_node`, `retracted` in place; the table never trusts a host copy of those.

Host/device split. Every mutating call validates completely on the host first and raises
`ValueError`/`TypeError` (or `CapacityError`, a `ValueError`) naming the field, the request and
the value before anything changes; the device update is then a handful of batched tensor ops
(one host->device copy of packed values, one scatter per column). The static-shape readers
(`waiting_mask`, `waiting_order_static`, `gather_fills` with a device index tensor) never
synchronize with the host.

Token allocator. Each request reserves `tok_cap = prompt_len + max(max_new_tokens, output_len)`
tokens at `tok_off` so outputs are appended in place. Free ranges live on the host as a sorted,
coalesced interval list (numpy). A batch is placed first-fit in batch order. If first-fit fails
but the total free room suffices (fragmentation), the table compacts: every live range moves to
the front of the pool in offset order with one gather (`compact()`), leaving a single free tail,
and the batch is then placed there. If the total free room does not suffice, `add` raises
`CapacityError` before anything changes. `compact()` may also be called at any time.

Interning. Request ids map to int64 ids (a counter, never reused) and slots on the host.
Routing keys (R-ORD-7) intern to ids in `[0, key_capacity)`; `None` and `""` both map to -1
(SPEC R-ORD-7 treats an empty key as absent: it is not counted and sorts as `""`). Ranks:
absent -> 0, interned keys -> 1..n in Python `str` order (code-point order), recomputed on the
host whenever a new key is interned and kept in the device tensor `routing_rank_of_id` [K]
(int32) and the `routing_key_rank` column. A routing-key id is valid while a row of this table
holds it: ids whose key no live row uses are reclaimed when the key table fills up.
Namespaces (`extra_key`, R-RC-2) intern to ids that are never reused (the radix tree outlives
requests): `None` -> 0, strings -> 1, 2, ...
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .request import INT32_MAX, INT64_MAX, INT64_MIN, Request

__all__ = [
    "FREE", "WAITING", "RUNNING", "CHUNKED", "STATE_NAMES", "COLUMNS", "CapacityError", "RequestTable",
]

# ---- row states (the `state` column, int8) ----------------------------------------------------
FREE = 0  # slot unused (valid == False)
WAITING = 1  # in the waiting queue, ordered by queue_pos (R-ORD-11)
RUNNING = 2  # in the running (decode) batch
CHUNKED = 3  # being prefilled: the in-flight chunked request or admitted this step
STATE_NAMES = {FREE: "free", WAITING: "waiting", RUNNING: "running", CHUNKED: "chunked"}

INT32_MIN = -(2**31)

# (name, dtype, value of a never-used row). Every column is a 1-D tensor of length capacity.
COLUMNS: Tuple[Tuple[str, torch.dtype, int], ...] = (
    ("valid", torch.bool, 0),  # row holds a request
    ("rid", torch.int64, -1),  # interned request id (host keeps str <-> id)
    ("queue_pos", torch.int64, 0),  # persistent queue order key, smaller = earlier (R-ORD-11)
    ("enqueue_time", torch.float64, 0),  # arrival or re-queue time [caller's time unit]
    ("priority", torch.int64, 0),  # absent priority stored as `absent_priority` (SPEC section 1)
    ("prompt_len", torch.int32, 0),  # [tokens]
    ("output_len", torch.int32, 0),  # [tokens] generated so far
    ("max_new_tokens", torch.int32, 0),  # [tokens]
    ("ignore_eos", torch.bool, 0),
    ("routing_key_id", torch.int32, -1),  # -1 absent (None or "")
    ("routing_key_rank", torch.int32, 0),  # rank of the key in str order; absent -> 0 (R-ORD-7)
    ("namespace_id", torch.int32, 0),  # interned extra_key; 0 = default namespace None (R-RC-2)
    ("return_logprob", torch.bool, 0),
    ("logprob_start_len", torch.int32, 0),  # [tokens], -1 = none
    ("prefix_len", torch.int32, 0),  # [tokens] latest prefix match (R-ORD-8)
    ("last_node", torch.int32, -1),  # radix node of the latest match, -1 none
    ("max_prefix_len", torch.int32, 0),  # [tokens] R-ORD-8 cap on the usable prefix
    ("retracted", torch.bool, 0),  # re-queued after retraction/preemption (R-DEC-2, R-ADM-7)
    ("state", torch.int8, FREE),  # FREE / WAITING / RUNNING / CHUNKED
    ("tok_off", torch.int64, 0),  # start of the row's range in `tokens`
    ("tok_cap", torch.int32, 0),  # [tokens] reserved room = prompt_len + max(max_new_tokens, output_len)
)
_COLUMN_NAMES = tuple(c[0] for c in COLUMNS)
_WRITE_STATES = (WAITING, RUNNING, CHUNKED)


class CapacityError(ValueError):
    """A fixed capacity (rows, tokens, routing keys) would be exceeded; nothing was changed."""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_time(now, what: str) -> float:
    if isinstance(now, bool) or not isinstance(now, (int, float, np.number)):
        raise TypeError(f"{what} must be a number, got {now!r}")
    t = float(now)
    if t != t:
        raise ValueError(f"{what} must not be NaN")
    return t


def _int_array(x, what: str) -> np.ndarray:
    """An int, sequence, numpy array or tensor (any device but meta) as an int64 numpy array.
    Raises TypeError for non-integers, ValueError for values outside int64."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            raise TypeError(f"{what} must hold integers, got {x.dtype}")
        return x.detach().to("cpu").numpy().astype(np.int64)
    if _is_int(x):
        x = [x]
    arr = np.asarray(x) if not isinstance(x, (str, bytes)) else np.asarray(None)
    if arr.size == 0 and arr.dtype.kind not in "iu":
        return np.zeros(arr.shape, np.int64)
    if arr.dtype == object:
        flat = arr.reshape(-1).tolist()
        for v in flat:
            if not _is_int(v):
                raise TypeError(f"{what} must hold integers, got {type(v).__name__} {v!r}")
            if not INT64_MIN <= int(v) <= INT64_MAX:
                raise ValueError(f"{what}: value {int(v)} is outside int64")
        return np.array([int(v) for v in flat], np.int64).reshape(arr.shape)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > INT64_MAX:
        raise ValueError(f"{what}: value {int(arr.max())} is outside int64")
    return arr.astype(np.int64)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lens[i]) as int64 (vectorized)."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.cumsum(lens) - lens
    return np.repeat(starts - first, lens) + np.arange(total, dtype=np.int64)


class RequestTable:
    """The request table: fixed-capacity structure-of-arrays tensors plus a token pool.

    Args:
        capacity: C, the number of rows (requests), >= 1.
        token_capacity: size of the token pool [tokens], >= 1.
        device: where the tensors live (any torch device, including `meta`).
        absent_priority: the stored priority of a request without one: `INT64_MAX` when low
            values are scheduled first, else `INT64_MIN` (SPEC section 1;
            `SchedulerConfig.absent_priority`).
        key_capacity: K, routing-key id space [ids]; default C (enough: each live row holds at
            most one key and unused ids are reclaimed).

    Attributes (device tensors, fixed addresses):
        one per entry of `COLUMNS`, shape [C]; `tokens` [token_capacity] int32 (unused = -1);
        `routing_rank_of_id` [K] int32 (free ids -1).

    Raises:
        TypeError/ValueError naming the argument.
    """

    # columns (see COLUMNS for dtypes and meaning), each [C]
    valid: torch.Tensor
    rid: torch.Tensor
    queue_pos: torch.Tensor
    enqueue_time: torch.Tensor
    priority: torch.Tensor
    prompt_len: torch.Tensor
    output_len: torch.Tensor
    max_new_tokens: torch.Tensor
    ignore_eos: torch.Tensor
    routing_key_id: torch.Tensor
    routing_key_rank: torch.Tensor
    namespace_id: torch.Tensor
    return_logprob: torch.Tensor
    logprob_start_len: torch.Tensor
    prefix_len: torch.Tensor
    last_node: torch.Tensor
    max_prefix_len: torch.Tensor
    retracted: torch.Tensor
    state: torch.Tensor
    tok_off: torch.Tensor
    tok_cap: torch.Tensor
    tokens: torch.Tensor
    routing_rank_of_id: torch.Tensor

    def __init__(self, capacity: int, token_capacity: int, device="cpu", *, absent_priority: int,
                 key_capacity: Optional[int] = None):
        for name, v in (("capacity", capacity), ("token_capacity", token_capacity)):
            if not _is_int(v):
                raise TypeError(f"{name} must be an int, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if key_capacity is None:
            key_capacity = capacity
        if not _is_int(key_capacity):
            raise TypeError(f"key_capacity must be an int or None, got {key_capacity!r}")
        if not 1 <= key_capacity <= INT32_MAX:
            raise ValueError(f"key_capacity must be in [1, {INT32_MAX}], got {key_capacity}")
        if not _is_int(absent_priority):
            raise TypeError(f"absent_priority must be an int, got {absent_priority!r}")
        if int(absent_priority) not in (INT64_MAX, INT64_MIN):
            raise ValueError(
                f"absent_priority must be {INT64_MAX} (low values first) or {INT64_MIN}, got {absent_priority}")
        self.capacity = C = int(capacity)
        self.token_capacity = int(token_capacity)
        self.key_capacity = K = int(key_capacity)
        self.absent_priority = int(absent_priority)
        self.device = torch.empty(0, device=device).device  # resolved: 'cuda' -> 'cuda:0'

        # device columns
        for name, dtype, init in COLUMNS:
            setattr(self, name, torch.full((C,), init, dtype=dtype, device=self.device))
        self.tokens = torch.full((self.token_capacity,), -1, dtype=torch.int32, device=self.device)
        self.routing_rank_of_id = torch.full((K,), -1, dtype=torch.int32, device=self.device)

        # host mirrors of the table-owned columns (see module docstring)
        self._h_valid = np.zeros(C, bool)
        self._h_rid = np.full(C, -1, np.int64)
        self._h_prompt = np.zeros(C, np.int64)
        self._h_out = np.zeros(C, np.int64)
        self._h_off = np.zeros(C, np.int64)
        self._h_cap = np.zeros(C, np.int64)
        self._h_key = np.full(C, -1, np.int64)
        self._rid_str: List[Optional[str]] = [None] * C
        self._slot_of: Dict[str, int] = {}
        self._next_rid_id = 0
        self._next_pos = 0
        # free-slot stack: pop from the end; initially pops 0, 1, 2, ...
        self._free_slots = np.arange(C - 1, -1, -1, dtype=np.int64)
        self._n_free_slots = C
        # token free list: sorted, coalesced, non-empty intervals
        self._free_start = np.array([0], np.int64)
        self._free_len = np.array([self.token_capacity], np.int64)
        # routing keys
        self._key_str: List[Optional[str]] = [None] * K
        self._key_id: Dict[str, int] = {}
        self._key_refs = np.zeros(K, np.int64)
        self._key_rank = np.full(K, -1, np.int64)
        self._free_key_ids = list(range(K - 1, -1, -1))
        # namespaces
        self._ns_str: List[Optional[str]] = [None]
        self._ns_id: Dict[str, int] = {}

    # ---- sizes -----------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of live rows (any state but FREE)."""
        return self.capacity - self._n_free_slots

    @property
    def free_rows(self) -> int:
        return self._n_free_slots

    @property
    def free_tokens(self) -> int:
        """Unreserved tokens in the pool (possibly fragmented) [tokens]."""
        return int(self._free_len.sum())

    @property
    def largest_free_range(self) -> int:
        """Longest contiguous free run [tokens]; a request needing more triggers `compact()`."""
        return int(self._free_len.max()) if len(self._free_len) else 0

    def columns(self) -> Dict[str, torch.Tensor]:
        """Name -> device tensor for every column of `COLUMNS` (the tensors themselves)."""
        return {name: getattr(self, name) for name in _COLUMN_NAMES}

    # ---- host <-> device helpers -------------------------------------------------------------
    def _to_dev(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)

    def _slots(self, slots, what: str, *, live: bool = True) -> np.ndarray:
        """`slots` as a unique 1-D int64 numpy array of live rows; raises naming the bad one."""
        arr = _int_array(slots, f"{what}: slots")
        if arr.ndim != 1:
            raise ValueError(f"{what}: slots must be 1-D, got shape {tuple(arr.shape)}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.capacity))
        if len(bad):
            raise ValueError(f"{what}: slot {int(arr[bad[0]])} is outside [0, {self.capacity})")
        if live:
            dead = np.flatnonzero(~self._h_valid[arr])
            if len(dead):
                raise ValueError(f"{what}: slot {int(arr[dead[0]])} holds no request")
        if len(np.unique(arr)) != len(arr):
            vals, counts = np.unique(arr, return_counts=True)
            raise ValueError(f"{what}: slot {int(vals[counts > 1][0])} is given more than once")
        return arr

    # ---- interning ----------------------------------------------------------------------------
    def intern_namespace(self, ns: Optional[str]) -> int:
        """Namespace id of `extra_key` (R-RC-2): None -> 0, strings -> 1, 2, ... never reused."""
        if ns is None:
            return 0
        if not isinstance(ns, str):
            raise TypeError(f"namespace must be a str or None, got {ns!r}")
        i = self._ns_id.get(ns)
        if i is None:
            i = len(self._ns_str)
            if i > INT32_MAX:
                raise CapacityError(f"namespace ids exhausted at {i}")
            self._ns_id[ns] = i
            self._ns_str.append(ns)
        return i

    def namespace_of_id(self, i: int) -> Optional[str]:
        return self._ns_str[i]

    def _plan_keys(self, keys) -> Tuple[List[str], List[int]]:
        """New keys to intern and ids to reclaim (no change). Raises CapacityError."""
        new = sorted({k for k in keys if k and k not in self._key_id})
        reclaim: List[int] = []
        if len(new) > len(self._free_key_ids):
            keep = set(keys)
            reclaim = [i for i in np.flatnonzero(self._key_refs == 0).tolist()
                       if self._key_str[i] is not None and self._key_str[i] not in keep]
            if len(new) > len(self._free_key_ids) + len(reclaim):
                raise CapacityError(
                    f"routing keys: {len(new)} new keys need ids but only "
                    f"{len(self._free_key_ids) + len(reclaim)} of key_capacity {self.key_capacity} are free")
        return new, reclaim

    def _apply_keys(self, new: List[str], reclaim: List[int]) -> None:
        for i in reclaim:
            del self._key_id[self._key_str[i]]
            self._key_str[i] = None
            self._key_rank[i] = -1
            self._free_key_ids.append(i)
        for k in new:
            i = self._free_key_ids.pop()
            self._key_str[i] = k
            self._key_id[k] = i
        if new:
            ids = sorted(self._key_id.values(), key=lambda i: self._key_str[i])
            self._key_rank[:] = -1
            self._key_rank[np.asarray(ids, np.int64)] = np.arange(1, len(ids) + 1)
            self.routing_rank_of_id.copy_(self._to_dev(self._key_rank.astype(np.int32)))
            self._refresh_routing_ranks()
        elif reclaim:
            self.routing_rank_of_id.copy_(self._to_dev(self._key_rank.astype(np.int32)))

    def _refresh_routing_ranks(self) -> None:
        """routing_key_rank = rank of routing_key_id (absent -> 0), all rows, on device."""
        kid = self.routing_key_id.long()
        self.routing_key_rank.copy_(torch.where(
            kid >= 0, self.routing_rank_of_id[kid.clamp(min=0)], torch.zeros_like(self.routing_key_rank)))

    def intern_routing_key(self, key: Optional[str]) -> int:
        """Routing-key id (R-ORD-7): None and "" -> -1; a new key gets a free id in [0, K) and
        every rank is recomputed. Raises CapacityError when K keys held by live rows leave no id."""
        if key is not None and not isinstance(key, str):
            raise TypeError(f"routing key must be a str or None, got {key!r}")
        if not key:
            return -1
        self._apply_keys(*self._plan_keys([key]))
        return self._key_id[key]

    def routing_key_of_id(self, i: int) -> Optional[str]:
        """The key of id `i` (None for -1)."""
        return None if i < 0 else self._key_str[i]

    def routing_rank(self, key: Optional[str]) -> int:
        """Rank of an interned key (absent/"" -> 0); KeyError if not interned."""
        return 0 if not key else int(self._key_rank[self._key_id[key]])

    # ---- token allocator ------------------------------------------------------------------------
    def _plan_tokens(self, needs: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """First-fit placement of `needs` in batch order on a copy of the free list: (offsets,
        new free starts, new free lens), or None when some request finds no free run."""
        fs, fl = self._free_start.copy(), self._free_len.copy()
        offs = np.empty(len(needs), np.int64)
        for i, n in enumerate(needs.tolist()):
            hit = np.flatnonzero(fl >= n)
            if not len(hit):
                return None
            j = hit[0]
            offs[i] = fs[j]
            fs[j] += n
            fl[j] -= n
        keep = fl > 0
        return offs, fs[keep], fl[keep]

    def _free_ranges(self, starts: np.ndarray, lens: np.ndarray) -> None:
        """Return ranges to the free list, coalescing neighbours (vectorized)."""
        s = np.concatenate([self._free_start, starts])
        ln = np.concatenate([self._free_len, lens])
        keep = ln > 0
        s, ln = s[keep], ln[keep]
        order = np.argsort(s, kind="stable")
        s, ln = s[order], ln[order]
        if len(s) == 0:
            self._free_start, self._free_len = s, ln
            return
        begin = np.ones(len(s), bool)
        begin[1:] = s[1:] != (s[:-1] + ln[:-1])
        idx = np.flatnonzero(begin)
        self._free_start = s[idx]
        self._free_len = np.add.reduceat(ln, idx)

    def compact(self) -> int:
        """Move every live token range to the front of the pool, keeping their order, with one
        gather; the free room becomes one run at the end. Returns the tokens moved.
        Offsets (`tok_off`) change; fills do not."""
        live = np.flatnonzero(self._h_valid)
        live = live[np.argsort(self._h_off[live], kind="stable")]
        caps = self._h_cap[live]
        new_off = np.cumsum(caps) - caps
        total = int(caps.sum())
        moved = 0
        if not np.array_equal(new_off, self._h_off[live]):
            fill = self._h_prompt[live] + self._h_out[live]
            src = _ranges(self._h_off[live], fill)
            dst = _ranges(new_off, fill)
            moved = len(src)
            if moved:
                idx = self._to_dev(np.stack([src, dst]))
                self.tokens.index_put_((idx[1],), self.tokens[idx[0]])  # gather first, then scatter
            self._h_off[live] = new_off
            self.tok_off.index_copy_(0, self._to_dev(live), self._to_dev(new_off))
        self._free_start = np.array([total], np.int64) if total < self.token_capacity else np.zeros(0, np.int64)
        self._free_len = (np.array([self.token_capacity - total], np.int64) if total < self.token_capacity
                          else np.zeros(0, np.int64))
        return moved

    # ---- mutations ------------------------------------------------------------------------------
    def add(self, requests: Sequence[Request], *, state: int = WAITING, now: float = 0.0) -> torch.Tensor:
        """Insert requests at the queue tail, in batch order (R-ORD-11); all or nothing.

        Each row gets a slot from the free-slot stack (most recently freed first), the next
        queue position, `enqueue_time = request.enqueue_time` or `now` when absent, priority
        or `absent_priority`, `prefix_len = 0`, `last_node = -1`, `max_prefix_len` per R-ORD-8,
        and `tok_cap = prompt_len + max(max_new_tokens, output_len)` tokens of the pool holding
        its fill.

        Returns: slots, int64 tensor [len(requests)] on `device`.
        Raises (before any change): TypeError for a non-Request or bad field (Request.validate
        re-runs, catching edits since construction); ValueError for a duplicate rid (within the
        batch or live), a length or `logprob_start_len` outside int32, a bad `state`;
        CapacityError when rows, tokens or routing-key ids run out.
        """
        if not _is_int(state) or int(state) not in _WRITE_STATES:
            raise ValueError(f"state must be one of WAITING/RUNNING/CHUNKED {_WRITE_STATES}, got {state!r}")
        now = _check_time(now, "now")
        requests = list(requests)
        B = len(requests)
        if B == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        seen = set()
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__}")
            r.validate()
            if r.rid in self._slot_of:
                raise ValueError(f"request {r.rid!r}: rid is already in the table (slot {self._slot_of[r.rid]})")
            if r.rid in seen:
                raise ValueError(f"request {r.rid!r}: rid appears more than once in the batch")
            seen.add(r.rid)
            who = f"request {r.rid!r}"
            cap = len(r.prompt_ids) + max(r.max_new_tokens, len(r.output_ids))
            for name, v, lo in (("max_new_tokens", r.max_new_tokens, 0),
                                ("logprob_start_len", r.logprob_start_len, INT32_MIN),
                                ("prompt_len + max_new_tokens", cap, 0)):
                if not lo <= v <= INT32_MAX:
                    raise ValueError(f"{who}: {name} = {v} is outside the int32 range [{lo}, {INT32_MAX}]")
        if B > self._n_free_slots:
            raise CapacityError(f"rows: {B} requests but only {self._n_free_slots} of capacity "
                                f"{self.capacity} rows are free")
        key_plan = self._plan_keys([r.routing_key for r in requests])
        prompt = np.fromiter((len(r.prompt_ids) for r in requests), np.int64, B)
        out = np.fromiter((len(r.output_ids) for r in requests), np.int64, B)
        mnt = np.fromiter((r.max_new_tokens for r in requests), np.int64, B)
        caps = prompt + np.maximum(mnt, out)
        need = int(caps.sum())
        if need > self.free_tokens:
            raise CapacityError(f"tokens: the batch reserves {need} tokens (prompt + max(max_new_tokens, output)) but only "
                                f"{self.free_tokens} of token_capacity {self.token_capacity} are free")
        # ---- validated: from here on nothing raises -----------------------------------------
        tok_plan = self._plan_tokens(caps)
        if tok_plan is None:
            self.compact()
            tok_plan = self._plan_tokens(caps)
            assert tok_plan is not None
        offs, self._free_start, self._free_len = tok_plan
        self._apply_keys(*key_plan)
        top = self._n_free_slots
        slots = self._free_slots[top - B:top][::-1].copy()
        self._n_free_slots = top - B
        rid_ids = np.arange(self._next_rid_id, self._next_rid_id + B, dtype=np.int64)
        self._next_rid_id += B
        pos = np.arange(self._next_pos, self._next_pos + B, dtype=np.int64)
        self._next_pos += B
        key_ids = np.fromiter((self._key_id[r.routing_key] if r.routing_key else -1 for r in requests), np.int64, B)
        fill_len = prompt + out
        lsl = np.fromiter((r.logprob_start_len for r in requests), np.int64, B)
        ret_lp = np.fromiter((r.return_logprob for r in requests), bool, B)
        mpl = fill_len - 1
        mpl = np.where(ret_lp & (lsl >= 0), np.minimum(mpl, lsl), mpl)
        times = np.fromiter((now if r.enqueue_time is None else r.enqueue_time for r in requests), np.float64, B)
        values = {
            "valid": np.ones(B, np.int64),
            "rid": rid_ids,
            "queue_pos": pos,
            "enqueue_time": times.view(np.int64),
            "priority": np.array([self.absent_priority if r.priority is None else r.priority for r in requests],
                                 np.int64),
            "prompt_len": prompt,
            "output_len": out,
            "max_new_tokens": mnt,
            "ignore_eos": np.fromiter((r.ignore_eos for r in requests), np.int64, B),
            "routing_key_id": key_ids,
            "routing_key_rank": np.where(key_ids >= 0, self._key_rank[np.maximum(key_ids, 0)], 0),
            "namespace_id": np.fromiter((self.intern_namespace(r.extra_key) for r in requests), np.int64, B),
            "return_logprob": ret_lp.astype(np.int64),
            "logprob_start_len": lsl,
            "prefix_len": np.zeros(B, np.int64),
            "last_node": np.full(B, -1, np.int64),
            "max_prefix_len": mpl,
            "retracted": np.zeros(B, np.int64),
            "state": np.full(B, int(state), np.int64),
            "tok_off": offs,
            "tok_cap": caps,
        }
        packed = self._to_dev(np.stack([slots] + [values[n] for n in _COLUMN_NAMES]))  # one H2D copy
        s = packed[0]
        for j, (name, dtype, _) in enumerate(COLUMNS):
            row = packed[j + 1]
            row = row.view(torch.float64) if dtype == torch.float64 else row.to(dtype)
            getattr(self, name).index_copy_(0, s, row)
        fills = [r.fill_ids() for r in requests]
        dst = _ranges(offs, fill_len)
        tok = self._to_dev(np.stack([dst, np.concatenate(fills).astype(np.int64)]))
        self.tokens.index_put_((tok[0],), tok[1].to(torch.int32))
        # host mirrors
        self._h_valid[slots] = True
        self._h_rid[slots] = rid_ids
        self._h_prompt[slots] = prompt
        self._h_out[slots] = out
        self._h_off[slots] = offs
        self._h_cap[slots] = caps
        self._h_key[slots] = key_ids
        np.add.at(self._key_refs, key_ids[key_ids >= 0], 1)
        for slot, r in zip(slots.tolist(), requests):
            self._rid_str[slot] = r.rid
            self._slot_of[r.rid] = slot
        return s.clone()

    def remove(self, slots) -> None:
        """Free rows and their token ranges (batched). Raises ValueError (before any change)
        for a slot out of range, not live, or repeated."""
        sl = self._slots(slots, "remove")
        if not len(sl):
            return
        self._free_ranges(self._h_off[sl], self._h_cap[sl])
        keys = self._h_key[sl]
        np.subtract.at(self._key_refs, keys[keys >= 0], 1)
        for slot in sl.tolist():
            del self._slot_of[self._rid_str[slot]]
            self._rid_str[slot] = None
        self._h_valid[sl] = False
        self._h_rid[sl] = -1
        self._h_key[sl] = -1
        self._h_out[sl] = self._h_prompt[sl] = self._h_cap[sl] = 0
        top = self._n_free_slots
        self._free_slots[top:top + len(sl)] = sl[::-1]  # the first slot given is reused first
        self._n_free_slots = top + len(sl)
        s = self._to_dev(sl)
        self.valid.index_fill_(0, s, False)
        self.state.index_fill_(0, s, FREE)
        self.rid.index_fill_(0, s, -1)
        self.routing_key_id.index_fill_(0, s, -1)
        self.routing_key_rank.index_fill_(0, s, 0)

    def requeue(self, slots, now: float) -> None:
        """Move rows to the queue tail in the given order (R-ADM-7, R-DEC-2): new queue_pos,
        `enqueue_time = now`, `retracted = True`, `prefix_len = 0`, `last_node = -1`,
        state WAITING. Output tokens are kept. Raises ValueError as `remove`."""
        now = _check_time(now, "now")
        sl = self._slots(slots, "requeue")
        B = len(sl)
        if not B:
            return
        p0 = self._next_pos
        self._next_pos += B
        s = self._to_dev(sl)
        self.queue_pos.index_copy_(0, s, torch.arange(p0, p0 + B, dtype=torch.int64, device=self.device))
        self.enqueue_time.index_fill_(0, s, now)
        self.retracted.index_fill_(0, s, True)
        self.prefix_len.index_fill_(0, s, 0)
        self.last_node.index_fill_(0, s, -1)
        self.state.index_fill_(0, s, WAITING)

    def set_state(self, slots, state: int) -> None:
        """Set the `state` column of live rows to WAITING, RUNNING or CHUNKED (queue_pos kept)."""
        if not _is_int(state) or int(state) not in _WRITE_STATES:
            raise ValueError(f"state must be one of WAITING/RUNNING/CHUNKED {_WRITE_STATES}, got {state!r}")
        sl = self._slots(slots, "set_state")
        if len(sl):
            self.state.index_fill_(0, self._to_dev(sl), int(state))

    def append_tokens(self, slots, token_ids) -> None:
        """Append one output token per row (batched), in place in its reserved range; updates
        `output_len` and `max_prefix_len` (R-ORD-8).

        Args: slots [B] (unique live rows), token_ids [B] ints in [0, 2^31-1].
        Raises (before any change): ValueError for a bad slot, a length mismatch, a token id
        outside int32 range, or a row whose reserved room (`tok_cap`) is full.
        """
        sl = self._slots(slots, "append_tokens")
        ids = _int_array(token_ids, "append_tokens: token_ids")
        if ids.shape != sl.shape:
            raise ValueError(f"append_tokens: {len(sl)} slots but token_ids has shape {tuple(ids.shape)}")
        bad = np.flatnonzero((ids < 0) | (ids > INT32_MAX))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"append_tokens: token id {int(ids[i])} for request {self._rid_str[sl[i]]!r} "
                             f"(slot {int(sl[i])}) is outside the token id range [0, {INT32_MAX}]")
        fill = self._h_prompt[sl] + self._h_out[sl]
        full = np.flatnonzero(fill >= self._h_cap[sl])
        if len(full):
            i = int(full[0])
            raise ValueError(f"append_tokens: request {self._rid_str[sl[i]]!r} (slot {int(sl[i])}) has no room: "
                             f"fill {int(fill[i])} tokens = tok_cap {int(self._h_cap[sl[i]])}")
        if not len(sl):
            return
        new_out = self._h_out[sl] + 1
        packed = self._to_dev(np.stack([sl, self._h_off[sl] + fill, ids.astype(np.int64), new_out]))
        s = packed[0]
        self.tokens.index_put_((packed[1],), packed[2].to(torch.int32))
        self.output_len.index_copy_(0, s, packed[3].to(torch.int32))
        self._h_out[sl] = new_out
        mpl = self.prompt_len[s] + self.output_len[s] - 1
        lsl = self.logprob_start_len[s]
        capped = self.return_logprob[s] & (lsl >= 0)
        self.max_prefix_len.index_copy_(0, s, torch.where(capped, torch.minimum(mpl, lsl), mpl))

    # ---- readers ----------------------------------------------------------------------------------
    def waiting_mask(self) -> torch.Tensor:
        """bool [C]: rows in the waiting queue. No host sync."""
        return self.valid & (self.state == WAITING)

    def waiting_order(self) -> torch.Tensor:
        """int64 [n_waiting]: slots of waiting rows by queue_pos (R-ORD-11). Dynamic shape:
        synchronizes with the host (nonzero); use `waiting_order_static` inside a step."""
        idx = torch.nonzero(self.waiting_mask()).squeeze(1)
        return idx[torch.argsort(self.queue_pos[idx], stable=True)]

    def waiting_order_static(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(order int64 [C], count int64 0-d): all C slots sorted with waiting rows first by
        queue_pos, then every other row (by slot); `order[:count]` is `waiting_order()`.
        Static shapes, no host sync (CUDA-graph and torch.compile(fullgraph=True) safe)."""
        mask = self.waiting_mask()
        key = torch.where(mask, self.queue_pos, torch.full_like(self.queue_pos, INT64_MAX))
        order = torch.sort(key, stable=True).indices
        return order, mask.sum()

    def fill_tokens(self, slot: int) -> torch.Tensor:
        """`fill(r)` of one live row: int32 [prompt_len + output_len] (a copy) on `device`."""
        s = int(self._slots(slot, "fill_tokens")[0])
        off = int(self._h_off[s])
        return self.tokens[off:off + int(self._h_prompt[s] + self._h_out[s])].clone()

    def gather_fills(self, slots, max_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fills of many rows, padded: (tokens int32 [B, max_len] with -1 past each fill,
        lengths int32 [B] = full fill length, not truncated to max_len).

        `slots` [B]: a device int64 tensor is used as is (no host sync; entries must be in
        [-1, C)); anything else is validated on the host. Slot -1 and free rows give length 0.
        """
        if not _is_int(max_len) or max_len < 0:
            raise ValueError(f"gather_fills: max_len must be an int >= 0, got {max_len!r}")
        if isinstance(slots, torch.Tensor) and slots.device == self.device:
            s = slots.long()
        else:
            arr = slots.detach().cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots, np.int64)
            arr = arr.astype(np.int64).reshape(-1)
            bad = np.flatnonzero((arr < -1) | (arr >= self.capacity))
            if len(bad):
                raise ValueError(f"gather_fills: slot {int(arr[bad[0]])} is outside [-1, {self.capacity})")
            s = self._to_dev(arr)
        sc = s.clamp(min=0)
        length = torch.where((s >= 0) & self.valid[sc], self.prompt_len[sc] + self.output_len[sc],
                             torch.zeros_like(sc, dtype=torch.int32))
        ar = torch.arange(max_len, device=self.device)
        inside = ar[None, :] < length[:, None]
        pos = torch.where(inside, self.tok_off[sc][:, None] + ar[None, :], torch.zeros_like(ar)[None, :])
        out = torch.where(inside, self.tokens[pos], torch.full_like(pos, -1, dtype=torch.int32))
        return out, length

    # ---- rid maps ---------------------------------------------------------------------------------
    def slot_of(self, rid: str) -> int:
        """Slot of a live request; KeyError if unknown."""
        try:
            return self._slot_of[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} is not in the table") from None

    def rid_of(self, slot: int) -> str:
        """rid of a live row; ValueError for a free or out-of-range slot."""
        return self._rid_str[int(self._slots(slot, "rid_of")[0])]

    def rid_id_of(self, rid: str) -> int:
        """The interned int64 id stored in the `rid` column for a live request."""
        return int(self._h_rid[self.slot_of(rid)])

    # ---- debugging and tests ----------------------------------------------------------------------
    def to_host_rows(self) -> List[dict]:
        """Every live row as a dict (slot order): all columns (Python scalars), plus `rid`
        (str), `rid_id`, `routing_key`, `namespace` (strings) and `fill` (list of ints).
        Synchronizes; for debugging and tests."""
        cols = {name: getattr(self, name).cpu().numpy() for name in _COLUMN_NAMES}
        toks = self.tokens.cpu().numpy()
        rows = []
        for slot in np.flatnonzero(cols["valid"]).tolist():
            row = {name: cols[name][slot].item() for name in _COLUMN_NAMES}
            row["rid_id"] = row.pop("rid")
            row["slot"] = slot
            row["rid"] = self._rid_str[slot]
            row["routing_key"] = self.routing_key_of_id(row["routing_key_id"])
            row["namespace"] = self.namespace_of_id(row["namespace_id"])
            off = row["tok_off"]
            row["fill"] = toks[off:off + row["prompt_len"] + row["output_len"]].tolist()
            rows.append(row)
        return rows

    def snapshot(self) -> dict:
        """A deep copy of all device tensors and host bookkeeping (for before/after tests)."""
        snap = {name: t.clone() for name, t in self.columns().items()}
        snap["tokens"] = self.tokens.clone()
        snap["routing_rank_of_id"] = self.routing_rank_of_id.clone()
        for name, v in vars(self).items():
            if name.startswith("_"):
                snap[name] = v.copy() if isinstance(v, (np.ndarray, list, dict)) else v
        return snap

    def check_integrity(self) -> None:
        """Executable invariants (STYLE practice 5); raises AssertionError naming the broken one.
        Synchronizes with the device."""
        C = self.capacity
        col = {name: getattr(self, name).cpu().numpy() for name in _COLUMN_NAMES}
        live = self._h_valid
        L = np.flatnonzero(live)
        assert np.array_equal(col["valid"], live), "valid column != host mirror"
        assert np.array_equal(col["valid"], col["state"] != FREE), "valid != (state != FREE)"
        assert np.isin(col["state"], (FREE,) + _WRITE_STATES).all(), "unknown state code"
        for name, mirror in (("rid", self._h_rid), ("prompt_len", self._h_prompt), ("output_len", self._h_out),
                             ("tok_off", self._h_off), ("tok_cap", self._h_cap), ("routing_key_id", self._h_key)):
            assert np.array_equal(col[name][L], mirror[L]), f"{name} column != host mirror"
        # slots
        free = self._free_slots[:self._n_free_slots]
        assert len(free) == C - len(L), "free-slot count != capacity - live rows"
        assert len(np.unique(free)) == len(free) and not live[free].any(), "free-slot stack holds a live/repeated slot"
        assert len(self._slot_of) == len(L), "rid map size != live rows"
        for rid, slot in self._slot_of.items():
            assert live[slot] and self._rid_str[slot] == rid, f"rid map broken for {rid!r}"
        assert len(np.unique(self._h_rid[L])) == len(L), "duplicate rid ids"
        qp = col["queue_pos"][L]
        assert len(np.unique(qp)) == len(L) and (qp < self._next_pos).all(), "queue_pos not unique / ahead of counter"
        # tokens: live ranges + free list partition [0, token_capacity)
        assert (self._h_prompt[L] >= 1).all(), "prompt_len < 1"
        assert (self._h_prompt[L] + self._h_out[L] <= self._h_cap[L]).all(), "fill longer than tok_cap"
        starts = np.concatenate([self._h_off[L], self._free_start])
        lens = np.concatenate([self._h_cap[L], self._free_len])
        o = np.argsort(starts, kind="stable")
        starts, lens = starts[o], lens[o]
        assert (self._free_len > 0).all(), "empty free range"
        assert int(lens.sum()) == self.token_capacity, "reserved + free != token_capacity"
        if len(starts):
            assert starts[0] == 0 and np.array_equal(starts[1:], (starts + lens)[:-1]), "token ranges overlap or gap"
        fs = self._free_start
        assert (fs[1:] > (fs + self._free_len)[:-1]).all(), "free list unsorted, overlapping or not coalesced"
        # derived columns
        fill = col["prompt_len"][L].astype(np.int64) + col["output_len"][L]
        lsl = col["logprob_start_len"][L]
        mpl = np.where(col["return_logprob"][L] & (lsl >= 0), np.minimum(fill - 1, lsl), fill - 1)
        assert np.array_equal(col["max_prefix_len"][L], mpl), "max_prefix_len != R-ORD-8 formula"
        # routing keys
        kid = col["routing_key_id"][L].astype(np.int64)
        refs = np.bincount(kid[kid >= 0], minlength=self.key_capacity)
        assert np.array_equal(refs, self._key_refs), "routing-key refcounts != live rows"
        ids = [i for i in range(self.key_capacity) if self._key_str[i] is not None]
        assert len(ids) == len(self._key_id) and all(self._key_id[self._key_str[i]] == i for i in ids), \
            "routing-key maps broken"
        by_rank = sorted(ids, key=lambda i: self._key_rank[i])
        assert [self._key_str[i] for i in by_rank] == sorted(self._key_id), "routing-key ranks not in str order"
        assert np.array_equal(self.routing_rank_of_id.cpu().numpy(), self._key_rank), "rank table != host mirror"
        want = np.where(kid >= 0, self._key_rank[np.maximum(kid, 0)], 0)
        assert np.array_equal(col["routing_key_rank"][L], want), "routing_key_rank column stale"
        assert (col["namespace_id"][L] < len(self._ns_str)).all(), "unknown namespace id"
