"""DFS-weight passes (SPEC.md R-ORD-10) over a flattened tree, as parallel rounds.

The tree is given as arrays over N nodes: `parent` (-1 for the root, node 0), `child_rank`
(position among the parent's children). With `anc_k(v)` the ancestor 2^k levels up (-1 past
the root), both tree sums are computed by pointer jumping, so a chain of 10^5 nodes takes 17
rounds, not 10^5 levels:

- weights, bottom-up: `S_0 = own`; `S_{k+1}(v) = S_k(v) + sum_{w: anc_k(w) = v} S_k(w)`
  (a scatter with integer atomics, exact and order-independent); after R rounds with
  2^R > max depth, `S = weight` (own requests in the subtree).
- start positions, top-down: `T_0 = off` (weights of the siblings ordered before the node);
  `T_{k+1}(v) = T_k(v) + T_k(anc_k(v))` (a gather); after R rounds `T = start`.

Then request i at node v is emitted at `start(v) + weight(v) - own(v)` (post-order: the
descendants' requests first), ties in queue order via a stable sort (done by the caller).
The sibling offsets (`off`) are a stable sort of `sibling_keys` plus a segmented prefix sum,
both torch ops in `gpu_sched.policy`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._utils import block_config, check_int, check_launch_device, check_tensor, grid_1d

INT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _own_count_kernel(last_node_ptr, own_ptr, n, num_nodes, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(last_node_ptr + offs, mask=mask, other=0).to(tl.int64)
    v = tl.where((v >= 0) & (v < num_nodes), v, 0)
    tl.atomic_add(own_ptr + v, tl.full([BLOCK], 1, tl.int64), mask=mask)


def own_counts(last_node: torch.Tensor, num_nodes: int, *, block: Optional[int] = None) -> torch.Tensor:
    """int64 [num_nodes]: queued requests per node; a last node outside [0, N) counts at the
    root (node 0), like an unmatched request."""
    where = "own_counts"
    check_tensor(where, "last_node", last_node, INT_DTYPES)
    dev = check_launch_device(where, _own_count_kernel, last_node)
    check_int(where, "num_nodes", num_nodes, lo=1)
    n = last_node.numel()
    BLOCK, warps = block_config(block)
    own = torch.zeros(num_nodes, dtype=torch.int64, device=dev)
    if n:
        _own_count_kernel[grid_1d(n, BLOCK)](last_node, own, n, num_nodes, BLOCK=BLOCK, num_warps=warps)
    return own


@triton.jit
def _weight_round_kernel(s_ptr, anc_ptr, s_new_ptr, anc_new_ptr, num_nodes, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_nodes
    a = tl.load(anc_ptr + offs, mask=mask, other=-1)
    up = mask & (a >= 0)
    s = tl.load(s_ptr + offs, mask=mask, other=0)
    tl.atomic_add(s_new_ptr + a, s, mask=up)
    a2 = tl.load(anc_ptr + a, mask=up, other=-1)
    tl.store(anc_new_ptr + offs, a2, mask=mask)


def weight_round(s: torch.Tensor, anc: torch.Tensor, *, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One bottom-up round: (S_{k+1}, anc_{k+1}) from (S_k, anc_k), int64 [N] each."""
    where = "weight_round"
    check_tensor(where, "s", s, (torch.int64,))
    dev = check_launch_device(where, _weight_round_kernel, s)
    N = s.numel()
    check_tensor(where, "anc", anc, (torch.int64,), numel=N, device=dev)
    BLOCK, warps = block_config(block)
    s_new = s.clone()
    anc_new = torch.empty_like(anc)
    if N:
        _weight_round_kernel[grid_1d(N, BLOCK)](s, anc, s_new, anc_new, N, BLOCK=BLOCK, num_warps=warps)
    return s_new, anc_new


