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

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._utils import block_config, check_launch_device, check_tensor, grid_1d, scan_config
from .ignore_eos import _no_fma

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


# ---- one round's event and state update -----------------------------------------------------------
#: the round state `admission_round` reads and writes (int64 [STATE_LEN]; flags as 0/1)
(ST_S, ST_CI, ST_CC, ST_CE, ST_DONE, ST_CHUNK_IDX, ST_CHUNK_LEN, ST_K, ST_STOP, ST_KIND, ST_I, ST_CUR, ST_RIN,
 ST_RC, ST_EV, ST_FULL) = range(16)
STATE_LEN = 16
#: the loop's constants (int64 [BASE_LEN]): budgets after the in-flight chunk, queue length
(B_A, B_EV0, B_I, B_CUR, B_RIN, B_RC, B_CAN_RUN, B_RUNNING_BS, B_FULL, B_N) = range(10)
BASE_LEN = 10


@triton.jit
def _ceil_page(x, P: tl.constexpr):
    return -_floor_div(-x, P) * P


@triton.jit
def _round_kernel(stop_ptr, kind_ptr, tc_ptr, mark_ptr, e_ptr, wI_ptr, wC_ptr, exI_ptr, exC_ptr, exE_ptr,
                  pre_ptr, ev_ptr, iep_ptr, drop_ptr, base_ptr, st_ptr, st_out, sc_ptr, end_ptr, L,
                  P: tl.constexpr, BLOCK: tl.constexpr):
    # one program: the first event of the round (a min over the queue), then scalar updates.
    # The state is read from st_ptr and written whole to st_out (another buffer): the
    # program's warps never read what another one may already have written.
    n = tl.load(base_ptr + 9)
    s = tl.load(st_ptr + 0)
    k = n
    for start in range(0, L, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < L
        kind = tl.load(kind_ptr + offs, mask=m, other=0)
        stop = tl.load(stop_ptr + offs, mask=m, other=0)
        event = m & (offs < n) & (offs >= s) & ~((kind == 1) & (stop == 0))
        k = tl.minimum(k, tl.min(tl.where(event, offs, n), axis=0))
    A = tl.load(base_ptr + 0)
    ev0 = tl.load(base_ptr + 1)
    I = tl.load(base_ptr + 2)
    cur = tl.load(base_ptr + 3)
    rin = tl.load(base_ptr + 4)
    rc = tl.load(base_ptr + 5)
    can_run0 = tl.load(base_ptr + 6)
    running_bs = tl.load(base_ptr + 7)
    batch_full = tl.load(base_ptr + 8)
    cI = tl.load(st_ptr + 1)
    cC = tl.load(st_ptr + 2)
    cE = tl.load(st_ptr + 3)
    done = tl.load(st_ptr + 4)
    chunk_idx = tl.load(st_ptr + 5)
    chunk_len = tl.load(st_ptr + 6)
    k_fin = tl.load(st_ptr + 7)
    stop_fin = tl.load(st_ptr + 8)
    kind_fin = tl.load(st_ptr + 9)
    I_fin = tl.load(st_ptr + 10)
    cur_fin = tl.load(st_ptr + 11)
    rin_fin = tl.load(st_ptr + 12)
    rc_fin = tl.load(st_ptr + 13)
    ev_fin = tl.load(st_ptr + 14)
    full_fin = tl.load(st_ptr + 15)
    atend = k >= n
    stop_k = tl.where(atend, 1, tl.load(stop_ptr + k))
    kind_k = tl.where(atend, 0, tl.load(kind_ptr + k))
    again = (kind_k == 2) & (chunk_idx >= 0)  # one chunk a step: a second is refused, OTHER (5)
    stop_k = tl.where(again, 5, stop_k)
    kind_k = tl.where(again, 0, kind_k)
    tc_k = tl.load(tc_ptr + k)
    whole_k = kind_k == 1
    e_k = tl.load(e_ptr + k)
    wI_k = tl.load(wI_ptr + k)
    wC_k = tl.load(wC_ptr + k)
    ec_k = _ceil_page(tc_k, P)
    dI = tl.where(whole_k, wI_k, ec_k + P)
    dC = tl.where(whole_k, wC_k, ec_k + P)
    dE = tl.where(whole_k, e_k, ec_k)
    live = done == 0
    is_chunk = live & (kind_k == 2)
    pre_k = tl.load(pre_ptr + k)
    tl.store(end_ptr + k, pre_k + tc_k, mask=is_chunk)
    upd = is_chunk & (stop_k == 0)
    Ik = I + cI + tl.load(exI_ptr + k)
    curk = cur + cC + tl.load(exC_ptr + k)
    exE_k = tl.load(exE_ptr + k)
    rink = rin + cE - exE_k
    rck = rc + cE - exE_k
    cI = tl.where(upd, cI + dI - wI_k, cI)
    cC = tl.where(upd, cC + dC - wC_k, cC)
    cE = tl.where(upd, cE + e_k - dE, cE)
    term = live & ~upd
    adm = kind_k != 0
    admi = adm.to(tl.int64)
    ev_k = tl.load(ev_ptr + k)
    ev_after = tl.where(tl.load(iep_ptr + k) != 0, ev_k, ev_k - tl.load(drop_ptr + k))
    fl = (batch_full != 0) | (~atend & (tl.load(mark_ptr + k) != 0))
    fl = tl.where(stop_k == 4, ((can_run0 + k + admi) > 0) | (running_bs > 0), fl)
    tl.store(st_out + 0, tl.where(upd, k + 1, s))
    tl.store(st_out + 1, cI)
    tl.store(st_out + 2, cC)
    tl.store(st_out + 3, cE)
    tl.store(st_out + 4, (~live | term).to(tl.int64))
    tl.store(st_out + 5, tl.where(is_chunk, k, chunk_idx))
    tl.store(st_out + 6, tl.where(is_chunk, tc_k, chunk_len))
    tl.store(st_out + 7, tl.where(term, k, k_fin))
    tl.store(st_out + 8, tl.where(term, stop_k, stop_fin))
    tl.store(st_out + 9, tl.where(term, kind_k, kind_fin))
    tl.store(st_out + 10, tl.where(term, Ik + tl.where(adm, dI, 0), I_fin))
    tl.store(st_out + 11, tl.where(term, curk + tl.where(adm, dC, 0), cur_fin))
    tl.store(st_out + 12, tl.where(term, rink - tl.where(adm, dE, 0), rin_fin))
    tl.store(st_out + 13, tl.where(term, rck - tl.where(adm, dE, 0), rc_fin))
    tl.store(st_out + 14, tl.where(term, tl.where(adm, ev_after, ev_k), ev_fin))
    tl.store(st_out + 15, tl.where(term, fl.to(tl.int64), full_fin))
    # the next round's budgets for the per-request checks
    tl.store(sc_ptr + 0, A)
    tl.store(sc_ptr + 1, ev0)
    tl.store(sc_ptr + 2, I + cI)
    tl.store(sc_ptr + 3, cur + cC)
    tl.store(sc_ptr + 4, rin + cE)
    tl.store(sc_ptr + 5, rc + cE)
    tl.store(sc_ptr + 6, can_run0)
    tl.store(sc_ptr + 7, running_bs)
    tl.store(sc_ptr + 8, batch_full)


def admission_round(cfg, stop, kind, tc, mark, e, wI, wC, exI, exC, exE, pre, ev, iep, drop, base: torch.Tensor,
                    state: torch.Tensor, state_out: torch.Tensor, sc: torch.Tensor, end: torch.Tensor, *,
                    block: Optional[int] = None) -> None:
    """One round of `gpu_sched.admission.admit_step` after its per-request checks, in place, as
    one single-program launch instead of some 120 small tensor ops: the round's first event
    k (the first index from the round's start that is not "admit whole, loop goes on"), the
    chunk it may cut (`end[k]`), the chunk corrections for the next round, the terminal
    values when the loop ends at k, and the next round's `sc`.

    Columns [L] on one device, contiguous: stop, kind, tc, e, wI, wC, exI, exC, exE, pre, ev,
    drop int64 (the checks' outputs and admit_step's per-request quantities, padded), mark and
    iep bool; base int64 [BASE_LEN] (the loop's constants, `B_*`); state int64 [STATE_LEN]
    (`ST_*`, read) and state_out (another int64 [STATE_LEN], written whole: callers alternate
    the two); sc int64 [9] (written); end int64 [L] (written at k).
    """
    where = "admission_round"
    check_tensor(where, "stop", stop, (torch.int64,))
    dev = check_launch_device(where, _round_kernel, stop)
    L = stop.numel()
    for name, t in (("kind", kind), ("tc", tc), ("e", e), ("wI", wI), ("wC", wC), ("exI", exI), ("exC", exC),
                    ("exE", exE), ("pre", pre), ("ev", ev), ("drop", drop), ("end", end)):
        check_tensor(where, name, t, (torch.int64,), numel=L, device=dev)
    for name, t in (("mark", mark), ("iep", iep)):
        check_tensor(where, name, t, (torch.bool,), numel=L, device=dev)
    check_tensor(where, "base", base, (torch.int64,), numel=BASE_LEN, device=dev)
    check_tensor(where, "state", state, (torch.int64,), numel=STATE_LEN, device=dev)
    check_tensor(where, "state_out", state_out, (torch.int64,), numel=STATE_LEN, device=dev)
    if state_out.data_ptr() == state.data_ptr():
        raise ValueError(f"{where}: state_out must be another buffer than state")
    check_tensor(where, "sc", sc, (torch.int64,), numel=9, device=dev)
    BLOCK, warps = scan_config(L, block)
    _round_kernel[(1,)](stop, kind, tc, mark.view(torch.uint8), e, wI, wC, exI, exC, exE, pre, ev,
                        iep.view(torch.uint8), drop, base, state, state_out, sc, end, L, P=cfg.page_size,
                        BLOCK=BLOCK, num_warps=warps)


# ---- the loop's inputs, before the first round ------------------------------------------------------
#: packed scalar inputs of `admission_prepare` (int64 [SV_LEN])
(SV_A, SV_EV0, SV_I, SV_CUR, SV_RIN, SV_RC, SV_N_RES, SV_CAN_RUN, SV_RUNNING_BS, SV_FULL, SV_N, SV_C_PRESENT,
 SV_C_FILL, SV_C_PREFIX, SV_C_MAXNEW) = range(15)
SV_LEN = 15
#: `admission_prepare`'s extra scalar outputs (int64 [EXTRA_LEN])
X_IN_TOKENS, X_INFLIGHT_END, X_INFLIGHT_LEFT, X_RIN_LOOP = range(4)
EXTRA_LEN = 4


@triton.jit
def _prepare_kernel(fill_ptr, out_ptr, prompt_ptr, maxn_ptr, pre_ptr, drop_ptr, ie_ptr, sv_ptr, ratio_ptr,
                    fill_o, out_o, prompt_o, maxn_o, pre_o, drop_o, ie_o, e_o, wI_o, wC_o, exI_o, exC_o, exE_o,
                    exD_o, ev_o, iep_o, end_o, base_ptr, state_ptr, sc_ptr, rn_ptr, extra_ptr, Q, clip,
                    P: tl.constexpr, CHUNKED: tl.constexpr, IE_PATH: tl.constexpr, BLOCK: tl.constexpr):
    # one program: the budgets after the in-flight chunk (R-ADM-5), then the padded columns and
    # their exclusive prefix sums block by block, carrying the running totals
    A = tl.load(sv_ptr + 0)
    ev0 = tl.load(sv_ptr + 1)
    I = tl.load(sv_ptr + 2)
    cur = tl.load(sv_ptr + 3)
    rin = tl.load(sv_ptr + 4)
    rc = tl.load(sv_ptr + 5)
    N = tl.load(sv_ptr + 6)
    can_run0 = tl.load(sv_ptr + 7)
    running_bs = tl.load(sv_ptr + 8)
    full0 = tl.load(sv_ptr + 9)
    n = tl.load(sv_ptr + 10)
    rn = tl.load(ratio_ptr) * N.to(tl.float64)  # float64(ratio * N), D7
    zero = n * 0
    in_tokens = zero
    inflight_end = zero
    inflight_left = zero
    if CHUNKED:
        pr = tl.load(sv_ptr + 11) != 0
        cfill = tl.load(sv_ptr + 12)
        cpre = tl.load(sv_ptr + 13)
        cmaxn = tl.load(sv_ptr + 14)
        rt = (A + ev0 - I).to(tl.float64) - rn
        room = tl.minimum(rc, rt.to(tl.int64))
        room = tl.where(room <= 0, rc, room)
        ext_c = cfill - cpre
        nc = tl.maximum(tl.minimum(ext_c, room), 0)  # none for rem_chunk < 0 (`add_chunked_req`)
        ec = _ceil_page(nc, P)
        resc = tl.where(nc == ext_c, tl.minimum(cmaxn, clip), 0)
        I = tl.where(pr, I + ec + resc + P, I)
        cur = tl.where(pr, cur + ec + P, cur)
        rin = tl.where(pr, rin - ec, rin)
        rc = tl.where(pr, rc - ec, rc)
        in_tokens = tl.where(pr, ec, zero)
        inflight_end = tl.where(pr, cpre + nc, zero)
        inflight_left = (pr & (nc < ext_c)).to(tl.int64)
        can_run0 = can_run0 + pr.to(tl.int64)
    tl.store(rn_ptr, rn)
    tl.store(extra_ptr + 0, in_tokens)
    tl.store(extra_ptr + 1, inflight_end)
    tl.store(extra_ptr + 2, inflight_left)
    tl.store(extra_ptr + 3, rin)
    # the round loop's constants, its starting state (admission_round's ST_*) and first budgets
    tl.store(base_ptr + 0, A)
    tl.store(base_ptr + 1, ev0)
    tl.store(base_ptr + 2, I)
    tl.store(base_ptr + 3, cur)
    tl.store(base_ptr + 4, rin)
    tl.store(base_ptr + 5, rc)
    tl.store(base_ptr + 6, can_run0)
    tl.store(base_ptr + 7, running_bs)
    tl.store(base_ptr + 8, full0)
    tl.store(base_ptr + 9, n)
    tl.store(sc_ptr + 0, A)
    tl.store(sc_ptr + 1, ev0)
    tl.store(sc_ptr + 2, I)
    tl.store(sc_ptr + 3, cur)
    tl.store(sc_ptr + 4, rin)
    tl.store(sc_ptr + 5, rc)
    tl.store(sc_ptr + 6, can_run0)
    tl.store(sc_ptr + 7, running_bs)
    tl.store(sc_ptr + 8, full0)
    # every state entry written once: s, cI, cC, cE, done, chunk (none), chunk_len, k, stop, kind
    tl.store(state_ptr + 0, zero)
    tl.store(state_ptr + 1, zero)
    tl.store(state_ptr + 2, zero)
    tl.store(state_ptr + 3, zero)
    tl.store(state_ptr + 4, zero)
    tl.store(state_ptr + 5, zero - 1)
    tl.store(state_ptr + 6, zero)
    tl.store(state_ptr + 7, zero)
    tl.store(state_ptr + 8, zero)
    tl.store(state_ptr + 9, zero)
    tl.store(state_ptr + 10, I)
    tl.store(state_ptr + 11, cur)
    tl.store(state_ptr + 12, rin)
    tl.store(state_ptr + 13, rc)
    tl.store(state_ptr + 14, ev0)
    tl.store(state_ptr + 15, full0)
    # per-request columns, padded with one zero entry at Q
    cI = zero
    cC = zero
    cE = zero
    cD = zero
    for start in range(0, Q + 1, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < Q + 1
        src = offs < Q
        fill = tl.load(fill_ptr + offs, mask=src, other=0)
        out = tl.load(out_ptr + offs, mask=src, other=0)
        prompt = tl.load(prompt_ptr + offs, mask=src, other=0)
        maxn = tl.load(maxn_ptr + offs, mask=src, other=0)
        pre = tl.load(pre_ptr + offs, mask=src, other=0)
        drop = tl.load(drop_ptr + offs, mask=src, other=0)
        ie = tl.load(ie_ptr + offs, mask=src, other=0)
        vm = (m & (offs < n)).to(tl.int64)
        e = _ceil_page(fill - pre, P)
        wI = e + tl.minimum(maxn, clip) + P
        wC = e + P
        xI = wI * vm
        xC = wC * vm
        xE = e * vm
        xD = drop * vm
        exI = tl.cumsum(xI, 0) - xI + cI
        exC = tl.cumsum(xC, 0) - xC + cC
        exE = tl.cumsum(xE, 0) - xE + cE
        exD = tl.cumsum(xD, 0) - xD + cD
        cI += tl.sum(xI, 0)
        cC += tl.sum(xC, 0)
        cE += tl.sum(xE, 0)
        cD += tl.sum(xD, 0)
        tl.store(fill_o + offs, fill, mask=m)
        tl.store(end_o + offs, fill, mask=m)  # the extend ends, which the rounds overwrite for chunks
        tl.store(out_o + offs, out, mask=m)
        tl.store(prompt_o + offs, prompt, mask=m)
        tl.store(maxn_o + offs, maxn, mask=m)
        tl.store(pre_o + offs, pre, mask=m)
        tl.store(drop_o + offs, drop, mask=m)
        tl.store(ie_o + offs, ie, mask=m)
        tl.store(e_o + offs, e, mask=m)
        tl.store(wI_o + offs, wI, mask=m)
        tl.store(wC_o + offs, wC, mask=m)
        tl.store(exI_o + offs, exI, mask=m)
        tl.store(exC_o + offs, exC, mask=m)
        tl.store(exE_o + offs, exE, mask=m)
        tl.store(exD_o + offs, exD, mask=m)
        tl.store(ev_o + offs, ev0 - exD, mask=m)
        if IE_PATH:
            tl.store(iep_o + offs, ie, mask=m)
        else:
            tl.store(iep_o + offs, ie * 0, mask=m)


class Prepared(NamedTuple):
    """`admission_prepare`'s outputs: padded columns [Q+1] and the loop's scalars."""

    fill: torch.Tensor
    out: torch.Tensor
    prompt: torch.Tensor
    maxn: torch.Tensor
    pre: torch.Tensor
    drop: torch.Tensor
    ie: torch.Tensor  # bool
    e: torch.Tensor
    wI: torch.Tensor
    wC: torch.Tensor
    exI: torch.Tensor
    exC: torch.Tensor
    exE: torch.Tensor
    exD: torch.Tensor
    ev: torch.Tensor
    iep: torch.Tensor  # bool
    end: torch.Tensor  # the fill again: the extend ends `admission_round` writes in place
    base: torch.Tensor  # int64 [BASE_LEN]
    state: torch.Tensor  # int64 [STATE_LEN]
    sc: torch.Tensor  # int64 [9]
    rn: torch.Tensor  # float64 0-d
    extra: torch.Tensor  # int64 [EXTRA_LEN]


def admission_prepare(cfg, fill, out, prompt, maxn, pre, drop, ie, sv: torch.Tensor, ratio: torch.Tensor,
                      chunked: bool, *, block: Optional[int] = None) -> Prepared:
    """Everything `gpu_sched.admission.admit_step` computes before its rounds, as one
    single-program launch: the in-flight chunk's budgets (R-ADM-5, when `chunked`), float64
    `ratio * N` (D7), the columns padded with one zero entry, each request's whole-admission
    commits and their exclusive prefix sums over the valid entries, the round loop's constants,
    starting state and first budgets (`admission_round`'s B_*, ST_*, sc).

    Columns int64 [Q] (ie bool), contiguous, on one device; sv int64 [SV_LEN] (`SV_*`), ratio
    float64 0-d.
    """
    where = "admission_prepare"
    check_tensor(where, "fill", fill, (torch.int64,))
    dev = check_launch_device(where, _prepare_kernel, fill)
    Q = fill.numel()
    for name, t in (("out", out), ("prompt", prompt), ("maxn", maxn), ("pre", pre), ("drop", drop)):
        check_tensor(where, name, t, (torch.int64,), numel=Q, device=dev)
    check_tensor(where, "ie", ie, (torch.bool,), numel=Q, device=dev)
    check_tensor(where, "sv", sv, (torch.int64,), numel=SV_LEN, device=dev)
    check_tensor(where, "ratio", ratio, (torch.float64,), ndim=ratio.dim(), numel=1, device=dev)
    # not `scan_config`'s wide block: with its 15 columns a 4096-wide program took 94 us at 4k
    # requests on an H200, against 30 us in blocks of 1024
    BLOCK, warps = block_config(block)
    L = Q + 1
    cols = torch.empty((15, L), dtype=torch.int64, device=dev)
    flags = torch.empty((2, L), dtype=torch.bool, device=dev)
    base = torch.empty(BASE_LEN, dtype=torch.int64, device=dev)
    state = torch.empty(STATE_LEN, dtype=torch.int64, device=dev)
    sc = torch.empty(9, dtype=torch.int64, device=dev)
    rn = torch.empty((), dtype=torch.float64, device=dev)
    extra = torch.empty(EXTRA_LEN, dtype=torch.int64, device=dev)
    c = cols.unbind(0)
    u8 = flags.view(torch.uint8)
    _prepare_kernel[(1,)](fill, out, prompt, maxn, pre, drop, ie.view(torch.uint8), sv, ratio,
                          c[0], c[1], c[2], c[3], c[4], c[5], u8[0], c[6], c[7], c[8], c[9], c[10], c[11], c[12],
                          c[13], u8[1], c[14], base, state, sc, rn, extra, Q, cfg.clip, P=cfg.page_size,
                          CHUNKED=chunked, IE_PATH=cfg.ignore_eos_path, BLOCK=BLOCK, num_warps=warps,
                          **_no_fma(_prepare_kernel))
    fl = flags.unbind(0)
    return Prepared(c[0], c[1], c[2], c[3], c[4], c[5], fl[0], c[6], c[7], c[8], c[9], c[10], c[11], c[12],
                    c[13], fl[1], c[14], base, state, sc, rn, extra)


# ---- the result, read off the final state ----------------------------------------------------------
#: `admission_result`'s int64 outputs (`R_*`): the admitted count first, then as
#: `gpu_sched.admission.read_step_result` reads a StepResult, then the two the recorded step adds
(R_COUNT, R_STOP_INDEX, R_STOP, R_CHUNK_INDEX, R_CHUNK_LEN, R_FULL, R_INFLIGHT_END, R_INFLIGHT_LEFT, R_I, R_CUR,
 R_RIN, R_RC, R_EV, R_HIT, R_INPUT, R_DONE, R_CUR_REM, R_INPUT_NEW) = range(18)
RESULT_LEN = 18


@triton.jit
def _result_kernel(state_ptr, extra_ptr, pre_ptr, iep_ptr, sv_ptr, rn_ptr, adm_ptr, iv_ptr, flag_ptr, rem_ptr,
                   L, P: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.load(sv_ptr + 10)  # SV_N
    k_fin = tl.load(state_ptr + 7)  # ST_K
    kind_fin = tl.load(state_ptr + 9)  # ST_KIND
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), 0)
    count = zero
    hit = zero
    for s in range(0, L, BLOCK):
        j = s + tl.arange(0, BLOCK).to(tl.int64)
        m = j < L
        adm = m & (j < n) & ((j < k_fin) | ((j == k_fin) & (kind_fin != 0)))
        tl.store(adm_ptr + j, adm.to(tl.uint8), mask=m)
        iep = tl.load(iep_ptr + j, mask=m, other=1) != 0
        count += tl.sum((adm & (j < L - 1)).to(tl.int64), 0)  # the queue's Q entries, not the pad
        hit += tl.sum(tl.where(adm & ~iep, tl.load(pre_ptr + j, mask=m, other=0), 0), 0)
    A = tl.load(sv_ptr + 0)  # SV_A
    I = tl.load(state_ptr + 10)
    cur = tl.load(state_ptr + 11)
    rin = tl.load(state_ptr + 12)
    ev = tl.load(state_ptr + 14)
    full = tl.load(state_ptr + 15)
    done = tl.load(state_ptr + 4)
    inflight_end = tl.load(extra_ptr + 1)
    inflight_left = tl.load(extra_ptr + 2)
    input_tokens = tl.load(extra_ptr + 0) + (tl.load(extra_ptr + 3) - rin)
    # the in-flight chunk's own input tokens, page-rounded (the host's adder counts them itself)
    x = inflight_end - tl.load(sv_ptr + 13)  # SV_C_PREFIX
    in_flight = tl.where(tl.load(sv_ptr + 11) != 0, _floor_div(x + P - 1, P) * P, 0)  # SV_C_PRESENT
    tl.store(iv_ptr + 0, count)
    tl.store(iv_ptr + 1, k_fin)
    tl.store(iv_ptr + 2, tl.load(state_ptr + 8))  # ST_STOP
    tl.store(iv_ptr + 3, tl.load(state_ptr + 5))  # ST_CHUNK_IDX
    tl.store(iv_ptr + 4, tl.load(state_ptr + 6))  # ST_CHUNK_LEN
    tl.store(iv_ptr + 5, (full != 0).to(tl.int64))
    tl.store(iv_ptr + 6, inflight_end)
    tl.store(iv_ptr + 7, (inflight_left != 0).to(tl.int64))
    tl.store(iv_ptr + 8, I)
    tl.store(iv_ptr + 9, cur)
    tl.store(iv_ptr + 10, rin)
    tl.store(iv_ptr + 11, tl.load(state_ptr + 13))  # ST_RC
    tl.store(iv_ptr + 12, ev)
    tl.store(iv_ptr + 13, hit)
    tl.store(iv_ptr + 14, input_tokens)
    tl.store(iv_ptr + 15, (done != 0).to(tl.int64))
    tl.store(iv_ptr + 16, A + ev - cur)
    tl.store(iv_ptr + 17, input_tokens - in_flight)
    tl.store(flag_ptr + 0, (full != 0).to(tl.uint8))
    tl.store(flag_ptr + 1, (inflight_left != 0).to(tl.uint8))
    tl.store(flag_ptr + 2, (done != 0).to(tl.uint8))
    tl.store(rem_ptr, (A + ev - I).to(tl.float64) - tl.load(rn_ptr))


class AdmissionResult(NamedTuple):
    """`admission_result`'s outputs: the admitted mask over the padded queue and the scalars."""

    admitted: torch.Tensor  # bool [Q+1]
    iv: torch.Tensor  # int64 [RESULT_LEN] (`R_*`)
    flags: torch.Tensor  # bool [3]: batch full, in-flight chunk left, rounds decided
    rem_total: torch.Tensor  # float64 0-d (D7)


def admission_result(cfg, state: torch.Tensor, extra: torch.Tensor, pre: torch.Tensor, iep: torch.Tensor,
                     sv: torch.Tensor, rn: torch.Tensor, *, block: Optional[int] = None) -> AdmissionResult:
    """What `gpu_sched.admission.admit_step` returns, read off the rounds' final state in one
    single-program launch: the admitted mask (valid entries before the stop index, and the
    one at it when it was admitted), the hit tokens of the admitted entries (those on the
    ignore-EOS path, `iep`, count none, as in `admit_step`'s torch form), the
    counts, budgets and flags, the D7 float64 total, and
    the input tokens without the in-flight chunk's own (page-rounded; the recorded step's
    figure). state int64 [STATE_LEN], extra int64 [EXTRA_LEN], pre int64 [Q+1], iep bool
    [Q+1], sv int64 [SV_LEN] (the loop's inputs), rn float64 0-d."""
    where = "admission_result"
    check_tensor(where, "pre", pre, (torch.int64,))
    dev = check_launch_device(where, _result_kernel, pre)
    L = pre.numel()
    check_tensor(where, "iep", iep, (torch.bool,), numel=L, device=dev)
    check_tensor(where, "state", state, (torch.int64,), numel=STATE_LEN, device=dev)
    check_tensor(where, "extra", extra, (torch.int64,), numel=EXTRA_LEN, device=dev)
    check_tensor(where, "sv", sv, (torch.int64,), numel=SV_LEN, device=dev)
    check_tensor(where, "rn", rn, (torch.float64,), ndim=rn.dim(), numel=1, device=dev)
    BLOCK, warps = scan_config(L, block)
    adm = torch.empty(L, dtype=torch.bool, device=dev)
    iv = torch.empty(RESULT_LEN, dtype=torch.int64, device=dev)
    flags = torch.empty(3, dtype=torch.bool, device=dev)
    rem = torch.empty((), dtype=torch.float64, device=dev)
    _result_kernel[(1,)](state, extra, pre, iep.view(torch.uint8), sv, rn, adm.view(torch.uint8), iv,
                         flags.view(torch.uint8), rem, L, P=cfg.page_size, BLOCK=BLOCK, num_warps=warps)
    return AdmissionResult(adm, iv, flags, rem)
