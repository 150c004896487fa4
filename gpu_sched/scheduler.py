"""GpuScheduler: the scheduler with the prefix tree, ordering and admission on a torch device.

Same calls as `ReferenceScheduler` (submit / step / complete_prefill / decode / retract_decode /
finish / abort / seed_* / check_integrity); tests hold one against the other. What runs where:
  * the radix cache is a `FlatRadixTree` on `device` (batched, hash-based matching);
  * each request's columns, ordering keys, pool offsets and latest match live in a host row
    table (`_rows_of`), written once per fill (its tokens hashed into the pools when a match
    first needs them, `_ensure_hashed`; rows of finished requests reused); the waiting queue
    is the rows of its requests (`RowQueue`), so a step gathers columns, permutes and cuts it
    with numpy, never with Python per waiting request; a match kept from an earlier step
    (ordering's full ones, admission windows' capped ones) is checked with two lookups
    (`check_matches`) before any search; admission takes the ordering's matches while the
    tree's content is unchanged;
  * ordering builds the queue's columns as tensors and applies `gpu_sched.policy`
    (sort keys, in-batch deprioritization, dfs-weight), with `backend` "torch" or "triton";
  * admission is one static-shaped device computation over the ordered queue
    (`gpu_sched.admission.admit_step`: prefix sums, chunks, ignore-EOS grid, stop reason, budgets),
    read back once and applied on the host.
    On the CPU a window of up to `SCALAR_WINDOW` requests is decided instead one request at
    a time, each request's match and lock drop made when the loop reaches it
    (`_scalar_admission`, `_ScalarMatcher`, `_window_loop`; a fill not hashed yet is matched
    by a walk of the tree on its tokens), and on the host paths a larger one by prefix sums
    that find the first request the loop does not simply admit, then the same loop from
    there (`_window_lead`).
The engine-facing bookkeeping (KV slots of running requests) stays on the host.
"""

from __future__ import annotations

import collections.abc
import gc
import operator
import os
import secrets
import struct
import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .config import SchedulerConfig
from .device_cache import DeviceRadixCache
from .reference.policy import OrderResult, active_policy, checked_shuffle
from .reference.scheduler import ReferenceScheduler
from .reference.state import ReqState
from .row_queue import LazyList, RowQueue, rid_list
from . import policy as dpolicy
from .admission import (STOP_CODES, STOP_NAMES, STOP_NO_TOKEN, STOP_OTHER, STOP_PREEMPT, STOP_QUEUE_END, HeldCols,
                        LockDropWalk, QueueCols, StepConfig, StepState, admit_step, admit_step_host, lock_drops,
                        lock_drops_np, match_lock_drops, preempt_select, read_step_result)
from .radix import _match_nodes_host, _path_position_host

BACKENDS = ("torch", "triton")
#: columns of GpuScheduler's row table: fill length, output length, prompt length,
#: max_new_tokens, ignore_eos, max_prefix_len (R-ORD-8), namespace id, token and chunk-hash
#: pool offsets, and the last match (tree version: a full-length match trusted on that tree
#: content; -2: a kept capped match, checked before use; -1: none; length; pool position;
#: the fill's prefix hashes at that length and one page further) and the R-ORD-9 group of
#: the first T fill tokens (T, or -1 for none; interned (namespace, head hash) id); a stamp
#: that moves whenever the row is written or its pool offsets move (device mirrors upload
#: rows by it); then the ordering keys: priority, enqueue time (float64 bits; refreshed when
#: the request is queued again) and the interned routing-key id (-1: none or "")
(RT_FILL, RT_OUT, RT_PROMPT, RT_MAXNEW, RT_IGN, RT_CAP, RT_NS, RT_TOFF, RT_COFF,
 RT_MVER, RT_MLEN, RT_MPOS, RT_H1, RT_H2, RT_HEADT, RT_HEAD, RT_STAMP, RT_PRIO, RT_TIME, RT_RKEY) = range(20)
RT_COLS = 20
#: the row-table columns `_ScalarMatcher` reads
_SCALAR_COLS = (RT_FILL, RT_CAP, RT_MVER, RT_MLEN, RT_MPOS, RT_H1, RT_H2, RT_TOFF, RT_OUT, RT_MAXNEW)
#: the columns a kept capped match writes (`_keep_found`): version -2, length, position, hashes
_KEEP_COLS = (RT_MVER, RT_MLEN, RT_MPOS, RT_H1, RT_H2)
_LOOP_COLS = np.array([RT_FILL, RT_OUT, RT_MAXNEW])
#: the columns `_write_rows` writes, in its order
_WRITE_COLS = np.array([RT_FILL, RT_OUT, RT_PROMPT, RT_MAXNEW, RT_IGN, RT_CAP, RT_NS, RT_PRIO, RT_TIME, RT_RKEY,
                        RT_MVER, RT_HEADT, RT_STAMP, RT_TOFF])
_WRITE_TIME = int(np.flatnonzero(_WRITE_COLS == RT_TIME)[0])  # where the float time's bits go
_WRITE_PRIO = int(np.flatnonzero(_WRITE_COLS == RT_PRIO)[0])
_WRITE_MAXNEW = int(np.flatnonzero(_WRITE_COLS == RT_MAXNEW)[0])
_WRITE_COLS_LIST = _WRITE_COLS.tolist()
#: and those `_find_rows_scalar` reads
_FIND_COLS = np.array([RT_TOFF, RT_COFF, RT_FILL, RT_CAP, RT_NS])
_DEV_ROW = operator.attrgetter("dev_row")
_OUTPUT_IDS = operator.attrgetter("req.output_ids")
_PRIORITY = operator.attrgetter("priority")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def _f64_bits(t: float) -> int:
    """A float time's int64 bits, as `np.float64(t).view(np.int64)` gives them."""
    return _I64.unpack(_F64.pack(t))[0]


def _bits_f64(b: int) -> float:
    """`_f64_bits`' inverse: the float64 whose bits are the int64 b."""
    return _F64.unpack(_I64.pack(b))[0]


def _rt_get(rt: np.ndarray, rows: np.ndarray, c: int) -> np.ndarray:
    """Column c of the (column-major) row table at int rows: a `take` from the contiguous
    column, about twice as fast as `rt[rows, c]` for a large queue; `mode="clip"` skips the
    bounds check (rows are the table's own, always in range): 1.8x faster again at 32k rows."""
    return rt[:, c].take(rows, mode="clip")


def _ordered_rows(q: RowQueue, key: tuple) -> int:
    """How many leading rows of q (its tail consolidated) are known to be in the order of
    ordering key `key` (`RowQueue.ordered`; 0 when unknown or by another key)."""
    o = q.ordered
    return o[1] if o is not None and o[0] == key else 0


def _rt_set(rt: np.ndarray, rows: np.ndarray, c: int, v) -> None:
    """rt[rows, c] = v through the contiguous column view (faster than the 2-D form)."""
    rt[:, c][rows] = v


class _ScalarMatcher:
    """The capped matches (R-STEP-3.4) and lock drops of a small admission window's rows, one
    row at a time in window order, as `_window_loop` reaches them (`__call__(j)` -> match
    length and drop [tokens], and the row's lengths), so that nothing is matched past the
    loop's stop point. A match known on the tree's content is climbed to its capped depth
    (`path_position`'s climb), a kept one is checked by its two lookups (`holds`:
    `check_matches`' test), a row with no match to trust or whose check fails is searched
    and kept (a fill not hashed yet by the walk `_find_lazy`, else `_find_rows_scalar`, as
    `_checked_find` does); the drops are `admission.LockDropWalk`'s. `ms`, `ps`: the
    lengths and last pool positions so far (`_admit_run` applies them without a tensor).
    Nothing on the tree changes while the loop runs (searches only read it)."""

    __slots__ = ("s", "rows", "tree", "P", "ver", "owner", "key_off", "key_len", "parent", "walk", "ms", "ps",
                 "rt_arr", "rt", "offs", "hkeys", "hvals", "at_views")

    def __init__(self, sched: "GpuScheduler", rows: np.ndarray):
        tree = sched.cache.tree
        self.s, self.rows, self.tree = sched, rows, tree
        self.P, self.ver = sched.config.page_size, tree.version
        self.owner, self.key_off, self.key_len, self.parent = map(tree._mv, ("owner", "key_off", "key_len", "parent"))
        self.walk = LockDropWalk(self.parent, self.key_len, tree._mv("lock_ref"), tree._mv("alive"))
        self.ms: List[int] = []
        self.ps: List[int] = []
        # views made once per window (each costs a lookup or an allocation per call): the row
        # table flat (`_rt_mv`; a search may write a row's kept columns through it) and the
        # prefix hash table when first read (searches only read the tree while the loop runs;
        # reading it enters the tree's deferred entries, which walks do not need)
        self._view_rows()
        self.hkeys = self.hvals = self.at_views = None

    def _view_rows(self) -> None:
        self.rt_arr = self.s._rt
        self.rt, N = self.s._rt_mv()
        self.offs = tuple(c * N for c in _SCALAR_COLS)

    def holds(self, mlen: int, Lq: int, h1: int, h2: int, mpos: int) -> Tuple[bool, int]:
        """Whether a kept match of length mlen (prefix hashes h1 at mlen, h2 one page on, its
        last token kept at pool position mpos) is the row's match on the tree now
        (`check_matches`' test by two lookups): depth mlen is present (or 0) and depth
        mlen + P absent (or past Lq); and the pool position found for depth mlen (-1 if
        absent). On a tree with deferred entries (whose lookups would enter them all) by
        positions instead (`FlatRadixTree._holds_at`)."""
        P = self.P
        if self.hkeys is None and self.tree._pend:
            if self.at_views is None:
                self.at_views = (self.owner, self.tree._mv("hsh"), self.key_off, self.key_len)
            return self.tree._holds_at(mlen, Lq, h1, h2, mpos, self.at_views)
        if self.hkeys is None:
            self.hkeys, self.hvals = self.tree._mv("hkeys"), self.tree._mv("hvals")
        s1, s2 = self.tree._probe_scalar(self.hkeys, (h1, h2))
        pos, pos2 = (self.hvals[s1] if s1 >= 0 else -1), s2
        return not (mlen > Lq or mlen % P or mlen > 0 and pos < 0 or mlen + P <= Lq and pos2 >= 0), pos

    def __call__(self, j: int) -> Tuple[int, int, int, int, int]:
        """Row j's (match length, lock drop, fill length, output length, max_new_tokens)."""
        if j != len(self.ms):
            raise RuntimeError(f"_ScalarMatcher: row {j} asked for after {len(self.ms)} rows")
        s, P, owner, key_off = self.s, self.P, self.owner, self.key_off
        r = self.rows.item(j)
        f = self.rt  # Python ints per read (a fancy index costs several numpy calls; a 2-d view's reads 4x these)
        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9 = self.offs
        fill, cap, mver, mlen, mpos, h1, h2, toff, out, maxnew = (
            f[a0 + r], f[a1 + r], f[a2 + r], f[a3 + r], f[a4 + r], f[a5 + r], f[a6 + r], f[a7 + r], f[a8 + r], f[a9 + r])
        Lq = min(fill, cap) // P * P
        node = cover = 0
        if mver == self.ver:  # the full match on this content: its capped part lies on its path
            m, pos = min(Lq, mlen), -1
            if m > 0:
                X = owner[mpos]
                start = mlen - (mpos - key_off[X] + 1)  # the depth where node X begins
                while m <= start:
                    X = self.parent[X]
                    start -= self.key_len[X]
                node, cover = X, m - start
                pos = key_off[X] + cover - 1
        else:
            ok, pos = self.holds(mlen, Lq, h1, h2, mpos) if mver != -1 else (False, -1)
            if not ok:
                # not hashed, or a tree with deferred entries (a hash search would enter them
                # all): the walk (`_find_rows_scalar`'s choice, without its array glue)
                if s.LAZY_FIND_TOKENS > 0 and (toff < 0 or self.tree._pend):
                    kept = s._find_lazy(r)
                else:
                    kept = s._find_rows_scalar(self.rows[j : j + 1], capped=True)[:, 0].tolist()
                if s._rt is not self.rt_arr:  # not expected (a search adds no row): view it again
                    self._view_rows()
                f, N = self.rt, self.rt_arr.shape[0]
                for c, v in zip(_KEEP_COLS, (-2, *kept)):  # `_keep_found` for one row
                    f[c * N + r] = v
                mlen, pos = kept[0], kept[1]
            elif mlen == 0:
                pos = -1
            m = mlen
            if m > 0:  # its node holds pos
                node = owner[pos]
                cover = pos - key_off[node] + 1
        self.ms.append(m)
        self.ps.append(pos)
        return m, self.walk.add(node, cover, m > 0), fill, out, maxnew


class _RowCols:
    """Columns of some rows of the row table, each gathered on first use: the table is
    column-major, so one column of a large queue is one contiguous-source gather instead of
    whole 160-byte rows. `cols[:, c]`, `cols[idx, c]`; `sub(idx)` selects rows (gathered
    columns carried over). Read only: writes go to the table."""

    __slots__ = ("rt", "rows", "_c")

    def __init__(self, rt: np.ndarray, rows: np.ndarray, cached=None):
        self.rt, self.rows, self._c = rt, rows, cached if cached is not None else {}

    def col(self, c: int) -> np.ndarray:
        v = self._c.get(c)
        if v is None:
            v = self._c[c] = _rt_get(self.rt, self.rows, c)
        return v

    def __getitem__(self, key):
        r, c = key
        v = self.col(c)
        return v if isinstance(r, slice) and r == slice(None) else v[r]

    def sub(self, idx: np.ndarray) -> "_RowCols":
        return _RowCols(self.rt, self.rows[idx], {c: v[idx] for c, v in self._c.items()})


class _Views:
    """Live row-based views (they compare by value, like lists, so are not hashable): `add(v)`,
    `values()`, `id(v) in views`. Plain weak references in a list, the dead ones dropped
    when it has doubled since the last sweep (a WeakValueDictionary's entry costs ~0.7 us,
    a callback-free reference ~0.1 us; a step makes a few views). The sweep also keeps one
    reference per view, so the list holds at most twice the live views of the last sweep
    (or 64); between sweeps `values()` may give a view twice (pinning it twice does nothing
    more)."""

    __slots__ = ("_refs", "_sweep_at")

    def __init__(self):
        self._refs: List[weakref.ref] = []
        self._sweep_at = 64

    def add(self, v) -> None:
        refs = self._refs
        refs.append(weakref.ref(v))
        if len(refs) >= self._sweep_at:
            live = {}  # one reference per live view (a queue re-added when its arrivals join)
            for r in refs:
                v = r()
                if v is not None:
                    live[id(v)] = r
            refs[:] = live.values()
            self._sweep_at = max(64, 2 * len(refs))

    def values(self) -> list:
        return [v for v in map(_call, self._refs) if v is not None]

    def __contains__(self, key: int) -> bool:
        return any(id(v) == key for v in self.values())

    def __deepcopy__(self, memo):
        # a copied scheduler starts with no views: its copied queue's rows are all held (never
        # freed), and views made from it later register themselves
        return _Views()

    def __reduce__(self):  # a pickled scheduler too (weak references do not pickle)
        return _Views, ()


