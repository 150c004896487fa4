"""Admission as prefix sums (SPEC.md section 4 and section 8, R-ADM-1..4, R-STEP-3).

The sequential loop admits the ordered queue one request at a time; every admission lowers the
budgets for the next one. For a run of requests that are each admitted whole and leave the
budget at CONTINUE (the common case), request j sees, exactly:

  I_j       = I + sum_{i<j} (ceilP(ext_i) + min(max_new_i, CLIP) + P)        (R-ADM-2)
  cur_off_j = cur_off + sum_{i<j} (ceilP(ext_i) + P)
  rem_input_j, rem_chunk_j = their start values - sum_{i<j} ceilP(ext_i)
  evictable_j = evictable - sum_{i<j} drop_i,

where drop_i, what locking request i's prefix moves from evictable to protected (R-RC-6), counts
the tokens of its path that were unlocked before and are not on the path of an earlier request
of the run (per tree node: its cover beyond the running maximum cover of earlier requests, a
segmented exclusive cummax). `rem_total_j = float64(A + evictable_j - I_j) - float64(ratio*N)`
(D7). `scan` evaluates every check of R-STEP-3 / R-ADM-3 for all requests at once and returns
the first index where anything else happens (a refusal, a chunk, a full batch, preemption,
ignore-EOS, a stop after admission); the caller applies the run before it in one batch and hands
that one request to the sequential rules, then scans on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from .radix import ROOT, FlatRadixTree


@dataclass
class ScanState:
    """Budget state when the scan starts (all int64 except ratio_n)."""

    available: int
    evictable: int
    I: int
    cur_off: int
    rem_input: int
    rem_chunk: int | None
    ratio_n: float  # float64(ratio * N)
    can_run: int  # requests already in can_run
    running_bs: int
    cap: int | None
    prefill_max_requests: int | None
    batch_is_full: bool
    page_size: int
    clip: int


def path_drops(tree: FlatRadixTree, m: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """drop_j [B] int64: tokens of path_j[0, m_j) in unlocked nodes not covered by an earlier
    j' < j (batch order). `pos` is the pool position of the last matched token (-1 if m == 0)."""
    B = m.numel()
    dev = m.device
    has = m > 0
    req = torch.nonzero(has).flatten()
    if req.numel() == 0:
        return torch.zeros(B, dtype=torch.int64, device=dev)
    node = tree.owner[pos[req]]
    cover = pos[req] - tree.key_off[node] + 1
    reqs, nodes, covers = [], [], []
    while req.numel():
        reqs.append(req)
        nodes.append(node)
        covers.append(cover)
        up = tree.parent[node]
        keep = up > ROOT
        req, node = req[keep], up[keep]
        cover = tree.key_len[node]
    req, node, cover = torch.cat(reqs), torch.cat(nodes), torch.cat(covers)
    unlocked = tree.lock_ref[node] == 0
    req, node, cover = req[unlocked], node[unlocked], cover[unlocked]
    if req.numel() == 0:
        return torch.zeros(B, dtype=torch.int64, device=dev)
    # group pairs by node, requests in batch order inside each group
    o = torch.argsort(req, stable=True)
    o = o[torch.argsort(node[o], stable=True)]
    req, node, cover = req[o], node[o], cover[o]
    n = req.numel()
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = node[1:] != node[:-1]
    grp = torch.cumsum(first.to(torch.int64), 0)
    big = int(tree.key_len.max()) + 1
    running = torch.cummax(grp * big + cover, 0).values - grp * big  # inclusive per-group max
    prev = torch.zeros_like(running)
    prev[1:] = torch.where(first[1:], 0, running[:-1])
    gain = (cover - prev).clamp(min=0)
    return torch.zeros(B, dtype=torch.int64, device=dev).index_add_(0, req, gain)


def scan(st: ScanState, fill_len: torch.Tensor, out_len: torch.Tensor, max_new: torch.Tensor,
         prefix_len: torch.Tensor, drop: torch.Tensor, special: torch.Tensor) -> int:
    """First index of the window whose request is not a plain whole admission that leaves the
    budget at CONTINUE (len(window) if all are). All inputs int64 [W] in queue order except
    `special` (bool [W]: requests the scan must not decide, e.g. ignore-EOS with the cache
    disabled)."""
    W = fill_len.numel()
    if W == 0:
        return 0
    dev = fill_len.device
    P = st.page_size
    ext = fill_len - prefix_len
    e = (ext + P - 1) // P * P
    reserve = torch.clamp(max_new, max=st.clip)
    mn = torch.clamp(torch.clamp(max_new - out_len, min=0), max=st.clip)
    total = ext + mn + P

    def excl(x):
        return torch.cumsum(x, 0) - x

    k = torch.arange(W, device=dev)
    E, R, D = excl(e), excl(reserve), excl(drop)
    I = st.I + E + R + P * k
    cur_off = st.cur_off + E + P * k
    rem_input = st.rem_input - E
    ev = st.evictable - D

    def rem_total(evv, II):
        return (st.available + evv - II).to(torch.float64) - st.ratio_n

    def state_continue(evv, II, co, ri, rc):
        no_token = (rem_total(evv, II) <= 0) | (st.available + evv - co <= 0)
        other = ri <= 0
        if rc is not None:
            other = other | (rc <= 0)
        return ~no_token & ~other

    rc = None if st.rem_chunk is None else st.rem_chunk - E
    ok = state_continue(ev, I, cur_off, rem_input, rc)  # top-of-loop state (R-STEP-3.1)
    count = st.can_run + k
    if st.batch_is_full:
        ok = ok & False
    if st.cap is not None:
        ok = ok & (st.running_bs + count < st.cap)
    if st.prefill_max_requests is not None:
        ok = ok & (count < st.prefill_max_requests)
    ok = ok & ~special
    totf = total.to(torch.float64)
    for evv in (ev, ev - drop):  # before and under the temporary lock (R-ADM-3 steps 4-5)
        ok = ok & (totf < rem_total(evv, I))
        if st.rem_chunk is None:
            ok = ok & ~((count > 0) & (e >= rem_input))
    if rc is not None:
        ok = ok & (e <= rc)  # whole admission, not a chunk (R-ADM-3 step 6)
    # the state after committing must still be CONTINUE (R-ADM-3 step 8)
    ev2, I2 = ev - drop, I + e + reserve + P
    ok = ok & state_continue(ev2, I2, cur_off + e + P, rem_input - e, None if rc is None else rc - e)
    bad = torch.nonzero(~ok).flatten()
    return int(bad[0]) if bad.numel() else W
