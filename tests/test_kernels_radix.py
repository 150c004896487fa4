"""Kernel tests of `gpu_sched.kernels.radix`: every checked launcher against the torch code of
`FlatRadixTree` that it replaces, at sizes 0, 1, BLOCK-1, BLOCK, BLOCK+1 and a larger batch;
exact integer equality with the first differing index in the message. Then the operation-sequence
differential test of tests/test_radix_device.py (512 sequences of 50 operations, page sizes 1, 4,
16, 64) with backend="triton", holding the triton tree equal to the reference cache and, array by
array, to a torch-backend twin.

Without CUDA the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
imported); with CUDA they are compiled and run on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import copy  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from gpu_sched import policy as P  # noqa: E402
from gpu_sched.kernels import radix as K  # noqa: E402
from gpu_sched import radix as radix_module  # noqa: E402
from gpu_sched.radix import EMPTY, TOMB, FlatRadixTree, home_slot  # noqa: E402

from test_radix_device import ROUNDS, Lanes, pad, random_seq  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (n, block): 0, 1, BLOCK-1, BLOCK, BLOCK+1 at the smallest block, and a larger batch at the default
SIZES = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (300, None)]
SIZE_IDS = [f"n{n}-b{b or 'default'}" for n, b in SIZES]
STATE = ("parent", "key_off", "key_len", "start", "lock_ref", "last_access", "cid", "order", "ns", "nchild",
         "alive", "tok", "val", "hsh", "owner", "hkeys", "hvals", "evictable_size", "protected_size")


def assert_equal(got, want, what):
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape:
        if torch.equal(got.cpu().to(torch.int64), want.cpu().to(torch.int64)):
            return
    got = [int(x) for x in (got.flatten().tolist() if isinstance(got, torch.Tensor) else got)]
    want = [int(x) for x in (want.flatten().tolist() if isinstance(want, torch.Tensor) else want)]
    assert len(got) == len(want), f"{what}: length {len(got)} != {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise AssertionError(f"{what}: first difference at index {i}: got {g}, want {w}")


def assert_same_state(a: FlatRadixTree, b: FlatRadixTree, what=""):
    for name in STATE:
        assert_equal(getattr(a, name), getattr(b, name), f"{what}{name}")
    scalars = ("clock", "next_cid", "next_order", "top", "_h_used")
    assert [getattr(a, k) for k in scalars] == [getattr(b, k) for k in scalars], f"{what}counters"
    assert a._free_nodes == b._free_nodes


def build_tree(page_size, n_seq, rng, chunk_pages=None, vocab=4, max_len=60, max_nodes=4096):
    tree = FlatRadixTree(page_size, max_nodes=max_nodes, token_capacity=1 << 14, device=DEV,
                         chunk_pages=chunk_pages, seed=rng.randrange(100))
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(6)]
    slot = 0
    for _ in range(n_seq):
        q = random_seq(rng, bases, vocab)
        tree.insert(torch.tensor(q, dtype=torch.int32), torch.arange(slot, slot + len(q)), rng.randrange(2))
        slot += len(q)
    return tree, bases


def test_kernels_run_where_expected():
    from gpu_sched.kernels._utils import is_interpreted

    assert is_interpreted(K._probe_kernel) == (not torch.cuda.is_available())


# ---- probe ------------------------------------------------------------------------------------------
def keys_with_homes(rng, n, H, homes):
    """n distinct random keys whose home slots all lie in `homes` (contested slots)."""
    cand = torch.tensor(rng.sample(range(1, 1 << 62), 64 * H), dtype=torch.int64)
    ok = torch.isin(home_slot(cand, H), torch.tensor(sorted(set(homes))))
    pool = cand[ok].tolist()
    assert len(pool) >= n
    return rng.sample(pool, n)


def small_table(rng, H=256, n_live=120, n_dead=30):
    """A table of power-of-two size with clustered keys (many share a home slot) and tombstones."""
    tree = FlatRadixTree(1, max_nodes=4, token_capacity=H // 2, device=DEV)
    assert tree.hkeys.numel() == H
    keys = keys_with_homes(rng, n_live + n_dead, H, [rng.randrange(H) for _ in range(12)])
    h = torch.tensor(keys, dtype=torch.int64, device=DEV)
    tree.max_probe = H  # long probe runs are the point here
    tree._table_insert(h, torch.arange(len(keys), device=DEV) * 7, "torch")
    tree._table_delete(h[:n_dead], "torch")
    return tree, keys


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("max_probe", [3, 12, 64])  # 12: a window cut short by the limit
@pytest.mark.parametrize("scalar", [True, False])
def test_probe(n, block, max_probe, scalar, monkeypatch):
    # the host form probes few keys in Python loops (`_probe_scalar`), more in numpy windows
    monkeypatch.setattr(radix_module, "PROBE_SCALAR_MAX", 1 << 30 if scalar else -1)
    rng = random.Random(n * 7 + max_probe)
    tree, keys = small_table(rng)
    tree.max_probe = max_probe
    pool = keys + [rng.randrange(1 << 40) for _ in range(40)] + [0]
    h = torch.tensor([rng.choice(pool) for _ in range(n)], dtype=torch.int64, device=DEV)
    slot, val = K.probe(h, tree.hkeys, tree.hvals, max_probe, block=block)
    assert_equal(slot, tree._probe(h, "torch"), "slot")  # on a CPU: its numpy form, `_probe_host`
    with P.torch_forms():  # and its torch form
        assert_equal(slot, tree._probe(h, "torch"), "slot (torch form)")
    assert_equal(val, tree.lookup(h, backend="torch"), "value")
    assert_equal(tree.lookup(h, backend="triton"), tree.lookup(h, backend="torch"), "lookup")


# ---- table insert -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_table_insert(n, block):
    rng = random.Random(n + 11)
    H = 2048
    a = FlatRadixTree(1, max_nodes=4, token_capacity=H // 2, device=DEV)
    live = [rng.randrange(1 << 40) for _ in range(200)]
    a._table_insert(torch.tensor(live, device=DEV), torch.arange(200, device=DEV), "torch")
    a._table_delete(torch.tensor(live[:50], device=DEV), "torch")
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    keys = keys_with_homes(rng, n, H, [rng.randrange(H) for _ in range(max(1, n // 3))])
    h = torch.tensor(keys, dtype=torch.int64, device=DEV)
    v = torch.arange(len(keys), dtype=torch.int64, device=DEV) + 1000
    a._table_insert(h, v, "torch")  # on a CPU: its numpy form, `_table_insert_host`
    with P.torch_forms():  # and its torch form: the same table
        c._table_insert(h, v, "torch")
    assert_equal(c.hkeys, a.hkeys, "hkeys (torch form)")
    assert_equal(c.hvals, a.hvals, "hvals (torch form)")
    claim = torch.full((H,), -1, dtype=torch.int64, device=DEV)
    ok, tag = K.table_insert(h, v, b.hkeys, b.hvals, claim, 5, b.max_probe, block=block)
    assert ok and tag >= 5 + len(keys)
    assert_equal(b.hkeys, a.hkeys, "hkeys")
    assert_equal(b.hvals, a.hvals, "hvals")
    assert_equal(b.lookup(h, backend="triton"), v, "lookup after insert")


def test_table_insert_contested_slot_goes_to_largest_index():
    tree = FlatRadixTree(1, max_nodes=4, token_capacity=64, device=DEV)
    H = tree.hkeys.numel()
    rng = random.Random(0)
    k5, k6 = keys_with_homes(rng, 3, H, [5]), keys_with_homes(rng, 1, H, [6])
    h = torch.tensor(k5 + k6, dtype=torch.int64, device=DEV)
    for be, host in (("torch", True), ("torch", False), ("triton", True)):
        t = copy.deepcopy(tree)
        with contextlib.nullcontext() if host else P.torch_forms():
            t._table_insert(h, torch.arange(4, device=DEV), be)
        # round 1: slot 5 <- key 2 (largest of 0, 1, 2), slot 6 <- key 3;
        # round 2: slot 7 <- key 1 (largest of 0, 1); round 3: slot 8 <- key 0
        assert t.hkeys[5:9].tolist() == [k5[2], k6[0], k5[1], k5[0]], (be, host)


def test_table_delete_clears_tombstones_that_end_a_run():
    """A deleted entry's tombstone turns back to EMPTY when the slot after it is EMPTY, and so
    in turn do the tombstones before it (none lies on a key's probe path); a tombstone with a
    live or tombstoned slot after it stays. Every form (host, torch, triton) leaves the same
    slots, counts the cleared slots out of the used ones, and still finds every live key."""
    base = FlatRadixTree(1, max_nodes=4, token_capacity=64, device=DEV)
    H = base.hkeys.numel()
    rng = random.Random(3)
    k = keys_with_homes(rng, 6, H, [10])  # one run: slots 10-15
    h = torch.tensor(k, dtype=torch.int64, device=DEV)
    base._table_insert(h, torch.arange(6, device=DEV), "torch")
    order = {key: int(torch.nonzero(base.hkeys == key)[0]) for key in k}  # key -> slot (10..15)
    by_slot = sorted(k, key=order.get)
    for be, host in (("torch", True), ("torch", False), ("triton", True)):
        t = copy.deepcopy(base)
        used = t._h_used
        with contextlib.nullcontext() if host else P.torch_forms():
            # slots 11 and 12: tombstones (a live key after them)
            t._table_delete(torch.tensor(by_slot[1:3], device=DEV), be)
            assert t.hkeys[10:17].tolist() == [by_slot[0], TOMB, TOMB] + by_slot[3:] + [EMPTY], (be, host)
            assert t._h_used == used
            # slot 15 ends the run (16 is EMPTY): it clears; 14 before it holds a live key
            t._table_delete(torch.tensor([by_slot[5]], device=DEV), be)
            assert t.hkeys[15].item() == EMPTY and t._h_used == used - 1, (be, host)
            # deleting 13 and 14 now clears 14, 13, and the tombstones at 12 and 11 before them
            t._table_delete(torch.tensor(by_slot[3:5], device=DEV), be)
            assert t.hkeys[10:16].tolist() == [by_slot[0]] + [EMPTY] * 5, (be, host)
            assert t._h_used == used - 5
            assert t.lookup(torch.tensor([by_slot[0]], device=DEV), backend=be).tolist() == [k.index(by_slot[0])]


@pytest.mark.parametrize("seed", range(4))
def test_table_delete_random_forms_agree_and_find_every_key(seed):
    """Random insert / delete rounds on a small, crowded table: the host, torch and triton forms
    leave the same table (tombstones cleared alike), and every live key is found, every deleted
    one absent."""
    rng = random.Random(seed)
    trees = [FlatRadixTree(1, max_nodes=4, token_capacity=128, device=DEV) for _ in range(3)]
    H = trees[0].hkeys.numel()
    homes = [rng.randrange(H) for _ in range(6)]
    pool = keys_with_homes(rng, 200, H, homes)
    live, vals = [], {}
    for r in range(30):
        if live and rng.random() < 0.5:
            dels = rng.sample(live, rng.randrange(1, len(live) + 1))
            for t, (be, host) in zip(trees, (("torch", True), ("torch", False), ("triton", True))):
                with contextlib.nullcontext() if host else P.torch_forms():
                    t._table_delete(torch.tensor(dels, dtype=torch.int64, device=DEV), be)
            live = [x for x in live if x not in dels]
        else:
            new = [x for x in rng.sample(pool, 12) if x not in live][: max(0, 90 - len(live))]
            for x in new:
                vals[x] = rng.randrange(1000)
            for t, (be, host) in zip(trees, (("torch", True), ("torch", False), ("triton", True))):
                if new:
                    with contextlib.nullcontext() if host else P.torch_forms():
                        t._table_insert(torch.tensor(new, dtype=torch.int64, device=DEV),
                                        torch.tensor([vals[x] for x in new], device=DEV), be)
            live += new
        for t in trees[1:]:
            assert_equal(t.hkeys, trees[0].hkeys, f"hkeys round {r}")
            assert t._h_used == trees[0]._h_used
        if live:
            assert trees[0].lookup(torch.tensor(live, device=DEV)).tolist() == [vals[x] for x in live]
        gone = [x for x in pool[:60] if x not in live]
        if gone:
            assert trees[0].lookup(torch.tensor(gone, device=DEV)).tolist() == [-1] * len(gone)


def test_table_insert_probe_limit():
    tree = FlatRadixTree(1, max_nodes=4, token_capacity=64, device=DEV, max_probe=2)
    h = torch.tensor(keys_with_homes(random.Random(1), 3, tree.hkeys.numel(), [3]), dtype=torch.int64, device=DEV)
    for be, host in (("torch", True), ("torch", False), ("triton", True)):
        with pytest.raises(RuntimeError, match="probe limit"), (contextlib.nullcontext() if host else P.torch_forms()):
            copy.deepcopy(tree)._table_insert(h, torch.arange(3, device=DEV), be)


# ---- find -------------------------------------------------------------------------------------------
def csr_args(tokens, lengths, ch):
    B, L = tokens.shape
    rows = torch.arange(B, dtype=torch.int64, device=DEV)
    return (tokens.reshape(-1), rows * L, torch.full((B,), L, device=DEV), lengths, ch.reshape(-1),
            rows * ch.shape[1], torch.full((B,), ch.shape[1], device=DEV))


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("page_size,chunk_pages", [(1, 3), (4, 2), (16, 1)])
def test_find(n, block, page_size, chunk_pages):
    rng = random.Random(n * 13 + page_size)
    tree, bases = build_tree(page_size, 25, rng, chunk_pages=chunk_pages, vocab=3)
    qs = [random_seq(rng, bases, 3) for _ in range(n)]
    tokens, lengths = pad(qs) if n else (torch.zeros((0, 1), dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    tokens, lengths = tokens.to(DEV), lengths.to(DEV)
    ns = torch.tensor([rng.randrange(2) for _ in range(n)], dtype=torch.int64, device=DEV)
    ch = tree.prefix_hashes(tokens, lengths, ns, tree.C)
    want_m, want_pos = tree._find(tokens, lengths, ns, ch, "torch")
    tok, ts, tspan, lens, chf, cs, cc = csr_args(tokens, lengths, ch)
    got_m, got_pos = K.find(tok, ts, tspan, lens, ns, chf, cs, cc, tree.hkeys, tree.hvals,
                            page_size=tree.P, chunk_pages=tree.chunk_pages, B1=tree.B1, B2=tree.B2,
                            max_probe=tree.max_probe, block=block)
    assert_equal(got_m, want_m, "matched")
    assert_equal(got_pos, want_pos, "position")
    if n >= 5:
        assert int(want_m.max()) > 0  # sanity: the queries reach into the tree


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_match_csr_equals_padded(backend):
    """CSR rows (sharing storage, no padding) match exactly like the padded batch."""
    rng = random.Random(5)
    a, bases = build_tree(1, 30, rng, chunk_pages=4, vocab=3)
    b = copy.deepcopy(a)
    uniq = [random_seq(rng, bases, 3) for _ in range(6)]
    pick = [rng.randrange(len(uniq)) for _ in range(20)]
    qs = [uniq[i] for i in pick]
    nss = [0] * len(qs)
    tokens, lengths = pad(qs)
    ma, la = a.match(tokens.to(DEV), lengths.to(DEV), torch.tensor(nss, device=DEV), backend=backend)
    # CSR: one copy of each distinct prompt, rows point into it
    pool = torch.tensor([t for q in uniq for t in q], dtype=torch.int32, device=DEV)
    starts = np.cumsum([0] + [len(q) for q in uniq])
    chs = [b.prefix_hashes(torch.tensor(q, dtype=torch.int32, device=DEV)[None],
                           torch.tensor([len(q)], device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV),
                           b.C)[0] for q in uniq]
    cstarts = np.cumsum([0] + [c.numel() for c in chs])
    ch_pool = torch.cat(chs)
    mb, lb = b.match_csr(pool, torch.tensor(starts[pick], device=DEV), lengths.to(DEV),
                         torch.tensor(nss, device=DEV), ch_pool, torch.tensor(cstarts[pick], device=DEV),
                         backend=backend)
    assert_equal(mb, ma, "matched")
    assert_equal(lb, la, "last node")
    assert_same_state(b, a)


# ---- split round -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_split_apply(n, block):
    """n leaves cut at covers around the fill block (BLOCK-1, BLOCK, BLOCK+1 tokens and others)."""
    rng = random.Random(n + 3)
    fill = block or K.FILL_BLOCK
    a = FlatRadixTree(1, max_nodes=2 * n + 2, token_capacity=64 + n * (max(fill, 40) + 2), device=DEV)
    for i in range(n):
        L = rng.choice([fill + 2, 3, 40]) if i < 20 else rng.choice([3, 40])  # a few long ones
        a.insert(torch.tensor([i] + [rng.randrange(5) for _ in range(L - 1)], dtype=torch.int32),
                 torch.arange(L) + 10 * i, 0)
    a.lock(torch.tensor([i + 1 for i in range(n) if i % 3 == 0], dtype=torch.int64))
    b = copy.deepcopy(a)
    piece = torch.tensor(rng.sample(range(1, n + 1), n), dtype=torch.int64, device=DEV)
    kl = a.key_len[piece].tolist()
    cover = torch.tensor([rng.choice([c for c in (1, fill - 1, fill, fill + 1, k // 2, k - 1) if 0 < c < k])
                          for k in kl], dtype=torch.int64, device=DEV)
    stamp = torch.tensor([rng.randrange(3) + a.clock for _ in range(n)], dtype=torch.int64, device=DEV)
    cid = torch.arange(n, dtype=torch.int64, device=DEV) + a.next_cid
    head = a._alloc_nodes(n)
    b._alloc_nodes(n)
    a._split_writes(piece, cover, stamp, cid, head, "torch")
    K.split_apply(piece, cover, stamp, cid, head, b._node_arrays(), b.alive, b.owner, block=block)
    assert_same_state(b, a)
    a._stamp_paths(head, stamp, "torch")  # what _apply does next; then the tree is consistent
    a.check_integrity()


# ---- stamps and lock counts ----------------------------------------------------------------------------
def deep_tree(rng, n_seq=40):
    tree, _ = build_tree(1, n_seq, rng, chunk_pages=2, vocab=3, max_len=50)
    return tree, torch.nonzero(tree.alive).flatten().tolist()


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_stamp_paths(n, block):
    rng = random.Random(n + 17)
    a, alive = deep_tree(rng)
    b = copy.deepcopy(a)
    nodes = torch.tensor([rng.choice(alive) for _ in range(n)], dtype=torch.int64, device=DEV)
    stamp = torch.tensor([a.clock + rng.randrange(1, 6) for _ in range(n)], dtype=torch.int64, device=DEV)  # ties
    # the plain definition: every node on every path takes the largest stamp through it
    want = a.last_access.tolist()
    parent = a.parent.tolist()
    for v, s in zip(nodes.tolist(), stamp.tolist()):
        while v >= 0:
            want[v] = max(want[v], s)
            v = parent[v]
    a._stamp_paths(nodes, stamp, "torch")
    K.stamp_paths(nodes, stamp, b.parent, b.last_access, block=block)
    assert_equal(a.last_access, want, "last_access (torch, early stops)")
    assert_equal(b.last_access, want, "last_access (triton)")


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_path_counts(n, block):
    rng = random.Random(n + 19)
    tree, alive = deep_tree(rng)
    nodes = torch.tensor([rng.choice(alive) for _ in range(n)], dtype=torch.int64, device=DEV)  # root included
    assert_equal(K.path_counts(nodes, tree.parent, block=block), tree._path_counts(nodes, "torch"), "count")


@pytest.mark.parametrize("n", [1, 17, 300])
def test_lock_unlock_triton_equals_torch(n):
    """`lock` / `unlock` with the triton backend (`FlatRadixTree._lock_dense`: path counts over
    the live ids, no compaction) leave the lock counts and the evictable / protected sizes the
    torch form leaves, repeated holders and the root among the nodes; an unlock below zero
    raises and changes nothing."""
    rng = random.Random(n + 29)
    a, alive = deep_tree(rng)
    b, start = copy.deepcopy(a), copy.deepcopy(a)
    nodes = torch.tensor([rng.choice(alive) for _ in range(n)], dtype=torch.int64, device=DEV)

    def state(t):
        return [t.lock_ref.tolist(), int(t.evictable_size), int(t.protected_size)]

    first = nodes[: max(1, n // 3)]  # locked before: the second lock finds some paths locked
    for batch in (first, nodes):
        with P.torch_forms():
            a.lock(batch, backend="torch")
        b.lock(batch, backend="triton")
        assert state(a) == state(b)
    held = nodes[nodes > 0]
    assert held.numel() and int(b.protected_size) > 0  # something was locked
    before = state(b)
    with pytest.raises(RuntimeError, match="below zero"):
        # every lock released, one path once more
        b.unlock(torch.cat([held, first, held[:1]]), backend="triton")
    assert state(b) == before
    half = nodes[: max(1, n // 2)]
    with P.torch_forms():
        a.unlock(half, backend="torch")
    b.unlock(half, backend="triton")
    assert state(a) == state(b)
    b.unlock(nodes[half.numel():], backend="triton")
    b.unlock(first, backend="triton")
    assert state(b) == state(start)  # back where it started


# ---- eviction ranking ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_evict_rank(n, block):
    rng = random.Random(n + 23)
    tree = FlatRadixTree(1, max_nodes=64, token_capacity=64, device=DEV)
    par = torch.tensor([rng.choice([0, 1, 5, 63, rng.randrange(64)]) for _ in range(n)], dtype=torch.int64, device=DEV)
    cnt, last = K.evict_rank(par, tree.max_nodes, block=block)
    # the plain definition over all node ids
    want_cnt, want_last = [0] * tree.max_nodes, [-1] * tree.max_nodes
    for i, p in enumerate(par.tolist()):
        want_cnt[p] += 1
        want_last[p] = i
    assert_equal(cnt, want_cnt, "count")
    assert_equal(last, want_last, "last position")
    # the torch code gives the same at the distinct parents (and nothing else)
    u, ucnt, ulast = tree._evict_rank(par, "torch")
    assert_equal(u, sorted(set(par.tolist())), "parents")
    assert_equal(ucnt, cnt[u], "count (torch)")
    assert_equal(ulast, last[u], "last position (torch)")
    u2, ucnt2, ulast2 = tree._evict_rank(par, "triton")
    assert_equal(u2, u, "parents (triton)")
    assert_equal(ucnt2, ucnt, "count (triton)")
    assert_equal(ulast2, ulast, "last position (triton)")


# ---- launcher checks ---------------------------------------------------------------------------------------
def test_launchers_check_arguments():
    t = FlatRadixTree(1, max_nodes=8, token_capacity=64, device=DEV)
    with pytest.raises(TypeError, match="probe: h must have dtype int64"):
        K.probe(torch.zeros(3, dtype=torch.int32, device=DEV), t.hkeys, t.hvals, 4)
    with pytest.raises(ValueError, match="power of two"):
        K.probe(torch.zeros(3, dtype=torch.int64, device=DEV), t.hkeys[:3], t.hvals[:3], 4)
    with pytest.raises(ValueError, match="contiguous"):
        K.path_counts(torch.zeros(6, dtype=torch.int64, device=DEV)[::2], t.parent)
    with pytest.raises(ValueError, match="stamp must have 2 elements"):
        K.stamp_paths(torch.zeros(2, dtype=torch.int64, device=DEV), torch.zeros(3, dtype=torch.int64, device=DEV),
                      t.parent, t.last_access)
    with pytest.raises(ValueError, match="backend must be one of"):
        FlatRadixTree(1, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        t.evict(1, backend="numpy")


# ---- whole-tree differential run with backend="triton" -------------------------------------------------------
#: (page size, chunk pages) x TRITON_LANES sequences of ROUNDS operations: 512 sequences with
#: CUDA; in Triton's CPU interpreter every kernel op is emulated in Python (a 32-lane run of one
#: configuration takes 15-25 s), so the default there is 32 sequences and
#: GPU_SCHED_TRITON_LANES=128 runs the full 512 (about 5 minutes on one core)
TRITON_CONFIGS = [(1, 4), (4, 2), (16, None), (64, None)]
TRITON_LANES = int(os.environ.get("GPU_SCHED_TRITON_LANES", "128" if torch.cuda.is_available() else "8"))


@pytest.mark.parametrize("page_size,chunk_pages", TRITON_CONFIGS)
def test_random_operation_sequences_triton(page_size, chunk_pages):
    """tests/test_radix_device.py's lanes (independent random operation sequences run side by
    side on one tree pair, compared with the reference after every round) with the flat tree
    on backend="triton", and a torch-backend twin that must stay equal to it array by array."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lanes = Lanes(page_size, chunk_pages, TRITON_LANES, seed=7000 + page_size, backend="triton",
                      twin=assert_equal, device=DEV)
        for r in range(ROUNDS):
            lanes.round()
            assert_same_state(lanes.flat, lanes.trees[1], f"round {r}: triton vs torch: ")
    finally:
        torch.set_num_threads(n)