@triton.jit
def _sibling_keys_kernel(parent_ptr, rank_ptr, weight_ptr, out_ptr, num_nodes, num_requests,
                         PACK_RANK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_nodes
    p = tl.load(parent_ptr + offs, mask=mask, other=-1).to(tl.int64)
    w = tl.load(weight_ptr + offs, mask=mask, other=0)
    key = (p + 1) * (num_requests + 1) + (num_requests - w)
    if PACK_RANK:
        r = tl.load(rank_ptr + offs, mask=mask, other=0).to(tl.int64)
        key = key * num_nodes + r
    tl.store(out_ptr + offs, key, mask=mask)


def sibling_keys(parent: torch.Tensor, child_rank: torch.Tensor, weight: torch.Tensor, num_requests: int,
                 *, pack_rank: bool, block: Optional[int] = None) -> torch.Tensor:
    """int64 [N] keys grouping siblings (by parent) heaviest first:
    `(parent + 1) * (n + 1) + (n - weight)`, times N plus `child_rank` when `pack_rank`
    (the caller checks that it fits int64; child_rank must be in [0, N))."""
    where = "sibling_keys"
    check_tensor(where, "parent", parent, INT_DTYPES)
    dev = check_launch_device(where, _sibling_keys_kernel, parent)
    N = parent.numel()
    check_tensor(where, "child_rank", child_rank, INT_DTYPES, numel=N, device=dev)
    check_tensor(where, "weight", weight, (torch.int64,), numel=N, device=dev)
    check_int(where, "num_requests", num_requests, lo=0)
    BLOCK, warps = block_config(block)
    out = torch.empty(N, dtype=torch.int64, device=dev)
    if N:
        _sibling_keys_kernel[grid_1d(N, BLOCK)](parent, child_rank, weight, out, N, num_requests,
                                                PACK_RANK=bool(pack_rank), BLOCK=BLOCK, num_warps=warps)
    return out


@triton.jit
def _start_round_kernel(t_ptr, anc_ptr, t_new_ptr, anc_new_ptr, num_nodes, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_nodes
    a = tl.load(anc_ptr + offs, mask=mask, other=-1)
    up = mask & (a >= 0)
    t = tl.load(t_ptr + offs, mask=mask, other=0)
    t_up = tl.load(t_ptr + a, mask=up, other=0)
    a2 = tl.load(anc_ptr + a, mask=up, other=-1)
    tl.store(t_new_ptr + offs, t + t_up, mask=mask)
    tl.store(anc_new_ptr + offs, a2, mask=mask)


def start_round(t: torch.Tensor, anc: torch.Tensor, *, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One top-down round: (T_{k+1}, anc_{k+1}) from (T_k, anc_k), int64 [N] each."""
    where = "start_round"
    check_tensor(where, "t", t, (torch.int64,))
    dev = check_launch_device(where, _start_round_kernel, t)
    N = t.numel()
    check_tensor(where, "anc", anc, (torch.int64,), numel=N, device=dev)
    BLOCK, warps = block_config(block)
    t_new = torch.empty_like(t)
    anc_new = torch.empty_like(anc)
    if N:
        _start_round_kernel[grid_1d(N, BLOCK)](t, anc, t_new, anc_new, N, BLOCK=BLOCK, num_warps=warps)
    return t_new, anc_new


@triton.jit
def _request_base_kernel(last_node_ptr, start_ptr, weight_ptr, own_ptr, out_ptr, n, num_nodes,
                         BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(last_node_ptr + offs, mask=mask, other=0).to(tl.int64)
    v = tl.where((v >= 0) & (v < num_nodes), v, 0)
    st = tl.load(start_ptr + v, mask=mask, other=0)
    w = tl.load(weight_ptr + v, mask=mask, other=0)
    o = tl.load(own_ptr + v, mask=mask, other=0)
    tl.store(out_ptr + offs, st + w - o, mask=mask)


def request_bases(last_node: torch.Tensor, start: torch.Tensor, weight: torch.Tensor, own: torch.Tensor,
                  *, block: Optional[int] = None) -> torch.Tensor:
    """int64 [n]: the first output position of each request's node's own requests,
    `start(v) + weight(v) - own(v)` (a last node outside [0, N) is the root)."""
    where = "request_bases"
    check_tensor(where, "last_node", last_node, INT_DTYPES)
    dev = check_launch_device(where, _request_base_kernel, last_node)
    N = start.numel()
    check_tensor(where, "start", start, (torch.int64,), device=dev)
    check_tensor(where, "weight", weight, (torch.int64,), numel=N, device=dev)
    check_tensor(where, "own", own, (torch.int64,), numel=N, device=dev)
    n = last_node.numel()
    BLOCK, warps = block_config(block)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n:
        _request_base_kernel[grid_1d(n, BLOCK)](last_node, start, weight, own, out, n, N,
                                                BLOCK=BLOCK, num_warps=warps)
    return out
