"""The admission decision of one step as a static-shaped, host-sync-free tensor computation
(SPEC.md sections 4-5: R-ADM-1..7, R-STEP-3; section 8's parallel forms).

How it works (read this first)
  The sequential loop (R-STEP-3) admits a prefix of the ordered queue and stops at the first
  request that is refused or leaves a non-CONTINUE budget. Every request before the stop point
  was admitted, so what request j sees is fixed by prefix sums over the queue:

    I_j       = I + sum_{i<j} (ceilP(ext_i) + min(max_new_i, CLIP) + P)     (R-ADM-2)
    cur_off_j = cur_off + sum_{i<j} (ceilP(ext_i) + P)
    rem_input_j, rem_chunk_j = start - sum_{i<j} ceilP(ext_i)
    evictable_j = evictable - sum_{i<j} drop_i                               (`lock_drops`)
    |can_run|_j = can_run + j

  except that a chunked admission (R-ADM-3 step 7) commits less than a whole one and the loop
  may go on after it. So `admit_step` runs a fixed number of rounds: each round evaluates every
  check of R-STEP-3 / R-ADM-3 for the whole queue at once under the prefix sums (corrected by
  the chunks of earlier rounds), finds the first index where anything but "admit whole, budget
  still CONTINUE" happens (a masked min, no host read), and applies that event with
  `torch.where`. Only a chunk that leaves the budget at CONTINUE lets the next round go on.
  Two rounds always suffice: one chunk a step (`PrefillAdder.add_one_req`; `chunk_idx` set
  turns a later chunk into OTHER), so the only event that lets the loop go on (a chunk leaving the
  budget at CONTINUE) happens at most once; the next round's event ends the loop. `decided`
  reports the end was reached (a RuntimeError on the host, never a silent cut).

  Ignore-EOS requests with the cache disabled (R-ADM-6) use `ignore_eos_fail`: every candidate
  j against the states of the held requests and the queue entries up to j, all sorted once by
  `left` (D1), with masked prefix sums along the sorted order and an any-reduction per row.

  Priority preemption (R-ADM-7) is a host event here (`STOP_PREEMPT` names the request that
  needs it); `preempt_select` decides one attempt on the device.

  Eager callers (`GpuScheduler.step` without a recorded graph, torch backend) use
  `admit_step_host`: the same per-request checks as tensors, but each round's event and the
  values at it are read back and the round's state update runs in Python integers, which
  replaces some 90 scalar tensor ops per round (each a few us on a CPU, a kernel launch on a
  GPU) by two reads. On CPU tensors the checks themselves (`_queue_sums`, `eval_requests`)
  and `lock_drops` run as numpy calls on views of the columns (the same formulas; a numpy
  call costs 1-3 us where a torch CPU op costs 5-15 us). The static `admit_step` is what a
  CUDA graph records; tests hold the forms equal field by field.

Static shapes: the queue has a fixed capacity Q with a device count `n`; budgets are 0-d
tensors; config values are Python ints. No `.item()`, no `nonzero`, no boolean-mask indexing,
no data-dependent shape (tests run it on `meta` tensors and under `torch.compile(fullgraph)`).
Floats: float64 exactly where D7 / R-ADM-6 / R-ADM-7 say; everything else int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import numpy as np
import torch

from .kernels._utils import check_tensor
from .policy import _host

STOP_NONE = 0
STOP_QUEUE_END = 1
STOP_BUDGET_OTHER = 2
STOP_BATCH_FULL = 3
STOP_NO_TOKEN = 4
STOP_OTHER = 5
STOP_PREEMPT = 6
#: stop codes as the reference scheduler names them ("needs_preempt": the host runs R-ADM-7)
STOP_NAMES = {STOP_QUEUE_END: "queue_end", STOP_BUDGET_OTHER: "budget_other", STOP_BATCH_FULL: "batch_full",
              STOP_NO_TOKEN: "add_no_token", STOP_OTHER: "add_other", STOP_PREEMPT: "needs_preempt"}
STOP_CODES = {name: code for code, name in STOP_NAMES.items()}

KIND_NONE, KIND_WHOLE, KIND_CHUNK = 0, 1, 2
_CONT, _NT, _OTH = 0, 1, 2
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


@dataclass(frozen=True)
class StepConfig:
    """Host-side knobs of `admit_step` (they fix the computation's structure).

    page_size, clip: P and CLIP. chunking: chunked_prefill_size is set. align:
    truncation_align_size or None. max_running / prefill_max: caps or None. ignore_eos_path:
    the cache is disabled, so ignore-EOS requests take R-ADM-6. preemption: priority preemption
    is on (a full batch becomes `STOP_PREEMPT`). rounds: see the module doc (2 is always exact; more
    only cost time).
    grid_rows: candidate rows per block of the ignore-EOS grid (memory bound only).
    """

    page_size: int = 1
    clip: int = 4096
    chunking: bool = False
    align: Optional[int] = None
    max_running: Optional[int] = None
    prefill_max: Optional[int] = None
    ignore_eos_path: bool = False
    preemption: bool = False
    rounds: int = 2
    grid_rows: int = 512

    @classmethod
    def from_config(cls, cfg, **over) -> "StepConfig":
        kw = dict(page_size=cfg.page_size, clip=cfg.clip_max_new_tokens,
                  chunking=cfg.chunked_prefill_size is not None, align=cfg.truncation_align_size,
                  max_running=cfg.max_running_requests, prefill_max=cfg.prefill_max_requests,
                  ignore_eos_path=cfg.disable_radix_cache, preemption=cfg.enable_priority_preemption,
                  rounds=2)
        kw.update(over)
        return cls(**kw)


class QueueCols(NamedTuple):
    """The ordered queue, capacity Q (entries at index >= n are ignored). int64 [Q] unless said."""

    n: torch.Tensor  # 0-d int64: valid entries
    fill_len: torch.Tensor
    out_len: torch.Tensor
    prompt_len: torch.Tensor
    max_new: torch.Tensor
    prefix_len: torch.Tensor  # re-matched, capped at max_prefix_len (R-STEP-3.4)
    drop: torch.Tensor  # `lock_drops` (zeros with the cache disabled)
    ignore_eos: torch.Tensor  # bool [Q]


class HeldCols(NamedTuple):
    """Requests that count as ignore-EOS states besides the queue (R-ADM-6, D6): the running batch
    and what `can_run` already holds. int64 [R] unless said."""

    valid: torch.Tensor  # bool [R]
    max_new: torch.Tensor
    out_len: torch.Tensor
    prompt_len: torch.Tensor
    ignore_eos: torch.Tensor  # bool [R]


class ChunkedCols(NamedTuple):
    """The in-flight chunked request (R-ADM-5); 0-d tensors."""

    present: torch.Tensor  # bool
    fill_len: torch.Tensor
    prefix_len: torch.Tensor
    max_new: torch.Tensor
    out_len: torch.Tensor
    prompt_len: torch.Tensor
    ignore_eos: torch.Tensor  # bool


class StepState(NamedTuple):
    """Budgets when the loop starts (0-d tensors; R-ADM state). `rem_chunk` is ignored when
    chunking is off. `N` is the int64 running reservation count, `ratio` float64."""

    available: torch.Tensor
    evictable: torch.Tensor
    I: torch.Tensor
    cur_off: torch.Tensor
    rem_input: torch.Tensor
    rem_chunk: torch.Tensor
    ratio: torch.Tensor
    N: torch.Tensor
    can_run: torch.Tensor  # requests already in can_run
    running_bs: torch.Tensor  # len(running), read once before the loop
    batch_full: torch.Tensor  # bool, after R-STEP-1's clearing


class StepResult(NamedTuple):
    admitted: torch.Tensor  # bool [Q], queue order
    extend_start: torch.Tensor  # int64 [Q] (meaningful where admitted)
    extend_end: torch.Tensor  # int64 [Q]
    stop_index: torch.Tensor  # 0-d: the request the loop stopped at (n at the queue's end)
    stop: torch.Tensor  # 0-d STOP_* code
    chunk_index: torch.Tensor  # 0-d: queue index of the new chunked request, -1 if none
    chunk_len: torch.Tensor  # 0-d: its (truncated) extend length, 0 if none
    batch_full: torch.Tensor  # 0-d bool
    inflight_end: torch.Tensor  # 0-d: extend end of the in-flight chunked request (R-ADM-5)
    inflight_left: torch.Tensor  # 0-d bool: it stays the chunked request
    I: torch.Tensor
    cur_off: torch.Tensor
    rem_input: torch.Tensor
    rem_chunk: torch.Tensor
    evictable: torch.Tensor
    rem_total: torch.Tensor  # float64, D7
    cur_rem: torch.Tensor
    hit_tokens: torch.Tensor  # added to log_hit_tokens by this call
    input_tokens: torch.Tensor  # added to log_input_tokens by this call
    decided: torch.Tensor  # 0-d bool: the rounds reached the loop's end
    #: backend "triton": the int64 scalars above packed as int64 [RESULT_LEN]
    #: (`kernels.admission.R_*`; those fields are views of it, so none may be written in place:
    #: the mask, the columns, the flags and rem_total live in buffers of their own), so a
    #: read-back or a recorded step takes them in one op. None on the torch backend.
    packed: Optional[torch.Tensor] = None


# ---- small helpers ------------------------------------------------------------------------------
# The per-request checks (`eval_requests`, `_queue_sums`) take torch tensors, or numpy arrays
# in `admit_step_host`'s CPU form: these few helpers pick the library by the argument's type;
# the rest is operators to which both libraries give the same int64 / IEEE float64 meaning
# (floor division included).
def _where(c, a, b):
    return np.where(c, a, b) if isinstance(c, np.ndarray) else torch.where(c, a, b)


def _f64(x):
    return x.astype(np.float64) if isinstance(x, np.ndarray) else x.to(torch.float64)


def _clamp(x, lo=None, hi=None):
    if isinstance(x, np.ndarray):
        x = x if lo is None else np.maximum(x, lo)
        return x if hi is None else np.minimum(x, hi)
    return torch.clamp(x, min=lo, max=hi)


def _floordiv(x, d: int):
    return x // d if isinstance(x, np.ndarray) else torch.div(x, d, rounding_mode="floor")


def _floor_p(x: torch.Tensor, P: int) -> torch.Tensor:
    return x if P == 1 else _floordiv(x, P) * P


def _ceil_p(x: torch.Tensor, P: int) -> torch.Tensor:
    return x if P == 1 else -_floordiv(-x, P) * P


def _budget(rem_total, cur_rem, rem_input, rem_chunk, chunking: bool):
    """R-ADM-1 as a code tensor: 0 CONTINUE, 1 NO_TOKEN, 2 OTHER."""
    nt = (rem_total <= 0) | (cur_rem <= 0)
    oth = rem_input <= 0
    if chunking:
        oth = oth | (rem_chunk <= 0)
    return _where(nt, _NT, _where(oth, _OTH, _CONT))


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return (np.cumsum(x) if isinstance(x, np.ndarray) else torch.cumsum(x, 0)) - x


def _at(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """v[k] for a 0-d index tensor, without a host read."""
    return torch.index_select(v, 0, k.reshape(1)).reshape(())


# ---- lock-aware evictable drops ------------------------------------------------------------------
def lock_drops(parent: torch.Tensor, key_len: torch.Tensor, lock_ref: torch.Tensor, alive: torch.Tensor,
               last_node: torch.Tensor, cover: torch.Tensor, valid: torch.Tensor,
               max_depth: Optional[int] = None, backend: str = "torch", early_exit: bool = False) -> torch.Tensor:
    """drop_i [Q] int64: what locking request i's matched path moves from `evictable` to
    `protected` after requests 0..i-1 locked theirs (R-RC-6; SPEC section 8).

    Tree: node arrays [N] (`parent` -1 for the root, node 0; `alive` bool). Request i matched
    `cover[i]` tokens of node `last_node[i]` (1..key_len; less than key_len when the match ends
    inside the node, which a sequential match would split) and every ancestor whole; `valid`
    false for a request with nothing matched. A node counts only when unlocked (lock_ref 0).

    Static form: F(v) = the first request whose path covers v whole = the minimum over v's
    subtree of the first rank of requests whose whole-covered path ends there (scatter-amin,
    then pointer doubling up the ancestors: ceil(log2 N) rounds, or bit_length(max_depth) when
    the caller bounds the number of nodes on any matched path, e.g. by max matched length // P);
    node v adds
    `key_len - (largest partial cover of v by a request before F(v))` to request F(v); a
    partial cover adds what it covers beyond earlier partial covers of the same node, unless an
    earlier request covered the node whole. `backend` "triton" runs it all in
    `gpu_sched.kernels.radix.lock_drops`: F by one atomic walk per request, the node and
    partial-cover gains by atomics and one program over the requests sorted by node (four
    launches and a sort instead of ~75 tensor ops; max_depth and early_exit unused).
    `early_exit` (eager callers; host reads): the doubling stops at its first round that
    changes nothing (a fixed point: every later round would change nothing either, and every
    descendant is then counted), and the partial-cover part is skipped when no request has one.
    On CPU tensors with backend "torch" the host form runs (`lock_drops_np`: Python walks of
    the paths for up to LOCK_WALK_MAX requests, the same steps as numpy calls past that).
    """
    if backend == "torch" and _host(parent):
        return torch.from_numpy(lock_drops_np(parent.numpy(), key_len.numpy(), lock_ref.numpy(), alive.numpy(),
                                              last_node.numpy(), cover.numpy(), valid.numpy(), max_depth, early_exit))
    if backend == "triton":  # four launches and a sort (`kernels.radix.lock_drops`)
        from .kernels.radix import lock_drops as lock_drops_triton

        return lock_drops_triton(parent.contiguous(), key_len.contiguous(), lock_ref.contiguous(), alive.contiguous(),
                                 last_node.contiguous(), cover.contiguous(), valid.contiguous())
    N = parent.numel()
    Q = last_node.numel()
    dev = parent.device
    D = N  # dummy node slot
    idx = torch.arange(Q, device=dev)
    ln = torch.where(valid, last_node, 0).clamp(0, N - 1)
    kl_last = key_len[ln]
    full = valid & (cover >= kl_last)
    partial = valid & ~full
    par_last = parent[ln]
    start = torch.where(full, ln, par_last)
    INF = Q
    start = torch.where(valid & (start > 0), start, D)
    f = torch.full((N + 1,), INF, dtype=torch.int64, device=dev)
    f = f.scatter_reduce(0, start, idx, reduce="amin", include_self=True)
    real = torch.arange(N + 1, device=dev) < N
    par_ext = torch.cat([parent, parent.new_full((1,), -1)])
    alive_ext = torch.cat([alive, alive.new_zeros(1)])
    anc = torch.where(real & alive_ext & (par_ext >= 0), par_ext, D)
    rounds = (N - 1).bit_length() if max_depth is None else min((N - 1).bit_length(), int(max_depth).bit_length())
    for _ in range(max(1, rounds)):
        g = f.scatter_reduce(0, anc, f, reduce="amin", include_self=True)
        if early_exit and torch.equal(g, f):
            break
        f = g
        anc = anc[anc]
    f = f[:N]
    any_partial = not early_exit or bool(partial.any())  # else every match ends at its node's end
    mp = 0
    if any_partial:  # largest partial cover of each node by a request before its F
        early = partial & (idx < f[ln])
        mp = torch.zeros(N + 1, dtype=torch.int64, device=dev)
        mp = mp.scatter_reduce(0, torch.where(early, ln, D), torch.where(early, cover, 0), reduce="amax",
                               include_self=True)[:N]
    node_ids = torch.arange(N, device=dev)
    gain_ok = alive & (lock_ref == 0) & (node_ids != 0) & (f < INF)
    w = torch.where(gain_ok, key_len - mp, 0)
    drop = torch.zeros(Q + 1, dtype=torch.int64, device=dev)
    drop = drop.scatter_add(0, torch.where(gain_ok, f, Q), w)[:Q]
    if not any_partial:
        return torch.where(valid, drop, 0)
    # partial covers: beyond the largest earlier partial cover of the same node
    key = torch.where(partial, ln, N)
    order = torch.sort(key, stable=True).indices
    ks, cs = key[order], torch.where(partial, cover, 0)[order]
    first = torch.ones(Q, dtype=torch.bool, device=dev)
    if Q > 1:
        first[1:] = ks[1:] != ks[:-1]
    grp = torch.cumsum(first.to(torch.int64), 0)
    big = 1 << 32
    incl = torch.cummax(grp * big + cs, 0).values - grp * big
    prev = torch.cat([incl.new_zeros(1), incl[:-1]]) if Q > 0 else incl
    prev = torch.where(first, 0, prev)
    prev_q = torch.zeros_like(prev).scatter(0, order, prev)
    pgain = (cover - prev_q).clamp(min=0)
    pok = partial & (lock_ref[ln] == 0) & (f[ln] > idx)
    return torch.where(valid, drop + torch.where(pok, pgain, 0), 0)


def match_lock_drops(parent: torch.Tensor, key_len: torch.Tensor, lock_ref: torch.Tensor, alive: torch.Tensor,
                     owner: torch.Tensor, key_off: torch.Tensor, m: torch.Tensor, pos: torch.Tensor,
                     valid: torch.Tensor, max_depth: Optional[int] = None, backend: str = "torch",
                     early_exit: bool = False) -> torch.Tensor:
    """`lock_drops` of requests given by their matches (R-RC-6; SPEC section 8): request i holds
    a match when valid[i] and m[i] > 0 (matched length [tokens]), whose last token sits at pool
    position pos[i] of the tree's node owner[pos[i]], pos[i] - key_off[node] + 1 tokens into
    it. Node arrays [N] as `lock_drops` (a prefix of the tree's); `owner` and `key_off` the
    tree's whole arrays; m, pos int64 [Q], valid bool [Q]. backend "triton" reads the matches
    in the kernels' first launch (`kernels.radix.lock_drops_matched`); else the node and cover
    by tensor ops, then `lock_drops`. int64 [Q]."""
    if backend == "triton":
        from .kernels.radix import lock_drops_matched

        return lock_drops_matched(parent.contiguous(), key_len.contiguous(), lock_ref.contiguous(), alive.contiguous(),
                                  owner.contiguous(), key_off.contiguous(), m.contiguous(), pos.contiguous(),
                                  valid.contiguous())
    has = valid & (m > 0)
    p = torch.where(has, pos, 0)
    node = torch.where(has, owner[p], 0)
    cover = p - key_off[node] + 1
    return lock_drops(parent, key_len, lock_ref, alive, node, cover, has, max_depth=max_depth, backend=backend,
                      early_exit=early_exit)


LOCK_WALK_MAX = 64  # `lock_drops` on the host: up to this many requests, Python walks of their paths


class LockDropWalk:
    """`lock_drops` of requests given one at a time in queue order (`add`), by walking their
    paths in Python: the first request to reach a node is its F (later walks stop there: the
    nodes above were reached first by the same or an earlier request), so the cost is the
    number of distinct path nodes, not the tree's node count (the rounds of
    `_lock_drops_host` scan every node). Request i's drop depends on requests 0..i only
    (first ranks, and the partial covers of a node before its F), so it is known when i is
    added: an admission loop walks only the requests it reaches. A walk goes up from a live
    node only (the rounds' `anc` stops at a dead one). Exact for any path depth (the rounds'
    result when `max_depth` bounds it). Node arrays are numpy views of the tree's columns,
    read as they are when each request is added (nothing on the tree may change between):
    numpy arrays, or memoryviews of them (`FlatRadixTree._mv`: Python ints per read, several
    times cheaper)."""

    __slots__ = ("parent", "key_len", "lock_ref", "alive", "top", "first", "mp", "prev")

    def __init__(self, parent, key_len, lock_ref, alive):
        self.parent, self.key_len, self.lock_ref, self.alive = parent, key_len, lock_ref, alive
        self.top = len(parent) - 1
        self.first = set()  # nodes some earlier request's whole-covered path holds (their F is known)
        self.mp = {}  # node -> largest partial cover of it before its F
        self.prev = {}  # node -> largest partial cover of it so far

    def add(self, last_node: int, cover: int, valid: bool) -> int:
        """The next request's drop [tokens]: its match ends `cover` tokens into node
        `last_node` (clipped to the node ids, as the other forms clip); 0 if not `valid`."""
        if not valid:
            return 0
        parent, key_len, lock_ref, alive = self.parent, self.key_len, self.lock_ref, self.alive
        first, mp = self.first, self.mp
        v0 = min(max(last_node, 0), self.top)
        drop = 0
        partial = cover < key_len[v0]
        v = int(parent[v0]) if partial else v0  # a match inside node v0: its whole path starts at the parent
        while v > 0 and v not in first:  # this request is F of every node it reaches first
            first.add(v)
            if not alive[v]:
                break
            if lock_ref[v] == 0:
                drop += int(key_len[v]) - mp.get(v, 0)
            v = int(parent[v])
        if partial:
            before = v0 not in first  # v0's F (if any) comes after this request
            if before and cover > mp.get(v0, 0):
                mp[v0] = cover
            p = self.prev.get(v0, 0)
            if cover > p:
                self.prev[v0] = cover
                if before and lock_ref[v0] == 0:
                    drop += cover - p
        return drop


def _lock_drops_walk(parent: np.ndarray, key_len: np.ndarray, lock_ref: np.ndarray, alive: np.ndarray,
                     last_node: List[int], cover: List[int], valid: List[bool]) -> List[int]:
    """`lock_drops` for a few requests (`LockDropWalk` over them in queue order). Takes the
    requests' columns as Python lists (node arrays as numpy views); returns the Q drops as a
    list."""
    walk = LockDropWalk(parent, key_len, lock_ref, alive)
    return [walk.add(v, c, ok) for v, c, ok in zip(last_node, cover, valid)]


def lock_drops_np(parent: np.ndarray, key_len: np.ndarray, lock_ref: np.ndarray, alive: np.ndarray,
                  last_node: np.ndarray, cover: np.ndarray, valid: np.ndarray, max_depth: Optional[int] = None,
                  early_exit: bool = False) -> np.ndarray:
    """`lock_drops` with numpy in and out (a CPU tree's views; arguments as there): Python
    walks of the requests' paths for up to LOCK_WALK_MAX requests (`_lock_drops_walk`), the
    static form's steps as numpy calls past that (`_lock_drops_host`). int64 [Q]."""
    if last_node.size <= LOCK_WALK_MAX:  # few requests: walk their paths, not every node
        return np.array(_lock_drops_walk(parent, key_len, lock_ref, alive, last_node.tolist(), cover.tolist(),
                                         valid.tolist()), dtype=np.int64)
    return _lock_drops_host(parent, key_len, lock_ref, alive, last_node, cover, valid, max_depth, early_exit)


def _lock_drops_host(parent: np.ndarray, key_len: np.ndarray, lock_ref: np.ndarray, alive: np.ndarray,
                     last_node: np.ndarray, cover: np.ndarray, valid: np.ndarray, max_depth: Optional[int],
                     early_exit: bool) -> np.ndarray:
    """`lock_drops`' torch form on host arrays (CPU tensors' views), step for step: scatter-min
    and scatter-max by `np.minimum.at` / `np.maximum.at`, scatter-add by `np.add.at`, the same
    doubling rounds and early exit. Some 40 numpy calls of 1-3 us where the torch form spends
    5-15 us per op on a CPU. Returns int64 [Q]."""
    N, Q = parent.size, last_node.size
    if Q == 0:
        return np.zeros(0, dtype=np.int64)
    D = N  # dummy node slot
    idx = np.arange(Q, dtype=np.int64)
    ln = np.minimum(np.maximum(np.where(valid, last_node, 0), 0), N - 1)  # np.clip costs 3x more
    full = valid & (cover >= key_len[ln])
    partial = valid & ~full
    start = np.where(full, ln, parent[ln])
    INF = Q
    f = np.full(N + 1, INF, dtype=np.int64)
    np.minimum.at(f, np.where(valid & (start > 0), start, D), idx)
    anc = np.full(N + 1, D, dtype=np.int64)
    anc[:N] = np.where(alive & (parent >= 0), parent, D)
    rounds = (N - 1).bit_length() if max_depth is None else min((N - 1).bit_length(), int(max_depth).bit_length())
    for _ in range(max(1, rounds)):
        g = f.copy()
        np.minimum.at(g, anc, f)
        if early_exit and np.array_equal(g, f):
            break
        f = g
        anc = anc[anc]
    f = f[:N]
    any_partial = not early_exit or bool(partial.any())
    mp = 0
    if any_partial:
        early = partial & (idx < f[ln])
        mp = np.zeros(N + 1, dtype=np.int64)
        np.maximum.at(mp, np.where(early, ln, D), np.where(early, cover, 0))
        mp = mp[:N]
    gain_ok = alive & (lock_ref == 0) & (np.arange(N) != 0) & (f < INF)
    drop = np.zeros(Q + 1, dtype=np.int64)
    np.add.at(drop, np.where(gain_ok, f, Q), np.where(gain_ok, key_len - mp, 0))
    drop = drop[:Q]
    if not any_partial:
        return np.where(valid, drop, 0)
    key = np.where(partial, ln, N)
    order = np.argsort(key, kind="stable")
    ks, cs = key[order], np.where(partial, cover, 0)[order]
    first = np.ones(Q, dtype=bool)
    first[1:] = ks[1:] != ks[:-1]
    grp = np.cumsum(first, dtype=np.int64)
    big = 1 << 32
    incl = np.maximum.accumulate(grp * big + cs) - grp * big
    prev = np.where(first, 0, np.concatenate([[0], incl[:-1]]))
    prev_q = np.empty(Q, dtype=np.int64)
    prev_q[order] = prev
    pgain = np.maximum(cover - prev_q, 0)
    pok = partial & (lock_ref[ln] == 0) & (f[ln] > idx)
    return np.where(valid, drop + np.where(pok, pgain, 0), 0)


# ---- R-ADM-6: the ignore-EOS reservation scan as a grid ---------------------------------------------
def eos_states(max_new, out_len, prompt_len, ignore_eos, ratio):
    """(left float64 [n], occupied int64 [n]) of R-ADM-6 / D7: `float64(max_new * ratio') -
    len(out)`, `occupied = prompt_len + out_len` [tokens]. max_new, out_len, prompt_len int
    [n], ignore_eos bool [n]; `ratio` a float64 tensor (0-d), not a Python float."""
    r = torch.where(ignore_eos, torch.ones_like(ratio), ratio)
    left = max_new.to(torch.float64) * r - out_len.to(torch.float64)
    return left, prompt_len + out_len


def ignore_eos_fail(c: torch.Tensor, q_left, q_occ, q_valid, h_left, h_occ, h_valid, rows: int = 512,
                    backend: str = "torch"):
    """fail [Q] bool: candidate j fails the reservation scan of R-ADM-6 with `c[j] = cur_rem_j -
    ceilP(ext_j)`, its states being the held ones (`h_*`, [R]) and queue entries 0..j (`q_*`, [Q]).

    All states are sorted once by `left` (stable; the result does not depend on ties); row j masks
    out queue entries after j; freed_k and bs_k are masked prefix sums along the sorted order;
    the row fails where any kept position has `float64(c + freed_k) - float64(left_k * bs_k) <= bs_k`.
    `backend` "triton": the rows run as `gpu_sched.kernels.ignore_eos.ignore_eos_scan`.
    """
    Q = c.numel()
    dev = c.device
    left = torch.cat([h_left, q_left])
    occ = torch.cat([h_occ, q_occ])
    qidx = torch.cat([torch.full_like(h_occ, -1), torch.arange(Q, device=dev)])
    keep = torch.cat([h_valid, q_valid]) & (left > 0)
    key = torch.where(keep, left, torch.full_like(left, float("inf")))
    order = torch.sort(key, stable=True).indices
    left_s, occ_s, qidx_s, keep_s = left[order], occ[order], qidx[order], keep[order]
    if backend == "triton":
        from .kernels.ignore_eos import ignore_eos_scan
        return ignore_eos_scan(c.contiguous(), left_s, occ_s, qidx_s, keep_s)
    out = []
    for r0 in range(0, Q, rows):
        j = torch.arange(r0, min(Q, r0 + rows), device=dev)
        m = keep_s[None, :] & (qidx_s[None, :] <= j[:, None])
        mo = torch.where(m, occ_s[None, :], 0)
        freed = torch.cumsum(mo, 1) - mo
        mc = m.to(torch.int64)
        cnt = torch.cumsum(mc, 1)
        bs = (cnt[:, -1:] - cnt + mc).to(torch.float64)
        test = (c[j][:, None] + freed).to(torch.float64) - left_s[None, :] * bs <= bs
        out.append((m & test).any(1))
    if not out:
        return torch.zeros(0, dtype=torch.bool, device=dev)
    return torch.cat(out)


# ---- R-ADM-7: one preemption attempt ---------------------------------------------------------------
class PreemptResult(NamedTuple):
    victims: torch.Tensor  # bool [R], running-batch order
    success: torch.Tensor  # 0-d bool
    V: torch.Tensor  # 0-d int64: sum of the victims' reservations


def _gt_shifted(a: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """a > b + t for int64 tensors and a Python int t, without int64 overflow."""
    if t >= 0:
        return torch.where(b > INT64_MAX - t, False, a > b + t)
    return torch.where(b < INT64_MIN - t, True, a > b + t)


def preempt_select(valid, priority, enqueue_time, reserve, r_priority, base, ratio, N,
                   sign: int, threshold: int, backend: str = "torch") -> PreemptResult:
    """R-ADM-7 for one request: which running requests to preempt (D5: `base = ext +
    min(max_new, CLIP) - (A + evictable - I)` with the re-matched ext).

    Running batch [R]: `valid` bool, `priority` int64, `enqueue_time` float64, `reserve` int64
    `min(max_new - len(out), CLIP)`. Victims are sorted by (priority * -sign, -enqueue_time),
    stable (bitwise-not instead of negation: no overflow at the absent priorities); a victim is
    eligible while `(r_priority - priority) * -sign > threshold`; the walk stops at the first
    ineligible one or as soon as `float64(base) + float64(ratio * (N - V)) <= 0`. `backend`
    "triton": the walk (eligibility, cumulative reservations, cut) is
    `gpu_sched.kernels.preempt.preempt_cut` over the device-sorted victims.
    """
    R = valid.numel()
    dev = valid.device
    # least important first: (priority * -sign) ascending, then newest first; stable
    o1 = torch.sort(torch.where(valid, -enqueue_time, float("inf")), stable=True).indices
    pk = priority if sign < 0 else ~priority
    pk = torch.where(valid, pk, INT64_MAX)
    o2 = torch.sort(pk[o1], stable=True).indices
    order = o1[o2]
    vs, ps, rs = valid[order], priority[order], reserve[order]
    ar = torch.arange(R, device=dev)
    if backend == "triton":
        from .kernels.preempt import preempt_cut
        kstar = preempt_cut(ps, rs, vs, r_priority, base, ratio, N, sign, threshold)
        success = kstar < R
        take = success & (ar <= kstar)
        victims = torch.zeros(R, dtype=torch.bool, device=dev).scatter(0, order, take)
        return PreemptResult(victims, success, torch.where(take, rs, 0).sum())
    if sign < 0:  # neg = +1: r - v > threshold
        elig = _gt_shifted(r_priority.expand(R), ps, threshold)
    else:  # neg = -1: v - r > threshold
        elig = _gt_shifted(ps, r_priority.expand(R), threshold)
    elig = vs & elig
    run = torch.cumprod(elig.to(torch.int64), 0).to(torch.bool)
    V = torch.cumsum(torch.where(run, rs, 0), 0)
    need = base.to(torch.float64) + ratio * (N - V).to(torch.float64)
    hit = run & (need <= 0)
    kstar = torch.where(hit, ar, R).min() if R else torch.zeros((), dtype=torch.int64, device=dev) + R
    success = kstar < R
    take = success & (ar <= kstar)
    victims = torch.zeros(R, dtype=torch.bool, device=dev).scatter(0, order, take)
    Vt = torch.where(take, rs, 0).sum()
    return PreemptResult(victims, success, Vt)


# ---- per-request checks of one round -------------------------------------------------------------
def eval_requests(cfg: StepConfig, sc: torch.Tensor, rn: torch.Tensor, fill, pre, out, maxn, drop, ie, fail,
                  exI, exC, exE, exD):
    """Every check of R-STEP-3 / R-ADM-3 for every request j, assuming the loop reaches j with all
    of 0..j-1 admitted (whole, after the round's chunk corrections).

    sc int64 [9] = (A, evictable, I, cur_off, rem_input, rem_chunk, can_run, running_bs,
    batch_full) at the round's start (corrections included); rn = float64(ratio * N); per-request
    int64 columns and the exclusive prefix sums of the whole commits (exI, exC, exE) and drops
    (exD); `fail` the ignore-EOS scan result. Returns (stop, kind, chunk length t, full mark):
    the STOP_* code after j (STOP_NONE: the loop goes on), KIND_* of j's admission, the extend
    length a chunk of j would get, and whether j's iteration marks the batch full. The columns
    may also be numpy arrays (with `sc` a sequence and `rn` a float): `admit_step_host`'s CPU
    form, the same formulas.
    """
    P = cfg.page_size
    host = isinstance(fill, np.ndarray)  # `admit_step_host`'s CPU form: numpy arrays, sc a sequence
    A, ev0, I, cur, rin, rc, can_run, running_bs, full0 = sc if host else sc.unbind(0)
    if host:
        ar, false = np.arange(fill.size), np.zeros(fill.size, dtype=bool)
    else:
        ar = torch.arange(fill.numel(), device=fill.device)
        false = torch.zeros(fill.numel(), dtype=torch.bool, device=fill.device)
    ext = fill - pre
    e = _ceil_p(ext, P)
    res = _clamp(maxn, hi=cfg.clip)
    mn = _clamp(maxn - out, lo=0, hi=cfg.clip)
    total = _f64(ext + mn + P)
    Ij, curj, rinj, rcj = I + exI, cur + exC, rin - exE, rc - exE
    ev = ev0 - exD
    cnt = can_run + ar
    rt = _f64(A + ev - Ij) - rn
    cr = A + ev - curj
    passed1 = _budget(rt, cr, rinj, rcj, cfg.chunking) != _OTH
    cap_hit = (running_bs + cnt >= cfg.max_running) if cfg.max_running is not None else false
    full = (full0 != 0) | cap_hit
    pmr_hit = (cnt >= cfg.prefill_max) if cfg.prefill_max is not None else false
    # normal path (R-ADM-3 steps 3-7)
    nt1 = total >= rt
    oth = (cnt > 0) & (e >= rinj) if not cfg.chunking else false
    ev2 = ev - drop
    nt2 = total >= _f64(A + ev2 - Ij) - rn
    refuse = _where(nt1, _NT, _where(oth, _OTH, _where(nt2, _NT, _CONT)))
    whole = (e <= rcj) if cfg.chunking else ~false
    t = _floor_p(rcj, P)
    chunk_bad = false
    if cfg.align is not None:
        chunk_bad = t < cfg.align
        t = _floordiv(t, cfg.align) * cfg.align
    t = _floor_p(pre + t, P) - pre
    chunk_bad = chunk_bad | (t <= 0)
    refuse = _where((refuse == _CONT) & ~whole & chunk_bad, _OTH, refuse)
    tc = t
    ev_after = ev2
    if cfg.ignore_eos_path:  # R-ADM-6
        iep = ie
        nt_b = (e > cr) | (_f64(e) > rt) | fail
        whole_b = (ext <= rcj) if cfg.chunking else ~false
        ref_b = _where(nt_b, _NT, _where(~whole_b & (rcj <= 0), _OTH, _CONT))
        refuse = _where(iep, ref_b, refuse)
        whole = _where(iep, whole_b, whole)
        tc = _where(iep, rcj, tc)
        ev_after = _where(iep, ev, ev2)
    ecn = _ceil_p(tc, P)
    dI = _where(whole, e + res + P, ecn + P)
    dC = _where(whole, e + P, ecn + P)
    dE = _where(whole, e, ecn)
    after = _budget(_f64(A + ev_after - (Ij + dI)) - rn, A + ev_after - (curj + dC),
                    rinj - dE, rcj - dE, cfg.chunking)
    pre_stop = _where(~passed1, STOP_BUDGET_OTHER,
                           _where(full, STOP_PREEMPT if cfg.preemption else STOP_BATCH_FULL,
                                       _where(pmr_hit, STOP_OTHER, STOP_NONE)))
    add_stop = _where(refuse == _NT, STOP_NO_TOKEN, _where(refuse == _OTH, STOP_OTHER,
                           _where(after == _NT, STOP_NO_TOKEN,
                                       _where(after == _OTH, STOP_OTHER, STOP_NONE))))
    stop = _where(pre_stop != STOP_NONE, pre_stop, add_stop)
    admits = (pre_stop == STOP_NONE) & (refuse == _CONT)
    kind = _where(admits, _where(whole, KIND_WHOLE, KIND_CHUNK), KIND_NONE)
    return stop, kind, tc, passed1 & cap_hit


def _held_states(held: Optional[HeldCols], chunked: Optional[ChunkedCols], ratio: torch.Tensor, dev):
    """R-ADM-6 states of the running requests (`held`) and the in-flight chunk (if given):
    (left float64 [R'], occupied int64 [R'], valid bool [R'])."""
    if held is not None:
        h_left, h_occ = eos_states(held.max_new, held.out_len, held.prompt_len, held.ignore_eos, ratio)
        h_valid = held.valid
    else:
        h_left = torch.zeros(0, dtype=torch.float64, device=dev)
        h_occ = torch.zeros(0, dtype=torch.int64, device=dev)
        h_valid = torch.zeros(0, dtype=torch.bool, device=dev)
    if chunked is not None:
        cl, co = eos_states(chunked.max_new, chunked.out_len, chunked.prompt_len, chunked.ignore_eos, ratio)
        h_left, h_occ = torch.cat([h_left, cl.reshape(1)]), torch.cat([h_occ, co.reshape(1)])
        h_valid = torch.cat([h_valid, chunked.present.reshape(1)])
    return h_left, h_occ, h_valid


# ---- the step ------------------------------------------------------------------------------------
class _QueueSums(NamedTuple):
    """The queue's columns padded by one entry (index Q: where a loop that reached the end
    "stops") and the round-independent prefix sums of whole commits (module doc)."""

    ar: torch.Tensor
    valid: torch.Tensor
    fill: torch.Tensor
    out: torch.Tensor
    prompt: torch.Tensor
    maxn: torch.Tensor
    pre: torch.Tensor
    drop: torch.Tensor
    ie: torch.Tensor
    e: torch.Tensor  # ceilP(extend)
    wI: torch.Tensor  # whole commit of I, cur_off
    wC: torch.Tensor
    exI: torch.Tensor  # exclusive prefix sums over valid entries
    exC: torch.Tensor
    exE: torch.Tensor
    exD: torch.Tensor


def _queue_sums(cfg: StepConfig, q: QueueCols, n) -> _QueueSums:
    """`_QueueSums` of q's columns: torch tensors, or numpy arrays (`admit_step_host`'s CPU
    form, n an int)."""
    if isinstance(q.fill_len, np.ndarray):
        def pad(x, v=0):
            return np.concatenate([x, np.full(1, v, dtype=x.dtype)])

        ar = np.arange(q.fill_len.size + 1)
        valid = ar < n
        vm = valid.astype(np.int64)
    else:
        def pad(x, v=0):
            return torch.cat([x, x.new_full((1,), v)])

        ar = torch.arange(q.fill_len.numel() + 1, device=q.fill_len.device)
        valid = ar < n
        vm = valid.to(torch.int64)
    fill, pre = pad(q.fill_len), pad(q.prefix_len)
    maxn, drop = pad(q.max_new), pad(q.drop)
    e = _ceil_p(fill - pre, cfg.page_size)
    res = _clamp(maxn, hi=cfg.clip)
    wI, wC = e + res + cfg.page_size, e + cfg.page_size
    return _QueueSums(ar, valid, fill, pad(q.out_len), pad(q.prompt_len), maxn, pre, drop, pad(q.ignore_eos, False),
                      e, wI, wC, _excl_cumsum(wI * vm), _excl_cumsum(wC * vm), _excl_cumsum(e * vm),
                      _excl_cumsum(drop * vm))


def admit_step(cfg: StepConfig, st: StepState, q: QueueCols, held: Optional[HeldCols] = None,
               chunked: Optional[ChunkedCols] = None, backend: str = "torch",
               early_exit: bool = False, sv: Optional[torch.Tensor] = None) -> StepResult:
    """R-ADM-5 (the in-flight chunked request, if given) and R-STEP-3 over the ordered queue,
    exactly as the sequential loop decides; see the module doc. `held` is needed only with
    `cfg.ignore_eos_path`. The loop stops with `STOP_PREEMPT` where a full batch would try
    priority preemption (the host runs R-ADM-7 and calls again for the rest). `backend` "triton"
    runs the per-request checks and the ignore-EOS grid as Triton kernels (`gpu_sched.kernels`).
    `early_exit`: skip the rounds left once the loop's end is reached (a round after that
    changes nothing), at the cost of one host read per round: for eager callers, never inside
    a recorded graph. `sv` (backend "triton" only): the loop's scalar inputs already packed,
    int64 [SV_LEN] in `kernels.admission`'s SV_* order (a recorded step gathers them in one
    op); then the scalars of `st` are not read but its ratio (and its available budget on the
    ignore-EOS path), nor `q.n`, nor those of `chunked` but on the ignore-EOS path."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    if backend == "triton":
        return _admit_step_triton(cfg, st, q, held, chunked, early_exit, sv)
    if sv is not None:
        raise ValueError("admit_step: packed scalars (sv) are for backend 'triton'")
    P = cfg.page_size
    Q = q.fill_len.numel()
    dev = q.fill_len.device
    i64 = torch.int64

    n = q.n
    qs = _queue_sums(cfg, q, n)
    ar, valid, fill, out, prompt, maxn, pre, drop, ie = qs[:9]
    A, ev0, ratio = st.available, st.evictable, st.ratio
    rn = ratio * st.N.to(torch.float64)  # float64(ratio * N), D7
    I, cur, rin = st.I, st.cur_off, st.rem_input
    rc = st.rem_chunk if cfg.chunking else torch.zeros((), dtype=i64, device=dev)
    zero = torch.zeros((), dtype=i64, device=dev)
    can_run0 = st.can_run
    in_tokens = zero
    inflight_end, inflight_left = zero, torch.zeros((), dtype=torch.bool, device=dev)

    # R-ADM-5: the in-flight chunked request comes first
    if chunked is not None:
        rt = (A + ev0 - I).to(torch.float64) - rn
        room = torch.minimum(rc, rt.to(i64))
        room = torch.where(room <= 0, rc, room)
        ext_c = chunked.fill_len - chunked.prefix_len
        nc = torch.clamp(torch.minimum(ext_c, room), min=0)  # none for rem_chunk < 0 (`add_chunked_req`)
        ec = _ceil_p(nc, P)
        resc = torch.where(nc == ext_c, torch.clamp(chunked.max_new, max=cfg.clip), 0)
        pr = chunked.present
        I = torch.where(pr, I + ec + resc + P, I)
        cur = torch.where(pr, cur + ec + P, cur)
        rin = torch.where(pr, rin - ec, rin)
        rc = torch.where(pr, rc - ec, rc)
        in_tokens = torch.where(pr, ec, zero)
        inflight_end = torch.where(pr, chunked.prefix_len + nc, zero)
        inflight_left = pr & (nc < ext_c)
        can_run0 = can_run0 + pr.to(i64)
    rin_loop = rin

    # per-request quantities (independent of the round)
    e, wI, wC, exI, exC, exE, exD = qs[9:]
    ev = ev0 - exD
    false = torch.zeros(Q + 1, dtype=torch.bool, device=dev)
    iep = ie & cfg.ignore_eos_path
    if cfg.ignore_eos_path:
        q_left, q_occ = eos_states(maxn, out, prompt, ie, ratio)
        h_left, h_occ, h_valid = _held_states(held, chunked, ratio, dev)

    # round state
    s = zero
    cI, cC, cE = zero, zero, zero
    done = torch.zeros((), dtype=torch.bool, device=dev)
    k_fin, stop_fin, kind_fin = zero, zero, zero
    chunk_idx, chunk_len = zero - 1, zero
    end_vec = fill
    I_fin, cur_fin, rin_fin, rc_fin, ev_fin = I, cur, rin, rc, ev0
    full_fin = st.batch_full
    for r in range(cfg.rounds):
        sc = torch.stack([A, ev0, I + cI, cur + cC, rin + cE, rc + cE, can_run0, st.running_bs,
                          st.batch_full.to(i64)]).to(i64)
        if cfg.ignore_eos_path:  # R-ADM-6 reservation scan, c_j = cur_rem_j - ceilP(ext_j)
            c = (A + ev - (cur + cC + exC)) - e
            if backend == "triton":
                fail = ignore_eos_fail(c[:Q], q_left[:Q], q_occ[:Q], valid[:Q], h_left, h_occ, h_valid,
                                       backend="triton")
            else:
                fail = ignore_eos_fail(c[:Q], q_left[:Q], q_occ[:Q], valid[:Q], h_left, h_occ, h_valid,
                                       rows=cfg.grid_rows)
            fail = torch.cat([fail, false[:1]])
        else:
            fail = false
        if backend == "triton":
            from .kernels.admission import eval_requests as k_eval
            stop_j, kind_j, tc, mark_j = k_eval(cfg, sc, rn, fill, pre, out, maxn, drop, ie, fail, exI, exC, exE, exD)
        else:
            stop_j, kind_j, tc, mark_j = eval_requests(cfg, sc, rn, fill, pre, out, maxn, drop, ie, fail,
                                                       exI, exC, exE, exD)
        event = valid & (ar >= s) & ~((kind_j == KIND_WHOLE) & (stop_j == STOP_NONE))
        k = torch.where(event, ar, n).min()
        atend = k >= n
        stop_k = torch.where(atend, STOP_QUEUE_END, _at(stop_j, k))
        kind_k = torch.where(atend, KIND_NONE, _at(kind_j, k))
        tc_k = _at(tc, k)
        # one chunk a step (`PrefillAdder.add_one_req`): a second is refused, OTHER
        again = (kind_k == KIND_CHUNK) & (chunk_idx >= 0)
        stop_k = torch.where(again, STOP_OTHER, stop_k)
        kind_k = torch.where(again, KIND_NONE, kind_k)
        whole_k = kind_k == KIND_WHOLE
        e_k, ec_k = _at(e, k), _ceil_p(tc_k, P)
        dI = torch.where(whole_k, _at(wI, k), ec_k + P)
        dC = torch.where(whole_k, _at(wC, k), ec_k + P)
        dE = torch.where(whole_k, e_k, ec_k)
        live = ~done
        is_chunk = live & (kind_k == KIND_CHUNK)
        chunk_idx = torch.where(is_chunk, k, chunk_idx)
        chunk_len = torch.where(is_chunk, tc_k, chunk_len)
        end_vec = torch.where((ar == k) & is_chunk, _at(pre, k) + tc_k, end_vec)
        upd = is_chunk & (stop_k == STOP_NONE)
        Ik, curk = I + cI + _at(exI, k), cur + cC + _at(exC, k)
        rink, rck = rin + cE - _at(exE, k), rc + cE - _at(exE, k)
        cI = torch.where(upd, cI + dI - _at(wI, k), cI)
        cC = torch.where(upd, cC + dC - _at(wC, k), cC)
        cE = torch.where(upd, cE + e_k - dE, cE)
        s = torch.where(upd, k + 1, s)
        term = live & ~upd
        adm = kind_k != KIND_NONE
        z = torch.zeros_like(k)
        k_fin = torch.where(term, k, k_fin)
        stop_fin = torch.where(term, stop_k, stop_fin)
        kind_fin = torch.where(term, kind_k, kind_fin)
        I_fin = torch.where(term, Ik + torch.where(adm, dI, z), I_fin)
        cur_fin = torch.where(term, curk + torch.where(adm, dC, z), cur_fin)
        rin_fin = torch.where(term, rink - torch.where(adm, dE, z), rin_fin)
        rc_fin = torch.where(term, rck - torch.where(adm, dE, z), rc_fin)
        ev_k = _at(ev, k)
        ev_after = torch.where(_at(iep, k), ev_k, ev_k - _at(drop, k))
        ev_fin = torch.where(term, torch.where(adm, ev_after, ev_k), ev_fin)
        fl = st.batch_full | (~atend & _at(mark_j, k))
        fl = torch.where(stop_k == STOP_NO_TOKEN, (can_run0 + k + adm.to(i64) > 0) | (st.running_bs > 0), fl)
        full_fin = torch.where(term, fl, full_fin)
        done = done | term
        if early_exit and r + 1 < cfg.rounds and bool(done):
            break

    admitted = valid & ((ar < k_fin) | ((ar == k_fin) & (kind_fin != KIND_NONE)))
    hit = torch.where(admitted & ~iep, pre, 0).sum()
    rem_total = (A + ev_fin - I_fin).to(torch.float64) - rn
    return StepResult(
        admitted=admitted[:Q], extend_start=pre[:Q], extend_end=end_vec[:Q], stop_index=k_fin, stop=stop_fin,
        chunk_index=chunk_idx, chunk_len=chunk_len, batch_full=full_fin, inflight_end=inflight_end,
        inflight_left=inflight_left, I=I_fin, cur_off=cur_fin, rem_input=rin_fin, rem_chunk=rc_fin,
        evictable=ev_fin, rem_total=rem_total, cur_rem=A + ev_fin - cur_fin, hit_tokens=hit,
        input_tokens=in_tokens + (rin_loop - rin_fin), decided=done)


# ---- the eager form: the rounds' scalar state on the host ------------------------------------------
class HostStepResult(NamedTuple):
    """`admit_step_host`'s result: what `StepResult` holds, as Python values. `admitted` is
    the length of the admitted prefix of the queue and `extend_end` its extend ends [tokens]
    (a chunked admission's truncated end included); rem_total and cur_rem follow from the
    budgets (`A + evictable - I - ratio * N`, `A + evictable - cur_off`)."""

    admitted: int
    extend_end: list
    stop_index: int
    stop: int
    chunk_index: int
    chunk_len: int
    batch_full: bool
    inflight_end: int
    inflight_left: bool
    I: int
    cur_off: int
    rem_input: int
    rem_chunk: int
    evictable: int
    hit_tokens: int
    input_tokens: int
    decided: bool


def read_step_result(res: StepResult) -> HostStepResult:
    """`admit_step`'s tensor result as a `HostStepResult`, in one read-back (the admitted
    entries are a prefix of the queue: the loop admits in order until it stops)."""
    i64 = torch.int64
    if res.packed is not None:  # the same 16 values, packed in this order (`kernels.admission.R_*`)
        head = res.packed[:16]
    else:
        head = torch.stack([res.admitted.sum(), res.stop_index, res.stop, res.chunk_index, res.chunk_len,
                            res.batch_full.to(i64), res.inflight_end, res.inflight_left.to(i64), res.I, res.cur_off,
                            res.rem_input, res.rem_chunk, res.evictable, res.hit_tokens, res.input_tokens,
                            res.decided.to(i64)])
    vals = torch.cat([head, res.extend_end]).tolist()
    na = vals[0]
    return HostStepResult(na, vals[16 : 16 + na], *vals[1:5], bool(vals[5]), vals[6], bool(vals[7]), *vals[8:15],
                          bool(vals[15]))


def _py(x):
    """A 0-d tensor's value (one host read) or the number itself."""
    return x.item() if isinstance(x, torch.Tensor) else x


def _ceil_i(x: int, P: int) -> int:
    return -((-x) // P) * P


def admit_step_host(cfg: StepConfig, st: StepState, q: QueueCols, held: Optional[HeldCols] = None,
                    chunked: Optional[ChunkedCols] = None) -> HostStepResult:
    """`admit_step` for eager callers of the torch backend: the same per-request checks
    (`eval_requests`, the ignore-EOS grid) as tensors over the queue, but each round's event
    (the first index that is not "admit whole, budget CONTINUE") is read back with the values
    at it, and the round's state update (R-STEP-3's budget commits, R-ADM-3's chunk, the
    batch-full mark) is done in Python integers and float64 floats, exactly as `admit_step`'s
    tensor formulas do it. That replaces some 90 scalar tensor ops per round (a few us each
    on a CPU, a kernel launch each on a GPU) by two reads.

    Args: as `admit_step`; the fields of `st`, `q.n` and `chunked` may be Python numbers or
    0-d tensors (read once), and without the ignore-EOS path q's columns may be numpy arrays
    (the CPU form runs on them as they are). Returns `HostStepResult`. Tests hold it equal to
    `admit_step` field by field (`tests/test_step_core.py`).
    """
    P = cfg.page_size
    Q = len(q.fill_len)
    dev = q.fill_len.device if isinstance(q.fill_len, torch.Tensor) else torch.device("cpu")
    i64 = torch.int64
    A, ev0, N = int(_py(st.available)), int(_py(st.evictable)), int(_py(st.N))
    ratio = float(_py(st.ratio))
    rn = ratio * float(N)  # float64(ratio * N), D7 (Python floats are IEEE doubles)
    I, cur, rin = int(_py(st.I)), int(_py(st.cur_off)), int(_py(st.rem_input))
    rc = int(_py(st.rem_chunk)) if cfg.chunking else 0
    can_run0, running_bs, full0 = int(_py(st.can_run)), int(_py(st.running_bs)), bool(_py(st.batch_full))
    n = int(_py(q.n))
    in_tokens, inflight_end, inflight_left = 0, 0, False

    # R-ADM-5: the in-flight chunked request comes first
    if chunked is not None and bool(_py(chunked.present)):
        c_fill, c_pre, c_max = (int(_py(v)) for v in (chunked.fill_len, chunked.prefix_len, chunked.max_new))
        rt = float(A + ev0 - I) - rn
        room = min(rc, int(rt))  # float64 -> int64 truncates toward zero, as int() does
        room = rc if room <= 0 else room
        ext_c = c_fill - c_pre
        nc = max(min(ext_c, room), 0)  # none for rem_chunk < 0 (`add_chunked_req`)
        ec = _ceil_i(nc, P)
        resc = min(c_max, cfg.clip) if nc == ext_c else 0
        I, cur, rin, rc = I + ec + resc + P, cur + ec + P, rin - ec, rc - ec
        in_tokens, inflight_end, inflight_left = ec, c_pre + nc, nc < ext_c
        can_run0 += 1
    rin_loop = rin

    # CPU tensors without the ignore-EOS grid: the checks run as numpy calls on their views
    # (each 1-3 us where a torch CPU op costs 5-15 us); the same formulas (`eval_requests`)
    host = not cfg.ignore_eos_path and (isinstance(q.fill_len, np.ndarray) or _host(q.fill_len))
    if host:  # numpy columns as they are, CPU tensors as their views
        q = QueueCols(n, *(v if isinstance(v, np.ndarray) else v.numpy() for v in q[1:]))
    qs = _queue_sums(cfg, q, n)
    ar, valid, fill, out, prompt, maxn, pre, drop, ie, e, wI, wC, exI, exC, exE, exD = qs
    ev = ev0 - exD
    iep = ie & cfg.ignore_eos_path
    exH = _excl_cumsum(_where(iep | ~valid, 0, pre))  # hit tokens of a prefix (ignore-EOS ones count none)
    # every column the round update reads at the event: one stacked read-back for tensors, read
    # one by one at the event for numpy arrays (no copy of the columns)
    cols = [e, wI, wC, pre, exI, exC, exE, ev, drop, iep, exH]
    cols = cols if host else torch.stack(cols[:9] + [iep.to(i64), exH])
    false = np.zeros(Q + 1, dtype=bool) if host else torch.zeros(Q + 1, dtype=torch.bool, device=dev)
    rn_t = rn if host else torch.tensor(rn, dtype=torch.float64, device=dev)
    if cfg.ignore_eos_path:
        ratio_t = torch.tensor(ratio, dtype=torch.float64, device=dev)
        q_left, q_occ = eos_states(maxn, out, prompt, ie, ratio_t)
        h_left, h_occ, h_valid = _held_states(held, chunked if chunked is None else ChunkedCols(
            *(torch.as_tensor(_py(v), device=dev) for v in chunked)), ratio_t, dev)

    s, cI, cC, cE = 0, 0, 0, 0
    done = False
    k_fin = stop_fin = kind_fin = 0
    chunk_idx, chunk_len, chunk_ends = -1, 0, {}
    I_fin, cur_fin, rin_fin, rc_fin, ev_fin, full_fin, hit = I, cur, rin, rc, ev0, full0, 0
    for _ in range(cfg.rounds):
        sc = [A, ev0, I + cI, cur + cC, rin + cE, rc + cE, can_run0, running_bs, int(full0)]
        sc = np.array(sc, dtype=np.int64) if host else torch.tensor(sc, dtype=i64, device=dev)
        fail = false
        if cfg.ignore_eos_path:  # R-ADM-6 reservation scan, c_j = cur_rem_j - ceilP(ext_j)
            c = (A + ev - (cur + cC + exC)) - e
            fail = torch.cat([ignore_eos_fail(c[:Q], q_left[:Q], q_occ[:Q], valid[:Q], h_left, h_occ, h_valid,
                                              rows=cfg.grid_rows), false[:1]])
        stop_j, kind_j, tc, mark_j = eval_requests(cfg, sc, rn_t, fill, pre, out, maxn, drop, ie, fail,
                                                   exI, exC, exE, exD)
        event = valid & (ar >= s) & ~((kind_j == KIND_WHOLE) & (stop_j == STOP_NONE))
        k = int(_where(event, ar, n).min())
        if host:
            stop_r, kind_r, tc_k, mark_k = int(stop_j[k]), int(kind_j[k]), int(tc[k]), int(mark_j[k])
        else:
            stop_r, kind_r, tc_k, mark_k = torch.stack([stop_j, kind_j, tc, mark_j.to(i64)])[:, k].tolist()
        e_k, wI_k, wC_k, pre_k, exI_k, exC_k, exE_k, ev_k, drop_k, iep_k, exH_k = (
            [int(c[k]) for c in cols] if host else cols[:, k].tolist())
        atend = k >= n
        stop_k = STOP_QUEUE_END if atend else stop_r
        kind_k = KIND_NONE if atend else kind_r
        if kind_k == KIND_CHUNK and chunk_idx >= 0:  # one chunk a step (`PrefillAdder.add_one_req`)
            stop_k, kind_k = STOP_OTHER, KIND_NONE
        whole_k = kind_k == KIND_WHOLE
        ec_k = _ceil_i(tc_k, P)
        dI = wI_k if whole_k else ec_k + P
        dC = wC_k if whole_k else ec_k + P
        dE = e_k if whole_k else ec_k
        if kind_k == KIND_CHUNK:
            chunk_idx, chunk_len = k, tc_k
            chunk_ends[k] = pre_k + tc_k
        upd = kind_k == KIND_CHUNK and stop_k == STOP_NONE
        Ik, curk = I + cI + exI_k, cur + cC + exC_k
        rink, rck = rin + cE - exE_k, rc + cE - exE_k
        if upd:  # a chunk that leaves the budget at CONTINUE: the loop goes on after it
            cI, cC, cE, s = cI + dI - wI_k, cC + dC - wC_k, cE + e_k - dE, k + 1
            continue
        adm = kind_k != KIND_NONE
        k_fin, stop_fin, kind_fin = k, stop_k, kind_k
        I_fin, cur_fin = Ik + (dI if adm else 0), curk + (dC if adm else 0)
        rin_fin, rc_fin = rink - (dE if adm else 0), rck - (dE if adm else 0)
        ev_fin = (ev_k if iep_k else ev_k - drop_k) if adm else ev_k
        full_fin = full0 or (not atend and bool(mark_k))
        if stop_k == STOP_NO_TOKEN:
            full_fin = can_run0 + k + int(adm) > 0 or running_bs > 0
        hit = exH_k + (pre_k if adm and not iep_k else 0)
        done = True
        break
    na = k_fin + int(kind_fin != KIND_NONE) if done else 0
    ends = fill[:na].tolist()
    for j, end in chunk_ends.items():  # admitted chunks end where they were truncated
        if j < na:
            ends[j] = end
    return HostStepResult(
        admitted=na, extend_end=ends, stop_index=k_fin, stop=stop_fin, chunk_index=chunk_idx, chunk_len=chunk_len,
        batch_full=full_fin, inflight_end=inflight_end, inflight_left=inflight_left, I=I_fin, cur_off=cur_fin,
        rem_input=rin_fin, rem_chunk=rc_fin, evictable=ev_fin, hit_tokens=hit,
        input_tokens=in_tokens + (rin_loop - rin_fin), decided=done)


def _admit_step_triton(cfg: StepConfig, st: StepState, q: QueueCols, held: Optional[HeldCols],
                       chunked: Optional[ChunkedCols], early_exit: bool, sv: Optional[torch.Tensor] = None) -> StepResult:
    """`admit_step` with backend "triton": the same computation in a few launches. Before the
    rounds, `kernels.admission.admission_prepare` (the in-flight chunk, padded columns, prefix
    sums, the loop's constants and state); per round, the per-request checks
    (`eval_requests`), the ignore-EOS grid when on, and `admission_round` (the event and state
    update); the result then reads the state buffer. Tests hold it equal to the torch path."""
    from .kernels import admission as KA

    Q = q.fill_len.numel()
    dev = q.fill_len.device
    i64 = torch.int64
    c = chunked
    if sv is None:
        zero = torch.zeros((), dtype=i64, device=dev)
        sv = torch.stack([st.available, st.evictable, st.I, st.cur_off, st.rem_input,
                          st.rem_chunk if cfg.chunking else zero, st.N, st.can_run, st.running_bs,
                          st.batch_full.to(i64), q.n,
                          c.present.to(i64) if c is not None else zero, c.fill_len if c is not None else zero,
                          c.prefix_len if c is not None else zero, c.max_new if c is not None else zero]).to(i64)
    else:
        check_tensor("admit_step", "sv", sv, (i64,), numel=KA.SV_LEN, device=dev)
    cont = lambda x: x.contiguous()  # noqa: E731
    p = KA.admission_prepare(cfg, cont(q.fill_len), cont(q.out_len), cont(q.prompt_len), cont(q.max_new),
                             cont(q.prefix_len), cont(q.drop), cont(q.ignore_eos), sv, st.ratio, c is not None)
    # the checks read `fail` on the ignore-EOS path only (elsewhere any bool column will do)
    fail = no_fail = torch.zeros(Q + 1, dtype=torch.bool, device=dev) if cfg.ignore_eos_path else p.ie
    if cfg.ignore_eos_path:
        valid = torch.arange(Q + 1, device=dev) < sv[KA.SV_N]
        A = sv[KA.SV_A]
        q_left, q_occ = eos_states(p.maxn, p.out, p.prompt, p.ie, st.ratio)
        h_left, h_occ, h_valid = _held_states(held, c, st.ratio, dev)
    state, spare, end_vec = p.state, torch.empty_like(p.state), p.end
    for r in range(cfg.rounds):
        if cfg.ignore_eos_path:  # R-ADM-6 reservation scan, c_j = cur_rem_j - ceilP(ext_j)
            cj = (A + p.ev - (p.base[KA.B_CUR] + state[KA.ST_CC] + p.exC)) - p.e
            fail = torch.cat([ignore_eos_fail(cj[:Q], q_left[:Q], q_occ[:Q], valid[:Q], h_left, h_occ, h_valid,
                                              backend="triton"), no_fail[:1]])
        stop_j, kind_j, tc, mark_j = KA.eval_requests(cfg, p.sc, p.rn, p.fill, p.pre, p.out, p.maxn, p.drop, p.ie,
                                                      fail, p.exI, p.exC, p.exE, p.exD)
        KA.admission_round(cfg, stop_j, kind_j, tc, mark_j, p.e, p.wI, p.wC, p.exI, p.exC, p.exE, p.pre, p.ev,
                           p.iep, p.drop, p.base, state, spare, p.sc, end_vec)
        state, spare = spare, state
        if early_exit and r + 1 < cfg.rounds and bool(state[KA.ST_DONE]):
            break
    # the result read off the final state in one launch; the fields are views of its buffers
    r = KA.admission_result(cfg, state, p.extra, p.pre, p.iep, sv, p.rn)
    v, fl = r.iv, r.flags
    return StepResult(
        admitted=r.admitted[:Q], extend_start=p.pre[:Q], extend_end=end_vec[:Q], stop_index=v[KA.R_STOP_INDEX],
        stop=v[KA.R_STOP], chunk_index=v[KA.R_CHUNK_INDEX], chunk_len=v[KA.R_CHUNK_LEN], batch_full=fl[0],
        inflight_end=v[KA.R_INFLIGHT_END], inflight_left=fl[1], I=v[KA.R_I], cur_off=v[KA.R_CUR],
        rem_input=v[KA.R_RIN], rem_chunk=v[KA.R_RC], evictable=v[KA.R_EV], rem_total=r.rem_total,
        cur_rem=v[KA.R_CUR_REM], hit_tokens=v[KA.R_HIT], input_tokens=v[KA.R_INPUT], decided=fl[2], packed=v)
