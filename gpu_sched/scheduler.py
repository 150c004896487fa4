"""GpuScheduler: the scheduler with the prefix tree, ordering and admission on a torch device.

Same calls as `ReferenceScheduler` (submit / step / complete_prefill / decode / retract_decode /
finish / abort / seed_* / check_integrity); tests hold one against the other. What runs where:
  * the radix cache is a `FlatRadixTree` on `device` (batched, hash-based matching);
  * ordering builds the queue's columns as tensors and applies `gpu_sched.policy`
    (sort keys, in-batch deprioritization, dfs-weight), with `backend` "torch" or "triton";
  * admission computes the sequential loop's decisions as prefix sums over the ordered queue
    (`gpu_sched.admission`), falling back to the per-request rules only at the rare events that
    change the state mid-scan (a chunk, a preemption, an ignore-EOS request).
The engine-facing bookkeeping (KV slots of running requests) stays on the host.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from .config import SchedulerConfig
from .device_cache import DeviceRadixCache
from .reference.policy import OrderResult, active_policy
from .reference.scheduler import ReferenceScheduler
from .reference.state import ReqState
from . import policy as dpolicy

BACKENDS = ("torch", "triton")


class GpuScheduler(ReferenceScheduler):
    """Device scheduler.

    Args:
        config, kv_pool_size, shuffle: as `ReferenceScheduler`.
        backend: "torch" (any device) or "triton" (Triton kernels for keys and tree passes;
            on CPU only under TRITON_INTERPRET=1).
        device: torch device (default "cpu").
    """

    def __init__(self, config: SchedulerConfig, kv_pool_size: int,
                 shuffle: Optional[Callable[[int], Sequence[int]]] = None,
                 backend: str = "torch", device="cpu"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.device = torch.device(device)
        if backend == "triton" and self.device.type == "cpu":
            # Triton kernels on CPU tensors run only in the interpreter; it must be chosen
            # before triton is first imported (the kernel modules import it lazily)
            os.environ.setdefault("TRITON_INTERPRET", "1")
        super().__init__(config, kv_pool_size, shuffle=shuffle)
        self._torch_gen = torch.Generator(device=self.device)
        self._torch_gen.manual_seed(config.random_seed)
        self._custom_shuffle = shuffle is not None
        self._hash_cache = {}

    def _make_cache(self):
        return DeviceRadixCache(self.pool, self.config.page_size, disable=self.config.disable_radix_cache,
                                device=self.device, backend=self.backend)

    # ---- ordering (R-ORD) on the device ------------------------------------------------------
    def _col(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _padded_fills(self, queue: List[ReqState], caps: Optional[List[int]] = None):
        lens = [r.fill_len if caps is None else min(r.fill_len, c) for r, c in zip(queue, caps or [None] * len(queue))]
        L = max(lens + [1])
        buf = np.zeros((len(queue), L), np.int32)
        for i, (r, n) in enumerate(zip(queue, lens)):
            buf[i, :n] = r.fill()[:n]
        return torch.from_numpy(buf).to(self.device), self._col(lens, torch.int64)

    def _fill_hashes(self, r: ReqState):
        """(device fill tokens int32 [L], chunk hashes int64 [L // C]) of a request, computed once
        per fill length: matching then costs O(log L) probes, not O(L) (issue: matching cost)."""
        ent = self._hash_cache.get(r.rid)
        if ent is None or ent[0] != r.fill_len:
            tree = self.cache.tree
            toks = torch.from_numpy(np.array(r.fill(), dtype=np.int32)).to(self.device)
            ns = self._col([self.cache.ns_id(r.req.extra_key)], torch.int64)
            ch = tree.prefix_hashes(toks[None], self._col([r.fill_len], torch.int64), ns, tree.C)[0]
            ent = (r.fill_len, toks, ch)
            self._hash_cache[r.rid] = ent
            if len(self._hash_cache) > 2 * len(self.reqs) + 64:
                self._hash_cache = {k: v for k, v in self._hash_cache.items() if k in self.reqs}
        return ent[1], ent[2]

    def _csr(self, queue: List[ReqState], caps: Optional[List[int]]):
        """The queue's fills (capped) as CSR tensors for `FlatRadixTree.match_csr`/_find_csr."""
        C = self.cache.tree.C
        toks, chs, lens = [], [], []
        for i, r in enumerate(queue):
            t, ch = self._fill_hashes(r)
            n = r.fill_len if caps is None else min(r.fill_len, caps[i])
            toks.append(t)
            chs.append(ch[: n // C])
            lens.append(n)
        lengths = self._col(lens, torch.int64)
        tl = self._col([t.numel() for t in toks], torch.int64)
        cl = self._col([c.numel() for c in chs], torch.int64)
        tok = torch.cat(toks) if toks else torch.zeros(0, dtype=torch.int32, device=self.device)
        ch = torch.cat(chs) if chs else torch.zeros(0, dtype=torch.int64, device=self.device)
        ns = self._col([self.cache.ns_id(r.req.extra_key) for r in queue], torch.int64)
        return tok, torch.cumsum(tl, 0) - tl, lengths, ns, ch, torch.cumsum(cl, 0) - cl, cl

    def find(self, queue: List[ReqState], caps: Optional[List[int]] = None):
        """Matched lengths and last pool positions against the current tree, without splits or
        stamps (splits never change what the tree holds)."""
        tok, toff, lens, ns, ch, coff, cl = self._csr(queue, caps)
        mc = int(cl.max()) if cl.numel() else 0
        return self.cache.tree._find_csr(tok, toff, lens, lens, ns, ch, coff, cl, mc)

    def batch_match(self, queue: List[ReqState], caps: Optional[List[int]] = None):
        """Match every request of `queue` in order (R-RC-4 batched); sets prefix_len/last_node."""
        if not queue:
            return
        if self.cache.disable:
            for r in queue:
                r.prefix_len, r.last_node = 0, self.cache.root
            return
        tok, toff, lens, ns, ch, coff, _ = self._csr(queue, caps)
        m, last = self.cache.tree.match_csr(tok, toff, lens, ns, ch, coff)
        for r, a, b in zip(queue, m.tolist(), last.tolist()):
            r.prefix_len, r.last_node = a, b

    def _order(self) -> OrderResult:
        cfg = self.config
        q = list(self.queue)
        n = len(q)
        policy = active_policy(cfg, n)
        sign = cfg.priority_sign
        be = self.backend
        if cfg.effective_policy == "fcfs":
            if cfg.enable_priority_scheduling and n:
                perm = dpolicy.fcfs_priority_order(self._col([r.priority for r in q], torch.int64),
                                                   self._col([r.enqueue_time for r in q], torch.float64), sign, backend=be)
                q = [q[i] for i in perm.tolist()]
            return OrderResult("fcfs", q)
        if policy in ("lpm", "dfs-weight"):
            self.batch_match(q)
            for r in q:
                r.num_matched = min(r.prefix_len, r.max_prefix_len())
            T = cfg.in_batch_prefix_caching_deprioritize_threshold
            if n:
                heads, hl = self._padded_fills(q, [T] * n) if T > 0 else (torch.zeros((n, 0), dtype=torch.int32, device=self.device), self._col([0] * n, torch.int64))
                dep = dpolicy.in_batch_deprioritize(
                    self._col([r.prefix_len for r in q], torch.int64), self._col([r.fill_len for r in q], torch.int64),
                    self._col([self.cache.ns_id(r.req.extra_key) for r in q], torch.int64),
                    dpolicy.head_hashes(heads, hl) if T > 0 else torch.zeros(n, dtype=torch.int64, device=self.device),
                    cfg.in_batch_prefix_caching_check_threshold, T, backend=be).tolist()
            else:
                dep = []
            dep_rids = {r.rid for r, d in zip(q, dep) if d}
            if n and policy == "lpm":
                perm = dpolicy.lpm_order(self._col([r.num_matched for r in q], torch.int64),
                                         torch.tensor(dep, dtype=torch.bool, device=self.device), backend=be)
                q = [q[i] for i in perm.tolist()]
            elif n:
                parent, rank, remap = self._child_ranks()
                last = remap[self._col([r.last_node for r in q], torch.int64)]
                perm = dpolicy.dfs_weight_order(parent, rank, None, last, backend=be)
                q = [q[i] for i in perm.tolist()]
            return OrderResult(policy, q, [r.num_matched for r in q], [r.rid for r in q if r.rid in dep_rids])
        if n == 0 or policy == "fcfs":  # fcfs here: the lpm fallback sorts nothing (R-ORD-2)
            return OrderResult(policy, q)
        if policy == "lof":
            prio = self._col([r.priority for r in q], torch.int64) if cfg.enable_priority_scheduling else None
            perm = dpolicy.lof_order(self._col([r.max_new for r in q], torch.int64), prio, sign, backend=be)
        elif policy == "random":
            if self._custom_shuffle:
                perm = torch.as_tensor(list(self.shuffle(n)), dtype=torch.int64)
            else:
                perm = dpolicy.random_order(n, self._torch_gen, backend=be)
        else:  # routing-key
            keys = sorted({k for k in [r.req.routing_key for r in q + self.running] if k})
            kid = {k: i for i, k in enumerate(keys)}
            perm = dpolicy.routing_key_order(
                self._col([kid.get(r.req.routing_key, -1) if r.req.routing_key else -1 for r in q], torch.int64),
                self._col(list(range(len(keys))), torch.int64),
                self._col([kid[r.req.routing_key] for r in self.running if r.req.routing_key], torch.int64),
                backend=be)
        q = [q[i] for i in perm.tolist()]
        return OrderResult(policy, q)

    def _child_ranks(self):
        """(parent, child_rank) over the live nodes only (compacted ids, root first) and the map
        from tree ids to compacted ids, for dfs-weight: siblings ranked by child order."""
        t = self.cache.tree
        ids = torch.nonzero(t.alive).flatten()  # root (0) first
        remap = torch.full_like(t.parent, -1)
        remap[ids] = torch.arange(ids.numel(), device=self.device)
        p = t.parent[ids]
        parent = torch.where(p >= 0, remap[p.clamp(min=0)], -1)
        N = ids.numel()
        idx = torch.argsort(t.order[ids], stable=True)
        idx = idx[torch.argsort(parent[idx], stable=True)]
        ps = parent[idx]
        first = torch.ones(N, dtype=torch.bool, device=self.device)
        first[1:] = ps[1:] != ps[:-1]
        pos = torch.arange(N, device=self.device)
        start = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), 0).values
        rank = torch.empty_like(pos)
        rank[idx] = pos - start
        return parent, rank, remap

    # ---- admission (R-STEP-3) as prefix-sum scans ------------------------------------------------
    def _admission_loop(self, queue: List[ReqState], adder) -> str:
        """R-STEP-3: scan windows of the ordered queue; apply each run of plain whole
        admissions in one batch (batched re-match with splits and stamps, batched locks, summed
        commits) and hand the first other request to the sequential rules (`_admit_one`)."""
        from .admission import ScanState, path_drops, scan

        cfg = self.config
        running_bs = len(self.running)
        i, n, W = 0, len(queue), 64
        tree = self.cache.tree
        while i < n:
            win = queue[i : i + W]
            caps = [r.max_prefix_len() for r in win]
            if self.cache.disable:
                m = torch.zeros(len(win), dtype=torch.int64, device=self.device)
                drop = torch.zeros_like(m)
            else:
                m, pos = self.find(win, caps)
                drop = path_drops(tree, m, pos)
            st = ScanState(
                available=self.pool.available, evictable=self.cache.evictable_size, I=adder.I,
                cur_off=adder.cur_off, rem_input=adder.rem_input, rem_chunk=adder.rem_chunk,
                ratio_n=float(adder.ratio * adder.N), can_run=len(adder.can_run), running_bs=running_bs,
                cap=cfg.max_running_requests, prefill_max_requests=cfg.prefill_max_requests,
                batch_is_full=self.batch_is_full, page_size=cfg.page_size, clip=cfg.clip_max_new_tokens)
            special = torch.tensor([r.req.ignore_eos and self.cache.disable for r in win], dtype=torch.bool,
                                   device=self.device)
            k = scan(st, self._col([r.fill_len for r in win], torch.int64), self._col([r.out_len for r in win], torch.int64),
                     self._col([r.max_new for r in win], torch.int64), m, drop, special)
            if k:
                self._admit_run(win[:k], caps[:k], adder)
            if k < len(win):
                stop = self._admit_one(win[k], adder, running_bs)
                if stop is not None:
                    return stop
                i += k + 1
            else:
                i += k
                W *= 2
        return "queue_end"

    def _admit_run(self, run: List[ReqState], caps: List[int], adder) -> None:
        """Apply plain whole admissions in queue order: what `add_one_req` step 6 does for each."""
        if self.cache.disable:
            for r in run:
                r.prefix_len, r.last_node = 0, self.cache.root
        else:
            self.batch_match(run, caps)
            self.cache.tree.lock(self._col([r.last_node for r in run], torch.int64))
        P, clip = self.config.page_size, self.config.clip_max_new_tokens
        for r in run:
            r.lock_node = r.last_node if not self.cache.disable else None
            e = -(-(r.fill_len - r.prefix_len) // P) * P
            adder._admit(r, r.prefix_len, r.fill_len)
            adder.I += e + min(r.max_new, clip) + P
            adder.cur_off += e + P
            adder.rem_input -= e
            if adder.rem_chunk is not None:
                adder.rem_chunk -= e
            adder.log_hit_tokens += r.prefix_len
            adder.log_input_tokens += e
