"""Per-request admission checks of one round of `gpu_sched.admission.admit_step` (SPEC R-ADM-1..3,
R-STEP-3) as one Triton kernel: for every queue index j, assuming the loop reaches j with
0..j-1 admitted whole, the stop code after j, the kind of j's admission, the chunk length j
would get and whether j's iteration marks the batch full. The torch version is
`gpu_sched.admission.eval_requests`; tests hold the two equal, bit for bit.

Budgets come from device memory (`sc`, `rn`), never from the host: the launch needs no sync.
Integer division is written on non-negative operands only (floor semantics identical in the
compiled kernel and the interpreter); float64 only where D7 puts it, with FMA contraction off.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import block_config, check_launch_device, check_tensor, grid_1d

# stop codes (gpu_sched.admission.STOP_*) and kinds (KIND_*), as literals inside the kernel:
# 0 none, 2 budget_other, 3 batch_full, 4 add_no_token, 5 add_other, 6 needs_preempt;
# kind 0 none, 1 whole, 2 chunk


@triton.jit
def _floor_div(x, d):
    """floor(x / d) for d > 0, from non-negative operands only."""
    return tl.where(x >= 0, x // d, -((-x + d - 1) // d))


@triton.jit
def _eval_kernel(fill_ptr, pre_ptr, out_ptr, maxn_ptr, drop_ptr, ie_ptr, fail_ptr, exI_ptr, exC_ptr, exE_ptr,
                 exD_ptr, sc_ptr, rn_ptr, stop_ptr, kind_ptr, tc_ptr, mark_ptr, n, clip, cap, pmr, align,
                 P: tl.constexpr, CHUNKING: tl.constexpr, HAS_ALIGN: tl.constexpr, HAS_CAP: tl.constexpr,
                 HAS_PMR: tl.constexpr, IE_PATH: tl.constexpr, PREEMPT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    fill = tl.load(fill_ptr + offs, mask=mask, other=0)
    pre = tl.load(pre_ptr + offs, mask=mask, other=0)
    out = tl.load(out_ptr + offs, mask=mask, other=0)
    maxn = tl.load(maxn_ptr + offs, mask=mask, other=0)
    drop = tl.load(drop_ptr + offs, mask=mask, other=0)
    exI = tl.load(exI_ptr + offs, mask=mask, other=0)
    exC = tl.load(exC_ptr + offs, mask=mask, other=0)
    exE = tl.load(exE_ptr + offs, mask=mask, other=0)
    exD = tl.load(exD_ptr + offs, mask=mask, other=0)
    A = tl.load(sc_ptr + 0)
    ev0 = tl.load(sc_ptr + 1)
    I = tl.load(sc_ptr + 2)
    cur = tl.load(sc_ptr + 3)
    rin = tl.load(sc_ptr + 4)
    rc = tl.load(sc_ptr + 5)
    can_run = tl.load(sc_ptr + 6)
    running_bs = tl.load(sc_ptr + 7)
    full0 = tl.load(sc_ptr + 8)
    rn = tl.load(rn_ptr)

    ext = fill - pre
    e = _floor_div(ext + (P - 1), P) * P  # ceilP
    res = tl.minimum(maxn, clip)
    mn = tl.minimum(tl.maximum(maxn - out, 0), clip)
    total = (ext + mn + P).to(tl.float64)
    Ij = I + exI
    curj = cur + exC
    rinj = rin - exE
    rcj = rc - exE
    ev = ev0 - exD
    cnt = can_run + offs
    rt = (A + ev - Ij).to(tl.float64) - rn
    cr = A + ev - curj
    nt0 = (rt <= 0) | (cr <= 0)
    oth0 = rinj <= 0
    if CHUNKING:
        oth0 = oth0 | (rcj <= 0)
    passed1 = nt0 | (oth0 == 0)
    cap_hit = offs < 0
    if HAS_CAP:
        cap_hit = running_bs + cnt >= cap
    full = (full0 != 0) | cap_hit
    pmr_hit = offs < 0
    if HAS_PMR:
        pmr_hit = cnt >= pmr
    # normal path: refuse 0 continue, 1 no token, 2 other
    nt1 = total >= rt
    oth = offs < 0
    if not CHUNKING:
        oth = (cnt > 0) & (e >= rinj)
    ev2 = ev - drop
    nt2 = total >= (A + ev2 - Ij).to(tl.float64) - rn
    refuse = tl.where(nt1, 1, tl.where(oth, 2, tl.where(nt2, 1, 0)))
    whole = offs >= 0
    if CHUNKING:
        whole = e <= rcj
    t = _floor_div(rcj, P) * P
    chunk_bad = offs < 0
    if HAS_ALIGN:
        chunk_bad = t < align
        t = _floor_div(t, align) * align
    t = _floor_div(pre + t, P) * P - pre
    chunk_bad = chunk_bad | (t <= 0)
    refuse = tl.where((refuse == 0) & (whole == 0) & chunk_bad, 2, refuse)
    tc = t
    ev_after = ev2
    if IE_PATH:
        iep = tl.load(ie_ptr + offs, mask=mask, other=0) != 0
        fail = tl.load(fail_ptr + offs, mask=mask, other=0) != 0
        nt_b = (e > cr) | (e.to(tl.float64) > rt) | fail
        whole_b = offs >= 0
        if CHUNKING:
            whole_b = ext <= rcj
        ref_b = tl.where(nt_b, 1, tl.where((whole_b == 0) & (rcj <= 0), 2, 0))
        refuse = tl.where(iep, ref_b, refuse)
        whole = tl.where(iep, whole_b, whole)
        tc = tl.where(iep, rcj, tc)
        ev_after = tl.where(iep, ev, ev2)
    ecn = _floor_div(tc + (P - 1), P) * P
    dI = tl.where(whole, e + res + P, ecn + P)
    dC = tl.where(whole, e + P, ecn + P)
    dE = tl.where(whole, e, ecn)
    rtA = (A + ev_after - (Ij + dI)).to(tl.float64) - rn
    crA = A + ev_after - (curj + dC)
    ntA = (rtA <= 0) | (crA <= 0)
    othA = (rinj - dE) <= 0
    if CHUNKING:
        othA = othA | ((rcj - dE) <= 0)
    after = tl.where(ntA, 1, tl.where(othA, 2, 0))
    full_code = 3
    if PREEMPT:
        full_code = 6
    pre_stop = tl.where(passed1 == 0, 2, tl.where(full, full_code, tl.where(pmr_hit, 5, 0)))
    add_stop = tl.where(refuse == 1, 4, tl.where(refuse == 2, 5, tl.where(after == 1, 4, tl.where(after == 2, 5, 0))))
    stop = tl.where(pre_stop != 0, pre_stop, add_stop)
    admits = (pre_stop == 0) & (refuse == 0)
    kind = tl.where(admits, tl.where(whole, 1, 2), 0)
    tl.store(stop_ptr + offs, stop.to(tl.int64), mask=mask)
    tl.store(kind_ptr + offs, kind.to(tl.int64), mask=mask)
    tl.store(tc_ptr + offs, tc, mask=mask)
    tl.store(mark_ptr + offs, (passed1 & cap_hit).to(tl.uint8), mask=mask)


def eval_requests(cfg, sc: torch.Tensor, rn: torch.Tensor, fill, pre, out, maxn, drop, ie, fail, exI, exC, exE,
                  exD, *, block: Optional[int] = None):
    """(stop, kind, chunk length, full mark) per request: `gpu_sched.admission.eval_requests` on Triton.

    cfg: a `gpu_sched.admission.StepConfig`. sc int64 [9] and rn float64 0-d/[1] on the device; the
    columns int64 [n] (ie, fail bool [n]), contiguous, on one device.
    """
    where = "eval_requests"
    check_tensor(where, "fill", fill, (torch.int64,))
    dev = check_launch_device(where, _eval_kernel, fill)
    n = fill.numel()
    for name, t in (("pre", pre), ("out", out), ("maxn", maxn), ("drop", drop), ("exI", exI), ("exC", exC),
                    ("exE", exE), ("exD", exD)):
        check_tensor(where, name, t, (torch.int64,), numel=n, device=dev)
    for name, t in (("ie", ie), ("fail", fail)):
        check_tensor(where, name, t, (torch.bool,), numel=n, device=dev)
    check_tensor(where, "sc", sc, (torch.int64,), numel=9, device=dev)
    check_tensor(where, "rn", rn, (torch.float64,), ndim=rn.dim(), numel=1, device=dev)
    BLOCK, warps = block_config(block)
    stop = torch.empty(n, dtype=torch.int64, device=dev)
    kind = torch.empty(n, dtype=torch.int64, device=dev)
    tc = torch.empty(n, dtype=torch.int64, device=dev)
    mark = torch.empty(n, dtype=torch.bool, device=dev)
    _eval_kernel[grid_1d(n, BLOCK)](
        fill, pre, out, maxn, drop, ie.view(torch.uint8), fail.view(torch.uint8), exI, exC, exE, exD, sc, rn,
        stop, kind, tc, mark.view(torch.uint8), n, cfg.clip, cfg.max_running or 0, cfg.prefill_max or 0,
        cfg.align or 1, P=cfg.page_size, CHUNKING=cfg.chunking, HAS_ALIGN=cfg.align is not None,
        HAS_CAP=cfg.max_running is not None, HAS_PMR=cfg.prefill_max is not None, IE_PATH=cfg.ignore_eos_path,
        PREEMPT=cfg.preemption, BLOCK=BLOCK, num_warps=warps)
    return stop, kind, tc, mark
