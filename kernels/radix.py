"""Triton kernels of the flattened radix tree (`gpu_sched.radix.FlatRadixTree`, SPEC.md section 2).

Each kernel does the per-request (or per-key) work of one FlatRadixTree step; the tree keeps the
host-side bookkeeping (node allocation, round counts) and chooses between these launchers and its
torch code with `backend="torch" | "triton"`. Results are identical to the torch code, bit for bit
(tests/test_kernels_radix.py):

- `probe`: hash-table lookup. One program per block of queries; linear probing from the home
  slot (bits 32.. of `h * HASH_MIX`, masked to the power-of-two size H) for at most `max_probe`
  slots, stopping at the key or at an EMPTY slot (a tombstone does not stop it). Gives the slot
  (-1 if absent) and the stored value.
- `find`: the match search of `FlatRadixTree._find`. One program per block of requests: a binary
  search over the chunk-boundary hashes (presence is monotone in depth), then page-by-page
  extension inside the next chunk by rolling the two modular hashes from the chunk-boundary hash.
  Queries come in CSR form (a flat token pool with per-row start and readable span, and a flat
  chunk-hash pool with per-row start and count), so a padded [B, L] batch is the special case
  start = i * L. Gives (matched length, pool position of its last token or -1). `find_static`
  is the same launch for a recorded step: it caps, pads and counts each row's length itself.
- `table_insert`: the claim/commit rounds of the open-addressing insert. Round r: every pending
  key whose slot is free (EMPTY or TOMB) claims it with `atomic_max(claim[slot], tag + i)`; after
  the launch boundary the claimant with the largest index wins and writes key and value, the
  others step to the next slot. Tags grow across rounds and calls, so the claim buffer is never
  cleared. Deterministic under real parallelism (the winner is a maximum, not a race).
- `split_apply`: the writes of one split round (`FlatRadixTree._split_round`). One program per
  request: the new head copies the piece's parent, key start, depth, lock count, child order and
  namespace, takes the request's stamp and creation id; the piece keeps the tail under the head;
  the head's token range is written to `owner` a block at a time. Requests of one round cut
  different original nodes, so programs touch disjoint nodes and ranges.
- `stamp_paths`: R-RC-4 / SPEC section 8 stamping. One program per block of requests walks each
  node up to the root with `atomic_max` on `last_access`, stopping where a larger stamp of the
  batch already stands (its writer walks on; the final maxima are the same).
- `path_counts`: lock counts (R-RC-6). Same walk with `atomic_add` of 1 per node, root excluded.
- `lock_drops`: the lock-aware evictable drops of an admission window (R-RC-6, SPEC section 8):
  the first request per node by one `atomic_min` walk per request, node gains by `atomic_add`
  to that request, partial covers by one program over the requests sorted by node.
- `evict_rank`: per-parent candidate count and largest candidate position of one eviction round
  (R-RC-7), with `atomic_add` / `atomic_max`.

Integer hashes use Python's modulo: Triton's `%` truncates like C, so the kernels keep every
dividend non-negative (adding 2p before a token step) or shift a negative remainder by p.
Offsets are int64 throughout.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._utils import block_config, check_int, check_launch_device, check_tensor, grid_1d, scan_config

P1, P2 = 2**31 - 1, 2147483629
#: home slot of key h = bits 32.. of h * HASH_MIX (int64, wrapping): `gpu_sched.radix.home_slot`
HASH_MIX = -7046029254386353131
EMPTY = -1
INT_DTYPES = (torch.int32, torch.int64)
#: requests per program of the per-request kernels (their lanes loop, so keep blocks small)
REQUEST_BLOCK = 128
#: owner positions written per iteration by a split program
FILL_BLOCK = 1024


# Reductions go through `tl.reduce` with Triton's own combine functions: the same code as
# `tl.max` / `tl.sum` once compiled, and the interpreter maps them to numpy instead of
# re-entering a jitted function on every loop test (which costs milliseconds each).
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def _req_block(block: Optional[int]) -> Tuple[int, int]:
    return block_config(REQUEST_BLOCK if block is None else block)


# ---- shared device helpers ------------------------------------------------------------------------
@triton.jit
def _probe_slot(hkeys_ptr, h, active, H, max_probe):
    """Slot of h in the table, -1 if absent or `active` is false (linear probing from the
    home slot, bits 32.. of h * HASH_MIX)."""
    pos = ((h * -7046029254386353131) >> 32) & (H - 1)
    slot = tl.full(h.shape, -1, tl.int64)
    it = 0
    go = (it < max_probe) & (tl.reduce(active.to(tl.int32), 0, _MAX) > 0)
    while go:
        k = tl.load(hkeys_ptr + pos, mask=active, other=-1)
        slot = tl.where(active & (k == h), pos, slot)
        active = active & (k != h) & (k != -1)
        pos = (pos + 1) & (H - 1)
        it += 1
        go = (it < max_probe) & (tl.reduce(active.to(tl.int32), 0, _MAX) > 0)
    return slot


# ---- probe --------------------------------------------------------------------------------------
@triton.jit
def _probe_kernel(h_ptr, hkeys_ptr, hvals_ptr, slot_ptr, val_ptr, n, H, max_probe, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask, other=0)
    slot = _probe_slot(hkeys_ptr, h, mask, H, max_probe)
    val = tl.load(hvals_ptr + slot, mask=slot >= 0, other=-1)
    tl.store(slot_ptr + offs, slot, mask=mask)
    tl.store(val_ptr + offs, val, mask=mask)


def _check_table(where: str, hkeys: torch.Tensor, hvals: torch.Tensor, dev) -> int:
    check_tensor(where, "hkeys", hkeys, (torch.int64,), device=dev)
    H = hkeys.numel()
    if H < 1 or H & (H - 1) or H > 2**31:
        raise ValueError(f"{where}: hkeys size must be a power of two <= 2^31, got {H}")
    check_tensor(where, "hvals", hvals, (torch.int64,), numel=H, device=dev)
    return H


def probe(h: torch.Tensor, hkeys: torch.Tensor, hvals: torch.Tensor, max_probe: int,
          *, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(slot, value) int64 [n] of each hash h (int64 [n]) in the open-addressing table
    (hkeys, hvals) of power-of-two size; slot -1 and value -1 when absent within max_probe."""
    where = "probe"
    check_tensor(where, "h", h, (torch.int64,))
    dev = check_launch_device(where, _probe_kernel, h)
    H = _check_table(where, hkeys, hvals, dev)
    check_int(where, "max_probe", max_probe, lo=1, hi=2**31 - 1)
    n = h.numel()
    BLOCK, warps = block_config(block)
    slot = torch.empty(n, dtype=torch.int64, device=dev)
    val = torch.empty(n, dtype=torch.int64, device=dev)
    if n:
        _probe_kernel[grid_1d(n, BLOCK)](h, hkeys, hvals, slot, val, n, H, max_probe, BLOCK=BLOCK, num_warps=warps)
    return slot, val


