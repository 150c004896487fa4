"""The decision of one scheduling step as a fixed-capacity device computation that a CUDA graph
can hold: prefix match, ordering and admission (SPEC.md R-STEP-2, R-STEP-3; sections 3-5).

`StepGraph` keeps the waiting queue, the running batch and the step's budgets in preallocated
device buffers (capacities fixed at construction; entries past the device count `n` are
padding) and computes, with static shapes and no host read:

  1. prefix match of every queued request against the device radix tree
     (`FlatRadixTree.find_static`: fixed binary-search rounds, fixed probe windows), at full
     length for ordering (R-ORD-8) and capped at max_prefix_len for admission (R-STEP-3.4);
  2. the policy's order (`gpu_sched.policy`: fcfs with or without priority, lof, routing-key,
     lpm with in-batch deprioritization R-ORD-9 and the R-ORD-2 fallback, dfs-weight on the
     tree before the ordering match's splits, `_dfs_weight_perm`; random as the permutation
     `load` uploaded); padding sorts last;
  3. the admission of the first W ordered entries (`gpu_sched.admission.admit_step`, with the
     in-flight chunked request R-ADM-5 and lock-aware evictable drops `lock_drops`; W = the
     `admit_window` given to `capture()`, by default as many as one step's prefill token budget
     can admit, capped at the capacity: the loop never reads past its stop point, and one that
     admits all W goes on eagerly on the host).

Everything lands in one int64 output buffer (`HEAD` scalars, then the order, extend ends (first
W), full match lengths and deprioritized flags, each [Q]), so the host reads the step back once;
the per-step inputs (the queue's row-store slots and enqueue times, the budgets' scalars, the
new-token ratio) go the other way in one input buffer, one copy (from pinned memory on CUDA). On
CUDA the computation is recorded once in a `torch.cuda.CUDAGraph` and replayed; the graph is
recorded again when a tensor it reads was reallocated (the tree's hash table grown, the
scheduler's token pools rebuilt): `signature()` names them by address.

What stays on the host: the queue's slot numbers in a device row store (each request's row is
written once, when first seen), the budgets, and after the read-back the tree's splits and
stamps, locks and the per-request bookkeeping
(`GpuScheduler` applies them exactly as its eager path does), and under random the
permutation: drawn by `GpuScheduler._random_perm` as the eager path draws it (the scheduler's
seeded generator, on the device; or its `shuffle=` callable) and uploaded by `load`, so the
recorded and the eager step decide alike with the same seed.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import numpy as np
import torch

from . import policy as dpolicy
from .config import CACHE_AWARE_POLICIES, CAPTURE_CAPACITY_MAX, TOKEN_KNOB_MAX, _check_int
from .admission import ChunkedCols, HeldCols, QueueCols, StepConfig, StepState, admit_step, match_lock_drops
from .scheduler import (RT_CAP, RT_COFF, RT_FILL, RT_IGN, RT_MAXNEW, RT_NS, RT_OUT, RT_PRIO, RT_PROMPT,
                        RT_RKEY, RT_STAMP, RT_TIME, RT_TOFF, _rt_get, _RowCols)

#: policies the recorded step computes (every policy; random from an uploaded permutation)
GRAPH_POLICIES = ("fcfs", "lof", "routing-key", "lpm", "dfs-weight", "random")
#: output head: stop, stop_index, chunk_index, batch_full, I, cur_off, rem_input, rem_chunk,
#: hit_tokens, input_tokens, decided, admitted count, inflight_end, inflight_left
HEAD = 14
#: those fields by their names in `kernels.admission.admission_result`'s int64 output (`R_*`;
#: INPUT_NEW: input tokens without the in-flight chunk's own, which the host's adder counts)
_HEAD_FIELDS = ("STOP", "STOP_INDEX", "CHUNK_INDEX", "FULL", "I", "CUR", "RIN", "RC", "HIT", "INPUT_NEW", "DONE",
                "COUNT", "INFLIGHT_END", "INFLIGHT_LEFT")
# queue int64 rows
_Q_FILL, _Q_OUT, _Q_PROMPT, _Q_MAXNEW, _Q_IE, _Q_PRIO, _Q_CAP, _Q_NS, _Q_TOFF, _Q_COFF = range(10)
_Q_ROWS = 10
# scalar slots
(_S_N, _S_AVAIL, _S_I, _S_CUR, _S_RIN, _S_RC, _S_NRES, _S_RBS, _S_FULL, _S_NHELD,
 _S_CPRES, _S_CFILL, _S_CPRE, _S_CMAXNEW, _S_COUT, _S_CPROMPT, _S_CIE, _S_ZERO, _S_NW) = range(19)
_S_LEN = 19
#: `kernels.admission.admission_prepare`'s scalar inputs (SV_* order) as places in the scalar
#: slots with the tree's evictable size appended (at _S_LEN): one gather on the triton backend;
#: the second form for a config without chunked prefill (rem_chunk 0)
_SV_FROM_SC = tuple((_S_AVAIL, _S_LEN, _S_I, _S_CUR, _S_RIN, rc, _S_NRES, _S_ZERO, _S_RBS, _S_FULL, _S_NW, _S_CPRES,
                     _S_CFILL, _S_CPRE, _S_CMAXNEW) for rc in (_S_RC, _S_ZERO))


class StepOutput(NamedTuple):
    """One step read back: the head as Python ints, the per-entry fields as numpy arrays
    (views of one host copy of the output; a list of 4k entries costs ~100 us to make,
    more than the rest of the read), queue order where said."""

    head: List[int]  # HEAD values, see the module constant
    order: np.ndarray  # int64 [n] queue positions in policy order
    extend_end: np.ndarray  # int64 [min(n, window)] extend end of the ordered queue's entries (admitted ones)
    prefix_len: Optional[np.ndarray]  # int64 [n] full-length match, queue order (lpm, dfs-weight; else None)
    deprioritized: Optional[np.ndarray]  # bool [n] R-ORD-9 flags, queue order (lpm, dfs-weight; else None)
    window: int  # ordered entries the admission scanned: a stop at queue_end with window < n
    #              means the host goes on from there (`GpuScheduler._admission_loop`)


class StepGraph:
    """Fixed-capacity step of a `GpuScheduler` (see the module doc).

    Args:
        sched: the `GpuScheduler` whose tree, token pools and config the step reads.
        queue_capacity: Q, most waiting requests per step.
        running_capacity: R, most running requests (ignore-EOS states, R-ADM-6).
        max_len: bound on the waiting requests' fill lengths [tokens]; fixes the match's
            search rounds, the ancestor rounds of `lock_drops` and dfs-weight's rounds and
            tiebreak (default: the tree's token capacity). `GpuScheduler` takes its eager path
            for a queue with a longer fill (`fits_lengths`).
        admit_window: ordered entries the recorded admission decides (default: the queue
            capacity, capped at `max(GpuScheduler.admit_window, config.max_prefill_tokens)`:
            every admitted request takes at least one prefill token, so the window covers the
            admissions of nearly every step; a larger value is capped at the queue capacity).
            A step that admits all of them goes on eagerly on the host, window by window, which
            on a GPU costs far more than the replay.
    Raises:
        TypeError: a capacity, max_len or admit_window that is not an int (bools refused).
        ValueError: one below 1, a capacity above 2^24, a max_len above 2^40.
    """

    #: fewest slots of the row store (twice the queue capacity and the row table's rows at least)
    MIN_STORE = 1024

    def __init__(self, sched, queue_capacity: int, running_capacity: int, max_len: Optional[int] = None,
                 admit_window: Optional[int] = None):
        _check_int("queue_capacity", queue_capacity, lo=1, hi=CAPTURE_CAPACITY_MAX, hi_is="2^24")
        _check_int("running_capacity", running_capacity, lo=1, hi=CAPTURE_CAPACITY_MAX, hi_is="2^24")
        _check_int("max_len", max_len, lo=1, hi=TOKEN_KNOB_MAX, hi_is="2^40", none_means="the tree's token capacity")
        _check_int("admit_window", admit_window, lo=1, none_means="max(GpuScheduler.admit_window, max_prefill_tokens)")
        self.s = sched
        self.Q, self.R = int(queue_capacity), int(running_capacity)
        # The sequential loop never looks past its stop point, so admission scans the first W
        # ordered entries only (exact: nothing after an entry changes what it sees); a loop
        # that gets through all W goes on eagerly from there.
        if admit_window is None:
            admit_window = max(int(getattr(sched, "admit_window", 1)), int(sched.config.max_prefill_tokens))
        self.W = min(self.Q, int(admit_window))
        tree = sched.cache.tree
        self.max_len = int(max_len) if max_len is not None else int(tree.token_capacity)
        dev = sched.device
        self.device = dev
        # the per-step inputs in one device buffer, sent by one host-to-device copy (`load`):
        # row-store slot per queue position [Q], enqueue times [Q] (float64 bits), the scalar
        # slots [_S_LEN] and the new-token ratio (float64 bits); the step reads views of it
        Q = self.Q
        self.inp = torch.zeros(2 * Q + _S_LEN + 1, dtype=torch.int64, device=dev)
        self._input_views()
        # its host side: pinned on CUDA, so the copy does not wait for the device; the next
        # load waits for the copy before writing it again (`_sent`)
        self._stage = torch.zeros(self.inp.numel(), dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._stage_np = self._stage.numpy()
        self._sent = None
        self._store_cap = 0
        self._grow(max(2 * self.Q, self.MIN_STORE, sched._rt.shape[0]))
        self.hi = torch.zeros((4, self.R), dtype=torch.int64, device=dev)
        # routing-key (R-ORD-7): the queue's interned key ids, the running batch's (-1 past
        # it: not counted) and each id's string rank, uploaded when a key is interned
        self.qk = torch.full((self.Q,), -1, dtype=torch.int64, device=dev)
        self.rk_run = torch.full((self.R,), -1, dtype=torch.int64, device=dev)
        self.rk_rank = torch.zeros(16, dtype=torch.int64, device=dev)
        self._rk_loaded = None  # the rank array last uploaded
        # random (R-ORD-6): the step's permutation of the queue, padding after it in place
        self._ar = torch.arange(self.Q, dtype=torch.int64, device=dev)
        # read-only constants of `_compute`: no match, nothing deprioritized
        self._zeros = torch.zeros(self.Q, dtype=torch.int64, device=dev)
        self._no_dep = torch.zeros(self.Q, dtype=torch.bool, device=dev)
        self.rperm = self._ar.clone()
        self._sv_idx = [torch.tensor(ix, dtype=torch.int64, device=dev) for ix in _SV_FROM_SC]
        self.out = torch.zeros(HEAD + 4 * self.Q, dtype=torch.int64, device=dev)
        self._pad = torch.zeros(self.Q - self.W, dtype=torch.int64, device=dev)  # extend ends past the window
        # the head's fields in `kernels.admission.admission_result`'s packing (the triton backend
        # only: the torch backend imports no kernel module)
        self._head_idx = None
        if sched.backend == "triton":
            from .kernels import admission as KA

            self._head_idx = torch.tensor([getattr(KA, "R_" + f) for f in _HEAD_FIELDS], dtype=torch.int64,
                                          device=dev)
        # full-length match (queue order) for the host's splits and stamps after the read-back
        self.m_full = torch.zeros(self.Q, dtype=torch.int64, device=dev)
        self.pos_full = torch.zeros(self.Q, dtype=torch.int64, device=dev)
        # capped match of the admission window (ordered), applied by the host to what was admitted
        self.m_cap = torch.zeros(self.W, dtype=torch.int64, device=dev)
        self.pos_cap = torch.zeros(self.W, dtype=torch.int64, device=dev)
        self.graph = None
        self._sig = None
        self._n = 0
        self._caps = np.zeros(0, dtype=np.int64)  # max_prefix_len of the loaded queue
        self.captures = 0  # graphs recorded so far
        self.runs = 0  # steps computed (replays on CUDA)

    def _input_views(self) -> None:
        """The step's views of its input buffer `inp`: row-store slots, enqueue times, scalars
        and the ratio."""
        Q = self.Q
        self.sidx = self.inp[:Q]
        self.qt = self.inp[Q : 2 * Q].view(torch.float64)
        self.sc = self.inp[2 * Q : 2 * Q + _S_LEN]
        self.ratio = self.inp[2 * Q + _S_LEN :].view(torch.float64).reshape(())

    # ---- copies and pickles ----------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) of a recorded step: its buffers as torch copies them, without
        the views into them (a pickle copies a view apart from its base, and a copied numpy
        view of the input stage is not the stage the step uploads: a copied scheduler decided on
        stale inputs), the copy event and the CUDA graph, recorded again by the copy's first
        step (its buffers are new). The views are made again on the copy's own buffers."""
        state = dict(self.__dict__)
        for name in ("sidx", "qt", "sc", "ratio", "_stage_np"):
            del state[name]
        state.update(_sent=None, graph=None, _sig=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._input_views()
        if self.device.type == "cuda" and not self._stage.is_pinned():
            self._stage = self._stage.pin_memory()
        self._stage_np = self._stage.numpy()

    # ---- eligibility and inputs ------------------------------------------------------------------
    def supports(self, n_queue: int, n_running: int) -> bool:
        """True if this step fits a recorded policy and the capacities (the scheduler also
        checks `fits_lengths`)."""
        cfg = self.s.config
        return cfg.effective_policy in GRAPH_POLICIES and n_queue <= self.Q and n_running <= self.R

    def fits_lengths(self, rows: np.ndarray) -> bool:
        """True if every fill of the queue's table rows `rows` is within `max_len` (the bound
        the match's search rounds, `lock_drops`' and dfs-weight's tree rounds and dfs-weight's
        tiebreak rely on), or the cache is off (nothing is matched)."""
        return self.s.cache.disable or rows.size == 0 or int(_rt_get(self.s._rt, rows, RT_FILL).max()) <= self.max_len

    def load(self, rows: np.ndarray, adder, batch_full: bool, chunked) -> None:
        """Write one step's inputs into the buffers.

        rows: int64 [n], the waiting requests' rows in the scheduler's row table, in queue
        order (`GpuScheduler._queue_rows`); adder: a fresh `PrefillAdder`
        (budgets at the loop's start, before the in-flight chunked request); chunked: that
        request or None. The device row store mirrors the scheduler's host row table
        (`GpuScheduler._rows_of`: one row per request, written once per fill, its stamp moved
        whenever the row or its pool offsets change): a step sends the queue's row numbers
        and uploads only rows whose stamp moved since their last upload."""
        s = self.s
        n = len(rows)
        # random: drawn first (a bad shuffle raises before any buffer is written), as the eager
        # path draws it, on the device
        rp = s._random_perm(n) if s.config.effective_policy == "random" else None
        self._n = n
        idx = rows
        s._ensure_hashed(idx)  # may rebuild the pools
        if s._rt.shape[0] > self._store_cap:
            self._grow(2 * s._rt.shape[0])
        sel = _RowCols(s._rt, idx)
        stale = np.flatnonzero(self._upl[idx] != sel[:, RT_STAMP])
        if stale.size:
            u, su = idx[stale], sel.sub(stale)
            cols = np.stack([su[:, RT_FILL], su[:, RT_OUT], su[:, RT_PROMPT], su[:, RT_MAXNEW], su[:, RT_IGN],
                             su[:, RT_PRIO],
                             su[:, RT_CAP],
                             *((su[:, RT_NS], su[:, RT_TOFF], su[:, RT_COFF]) if not s.cache.disable
                               else (np.zeros(stale.size, dtype=np.int64),) * 3)])
            ut = torch.from_numpy(u).to(self.device)
            self.store.index_copy_(1, ut, torch.from_numpy(cols).to(self.device))
            self._upl[u] = su[:, RT_STAMP]
        if s.config.effective_policy in CACHE_AWARE_POLICIES:  # read with the full matches (the plan's num_matched)
            self._caps = sel[:, RT_CAP]
        if self._sent is not None:  # the last step's copy still reads the host buffer
            self._sent.synchronize()
        Q, st = self.Q, self._stage_np
        st[:n] = idx
        st[n:Q] = 0
        if s.config.enable_priority_scheduling:
            st[Q : Q + n] = sel[:, RT_TIME]  # the float64 bits, as the table keeps them
            st[Q + n : 2 * Q] = 0
        if s.config.effective_policy == "routing-key":
            self._load_routing(sel[:, RT_RKEY])
        elif rp is not None:  # in place, padding as the identity after it
            self.rperm[:n].copy_(rp)
            self.rperm[n:].copy_(self._ar[n:])
        run = self.s.running
        if s.config.disable_radix_cache:  # the running batch's columns: read only by the ignore-EOS scan (R-ADM-6,
            # `StepConfig.ignore_eos_path`)
            hi = np.zeros((4, self.R), dtype=np.int64)
            if run:
                hi[:, : len(run)] = np.array([[r.max_new, r.out_len, r.prompt_len, int(r.req.ignore_eos)] for r in run],
                                             dtype=np.int64).T
            self.hi.copy_(torch.from_numpy(hi))
        c = chunked
        st[2 * Q : 2 * Q + _S_LEN] = [
            n, self.s.pool.available, adder.I, adder.cur_off, adder.rem_input,
            adder.rem_chunk if adder.rem_chunk is not None else 0, adder.N, len(run), int(batch_full),
            len(run), int(c is not None),
            *((c.fill_len, c.prefix_len, c.max_new, c.out_len, c.prompt_len, int(c.req.ignore_eos))
              if c is not None else (0,) * 6), 0, min(n, self.W)]
        st[2 * Q + _S_LEN :] = np.float64(adder.ratio).view(np.int64)
        cuda = self.device.type == "cuda"
        self.inp.copy_(self._stage, non_blocking=cuda)
        if cuda:
            self._sent = torch.cuda.Event()
            self._sent.record()

    def _load_routing(self, key_ids: np.ndarray) -> None:
        """R-ORD-7's inputs: the queue's key ids [n], the running batch's, and the string ranks
        when they changed (a larger buffer when the keys outgrew it: the graph is recorded
        again). Unused rank slots rank above every key; no id points at them."""
        s = self.s
        run = s._running_key_ids()  # may intern a key: before the ranks
        ranks = s._rk_ranks()
        if ranks is not self._rk_loaded:
            K = ranks.size
            if K > self.rk_rank.numel():
                self.rk_rank = torch.zeros(max(2 * K, 16), dtype=torch.int64, device=self.device)
            full = np.arange(self.rk_rank.numel(), dtype=np.int64)
            full[:K] = ranks
            self.rk_rank.copy_(torch.from_numpy(full))
            self._rk_loaded = ranks
        qk = np.full(self.Q, -1, dtype=np.int64)
        qk[: key_ids.size] = key_ids
        self.qk.copy_(torch.from_numpy(qk))
        rk = np.full(self.R, -1, dtype=np.int64)
        rk[: len(run)] = run
        self.rk_run.copy_(torch.from_numpy(rk))

    def _grow(self, cap: int) -> None:
        """A row store of `cap` slots (a new tensor: the graph is recorded again); every row is
        uploaded again when next used."""
        self._store_cap = int(cap)
        self.store = torch.zeros((_Q_ROWS, self._store_cap), dtype=torch.int64, device=self.device)
        self._upl = np.full(self._store_cap, -1, dtype=np.int64)  # row stamp at its last upload

    # ---- the device computation -------------------------------------------------------------------
    def compute(self) -> None:
        """The step on the buffers (static shapes, no host read); writes `out`, `m_full`,
        `pos_full`. The torch forms on every device (`policy.torch_forms`): on the CPU too it
        computes what a CUDA graph records, not the eager step's numpy forms."""
        with dpolicy.torch_forms():
            self._compute()

    def _compute(self) -> None:
        s = self.s
        cfg = s.config
        be = s.backend
        dev = self.device
        i64 = torch.int64
        qi, sc = self.store.index_select(1, self.sidx), self.sc
        fill, outl, prompt, maxn, ie, prio, cap, ns, toff, coff = qi.unbind(0)
        n = sc[_S_N]
        ar = self._ar  # the constants are buffers made once (never written): no kernel each
        valid = ar < n
        zeros = self._zeros
        cache_on = not s.cache.disable
        policy = cfg.effective_policy
        tree = s.cache.tree
        if cache_on:
            tok, ch = s._qtok, s._qch
            if tok is None:  # nothing hashed yet (an empty queue): empty pools
                tok = torch.zeros(0, dtype=torch.int32, device=dev)
                ch = torch.zeros(0, dtype=i64, device=dev)
        # ---- ordering (R-ORD) ----
        dep = self._no_dep
        m_full, pos_full = zeros, None  # matched only for lpm / dfs-weight
        if policy in ("lpm", "dfs-weight"):
            # straight into the buffers the host reads these matches from (no copy after)
            m_full, pos_full = tree.find_static(tok, toff, fill, ns, ch, coff, self.max_len, valid=valid,
                                                out=(self.m_full, self.pos_full), backend=be)
            T = cfg.in_batch_prefix_caching_deprioritize_threshold
            if 0 < T <= self.max_len:
                hh = dpolicy.head_hashes_pool(tok, toff, fill, T, backend=be)
            else:  # no fill reaches T (fills are <= max_len here): R-ORD-9 groups nobody
                hh = zeros
            dep = dpolicy.in_batch_deprioritize(m_full, fill, ns, hh, cfg.in_batch_prefix_caching_check_threshold,
                                                T, valid=valid, backend=be)
            if policy == "lpm":
                perm = dpolicy.lpm_order(m_full, dep, cap=cap, valid=valid, backend=be)
                if cfg.lpm_fallback_queue_len is not None:  # R-ORD-2: above the limit, queue order
                    perm = torch.where(n > cfg.lpm_fallback_queue_len, ar, perm)
            else:  # padding matches nothing: at the root with tiebreak 0, behind the real requests
                # there (queue order breaks their tie) and so last of all
                perm = self._dfs_weight_perm(m_full, pos_full)
        else:
            if policy == "random":
                perm = self.rperm
            elif policy == "routing-key":
                perm = dpolicy.routing_key_order(self.qk, self.rk_rank, self.rk_run, backend=be)
            elif policy == "lof":
                perm = dpolicy.lof_order(maxn, prio if cfg.enable_priority_scheduling else None, cfg.priority_sign,
                                         backend=be)
            elif cfg.enable_priority_scheduling:
                perm = dpolicy.fcfs_priority_order(prio, self.qt, cfg.priority_sign, backend=be)
            else:
                perm = ar
            # padding last, the order of the real entries kept
            if be == "triton":  # one launch, no sort
                from .kernels.sort_keys import valid_first

                perm = valid_first(perm.contiguous(), n)
            else:
                perm = perm[torch.sort((~valid[perm]).to(torch.int8), stable=True).indices]
        # ---- admission (R-STEP-3) on the first W ordered entries ----
        W = self.W
        pw = perm[:W]
        ovalid = torch.index_select(valid, 0, pw)
        # the window's columns in one gather of the stacked queue rows (one kernel, not ten)
        (w_fill, w_out, w_prompt, w_maxn, w_ie, _, w_cap, w_ns, w_toff,
         w_coff) = torch.index_select(qi, 1, pw).unbind(0)
        zeros = zeros[:W]
        if cache_on:  # the match capped at max_prefix_len (R-STEP-3.4)
            om, opos = tree.find_static(tok, w_toff, w_fill, w_ns, ch, w_coff, self.max_len, cap=w_cap, valid=ovalid,
                                        out=(self.m_cap, self.pos_cap), backend=be)
            b = self._node_span()
            drop = match_lock_drops(tree.parent[:b], tree.key_len[:b], tree.lock_ref[:b], tree.alive[:b], tree.owner,
                                    tree.key_off, om, opos, ovalid, max_depth=self.max_len // cfg.page_size, backend=be)
            ev = tree.evictable_size
        else:
            om, drop = zeros, zeros
            ev = torch.zeros((), dtype=i64, device=dev)
        scfg = StepConfig.from_config(cfg)
        sv = None
        if be == "triton":  # the loop's scalars in one gather; st's and chunked's then read only where noted
            sv = torch.cat([sc, ev.reshape(1)]).index_select(0, self._sv_idx[0 if scfg.chunking else 1])
        packed = sv is not None
        # can_run (0) and the window's count min(n, W) are host-written slots: views, no op
        st = StepState(available=sc[_S_AVAIL], evictable=ev, I=sc[_S_I], cur_off=sc[_S_CUR], rem_input=sc[_S_RIN],
                       rem_chunk=sc[_S_RC], ratio=self.ratio, N=sc[_S_NRES], can_run=sc[_S_ZERO],
                       running_bs=sc[_S_RBS], batch_full=sc[_S_FULL] if packed else sc[_S_FULL] != 0)
        q = QueueCols(n=sc[_S_NW], fill_len=w_fill, out_len=w_out, prompt_len=w_prompt, max_new=w_maxn,
                      prefix_len=om, drop=drop, ignore_eos=w_ie != 0)
        held = None
        if scfg.ignore_eos_path:
            h = self.hi
            held = HeldCols(valid=torch.arange(self.R, device=dev) < sc[_S_NHELD], max_new=h[0], out_len=h[1],
                            prompt_len=h[2], ignore_eos=h[3] != 0)
        flags = not packed or scfg.ignore_eos_path  # the ignore-EOS grid reads the chunk's flags
        chunked = ChunkedCols(present=sc[_S_CPRES] != 0 if flags else sc[_S_CPRES], fill_len=sc[_S_CFILL],
                              prefix_len=sc[_S_CPRE], max_new=sc[_S_CMAXNEW], out_len=sc[_S_COUT],
                              prompt_len=sc[_S_CPROMPT], ignore_eos=sc[_S_CIE] != 0 if flags else sc[_S_CIE])
        res = admit_step(scfg, st, q, held, chunked, backend=be, sv=sv)
        if res.packed is not None:  # triton: the head's values packed by the result launch, one gather
            head = res.packed.index_select(0, self._head_idx)
        else:
            # the host's adder counts the in-flight chunk's input tokens itself (add_chunked_req)
            P = cfg.page_size
            in_flight = torch.where(chunked.present, (res.inflight_end - chunked.prefix_len + P - 1) // P * P, 0)
            head = torch.stack([res.stop, res.stop_index, res.chunk_index, res.batch_full.to(i64), res.I,
                                res.cur_off, res.rem_input, res.rem_chunk, res.hit_tokens, res.input_tokens - in_flight,
                                res.decided.to(i64), res.admitted.sum(), res.inflight_end, res.inflight_left.to(i64)])
        # straight into the output buffer: head, order, extend ends (zero past the window), full
        # matches, deprioritized flags
        torch.cat([head, perm, res.extend_end, self._pad, m_full, dep.to(i64)], out=self.out)

    def _dfs_weight_perm(self, m_full: torch.Tensor, pos_full: torch.Tensor) -> torch.Tensor:
        """R-ORD-10 on the tree as it is, before the full matches' splits (the host applies those
        after the read-back): every node slot below `_node_span()` takes part, dead ones
        detached (parent -1, no requests); siblings ordered by the tree's creation-order stamps
        (`tree.order`, unbounded: the siblings' sort takes two keys), no ranking pass and no
        compaction. A match ending inside a
        node, which sequential matching would split, is the node's request with tiebreak
        `max_len + 1 - cover` (`dfs_weight_order`): after the node's own requests, deeper
        covers first, as the chain of split heads would emit them (a head takes its node's
        place in the child order)."""
        tree = self.s.cache.tree
        b = self._node_span()
        if self.s.backend == "triton":  # the same values in one launch
            from .kernels.dfs_weight import match_nodes

            node, tb, parent = match_nodes(m_full, pos_full, tree.owner, tree.key_off, tree.key_len, tree.alive[:b],
                                           tree.parent[:b], self.max_len + 1)
        else:
            parent = torch.where(tree.alive[:b], tree.parent[:b], -1)
            has = m_full > 0
            p = torch.where(has, pos_full, 0)
            node = torch.where(has, tree.owner[p], 0)
            cover = p - tree.key_off[node] + 1
            tb = torch.where(has & (cover < tree.key_len[node]), self.max_len + 1 - cover, 0)
        return dpolicy.dfs_weight_order(parent, tree.order[:b], None, node,
                                        max_depth=min(self.max_len // self.s.config.page_size, b),
                                        backend=self.s.backend, tiebreak=tb, rank_bound=dpolicy.INT64_MAX,
                                        tiebreak_bound=self.max_len + 1)

    def _node_span(self) -> int:
        """Node ids the admission scans: every live id is below `node_bound()`; rounded up to a
        power of two so that the span (part of the recorded shapes) changes only on doubling."""
        tree = self.s.cache.tree
        return min(1 << max(tree.node_bound() - 1, 1).bit_length(), tree.parent.numel())

    # ---- graph --------------------------------------------------------------------------------------
    def signature(self) -> tuple:
        """Addresses and sizes of every tensor the step reads besides its own buffers, and the
        node span: a change means the recorded graph would read stale memory or shapes."""
        tree = self.s.cache.tree
        ts = [v for v in vars(tree).values() if isinstance(v, torch.Tensor)]
        ts += [t for t in (self.s._qtok, self.s._qch, self.store, self.rk_rank) if t is not None]
        return tuple((t.data_ptr(), t.numel()) for t in ts) + (self._node_span(),)

    def run(self) -> StepOutput:
        """Compute (replaying the recorded graph on CUDA, recording it first when needed) and
        read the output back: the step's one device-to-host copy."""
        if self.device.type == "cuda":
            sig = self.signature()
            if self.graph is None or sig != self._sig:
                self._record()
                self._sig = sig
            self.graph.replay()
        else:
            self.compute()
        self.runs += 1
        return self._read()

    def _read(self) -> StepOutput:
        # one host copy (on the CPU too: the next step writes `out` again) of what the step
        # reads: the full matches and flags only for the policies that order by them
        Q, n, b = self.Q, self._n, HEAD
        w = min(n, self.W)
        cache_aware = self.s.config.effective_policy in CACHE_AWARE_POLICIES
        vals = self.out[: b + 4 * Q if cache_aware else b + Q + w].to("cpu", copy=True).numpy()
        if not cache_aware:
            return StepOutput(vals[:b].tolist(), vals[b : b + n], vals[b + Q : b + Q + w], None, None, self.W)
        return StepOutput(vals[:b].tolist(), vals[b : b + n], vals[b + Q : b + Q + w], vals[b + 2 * Q : b + 2 * Q + n],
                          vals[b + 3 * Q : b + 3 * Q + n] != 0, self.W)

    def _record(self) -> None:
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # kernel compilation and caches before recording
                self.compute()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.compute()
        self.captures += 1
