"""The ignore-EOS reservation scan of R-ADM-6 (D1, D7) as a candidates x states grid: one
program per candidate j walks the states, already sorted by `left` on the device, twice in
blocks: first the number of states it keeps (held ones and queue entries up to j, `left > 0`),
then masked running prefix sums of `occupied` and of the count, testing at every kept position
`float64(c_j + freed_k) - float64(left_k * bs_k) <= bs_k`; the candidate fails on any hit.
The torch version is the grid in `gpu_sched.admission.ignore_eos_fail`; tests hold them equal.
FMA contraction is off so `left_k * bs_k` is rounded on its own, as D7 says.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import block_config, check_launch_device, check_tensor


@triton.jit
def _states_of(qidx_ptr, keep_ptr, offs, S, j):
    """(in range, counted) masks of a block of sorted states for candidate j: kept states that
    are held or come from queue entries up to j."""
    msk = offs < S
    qi = tl.load(qidx_ptr + offs, mask=msk, other=0)
    kp = tl.load(keep_ptr + offs, mask=msk, other=0)
    return msk, msk & (kp != 0) & (qi <= j)


@triton.jit
def _ignore_eos_kernel(c_ptr, left_ptr, occ_ptr, qidx_ptr, keep_ptr, fail_ptr, S, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    c = tl.load(c_ptr + j)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), 0)
    total = zero
    for s0 in range(0, S, BLOCK):
        offs = s0 + tl.arange(0, BLOCK).to(tl.int64)
        msk, m = _states_of(qidx_ptr, keep_ptr, offs, S, j)
        total += tl.sum(m.to(tl.int64), 0)
    carry_cnt = zero
    carry_occ = zero
    fail = zero
    for s0 in range(0, S, BLOCK):
        offs = s0 + tl.arange(0, BLOCK).to(tl.int64)
        msk, m = _states_of(qidx_ptr, keep_ptr, offs, S, j)
        mc = m.to(tl.int64)
        occ = tl.where(m, tl.load(occ_ptr + offs, mask=msk, other=0), 0)
        left = tl.load(left_ptr + offs, mask=msk, other=0.0)
        cnt_incl = carry_cnt + tl.cumsum(mc, 0)
        freed = carry_occ + tl.cumsum(occ, 0) - occ
        bs = (total - cnt_incl + mc).to(tl.float64)
        test = m & ((c + freed).to(tl.float64) - left * bs <= bs)
        fail = tl.maximum(fail, tl.max(test.to(tl.int64), 0))
        carry_cnt += tl.sum(mc, 0)
        carry_occ += tl.sum(occ, 0)
    tl.store(fail_ptr + j, fail.to(tl.uint8))


def ignore_eos_scan(c: torch.Tensor, left_s: torch.Tensor, occ_s: torch.Tensor, qidx_s: torch.Tensor,
                    keep_s: torch.Tensor, *, block: Optional[int] = None) -> torch.Tensor:
    """fail bool [Q] for the candidates `c` int64 [Q] (cur_rem_j - ceilP(ext_j)) over the states
    sorted by left: `left_s` float64 [S], `occ_s` int64 [S], `qidx_s` int64 [S] (queue index of
    the state, -1 for a held one), `keep_s` bool [S]."""
    where = "ignore_eos_scan"
    check_tensor(where, "c", c, (torch.int64,))
    dev = check_launch_device(where, _ignore_eos_kernel, c)
    Q = c.numel()
    check_tensor(where, "left_s", left_s, (torch.float64,), device=dev)
    S = left_s.numel()
    check_tensor(where, "occ_s", occ_s, (torch.int64,), numel=S, device=dev)
    check_tensor(where, "qidx_s", qidx_s, (torch.int64,), numel=S, device=dev)
    check_tensor(where, "keep_s", keep_s, (torch.bool,), numel=S, device=dev)
    BLOCK, warps = block_config(block)
    fail = torch.zeros(Q, dtype=torch.bool, device=dev)
    if Q:
        _ignore_eos_kernel[(Q,)](c, left_s, occ_s, qidx_s, keep_s.view(torch.uint8), fail.view(torch.uint8), S,
                                 BLOCK=BLOCK, num_warps=warps, **_no_fma(_ignore_eos_kernel))
    return fail


def _no_fma(kernel) -> dict:
    """Launch options that keep `a * b - c` two roundings (compiled kernels only)."""
    from ._utils import is_interpreted
    return {} if is_interpreted(kernel) else {"enable_fp_fusion": False}