# ---- find (binary search + in-chunk extension) ----------------------------------------------------
# chunk_pages is never specialised: Triton turns an int argument equal to 1 into a constant, the
# extension loop below then folds away, and Triton 3.6 fails to compile the dead loop
# ("PassManager::run failed" in TritonGPUCoalesce); page sizes >= 16 default to chunk_pages 1.
@triton.jit(do_not_specialize=["chunk_pages"])
def _find_kernel(tok_ptr, tok_start_ptr, tok_span_ptr, len_ptr, ns_ptr, ch_ptr, ch_start_ptr, ch_cnt_ptr,
                 hkeys_ptr, hvals_ptr, d_ptr, pos_ptr, cap_ptr, valid_ptr, n, H, max_probe, P, C, chunk_pages, B1, B2,
                 STATIC: tl.constexpr, HAS_CAP: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    L = tl.load(len_ptr + offs, mask=mask, other=0)
    if STATIC:  # `find_static`: the length capped and zeroed here; span = length, count = length // C
        if HAS_CAP:
            L = tl.maximum(tl.minimum(L, tl.load(cap_ptr + offs, mask=mask, other=0)), 0)
        if HAS_VALID:
            L = tl.where(tl.load(valid_ptr + offs, mask=mask, other=0) != 0, L, 0)
        ccnt = L // C
        tspan = L
    else:
        ccnt = tl.load(ch_cnt_ptr + offs, mask=mask, other=0)
        tspan = tl.load(tok_span_ptr + offs, mask=mask, other=0)
    Lq = L // P * P
    cstart = tl.load(ch_start_ptr + offs, mask=mask, other=0)
    cmax = tl.maximum(ccnt - 1, 0)
    # binary search for the deepest present chunk boundary
    lo = tl.zeros([BLOCK], tl.int64)
    lo_pos = tl.full([BLOCK], -1, tl.int64)
    hi = Lq // C
    go = mask & (lo < hi)
    while tl.reduce(go.to(tl.int32), 0, _MAX) > 0:
        mid = (lo + hi + 1) // 2
        idx = tl.minimum(tl.maximum(mid - 1, 0), cmax)
        h = tl.load(ch_ptr + cstart + idx, mask=go & (ccnt > 0), other=0)
        slot = _probe_slot(hkeys_ptr, h, go, H, max_probe)
        pos = tl.load(hvals_ptr + slot, mask=slot >= 0, other=-1)
        found = go & (pos >= 0)
        lo = tl.where(found, mid, lo)
        lo_pos = tl.where(found, pos, lo_pos)
        hi = tl.where(go & ~found, mid - 1, hi)
        go = mask & (lo < hi)
    # extend page by page inside the next chunk, rolling the hash from the boundary
    d = lo * C
    sidx = tl.minimum(tl.maximum(lo - 1, 0), cmax)
    seed_h = tl.load(ch_ptr + cstart + sidx, mask=mask & (lo > 0) & (ccnt > 0), other=0)
    nsv = tl.load(ns_ptr + offs, mask=mask, other=0)
    seed = nsv * 1000003 + 12345
    r1 = seed % 2147483647
    r2 = seed % 2147483629
    s1 = tl.where(lo > 0, seed_h >> 31, tl.where(r1 < 0, r1 + 2147483647, r1))
    s2 = tl.where(lo > 0, seed_h & 2147483647, tl.where(r2 < 0, r2 + 2147483629, r2))
    tbase = tok_ptr + tl.load(tok_start_ptr + offs, mask=mask, other=0)
    tlast = tl.maximum(tspan - 1, 0)
    has_tok = tspan > 0
    alive = mask & (d + P <= Lq)
    pos_out = lo_pos
    it = 0
    go2 = (it < chunk_pages - 1) & (tl.reduce(alive.to(tl.int32), 0, _MAX) > 0)
    while go2:
        for j in range(P):
            t = tl.load(tbase + tl.minimum(d + j, tlast), mask=alive & has_tok, other=-1).to(tl.int64) + 1
            # Python's modulo for t >= -2^31: adding 2p keeps the dividend non-negative
            s1 = (s1 * B1 + t + 4294967294) % 2147483647
            s2 = (s2 * B2 + t + 4294967258) % 2147483629
        slot = _probe_slot(hkeys_ptr, (s1 << 31) | s2, alive, H, max_probe)
        pos = tl.load(hvals_ptr + slot, mask=slot >= 0, other=-1)
        ok = alive & (pos >= 0)
        d = tl.where(ok, d + P, d)
        pos_out = tl.where(ok, pos, pos_out)
        alive = ok & (d + P <= Lq)
        it += 1
        go2 = (it < chunk_pages - 1) & (tl.reduce(alive.to(tl.int32), 0, _MAX) > 0)
    tl.store(d_ptr + offs, d, mask=mask)
    tl.store(pos_ptr + offs, pos_out, mask=mask)


def _check_search(where: str, page_size, chunk_pages, B1, B2, max_probe) -> None:
    check_int(where, "page_size", page_size, lo=1, hi=2**20)
    check_int(where, "chunk_pages", chunk_pages, lo=1, hi=2**20)
    check_int(where, "B1", B1, lo=0, hi=P1 - 1)
    check_int(where, "B2", B2, lo=0, hi=P2 - 1)
    check_int(where, "max_probe", max_probe, lo=1, hi=2**31 - 1)


def find(tokens: torch.Tensor, tok_start: torch.Tensor, tok_span: torch.Tensor, lengths: torch.Tensor,
         ns: torch.Tensor, chunk_hashes: torch.Tensor, ch_start: torch.Tensor, ch_count: torch.Tensor,
         hkeys: torch.Tensor, hvals: torch.Tensor, *, page_size: int, chunk_pages: int, B1: int, B2: int,
         max_probe: int, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(matched int64 [B], pool position int64 [B]) of `FlatRadixTree._find` for B queries.

    tokens int32 [T] flat pool; row i reads tokens[tok_start[i] + c] for c < tok_span[i] (reads
    past the span are clamped to its last token and only feed hashes of dead lanes).
    lengths/ns int64 [B]; chunk_hashes int64 [K] flat pool, row i's boundary hashes at depths
    C, 2C, ... are chunk_hashes[ch_start[i] : ch_start[i] + ch_count[i]] with
    ch_count[i] >= floorP(lengths[i]) // C, C = page_size * chunk_pages.
    """
    where = "find"
    check_tensor(where, "lengths", lengths, (torch.int64,))
    dev = check_launch_device(where, _find_kernel, lengths)
    B = lengths.numel()
    check_tensor(where, "tokens", tokens, (torch.int32,), device=dev)
    for name, t in (("tok_start", tok_start), ("tok_span", tok_span), ("ns", ns), ("ch_start", ch_start),
                    ("ch_count", ch_count)):
        check_tensor(where, name, t, (torch.int64,), numel=B, device=dev)
    check_tensor(where, "chunk_hashes", chunk_hashes, (torch.int64,), device=dev)
    H = _check_table(where, hkeys, hvals, dev)
    _check_search(where, page_size, chunk_pages, B1, B2, max_probe)
    BLOCK, warps = _req_block(block)
    d = torch.empty(B, dtype=torch.int64, device=dev)
    pos = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return d, pos
    # a zero-size pool still needs a valid address (every read of it is masked)
    tok = tokens if tokens.numel() else torch.zeros(1, dtype=torch.int32, device=dev)
    ch = chunk_hashes if chunk_hashes.numel() else torch.zeros(1, dtype=torch.int64, device=dev)
    _find_kernel[grid_1d(B, BLOCK)](
        tok, tok_start, tok_span, lengths, ns, ch, ch_start, ch_count, hkeys, hvals, d, pos, lengths, lengths,
        B, H, max_probe, page_size, page_size * chunk_pages, chunk_pages, B1, B2,
        STATIC=False, HAS_CAP=False, HAS_VALID=False, BLOCK=BLOCK, num_warps=warps)
    return d, pos


def find_static(tokens: torch.Tensor, tok_start: torch.Tensor, lengths: torch.Tensor, ns: torch.Tensor,
                chunk_hashes: torch.Tensor, ch_start: torch.Tensor, hkeys: torch.Tensor, hvals: torch.Tensor, *,
                page_size: int, chunk_pages: int, B1: int, B2: int, max_probe: int,
                cap: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
                out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`find` of `FlatRadixTree.find_static` in one launch: row i's length is
    L = lengths[i], then min(L, cap[i]) clamped at 0 when `cap` is given, then 0 where
    valid[i] is False when `valid` is given; its readable token span is L and its chunk-hash
    count L // C (C = page_size * chunk_pages), so the caller forms neither (no tensor op
    before the launch). lengths/tok_start/ns/ch_start/cap int64 [B], valid bool [B].
    `out`: (matched, position) int64 [B] buffers written in place (a recorded step's own),
    else new tensors. Returns (matched int64 [B] [tokens], position int64 [B], -1 for none)."""
    where = "find_static"
    check_tensor(where, "lengths", lengths, (torch.int64,))
    dev = check_launch_device(where, _find_kernel, lengths)
    B = lengths.numel()
    check_tensor(where, "tokens", tokens, (torch.int32,), device=dev)
    for name, t in (("tok_start", tok_start), ("ns", ns), ("ch_start", ch_start)):
        check_tensor(where, name, t, (torch.int64,), numel=B, device=dev)
    if cap is not None:
        check_tensor(where, "cap", cap, (torch.int64,), numel=B, device=dev)
    if valid is not None:
        check_tensor(where, "valid", valid, (torch.bool,), numel=B, device=dev)
    check_tensor(where, "chunk_hashes", chunk_hashes, (torch.int64,), device=dev)
    H = _check_table(where, hkeys, hvals, dev)
    _check_search(where, page_size, chunk_pages, B1, B2, max_probe)
    if out is None:
        d = torch.empty(B, dtype=torch.int64, device=dev)
        pos = torch.empty(B, dtype=torch.int64, device=dev)
    else:
        d, pos = out
        check_tensor(where, "out[0]", d, (torch.int64,), numel=B, device=dev)
        check_tensor(where, "out[1]", pos, (torch.int64,), numel=B, device=dev)
    if B == 0:
        return d, pos
    BLOCK, warps = _req_block(block)
    tok = tokens if tokens.numel() else torch.zeros(1, dtype=torch.int32, device=dev)
    ch = chunk_hashes if chunk_hashes.numel() else torch.zeros(1, dtype=torch.int64, device=dev)
    capt = cap if cap is not None else lengths
    v8 = valid.view(torch.uint8) if valid is not None else lengths
    _find_kernel[grid_1d(B, BLOCK)](
        tok, tok_start, lengths, lengths, ns, ch, ch_start, lengths, hkeys, hvals, d, pos, capt, v8,
        B, H, max_probe, page_size, page_size * chunk_pages, chunk_pages, B1, B2,
        STATIC=True, HAS_CAP=cap is not None, HAS_VALID=valid is not None, BLOCK=BLOCK, num_warps=warps)
    return d, pos


# ---- table insert (claim / commit rounds) ---------------------------------------------------------
@triton.jit
def _claim_kernel(pos_ptr, pend_ptr, hkeys_ptr, claim_ptr, n, tag, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    pend = mask & (tl.load(pend_ptr + offs, mask=mask, other=0) != 0)
    p = tl.load(pos_ptr + offs, mask=mask, other=0)
    k = tl.load(hkeys_ptr + p, mask=pend, other=0)
    free = pend & (k < 0)  # EMPTY or TOMB
    tl.atomic_max(claim_ptr + p, tag + offs, mask=free)


@triton.jit
def _commit_kernel(h_ptr, v_ptr, pos_ptr, pend_ptr, hkeys_ptr, hvals_ptr, claim_ptr, left_ptr, n, H, tag,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    pend = mask & (tl.load(pend_ptr + offs, mask=mask, other=0) != 0)
    p = tl.load(pos_ptr + offs, mask=mask, other=0)
    c = tl.load(claim_ptr + p, mask=pend, other=-1)
    won = pend & (c == tag + offs)
    # every thread has loaded pend and pos before any stores them: a block smaller than the
    # program's threads is held by several threads each, and a late one would read the new
    # slot, then count and move from it (tests/interp_races.py)
    tl.debug_barrier()
    tl.store(hkeys_ptr + p, tl.load(h_ptr + offs, mask=won, other=0), mask=won)
    tl.store(hvals_ptr + p, tl.load(v_ptr + offs, mask=won, other=0), mask=won)
    still = pend & ~won
    tl.store(pend_ptr + offs, still.to(tl.int8), mask=mask)
    tl.store(pos_ptr + offs, tl.where(still, (p + 1) & (H - 1), p), mask=mask)
    tl.atomic_add(left_ptr, tl.reduce(still.to(tl.int64), 0, _SUM))


def table_insert(h: torch.Tensor, v: torch.Tensor, hkeys: torch.Tensor, hvals: torch.Tensor,
                 claim: torch.Tensor, tag_base: int, max_probe: int,
                 *, block: Optional[int] = None) -> Tuple[bool, int]:
    """Insert keys h (int64 [n], >= 0, absent from the table) with values v (int64 [n]) into
    (hkeys, hvals) in place: at most max_probe claim/commit rounds, as `FlatRadixTree._table_insert`
    (the largest index wins a contested slot). `claim` int64 [H] holds values below tag_base
    (e.g. -1 when new). Returns (all placed, the next unused tag base). Reads one scalar per round."""
    where = "table_insert"
    check_tensor(where, "h", h, (torch.int64,))
    dev = check_launch_device(where, _claim_kernel, h)
    n = h.numel()
    check_tensor(where, "v", v, (torch.int64,), numel=n, device=dev)
    H = _check_table(where, hkeys, hvals, dev)
    check_tensor(where, "claim", claim, (torch.int64,), numel=H, device=dev)
    check_int(where, "tag_base", tag_base, lo=0, hi=2**62)
    check_int(where, "max_probe", max_probe, lo=1, hi=2**31 - 1)
    if n == 0:
        return True, tag_base
    BLOCK, warps = block_config(block)
    grid = grid_1d(n, BLOCK)
    pos = ((h * HASH_MIX) >> 32) & (H - 1)  # home slots, as gpu_sched.radix.home_slot
    pend = torch.ones(n, dtype=torch.int8, device=dev)
    left = torch.zeros(1, dtype=torch.int64, device=dev)
    tag = tag_base
    for _ in range(max_probe):
        _claim_kernel[grid](pos, pend, hkeys, claim, n, tag, BLOCK=BLOCK, num_warps=warps)
        left.zero_()
        _commit_kernel[grid](h, v, pos, pend, hkeys, hvals, claim, left, n, H, tag, BLOCK=BLOCK, num_warps=warps)
        tag += n
        if int(left) == 0:
            return True, tag
    return False, tag


# ---- split round -------------------------------------------------------------------------------
@triton.jit
def _split_kernel(piece_ptr, cover_ptr, stamp_ptr, newcid_ptr, head_ptr,
                  parent_ptr, key_off_ptr, key_len_ptr, start_ptr, lock_ptr, last_ptr, cid_ptr, order_ptr,
                  ns_ptr, nchild_ptr, alive_ptr, owner_ptr, FILL: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    x = tl.load(piece_ptr + i)
    c = tl.load(cover_ptr + i)
    s = tl.load(stamp_ptr + i)
    hd = tl.load(head_ptr + i)
    off = tl.load(key_off_ptr + x)
    st = tl.load(start_ptr + x)
    tl.store(parent_ptr + hd, tl.load(parent_ptr + x))
    tl.store(key_off_ptr + hd, off)
    tl.store(key_len_ptr + hd, c)
    tl.store(start_ptr + hd, st)
    tl.store(lock_ptr + hd, tl.load(lock_ptr + x))
    tl.store(last_ptr + hd, s)
    tl.store(cid_ptr + hd, tl.load(newcid_ptr + i))
    tl.store(order_ptr + hd, tl.load(order_ptr + x))
    tl.store(ns_ptr + hd, tl.load(ns_ptr + x))
    tl.store(nchild_ptr + hd, tl.full([], 1, tl.int64))
    tl.store(alive_ptr + hd, tl.full([], 1, tl.int8))
    hv = tl.full([FILL], 0, tl.int64) + hd
    b = tl.zeros([], tl.int64)
    while b < c:
        o = b + tl.arange(0, FILL)
        tl.store(owner_ptr + off + o, hv, mask=o < c)
        b += FILL
    # every warp has read key_off[x] (above) before it moves: a warp that started late must
    # not see the new offset
    tl.debug_barrier()
    tl.store(key_off_ptr + x, off + c)
    tl.store(key_len_ptr + x, tl.load(key_len_ptr + x) - c)
    tl.store(start_ptr + x, st + c)
    tl.store(parent_ptr + x, hd)
    tl.store(last_ptr + x, tl.maximum(tl.load(last_ptr + x), s))


NODE_ARRAYS = ("parent", "key_off", "key_len", "start", "lock_ref", "last_access", "cid", "order", "ns", "nchild")


def split_apply(piece: torch.Tensor, cover: torch.Tensor, stamp: torch.Tensor, new_cid: torch.Tensor,
                head: torch.Tensor, nodes: Sequence[torch.Tensor], alive: torch.Tensor, owner: torch.Tensor,
                *, block: Optional[int] = None) -> None:
    """The writes of one split round, in place. Request i cuts node piece[i] after cover[i]
    tokens (0 < cover < key_len) into the new node head[i] (the matched head, stamped stamp[i],
    creation id new_cid[i]) and piece[i] (the tail, now under head[i]); the pieces must be
    distinct. `nodes` = the int64 node arrays in `NODE_ARRAYS` order, `alive` bool [N],
    `owner` int64 [T] (the head's token range is written with head[i])."""
    where = "split_apply"
    check_tensor(where, "piece", piece, (torch.int64,))
    dev = check_launch_device(where, _split_kernel, piece)
    n = piece.numel()
    for name, t in (("cover", cover), ("stamp", stamp), ("new_cid", new_cid), ("head", head)):
        check_tensor(where, name, t, (torch.int64,), numel=n, device=dev)
    if len(nodes) != len(NODE_ARRAYS):
        raise ValueError(f"{where}: nodes must be the {len(NODE_ARRAYS)} arrays {NODE_ARRAYS}, got {len(nodes)}")
    N = alive.numel()
    check_tensor(where, "alive", alive, (torch.bool,), device=dev)
    for name, t in zip(NODE_ARRAYS, nodes):
        check_tensor(where, name, t, (torch.int64,), numel=N, device=dev)
    check_tensor(where, "owner", owner, (torch.int64,), device=dev)
    FILL, warps = block_config(FILL_BLOCK if block is None else block)
    if n == 0:
        return
    _split_kernel[(n,)](piece, cover, stamp, new_cid, head, *nodes, alive.view(torch.int8), owner,
                        FILL=FILL, num_warps=warps)


# ---- path walks: stamps and lock counts ------------------------------------------------------------
@triton.jit
def _stamp_paths_kernel(nodes_ptr, stamp_ptr, parent_ptr, last_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    cur = tl.load(nodes_ptr + offs, mask=mask, other=-1)
    s = tl.load(stamp_ptr + offs, mask=mask, other=0)
    active = mask & (cur >= 0)
    while tl.reduce(active.to(tl.int32), 0, _MAX) > 0:
        old = tl.atomic_max(last_ptr + cur, s, mask=active)
        # a larger stamp there was written by a walk that goes on to the root (see
        # FlatRadixTree._stamp_paths): stop, leaving the root's atomics uncontended
        active = active & (old <= s)
        cur = tl.load(parent_ptr + cur, mask=active, other=-1)
        active = active & (cur >= 0)


def stamp_paths(nodes: torch.Tensor, stamp: torch.Tensor, parent: torch.Tensor, last_access: torch.Tensor,
                *, block: Optional[int] = None) -> None:
    """last_access[v] = max(last_access[v], stamp[i]) for every node v on the path from
    nodes[i] (>= 0) up to the root, in place (int64 throughout).

    A walk stops at a node already holding a larger stamp, so the precondition is that of a
    batched match: wherever last_access[v] > last_access[parent[v]], some walk starts at v with a
    stamp >= last_access[v] (a split head and its creator; elsewhere stamps do not decrease
    towards the root)."""
    where = "stamp_paths"
    check_tensor(where, "nodes", nodes, (torch.int64,))
    dev = check_launch_device(where, _stamp_paths_kernel, nodes)
    n = nodes.numel()
    check_tensor(where, "stamp", stamp, (torch.int64,), numel=n, device=dev)
    check_tensor(where, "parent", parent, (torch.int64,), device=dev)
    check_tensor(where, "last_access", last_access, (torch.int64,), numel=parent.numel(), device=dev)
    BLOCK, warps = _req_block(block)
    if n:
        _stamp_paths_kernel[grid_1d(n, BLOCK)](nodes, stamp, parent, last_access, n, BLOCK=BLOCK, num_warps=warps)


# ---- lock-aware evictable drops (R-RC-6, SPEC section 8) ------------------------------------------
@triton.jit
def _lock_first_kernel(parent_ptr, key_len_ptr, alive_ptr, last_ptr, cover_ptr, valid_ptr, f_ptr, key_ptr,
                       owner_ptr, key_off_ptr, m_ptr, pos_ptr, has_ptr, n, N, FROM_MATCH: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Per request: its path's start (its last node if covered whole, else that node's
    parent) and its partial-cover sort key (the node, or N when none); with FROM_MATCH the
    last node and cover come from the match (length m, last pool position pos: the node
    `owner` holds there, and how far into it); the cover and `has` (valid and m > 0) are
    written for the later launches (which read the node as the sort key). Then a walk from the
    start up through live parents with atomic_min of the request's index into f (F(v): the
    first request whose path holds node v), which stops at a node already holding a smaller
    index: that index's walk goes on up, so the nodes above end with a smaller minimum anyway."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    valid = mask & (tl.load(valid_ptr + offs, mask=mask, other=0) != 0)
    if FROM_MATCH:
        valid = valid & (tl.load(m_ptr + offs, mask=mask, other=0) > 0)
        p = tl.load(pos_ptr + offs, mask=valid, other=0)
        node = tl.load(owner_ptr + p, mask=valid, other=0)
        cover = tl.where(valid, p - tl.load(key_off_ptr + node, mask=valid, other=0) + 1, 0)
        ln = tl.where(valid, node, 0)
        tl.store(cover_ptr + offs, cover, mask=mask)
        tl.store(has_ptr + offs, valid.to(tl.uint8), mask=mask)
    else:
        ln = tl.load(last_ptr + offs, mask=mask, other=0)
        cover = tl.load(cover_ptr + offs, mask=mask, other=0)
    ln = tl.minimum(tl.maximum(tl.where(valid, ln, 0), 0), N - 1)
    full = valid & (cover >= tl.load(key_len_ptr + ln, mask=mask, other=0))
    partial = valid & ~full
    start = tl.where(full, ln, tl.load(parent_ptr + ln, mask=mask, other=-1))
    tl.store(key_ptr + offs, tl.where(partial, ln, N), mask=mask)
    cur = tl.where(valid & (start > 0), start, -1)
    active = mask & (cur >= 0)
    while tl.reduce(active.to(tl.int32), 0, _MAX) > 0:
        old = tl.atomic_min(f_ptr + cur, offs, mask=active)
        active = active & (old > offs)
        up = active & (tl.load(alive_ptr + cur, mask=active, other=0) != 0)
        cur = tl.load(parent_ptr + cur, mask=up, other=-1)
        active = up & (cur >= 0)


@triton.jit
def _lock_early_kernel(key_ptr, cover_ptr, f_ptr, mp_ptr, n, N, BLOCK: tl.constexpr):
    """mp[v] = the largest partial cover of node v by a request before F(v) (atomic_max)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = tl.load(key_ptr + offs, mask=mask, other=N)
    partial = mask & (key < N)
    early = partial & (offs < tl.load(f_ptr + key, mask=partial, other=0))
    tl.atomic_max(mp_ptr + key, tl.load(cover_ptr + offs, mask=early, other=0), mask=early)


@triton.jit
def _lock_gain_kernel(key_len_ptr, lock_ref_ptr, alive_ptr, f_ptr, mp_ptr, drop_ptr, N, INF, BLOCK: tl.constexpr):
    """Per node v (root excluded) alive, unlocked and on some request's whole-covered path:
    key_len - mp[v] added to the drop of F(v), its first such request (atomic_add)."""
    v = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = v < N
    f = tl.load(f_ptr + v, mask=mask, other=INF)
    ok = (mask & (v != 0) & (f < INF) & (tl.load(alive_ptr + v, mask=mask, other=0) != 0)
          & (tl.load(lock_ref_ptr + v, mask=mask, other=1) == 0))
    w = tl.load(key_len_ptr + v, mask=ok, other=0) - tl.load(mp_ptr + v, mask=ok, other=0)
    tl.atomic_add(drop_ptr + f, w, mask=ok)


@triton.jit
def _lock_partial_kernel(order_ptr, key_ptr, cover_ptr, valid_ptr, lock_ref_ptr, f_ptr, drop_ptr, out_ptr, n, N,
                         BLOCK: tl.constexpr):
    """One program over the requests sorted by (partial-cover node, index): each partial
    cover adds what it covers beyond the largest earlier partial cover of its node (a
    segmented exclusive running max: the segment number packed above the cover, so one plain
    running max, carried from block to block) when its node is unlocked and no earlier
    request covered the node whole; out = drop + that gain, 0 for a request without a match."""
    BIG: tl.constexpr = 1 << 32
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), 0)
    carry_grp = zero
    carry_run = zero
    for s in range(0, n, BLOCK):
        k = s + tl.arange(0, BLOCK).to(tl.int64)
        m = k < n
        has_prev = m & (k > 0)
        o = tl.load(order_ptr + k, mask=m, other=0)
        op = tl.load(order_ptr + k - 1, mask=has_prev, other=0)
        key = tl.load(key_ptr + o, mask=m, other=N)
        key_p = tl.load(key_ptr + op, mask=has_prev, other=-1)
        first = key != key_p
        grp = carry_grp + tl.cumsum(first.to(tl.int64), 0)
        prev_cover = tl.where(first | (key_p >= N), 0, tl.load(cover_ptr + op, mask=has_prev & ~first, other=0))
        v = tl.where(m, grp * BIG + prev_cover, 0)
        run = tl.maximum(tl.associative_scan(v, 0, _MAX), carry_run)
        excl = run - grp * BIG
        partial = m & (key < N)
        cover = tl.load(cover_ptr + o, mask=m, other=0)
        pok = partial & (tl.load(lock_ref_ptr + key, mask=partial, other=1) == 0) \
            & (tl.load(f_ptr + key, mask=partial, other=0) > o)
        gain = tl.where(pok, tl.maximum(cover - excl, 0), 0)
        valid = tl.load(valid_ptr + o, mask=m, other=0) != 0
        tl.store(out_ptr + o, tl.where(valid, tl.load(drop_ptr + o, mask=m, other=0) + gain, 0), mask=m)
        carry_grp = tl.reduce(tl.where(m, grp, 0), 0, _MAX)
        carry_run = tl.reduce(run, 0, _MAX)


def lock_drops(parent: torch.Tensor, key_len: torch.Tensor, lock_ref: torch.Tensor, alive: torch.Tensor,
               last_node: torch.Tensor, cover: torch.Tensor, valid: torch.Tensor, *,
               block: Optional[int] = None) -> torch.Tensor:
    """`gpu_sched.admission.lock_drops` (R-RC-6; SPEC section 8) in four launches and a sort:
    each request's path start and the first request per node by one atomic walk per request,
    the largest partial cover of each node before its first whole cover (atomic_max), each
    unlocked node's tokens added to its first request (atomic_add), then the partial covers'
    gains in one program over the requests sorted by node (`torch.sort`, stable). No host
    read. Node arrays int64 [N] (alive bool), N >= 1; requests int64 [Q] (valid bool);
    covers below 2^32. Returns int64 [Q]."""
    where = "lock_drops"
    dev, N, Q = _check_lock_args(where, parent, key_len, lock_ref, alive, last_node)
    check_tensor(where, "cover", cover, (torch.int64,), numel=Q, device=dev)
    check_tensor(where, "valid", valid, (torch.bool,), numel=Q, device=dev)
    return _lock_drops_launch(parent, key_len, lock_ref, alive, last_node, cover, valid, None, N, Q, block)


def lock_drops_matched(parent: torch.Tensor, key_len: torch.Tensor, lock_ref: torch.Tensor, alive: torch.Tensor,
                       owner: torch.Tensor, key_off: torch.Tensor, m: torch.Tensor, pos: torch.Tensor,
                       valid: torch.Tensor, *, block: Optional[int] = None) -> torch.Tensor:
    """`lock_drops` of requests given by their matches (`gpu_sched.admission.match_lock_drops`):
    request i holds a match when valid[i] and m[i] > 0, ending at pool position pos[i], in the
    node owner[pos[i]], pos[i] - key_off[node] + 1 tokens into it; read in the first launch
    (no tensor ops before it). Node arrays [N] as `lock_drops`; owner and key_off the tree's
    whole arrays (int64); m, pos int64 [Q], valid bool [Q]. Returns int64 [Q]."""
    where = "lock_drops_matched"
    dev, N, Q = _check_lock_args(where, parent, key_len, lock_ref, alive, m)
    check_tensor(where, "owner", owner, (torch.int64,), device=dev)
    check_tensor(where, "key_off", key_off, (torch.int64,), device=dev)
    check_tensor(where, "pos", pos, (torch.int64,), numel=Q, device=dev)
    check_tensor(where, "valid", valid, (torch.bool,), numel=Q, device=dev)
    cover = torch.empty(Q, dtype=torch.int64, device=dev)
    has = torch.empty(Q, dtype=torch.bool, device=dev)
    # the last node is read off the match in the first launch: `m` stands in for its column
    return _lock_drops_launch(parent, key_len, lock_ref, alive, m, cover, valid,
                              (owner, key_off, m, pos, has), N, Q, block)


def _check_lock_args(where, parent, key_len, lock_ref, alive, req):
    check_tensor(where, "parent", parent, (torch.int64,))
    dev = check_launch_device(where, _lock_first_kernel, parent)
    N = parent.numel()
    if N < 1:
        raise ValueError(f"{where}: the tree needs at least its root, got {N} nodes")
    for name, t in (("key_len", key_len), ("lock_ref", lock_ref)):
        check_tensor(where, name, t, (torch.int64,), numel=N, device=dev)
    check_tensor(where, "alive", alive, (torch.bool,), numel=N, device=dev)
    check_tensor(where, "requests", req, (torch.int64,), device=dev)
    return dev, N, req.numel()


@triton.jit
def _lock_init_kernel(f_ptr, mp_ptr, drop_ptr, N, Q, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    node = offs < N
    tl.store(f_ptr + offs, tl.zeros([BLOCK], tl.int64) + Q, mask=node)
    tl.store(mp_ptr + offs, tl.zeros([BLOCK], tl.int64), mask=node)
    tl.store(drop_ptr + offs, tl.zeros([BLOCK], tl.int64), mask=offs < Q)


def _lock_drops_launch(parent, key_len, lock_ref, alive, last_node, cover, valid, match, N: int, Q: int,
                       block: Optional[int]) -> torch.Tensor:
    dev = parent.device
    BLOCK, warps = _req_block(block)
    f = torch.empty(N, dtype=torch.int64, device=dev)
    mp = torch.empty(N, dtype=torch.int64, device=dev)
    drop = torch.empty(Q, dtype=torch.int64, device=dev)
    key = torch.empty(Q, dtype=torch.int64, device=dev)
    out = torch.empty(Q, dtype=torch.int64, device=dev)
    if Q == 0:
        return out
    NB, nwarps = block_config(block)
    # f = Q (no first request yet), mp = 0 per node, drop = 0 per request: one launch, not three fills
    _lock_init_kernel[grid_1d(max(N, Q), NB)](f, mp, drop, N, Q, BLOCK=NB, num_warps=nwarps)
    alive8, valid8 = alive.view(torch.uint8), valid.view(torch.uint8)
    owner, key_off, m, pos, has = match if match is not None else (parent, parent, last_node, last_node, valid)
    has8 = has.view(torch.uint8)  # the later launches' valid: written by the first from the matches
    _lock_first_kernel[grid_1d(Q, BLOCK)](parent, key_len, alive8, last_node, cover, valid8, f, key, owner, key_off,
                                          m, pos, has8, Q, N, FROM_MATCH=match is not None, BLOCK=BLOCK,
                                          num_warps=warps)
    valid8 = has8
    _lock_early_kernel[grid_1d(Q, BLOCK)](key, cover, f, mp, Q, N, BLOCK=BLOCK, num_warps=warps)
    _lock_gain_kernel[grid_1d(N, NB)](key_len, lock_ref, alive8, f, mp, drop, N, Q, BLOCK=NB, num_warps=nwarps)
    order = torch.sort(key, stable=True).indices
    SB, swarps = scan_config(Q, block)
    _lock_partial_kernel[(1,)](order, key, cover, valid8, lock_ref, f, drop, out, Q, N, BLOCK=SB, num_warps=swarps)
    return out


@triton.jit
def _path_counts_kernel(nodes_ptr, parent_ptr, cnt_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    cur = tl.load(nodes_ptr + offs, mask=mask, other=0)
    active = mask & (cur > 0)
    one = tl.full([BLOCK], 1, tl.int64)
    while tl.reduce(active.to(tl.int32), 0, _MAX) > 0:
        tl.atomic_add(cnt_ptr + cur, one, mask=active)
        cur = tl.load(parent_ptr + cur, mask=active, other=0)
        active = active & (cur > 0)


def path_counts(nodes: torch.Tensor, parent: torch.Tensor, *, block: Optional[int] = None) -> torch.Tensor:
    """int64 [N]: how many of the paths nodes[i]..root pass through each node, root (0)
    excluded; entries of `nodes` <= 0 contribute nothing."""
    where = "path_counts"
    check_tensor(where, "nodes", nodes, (torch.int64,))
    dev = check_launch_device(where, _path_counts_kernel, nodes)
    check_tensor(where, "parent", parent, (torch.int64,), device=dev)
    n = nodes.numel()
    BLOCK, warps = _req_block(block)
    cnt = torch.zeros(parent.numel(), dtype=torch.int64, device=dev)
    if n:
        _path_counts_kernel[grid_1d(n, BLOCK)](nodes, parent, cnt, n, BLOCK=BLOCK, num_warps=warps)
    return cnt


# ---- eviction ranking ----------------------------------------------------------------------------
@triton.jit
def _evict_rank_kernel(par_ptr, cnt_ptr, lastpos_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    par = tl.load(par_ptr + offs, mask=mask, other=0)
    tl.atomic_add(cnt_ptr + par, tl.full([BLOCK], 1, tl.int64), mask=mask)
    tl.atomic_max(lastpos_ptr + par, offs, mask=mask)


def evict_rank(par: torch.Tensor, num_nodes: int, *, block: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(count, last position) int64 [num_nodes]: for each node, how many entries of `par`
    (the parents of the sorted eviction candidates, each in [0, num_nodes)) name it, and the
    largest such position (-1 if none)."""
    where = "evict_rank"
    check_tensor(where, "par", par, (torch.int64,))
    dev = check_launch_device(where, _evict_rank_kernel, par)
    check_int(where, "num_nodes", num_nodes, lo=1, hi=2**62)
    n = par.numel()
    BLOCK, warps = block_config(block)
    cnt = torch.zeros(num_nodes, dtype=torch.int64, device=dev)
    lastpos = torch.full((num_nodes,), -1, dtype=torch.int64, device=dev)
    if n:
        _evict_rank_kernel[grid_1d(n, BLOCK)](par, cnt, lastpos, n, BLOCK=BLOCK, num_warps=warps)
    return cnt, lastpos
