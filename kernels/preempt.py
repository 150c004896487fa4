"""Priority preemption's walk (R-ADM-7, D5, D7) as one Triton program over the victims, already
sorted on the device by (priority * -sign, -enqueue_time): eligibility
`(r_priority - priority) * -sign > threshold` without int64 overflow, the running "all eligible
so far" flag, cumulative reservations `V`, `need(V) = float64(base) + float64(ratio * (N - V))`,
and the cut: the first sorted position where the walk is still eligible and `need <= 0`
(R if none: no preemption). The torch version is `gpu_sched.admission.preempt_select`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import block_config, check_int, check_launch_device, check_tensor
from .ignore_eos import _no_fma

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)


@triton.jit
def _preempt_cut_kernel(ps_ptr, rs_ptr, vs_ptr, rp_ptr, base_ptr, n_ptr, ratio_ptr, out_ptr, R, lim, thr,
                        SIGN_NEG: tl.constexpr, THR_NONNEG: tl.constexpr, BLOCK: tl.constexpr):
    rp = tl.load(rp_ptr)
    base = tl.load(base_ptr)
    N = tl.load(n_ptr)
    ratio = tl.load(ratio_ptr)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), 0)
    carry_ok = zero + 1
    carry_V = zero
    kstar = zero + R
    for s0 in range(0, R, BLOCK):
        offs = s0 + tl.arange(0, BLOCK).to(tl.int64)
        msk = offs < R
        ps = tl.load(ps_ptr + offs, mask=msk, other=0)
        rs = tl.load(rs_ptr + offs, mask=msk, other=0)
        vs = tl.load(vs_ptr + offs, mask=msk, other=0) != 0
        if SIGN_NEG:  # r - v > thr
            a = rp + zero
            b = ps
        else:  # v - r > thr
            a = ps
            b = rp + zero
        if THR_NONNEG:
            elig = tl.where(b > lim, False, a > b + thr)
        else:
            elig = tl.where(b < lim, True, a > b + thr)
        elig = elig & vs & msk
        bad = 1 - elig.to(tl.int64)
        run = (carry_ok != 0) & (tl.cumsum(bad, 0) == 0)
        rsr = tl.where(run, rs, 0)
        V = carry_V + tl.cumsum(rsr, 0)
        need = base.to(tl.float64) + ratio * (N - V).to(tl.float64)
        hit = run & (need <= 0)
        kstar = tl.minimum(kstar, tl.min(tl.where(hit, offs, R), 0))
        carry_ok = carry_ok * (tl.sum(bad, 0) == 0).to(tl.int64)
        carry_V += tl.sum(rsr, 0)
    tl.store(out_ptr, kstar)


def preempt_cut(ps: torch.Tensor, rs: torch.Tensor, vs: torch.Tensor, r_priority: torch.Tensor, base: torch.Tensor,
                ratio: torch.Tensor, N: torch.Tensor, sign: int, threshold: int,
                *, block: Optional[int] = None) -> torch.Tensor:
    """0-d int64: the last sorted victim position taken, R when the walk frees too little.

    ps, rs int64 [R] (priority, reservation) and vs bool [R] (valid) in victim order; r_priority,
    base, N int64 0-d; ratio float64 0-d; sign +1/-1; threshold an int (Python)."""
    where = "preempt_cut"
    check_tensor(where, "ps", ps, (torch.int64,))
    dev = check_launch_device(where, _preempt_cut_kernel, ps)
    R = ps.numel()
    check_tensor(where, "rs", rs, (torch.int64,), numel=R, device=dev)
    check_tensor(where, "vs", vs, (torch.bool,), numel=R, device=dev)
    for name, t, dt in (("r_priority", r_priority, torch.int64), ("base", base, torch.int64), ("N", N, torch.int64),
                        ("ratio", ratio, torch.float64)):
        check_tensor(where, name, t, (dt,), ndim=0, device=dev)
    if sign not in (1, -1) or isinstance(sign, bool):
        raise ValueError(f"{where}: sign must be +1 or -1, got {sign!r}")
    check_int(where, "threshold", threshold, lo=INT64_MIN, hi=INT64_MAX)
    BLOCK, warps = block_config(block)
    out = torch.full((), R, dtype=torch.int64, device=dev)
    if R:
        lim = INT64_MAX - threshold if threshold >= 0 else INT64_MIN - threshold
        _preempt_cut_kernel[(1,)](ps, rs, vs.view(torch.uint8), r_priority, base, N, ratio, out, R, lim, threshold,
                                  SIGN_NEG=sign < 0, THR_NONNEG=threshold >= 0, BLOCK=BLOCK, num_warps=warps,
                                  **_no_fma(_preempt_cut_kernel))
    return out