def _call(f):
    return f()


_ENQUEUE_TIME = operator.attrgetter("enqueue_time")


class _DisabledCache:
    """The radix cache as `PrefillAdder` reads it while `GpuScheduler._scalar_admission` runs
    the reference's loop over a window with the cache disabled: nothing evictable, locks of
    the root that change nothing."""

    disable = True
    evictable_size = 0

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass


class GpuScheduler(ReferenceScheduler):
    """Device scheduler.

    Args:
        config, kv_pool_size, shuffle: as `ReferenceScheduler`.
        backend: "torch" (any device) or "triton" (Triton kernels for keys and tree passes;
            on a CPU device they run in Triton's interpreter: the constructor sets
            TRITON_INTERPRET=1 unless the environment sets it, which takes effect only if no
            kernel module was imported before; a test-speed path, not a fast one).
        device: torch device (default "cpu").
        hash_seed: seed of the prefix-hash bases of the radix tree (int >= 0). Default None:
            drawn from the OS's entropy (`secrets`), kept as `hash_seed`. Prefix matching
            trusts 62-bit hashes of the token prefixes (`gpu_sched.radix`), so the bases are
            kept secret by default: with known bases, prompts can be crafted whose hashes
            collide, and a collision reuses another prompt's KV. No decision depends on the
            bases otherwise; pass a seed to make the tree's internal layout reproducible.
            Raises ValueError for a negative or non-int seed.

    Raises:
        ValueError: an unknown backend, a string torch cannot parse as a device, a CUDA
            device when `torch.cuda.is_available()` is False, a bad hash_seed, a kv_pool_size
            outside [0, 2^40].
        TypeError: a config that is not a `SchedulerConfig`, a kv_pool_size that is not an int.

    Attributes:
        admit_window: ordered requests the admission scans first (256; with `adaptive_window`,
            an eighth more than the previous loop admitted, when it admitted any, and on the
            host paths `SCALAR_WINDOW` when it admitted none); a loop that
            admits them all goes on with the next window, twice as long. The sequential loop
            never reads past its stop point, so the decisions do not depend on it; the cost of
            a step's admission is then O(admitted), not O(queue).
        queue: the waiting queue as a `RowQueue` (reads like a list; assigning any sequence
            of ReqStates works too): the rows of its requests in the row table, so a step
            orders, cuts and reports it with numpy on row numbers and looks requests up only
            in the admission windows. The plan's queue_order, num_matched and deprioritized
            are `LazyList`s (made on first use; equal to the reference's lists).

    Unlike the reference, ordering does not write each waiting request's prefix_len,
    last_node and num_matched (O(queue) host work per step): the step's matched lengths are
    in the plan's num_matched, and an admitted request gets its own capped match (R-STEP-3.4)
    as in the reference, which is what the rules read.
    """

    admit_window = 256
    #: admission windows of up to this many requests are decided one request at a time,
    #: each request's match and lock drop made when the loop reaches it (`_scalar_admission`,
    #: `_ScalarMatcher`: rows past the stop point cost nothing), larger ones by
    #: `_static_admission` (on the host paths: numpy matches and drops, then `_window_lead`).
    #: Kept matches not on the tree's current content (fcfs) cost the numpy form more (fcfs
    #: at 1k, every window through it: 400 us a step against 180)
    SCALAR_WINDOW = 32
    #: larger host windows (cache on, no priority preemption) by `_window_lead`, else by
    #: `admit_step_host` (the tests run both)
    LEAD_WINDOWS = True
    #: first searches of up to this many rows at once run as scalar binary searches on the
    #: host (`FlatRadixTree._find_scalar`, ~10 lookups a row) instead of probe rounds
    FIND_SCALAR_MAX = 8
    #: up to this many requests' rows are looked up, written and refreshed one by one in
    #: Python on a memoryview of the row table (`_rows_scalar`, ~2 us a row) rather than by
    #: numpy calls over them (~25 calls, 50-80 us for one arrival on a cold cache)
    ROWS_SCALAR_MAX = 8
    #: kept full matches are re-validated through the tree's change log while it holds at most
    #: this many hashes per row to re-validate (sorting and testing it costs ~0.1 us a hash);
    #: past that, by two table lookups per row (`check_matches`, ~0.5 us a lookup on a CPU).
    #: A Mooncake lpm replay's orderings saw ~12k logged hashes for ~80 rows: 1.2 ms a step
    LOG_PER_ROW = 4
    _match_hint = None
    #: start instead with an eighth more than the previous loop's admissions, when it admitted
    #: any (steps admit similar counts: one window, not several doublings, and not a window
    #: far past the stop point); on the host paths, with `SCALAR_WINDOW` when it admitted none
    #: (a full KV pool refuses the first request of step after step)
    adaptive_window = True
    #: an admission window's first match of a row whose fill is not hashed yet walks the tree
    #: on the fill's tokens (`_find_lazy`) instead of hashing the whole fill (a 100k-token
    #: prompt with little cached prefix costs ~10 ms to hash whole); a window of many such
    #: rows does so too when their fills average over 4x this many tokens (`_lazy_rows`);
    #: 0: hash the whole fill into the pools first
    LAZY_FIND_TOKENS = 2048
    #: pause the cyclic garbage collector during `step` (on again after it, if it was on). A
    #: step that admits thousands of requests builds as many plan tuples, and every 700 new
    #: container objects start a collection that walks the young objects, the step's live
    #: temporaries included: at 131k waiting (7k admitted, lpm) some ten collections, ~5 ms
    #: of a ~20 ms step. The step makes no reference cycles (its garbage goes by reference
    #: counts), so the pause only skips those walks; the next collection after it runs as usual.
    pause_gc = True
    #: rows of the row table at first (grown by doubling)
    ROW_TABLE_MIN = 1024
    #: R-ORD-9 group ids interned beyond 4x the row table's rows before the intern table
    #: starts anew (`_head_groups`)
    HEAD_GROUP_SLACK = 1 << 16
    #: routing keys interned beyond 2x the row table's rows before unused ones are dropped
    #: (`_rk_compact`)
    ROUTING_KEY_SLACK = 1 << 12
    #: smallest token pool of the per-request fills (chunk-hash pool: a sixteenth of it): 4 MB +
    #: 0.5 MB, so a light load (few live fills) rebuilds it once per ~600 two-thousand-token fills
    POOL_MIN_TOKENS = 1 << 20

    def __init__(self, config: SchedulerConfig, kv_pool_size: int,
                 shuffle: Optional[Callable[[int], Sequence[int]]] = None,
                 backend: str = "torch", device="cpu", hash_seed: Optional[int] = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if hash_seed is not None and (isinstance(hash_seed, (bool, np.bool_)) or not isinstance(hash_seed, (int, np.integer))
                                      or hash_seed < 0):
            raise ValueError(f"hash_seed must be None or an int >= 0, got {hash_seed!r}")
        if hash_seed is not None:
            hash_seed = int(hash_seed)  # numpy integers taken as ints, as the config's knobs
        # the prefix-hash bases' seed, drawn once: every tree this scheduler makes uses the
        # same bases, so hashes kept in its rows stay valid
        self.hash_seed = secrets.randbits(63) if hash_seed is None else hash_seed
        self.backend = backend
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:  # torch's own message lists every device type
            raise ValueError(f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1')") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch.cuda.is_available() is False (no GPU, or a CPU-only torch)")
        self._on_cpu = self.device.type == "cpu"  # kept: `device.type` is slow on a cold cache
        if backend == "triton" and self._on_cpu:
            # Triton kernels on CPU tensors run only in the interpreter; it must be chosen
            # before triton is first imported (the kernel modules import it lazily)
            os.environ.setdefault("TRITON_INTERPRET", "1")
        # row-based views (RowQueue, LazyList) alive now: pinned before their rows are reused
        self._views = _Views()
        self._lead = None  # (queue, can_run, start, k): the last admission loop appended queue[:k]
        self._rt_owner: List[Optional[ReqState]] = []
        super().__init__(config, kv_pool_size, shuffle=shuffle)
        self._torch_gen = torch.Generator(device=self.device)
        self._torch_gen.manual_seed(config.random_seed)
        self._custom_shuffle = shuffle is not None
        # the row table (`_rows_of`): per-request columns, rows owned by ReqState.dev_row
        self._rt = np.zeros((0, RT_COLS), dtype=np.int64, order="F")  # column-major: see _RowCols
        self._qviews = dpolicy.HostViews()  # the pools' numpy views and the row table's flat view (`_rt_mv`)
        self._rt_free: List[int] = []
        self._rk_id: dict = {}  # routing key -> interned id (RT_RKEY)
        self._rk_names: List[str] = []
        self._rk_rank = (None, 0)  # (ranks of the interned keys' strings, len(_rk_names) then)
        self._rk_epoch = 0  # compactions of the interned keys so far (ids renumbered at each)
        self._row_epoch = 0  # rewrites of held rows' values so far (`RowQueue.epoch`)
        self._rk_table = None  # ((running batch, epoch, K), R-ORD-7's slot table or None, by id): `_routing_perm_host`
        self._hg_id: dict = {}  # (namespace, R-ORD-9 head hash) -> interned group id (RT_HEAD)
        self._stamp = 0  # the latest row stamp
        # [lo, hi] of every value ever written to the priority and max_new_tokens columns: a
        # bound of any queue's keys, so a narrow ordering key needs no min/max pass (`_order`)
        self._col_bounds = {RT_PRIO: None, RT_MAXNEW: None}
        self._new_row(None)  # allocates ROW_TABLE_MIN rows; row 0 stays unused
        self._qtok: Optional[torch.Tensor] = None
        self._qch: Optional[torch.Tensor] = None
        self._qtop = [0, 0]
        self._graph = None  # StepGraph after capture()
        self._pending = None  # (StepOutput, ordered queue) of this step's recorded computation
        self._step_ratio: Optional[float] = None
        self._last_admitted = 0  # requests the previous admission loop admitted

    # ---- the waiting queue as table rows ---------------------------------------------------------
    @property
    def queue(self) -> RowQueue:
        """The waiting queue in its current order (R-STEP-4 keeps the last step's order): a
        `RowQueue` of rows of the request table, read like a list of `ReqState`s."""
        return self._queue

    @queue.setter
    def queue(self, value) -> None:
        """Assigning the waiting queue reorders it: `value` must hold the same waiting request
        states, each once (ValueError / TypeError naming the request otherwise, with the queue
        unchanged; `submit` adds requests and `abort` drops them). A `RowQueue` of this
        scheduler (its steps' own, and copies of them) is taken as it is."""
        if isinstance(value, RowQueue) and value._s is self:
            self._queue = value
            return
        if isinstance(value, (str, bytes)) or not isinstance(value, collections.abc.Iterable):
            raise TypeError(f"queue: expected a sequence of request states, got {type(value).__name__}")
        items = list(value)
        cur = getattr(self, "_queue", None)  # unset only in __init__
        waiting = {id(x): x for x in (cur if cur is not None else ())}
        seen = set()
        for i, x in enumerate(items):
            if not isinstance(x, ReqState):
                raise TypeError(f"queue: item {i} is {type(x).__name__} {x!r}, not a request state "
                                f"(submit() adds requests)")
            if id(x) not in waiting:
                raise ValueError(f"queue: request {x.rid!r} (item {i}) is not waiting in this scheduler "
                                 f"(running, in flight, finished or never submitted); assigning the queue "
                                 f"only reorders it")
            if id(x) in seen:
                raise ValueError(f"queue: request {x.rid!r} appears more than once (item {i})")
            seen.add(id(x))
        if len(seen) != len(waiting):
            missing = next(x for k, x in waiting.items() if k not in seen)
            raise ValueError(f"queue: the waiting request {missing.rid!r} is missing ({len(waiting) - len(seen)} "
                             f"in all); abort() drops requests, assigning the queue only reorders it")
        self._queue = RowQueue(self, tail=items)  # rows looked up at the next step

    def _queue_rows(self, q: RowQueue) -> np.ndarray:
        """Rows of every request in `q` (int64 [len(q)]): its tail's rows are looked up
        (`_rows_of`, written if new or stale), the enqueue time and priority of rows held
        before refreshed (a requeued request gets a new enqueue time; it also has an output
        token more than its row, so `_rows_of` rewrote it whole already: the refresh keeps the
        columns right should a row be held unchanged), then the tail joins the rows. A tail of
        up to `ROWS_SCALAR_MAX` requests (a serving loop's arrivals of one step) is written in
        Python (`_rows_scalar`), the same values as the numpy form's. The queue's order flags
        (`RowQueue.in_time`, `ordered`) are dropped first if rows' values were rewritten
        since they were known (`_row_epoch`: a copy kept across steps and assigned back),
        and are known for this epoch after."""
        if q.epoch != self._row_epoch:
            q.in_time = q.ordered = None
        if q.tail:
            tail = q.tail
            # rows held before (requeued requests, an assigned list): refreshed below; views
            # holding them from before (older epochs) no longer know their order. New rows
            # were just written whole by `_write_rows`.
            held = [r.dev_row >= 0 for r in tail]
            if any(held):
                self._row_epoch += 1
            if len(tail) <= self.ROWS_SCALAR_MAX:  # Python writes on a memoryview, no numpy call per column
                rl = self._rows_scalar(tail)
                times = [r.enqueue_time for r in tail]
                again = [(r, row, t) for r, row, t, h in zip(tail, rl, times, held) if h]
                if again:
                    f, N = self._rt_mv()
                    for r, row, t in again:
                        f[RT_PRIO * N + row] = r.priority
                        f[RT_TIME * N + row] = _f64_bits(t)
                    self._widen_bounds(RT_PRIO, [x[0].priority for x in again])
                rows = np.array(rl, dtype=np.int64)
                ordered = all(x <= y for x, y in zip(times, times[1:]))
            else:
                rows = self._rows_of(tail)
                times = np.fromiter(map(_ENQUEUE_TIME, tail), np.float64, len(tail))
                h = np.array(held, dtype=bool)
                if h.any():
                    prio = np.fromiter(map(_PRIORITY, tail), np.int64, len(tail))[h]
                    self._widen_bounds(RT_PRIO, prio)
                    _rt_set(self._rt, rows[h], RT_PRIO, prio)
                    _rt_set(self._rt, rows[h], RT_TIME, times[h].view(np.int64))
                ordered = bool((times[1:] >= times[:-1]).all())
            # the joined rows' time order, known where the rows' own is (O(tail), not O(queue))
            head = q.rows
            if len(head) and not q.in_time:
                q.in_time = None
            else:
                q.in_time = ordered and (not len(head) or bool(times[0] >= _bits_f64(self._rt.item(int(head[-1]), RT_TIME))))
            q.rows = np.concatenate([head, rows]) if len(head) else rows
            q.tail = []
            self._views.add(q)
        q.epoch = self._row_epoch
        return q.rows

    def _remove_queued(self, r: ReqState) -> None:
        """abort(): r's row dropped from the queue's rows (a numpy mask, no per-request
        Python), or r dropped from its tail."""
        q = self.queue
        if r.dev_row >= 0 and len(q.rows):
            keep = q.rows != r.dev_row  # a queued request's row is its own (never reused)
            if not keep.all():
                self.queue = q.subset(keep)
                return
        if any(x is r for x in q.tail):
            self.queue = RowQueue(self, q.rows, [x for x in q.tail if x is not r], q.in_time, q.ordered, q.epoch)

    def _rid_list(self, q) -> Sequence[str]:
        if isinstance(q, RowQueue):  # arrivals enter the row table now (once each), not per step
            if not q.tail and not len(q.rows):  # an empty queue (most steps of a light load)
                return []
            return rid_list(self, self._queue_rows(q))
        return super()._rid_list(q)

    def _rk_compact(self) -> None:
        """Drop interned routing keys no held request's row has (keys are often per session, so
        the table would otherwise grow with every key ever seen, and so would the routing-key
        ordering's lookup table): ids renumbered in the rows that hold one."""
        reqs = self.reqs
        rows = np.array([k for k, r in enumerate(self._rt_owner) if r is not None and reqs.get(r.rid) is r],
                        dtype=np.int64)
        old = self._rt[rows, RT_RKEY]
        # rows just handed to new requests may hold a stale id (rewritten right after); rows of
        # requests no longer held are never read again before they are rewritten
        held = (old >= 0) & (old < len(self._rk_names))
        keep = np.unique(old[held])
        remap = np.full(len(self._rk_names), -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        _rt_set(self._rt, rows, RT_RKEY, np.where(held, remap[np.where(held, old, 0)], -1))
        self._rk_names = [self._rk_names[i] for i in keep.tolist()]
        self._rk_id = {name: i for i, name in enumerate(self._rk_names)}
        self._rk_rank = (None, 0)
        self._rk_epoch += 1

    def _rk_intern(self, key) -> int:
        """Interned id of a routing key; -1 for none or "" (neither counts, R-ORD-7)."""
        if not key:
            return -1
        k = self._rk_id.get(key)
        if k is None:
            k = self._rk_id[key] = len(self._rk_names)
            self._rk_names.append(key)
        return k

    def _rk_ranks(self) -> np.ndarray:
        """Rank of each interned routing key's string in lexicographic order (int64 [K], ids
        as `RT_RKEY`; distinct strings, distinct ranks), R-ORD-7's key rank table.
        Kept until a key is interned or the keys are compacted (ids only grow in between, and
        the sort covers them all). The eager torch form of R-ORD-7 reads it too."""
        ranks, k = self._rk_rank
        names = self._rk_names
        if ranks is None or k != len(names):
            ranks = np.empty(len(names), dtype=np.int64)
            ranks[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
            self._rk_rank = (ranks, len(names))
        return ranks

    def _running_key_ids(self) -> List[int]:
        """The running batch's routing keys as interned ids (-1: none or "", not counted by
        R-ORD-7); a key compaction dropped is interned again."""
        get = self._rk_id.get
        ids = [get(r.req.routing_key, -2) for r in self.running]
        if -2 in ids:  # no key or '' (-1 from _rk_intern), or a key to intern anew
            ids = [k if k != -2 else self._rk_intern(r.req.routing_key) for k, r in zip(ids, self.running)]
        return ids

    def _pin_views(self, freed: List[int]) -> None:
        """Before rows `freed` are reused: views holding any of them keep their values."""
        if not freed:
            return
        f = np.asarray(freed, dtype=np.int64)
        for v in list(self._views.values()):
            rows = v.rows
            if rows is not None and len(rows) and np.isin(rows, f).any():
                v.pin()

    # ---- the recorded step (gpu_sched.step) ------------------------------------------------------
    def capture(self, queue_capacity: int = 4096, running_capacity: int = 1024, max_len: Optional[int] = None,
                admit_window: Optional[int] = None):
        """Take the fixed-capacity step from now on: prefix match, ordering and admission as one
        static device computation (`gpu_sched.step.StepGraph`), read back once per step. On CUDA
        it is recorded in a `torch.cuda.CUDAGraph` at the first step that uses it (after two
        warm-up runs that compile the kernels) and replayed by every later `step()`; recorded
        again only when a tensor it reads was reallocated. Every policy is recorded; under
        random the permutation is drawn before the replay, as the eager path draws it
        (`_random_perm`), and uploaded. Steps that do not fit (a queue over `queue_capacity`,
        a running batch over `running_capacity`, a waiting request's fill over `max_len`) take
        the eager path; decisions are the same either way. On a CPU the recorded step runs
        its torch forms eagerly: a check of its decisions, several times slower than the eager
        path's host forms; it is meant for CUDA.

        Args:
            queue_capacity, running_capacity: the buffers' capacities [requests].
            max_len: bound on the waiting requests' fill lengths [tokens] (fewer search and
                tree rounds); default: the tree's token capacity. A step whose queue holds a
                longer fill takes the eager path.
            admit_window: ordered requests the recorded admission decides [requests];
                default `min(queue_capacity, max(GpuScheduler.admit_window,
                config.max_prefill_tokens))` (the eager path's first window, 256, at least)
                (each admitted request takes a prefill token at least, so nearly every step is
                decided by the replay alone; a step that admits them all goes on eagerly); a
                larger value is capped at `queue_capacity`.
        Returns:
            the `StepGraph`: `runs` counts the steps it decided (the others took the eager
            path), `captures` the CUDA graphs recorded (0 on a CPU).
        Raises:
            TypeError: a capacity, max_len or admit_window that is not an int (bools refused).
            ValueError: one below 1, a capacity above 2^24, a max_len above 2^40.
        """
        from .step import StepGraph

        self._graph = StepGraph(self, queue_capacity, running_capacity, max_len, admit_window)
        return self._graph

    def step(self, new_token_ratio: float, now: Optional[float] = None):
        """`ReferenceScheduler.step` (the same plan, bit for bit), with ordering and admission
        on this scheduler's device, or the recorded step after `capture()`. With `pause_gc`
        the cyclic garbage collector is off for the call (and on again after, if it was)."""
        self._step_ratio = new_token_ratio
        paused = self.pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        try:
            return super().step(new_token_ratio, now)
        finally:
            if paused:
                gc.enable()
            self._pending = None
            self._step_ratio = None

    def _order_recorded(self, g) -> OrderResult:
        """R-STEP-2 by the recorded step (which also decides the admission loop's first segment,
        kept in `_pending`); the ordering match's splits and stamps are applied here, in queue
        order, as sequential matching would."""
        from .reference.adder import PrefillAdder

        cfg = self.config
        q = self.queue
        rows = self._queue_rows(q)  # `load` hashes fills not yet hashed
        n = len(rows)
        mixed = len(self.running) if cfg.enable_mixed_chunk and cfg.chunked_prefill_size is not None else 0
        adder = PrefillAdder(cfg, self.cache, self.pool, self.running, float(self._step_ratio), mixed)
        g.load(rows, adder, self.batch_is_full, self.chunked)
        out = g.run()
        order = out.order
        orows = rows[order]
        oq = RowQueue(self, orows)
        self._pending = (out, oq)
        policy = active_policy(cfg, n)
        if policy not in ("lpm", "dfs-weight"):
            return OrderResult(policy, oq)
        if not n:
            return OrderResult(policy, oq, [], [])
        # splits and stamps; the last nodes are not read back: only admitted requests need
        # theirs, and `_admit_run` gets them from the admission's own capped match
        self.cache.tree._apply(g.m_full[:n], g.pos_full[:n], self.cache.tree.backend)
        num = np.minimum(out.prefix_len, g._caps)[order]
        dep = out.deprioritized[order]
        return OrderResult(policy, oq, LazyList(n, num.tolist, num.item), rid_list(self, orows[dep]))

    def _unadmitted(self, queue: List[ReqState], can_run: List[ReqState]) -> List[ReqState]:
        """R-STEP-4. The admission loop admits a leading run of the ordered queue (it stops at
        the first request it does not admit), so the rest is a slice: checked in O(admitted)
        (the in-flight chunked request, first in can_run, is not in the queue); anything else
        takes the general filter."""
        run = can_run[1:] if can_run and can_run[0] is self.chunked else can_run
        k = len(run)
        lead, self._lead = self._lead, None
        if isinstance(queue, RowQueue):
            # `_admission_scan` appended queue[:k] itself, in order, after `start` entries
            if (lead is not None and lead[0] is queue and lead[1] is can_run and lead[3] == k
                    and len(can_run) == lead[2] + k):
                return queue.after(k)
            if k <= len(queue) and all(a is b for a, b in zip(run, queue.window(0, k)[0])):
                return queue.after(k)
            queue = list(queue)
        elif k <= len(queue) and all(a is b for a, b in zip(run, queue)):
            return queue[k:]
        return super()._unadmitted(queue, can_run)

    def _take_pending(self, queue: List[ReqState], adder):
        """The recorded step's output for this admission loop, if it computed one; its
        in-flight chunk (R-ADM-5) must agree with what the host's adder did."""
        pending, self._pending = self._pending, None
        if pending is None or pending[1] is not queue:
            return None
        out = pending[0]
        c = self.chunked
        if c is not None and c in adder.can_run and out.head[12] != c.extend_end:
            raise RuntimeError(f"recorded step: in-flight chunk end {out.head[12]} != host {c.extend_end}")
        return out

    def _make_cache(self):
        return DeviceRadixCache(self.pool, self.config.page_size, disable=self.config.disable_radix_cache,
                                device=self.device, backend=self.backend, hash_seed=self.hash_seed)

    # ---- ordering (R-ORD) on the device ------------------------------------------------------
    def _col(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _rows_of(self, rs: Sequence[ReqState]) -> np.ndarray:
        """Row of each request in the host row table `_rt` (int64 [rows, RT_COLS], stored
        column-major so a column of many rows is one gather, see `_RowCols`: its fill
        length, output length, prompt length, max_new_tokens, ignore_eos, max_prefix_len,
        namespace id, ordering keys and, once hashed (`_ensure_hashed`), its offsets in the
        CSR pools `_qtok` (int32 tokens) and `_qch` (int64 chunk hashes at depths C, 2C, ...)).
        A row is written once per fill length: a step then reads its queue's columns with one
        numpy gather instead of one Python call per request and field. Rows keep their numbers
        while their request is held (rows of finished or aborted requests are reused, see
        `_new_row`); offsets move when the pools are rebuilt (the row's stamp moves with them).
        Returns int64 [len(rs)]."""
        n = len(rs)
        if n <= self.ROWS_SCALAR_MAX:
            return np.array(self._rows_scalar(rs), dtype=np.int64)
        idx = np.fromiter(map(_DEV_ROW, rs), np.int64, n)
        need = int((idx < 0).sum())
        if need > len(self._rt_free) and self._reserve_rows(need):
            # a sweep freed rows (some maybe of these requests, if not held): read again, and
            # grow without sweeping, so no row handed out below is taken back
            idx = np.fromiter(map(_DEV_ROW, rs), np.int64, n)
            self._reserve_rows(int((idx < 0).sum()), sweep=False)
        outs = np.fromiter(map(len, map(_OUTPUT_IDS, rs)), np.int64, n)
        stale = (idx < 0) | (self._rt[np.maximum(idx, 0), RT_OUT] != outs) if n else np.zeros(0, bool)
        miss = np.flatnonzero(stale)
        if miss.size:
            if (idx[miss] >= 0).any():  # held rows rewritten: views of them hold old values
                self._row_epoch += 1
            reqs = [rs[k] for k in miss.tolist()]
            for r in reqs:
                if r.dev_row < 0:
                    r.dev_row = self._new_row(r)
            self._write_rows(reqs)
            idx[miss] = [r.dev_row for r in reqs]
        return idx

    def _rows_scalar(self, rs: Sequence[ReqState]) -> List[int]:
        """`_rows_of` for a few requests (`ROWS_SCALAR_MAX`) in Python: the same rows, reserved,
        made and (re)written in the same cases, as a list."""
        idx = [r.dev_row for r in rs]
        need = sum(i < 0 for i in idx)
        if need > len(self._rt_free) and self._reserve_rows(need):
            idx = [r.dev_row for r in rs]  # as `_rows_of`: read again, grow without sweeping
            self._reserve_rows(sum(i < 0 for i in idx), sweep=False)
        f, N = self._rt_mv()
        out = RT_OUT * N
        stale = [r for r, i in zip(rs, idx) if i < 0 or f[out + i] != len(r.req.output_ids)]
        if stale:
            if any(r.dev_row >= 0 for r in stale):  # held rows rewritten: views of them hold old values
                self._row_epoch += 1
            for r in stale:
                if r.dev_row < 0:
                    r.dev_row = self._new_row(r)
            self._write_rows(stale)
            idx = [r.dev_row for r in rs]
        return idx

    def _rt_mv(self) -> Tuple[memoryview, int]:
        """(a flat memoryview of the column-major row table, its row count): row r's column c
        is item c * N + r, for 0 <= r < N only (the flat view does not check rows: another
        row's index reads another column). Kept by `_qviews` (`policy.HostViews.mv`) while the
        table is; `_reserve_rows` drops it when the table grows."""
        return self._qviews.mv(self, "_rt"), self._rt.shape[0]

    def _reserve_rows(self, need: int, sweep: bool = True) -> bool:
        """At least `need` free rows: first rows of requests no longer held (finished, aborted)
        are freed (views holding them pinned first); the table doubles when that leaves fewer
        than a quarter of it free, so sweeps cost O(1) per row. True if any row was freed."""
        owner, reqs = self._rt_owner, self.reqs
        freed = [k for k, r in enumerate(owner) if r is not None and reqs.get(r.rid) is not r] if sweep else []
        if freed:
            self._pin_views(freed)
            for k in freed:
                owner[k].dev_row = -1
                owner[k] = None
            self._rt_free.extend(reversed(freed))
        while len(self._rt_free) < need or 4 * len(self._rt_free) < len(self._rt_owner):
            old = len(self._rt_owner)
            cap = max(self.ROW_TABLE_MIN, 2 * old)
            grown = np.zeros((cap, RT_COLS), dtype=np.int64, order="F")
            grown[:old] = self._rt
            self._rt = grown
            self._qviews.drop("_rt")  # its view holds the old table: made again on first use
            self._rt_owner.extend([None] * (cap - old))
            self._rt_free = list(range(cap - 1, old - 1, -1)) + self._rt_free
        return bool(freed)

    def _new_row(self, r: ReqState) -> int:
        if not self._rt_free:
            self._reserve_rows(1)
        k = self._rt_free.pop()
        self._rt_owner[k] = r
        return k

    def _write_rows(self, reqs: Sequence[ReqState]) -> None:
        """(Re)write the rows of `reqs` (each already owns one): the columns; the fill's
        tokens and chunk hashes enter the pools when a match first needs them."""
        if len(self._rk_names) > 2 * len(self._rt_owner) + self.ROUTING_KEY_SLACK:
            self._rk_compact()
        # the columns of `_WRITE_COLS`: no match known for this fill (MVER -1), no head hash
        # either (HEADT -1), one stamp for the call, not in the pools yet (TOFF -1: a rebuild
        # skips these rows); one indexed write for the whole batch
        n = len(reqs)
        self._stamp += 1
        ns = (lambda r: 0) if self.cache.disable else (lambda r: self.cache.ns_id(r.req.extra_key))
        rows = [[r.fill_len, r.out_len, r.prompt_len, r.max_new, int(r.req.ignore_eos), r.max_prefix_len(),
                 ns(r), r.priority, 0, self._rk_intern(r.req.routing_key), -1, -1, self._stamp, -1] for r in reqs]
        if n <= self.ROWS_SCALAR_MAX:  # one Python write per value on a memoryview of the table
            f, N = self._rt_mv()
            for r, vals in zip(reqs, rows):
                vals[_WRITE_TIME] = _f64_bits(r.enqueue_time)
                row = r.dev_row
                for c, v in zip(_WRITE_COLS_LIST, vals):
                    f[c * N + row] = v
            self._widen_bounds(RT_PRIO, [v[_WRITE_PRIO] for v in rows])
            self._widen_bounds(RT_MAXNEW, [v[_WRITE_MAXNEW] for v in rows])
            return
        vals = np.array(rows, dtype=np.int64).reshape(n, len(_WRITE_COLS))
        vals[:, _WRITE_TIME] = np.array([r.enqueue_time for r in reqs], dtype=np.float64).view(np.int64)
        self._widen_bounds(RT_PRIO, vals[:, _WRITE_PRIO])
        self._widen_bounds(RT_MAXNEW, vals[:, _WRITE_MAXNEW])
        self._rt[np.fromiter(map(_DEV_ROW, reqs), np.int64, n)[:, None], _WRITE_COLS] = vals

    def _widen_bounds(self, c: int, vals) -> None:
        """Widen `_col_bounds[c]` to cover `vals` (int64 [k], or a list of ints, about to be
        written to column c)."""
        if not len(vals):
            return
        lo, hi = (min(vals), max(vals)) if isinstance(vals, list) else (int(vals.min()), int(vals.max()))
        b = self._col_bounds[c]
        self._col_bounds[c] = (lo, hi) if b is None else (min(b[0], lo), max(b[1], hi))

    def _ensure_hashed(self, rows: np.ndarray, max_batch_tokens: int = 1 << 24) -> None:
        """With the cache on: the fills of table rows `rows` not yet in the pools are hashed
        (`chunk_hashes_flat`, end to end in batches of ~`max_batch_tokens` tokens) and
        appended, once per fill, when a match first needs them (ordering by lpm/dfs-weight, an
        admission window, the recorded step), not when the request arrives: fcfs/lof/routing-key
        queues hash only what admission reaches."""
        if self.cache.disable or not len(rows):
            return
        rt = self._rt
        todo = rows[_rt_get(rt, rows, RT_TOFF) < 0]
        if not todo.size:
            return
        if todo.size > 1:  # distinct rows, ascending (np.unique's result without its first-call
            todo = np.sort(todo)  # import of numpy.ma: 10-100+ ms in a serving process's first step)
            todo = todo[np.concatenate(([True], todo[1:] != todo[:-1]))]
        tree = self.cache.tree
        C = tree.C
        host = self._host_paths()
        lens_all = _rt_get(rt, todo, RT_FILL)
        # batch b holds the rows whose fills end within its share of the tokens (>= 1 row)
        ends = np.cumsum(lens_all)
        i = 0
        while i < todo.size:
            j = max(i + 1, int(np.searchsorted(ends, (ends[i - 1] if i else 0) + max_batch_tokens, side="right")))
            brow, lens = todo[i:j], lens_all[i:j]
            fills = [self._rt_owner[k].fill() for k in brow.tolist()]
            flat = np.concatenate(fills).astype(np.int32, copy=False)  # a copy: fills are read-only
            cnt = lens // C
            if host:  # the host sums on the arrays as they are (built here: no checks, no tensors)
                t0, c0 = self._pool_append(flat, tree._chunk_hashes_flat_host(flat, lens, _rt_get(rt, brow, RT_NS), C))
            else:
                toks = torch.from_numpy(flat).to(self.device)
                ch = tree.chunk_hashes_flat(toks, lens, _rt_get(rt, brow, RT_NS), C)
                t0, c0 = self._pool_append(toks, ch)
            _rt_set(rt, brow, RT_TOFF, t0 + np.cumsum(lens) - lens)
            _rt_set(rt, brow, RT_COFF, c0 + np.cumsum(cnt) - cnt)
            self._stamp += 1
            _rt_set(rt, brow, RT_STAMP, self._stamp)  # offsets moved: device mirrors upload the row again
            i = j

    def _pool_append(self, toks, ch):
        """Append fills to the CSR pools (grown by doubling). A rebuild keeps the fills of rows
        whose request is still held (offsets rewritten in place, row numbers kept) and frees
        the other rows. toks int32 [T] / ch int64 [K]: tensors on the device, or numpy arrays
        on the host paths (written through the pools' numpy views)."""
        nt, nc = len(toks), len(ch)  # 1-D arrays or tensors
        if self._qtok is None or self._qtop[0] + nt > self._qtok.numel() or self._qtop[1] + nc > self._qch.numel():
            rt = self._rt
            C = self.cache.tree.C
            live, freed = [], []
            for k, r in enumerate(self._rt_owner):
                if r is None or rt[k, RT_TOFF] < 0:
                    continue
                if self.reqs.get(r.rid) is r and rt[k, RT_FILL] == r.fill_len:
                    live.append(k)
                else:  # dropped (or about to be rewritten: its fill grew)
                    freed.append(k)
            self._pin_views(freed)
            for k in freed:
                self._rt_owner[k].dev_row = -1
                self._rt_owner[k] = None
                self._rt_free.append(k)
            need_t = int(rt[live, RT_FILL].sum()) + nt
            need_c = int((rt[live, RT_FILL] // C).sum()) + nc
            cap_t = max(self.POOL_MIN_TOKENS, 2 * need_t)
            cap_c = max(self.POOL_MIN_TOKENS // 16, 2 * need_c)
            tok = torch.zeros(cap_t, dtype=torch.int32, device=self.device)
            chs = torch.zeros(cap_c, dtype=torch.int64, device=self.device)
            # the live fills packed in row order: new offsets by prefix sums, one slice copy
            # per row (numpy's on CPU pools: ~1 us a copy against torch's ~5)
            rows = np.array(live, dtype=np.int64)
            n = _rt_get(rt, rows, RT_FILL)
            q = n // C
            t0, c0 = np.cumsum(n) - n, np.cumsum(q) - q
            if self._qtok is not None and rows.size:
                cpu = self._qtok.device.type == "cpu"
                new_t, new_c = (tok.numpy(), chs.numpy()) if cpu else (tok, chs)
                old_t, old_c = self._pool_views() if cpu else (self._qtok, self._qch)
                for a, b, ln, ca, cb, cn in zip(t0.tolist(), _rt_get(rt, rows, RT_TOFF).tolist(), n.tolist(),
                                                c0.tolist(), _rt_get(rt, rows, RT_COFF).tolist(), q.tolist()):
                    new_t[a : a + ln] = old_t[b : b + ln]
                    new_c[ca : ca + cn] = old_c[cb : cb + cn]
            _rt_set(rt, rows, RT_TOFF, t0)
            _rt_set(rt, rows, RT_COFF, c0)
            _rt_set(rt, rows, RT_STAMP, self._stamp + 1)
            t, c = int(n.sum()), int(q.sum())
            self._qtok, self._qch, self._qtop = tok, chs, [t, c]
            self._stamp += 1
        t, c = self._qtop
        if isinstance(toks, np.ndarray):
            qt, qc = self._pool_views()
            qt[t : t + nt] = toks
            qc[c : c + nc] = ch
        else:
            self._qtok[t : t + nt] = toks
            self._qch[c : c + nc] = ch
        self._qtop = [t + nt, c + nc]
        return t, c

    def _pool_views(self) -> Tuple[np.ndarray, np.ndarray]:
        """numpy views of the whole CPU pools (`_qtok`, `_qch`), made once per pool tensor (a
        rebuild makes new ones; a deep copy makes its own: `policy.HostViews`)."""
        return self._qviews.get(self, "_qtok"), self._qviews.get(self, "_qch")

    def _pools(self):
        """(tokens int32 [T], chunk hashes int64 [K]): the CSR pools' used parts."""
        if self._qtok is None:
            return (torch.zeros(0, dtype=torch.int32, device=self.device),
                    torch.zeros(0, dtype=torch.int64, device=self.device))
        return self._qtok[: self._qtop[0]], self._qch[: self._qtop[1]]

    def _csr(self, rows: np.ndarray, capped: bool):
        """The fills of table rows `rows` (capped at max_prefix_len if `capped`) as CSR tensors
        for `FlatRadixTree.match_csr`/_find_csr: rows point into the persistent pools, so
        nothing is concatenated per call."""
        C = self.cache.tree.C
        self._ensure_hashed(rows)
        sel = _RowCols(self._rt, rows)
        lens = np.minimum(sel[:, RT_FILL], sel[:, RT_CAP]) if capped else sel[:, RT_FILL]
        cols = torch.from_numpy(np.stack([sel[:, RT_TOFF], sel[:, RT_COFF], lens, sel[:, RT_NS]])).to(self.device)
        toff, coff, lengths, ns = cols[0], cols[1], cols[2], cols[3]
        tok, ch = self._pools()
        return tok, toff, lengths, ns, ch, coff, lengths // C

    def _order(self) -> OrderResult:
        g = self._graph
        if (g is not None and self._step_ratio is not None and g.supports(len(self.queue), len(self.running))
                and g.fits_lengths(self._queue_rows(self.queue))):
            return self._order_recorded(g)
        cfg = self.config
        q = self.queue
        rows = self._queue_rows(q)  # the queue as table rows: orders permute these (`take(mode="clip")`:
        # a permutation is in range, no bounds pass)
        n = len(rows)
        sign = cfg.priority_sign
        be = self.backend
        dev = self.device
        # on the CPU with the torch backend the integer-key orders are the policy functions'
        # host forms on the table's columns (`fcfs_perm_host`, `fcfs_time_perm_host`, `lof_perm_host`,
        # `_routing_perm_host`), without their tensor wrapping and checks: ~20 us less per call
        host = self._host_paths()

        def col(c):
            return torch.from_numpy(_rt_get(self._rt, rows, c)).to(dev)

        if cfg.effective_policy == "fcfs":
            if not (cfg.enable_priority_scheduling and n):
                return OrderResult("fcfs", q)
            key = ("fcfs", sign)
            done = _ordered_rows(q, key)  # a served queue's rows already in R-ORD-4 order
            if done == n:  # no arrival since the last ordering
                return OrderResult("fcfs", q)
            # a queue appended to in arrival order needs no time key: known from how the
            # queue was made (`RowQueue.in_time`), else checked on the host (not for a served
            # queue with its arrivals behind it: those are merged in)
            in_time_order = q.in_time
            t = None
            if not in_time_order:
                t = _rt_get(self._rt, rows, RT_TIME).view(np.float64)
                in_time_order = not (host and 2 * done >= n) and bool((t[1:] >= t[:-1]).all())
            if host:  # R-ORD-4: stable by (priority * sign, time), by priority alone in time order
                pr = _rt_get(self._rt, rows, RT_PRIO)
                if in_time_order:
                    perm = dpolicy.fcfs_perm_host(pr, sign, self._col_bounds[RT_PRIO])
                else:  # a served queue: often in order already (no arrival since the last step)
                    k = done if 2 * done >= n else dpolicy.fcfs_sorted_prefix(pr, t, sign)
                    if k == n:
                        q.ordered = (key, n)
                        return OrderResult("fcfs", q)
                    perm = dpolicy.fcfs_time_perm_host(pr, t, sign, sorted_prefix=k)
                if perm is not None:
                    return OrderResult("fcfs", RowQueue(self, rows.take(perm, mode="clip"), ordered=(key, n)))
            tk = None if in_time_order else torch.from_numpy(t).to(dev)
            perm = dpolicy.fcfs_priority_order(col(RT_PRIO), tk, sign, backend=be)
            return OrderResult("fcfs", RowQueue(self, rows[perm.cpu().numpy()], ordered=(key, n)))
        policy = active_policy(cfg, n)
        if policy in ("lpm", "dfs-weight"):
            if n == 0:
                return OrderResult(policy, q, [], [])
            # R-ORD-8: match in queue order (splits and stamps as sequential matching), then
            # keys, deprioritization and the order on the device; one read-back at the end
            if n == 1 and host:  # one arrival at an otherwise idle step: Python values, no array call
                one = self._order_one(policy, rows)
                if one is not None:
                    return one
            tree = self.cache.tree
            sel = _RowCols(self._rt, rows)
            # every row matched on the tree's current content (versions only grow and a row's is
            # one its tree had: min == version iff all equal): kept as they are, nothing to write
            current = int(sel[:, RT_MVER].min()) == tree.version
            lens = None
            if host and current:  # kept matches on an unchanged tree: no torch op at all
                mn, pn = sel[:, RT_MLEN], sel[:, RT_MPOS]
            else:
                lens = torch.from_numpy(sel[:, RT_FILL]).to(dev)
                m, pos = self._full_match(rows, sel, lens, current)  # hashes the fills it searches on first use
                version = tree.version  # the matches hold until the tree's content changes
            if host:  # splits and stamps with numpy in and out (the tree takes this scheduler's backend)
                if not current:
                    mn, pn = m.numpy(), pos.numpy()
                last = tree._apply_host(mn, pn)
            else:
                m, last = tree._apply(m, pos, tree.backend)
            T = cfg.in_batch_prefix_caching_deprioritize_threshold
            check = cfg.in_batch_prefix_caching_check_threshold
            grouped = T > 0 and check >= 0  # R-ORD-9 groups: (namespace, first T fill tokens), kept per row
            if host:  # capped lengths, R-ORD-9 and lpm's key on the columns' numpy views
                num = np.minimum(mn, sel[:, RT_CAP])
                # groups of the rows R-ORD-9 checks only (with a warm cache, few or none)
                grp = ((lambda e: self._head_groups(rows[e], sel.sub(e), T)[0].numpy()) if grouped
                       else np.zeros(n, dtype=np.int64))
                dep = dpolicy.deprioritize_groups_host(mn, sel[:, RT_FILL], grp, check, T)
                if policy == "dfs-weight":  # no torch op on the host paths (see `FlatRadixTree._apply_host`)
                    perm = self._dfs_weight_perm_host(last)
                else:
                    perm = dpolicy.lpm_perm_host(num, dep)
                    if perm is None:
                        perm = self._ranked_perm(policy, torch.from_numpy(num), torch.from_numpy(dep),
                                                 torch.from_numpy(last)).numpy()
                vals = [mn, num, dep, perm, pn]
            else:
                if grouped:
                    grp, G = self._head_groups(rows, sel, T)
                else:
                    grp, G = torch.zeros(n, dtype=torch.int64, device=dev), 1
                num = torch.minimum(m, torch.from_numpy(sel[:, RT_CAP].copy()).to(dev))
                dep = dpolicy.in_batch_deprioritize_groups(m, lens, grp, G, check, T, backend=be)
                perm = self._ranked_perm(policy, num, dep, last)
                if dev.type == "cpu":  # views, no copies
                    vals = [m.numpy(), num.numpy(), dep.numpy(), perm.numpy(), pos.numpy()]
                else:
                    vals = torch.stack([m, num, dep.to(torch.int64), perm, pos]).cpu().numpy()  # the read-back
            # admission reuses these matches while the tree holds the same content (`_window_match`)
            if not current:
                _rt_set(self._rt, rows, RT_MVER, version)
                _rt_set(self._rt, rows, RT_MLEN, vals[0])
                _rt_set(self._rt, rows, RT_MPOS, vals[4])
            perm, num, dep = vals[3], vals[1], vals[2]
            orows = rows[perm]
            # the plan's num_matched in queue order, gathered when first read (fresh arrays: never
            # written again); the deprioritized rids (with a warm cache often none)
            return OrderResult(policy, RowQueue(self, orows),
                               LazyList(n, lambda: num[perm].tolist(), lambda i: int(num[perm[i]])),
                               rid_list(self, orows[dep[perm] != 0]) if dep.any() else [])
        if policy == "random":  # R-ORD-6 (`_random_perm`: a custom shuffle is called for an empty queue too)
            perm = self._random_perm(n)
            return OrderResult(policy, RowQueue(self, rows[perm.cpu().numpy()]) if n else q)
        if n == 0 or policy == "fcfs":  # fcfs here: the lpm fallback sorts nothing (R-ORD-2)
            return OrderResult(policy, q)
        if policy == "lof":
            use_prio = cfg.enable_priority_scheduling
            key = ("lof", sign if use_prio else 0)
            done = _ordered_rows(q, key)
            if done == n:  # a served queue, no arrival since the last ordering
                return OrderResult(policy, q)
            if host:  # R-ORD-5
                prio = _rt_get(self._rt, rows, RT_PRIO) if use_prio else None
                mn = _rt_get(self._rt, rows, RT_MAXNEW)
                perm = None
                if 2 * done >= n and n - done <= dpolicy.LEXSORT_TAIL_MAX:  # arrivals merged in
                    perm = dpolicy.merge_arrivals_host(prio if use_prio else np.zeros(n, dtype=np.int64), ~mn,
                                                       sign < 0, done)
                if perm is None:
                    perm = dpolicy.lof_perm_host(mn, prio, sign, self._col_bounds[RT_MAXNEW])
                if perm is not None:
                    return OrderResult(policy, RowQueue(self, rows.take(perm, mode="clip"), ordered=(key, n)))
            prio = col(RT_PRIO) if use_prio else None
            perm = dpolicy.lof_order(col(RT_MAXNEW), prio, sign, backend=be)
            return OrderResult(policy, RowQueue(self, rows[perm.cpu().numpy()], ordered=(key, n)))
        else:  # routing-key: interned ids, ranked by their strings (`_rk_ranks`)
            qk = _rt_get(self._rt, rows, RT_RKEY)
            if host:
                perm = self._routing_perm_host(qk)
                return OrderResult(policy, q if perm is None else RowQueue(self, rows.take(perm, mode="clip")))
            run_ids = np.array(self._running_key_ids(), dtype=np.int64)  # may intern: before the ranks
            perm = dpolicy.routing_key_order(torch.from_numpy(qk).to(dev), torch.from_numpy(self._rk_ranks()).to(dev),
                                             torch.from_numpy(run_ids).to(dev), backend=be)
        return OrderResult(policy, RowQueue(self, rows[perm.cpu().numpy()]))

    def _order_one(self, policy: str, rows: np.ndarray) -> Optional[OrderResult]:
        """lpm / dfs-weight ordering (R-ORD-8..10) of a queue of one request whose row holds no
        kept match (a new arrival: the usual non-empty step of a light load), on the host paths,
        with Python values: the array path's search (`_find_rows_scalar`, as `_search_rows`
        takes it for one row), its row writes (the hashes, then the version, length and
        position), its splits and stamps (`FlatRadixTree._apply_list`, as `_apply_host` applies
        one match) and R-ORD-9's outcome for one row (`deprioritize_groups_host`: with
        T == 0 a checked row is deprioritized, else one row is its group's first), without the
        ~40 numpy and torch calls of the array path (each 2-9 us on a cold cache, as after an
        engine's other work). The order of one request is itself. None, having done nothing,
        when the row has a kept match or the array search would take it (`_scalar_find`)."""
        r = int(rows[0])
        f, N = self._rt_mv()
        if f[RT_MVER * N + r] != -1 or not self._scalar_find(1):
            return None
        tree = self.cache.tree
        m, pos, h1, h2 = self._find_rows_scalar(rows, capped=False)[:, 0].tolist()
        f, N = self._rt_mv()  # the table as it is after the search (which adds no row)
        f[RT_H1 * N + r], f[RT_H2 * N + r] = h1, h2  # RT_MVER stays -1 until the version below
        version = tree.version  # read before the splits, as the array path reads it
        tree._apply_list([m], [pos])
        f[RT_MVER * N + r], f[RT_MLEN * N + r], f[RT_MPOS * N + r] = version, m, pos
        cfg = self.config
        check = cfg.in_batch_prefix_caching_check_threshold
        dep = check != -1 and m <= check and cfg.in_batch_prefix_caching_deprioritize_threshold == 0
        num = min(m, f[RT_CAP * N + r])
        return OrderResult(policy, RowQueue(self, rows.copy()), [num], [self._rt_owner[r].rid] if dep else [])

    def _random_perm(self, n: int) -> torch.Tensor:
        """R-ORD-6: the permutation (int64 [n], on the device) that orders a queue of n
        requests under random; the eager path and the recorded step's inputs (`StepGraph.load`)
        both take it from here, so they draw the same permutations. With a `shuffle=` callable:
        its result, checked, and called for an empty queue too, as the reference calls it (a
        stateful shuffle stays in step with the reference's). Else `policy.random_order` on the
        scheduler's generator (seeded with `config.random_seed`), nothing drawn for an empty
        queue.

        Raises: TypeError when the shuffle returns a non-integer (a float, an array row);
        ValueError when its result is not a permutation of range(n)."""
        if self._custom_shuffle:  # checked as the reference checks it
            return torch.as_tensor(checked_shuffle(self.shuffle, n), dtype=torch.int64).reshape(n).to(self.device)
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return dpolicy.random_order(n, self._torch_gen, backend=self.backend)

    def _ranked_perm(self, policy: str, num: torch.Tensor, dep: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """lpm's order (R-ORD-8) by capped match lengths `num` and R-ORD-9 flags `dep`, or
        dfs-weight's (R-ORD-10) by the matches' last nodes `last`: int64 permutation [n]."""
        be = self.backend
        if policy == "lpm":  # lengths are token counts (< 2^31): int32 keys sort faster
            return dpolicy.lpm_order(num.to(torch.int32), dep, backend=be)
        parent, rank, remap = self._child_ranks()  # the host paths call `_dfs_weight_perm_host` instead
        return dpolicy.dfs_weight_order(parent, rank, None, remap[last], backend=be)

    def _dfs_weight_perm_host(self, last: np.ndarray) -> np.ndarray:
        """dfs-weight's order (R-ORD-10) on the host paths from the matches' last nodes `last`
        (int64 [n], the tree's ids): int64 permutation [n]. On the tree's own ids (dead slots
        have parent -1 and no requests: the root, weighing every request, sorts first among the
        parentless), siblings by their creation-order stamps: the child order itself, so no
        compaction and no ranks."""
        t = self.cache.tree
        b = t.node_bound()  # every live id is below it
        order, parent = t._np("order")[:b], t._np("parent")[:b]
        return dpolicy.dfs_weight_perm_host(parent, order, last, (b - 1).bit_length(),
                                            rank_bound=int(order.max()) + 1, in_range=True)

    def _routing_perm_host(self, qk: np.ndarray) -> Optional[np.ndarray]:
        """R-ORD-7 on the host for queued requests with interned key ids `qk` (int64 [n], -1:
        absent or ""): the running batch's key ids (interned: equal strings, one id) counted,
        and the requests sorted stably by (count descending, key string) for counted keys,
        then the others by key string (`policy.routing_perm_host` on the dense string ranks
        `_rk_ranks`): a gather and a sort over the queue, and the slot table over the K
        interned keys (`policy.routing_table_host`), kept while the running batch (the same
        request states in the same order) and the interned keys (no compaction, none added)
        stay: a serving loop's steps with no admission or finish since, the bench's repeated
        orderings. The table is also kept indexed by id (`policy.routing_id_table`), so that
        a request's narrow sort key is one gather of its id. Returns the permutation (int64
        [n]), or None when no running key counts (no reordering)."""
        run = tuple(self.running)  # holds the states: ids of finished ones cannot be reused
        c = self._rk_table
        if c is None or c[0] != (run, self._rk_epoch, len(self._rk_names)):
            run_ids = np.array(self._running_key_ids(), dtype=np.int64)  # may intern: before the ranks
            t = dpolicy.routing_table_host(self._rk_ranks(), run_ids, -1, dense=True) if (run_ids >= 0).any() else None
            by_id = None if t is None else dpolicy.routing_id_table(*t)
            self._rk_table = c = ((run, self._rk_epoch, len(self._rk_names)), t, by_id)
        if c[1] is None:
            return None
        if c[2] is not None:  # ids are interned (< K, the table's key count) or -1: one narrow gather
            return dpolicy.rank_perm_host(c[2][qk], c[1][1])
        return dpolicy.routing_perm_from_table(qk, *c[1])

    def _head_groups(self, rows: np.ndarray, sel: "_RowCols", T: int):
        """R-ORD-9 groups of table rows `rows`: (group ids int64 [B], size of the id space).
        Equal ids iff equal (namespace, `policy.head_hashes` of the first T fill tokens,
        gathered from the token pool); each row's id is computed and interned once per fill
        and T, so a step groups its queue without sorting (`in_batch_deprioritize_groups`).
        The intern table starts anew (every row's id recomputed when next needed) once it
        holds several times more entries than the row table has rows."""
        if len(self._hg_id) > 4 * len(self._rt_owner) + self.HEAD_GROUP_SLACK:
            self._hg_id.clear()
            self._rt[:, RT_HEADT] = -1
            sel = _RowCols(self._rt, rows)
        miss = np.flatnonzero(sel[:, RT_HEADT] != T)
        if miss.size:
            self._ensure_hashed(rows[miss])  # their tokens are read from the pool
            # the heads' width: positions past a fill count nothing, so the longest fill bounds
            # it (the same hashes as width T, which may be up to int64's largest); a power of
            # two, so that few widths (and weight tables, `policy._hash_weights`) ever occur
            W = min(T, 1 << max(int(sel[miss, RT_FILL].max()) - 1, 0).bit_length())
            if self._host_paths():  # numpy on the pool's view: the same hashes, no torch op
                tok = self._pool_views()[0][: self._qtop[0]] if self._qtok is not None else np.zeros(0, np.int32)
                # offsets are >= 0 once hashed; a fill shorter than W may end the pool
                cols = np.minimum(_rt_get(self._rt, rows[miss], RT_TOFF)[:, None] + np.arange(W), max(tok.size - 1, 0))
                heads = tok[cols] if tok.size else np.zeros((miss.size, W), dtype=np.int32)
                hh = dpolicy.head_hashes_host(heads, np.minimum(sel[miss, RT_FILL], W))
            else:
                tok, _ = self._pools()
                toff = torch.from_numpy(_rt_get(self._rt, rows[miss], RT_TOFF)).to(self.device)
                fill = torch.from_numpy(sel[miss, RT_FILL]).to(self.device)
                hh = dpolicy.head_hashes_pool(tok, toff, fill, W).cpu().numpy()
            ids = self._hg_id
            # hashes are below 2^62: (namespace, hash) as one Python int, exact
            grp = [ids.setdefault((ns << 62) | h, len(ids)) for ns, h in zip(sel[miss, RT_NS].tolist(), hh.tolist())]
            group = sel[:, RT_HEAD].copy()
            group[miss] = grp
            _rt_set(self._rt, rows[miss], RT_HEAD, group[miss])
            _rt_set(self._rt, rows[miss], RT_HEADT, T)
            return torch.from_numpy(group).to(self.device), len(ids)
        return torch.from_numpy(sel[:, RT_HEAD]).to(self.device), len(self._hg_id)

    def _full_match(self, rows: np.ndarray, sel: "_RowCols", lens: torch.Tensor, current: bool = False):
        """Full-length matches (R-ORD-8) of table rows `rows` (`sel` = their columns, `lens` their
        fill lengths as an int64 device tensor [B]): (length, last pool position) int64 device tensors [B], kept in
        the rows for later steps and for admission (`_window_match`). A row whose full match
        was found on a tree version the tree's change log reaches keeps it, position included,
        when neither of its two hashes was entered or removed since (`FlatRadixTree.unchanged`:
        a binary search in the few hashes the steps between changed, no table lookup); other
        rows matched before (any earlier step) have their old length checked (`check_matches`:
        two lookups); only rows without one, or whose match changed, are searched (their fills
        hashed into the pools first if new, and read as CSR tensors: `_csr`). `current`: the
        caller found every row matched on the tree's current version: the kept matches are
        returned as they are."""
        tree = self.cache.tree
        be = tree.backend
        dev = self.device
        if current:  # every row matched on the tree's current content (the caller's test)
            return torch.from_numpy(sel[:, RT_MLEN]).to(dev), torch.from_numpy(sel[:, RT_MPOS]).to(dev)
        ver = sel[:, RT_MVER]
        hinted = ver != -1
        if hinted.any():
            # full matches verified on an earlier tree version the change log reaches: kept
            # where neither of their two hashes changed since, the rest checked by lookups
            logged = ver >= tree._log_floor  # versions are >= 1: no row without a match is logged
            nl = int(np.count_nonzero(logged))
            # a log of more hashes than LOG_PER_ROW per logged row costs more to sort and test
            # than two lookups per row (`check_matches`, below): then the rows are looked up
            since = tree.changed_since(int(ver[logged].min()), limit=self.LOG_PER_ROW * nl) if nl else None
            if since is not None and since.numel() == 0 and logged.all():
                # the common step: nothing entered or removed since every row's match, so all
                # are kept as they are (no hash columns read)
                m = torch.from_numpy(sel[:, RT_MLEN]).to(dev)
                return m, torch.from_numpy(sel[:, RT_MPOS]).to(dev)
            guess = np.where(hinted, sel[:, RT_MLEN], -1)
            if self._host_paths():  # the same steps on the columns' numpy views: no torch op per call
                h1, h2 = torch.from_numpy(sel[:, RT_H1]), torch.from_numpy(sel[:, RT_H2])
                g = torch.from_numpy(guess)
                kp = torch.from_numpy(sel[:, RT_MPOS])  # by positions while the tree defers entries
                if since is not None:
                    keep = tree.unchanged(since, h1, h2).numpy() & logged
                    chk = np.flatnonzero(~keep)
                    ok, pos = keep.copy(), np.where(keep, sel[:, RT_MPOS], -1)
                    if chk.size:
                        c = torch.from_numpy(chk)
                        ok_c, pos_c = tree.check_matches(lens[c], g[c], h1[c], h2[c], backend=be, positions=kp[c])
                        ok[chk], pos[chk] = ok_c.numpy(), pos_c.numpy()
                else:
                    ok, pos = (x.numpy() for x in tree.check_matches(lens, g, h1, h2, backend=be, positions=kp))
                mi = np.flatnonzero(~ok)
                m = np.where(ok, guess, 0)
                if mi.size:
                    fm, fp = self._search_rows(rows, sel, mi)
                    m[mi], pos[mi] = fm.numpy(), fp.numpy()
                return torch.from_numpy(m), torch.from_numpy(pos)
            hint = torch.from_numpy(np.stack([guess, sel[:, RT_H1], sel[:, RT_H2], sel[:, RT_MPOS]])).to(dev)
            if since is not None:
                keep = tree.unchanged(since, hint[1], hint[2]) & torch.from_numpy(logged).to(dev)
                chk = torch.nonzero(~keep).flatten()
                ok = keep.clone()
                pos = torch.where(keep, hint[3], -1)
                if chk.numel():
                    ok_c, pos_c = tree.check_matches(lens[chk], hint[0][chk], hint[1][chk], hint[2][chk], backend=be)
                    ok[chk], pos[chk] = ok_c, pos_c
            else:
                ok, pos = tree.check_matches(lens, hint[0], hint[1], hint[2], backend=be)
            m = torch.where(ok, hint[0], 0)
            miss = torch.nonzero(~ok).flatten()
            if miss.numel():
                fm, fp = self._search_rows(rows, sel, miss.cpu().numpy())
                m, pos = m.index_copy(0, miss, fm), pos.index_copy(0, miss, fp)
            return m, pos
        # no row was matched before (the caller has at least one): all are searched
        return self._search_rows(rows, sel, np.arange(len(rows), dtype=np.int64))

    def _search_rows(self, rows: np.ndarray, sel: "_RowCols", mi: np.ndarray):
        """`_full_match`'s search of the rows at `mi` (int64 [k] indices into `rows`) on the
        tree, as they have no kept match or theirs changed: (length, last pool position) int64
        device tensors [k]. Their hashes at the length and one page on are written into their
        rows, with no hint (RT_MVER = -1) until the caller writes the new lengths."""
        tree = self.cache.tree
        if self._scalar_find(mi.size):
            k4 = self._find_rows_scalar(rows[mi], capped=False)
            fm, fp, hh = torch.from_numpy(k4[0]), torch.from_numpy(k4[1]), k4[2:]
        else:
            tok, toff, mlen, ns, ch, coff, cl = self._csr(rows[mi], False)
            mc = int(sel[mi, RT_FILL].max(initial=0)) // tree.C
            fm, fp = tree._find_csr(tok, toff, mlen, mlen, ns, ch, coff, cl, mc, tree.backend)
            h1, h2 = tree.depth_hashes(tok, toff, ns, ch, coff, fm)
            hh = torch.stack([h1, h2]).cpu().numpy()
        _rt_set(self._rt, rows[mi], RT_MVER, -1)
        _rt_set(self._rt, rows[mi], RT_H1, hh[0])
        _rt_set(self._rt, rows[mi], RT_H2, hh[1])
        return fm, fp

    def _child_ranks(self):
        """(parent, child_rank) over the live nodes only (compacted ids, root first) and the map
        from tree ids to compacted ids, for dfs-weight's torch forms: siblings ranked by child
        order (the host form orders on the tree's own ids instead, `_dfs_weight_perm_host`)."""
        t = self.cache.tree
        b = t.node_bound()  # every live id is below it
        ids = torch.nonzero(t.alive[:b]).flatten()  # root (0) first
        remap = torch.full_like(t.parent[:b], -1)
        remap[ids] = torch.arange(ids.numel(), device=self.device)
        p = t.parent[ids]
        parent = torch.where(p >= 0, remap[p.clamp(min=0)], -1)
        return parent, dpolicy.child_order_ranks(parent, t.order[ids]), remap

    # ---- admission (R-STEP-3) as one static step ------------------------------------------------
    def _admission_loop(self, queue: List[ReqState], adder) -> str:
        start = len(adder.can_run)
        self._lead = None
        try:
            return self._admission_scan(queue, adder)
        finally:
            self._last_admitted = len(adder.can_run) - start

    def _admission_scan(self, queue: List[ReqState], adder) -> str:
        """R-STEP-3: `gpu_sched.admission.admit_step` decides the whole loop on the device (admitted
        prefix, chunks, stop, budgets); one read-back, then the host applies it (`_admit_run`: the
        admission's own matches applied with splits and stamps, locks, can_run, commits). A request
        that finds the batch full with priority preemption on (`STOP_PREEMPT`) goes through
        `_admit_preempting` (device victim choice, host release), after which the rest of the
        queue is decided again."""
        running_bs = len(self.running)  # SGLang reads the batch size once, before the loop
        scfg = None  # made for the first window `_static_admission` decides
        pending = self._take_pending(queue, adder)
        i, n = 0, len(queue)
        start, lead = len(adder.can_run), 0  # queue[:lead] admitted, in order, after `start` entries
        W = max(1, int(self.admit_window))
        if self.adaptive_window and not self._last_admitted:
            if self.SCALAR_WINDOW > 0 and self._host_paths() and not self.config.enable_priority_preemption:
                # the previous loop admitted nothing: most likely this one stops at once too,
                # so a small window decided one request at a time (`_scalar_admission`) comes
                # before a static one over `admit_window` requests (~300 us at 256)
                W = min(W, self.SCALAR_WINDOW)
        elif self.adaptive_window:
            # an eighth more than the last loop admitted, rounded up to a multiple of 1/8 of the
            # power of two at or below that (a window past the stop point is wasted work; one
            # too short costs a second, twice as long)
            need = self._last_admitted + (self._last_admitted >> 3) + 1
            q = 1 << max(need.bit_length() - 4, 0)
            W = -(-need // q) * q  # below admit_window too: a small window costs little (walks, not scans)
        while i < n:
            if pending is not None:  # the recorded step decided this segment already
                rest = self._window_view(queue, 0, pending.window)[0]
                vals = pending.head[:12] + pending.extend_end[: pending.head[11]].tolist()
                matched = None if self.cache.disable else (self._graph.m_cap, self._graph.pos_cap)
                pending = None
            elif adder.new_chunked is not None:
                # an earlier window chunked a request: one chunk a step (`PrefillAdder.add_one_req`),
                # which a window decided on its own does not know, so the rest goes request by
                # request, the reference's iteration (the chunk left little budget: it stops within a few)
                for j in range(i, n):
                    stop = self._admit_one(queue[j], adder, running_bs)
                    if stop is not None:
                        return stop
                return "queue_end"
            else:
                # a window of the queue: the loop never reads past its stop point, and one that
                # gets through the window goes on with the next (twice as long)
                rest, wrows = self._window_view(queue, i, i + W)
                W *= 2
                if self._scalar_window(rest):
                    vals, matched = self._scalar_admission(rest, adder, running_bs, wrows)
                else:
                    if scfg is None:
                        scfg = StepConfig.from_config(self.config)
                    vals, matched = self._static_admission(rest, adder, running_bs, scfg, wrows)
            Q = len(rest)
            stop, k, ci, full, I, cur, rin, rc, hit, inp, decided, na = vals[:12]
            if not decided:
                raise RuntimeError("admit_step did not reach the end of the loop (rounds too few)")
            ends = vals[12 : 12 + na]
            refused = na == k and k < Q and stop in (STOP_NO_TOKEN, STOP_OTHER)  # re-matched, then refused
            if matched is not None:  # the admission's own capped match of the rows applied
                # the admitted prefix, and the refused request after it (slices: no index tensor)
                if isinstance(matched[0], list):
                    matched = tuple(v[:na] + v[k : k + 1] if refused else v[:na] for v in matched)
                elif isinstance(matched[0], np.ndarray):
                    matched = tuple(np.concatenate([v[:na], v[k : k + 1]]) if refused else v[:na] for v in matched)
                else:
                    matched = tuple(torch.cat([v[:na], v[k : k + 1]]) if refused else v[:na] for v in matched)
            self._admit_run(rest[:na], ends[:na], adder, rematch=rest[k] if refused else None, matched=matched)
            if lead == i:
                lead += na
            self._lead = (queue, adder.can_run, start, lead)  # read by `_unadmitted` (R-STEP-4)
            adder.I, adder.cur_off, adder.rem_input = I, cur, rin
            if adder.rem_chunk is not None:
                adder.rem_chunk = rc
            adder.log_hit_tokens += hit
            adder.log_input_tokens += inp
            if ci >= 0:
                adder.new_chunked = rest[ci]
            self.batch_is_full = bool(full)
            if stop == STOP_QUEUE_END and i + Q < n:  # the window, not the queue, ended
                i += Q
                continue
            if stop != STOP_PREEMPT:
                return STOP_NAMES[stop]
            stop = self._admit_preempting(rest[k], adder)
            if stop is not None:
                return stop
            if lead == i + k:  # rest[k] was added after the run before it
                lead += 1
                self._lead = (queue, adder.can_run, start, lead)
            i += k + 1
        return "queue_end"

    def _window_view(self, queue, a: int, b: int):
        """(requests a..b-1 of `queue`, their table rows int64 [b-a] or None): where a RowQueue
        holds them as rows, a RowQueue view of those rows (requests are looked up only where
        read: the admitted ones), else a list."""
        wrows = queue.window_rows(a, b) if isinstance(queue, RowQueue) else None
        if wrows is not None:
            return RowQueue(self, wrows), wrows
        return (queue.window(a, b)[0] if isinstance(queue, RowQueue) else queue[a:b]), None

    def _admit_preempting(self, r: ReqState, adder) -> Optional[str]:
        """R-STEP-3 for a request that finds the batch full with priority preemption on: re-match
        (D5), the preemption decision on the device (`_preempt`), re-match again (the
        victims' release may have evicted part of the prefix), add_one_req."""
        self.batch_is_full = True
        self._rematch(r)
        if not self._preempt(r, adder):
            return "batch_full"
        return self._rematch_and_add(r, adder)

    def _preempt(self, r: ReqState, adder) -> bool:
        """R-ADM-7: victims chosen by `gpu_sched.admission.preempt_select` (sorted on the device,
        cumulative reservations, cut), read back once; the host then releases them in
        running-batch order exactly as `PrefillAdder.preempt_for` does."""
        cfg = self.config
        run = self.running
        R = len(run)
        if R == 0:
            return False
        clip = cfg.clip_max_new_tokens
        dev = self.device
        ints = torch.from_numpy(np.array([[v.priority for v in run], [min(v.max_new - v.out_len, clip) for v in run]],
                                         dtype=np.int64)).to(dev)
        times = torch.tensor([v.enqueue_time for v in run], dtype=torch.float64, device=dev)
        base = r.fill_len - r.prefix_len + min(r.max_new, clip) - (self.pool.available + self.cache.evictable_size - adder.I)
        sc = torch.tensor([r.priority, base, adder.N], dtype=torch.int64).to(dev)
        res = preempt_select(torch.ones(R, dtype=torch.bool, device=dev), ints[0], times, ints[1], sc[0], sc[1],
                             torch.tensor(adder.ratio, dtype=torch.float64, device=dev), sc[2], cfg.priority_sign,
                             cfg.priority_scheduling_preemption_threshold, backend=self.backend)
        vals = torch.cat([torch.stack([res.success.to(torch.int64), res.V]), res.victims.to(torch.int64)]).tolist()
        if not vals[0]:
            return False
        mask = vals[2:]
        in_order = [v for v, m in zip(run, mask) if m]
        for k, v in enumerate(in_order, start=1):
            adder.preempt_evicted_tokens += self._release(v, R - k)
        run[:] = [v for v, m in zip(run, mask) if not m]
        adder.N -= vals[1]
        adder.preempted.extend(in_order)
        return True

    def _static_admission(self, rest: List[ReqState], adder, running_bs: int, scfg,
                          rows: Optional[np.ndarray] = None):
        """Columns of the ordered queue's window `rest` (table rows `rows`, looked up when
        None) and the adder's budgets as device tensors, then `admit_step` (no host read
        inside; backend "triton" runs its per-request kernels). On the host paths with the
        cache on and no priority preemption: `_window_lead` on the numpy matches and drops
        `_window_drops` gives there. Returns (vals, matched): vals = [stop code, stop index,
        chunk index (-1: none), batch full, I, cur_off, rem_input, rem_chunk, hit tokens, input
        tokens, decided, admitted count] + the admitted requests' extend ends (the read-back
        layout `_admission_scan` reads, `_scalar_admission`'s and `_window_loop`'s too)."""
        dev = self.device
        Q = len(rest)
        if rows is None:
            rows = self._rows_of(rest)
        sel = _RowCols(self._rt, rows)  # pool offsets not read: `_csr` hashes what a search needs
        host = self.backend == "torch"  # the rounds' scalar state on the host (`admit_step_host`)
        if (self.LEAD_WINDOWS and not self.cache.disable and self._host_paths()
                and not self.config.enable_priority_preemption):
            m, drop, ev, matched = self._window_drops(Q, rows, sel)
            return self._window_lead(rows, m, drop, ev, adder, running_bs, sel), matched
        cols = np.stack([sel[:, c] for c in (RT_FILL, RT_OUT, RT_PROMPT, RT_MAXNEW, RT_IGN)])
        if scfg.ignore_eos_path or not self._host_paths():
            cols = torch.from_numpy(cols).to(dev)  # else numpy columns: `admit_step_host` reads those as they are
        m, drop, ev, matched = self._window_drops(Q, rows, sel)
        budgets = [self.pool.available, adder.I, adder.cur_off, adder.rem_input,
                   adder.rem_chunk if adder.rem_chunk is not None else 0, adder.N, len(adder.can_run), running_bs,
                   int(self.batch_is_full)]
        sc = budgets if host else torch.tensor(budgets, dtype=torch.int64).to(dev)
        st = StepState(available=sc[0], evictable=ev, I=sc[1], cur_off=sc[2], rem_input=sc[3], rem_chunk=sc[4],
                       ratio=adder.ratio if host else torch.tensor(adder.ratio, dtype=torch.float64, device=dev),
                       N=sc[5], can_run=sc[6], running_bs=sc[7], batch_full=sc[8] != 0)
        q = QueueCols(n=Q if host else torch.tensor(Q, device=dev), fill_len=cols[0], out_len=cols[1],
                      prompt_len=cols[2], max_new=cols[3], prefix_len=m, drop=drop, ignore_eos=cols[4] != 0)
        held = None
        if scfg.ignore_eos_path:
            hs = list(self.running) + list(adder.can_run)
            hc = torch.from_numpy(np.array([[r.max_new, r.out_len, r.prompt_len, int(r.req.ignore_eos)] for r in hs],
                                           dtype=np.int64).reshape(len(hs), 4).T.copy()).to(dev)
            held = HeldCols(valid=torch.ones(len(hs), dtype=torch.bool, device=dev), max_new=hc[0], out_len=hc[1],
                            prompt_len=hc[2], ignore_eos=hc[3] != 0)
        res = (admit_step_host(scfg, st, q, held) if host
               else read_step_result(admit_step(scfg, st, q, held, None, backend=self.backend, early_exit=True)))
        return ([res.stop, res.stop_index, res.chunk_index, int(res.batch_full), res.I, res.cur_off, res.rem_input,
                 res.rem_chunk, res.hit_tokens, res.input_tokens, int(res.decided), res.admitted] + res.extend_end,
                matched)

    def _window_drops(self, Q: int, rows: np.ndarray, sel: "_RowCols"):
        """The admission window's capped matches (`_window_match`) and what locking each
        request's path lowers `evictable` by after the requests before it in the window locked
        theirs (`admission.lock_drops`, R-RC-6): (m, drop, evictable, matched), m and drop int64
        device tensors [Q], evictable the tree's (a device scalar), matched = (m, pos) or None
        with the cache disabled (all zero). On the host paths with the cache on: numpy arrays
        and an int (`_window_drops_host`)."""
        dev = self.device
        if self.cache.disable:
            m = torch.zeros(Q, dtype=torch.int64, device=dev)
            return m, torch.zeros_like(m), torch.zeros((), dtype=torch.int64, device=dev), None
        tree = self.cache.tree
        if self._host_paths():  # the tree takes this scheduler's backend: torch here
            return self._window_drops_host(rows, sel)
        m, pos, nc = self._window_match(rows, sel)
        # nodes on any matched path
        depth = int(np.minimum(sel[:, RT_FILL], sel[:, RT_CAP]).max(initial=0)) // self.config.page_size
        # live node ids lie below node_bound(): scan that prefix, rounded up to a power of
        # two (few distinct shapes), not the whole capacity
        b = min(1 << max(tree.node_bound() - 1, 1).bit_length(), tree.parent.numel())
        arrays = (tree.parent[:b], tree.key_len[:b], tree.lock_ref[:b], tree.alive[:b])
        bound = 1 << depth.bit_length()  # power of two: few distinct shapes
        if nc is not None:  # read off the paths already
            drop = lock_drops(*arrays, *nc, m > 0, max_depth=bound, backend=self.backend, early_exit=True)
        else:  # the node and cover of each match found with the drops (one launch on triton)
            drop = match_lock_drops(*arrays, tree.owner, tree.key_off, m, pos, torch.ones_like(m, dtype=torch.bool),
                                    max_depth=bound, backend=self.backend, early_exit=True)
        return m, drop, tree.evictable_size, (m, pos)

    def _window_drops_host(self, rows: np.ndarray, sel: "_RowCols"):
        """`_window_drops` on the host paths with the cache on, numpy in and out: the same
        (m, drop, evictable [tokens], (m, pos)), m, drop and pos int64 numpy [Q], evictable an
        int. Rows whose full match is known on the tree's current content are climbed to their
        capped depth (`_path_position_host`) with no torch op (a torch call after a pause costs
        20-35 us, a numpy one 5-9: `benchmarks/bench_cold.py`); other windows take
        `_window_match` and read its tensors' views."""
        tree = self.cache.tree
        P = self.config.page_size
        owner, key_off, key_len, parent = map(tree._np, ("owner", "key_off", "key_len", "parent"))
        capped = np.minimum(sel[:, RT_FILL], sel[:, RT_CAP])
        if bool((sel[:, RT_MVER] == tree.version).all()):
            mlen = sel[:, RT_MLEN]
            m = np.minimum(capped // P * P, mlen)
            pos, node, cover = _path_position_host(owner, key_off, key_len, parent, mlen, sel[:, RT_MPOS], m)
            has = m > 0
        else:
            mt, pt, _ = self._window_match(rows, sel)
            m, pos = mt.numpy(), pt.numpy()
            has, node = _match_nodes_host(owner, m, pos)
            cover = pos - key_off.take(node, mode="clip") + 1
        depth = int(capped.max(initial=0)) // P  # nodes on any matched path
        b = min(1 << max(tree.node_bound() - 1, 1).bit_length(), parent.size)  # as `_window_drops`
        drop = lock_drops_np(parent[:b], key_len[:b], tree._np("lock_ref")[:b], tree._np("alive")[:b], node, cover,
                             has, max_depth=1 << depth.bit_length(), early_exit=True)
        return m, drop, tree.host_int("evictable_size"), (m, pos)

    def _scalar_window(self, rest) -> bool:
        """Whether `_scalar_admission` decides this window: a few requests (at most
        `SCALAR_WINDOW`), the torch backend on the host paths' CPU (`policy.host_ok`: not
        inside `torch_forms()`), no priority preemption (its victims' release changes the tree
        mid-loop)."""
        return (len(rest) <= self.SCALAR_WINDOW and self._host_paths()
                and not self.config.enable_priority_preemption)

    def _scalar_admission(self, rest, adder, running_bs: int, rows: Optional[np.ndarray] = None):
        """R-STEP-3 over a small window. With the cache on, `_window_loop` decides it, each
        row's match and lock drop made when the loop reaches the row (`_ScalarMatcher`; at
        most `SCALAR_WINDOW` scalar searches, where the array search of a window of fresh
        rows would hash every fill whole). With the cache disabled (ignore-EOS requests
        take R-ADM-6's path there) the reference's own loop (`_admit_one` and
        `PrefillAdder.add_one_req`, one request at a time) runs on a copy of the adder whose
        cache is a `_DisabledCache`, every re-match (R-STEP-3.4) empty at the root. Nothing
        on the tree changes here: `_admission_scan` applies the outcome (`_admit_run`) as it
        applies `admit_step`'s. Returns (vals, matched) in `_static_admission`'s read-back
        layout (matched None with the cache disabled)."""
        Q = len(rest)
        if rows is None:
            rows = self._rows_of(rest)
        if not self.cache.disable:
            match = _ScalarMatcher(self, rows)  # each row's match and drop when the loop reaches it
            vals = self._window_loop(rows, None, None, self.cache.tree.host_int("evictable_size"), adder,
                                     running_bs, row_match=match)
            return vals, (match.ms, match.ps)
        # the budgets as the loop leaves them (the real adder takes them after): a shallow copy
        # by its __dict__ (copy.copy's __reduce_ex__ path costs a few us more)
        sub = object.__new__(type(adder))
        sub.__dict__.update(adder.__dict__)
        sub.can_run = list(adder.can_run)
        sub.new_chunked = None
        sub.log_hit_tokens = sub.log_input_tokens = 0
        sub.cache = _DisabledCache()
        start, full0 = len(sub.can_run), self.batch_is_full
        stop, k = "queue_end", Q
        reqs = rest.window(0, Q)[0] if isinstance(rest, RowQueue) else rest  # one lookup, not one per item
        self._match_hint = (0, self.cache.root)  # read by `_rematch`: the disabled cache's match
        try:
            for j in range(Q):
                reason = self._admit_one(reqs[j], sub, running_bs)
                if reason is not None:
                    stop, k = reason, j
                    break
        finally:
            self._match_hint = None
            full, self.batch_is_full = self.batch_is_full, full0
        run = sub.can_run[start:]  # the window's admitted prefix
        code = STOP_CODES[stop]
        ci = next((j for j, r in enumerate(run) if r is sub.new_chunked), -1)
        vals = [code, k, ci, int(full), sub.I, sub.cur_off, sub.rem_input,
                sub.rem_chunk if sub.rem_chunk is not None else 0, sub.log_hit_tokens, sub.log_input_tokens, 1,
                len(run)] + [r.extend_end for r in run]
        return vals, None

    def _window_lead(self, rows: np.ndarray, m: np.ndarray, drop: np.ndarray, ev: int, adder, running_bs: int,
                     sel: "_RowCols") -> List[int]:
        """`_window_loop` for a large window, its lead decided by numpy: k0 = the first request
        that is not admitted whole with the loop going on after it (R-STEP-3 / R-ADM-1..3;
        the budgets before request j are the start's plus exclusive prefix sums of whole
        commits and lock drops, exactly as the loop forms them, so the checks of every request
        up to the stop are a few array calls), then `_window_loop` from k0 with the state
        there (it decides k0 itself and anything after: a chunk, a refusal, the batch full).
        Some 40 numpy calls, where `admit_step_host`'s checks of every request take ~150
        (a call after a pause costs 5-9 us whatever its size: `benchmarks/bench_cold.py`).
        m, drop: int64 [Q] capped matches and lock drops [tokens]; ev: evictable [tokens]."""
        cfg = self.config
        P, clip, cap, pmax = cfg.page_size, cfg.clip_max_new_tokens, cfg.max_running_requests, cfg.prefill_max_requests
        # no int64 sum below wraps: CLIP and the page size are bounded (config.TOKEN_KNOB_MAX, PAGE_SIZE_MAX)
        Q = len(rows)
        ncan0 = len(adder.can_run)
        RN = adder.ratio * adder.N
        I0, cur0, rin0, rc0 = adder.I, adder.cur_off, adder.rem_input, adder.rem_chunk
        A = self.pool.available
        fill, out, maxn = sel[:, RT_FILL], sel[:, RT_OUT], sel[:, RT_MAXNEW]
        ext = fill - m
        e = ext if P == 1 else -(-ext // P) * P  # ceilP: the pages a whole admission commits
        total = ext + np.minimum(np.maximum(maxn - out, 0), clip) + P
        # exclusive prefix sums [Q + 1] of the whole commits (R-ADM-2: I, cur_off, rem_input)
        # and of the lock drops and hit tokens
        d = np.zeros((5, Q + 1), dtype=np.int64)
        np.cumsum(np.stack([e + np.minimum(maxn, clip) + P, e + P, e, drop, m]), axis=1, out=d[:, 1:])
        Ij, rinj = I0 + d[0], rin0 - d[2]
        base = A + ev - d[3]  # available + evictable before request j locks its path
        rt = (base - Ij).astype(np.float64) - RN  # D7's rem_total, as `PrefillAdder.rem_total` forms it
        good = (rt > 0) & (base - (cur0 + d[1]) > 0) & (rinj > 0)  # budget_state() CONTINUE before j
        if rc0 is not None:
            rcj = rc0 - d[2]
            good &= rcj > 0
        bad = ~good[1:]  # the budgets after j's commit stop the loop
        bad |= total >= rt[:-1]  # refused before the temporary lock
        bad |= total >= (base[:-1] - drop - Ij[:-1]).astype(np.float64) - RN  # and after it
        if rc0 is None:  # more input than rem_input once the batch holds a request
            bad |= (e >= rinj[:-1]) & (np.arange(ncan0, ncan0 + Q) > 0)
        else:  # a chunk, not a whole admission
            bad |= e > rcj[:-1]
        k0 = int(bad.argmax()) if Q else 0
        if Q and not bad[k0]:
            k0 = Q
        if not good[0] or self.batch_is_full:
            k0 = 0
        if cap is not None:  # the batch fills at this request
            k0 = min(k0, max(cap - running_bs - ncan0, 0))
        if pmax is not None:  # prefill_max_requests reached at this request
            k0 = min(k0, max(pmax - ncan0, 0))
        lead = (k0, int(d[0, k0]), int(d[1, k0]), int(d[2, k0]), int(d[3, k0]), int(d[4, k0]), fill[:k0].tolist())
        return self._window_loop(rows, m, drop, ev, adder, running_bs, lead)

    def _window_loop(self, rows: np.ndarray, ms, drops, ev: int, adder,
                     running_bs: int, lead=None, row_match=None) -> List[int]:
        """R-STEP-3 and R-ADM-1..3 over a window with the cache on and no priority preemption
        (a small one whole, a large one from `_window_lead`'s first index), in
        `_static_admission`'s read-back layout: the loop `_admit_one` and
        `PrefillAdder.add_one_req` run, one request at a time, with the budgets as local ints
        (`I`, `cur_off`, `rem_input`, `rem_chunk`), `evictable` [tokens] lowered by `drops[j]`
        while request j holds its (temporary or kept) lock, and each request's lengths read
        from the row table (`rows`): no request object is read or written, no adder is copied.
        `ms[j]` is request j's re-match (R-STEP-3.4, D5). The reference's own loop
        (`_scalar_admission` with the cache disabled) takes 5-7 us per request; this takes
        about 2. `lead` (from `_window_lead`): (k0, then the sums over requests 0..k0-1,
        all admitted whole, of the I, cur_off and rem_input commits, lock drops and hit
        tokens, and their extend ends): the loop starts at request k0 with those applied.
        `row_match` (instead of ms and drops, without `lead`): called with j = 0, 1, ... as
        the loop re-matches request j, returns (ms[j], drops[j], and the row's fill, output
        and max_new_tokens lengths) (`_ScalarMatcher`), so rows past the stop point are never
        matched or read."""
        cfg = self.config
        P, clip, align = cfg.page_size, cfg.clip_max_new_tokens, cfg.truncation_align_size
        cap, pmax = cfg.max_running_requests, cfg.prefill_max_requests
        A = self.pool.available
        RN = adder.ratio * adder.N  # D7: the float64 product, as `rem_total` forms it
        I, cur, rin, rc = adder.I, adder.cur_off, adder.rem_input, adder.rem_chunk
        hit = inp = 0
        ncan0 = ncan = len(adder.can_run)
        full = self.batch_is_full
        ends: List[int] = []
        stop, k, ci = "queue_end", len(rows), -1
        k0 = 0
        if lead is not None:
            k0, dI, dC, dE, dD, hit, ends = lead
            I, cur, rin, ev, inp, ncan = I + dI, cur + dC, rin - dE, ev - dD, dE, ncan + k0
            if rc is not None:
                rc -= dE
            rows, ms, drops = rows[k0:], ms[k0:], drops[k0:]
        if row_match is None:
            if not isinstance(ms, list):
                ms, drops = ms.tolist(), drops.tolist()
            cols = self._rt[rows[:, None], _LOOP_COLS].tolist()
        for i in range(len(rows)):
            j = k0 + i  # the window's index
            if (float(A + ev - I) - RN > 0 and A + ev - cur > 0
                    and (rin <= 0 or rc is not None and rc <= 0)):  # budget_state() is OTHER
                stop, k = "budget_other", j
                break
            if cap is not None and running_bs + ncan >= cap:
                full = True
            if full:
                stop, k = "batch_full", j
                break
            # the re-match (R-STEP-3.4, D5), then add_one_req (R-ADM-3) with that prefix
            if row_match is not None:  # the matcher reads the row's lengths too
                prefix, drop, fill, out, maxnew = row_match(j)
            else:
                prefix, drop = ms[i], drops[i]
                fill, out, maxnew = cols[i]
            if pmax is not None and ncan >= pmax:
                stop, k = "add_other", j
                break
            ext = fill - prefix
            total = ext + min(max(maxnew - out, 0), clip) + P
            in_paged = -(-ext // P) * P
            res = None
            for evict in (ev, ev - drop):  # refused() before and after the temporary lock
                if total >= float(A + evict - I) - RN:
                    res = "add_no_token"
                elif rc is None and ncan and in_paged >= rin:
                    res = "add_other"
                if res is not None:
                    break
            if res is None:
                if rc is None or in_paged <= rc:
                    n_ext, reserve, end = in_paged, min(maxnew, clip), fill
                elif ci >= 0:  # one chunk a step (`PrefillAdder.add_one_req`)
                    res = "add_other"
                else:  # the chunked request of this step (R-ADM-3's truncation)
                    t = rc // P * P
                    if align is not None:
                        if t < align:
                            res = "add_other"
                        t = t // align * align
                    if res is None:
                        t = (prefix + t) // P * P - prefix
                        if t <= 0:
                            res = "add_other"
                    n_ext, reserve, end = t, 0, prefix + t
                    if res is None:
                        ci = j
            if res is not None:
                stop, k = res, j
                if res == "add_no_token":
                    full = bool(ncan or self.running)
                break
            ev -= drop  # the lock is kept
            ends.append(end)
            ncan += 1
            e = -(-n_ext // P) * P  # _commit (R-ADM-2)
            I += e + reserve + P
            cur += e + P
            rin -= e
            if rc is not None:
                rc -= e
            hit += prefix
            inp += e
            # budget_state() after the commit
            if float(A + ev - I) - RN <= 0 or A + ev - cur <= 0:
                stop, k = "add_no_token", j  # the stop reason of the request just admitted
                full = bool(ncan or self.running)
                break
            if rin <= 0 or rc is not None and rc <= 0:
                stop, k = "add_other", j
                break
        na = ncan - ncan0
        return [STOP_CODES[stop], k, ci, int(full), I, cur, rin, rc if rc is not None else 0, hit, inp, 1,
                na] + ends

    def _rematch(self, r: ReqState) -> None:
        hint = self._match_hint  # `_scalar_admission`'s window match, else a match on the tree
        if hint is not None:
            r.prefix_len, r.last_node = hint
            return
        super()._rematch(r)

    def _window_match(self, rows: np.ndarray, sel: "_RowCols"):
        """R-STEP-3.4 matches (capped at max_prefix_len) of table rows `rows` (`sel` = their
        columns): (length, last pool position) int64 device tensors. A row whose full-length
        match is known on the tree's current content (this step's lpm/dfs-weight ordering, or
        an earlier one if nothing was inserted or removed since) takes it: present depths are
        a prefix of the page ends, so the capped match is min(full, floorP(cap)), and its
        position lies on the full match's path (`FlatRadixTree.path_position`). The other rows
        go through `_checked_find`. Returns (m, pos, nc): nc = (node, cover) of the capped
        matches (`path_position(nodes=True)`) when every row's was read off its path, else None."""
        tree = self.cache.tree
        P = self.config.page_size
        known = sel[:, RT_MVER] == tree.version
        if not known.any():
            return (*self._checked_find(rows, sel), None)
        capped = np.minimum(sel[:, RT_FILL], sel[:, RT_CAP]) // P * P
        full = np.stack([sel[:, RT_MLEN], sel[:, RT_MPOS], np.minimum(capped, sel[:, RT_MLEN])])
        full[:, ~known] = 0  # matched below
        ft = torch.from_numpy(full).to(self.device)
        m = ft[2]
        pos, node, cover = tree.path_position(ft[0], ft[1], m, nodes=True)
        if known.all():
            return m, pos, (node, cover)
        miss = np.flatnonzero(~known)
        fm, fp = self._checked_find(rows[miss], sel.sub(miss))
        mi = torch.from_numpy(miss).to(self.device)
        return m.index_copy(0, mi, fm), pos.index_copy(0, mi, fp), None

    def _checked_find(self, rows: np.ndarray, sel: "_RowCols"):
        """Capped matches (R-STEP-3.4, no splits or stamps) of table rows without a trusted
        match. A row's kept length (any earlier match of its fill, full or capped, on any tree
        content) that is not past the capped length is checked first (`check_matches`: two lookups, exact for
        any guess); the other rows are searched, and their new lengths kept (tree version
        -2: checked before use, never trusted) for the next step, where most still hold."""
        tree = self.cache.tree
        be, dev, P = tree.backend, self.device, self.config.page_size
        capped = np.minimum(sel[:, RT_FILL], sel[:, RT_CAP])
        g = np.where((sel[:, RT_MVER] != -1) & (sel[:, RT_MLEN] <= capped // P * P), sel[:, RT_MLEN], -1)
        miss = np.flatnonzero(g < 0)
        if miss.size == len(rows):
            m = pos = None
        else:
            t = torch.from_numpy(np.stack([capped, g, sel[:, RT_H1], sel[:, RT_H2]])).to(dev)
            ok, pos = tree.check_matches(t[0], t[1], t[2], t[3], backend=be)
            m = torch.where(ok, t[1], 0)
            miss = np.flatnonzero(~ok.cpu().numpy())
        if miss.size:
            mrows = rows[miss]
            if self._scalar_find(miss.size) or self._lazy_rows(mrows):
                kept = self._find_rows_scalar(mrows, capped=True)
                self._keep_found(mrows, kept)
                fm, fp = torch.from_numpy(kept[0]), torch.from_numpy(kept[1])
            else:
                tok, toff, lens, ns, ch, coff, cl = self._csr(mrows, True)
                mc = int(cl.max()) if cl.numel() else 0
                fm, fp = tree._find_csr(tok, toff, lens, lens, ns, ch, coff, cl, mc, be)
                h1, h2 = tree.depth_hashes(tok, toff, ns, ch, coff, fm)
                self._keep_found(mrows, torch.stack([fm, fp, h1, h2]).cpu().numpy())
            if m is None:
                return fm, fp
            mi = torch.from_numpy(miss).to(dev)
            m, pos = m.index_copy(0, mi, fm), pos.index_copy(0, mi, fp)
        return m, pos

    def _keep_found(self, rows: np.ndarray, kept: np.ndarray) -> None:
        """Keep searched capped matches in the row table (kept: int64 [4, n] = length, pool
        position, hashes at the length and one page on) with tree version -2: checked before
        use (`check_matches`), never trusted."""
        _rt_set(self._rt, rows, RT_MVER, -2)
        for c, v in zip(_KEEP_COLS[1:], kept):  # length, position, the two hashes
            _rt_set(self._rt, rows, c, v)

    def _host_paths(self) -> bool:
        """Whether this scheduler's passes take their host forms: the torch backend on the CPU
        outside `torch.compile` (`policy.host_ok`), where numpy on the tensors' views
        stands in for torch ops and the Python walks for a few rows are allowed."""
        return self.backend == "torch" and self._on_cpu and dpolicy.host_ok()

    def _scalar_find(self, n: int) -> bool:
        """Whether n rows' matches are searched on the host one by one (`_find_rows_scalar`)
        rather than by the array search: the torch backend on the host paths' CPU, for a few
        rows (`FIND_SCALAR_MAX`), or, on a tree with deferred entries, for up to one row per
        256 of them (the array search would enter them all, ~0.1 us each, where a row's walk
        costs some 15-50 us)."""
        if not self._host_paths():
            return False
        return n <= self.FIND_SCALAR_MAX or self.LAZY_FIND_TOKENS > 0 and 256 * n <= self.cache.tree._pend_n

    def _lazy_rows(self, rows: np.ndarray) -> bool:
        """Whether many rows' first capped searches go one by one through `_find_rows_scalar`
        anyway (so the unhashed ones take `_find_lazy`) rather than the array search over
        fills hashed whole: on the host paths, when the rows' unhashed fills average over
        4 x `LAZY_FIND_TOKENS` tokens (a whole fill costs ~30 ns a token to hash with 31-bit
        token ids, a walk a lookup and a token comparison per node on its matched path)."""
        if self.LAZY_FIND_TOKENS <= 0 or not self._host_paths():
            return False
        fresh = rows[_rt_get(self._rt, rows, RT_TOFF) < 0]
        return int(_rt_get(self._rt, fresh, RT_FILL).sum()) > 4 * self.LAZY_FIND_TOKENS * len(rows)

    def _find_rows_scalar(self, rows: np.ndarray, capped: bool) -> np.ndarray:
        """The matches of a few table rows by `FlatRadixTree._find_scalar` per row, on the
        pools' views: capped at max_prefix_len (`_checked_find`'s) or full-length
        (`_full_match`'s). int64 [4, n] (length, position, the hashes at the length and one
        page on); the callers keep them as they keep the array search's. With
        `LAZY_FIND_TOKENS` > 0, a row whose fill is not hashed yet (a request's first match: an
        admission window's of a fcfs, lof or routing-key request, an ordering's of a few new
        lpm or dfs-weight ones) walks the tree on the fill's tokens instead (`_find_lazy`), and
        so does every row while the tree holds deferred entries (a hash search would enter
        them all first)."""
        if self.LAZY_FIND_TOKENS > 0:
            walk = bool(self.cache.tree._pend)  # hashed rows walk too: a hash search would enter deferred entries
            if len(rows) == 1 and (walk or self._rt.item(int(rows[0]), RT_TOFF) < 0):  # one arrival: no array call
                return np.array(self._find_lazy(int(rows[0]), capped), dtype=np.int64).reshape(4, 1)
            fresh = np.full(len(rows), True) if walk else _rt_get(self._rt, rows, RT_TOFF) < 0
            if fresh.any():
                out = np.empty((4, len(rows)), dtype=np.int64)
                if not fresh.all():
                    out[:, ~fresh] = self._find_rows_scalar(rows[~fresh], capped)
                for j in np.flatnonzero(fresh).tolist():
                    out[:, j] = self._find_lazy(int(rows[j]), capped)
                return out
        self._ensure_hashed(rows)
        qt, qc = self._pool_views()
        tok, ch = qt[: self._qtop[0]], qc[: self._qtop[1]]
        cols = self._rt[rows[:, None], _FIND_COLS].tolist()
        find = self.cache.tree._find_scalar
        return np.array([find(tok, ch, toff, coff, min(fill, cap) if capped else fill, ns)
                         for toff, coff, fill, cap, ns in cols], dtype=np.int64).reshape(len(cols), 4).T.copy()

    def _find_lazy(self, row: int, capped: bool = True) -> Tuple[int, int, int, int]:
        """`_find_rows_scalar`'s search of one row whose fill is not in the pools (capped at
        max_prefix_len or full-length), by a walk of the tree on the fill's tokens
        (`FlatRadixTree._walk_scalar`: a lookup and a token comparison per node on the
        matched path, no hash of the fill). The values are those of the pooled search where
        `check_matches` probes them (the hash at the length when it is over 0, and one page
        on wherever the fill reaches, past a capped length too: `_full_match` checks a kept
        capped match against the whole fill). The pools are not written: the fill is hashed
        whole when a path needs it there (R-ORD-9's head groups, an array search, the
        recorded step).
        Returns (length, position, hash at the length, hash at length + P)."""
        f, N = self._rt_mv()
        fill_len, cap, ns = f[RT_FILL * N + row], f[RT_CAP * N + row], f[RT_NS * N + row]
        tok = self._rt_owner[row].fill()
        return self.cache.tree._walk_scalar(tok, min(fill_len, cap) if capped else fill_len, ns)

    def _admit_run(self, run: List[ReqState], ends: List[int], adder, rematch: Optional[ReqState] = None,
                   matched=None) -> None:
        """Apply the admissions `admit_step` decided, in queue order: the admission's capped
        matches applied in this order (splits and stamps as sequential matching; `rematch` last:
        the refused request the loop re-matched before refusing it), batched locks, extend ranges
        and can_run. `matched`: (matched length, pool position) of run + [rematch], int64:
        device tensors, numpy arrays (`_window_drops_host`) or, from a small window, Python
        lists, found on the tree as it was at admission (splits since do not move tokens, so
        the positions still hold); numpy arrays and CPU tensors on a host-form tree are
        applied by `FlatRadixTree._apply_host`. Budgets and counters come from the step's
        result."""
        if self.cache.disable:
            root = self.cache.root
            for r, end in zip(run, ends):  # adder._admit's effect, inlined: one pass
                r.prefix_len, r.last_node, r.lock_node = 0, root, None
                r.extend_start, r.extend_end = 0, end
            adder.can_run.extend(run)
            return
        rs = run + ([rematch] if rematch is not None else [])
        if not rs:
            return
        tree = self.cache.tree
        if isinstance(matched[0], list):  # a small window's lists (`_ScalarMatcher`): no tensor
            m, last = matched[0], tree._apply_list(*matched)
            vals = m + last
        elif isinstance(matched[0], np.ndarray) or tree._host_form() and matched[0].is_cpu:
            m = np.asarray(matched[0])  # numpy in and out (`_apply_host`; a CPU tensor's view)
            last = tree._apply_host(m, np.asarray(matched[1]))
            vals = m.tolist() + last.tolist()
        else:
            m, last = tree._apply(matched[0], matched[1], tree.backend)
            vals = None
        if run:
            tree.lock(last[: len(run)])
        B = len(rs)
        if vals is None:
            vals = torch.cat([m, last]).tolist()
        for r, a, b, end in zip(run, vals, vals[B:], ends):  # adder._admit's effect, inlined: one pass
            r.prefix_len, r.last_node, r.lock_node = a, b, b
            r.extend_start, r.extend_end = a, end
        adder.can_run.extend(run)
        if rematch is not None:
            rematch.prefix_len, rematch.last_node = vals[B - 1], vals[-1]
