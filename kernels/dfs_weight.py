"""DFS-weight passes (SPEC.md R-ORD-10) over a flattened tree, as parallel rounds.

The tree is given as arrays over N nodes: `parent` (-1 for the root, node 0), `child_rank`
(position among the parent's children). With `anc_k(v)` the ancestor 2^k levels up (-1 past
the root), both tree sums are computed by pointer jumping, so a chain of 10^5 nodes takes 17
rounds, not 10^5 levels:

- weights, bottom-up: `S_0 = own`; `S_{k+1}(v) = S_k(v) + sum_{w: anc_k(w) = v} S_k(w)`
  (a scatter with integer atomics, exact and order-independent); after R rounds with
  2^R > max depth, `S = weight` (own requests in the subtree); `subtree_weights`.
- start positions, top-down: `T_0 = off` (weights of the siblings ordered before the node);
  `T_{k+1}(v) = T_k(v) + T_k(anc_k(v))` (a gather); after R rounds `T = start`.

Then request i at node v is emitted at `start(v) + weight(v) - own(v)` (post-order: the
descendants' requests first), ties in queue order via a stable sort (done by the caller).
The sibling offsets (`off`) are a stable sort of `sibling_keys` (torch, in
`gpu_sched.policy`) and a segmented prefix sum (`sibling_offsets`).
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


@triton.jit
def _weight_round_kernel(s_ptr, anc_ptr, s_new_ptr, clear_ptr, anc_new_ptr, num_nodes, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_nodes
    a = tl.load(anc_ptr + offs, mask=mask, other=-1)
    up = mask & (a >= 0)
    s = tl.load(s_ptr + offs, mask=mask, other=0)
    # s_new starts at zero: the node's own term is an atomic too, as other lanes add there
    tl.atomic_add(s_new_ptr + offs, s, mask=mask)
    tl.atomic_add(s_new_ptr + a, s, mask=up)
    tl.store(clear_ptr + offs, tl.zeros([BLOCK], tl.int64), mask=mask)  # the next round's s_new
    a2 = tl.load(anc_ptr + a, mask=up, other=-1)
    tl.store(anc_new_ptr + offs, a2, mask=mask)


def subtree_weights(last_node: torch.Tensor, parent: torch.Tensor, rounds: int,
                    *, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(own, S) int64 [N] each: `own` the queued requests per node (a last node outside
    [0, N) counts at the root, node 0, like an unmatched request), `S = S_rounds` after
    `rounds` bottom-up pointer-jumping rounds (the module's docstring; `weight` once
    2^rounds exceeds the tree depth). last_node int [n]; parent int64 [N >= 1] (-1: none).

    One zero-fill, the count and one launch per round, no copies: the rounds rotate over
    three buffers, each round adding into one that the round before it cleared (a buffer is
    cleared only after the round that read it has finished)."""
    where = "subtree_weights"
    check_tensor(where, "last_node", last_node, INT_DTYPES)
    dev = check_launch_device(where, _weight_round_kernel, last_node)
    check_tensor(where, "parent", parent, (torch.int64,), device=dev)
    N = parent.numel()
    if N < 1:
        raise ValueError(f"{where}: parent must hold at least the root (node 0), got 0 nodes")
    check_int(where, "rounds", rounds, lo=0)
    n = last_node.numel()
    BLOCK, warps = block_config(block)
    bufs = torch.zeros(4, N, dtype=torch.int64, device=dev)  # own, then the three round buffers
    own = bufs[0]
    if n:
        _own_count_kernel[grid_1d(n, BLOCK)](last_node, own, n, N, BLOCK=BLOCK, num_warps=warps)
    s, anc = own, parent
    for k in range(rounds):
        s_new, anc_new = bufs[1 + k % 3], torch.empty_like(parent)
        _weight_round_kernel[grid_1d(N, BLOCK)](s, anc, s_new, bufs[1 + (k + 1) % 3], anc_new, N,
                                                BLOCK=BLOCK, num_warps=warps)
        s, anc = s_new, anc_new
    return own, s


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
def _sibling_run_kernel(order_ptr, parent_ptr, weight_ptr, w_s_ptr, first_ptr, num_nodes, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_nodes
    o = tl.load(order_ptr + offs, mask=mask, other=0)
    p = tl.load(parent_ptr + o, mask=mask, other=0)
    back = mask & (offs > 0)
    p_prev = tl.load(parent_ptr + tl.load(order_ptr + offs - 1, mask=back, other=0), mask=back, other=0)
    tl.store(w_s_ptr + offs, tl.load(weight_ptr + o, mask=mask, other=0), mask=mask)
    # each run's first position, written by that position alone (no atomics, no fill)
    tl.store(first_ptr + p + 1, offs, mask=mask & ((offs == 0) | (p != p_prev)))


@triton.jit
def _sibling_offset_kernel(order_ptr, parent_ptr, w_s_ptr, cs_ptr, first_ptr, off_ptr, num_nodes,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_nodes
    o = tl.load(order_ptr + offs, mask=mask, other=0)
    f = tl.load(first_ptr + tl.load(parent_ptr + o, mask=mask, other=0) + 1, mask=mask, other=0)
    excl = tl.load(cs_ptr + offs, mask=mask, other=0) - tl.load(w_s_ptr + offs, mask=mask, other=0)
    excl_f = tl.load(cs_ptr + f, mask=mask, other=0) - tl.load(w_s_ptr + f, mask=mask, other=0)
    tl.store(off_ptr + o, excl - excl_f, mask=mask)


def sibling_offsets(order: torch.Tensor, parent: torch.Tensor, weight: torch.Tensor,
                    *, block: Optional[int] = None) -> torch.Tensor:
    """int64 [N]: per node, the summed weight of the siblings before it in `order` (the
    module's `off`): order int64 [N], a permutation of the nodes that keeps each parent's
    children together (the sorted `sibling_keys`); parent int64 [N] in [-1, N); weight int64
    [N]. Two launches around one `torch.cumsum` (the runs' starts found where the parent
    changes, then each node's exclusive sum less its run's), in place of a segmented scan of
    torch ops."""
    where = "sibling_offsets"
    check_tensor(where, "order", order, (torch.int64,))
    dev = check_launch_device(where, _sibling_run_kernel, order)
    N = order.numel()
    check_tensor(where, "parent", parent, (torch.int64,), numel=N, device=dev)
    check_tensor(where, "weight", weight, (torch.int64,), numel=N, device=dev)
    BLOCK, warps = block_config(block)
    w_s = torch.empty(N, dtype=torch.int64, device=dev)
    first = torch.empty(N + 1, dtype=torch.int64, device=dev)  # by parent + 1; read only where written
    off = torch.empty(N, dtype=torch.int64, device=dev)
    if N:
        _sibling_run_kernel[grid_1d(N, BLOCK)](order, parent, weight, w_s, first, N, BLOCK=BLOCK, num_warps=warps)
        cs = torch.cumsum(w_s, 0)
        _sibling_offset_kernel[grid_1d(N, BLOCK)](order, parent, w_s, cs, first, off, N, BLOCK=BLOCK,
                                                  num_warps=warps)
    return off


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
def _request_base_kernel(last_node_ptr, start_ptr, weight_ptr, own_ptr, tb_ptr, out_ptr, n, num_nodes, tb_bound,
                         HAS_TB: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(last_node_ptr + offs, mask=mask, other=0).to(tl.int64)
    v = tl.where((v >= 0) & (v < num_nodes), v, 0)
    st = tl.load(start_ptr + v, mask=mask, other=0)
    w = tl.load(weight_ptr + v, mask=mask, other=0)
    o = tl.load(own_ptr + v, mask=mask, other=0)
    base = st + w - o
    if HAS_TB:
        base = base * tb_bound + tl.load(tb_ptr + offs, mask=mask, other=0).to(tl.int64)
    tl.store(out_ptr + offs, base, mask=mask)


def request_bases(last_node: torch.Tensor, start: torch.Tensor, weight: torch.Tensor, own: torch.Tensor,
                  *, tiebreak: Optional[torch.Tensor] = None, tiebreak_bound: Optional[int] = None,
                  block: Optional[int] = None) -> torch.Tensor:
    """int64 [n]: the first output position of each request's node's own requests,
    `start(v) + weight(v) - own(v)` (a last node outside [0, N) is the root). With
    `tiebreak` int [n] (values in [0, tiebreak_bound), not checked: that would read them)
    the packed key `base * tiebreak_bound + tiebreak`, whose stable order is the order by
    (base, tiebreak); the caller checks that n * tiebreak_bound fits int64."""
    where = "request_bases"
    check_tensor(where, "last_node", last_node, INT_DTYPES)
    dev = check_launch_device(where, _request_base_kernel, last_node)
    N = start.numel()
    check_tensor(where, "start", start, (torch.int64,), device=dev)
    check_tensor(where, "weight", weight, (torch.int64,), numel=N, device=dev)
    check_tensor(where, "own", own, (torch.int64,), numel=N, device=dev)
    n = last_node.numel()
    if (tiebreak is None) != (tiebreak_bound is None):
        raise ValueError(f"{where}: tiebreak and tiebreak_bound go together, got only one of them")
    if tiebreak is not None:
        check_tensor(where, "tiebreak", tiebreak, INT_DTYPES, numel=n, device=dev)
        check_int(where, "tiebreak_bound", tiebreak_bound, lo=1)
    BLOCK, warps = block_config(block)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n:
        _request_base_kernel[grid_1d(n, BLOCK)](last_node, start, weight, own, out if tiebreak is None else tiebreak,
                                                out, n, N, tiebreak_bound or 1, HAS_TB=tiebreak is not None,
                                                BLOCK=BLOCK, num_warps=warps)
    return out


@triton.jit
def _match_node_kernel(m_ptr, pos_ptr, owner_ptr, koff_ptr, klen_ptr, alive_ptr, parent_ptr, node_ptr, tb_ptr,
                       live_parent_ptr, n, num_nodes, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rm = offs < n  # the requests' lanes
    has = rm & (tl.load(m_ptr + offs, mask=rm, other=0) > 0)
    p = tl.load(pos_ptr + offs, mask=has, other=0)
    v = tl.load(owner_ptr + p, mask=has, other=0)
    cover = p - tl.load(koff_ptr + v, mask=has, other=0) + 1
    part = has & (cover < tl.load(klen_ptr + v, mask=has, other=0))
    tl.store(node_ptr + offs, tl.where(has, v, 0), mask=rm)
    tl.store(tb_ptr + offs, tl.where(part, cap - cover, 0), mask=rm)
    nm = offs < num_nodes  # the nodes' lanes
    live = tl.load(alive_ptr + offs, mask=nm, other=0) != 0
    par = tl.load(parent_ptr + offs, mask=nm, other=-1)
    tl.store(live_parent_ptr + offs, tl.where(live, par, -1), mask=nm)


def match_nodes(match_len: torch.Tensor, match_pos: torch.Tensor, owner: torch.Tensor, key_off: torch.Tensor,
                key_len: torch.Tensor, alive: torch.Tensor, parent: torch.Tensor, cap: int,
                *, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recorded step's dfs-weight inputs from its full prefix matches (R-ORD-10), in one
    launch: (node int64 [n], tiebreak int64 [n], live_parent int64 [N]).

    match_len int64 [n] (tokens), match_pos int64 [n] (pool position of each match's last
    token, read where match_len > 0); the tree's arrays: owner int64 [T] (node of each pool
    token), key_off, key_len int64 [>= every owner id + 1] (pool offset and length of each
    node's key), alive bool [N], parent int64 [N]; cap int >= 1, above every cover.
    node[i]: the node holding request i's last matched token (0, the root, without a match);
    tiebreak[i]: `cap - cover` where the match ends inside its node (cover = tokens of the node
    it covers), else 0; live_parent: parent where alive, else -1 (dead slots detached). The
    values of `StepGraph._dfs_weight_perm`'s torch form."""
    where = "match_nodes"
    check_tensor(where, "match_len", match_len, (torch.int64,))
    dev = check_launch_device(where, _match_node_kernel, match_len)
    n = match_len.numel()
    check_tensor(where, "match_pos", match_pos, (torch.int64,), numel=n, device=dev)
    check_tensor(where, "owner", owner, (torch.int64,), device=dev)
    check_tensor(where, "key_off", key_off, (torch.int64,), device=dev)
    check_tensor(where, "key_len", key_len, (torch.int64,), numel=key_off.numel(), device=dev)
    check_tensor(where, "alive", alive, (torch.bool,), device=dev)
    N = alive.numel()
    check_tensor(where, "parent", parent, (torch.int64,), numel=N, device=dev)
    check_int(where, "cap", cap, lo=1)
    BLOCK, warps = block_config(block)
    node = torch.empty(n, dtype=torch.int64, device=dev)
    tb = torch.empty(n, dtype=torch.int64, device=dev)
    live_parent = torch.empty(N, dtype=torch.int64, device=dev)
    if max(n, N):
        _match_node_kernel[grid_1d(max(n, N), BLOCK)](match_len, match_pos, owner, key_off, key_len,
                                                      alive.view(torch.uint8), parent, node, tb, live_parent, n,
                                                      N, cap, BLOCK=BLOCK, num_warps=warps)
    return node, tb, live_parent
