"""FlatRadixTree (torch) against the reference radix cache, operation by operation (R-RC-1..7).

`test_random_operation_sequences`: 512 random sequences of 50 operations (8 page-size/chunk
configurations: page sizes 1, 4, 16, 64; x 64 lanes), small vocabularies so that prefixes
collide, two namespaces per sequence. The sequences of one configuration run as lanes of one
tree pair (`Lanes`): each round applies one operation of every lane (batched match + lock,
insert_many, batched unlock, one evict), which keeps the whole file near 30 s of one core.
Compared after every round: per-query match length and last node (by full prefix, not id),
each insert's present length, the evicted node order and values, the tree as a set of
(prefix, key length, lock_ref) triples, evictable/protected sizes, and both integrity checks.
tests/test_kernels_radix.py runs the same lanes with backend="triton".
"""

import collections
import contextlib
import copy
import random

import numpy as np
import pytest
import torch

from gpu_sched import policy as PM
from gpu_sched import radix as radix_module
from gpu_sched.radix import FlatRadixTree
from gpu_sched.reference.radix_cache import KVPool, RadixCache

NS_NAMES = [None, "ns1", "ns2"]


def ref_prefix(cache, node, prefixes=None):
    if prefixes is not None and id(node) in prefixes:
        return prefixes[id(node)]
    ns, toks = cache.node_prefix(node)
    return (NS_NAMES.index(ns) if node is not cache.root else 0, toks) if toks else (0, ())


def flat_prefix(tree, node):
    ns, toks = tree.node_prefix(int(node))
    return (ns, toks) if toks else (0, ())


def ref_triples(cache):
    out = set()
    for n in cache._nodes():
        if n is not cache.root:
            out.add((ref_prefix(cache, n), len(n.key), n.lock_ref))
    return out


def pad(queries):
    L = max([len(q) for q in queries] + [1])
    t = torch.full((len(queries), L), 0, dtype=torch.int32)
    for i, q in enumerate(queries):
        t[i, : len(q)] = torch.tensor(q, dtype=torch.int32)
    return t, torch.tensor([len(q) for q in queries], dtype=torch.int64)


class Pair:
    """The reference cache and the flat tree driven with the same operations."""

    def __init__(self, page_size, chunk_pages=None, seed=0, token_capacity=1 << 14):
        self.pool = KVPool(1 << 16)
        self.ref = RadixCache(self.pool, page_size)
        self.flat = FlatRadixTree(page_size, max_nodes=4096, token_capacity=token_capacity, chunk_pages=chunk_pages,
                                  seed=seed)
        self.P = page_size
        self.ref_locks, self.flat_locks = [], []

    def check(self):
        assert ref_triples(self.ref) == self.flat.triples()
        assert self.ref.evictable_size == int(self.flat.evictable_size)
        assert self.ref.protected_size == int(self.flat.protected_size)
        self.ref.check_integrity()
        self.flat.check_integrity()

    def match(self, queries, nss):
        want = []
        for q, ns in zip(queries, nss):
            m, node = self.ref.match_prefix(np.array(q, np.int32), NS_NAMES[ns])
            want.append((m, ref_prefix(self.ref, node)))
        t, lens = pad(queries)
        m, last = self.flat.match(t, lens, torch.tensor(nss))
        got = [(int(a), flat_prefix(self.flat, b)) for a, b in zip(m, last)]
        for i, (w, g) in enumerate(zip(want, got)):
            assert w == g, f"query {i}: reference {w[0]} {w[1][1][:8]}.. != flat {g[0]} {g[1][1][:8]}.."
        return [node for node in last.tolist()], want

    def insert(self, q, ns):
        slots = self.pool.alloc(len(q) // self.P * self.P)
        a = self.ref.insert(np.array(q, np.int32), slots, NS_NAMES[ns])
        self.pool.free(slots[:a])
        b = self.flat.insert(torch.tensor(q, dtype=torch.int32), torch.from_numpy(slots), ns)
        assert a == b

    def evict(self, n):
        ref_names = {id(x): ref_prefix(self.ref, x) for x in self.ref._nodes()}
        flat_names = {i: flat_prefix(self.flat, i) for i in torch.nonzero(self.flat.alive).flatten().tolist()}
        ev = self.ref.evict(n)
        got_ref = [ref_names[id(x)] for x in ev]
        res = self.flat.evict(n)
        got_flat = [flat_names[i] for i in res.nodes.tolist()]
        assert got_ref == got_flat
        assert res.num_tokens == sum(len(x.key) for x in ev)
        want_vals = np.concatenate([x.value for x in ev]) if ev else np.zeros(0, np.int64)
        assert np.array_equal(res.values.numpy(), want_vals)


def random_seq(rng, bases, vocab):
    base = bases[rng.randrange(len(bases))]
    cut = rng.randrange(len(base) + 1)
    return base[:cut] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]


# ---- lanes: many independent random operation sequences on one tree pair ---------------------------
def ns_id(name):
    return 0 if name is None else int(name[2:])


def ns_name(i):
    return None if i == 0 else f"ns{i}"


def ref_state(cache):
    """{id(node): name} and {(name, key length, lock_ref)} of the reference tree in one walk.
    A node's name is (namespace id, depth, chained hash of its full prefix): equal names mean
    equal prefixes (up to a 64-bit hash collision), at a cost linear in the tree's tokens."""
    names, triples = {id(cache.root): (0, 0, 0)}, set()
    stack = [(cache.root, 0, 0)]
    while stack:
        node, depth, h = stack.pop()
        for ch in node.children.values():
            key = tuple(ch.key.tolist())
            d, hh = depth + len(key), hash((h, key))
            nm = (ns_id(ch.ns), d, hh)
            names[id(ch)] = nm
            triples.add((nm, len(key), ch.lock_ref))
            stack.append((ch, d, hh))
    return names, triples


def flat_state(tree):
    """The same for a FlatRadixTree: {node id: name} and the triples (arrays read once)."""
    b = tree.node_bound()
    alive, parent, off, ln, lock, ns, start = (getattr(tree, a)[:b].tolist() for a in
                                               ("alive", "parent", "key_off", "key_len", "lock_ref", "ns", "start"))
    tok = tree.tok[: tree.top].tolist()
    names, chain, triples = {0: (0, 0, 0)}, {0: 0}, set()
    for n in sorted((i for i in range(1, b) if alive[i]), key=start.__getitem__):  # parents first
        key = tuple(tok[off[n] : off[n] + ln[n]])
        h = hash((chain[parent[n]], key))
        chain[n] = h
        nm = (ns[n], start[n] + ln[n], h)
        names[n] = nm
        triples.add((nm, ln[n], lock[n]))
    return names, triples


class Lane:
    """One random operation sequence: its own RNG, base strings (small vocabulary, so prefixes
    collide) and two namespaces; `locks` pairs the reference node with the flat node id."""

    def __init__(self, seed, page_size, ns_pair):
        self.rng = rng = random.Random(seed)
        self.vocab = rng.choice([2, 3, 5])
        P = page_size
        self.max_base = 60 if P == 1 else 6 * P
        self.max_tail = 12 if P == 1 else 2 * P
        self.bases = [[rng.randrange(self.vocab) for _ in range(rng.randrange(1, self.max_base))] for _ in range(4)]
        self.ns = ns_pair
        self.evict = (1, 40, 1) if P == 1 else (1, 10, P // 2)  # amount: randrange(a, b) * c tokens
        self.locks = []

    def seq(self):
        rng = self.rng
        base = self.bases[rng.randrange(len(self.bases))]
        cut = rng.randrange(len(base) + 1)
        return base[:cut] + [rng.randrange(self.vocab) for _ in range(rng.randrange(0, self.max_tail))]

    def draw(self):
        """(op, args) of this lane's next operation."""
        rng = self.rng
        op = rng.random()
        if op < 0.35:
            qs = [self.seq() for _ in range(rng.randrange(1, 7))]
            nss = [self.ns[rng.randrange(2)] for _ in qs]
            lock = rng.sample(range(len(qs)), min(len(qs), rng.choice([1, 1, 2]))) if rng.random() < 0.5 else []
            return "match", (qs, nss, lock)
        if op < 0.9 and self.locks and op >= 0.8:
            return "unlock", self.locks.pop(rng.randrange(len(self.locks)))
        if op < 0.9:
            return "insert", (self.seq(), self.ns[rng.randrange(2)])
        a, b, c = self.evict
        return "evict", rng.randrange(a, b) * c


class Lanes:
    """`n_lanes` independent operation sequences (lane l uses namespaces 2l and 2l + 1, so
    lanes share no node) driven side by side on one reference cache and one flat tree: each
    round applies one operation of every lane, the lanes' matches as one batched match (and
    their locks as one batched lock), their inserts as one `insert_many`, their unlocks as one
    batched unlock, their evictions as one evict of the summed amount (eviction is global: the
    LRU order spans the lanes); the reference does the same one request at a time in lane
    order. Compared after every round: each query's match length and last node (by prefix), each
    insert's present length, the evicted node order and values, the tree as (prefix, key length,
    lock_ref) triples, evictable/protected sizes and both trees' integrity checks. With `twin`,
    a torch-backend tree receives the same operations and must equal `flat` array by array."""

    def __init__(self, page_size, chunk_pages, n_lanes, seed, backend="torch", twin=None, device="cpu"):
        P = page_size
        self.P = P
        self.lanes = [Lane(seed * 100_003 + l, P, (2 * l, 2 * l + 1)) for l in range(n_lanes)]
        self.pool = KVPool(1 << 24)
        self.ref = RadixCache(self.pool, P)
        max_len = self.lanes[0].max_base + self.lanes[0].max_tail
        kw = dict(max_nodes=200 * n_lanes + 16, token_capacity=20 * max_len * n_lanes, device=device,
                  chunk_pages=chunk_pages, seed=seed)
        self.device = torch.device(device)
        self.flat = FlatRadixTree(P, backend=backend, **kw)
        self.twin = twin
        self.trees = [self.flat] + ([FlatRadixTree(P, backend="torch", **kw)] if twin else [])

    def _match_flat(self, qs, nss):
        t, lens = pad(qs)
        args = (t.to(self.device), lens.to(self.device), torch.tensor(nss, device=self.device))
        outs = [tree.match(*args) for tree in self.trees]
        if self.twin:
            self.twin(outs[0][0], outs[1][0], "matched (triton vs torch)")
            self.twin(outs[0][1], outs[1][1], "last node (triton vs torch)")
        return outs[0]

    def round(self):
        ref, flat = self.ref, self.flat
        ops = [(lane, *lane.draw()) for lane in self.lanes]
        # matches, then the locks of what some of them matched
        mq = [(lane, q, ns) for lane, op, a in ops if op == "match" for q, ns in zip(a[0], a[1])]
        if mq:
            want = []
            for _, q, ns in mq:
                m, node = ref.match_prefix(np.array(q, np.int32), ns_name(ns))
                want.append((m, node))
            m, last = self._match_flat([q for _, q, _ in mq], [ns for _, _, ns in mq])
            rn, _ = ref_state(ref)
            fn, _ = flat_state(flat)
            for i, ((wm, wnode), gm, gl) in enumerate(zip(want, m.tolist(), last.tolist())):
                assert (wm, rn[id(wnode)]) == (gm, fn[gl]), (
                    f"query {i} {mq[i][1][:12]}..: reference ({wm}, {rn[id(wnode)]}) != flat ({gm}, {fn[gl]})")
            lk = [(lane, q, ns) for lane, op, a in ops if op == "match" for k in a[2] for q, ns in [(a[0][k], a[1][k])]]
            if lk:
                rnodes = [ref.match_prefix(np.array(q, np.int32), ns_name(ns))[1] for _, q, ns in lk]
                _, fl = self._match_flat([q for _, q, _ in lk], [ns for _, _, ns in lk])
                for node in rnodes:
                    ref.inc_lock_ref(node)
                for tree in self.trees:
                    tree.lock(fl)
                for (lane, _, _), node, f in zip(lk, rnodes, fl.tolist()):
                    lane.locks.append((node, f))
        # inserts: one insert_many for all lanes
        ins = [a for _, op, a in ops if op == "insert"]
        if ins:
            slots = [self.pool.alloc(len(q) // self.P * self.P) for q, _ in ins]
            want = []
            for (q, ns), sl in zip(ins, slots):
                a = ref.insert(np.array(q, np.int32), sl, ns_name(ns))
                self.pool.free(sl[:a])
                want.append(a)
            toks = [torch.tensor(q, dtype=torch.int32) for q, _ in ins]
            vals = [torch.from_numpy(sl) for sl in slots]
            nss = [ns for _, ns in ins]
            got = [tree.insert_many(toks, vals, nss) for tree in self.trees]
            for g in got:
                assert g == want, f"present lengths {g} != reference {want}"
        # unlocks
        ul = [a for _, op, a in ops if op == "unlock"]
        if ul:
            for node, _ in ul:
                ref.dec_lock_ref(node)
            for tree in self.trees:
                tree.unlock(torch.tensor([f for _, f in ul], dtype=torch.int64, device=self.device))
        # one eviction of the summed amount
        n_ev = sum(a for _, op, a in ops if op == "evict")
        if n_ev:
            rn, _ = ref_state(ref)
            fn, _ = flat_state(flat)
            ev = ref.evict(n_ev)
            res = [tree.evict(n_ev) for tree in self.trees]
            got = [fn[i] for i in res[0].nodes.tolist()]
            assert [rn[id(x)] for x in ev] == got, "evicted nodes differ from the reference"
            assert res[0].num_tokens == sum(len(x.key) for x in ev)
            want_vals = np.concatenate([x.value for x in ev]) if ev else np.zeros(0, np.int64)
            assert np.array_equal(res[0].values.cpu().numpy(), want_vals), "evicted values differ"
            if self.twin:
                self.twin(res[0].nodes, res[1].nodes, "evicted nodes (triton vs torch)")
        self.check()

    def check(self):
        _, rt = ref_state(self.ref)
        _, ft = flat_state(self.flat)
        assert rt == ft, f"trees differ: {len(rt - ft)} reference-only, {len(ft - rt)} flat-only triples"
        assert self.ref.evictable_size == int(self.flat.evictable_size)
        assert self.ref.protected_size == int(self.flat.protected_size)
        self.ref.check_integrity()
        self.flat.check_integrity()


#: (page size, chunk pages) of the torch runs: 8 configurations x LANES sequences of 50 operations
TORCH_CONFIGS = [(1, None), (1, 1), (1, 3), (4, None), (4, 2), (16, None), (16, 2), (64, None)]
LANES = 64
ROUNDS = 50


@pytest.mark.parametrize("page_size,chunk_pages", TORCH_CONFIGS)
@pytest.mark.parametrize("walks", [True, False])
def test_random_operation_sequences(page_size, chunk_pages, walks, monkeypatch):
    """LANES random sequences x ROUNDS operations per configuration (512 in all), with the
    CPU's Python walks for small batches (applies without splits, stamps, locks; the default
    up to `radix.SCALAR_BATCH`; a single insert's search) and without them (every batch
    through the array forms)."""
    if not walks:
        monkeypatch.setattr(radix_module, "SCALAR_BATCH", -1)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lanes = Lanes(page_size, chunk_pages, LANES, seed=1000 * page_size + (chunk_pages or 0))
        for _ in range(ROUNDS):
            lanes.round()
    finally:
        torch.set_num_threads(n)


def test_page_size_short_query_matches_nothing():
    """R-RC-3: with P = 4 a 3-token run matches nothing and inserts nothing."""
    tree = FlatRadixTree(4, max_nodes=16, token_capacity=64)
    assert tree.insert(torch.tensor([1, 2, 3], dtype=torch.int32), torch.arange(3), 0) == 0
    t, lens = pad([[1, 2, 3]])
    m, last = tree.match(t, lens, torch.tensor([0]))
    assert int(m[0]) == 0 and int(last[0]) == 0
    assert tree.triples() == set()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_many_returns_present_lengths_in_every_wave(page_size):
    """`insert_many` returns each sequence's present length as an int (R-RC-5), on a CPU tree
    as in its torch form, where sequences sharing a first page go in waves of one (the host
    path of a lone sequence once returned its (length, position) pair there), with the same
    tree after."""
    P = page_size
    seqs = [[1] * P + [2] * P + [3] * P, [1] * P + [2] * P + [5] * P, [7] * P, [1] * P + [9] * P, [7] * P]
    toks = [torch.tensor(q, dtype=torch.int32) for q in seqs]
    vals = [torch.arange(len(q)) + 100 * i for i, q in enumerate(seqs)]
    host, tor = (FlatRadixTree(P, max_nodes=64, token_capacity=1024) for _ in range(2))
    got = host.insert_many(toks, vals, [0] * len(seqs))
    with PM.torch_forms():
        want = tor.insert_many(toks, vals, [0] * len(seqs))
    assert got == want == [0, 2 * P, 0, P, P] and all(type(x) is int for x in got)
    assert_same_tree(host, tor, "insert_many", layout=False)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("walks", [True, False])
def test_insert_finds_every_present_length(page_size, walks, monkeypatch):
    """A single insert's search (the scalar binary search on the CPU, the array rounds
    without the walks) returns the present length whatever it is: every page count of a
    sequence already cached, from none to all of it and one page short of the new sequence's
    end, whose last page alone is then entered."""
    if not walks:
        monkeypatch.setattr(radix_module, "SCALAR_BATCH", -1)
    P = page_size
    rng = np.random.default_rng(P)
    for pages in range(0, 12):
        tree = FlatRadixTree(P, max_nodes=64, token_capacity=1024)
        seq = rng.integers(0, 50, 12 * P).astype(np.int32)
        if pages:
            assert tree.insert(torch.from_numpy(seq[: pages * P]), torch.arange(pages * P), 0) == 0
        cached = pages  # pages of seq in the tree
        for extra in (0, 1, 2):  # re-insert as long as cached, one page longer, two pages longer
            n = min(12, cached + extra) * P
            got = tree.insert(torch.from_numpy(seq[:n]), torch.arange(n) + 10**4, 0)
            assert got == min(cached * P, n), (pages, extra, got)
            cached = max(cached, n // P)
        t, lens = pad([seq.tolist()])
        m, _ = tree.match(t, lens, torch.tensor([0]))
        assert int(m[0]) == cached * P
        tree.check_integrity()


def assert_same_tree(a: FlatRadixTree, b: FlatRadixTree, step, layout: bool = True) -> None:
    """Every array of two trees (token pool, node fields, hash table, sizes), their counters,
    free lists and change logs' hashes are equal. `layout=False`: the hash tables hold the
    same entries (`FlatRadixTree.entries`, deferred ones included, nothing entered), in any
    slots: a CPU tree's host inserts defer entries (`DEFER_ENTRIES`) where the array forms
    enter them all."""
    table = (lambda t: [t.hkeys, t.hvals]) if layout else (lambda t: [torch.from_numpy(t.entries())])
    for x, y in zip(a._node_arrays() + [a.alive, a.tok, a.val, a.hsh, a.owner, *table(a),
                                        a.evictable_size, a.protected_size],
                    b._node_arrays() + [b.alive, b.tok, b.val, b.hsh, b.owner, *table(b),
                                        b.evictable_size, b.protected_size]):
        assert torch.equal(x, y), step
    assert (a.top, a.clock, a.next_cid, a.next_order, a._free_nodes) == \
        (b.top, b.clock, b.next_cid, b.next_order, b._free_nodes), step
    assert [h.tolist() for _, h in a._log] == [h.tolist() for _, h in b._log], step


@pytest.mark.parametrize("defer", [False, True], ids=["entered", "deferred"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_single_insert_walk_writes_what_the_array_form_writes(page_size, defer, monkeypatch):
    """A single insert's host path (scalar search, leaf written through numpy views) leaves
    every array of the tree (token pool, node fields, hash table, sizes) and its change log
    exactly as the array path does, over inserts that extend, split and repeat cached
    sequences, interleaved with matches (stamps) and evictions, through a compaction of the
    small token pool. With its entries deferred (`DEFER_ENTRIES`: the walk instead of the
    hash search, one entry per new leaf) the table holds the same entries, and every node's
    first page end is in it (`check_integrity`)."""
    monkeypatch.setattr(FlatRadixTree, "DEFER_ENTRIES", defer)
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 0)  # defer even right after a flush
    P = page_size
    rng = np.random.default_rng(7 + P)
    trees = [FlatRadixTree(P, max_nodes=512, token_capacity=160 * P, seed=3) for _ in range(2)]
    bases = [rng.integers(0, 6, int(rng.integers(1, 16)) * P).astype(np.int32) for _ in range(6)]
    deferred = 0  # steps after which the host tree held deferred entries
    for step in range(120):
        b = bases[int(rng.integers(len(bases)))]
        seq = np.concatenate([b[: int(rng.integers(len(b) + 1))], rng.integers(0, 6, int(rng.integers(0, 3 * P)))])
        op = int(rng.integers(6))
        outs = []
        for k, tree in enumerate(trees):
            with monkeypatch.context() as mp:
                if k:  # the second tree: every batch through the array forms
                    mp.setattr(radix_module, "SCALAR_BATCH", -1)
                if op == 0 or int(tree.evictable_size) > 100 * P:
                    outs.append(tree.evict(int(tree.evictable_size) // 2).num_tokens)
                elif op == 1:
                    t, lens = pad([seq.tolist()])
                    outs.append(tree.match(t, lens, torch.tensor([0]))[0].tolist())
                else:
                    outs.append(tree.insert(torch.from_numpy(seq.astype(np.int32)), torch.arange(len(seq)) + step * 100,
                                            int(step % 2)))
        assert outs[0] == outs[1], (step, outs)
        deferred += trees[0]._pend_n > 0
        assert_same_tree(*trees, step, layout=not defer)
        if defer and step % 10 == 0:  # heads entered, then every entry (a flush)
            trees[0].check_integrity()
    trees[0].check_integrity()
    assert (deferred > 20) == defer, deferred


@pytest.mark.parametrize("defer", [False, True], ids=["entered", "deferred"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_host_compaction_moves_what_the_torch_form_moves(page_size, defer, monkeypatch):
    """A CPU tree's compaction runs on numpy views (`_compact_host`); its torch form
    (`_compact_torch`, the one a GPU tree runs) leaves every array the same (token pool, node
    offsets, the table's values, `hslot`), on a fragmented pool with live, evicted and split
    ranges; the compacted tree still matches every cached sequence. Deferred entries move
    with their pending marks (`hslot`) and stay deferred."""
    monkeypatch.setattr(FlatRadixTree, "DEFER_ENTRIES", defer)
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 0)  # defer even right after a flush
    P = page_size
    rng = np.random.default_rng(11 + P)
    tree = FlatRadixTree(P, max_nodes=256, token_capacity=400 * P, seed=5)
    seqs = []
    for k in range(40):
        base = seqs[int(rng.integers(len(seqs)))][: int(rng.integers(0, 12)) * P] if seqs and k % 3 else []
        seq = list(base) + rng.integers(0, 50, int(rng.integers(1, 10)) * P).tolist()
        seqs.append(seq)
        tree.insert(torch.tensor(seq, dtype=torch.int32), torch.arange(len(seq)) + 1000 * k, 0)
        if k % 7 == 6:
            tree.evict(int(tree.evictable_size) // 3)
    assert tree.top > sum(int(n) for n in tree.key_len[tree.alive])  # holes to close
    assert bool(tree._pend) == defer
    a, b, c, d = (copy.deepcopy(tree) for _ in range(4))
    a._compact_host()
    b._compact_torch()
    assert bool(a._pend) == defer and a._pend_n == b._pend_n
    assert np.array_equal(a.entries(), b.entries())  # before either table is read (a flush)
    assert_same_tree(a, b, "compact")
    d.compact()  # the host form, the change log started anew
    c._compact_host = None  # under `torch_forms()` compact() runs the torch form, CPU tree or not
    with PM.torch_forms():
        c.compact()
    assert_same_tree(c, d, "compact in torch_forms()")
    assert d._log == [] and d._log_floor == d.version
    assert torch.equal(a.hslot, b.hslot) and a._reuse == b._reuse == 0
    assert a.top == sum(int(n) for n in a.key_len[a.alive])
    a.check_integrity()
    want = b.match(*pad(seqs), torch.zeros(len(seqs), dtype=torch.int64))
    got = a.match(*pad(seqs), torch.zeros(len(seqs), dtype=torch.int64))
    assert [x.tolist() for x in got] == [x.tolist() for x in want]
    assert (got[0] > 0).any()


def test_freed_pool_ranges_are_reused_before_compacting(monkeypatch):
    """A full token pool takes the next free run of positions at or after the reuse cursor
    (evicted leaves' ranges) without moving a live token; only when no free run is left below
    the bump pointer does it compact. Matches and the pool's ownership stay right throughout."""
    compactions = []
    orig = FlatRadixTree.compact
    monkeypatch.setattr(FlatRadixTree, "compact", lambda self: (compactions.append(self.top), orig(self)))
    pr = Pair(1, token_capacity=64)
    t = pr.flat
    seqs = {k: [k * 100 + i for i in range(20)] for k in (1, 2, 3)}
    for k in (1, 2, 3):  # pool positions 0-19, 20-39, 40-59
        pr.insert(seqs[k], 0)
    pr.evict(20)  # the oldest leaf, seqs[1]: positions 0-19 freed
    pr.check()
    floor = t._log_floor
    pr.insert([400 + i for i in range(16)], 0)  # 60 + 16 > 64: the free run at 0
    node = int(t.owner[0])
    assert (int(t.key_off[node]), int(t.key_len[node])) == (0, 16) and compactions == []
    assert t._log_floor == floor  # nothing moved: the change log still reaches back
    assert int(t.owner[20]) != node and int(t.key_off[int(t.owner[20])]) == 20  # live ranges stayed
    pr.match([seqs[2] + [7], seqs[3], [400 + i for i in range(16)]], [0, 0, 0])
    pr.check()
    pr.insert([500 + i for i in range(3)], 0)  # 60 + 3 <= 64: past the bump pointer
    assert int(t.key_off[int(t.owner[60])]) == 60 and t.top == 63
    pr.insert([600 + i for i in range(4)], 0)  # 63 + 4 > 64: positions 16-19, the rest of the freed run
    assert int(t.key_off[int(t.owner[16])]) == 16 and int(t.owner[19]) == int(t.owner[16]) and compactions == []
    pr.check()
    pr.match([seqs[2], seqs[3], [400 + i for i in range(16)], [600, 601, 602, 603]], [0] * 4)
    pr.evict(3)  # the least recent leaf, [500, 501, 502]: 60-62 free, but 60-63 is not all below top
    assert int(t.owner[60]) == -1
    pr.insert([700 + i for i in range(4)], 0)  # no free run of 4 below top: compacts
    assert compactions == [63]
    pr.match([seqs[2], seqs[3], [600, 601, 602, 603], [700, 701, 702, 703]], [0] * 4)
    pr.check()


def test_a_free_run_behind_the_reuse_cursor_is_taken_before_compacting(monkeypatch):
    """A range freed behind the reuse cursor (after the cursor passed it) is found by a
    second sweep from the pool's start before the pool is compacted: the new leaf takes it,
    no live token moves, and the change log still reaches back."""
    compactions = []
    orig = FlatRadixTree.compact
    monkeypatch.setattr(FlatRadixTree, "compact", lambda self: (compactions.append(self.top), orig(self)))
    pr = Pair(1, token_capacity=64)
    t = pr.flat
    seq = {k: [k * 100 + i for i in range(n)] for k, n in ((1, 20), (2, 20), (3, 20), (4, 16), (5, 4), (6, 4))}
    for k in (1, 2, 3):  # positions 0-19, 20-39, 40-59
        pr.insert(seq[k], 0)
    pr.evict(20)  # seq 1: 0-19 free
    pr.insert(seq[4], 0)  # 0-15, the cursor at 16
    pr.insert(seq[5], 0)  # 60-63, past the bump pointer
    pr.insert(seq[6], 0)  # 16-19, the cursor at 20
    assert [int(t.key_off[int(t.owner[p])]) for p in (0, 60, 16)] == [0, 60, 16] and t._reuse == 20
    pr.match([seq[2], seq[3], seq[5], seq[6]], [0] * 4)  # seq 4 now the least recent leaf
    pr.evict(16)  # seq 4: 0-15 free, behind the cursor
    assert int(t.owner[0]) == -1 and compactions == []
    floor = t._log_floor
    pr.insert([700 + i for i in range(12)], 0)  # nothing free from 20 on: 0-11, found from the start
    node = int(t.owner[0])
    assert (int(t.key_off[node]), int(t.key_len[node])) == (0, 12) and compactions == [] and t._log_floor == floor
    pr.match([seq[2], seq[3], seq[5], seq[6], [700 + i for i in range(12)]], [0] * 5)
    pr.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_token_pool_random_sequences(page_size):
    """Random inserts, matches and evictions on a tree whose token pool is a few sequences
    long, so that it reuses freed ranges and compacts again and again: the same cache as the
    reference after every operation, and the pool's ownership consistent."""
    P = page_size
    rng = random.Random(P)
    cap = 48 * P
    pr = Pair(P, token_capacity=cap)
    bases = [[rng.randrange(5) for _ in range(rng.randrange(1, 12) * P)] for _ in range(5)]
    reused = compacted = 0
    for step in range(300):
        op = rng.randrange(5)
        if op == 0:
            pr.evict(rng.randrange(1, 16) * P)
        elif op == 1:
            qs = [random_seq(rng, bases, 5) for _ in range(rng.randrange(1, 4))]
            pr.match(qs, [0] * len(qs))
        else:
            q = random_seq(rng, bases, 5)
            live = int(pr.flat.evictable_size) + int(pr.flat.protected_size)
            if live + len(q) > cap:  # the reference's pool has room: keep the tree's within its own
                pr.evict(live + len(q) - cap)
            top, floor = pr.flat.top, pr.flat._log_floor
            pr.insert(q, 0)
            reused += pr.flat.top == top and pr.flat._log_floor == floor and pr.flat._reuse > 0
            compacted += pr.flat._log_floor != floor
        pr.check()
    assert reused > 10 and compacted > 3, (reused, compacted)


def test_host_deletion_reads_recorded_slots_until_another_form_inserts(monkeypatch):
    """A CPU tree's host form deletes entries at the slots its inserts recorded (`hslot`), not
    by probing; an insert through the torch form (which records no slots) turns that off, the
    deletions probe again, and the next rehash (every entry entered again by the host form)
    turns it back on. The tree equals the reference throughout (check_integrity also checks
    every recorded slot while they are in use)."""
    probes = []
    orig = FlatRadixTree._probe_host
    monkeypatch.setattr(FlatRadixTree, "_probe_host", lambda self, h: (probes.append(h.size), orig(self, h))[1])
    pr = Pair(1, token_capacity=256)
    t = pr.flat
    rng = random.Random(5)
    seqs = [[rng.randrange(1000) for _ in range(20)] for _ in range(8)]
    for q in seqs[:4]:
        pr.insert(q, 0)
    probes.clear()
    pr.evict(20)
    assert t._hslot_ok and probes == []  # tombstones written at the recorded slots
    pr.check()
    with PM.torch_forms():
        pr.insert(seqs[4], 0)
    assert not t._hslot_ok
    pr.evict(20)
    assert sum(probes) >= 20  # the slots are no longer trusted: probed
    pr.check()
    t._rehash(extra=t.hkeys.numel())  # the host form enters every live entry again (a larger table)
    assert t._hslot_ok
    pr.check()
    probes.clear()
    pr.evict(40)
    assert probes == []
    for q in seqs[5:]:
        pr.insert(q, 0)
    pr.match(seqs, [0] * len(seqs))
    pr.check()


def test_batched_match_splits_like_sequential():
    """R-RC-4 / SPEC 8: several queries cutting one node at different depths in one batch."""
    pr = Pair(1)
    pr.insert(list(range(20)), 0)
    qs = [list(range(12)) + [99], list(range(5)) + [98], list(range(12)) + [97], list(range(16)) + [1]]
    pr.match(qs, [0, 0, 0, 0])
    pr.check()
    pr.evict(100)
    pr.check()


def random_tree_and_nodes(rng: random.Random, seqs: int, n: int):
    """A tree of `seqs` random sequences (1-29 tokens over 4 ids, page size 1) and n live node
    ids drawn with repeats (int64 [n])."""
    tree = FlatRadixTree(1, max_nodes=16 * seqs, token_capacity=1 << 15)
    for i in range(seqs):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        tree.insert(torch.tensor(seq, dtype=torch.int32), torch.arange(i * 40, i * 40 + len(seq)), 0)
    live = torch.nonzero(tree.alive[: tree.node_bound()]).flatten().tolist()
    return tree, torch.tensor([rng.choice(live) for _ in range(n)], dtype=torch.int64)


@pytest.mark.parametrize("n", [5, 64, 65, 3000])
def test_stamp_paths_equals_a_walk_per_request(n):
    """`_stamp_paths` (a batch's LRU stamps up each path; large batches merged per start node
    first) against one walk per request to the root, with repeated start nodes: both the CPU's
    numpy walk and the torch walk of other devices."""
    rng = random.Random(n)
    tree, nodes = random_tree_and_nodes(rng, 60, n)
    base = int(tree.last_access[: tree.node_bound()].max()) + 1
    stamp = base + torch.randperm(n, generator=torch.Generator().manual_seed(n))  # distinct, as a batch's
    want = tree.last_access.clone()
    for v, s in zip(nodes.tolist(), stamp.tolist()):
        while v >= 0:
            want[v] = max(int(want[v]), s)
            v = int(tree.parent[v])
    before = tree.last_access.clone()
    tree._stamp_paths(nodes, stamp)  # on the CPU: the numpy walk
    assert torch.equal(tree.last_access, want)
    tree.last_access.copy_(before)
    tree._stamp_paths_walk(nodes, stamp)  # the torch ops other devices run
    assert torch.equal(tree.last_access, want)


def random_tree_of_sequences(rng: random.Random, n: int, max_len: int):
    """A page-size-1 tree of n random sequences (1..max_len - 1 tokens over 3 ids, so they share
    prefixes) and the sequences."""
    tree = FlatRadixTree(1, max_nodes=1024, token_capacity=1 << 14)
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]
    for i, seq in enumerate(seqs):
        tree.insert(torch.tensor(seq, dtype=torch.int32), torch.arange(i * max_len, i * max_len + len(seq)), 0)
    return tree, seqs


def pad_queries(qs):
    """(int32 tokens [B, L] zero-padded, int64 lengths [B], L) of token lists."""
    L = max(len(q) for q in qs)
    return (torch.tensor([q + [0] * (L - len(q)) for q in qs], dtype=torch.int32),
            torch.tensor([len(q) for q in qs], dtype=torch.int64), L)


def test_match_ends_host_equals_torch():
    """`_match_ends` (each match's last node and the matches ending inside a node) on numpy
    views (the CPU's path) equals its torch ops, for matches ending at node ends, inside
    nodes and empty ones; and against the definition."""
    rng = random.Random(11)
    tree, seqs = random_tree_of_sequences(rng, 50, 40)
    qs = [s[: rng.randrange(0, len(s) + 1)] + [rng.randrange(3)] * rng.randrange(3) for s in seqs * 4]
    tok, lens, L = pad_queries(qs)
    m, pos = tree._find(tok, lens, torch.zeros(len(qs), dtype=torch.int64))
    X, idx = tree._match_ends(m, pos)
    Xt, idxt = tree._match_ends(m, pos, host=False)
    assert torch.equal(X, Xt) and torch.equal(idx, idxt)
    owner, off, kl = tree.owner.tolist(), tree.key_off.tolist(), tree.key_len.tolist()
    want_x = [owner[p] if k > 0 else 0 for k, p in zip(m.tolist(), pos.tolist())]
    want_i = [i for i, (k, p, x) in enumerate(zip(m.tolist(), pos.tolist(), want_x)) if k > 0 and p - off[x] + 1 < kl[x]]
    assert X.tolist() == want_x and idx.tolist() == want_i
    assert 0 < len(want_i) < len(qs) and 0 in m.tolist()  # both kinds of ends, and empty matches


@pytest.mark.parametrize("arity", [1, 2, 15, 255])
def test_search_host_equals_torch(arity):
    """`_search` (per row the deepest present page end, by `arity`-point rounds) by the CPU's
    numpy rounds (`_search_host`) equals its torch rounds and the definition: rows with nothing
    present, rows present to their end, an empty bound, and bounds past the shared part."""
    rng = random.Random(arity)
    tree, seqs = random_tree_of_sequences(rng, 40, 60)
    qs = [s[: rng.randrange(0, len(s) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(4))] for s in seqs * 3]
    qs += [[7, 7], []]  # an absent first token, an empty query
    tok, lens, L = pad_queries(qs)
    h = tree.prefix_hashes(tok, lens, torch.zeros(len(qs), dtype=torch.int64), 1).reshape(-1)
    key = lambda rows, q: h[rows * L + q - 1]  # noqa: E731
    got = tree._search(lens, key, arity)
    with PM.torch_forms():
        want = tree._search(lens, key, arity)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    present = [next((d for d in range(len(q), 0, -1) if int(tree.lookup(h[i * L + d - 1 : i * L + d])) >= 0), 0)
               for i, q in enumerate(qs)]
    assert got[0].tolist() == present
    assert got[1].tolist() == [int(tree.lookup(h[i * L + d - 1 : i * L + d])) if d else -1 for i, d in enumerate(present)]
    kinds = {(d == 0, d == len(q)) for d, q in zip(present, qs)}
    assert {(True, False), (False, True), (False, False)} <= kinds


@pytest.mark.parametrize("n", [0, 1, 2, 40, 3000])
def test_path_nodes_host_equals_torch(n):
    """`_path_nodes` (the distinct nodes on lock holders' paths and how many paths pass each)
    by the CPU's numpy walk equals the torch walk and the definition; root entries and
    repeated holders included, both ways of counting (few paths: np.unique; many: bincount)."""
    rng = random.Random(n)
    tree, nodes = random_tree_and_nodes(rng, 400, n)
    u, c = tree._path_nodes(nodes)
    ut, ct = tree._path_nodes(nodes, host=False)
    assert torch.equal(u, ut) and torch.equal(c, ct) and u.dtype == c.dtype == torch.int64
    want = {}
    for v in nodes.tolist():
        while v > 0:
            want[v] = want.get(v, 0) + 1
            v = int(tree.parent[v])
    assert dict(zip(u.tolist(), c.tolist())) == want
    assert (0 < u.numel() * 16 < tree.node_bound()) == (n in (1, 2))  # the np.unique branch at n 2


@pytest.mark.parametrize("n", [5, 40, 3000])
def test_batched_lock_unlock_forms_agree(n):
    """A batched lock and unlock on a CPU tree (Python walks up to `SCALAR_BATCH` holders,
    numpy past it: `_lock_host`) leave the lock counts and the evictable / protected sizes the
    torch form leaves; an unlock below zero raises and changes nothing, in every form."""
    rng = random.Random(n)
    tree, nodes = random_tree_and_nodes(rng, 400, n)

    def state(t):
        return t.lock_ref.clone(), int(t.evictable_size), int(t.protected_size)

    twin, start, base = copy.deepcopy(tree), state(tree), copy.deepcopy(tree)
    tree.lock(nodes)
    with PM.torch_forms():
        twin.lock(nodes)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(state(tree), state(twin)))
    assert int(tree.protected_size) > 0
    for forms in (contextlib.nullcontext, PM.torch_forms):  # node ids as a numpy array and a list
        for ids in (nodes.numpy(), nodes.tolist()):
            other = copy.deepcopy(base)
            with forms():
                other.lock(ids)
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                       for a, b in zip(state(tree), state(other)))
            with forms():
                other.unlock(ids)
            assert torch.equal(state(other)[0], start[0]) and state(other)[1:] == start[1:]
    held = nodes[nodes > 0]
    for t, forms in ((tree, contextlib.nullcontext), (twin, PM.torch_forms)):
        before = state(t)
        with forms(), pytest.raises(RuntimeError, match="below zero"):
            t.unlock(torch.cat([held, held[:1]]))  # one path released once more than it was locked
        after = state(t)
        assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    tree.unlock(nodes)
    with PM.torch_forms():
        twin.unlock(nodes)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(state(tree), state(twin)))
    end = state(tree)
    assert torch.equal(end[0], start[0]) and end[1:] == start[1:]  # back where it started


def test_host_views_follow_the_tensors():
    """`FlatRadixTree._np`'s numpy views (made once per tensor) are views of the tree's current
    tensors: after `_rehash` makes a new hash table, and in a deep copy (its views are of its
    own tensors: a write through them changes the copy only); `host_int` reads the sizes."""
    tree = FlatRadixTree(1, max_nodes=64, token_capacity=256)
    seq = torch.arange(40, dtype=torch.int32)
    tree.insert(seq, torch.arange(40), 0)
    old = tree._np("hkeys")
    assert np.shares_memory(old, tree.hkeys.numpy())
    tree._rehash(extra=4 * tree.hkeys.numel())
    new = tree._np("hkeys")
    assert new.size == tree.hkeys.numel() > old.size and np.shares_memory(new, tree.hkeys.numpy())
    t, lens = pad([seq.tolist()])
    assert int(tree.match(t, lens, torch.tensor([0]))[0][0]) == 40  # lookups read the new table
    node = int(tree.owner[39])
    tree.lock([node])
    assert tree.host_int("evictable_size") == int(tree.evictable_size) == 0
    assert tree.host_int("protected_size") == int(tree.protected_size) == 40
    twin = copy.deepcopy(tree)
    for name in ("lock_ref", "evictable_size", "hkeys"):
        assert np.shares_memory(twin._np(name), getattr(twin, name).numpy())
        assert not np.shares_memory(twin._np(name), getattr(tree, name).numpy())
    twin.unlock([node])
    assert (int(twin.lock_ref[node]), twin.host_int("evictable_size")) == (0, 40)
    assert (int(tree.lock_ref[node]), tree.host_int("evictable_size")) == (1, 0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_apply_list_equals_apply(page_size):
    """`_apply_list` (a small admission window's matches as Python lists: Python walks with at
    most one split, `_apply` when matches end inside nodes at two or more positions, and
    `_apply_host` past SCALAR_BATCH)
    returns the last nodes `_apply`'s torch form returns on the same matches as tensors and
    leaves every array, the clock and the creation ids as it does, over batches without
    splits, with one split position (several rows ending there too), with more, and one past
    `SCALAR_BATCH`; `lock` of a list leaves what `lock` of the tensor leaves."""
    P = page_size
    rng = np.random.default_rng(page_size)
    tree = FlatRadixTree(P, max_nodes=1024, token_capacity=8192)
    seqs = [rng.integers(0, 3, int(rng.integers(1, 12)) * P).astype(np.int32) for _ in range(16)]
    for i, seq in enumerate(seqs):
        tree.insert(torch.from_numpy(seq), torch.arange(len(seq)) + 100 * i, 0)
    kinds = set()
    for trial in range(40):
        B = 40 if trial == 39 else int(rng.integers(1, 6))
        qs = [np.concatenate([seqs[int(rng.integers(len(seqs)))][: int(rng.integers(0, 12)) * P],
                              rng.integers(0, 3, int(rng.integers(0, 2 * P)))]) for _ in range(B)]
        t, lens = pad([q.tolist() for q in qs])
        m, pos = tree._find(t, lens, torch.zeros(B, dtype=torch.int64))
        if trial % 3 == 0:  # several rows ending at one interior position
            m, pos = m.repeat(2), pos.repeat(2)
        twin = copy.deepcopy(tree)
        nodes_before = int(tree.alive.sum())
        last = tree._apply_list(m.tolist(), pos.tolist())
        with PM.torch_forms():  # the batched form's rounds
            _, want = twin._apply(m, pos)
        assert isinstance(last, list) and last == want.tolist()
        kinds.add((min(int(tree.alive.sum()) - nodes_before, 2), m.numel() > radix_module.SCALAR_BATCH))
        for x, y in zip(tree._node_arrays() + [tree.alive, tree.owner], twin._node_arrays() + [twin.alive, twin.owner]):
            assert torch.equal(x, y)
        assert (tree.clock, tree.next_cid) == (twin.clock, twin.next_cid)
        tree.lock(last)
        twin.lock(want)
        assert torch.equal(tree.lock_ref, twin.lock_ref)
        assert (int(tree.evictable_size), int(tree.protected_size)) == (int(twin.evictable_size),
                                                                          int(twin.protected_size))
        tree.unlock(want)
    assert {(0, False), (1, False), (2, False), (1, True)} <= kinds or {(0, False), (1, False), (2, False), (2, True)} <= kinds


@pytest.mark.parametrize("page_size", [1, 4])
def test_apply_host_equals_apply(page_size):
    """`_apply_host` (numpy in and out) returns the last nodes `_apply`'s torch form returns and
    leaves every node array, the clock and the creation ids as it does: for batches past
    SCALAR_BATCH whose matches all end at node ends (its own numpy stamp walk), batches with
    splits (`_apply` handed its match ends) and batches of SCALAR_BATCH or fewer."""
    P = page_size
    rng = np.random.default_rng(7 + page_size)
    tree = FlatRadixTree(P, max_nodes=2048, token_capacity=16384)
    seqs = [rng.integers(0, 3, int(rng.integers(1, 12)) * P).astype(np.int32) for _ in range(24)]
    for i, seq in enumerate(seqs):
        tree.insert(torch.from_numpy(seq), torch.arange(len(seq)) + 100 * i, 0)
    S = radix_module.SCALAR_BATCH
    seen = set()
    for trial in range(36):
        B = S + 1 + int(rng.integers(0, 40)) if trial % 4 else int(rng.integers(1, S + 1))
        qs = [np.concatenate([seqs[int(rng.integers(len(seqs)))][: int(rng.integers(0, 12)) * P],
                              rng.integers(0, 3, int(rng.integers(0, 2 * P)))]) for _ in range(B)]
        t, lens = pad([q.tolist() for q in qs])
        m, pos = tree._find(t, lens, torch.zeros(B, dtype=torch.int64))
        if trial % 3:  # the splits these matches need, made first: then every one ends at a node end
            tree._apply(m, pos)
        twin = copy.deepcopy(tree)
        kind = "small" if B <= S else ("split" if twin._match_ends(m, pos)[1].numel() else "unsplit")
        got = tree._apply_host(m.numpy().copy(), pos.numpy().copy())
        with PM.torch_forms():
            _, want = twin._apply(m, pos)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.tolist() == want.tolist(), kind
        for x, y in zip(tree._node_arrays() + [tree.alive, tree.owner], twin._node_arrays() + [twin.alive, twin.owner]):
            assert torch.equal(x, y), kind
        assert (tree.clock, tree.next_cid) == (twin.clock, twin.next_cid), kind
        seen.add(kind)
    assert seen == {"small", "split", "unsplit"}, seen


@pytest.mark.parametrize("vocab, L", [(2**31, 2000), (50_000, 2000), (2**20, 10_000)],
                         ids=["int32-ids", "vocab-ids", "segments"])
@pytest.mark.parametrize("every", [1, 3, 64])
def test_prefix_hashes_host_equals_torch(every, vocab, L):
    """`prefix_hashes` on the CPU (numpy, both moduli in one array) equals its torch form, token ids up
    to 2^31 - 1 and large namespace ids included. Ids of a vocabulary's size take the host form's
    unreduced running sums, in segments of 2^32 // max id - 1 terms when the window is longer
    (ids up to 2^20 over 10k tokens: 3 segments)."""
    rng = np.random.default_rng(every)
    tree = FlatRadixTree(1, max_nodes=64, token_capacity=1 << 12)
    tok = torch.from_numpy(rng.integers(0, vocab, (6, L)).astype(np.int32))
    tok[0] = vocab - 1
    ns = torch.tensor([0, 1, 5, 2**20, 2**40, 7])
    got = tree.prefix_hashes(tok, None, ns, every)
    with PM.torch_forms():
        want = tree.prefix_hashes(tok, None, ns, every)
    assert got.shape == (6, L // every) and torch.equal(got, want)


@pytest.mark.parametrize("B", [1, 64, 700])  # 700 rows: over 4096 terms, the float mod's size
def test_chunk_page_hashes_host_equals_torch(B):
    """`_chunk_page_hashes` (the page-end hashes inside chunk lo of each CSR row) on the CPU
    (numpy, `_chunk_page_hashes_host`) equals its torch form, for chunks at the start (the
    namespace seed), inside and at the end of rows, and equals `prefix_hashes` there."""
    rng = np.random.default_rng(B)
    tree = FlatRadixTree(1, max_nodes=64, token_capacity=1 << 12, chunk_pages=8)
    lens = rng.integers(1, 300, B)
    tok = torch.from_numpy(rng.integers(0, 2**31, int(lens.sum())).astype(np.int32))
    toff = torch.from_numpy(np.cumsum(lens) - lens)
    ns = torch.from_numpy(rng.integers(0, 3, B))
    cnt = lens // tree.C
    L = int(lens.max())
    pad = torch.zeros((B, L), dtype=torch.int32)
    for i in range(B):
        pad[i, : lens[i]] = tok[int(toff[i]) : int(toff[i]) + int(lens[i])]
    full = tree.prefix_hashes(pad, torch.from_numpy(lens), ns, 1)  # every depth
    ch = torch.cat([full[i, tree.C - 1 :: tree.C][: cnt[i]] for i in range(B)])
    coff = torch.from_numpy(np.cumsum(cnt) - cnt)
    lo = torch.from_numpy(rng.integers(0, cnt + 1))
    got = tree._chunk_page_hashes(tok, toff, ns, ch, coff, lo)
    with PM.torch_forms():
        want = tree._chunk_page_hashes(tok, toff, ns, ch, coff, lo)
    assert torch.equal(got, want)
    for i in range(B):  # inside the row: the prefix hashes at those depths
        d = int(lo[i]) * tree.C + np.arange(1, tree.chunk_pages)
        ok = d <= lens[i]
        assert torch.equal(got[i][torch.from_numpy(ok)], full[i, d[ok] - 1])
    assert B == 1 or (bool((lo == 0).any()) and bool((lo > 0).any()))


@pytest.mark.parametrize("vocab", [2**31, 50_000], ids=["int32-ids", "vocab-ids"])
@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("every", [1, 3, 8, 16])
def test_chunk_hashes_flat_equal_padded_prefix_hashes(every, host, vocab):
    """`chunk_hashes_flat` (sequences end to end) gives `prefix_hashes`' values (padded batch,
    masked to each sequence's lengths // every), empty and short sequences and token ids up to
    int32's top included; more than 2^32 - 1 tokens are refused before anything is computed.
    On the CPU both forms: numpy's (`_chunk_hashes_flat_host`) and torch's. Token ids below a
    vocabulary's size take the host form's per-chunk sums of unreduced terms (every * max id
    < 2^32), ids up to 2^31 - 1 its per-chunk sums of terms reduced one by one."""
    with contextlib.nullcontext() if host else PM.torch_forms():
        _check_chunk_hashes_flat(every, vocab)


def _check_chunk_hashes_flat(every, vocab=2**31):
    rng = np.random.default_rng(every)
    tree = FlatRadixTree(page_size=1)
    for B in (0, 1, 7, 40):
        lens = rng.integers(0, 60, B)
        lens[: B // 4] = rng.integers(0, every, B // 4) if B else lens[:0]  # no whole chunk
        rng.shuffle(lens)  # sequences without a whole chunk anywhere in the batch
        seqs = [rng.integers(0, vocab - 1, int(n), dtype=np.int64).astype(np.int32) for n in lens]
        if B and len(seqs[-1]):
            seqs[-1][:1] = vocab - 1
        ns = rng.integers(0, 3, B)
        flat = torch.from_numpy(np.concatenate(seqs) if B else np.zeros(0, np.int32))
        got = tree.chunk_hashes_flat(flat, lens, ns, every)
        L = max([1, *lens.tolist()])
        pad = torch.zeros((B, L), dtype=torch.int32)
        for b, q in enumerate(seqs):
            pad[b, : len(q)] = torch.from_numpy(q)
        full = tree.prefix_hashes(pad, torch.from_numpy(lens), torch.from_numpy(ns), every)
        want = [full[b, : int(lens[b]) // every] for b in range(B)]
        want = torch.cat(want) if want else torch.zeros(0, dtype=torch.int64)
        assert got.dtype == torch.int64 and torch.equal(got, want), (every, B)
    three = torch.zeros(3, dtype=torch.int32)
    for lens, ns, what in (([2], [0], "sum to the 3"), ([4, -1], [0, 0], "min -1"), ([3], [0, 1], "2 namespaces")):
        with pytest.raises(ValueError, match=what):
            tree.chunk_hashes_flat(three, np.array(lens), np.array(ns), every)
    with pytest.raises(ValueError, match="every must be"):
        tree.chunk_hashes_flat(three, np.array([3]), np.array([0]), 0)
    big = torch.zeros(1, dtype=torch.int32).expand(2**32)  # no storage behind the 2^32 tokens
    with pytest.raises(ValueError, match="2\\^32"):
        tree.chunk_hashes_flat(big, np.array([2**32]), np.array([0]), every)


def _trees_and_sequences(P: int, seed: int, n_trees: int, steps: int = 150):
    """(twin trees, rng, iterator of (step, sequence)): sequences made of a prefix of one of
    six page-aligned bases (tokens 0..4) plus up to 2P random tokens, so they extend, repeat
    and end inside cached sequences or short of a page."""
    rng = np.random.default_rng(seed + P)
    trees = [FlatRadixTree(P, max_nodes=512, token_capacity=200 * P, seed=5) for _ in range(n_trees)]
    bases = [rng.integers(0, 5, int(rng.integers(1, 14)) * P).astype(np.int32) for _ in range(6)]

    def seqs():
        for step in range(steps):
            b = bases[int(rng.integers(len(bases)))]
            yield step, np.concatenate([b[: int(rng.integers(len(b) + 1))],
                                        rng.integers(0, 5, int(rng.integers(0, 2 * P)))])

    return trees, rng, seqs()


@pytest.mark.parametrize("walks", [True, False])
@pytest.mark.parametrize("defer", [False, True], ids=["entered", "deferred"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_host_match_and_eviction_equal_torch_forms(page_size, defer, walks, monkeypatch):
    """On a CPU tree, a single query's `match` (host chunk sums and scalar searches, then the
    walks) and `evict` (leaves removed in numpy: `_remove_host`, table tombstones at their
    recorded slots; rounds over up to `SCALAR_BATCH` unlocked leaves in Python,
    `_evict_scalar`, or without the walks in numpy) leave every array, the hash table, the
    sizes, the change log's hashes and the free list as their torch forms do, and return the
    same results: queries that split nodes, repeat, miss, or are shorter than a page, in two
    namespaces; evictions of part and all, leaves whose parents join the rounds. With
    deferred entries (`DEFER_ENTRIES`) the table holds the same entries."""
    if not walks:
        monkeypatch.setattr(radix_module, "SCALAR_BATCH", -1)
    monkeypatch.setattr(FlatRadixTree, "DEFER_ENTRIES", defer)
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 0)  # defer even right after a flush
    P = page_size
    trees, rng, seqs = _trees_and_sequences(P, 40, 2)
    kinds, deferred = set(), 0
    for step, seq in seqs:
        op = "evict" if rng.integers(4) == 0 or int(trees[0].evictable_size) > 120 * P else ("match", "insert", "insert")[int(rng.integers(3))]
        amount = int(rng.integers(1, 3)) * int(trees[0].evictable_size) // 2 + 1
        outs = []
        for k, tree in enumerate(trees):
            with PM.torch_forms() if k else contextlib.nullcontext():
                if op == "evict":
                    res = tree.evict(amount)
                    outs.append((res.nodes.tolist(), res.values.tolist(), res.num_tokens))
                elif op == "match":
                    t = torch.from_numpy(seq.astype(np.int32))[None]
                    outs.append(tuple(x.tolist() for x in tree.match(t, torch.tensor([len(seq)]), torch.tensor([step % 2]))))
                else:
                    outs.append(tree.insert(torch.from_numpy(seq.astype(np.int32)), torch.arange(len(seq)) + step * 100,
                                            step % 2))
        assert outs[0] == outs[1], (step, op, outs)
        deferred += trees[0]._pend_n > 0
        kinds.add((op, outs[0][0][0] > 0 if op == "match" else len(outs[0][0]) > 1 if op == "evict" else None))
        assert_same_tree(*trees, step, layout=not defer)
    assert {("match", True), ("match", False), ("evict", True)} <= kinds
    assert (deferred > 5) == (defer and walks), deferred  # without the walks inserts take the array form


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_kept_matches_checked_by_positions_on_a_deferring_tree(page_size, monkeypatch):
    """`check_matches` with the kept positions on a CPU tree with deferred entries
    (`_check_at_positions`: the kept position's prefix hash, the next page end in its node
    or a child's first page end by lookup; `_holds_at` row by row, the same answers) says ok
    exactly where the lookups (on a copy
    whose table holds every entry) say ok and the kept position still holds the match's
    last page end, with the same position: kept matches of queries over inserts that extend
    them (inside a node and at a node's end), evictions, splits, reused and compacted pool
    ranges, in two namespaces."""
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 0)  # defer even right after a flush
    P = page_size
    rng = np.random.default_rng(11 + P)
    tree = FlatRadixTree(P, max_nodes=512, token_capacity=300 * P, seed=5)
    bases = [rng.integers(0, 4, int(rng.integers(1, 12)) * P).astype(np.int32) for _ in range(5)]
    kept, seen = [], collections.Counter()
    for step in range(250):
        b = bases[int(rng.integers(len(bases)))]
        seq = np.concatenate([b[: int(rng.integers(len(b) + 1))],
                              rng.integers(0, 4, int(rng.integers(0, 3 * P)))]).astype(np.int32)
        ns = int(rng.integers(2))
        twin = copy.deepcopy(tree)
        ch = twin._chunk_hashes_flat_host(seq, np.array([len(seq)], dtype=np.int64), [ns], twin.C)
        g, pos, h1, h2 = twin._find_scalar(seq, ch, 0, 0, len(seq), ns)
        kept = (kept + [(len(seq), g, pos, h1, h2)])[-40:]
        op = int(rng.integers(6))
        if op == 0 and int(tree.evictable_size) > 0:
            tree.evict(int(rng.integers(1, int(tree.evictable_size) + 1)))
        elif op == 1:
            tree.match(torch.from_numpy(seq)[None], torch.tensor([len(seq)]), torch.tensor([ns]))  # splits
        elif op == 2 and step % 5 == 0:
            tree.compact()
            seen["compacted"] += 1
        elif len(seq) >= P and tree.top + len(seq) < tree.tok.numel():
            tree.insert(torch.from_numpy(seq), torch.arange(len(seq)) + step * 1000, ns)
        if not tree._pend:
            continue
        L, g, pos, h1, h2 = (torch.tensor(c) for c in zip(*kept))
        ok, at = tree.check_matches(L, g, h1, h2, positions=pos)
        assert tree._pend  # nothing entered
        look = copy.deepcopy(tree)
        ok_l, at_l = look.check_matches(L, g, h1, h2)  # its lookups enter every entry first
        p = pos.numpy()
        pc = np.clip(p, 0, tree.owner.numel() - 1)
        holds = (g.numpy() == 0) | ((p >= 0) & (tree.owner.numpy()[pc] >= 0) & (tree.hsh.numpy()[pc] == h1.numpy()))
        assert np.array_equal(ok.numpy(), ok_l.numpy() & holds), step
        assert np.array_equal(at.numpy()[ok.numpy()], at_l.numpy()[ok.numpy()]), step
        rows = list(zip(*(x.tolist() for x in (g, L // P * P, h1, h2, pos))))  # the same test row by row
        assert [tree._holds_at(*r) for r in rows] == list(zip(ok.tolist(), at.tolist())), step
        views = tuple(tree._mv(a) for a in ("owner", "hsh", "key_off", "key_len"))  # as `_ScalarMatcher` hands them
        assert [tree._holds_at(*r, views) for r in rows] == list(zip(ok.tolist(), at.tolist())), step
        seen["ok"] += int(ok.sum())
        seen["moved"] += int((ok_l.numpy() & ~holds).sum())
        gn, Lq = g.numpy(), L.numpy() // P * P
        for j in np.flatnonzero(holds & (gn > 0) & (gn + P <= Lq)).tolist():  # where the next page end was sought
            X = int(tree.owner[p[j]])
            inside = p[j] + P <= int(tree.key_off[X]) + int(tree.key_len[X]) - 1
            seen[("inside" if inside else "at a node end", bool(ok_l[j]))] += 1
    want = ["ok", "moved", "compacted", ("at a node end", False), ("at a node end", True)]
    want += [("inside", False), ("inside", True)] if P == 1 else []  # P = 4, 16: one of the two each
    for k in want:
        assert seen[k] > 0, (k, seen)
    assert seen[("inside", False)] + seen[("inside", True)] > 0, seen


@pytest.mark.parametrize("page_size,chunk_pages", [(1, None), (1, 3), (4, None), (4, 1), (16, None)])
@pytest.mark.parametrize("defer", [False, True], ids=["entered", "deferred"])
def test_walk_finds_what_the_hash_search_finds(page_size, chunk_pages, defer, monkeypatch):
    """`_walk_scalar` (a query's match by a walk on its tokens: a lookup per node, the rest of
    the node compared) gives the length and pool position `_find_scalar` (binary searches
    over the query's chunk and page hashes) gives, and the same hashes wherever the query's
    tokens reach (one page past a capped length too: a kept capped match is checked later
    against the whole fill), on a CPU tree under inserts, matches that split nodes,
    evictions (dead nodes, table tombstones) and locks, in two namespaces, for queries capped
    anywhere; from a start on the path too (an insert's locked prefix). With deferred entries
    (`DEFER_ENTRIES`: only each node's first page end in the table) the hash search runs on
    a copy, whose table reads enter them, and the walk on the tree that keeps them."""
    monkeypatch.setattr(FlatRadixTree, "DEFER_ENTRIES", defer)
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 0)  # defer even right after a flush
    P = page_size
    rng = np.random.default_rng(7 + P)
    tree = FlatRadixTree(P, max_nodes=512, token_capacity=400 * P, seed=5, chunk_pages=chunk_pages)
    bases = [rng.integers(0, 5, int(rng.integers(1, 14)) * P).astype(np.int32) for _ in range(6)]
    kinds = set()
    for step in range(300):
        b = bases[int(rng.integers(len(bases)))]
        seq = np.concatenate([b[: int(rng.integers(len(b) + 1))],
                              rng.integers(0, 5, int(rng.integers(0, 2 * P)))]).astype(np.int32)
        ns = int(rng.integers(2))
        L = int(rng.integers(len(seq) + 1)) if rng.integers(3) == 0 else len(seq)
        Lq = L // P * P
        src = copy.deepcopy(tree) if defer else tree
        ch = src._chunk_hashes_flat_host(seq, np.array([len(seq)], dtype=np.int64), [ns], src.C)
        want = src._find_scalar(seq, ch, 0, 0, L, ns)
        if tree._pend:
            kinds.add("pending")
        got = tree._walk_scalar(seq, L, ns)
        assert got[:2] == want[:2], (step, got, want)
        if want[0] > 0:  # from a present depth on the path (an insert's locked prefix): the same walk
            k = int(rng.integers(1, want[0] // P + 1)) * P
            at = tree._walk_scalar(seq, k, ns)
            assert at[0] == k, (step, at)
            assert tree._walk_scalar(seq, L, ns, (k, at[1])) == got, (step, k)
            kinds.add("from a start")
        assert tree._walk_scalar(seq.astype(np.int64), L, ns) == got, step  # tokens of another dtype
        if want[0] > 0:
            assert got[2] == want[2], (step, "hash at the length")
        if want[0] + P <= len(seq):
            assert got[3] == want[3], (step, "hash one page on")
            if want[0] + P > Lq:
                kinds.add("next page past the cap")
        kinds.add("root miss" if want[0] == 0 else "whole" if want[0] == Lq else "stops inside")
        op = int(rng.integers(5))
        if op == 0 and int(tree.evictable_size) > 0:
            tree.evict(int(rng.integers(1, int(tree.evictable_size) + 1)))
        elif op == 1:
            tree.match(torch.from_numpy(seq)[None], torch.tensor([len(seq)]), torch.tensor([ns]))  # splits
        elif len(seq) >= P and tree.top + len(seq) < tree.tok.numel():
            tree.insert(torch.from_numpy(seq), torch.arange(len(seq)) + step * 1000, ns)
    assert kinds == {"root miss", "whole", "stops inside", "next page past the cap", "from a start"} | (
        {"pending"} if defer else set()), kinds


def _no_tensor_apply(*args, **kwargs):
    raise AssertionError("insert_and_match on a CPU tree's host form called _apply (tensors per call)")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_insert_and_match_equals_insert_then_match(page_size):
    """`insert_and_match` (on a CPU tree: the match applied at the position the insert knows,
    no hashes or search) leaves every array, the hash table, sizes, clock and change log as
    `insert` followed by `match` of the same tokens does, in both forms, and returns the same
    present length, matched length and node: sequences new, extending, fully cached (ending
    inside a node: the insert splits it) or shorter than a page, in two namespaces, with
    evictions between. Half the calls carry the hint of a cached prefix (an earlier match of
    the sequence, made on every tree), to `insert_and_match` and to `insert` alike: the host
    path hashes and searches only after it, the torch form ignores it; a hint one page too
    deep for its node is ignored. The host path applies its match without `_apply` (whose
    tensors cost ~30 us a call more in a serving loop)."""
    P = page_size
    trees, rng, seqs = _trees_and_sequences(P, 60, 3)
    kinds = set()
    for step, seq in seqs:
        t, v, ns = torch.from_numpy(seq.astype(np.int32)), torch.arange(len(seq)) + step * 100, step % 2
        if rng.integers(5) == 0:
            for tree in trees:
                tree.evict(int(tree.evictable_size) // 2 + 1)
            continue
        hint = {}
        if rng.integers(2):
            for tree in trees:  # the same match (stamps, splits) on every tree
                m0, node0 = tree.match(t[None], torch.tensor([len(seq)]), torch.tensor([ns]))
            hint = dict(known=int(m0[0]) + P * int(rng.integers(6) == 0), known_node=int(node0[0]))
            kinds.add(("hint", hint["known"] > 0))
        trees[0]._apply = _no_tensor_apply  # the host path applies its one match by the walks
        try:
            outs = [trees[0].insert_and_match(t, v, ns, **hint)]
        finally:
            del trees[0]._apply
        with PM.torch_forms():
            outs.append(trees[1].insert_and_match(t, v, ns, **hint))
        present = trees[2].insert(t[: len(seq) // P * P], v[: len(seq) // P * P], ns, **hint)  # insert's hint too
        m, last = trees[2].match(t[None], torch.tensor([len(seq)]), torch.tensor([ns]))
        outs.append((present, int(m[0]), int(last[0])))
        assert outs[0] == outs[1] == outs[2], (step, outs)
        assert_same_tree(trees[0], trees[2], step)
        assert_same_tree(trees[1], trees[2], step)
        kinds.add((outs[0][1] > 0, outs[0][0] == outs[0][1]))
    assert kinds == {(True, True), (True, False), (False, True), ("hint", True), ("hint", False)}, kinds


def _first_entry(t) -> int:
    return int(torch.nonzero(t.hkeys >= 0)[0])


@pytest.mark.parametrize("corrupt, message", [
    (lambda t, v: t.nchild.__setitem__(v, t.nchild[v] + 1), "nchild mismatch"),
    (lambda t, v: t.alive.__setitem__(t.node_bound(), True), "at or above node_bound"),
    (lambda t, v: t.last_access.__setitem__(v, t.last_access[0] + 1), "stamp above parent's"),
    (lambda t, v: t.hkeys.__setitem__(int(torch.nonzero(t.hkeys >= 0)[0]), -1), "hash entries"),
    (lambda t, v: t.owner.__setitem__(int(torch.nonzero(t.owner < 0)[0]), v), "owned pool positions"),
    (lambda t, v: t.hslot.__setitem__(int(t.hvals[_first_entry(t)]), _first_entry(t) + 1), "hslot != an entry's slot"),
])
def test_check_integrity_catches_corruption(corrupt, message):
    """`check_integrity` (over the live ids below `node_bound()`, the whole table counted)
    passes on a sound tree and names what is wrong after one field is corrupted."""
    tree = FlatRadixTree(1, max_nodes=64, token_capacity=256)
    for seq in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8]):
        tree.insert(torch.tensor(seq, dtype=torch.int32), torch.arange(len(seq)), 0)
    tree.check_integrity()
    leaf = int(torch.nonzero(tree.alive[: tree.node_bound()] & (tree.nchild[: tree.node_bound()] == 0)).flatten()[-1])
    corrupt(tree, leaf)
    with pytest.raises(AssertionError, match=message):
        tree.check_integrity()


def test_scalar_walks_follow_a_rebuilt_hash_table():
    """The scalar walks read memoryviews of the tree's arrays (`FlatRadixTree._mv`, kept per
    tensor): after the hash table is rebuilt (`_rehash`, as a load past 3/4 does: new hkeys
    / hvals tensors, here twice as large) the scalar lookups and walks read the new table, as
    the array forms do, with views of the old one still held; a deep copy's views are its
    own."""
    rng = np.random.default_rng(5)
    tree = FlatRadixTree(1, max_nodes=512, token_capacity=2048)
    seqs = [rng.integers(0, 50, int(rng.integers(5, 60))).astype(np.int32) for _ in range(30)]

    def check(i, seq):
        h = tree.prefix_hashes(torch.from_numpy(seq)[None], torch.tensor([len(seq)]), torch.tensor([0]), 1)[0]
        assert tree._lookup_scalar(h.tolist()) == tree.lookup(h).tolist(), i
        assert tree._walk_scalar(seq, len(seq), 0)[:2] == (len(seq), int(tree.lookup(h[-1:])[0])), i

    for i, seq in enumerate(seqs[:15]):
        tree.insert(torch.from_numpy(seq), torch.arange(len(seq)) + i * 100, 0)
        check(i, seq)
    old_t, old_v, H = tree.hkeys, tree._mv("hkeys"), tree.hkeys.numel()
    tree._rehash(extra=H)
    assert tree.hkeys is not old_t and tree.hkeys.numel() > H and tree._mv("hkeys") is not old_v
    for i, seq in enumerate(seqs):
        if i >= 15:
            tree.insert(torch.from_numpy(seq), torch.arange(len(seq)) + i * 100, 0)
        check(i, seq)
    twin = copy.deepcopy(tree)
    assert twin._mv("hkeys") is not tree._mv("hkeys")
    for seq in seqs:
        assert twin._walk_scalar(seq, len(seq), 0) == tree._walk_scalar(seq, len(seq), 0)


def _keys_at_homes(rng, n, H, homes):
    """n distinct random int64 keys whose home slots lie in `homes` (contested slots)."""
    cand = torch.tensor(rng.sample(range(1, 1 << 62), 64 * H), dtype=torch.int64)
    ok = torch.isin(radix_module.home_slot(cand, H), torch.tensor(sorted(set(homes))))
    return cand[ok][:n]


@pytest.mark.parametrize("scalar_max", [0, 4, 32, 10_000])
def test_table_insert_scalar_rounds_leave_the_torch_forms_table(monkeypatch, scalar_max):
    """`_table_insert_host` hands its last rounds to `_table_rounds_scalar` once few keys are
    pending (`SCALAR_TABLE_ROUNDS`): at any threshold (0: numpy rounds only; 10,000: Python
    rounds only) the table is the torch form's, key for key and slot for slot, on a crowded
    table with tombstones and contested home slots; the recorded slots (`hslot`) are the
    entries' slots; and the probe limit raises in both, the table left as the torch form
    leaves it (claims of the keys placed before the limit)."""
    monkeypatch.setattr(radix_module, "SCALAR_TABLE_ROUNDS", scalar_max)
    rng = random.Random(scalar_max + 3)
    base = FlatRadixTree(1, max_nodes=4, token_capacity=1024, device="cpu")
    H = base.hkeys.numel()
    live = _keys_at_homes(rng, 300, H, [rng.randrange(H) for _ in range(40)])
    base._table_insert(live, torch.arange(300), "torch")
    base._table_delete(live[::3], "torch")  # tombstones inside the runs
    fresh = _keys_at_homes(rng, 250, H, [rng.randrange(H) for _ in range(60)])
    fresh = fresh[~torch.isin(fresh, live)]
    vals = torch.randperm(fresh.numel()) + 7  # distinct pool positions
    host, tor = copy.deepcopy(base), copy.deepcopy(base)
    host._table_insert(fresh, vals, "torch", positions=True)
    with PM.torch_forms():
        tor._table_insert(fresh, vals, "torch", positions=True)
    assert torch.equal(host.hkeys, tor.hkeys) and torch.equal(host.hvals, tor.hvals)
    slots = host._probe(fresh, "torch")
    assert (slots >= 0).all() and torch.equal(host.hslot[vals].long(), slots)
    assert host.lookup(fresh).tolist() == vals.tolist()
    # the probe limit: five keys on one home slot, two probes each
    tight = [FlatRadixTree(1, max_nodes=4, token_capacity=64, device="cpu", max_probe=2) for _ in range(2)]
    h = _keys_at_homes(rng, 5, tight[0].hkeys.numel(), [9])
    for t, form in zip(tight, (contextlib.nullcontext(), PM.torch_forms())):
        with pytest.raises(RuntimeError, match="probe limit"), form:
            t._table_insert(h, torch.arange(5), "torch")
    assert torch.equal(tight[0].hkeys, tight[1].hkeys)


def test_one_host_entry_takes_the_slot_the_rounds_give():
    """`_enter_one_host` (a host insert's one entry, in Python ints) puts each key where the
    torch form's rounds put it alone, on a crowded table with tombstones and contested home
    slots, keys one after another, through a rehash at the load limit; each key's slot is
    recorded at its pool position (`hslot`), and the probe limit raises as the rounds do."""
    rng = random.Random(5)
    base = FlatRadixTree(1, max_nodes=4, token_capacity=256, device="cpu")  # 512 slots
    H = base.hkeys.numel()
    live = _keys_at_homes(rng, 120, H, [rng.randrange(H) for _ in range(20)])
    base._table_insert(live, torch.arange(120), "torch", positions=True)
    base._table_delete(live[::3], "torch", pos=np.arange(0, 120, 3))  # tombstones inside the runs
    fresh = _keys_at_homes(rng, 200, H, [rng.randrange(H) for _ in range(30)])
    fresh = fresh[~torch.isin(fresh, live)][:90]  # keys are >= 0; the product wraps to either sign
    vals = torch.randperm(fresh.numel()) + 130  # distinct pool positions, apart from live's
    one, tor = copy.deepcopy(base), copy.deepcopy(base)
    for k, (h, v) in enumerate(zip(fresh.tolist(), vals.tolist())):
        if k == 60:  # as if tombstones had filled the table: both rehash before this key
            one._h_used = tor._h_used = 3 * H // 4
        one._enter_one_host(h, v)
        with PM.torch_forms():
            tor._table_insert(torch.tensor([h]), torch.tensor([v]), "torch", positions=True)
        assert torch.equal(one.hkeys, tor.hkeys) and torch.equal(one.hvals, tor.hvals) and one._h_used == tor._h_used
        assert one._h_used < 3 * H // 4  # rehashed at key 60
    at = [int(torch.nonzero(one.hkeys == h)[0]) for h in fresh.tolist()]
    assert one.hslot[vals].tolist() == at
    tight = [FlatRadixTree(1, max_nodes=4, token_capacity=64, device="cpu", max_probe=2) for _ in range(2)]
    h = _keys_at_homes(rng, 3, tight[0].hkeys.numel(), [9]).tolist()
    for t, enter in zip(tight, (lambda t, k, i: t._enter_one_host(k, i),
                                lambda t, k, i: t._table_insert(torch.tensor([k]), torch.tensor([i]), "torch"))):
        enter(t, h[0], 0)
        enter(t, h[1], 1)
        with pytest.raises(RuntimeError, match="probe limit"):
            enter(t, h[2], 2)
    assert torch.equal(tight[0].hkeys, tight[1].hkeys)


@pytest.mark.parametrize("page", [1, 4])
def test_cache_path_values_read_on_host_equal_the_reference(monkeypatch, page):
    """`DeviceRadixCache.path_values` (the KV slots of root..node, which `complete_prefill`
    copies into a request's KV) read on a CPU tree's views equals its tensor form and the
    reference cache's, for matches that end at, inside (after splits) and above leaves, in
    two namespaces."""
    from gpu_sched.device_cache import DeviceRadixCache

    rng = random.Random(page)
    ref, dev = RadixCache(KVPool(4096), page), DeviceRadixCache(KVPool(4096), page)
    seqs = []
    for k in range(12):
        base = seqs[rng.randrange(len(seqs))][: rng.randrange(0, 40)] if seqs else []
        q = base + [rng.randrange(50) for _ in range(rng.randrange(4, 30))]
        ns = "a" if k % 3 else None
        vals = np.arange(len(q), dtype=np.int64) + 100 * k
        assert ref.insert(np.array(q), vals, ns) == dev.insert(np.array(q), vals, ns)
        seqs.append(q)
    checked = 0
    for k, q in enumerate(seqs):
        for cut in (len(q), len(q) // 2, 3):
            ns = "a" if k % 3 else None
            (m1, n1), (m2, n2) = ref.match_prefix(np.array(q[:cut]), ns), dev.match_prefix(np.array(q[:cut]), ns)
            assert m1 == m2
            host = dev.path_values(n2)
            monkeypatch.setattr(dev.tree, "_on_cpu", False)  # the tensor form
            tensor = dev.path_values(n2)
            monkeypatch.setattr(dev.tree, "_on_cpu", True)
            assert host.tolist() == tensor.tolist() == ref.path_values(n1).tolist()
            assert len(host) == m2
            checked += m2 > 0
    assert checked > 20
    assert dev.path_values(None).size == 0 and dev.path_values(dev.root).size == 0


@pytest.mark.parametrize("scalar_max", [0, 3, 10_000])
def test_tombstone_runs_cleared_in_python_leave_the_torch_forms_table(monkeypatch, scalar_max):
    """Deleting entries clears the tombstone runs before the slots that became EMPTY; the
    host form walks the last few runs in Python (`_clear_runs_scalar`, at most
    `SCALAR_TABLE_ROUNDS` runs): at any threshold the table (EMPTY and TOMB slots alike) and
    the used count are the torch form's, over deletions that leave long runs (crowded home
    slots, deletions in random order, some wrapping past the table's end) and lookups still
    find every live key."""
    monkeypatch.setattr(radix_module, "SCALAR_TABLE_ROUNDS", scalar_max)
    rng = random.Random(scalar_max + 11)
    host = FlatRadixTree(1, max_nodes=4, token_capacity=1024, device="cpu", max_probe=512)
    H = host.hkeys.numel()
    homes = [rng.randrange(H) for _ in range(18)] + [H - 3, H - 1]  # runs across the end too
    keys = _keys_at_homes(rng, 300, H, homes)
    host._table_insert(keys, torch.arange(300), "torch")
    tor = copy.deepcopy(host)
    live = keys.tolist()
    rng.shuffle(live)
    long_runs = 0
    while live:
        k = rng.randrange(1, 40)
        dels, live = live[:k], live[k:]
        before = (host.hkeys == radix_module.EMPTY).sum().item()
        host._table_delete(torch.tensor(dels), "torch")
        with PM.torch_forms():
            tor._table_delete(torch.tensor(dels), "torch")
        assert torch.equal(host.hkeys, tor.hkeys) and host._h_used == tor._h_used
        long_runs += (host.hkeys == radix_module.EMPTY).sum().item() - before > len(dels) + 2  # earlier tombstones too
        if live:
            assert (host.lookup(torch.tensor(live)) >= 0).all()
    assert long_runs >= 3, long_runs  # deletions that cleared runs of earlier tombstones
    assert host._h_used == 0 and (host.hkeys == radix_module.EMPTY).all()
    # a run across the table's end: three keys homed at the last slot sit at H-1, 0, 1;
    # deleting H-1's and 0's leaves tombstones, deleting 1's clears 1, 0 and H-1
    wrap = _keys_at_homes(rng, 3, H, [H - 1])
    for t in (host, tor):
        t._table_insert(wrap, torch.arange(3), "torch")
    at = {int(s): k for k, s in zip(wrap.tolist(), host._probe(wrap, "torch"))}
    assert sorted(at) == [0, 1, H - 1]
    for slot in (H - 1, 0, 1):
        host._table_delete(torch.tensor([at[slot]]), "torch")
        with PM.torch_forms():
            tor._table_delete(torch.tensor([at[slot]]), "torch")
        assert torch.equal(host.hkeys, tor.hkeys) and host._h_used == tor._h_used
    assert host._h_used == 0 and (host.hkeys == radix_module.EMPTY).all()


@pytest.mark.parametrize("page_size", [1, 4])
def test_device_cache_present_len_walk_equals_the_hash_search(page_size):
    """`DeviceRadixCache.present_len` on a CPU tree walks the tree on the key's tokens
    (`_walk_scalar`); it gives the length the hash search (`_find`, the torch form) gives and
    the reference cache's, for keys that share prefixes with cached paths, end inside a node,
    inside a page, past every path, in another namespace or in one never seen."""
    from gpu_sched.device_cache import DeviceRadixCache

    rng = random.Random(page_size)
    ref = RadixCache(KVPool(4000), page_size)
    dev = DeviceRadixCache(KVPool(4000), page_size)
    base = [rng.randrange(6) for _ in range(40)]
    seqs = []
    for _ in range(30):
        s = base[: rng.randrange(len(base))] + [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        ns = rng.choice([None, None, "ns"])
        seqs.append((s, ns))
        ref.insert(np.array(s, dtype=np.int32), ref.pool.alloc, ns)  # slots from each pool: evictions free them
        dev.insert(s, dev.pool.alloc, ns)
    keys = [(s[:k], ns) for s, ns in seqs for k in (0, 1, len(s) // 2, len(s))]
    keys += [(s + [rng.randrange(6) for _ in range(7)], ns) for s, ns in seqs[:10]]
    keys += [([rng.randrange(6) for _ in range(rng.randrange(60))], ns) for ns in (None, "ns", "never") for _ in range(20)]
    for evict in (False, True):  # and again after LRU evictions (tombstones in the table, shorter paths)
        if evict:
            ref.evict(ref.evictable_size // 3)
            dev.evict(dev.evictable_size // 3)
        for key, ns in keys:
            walked = dev.present_len(key, ns)
            with PM.torch_forms():
                searched = dev.present_len(key, ns)
            assert walked == searched == ref.present_len(np.array(key, dtype=np.int32), ns), (key, ns, evict)


@pytest.mark.parametrize("page_size", [1, 4])
def test_deferred_entries_kept_through_walks_splits_evictions_and_compactions(page_size, monkeypatch):
    """A CPU tree whose deferred table entries (`DEFER_ENTRIES`) are never entered (only walks
    read its table: inserts, `insert_and_match`, `_walk_scalar`, one query's `match` (a walk
    while entries are deferred, then its splits), lock-free evictions, and compactions of a
    small pool) against a twin that enters every entry at once: the same results, node
    arrays, token pool and table entries (`entries`, deferred ones included) after every
    operation, each node's first page end in the table throughout, and the whole table equal
    once the deferred entries are entered (`check_integrity`)."""
    P = page_size
    trees, rng, seqs = _trees_and_sequences(P, 90, 2, steps=250)
    for t in trees:  # a small pool: compactions
        t.token_capacity = 120 * P
    compactions = []
    orig = FlatRadixTree.compact

    def compact(self):  # the deferred entries' list made anew from their moved marks
        compactions.append(bool(self._pend))
        orig(self)
        marked = np.flatnonzero(self._np("hslot") == radix_module.PENDING)
        assert np.array_equal(np.sort(np.concatenate(self._pend or [marked[:0]])), marked)

    monkeypatch.setattr(FlatRadixTree, "compact", compact)
    kinds = set()
    for step, seq in seqs:
        seq = seq.astype(np.int32)
        ns = step % 2
        op = int(rng.integers(6))
        amount = int(rng.integers(1, 3)) * int(trees[0].evictable_size) // 3 + 1
        outs = []
        for k, tree in enumerate(trees):
            with monkeypatch.context() as mp:
                mp.setattr(FlatRadixTree, "DEFER_ENTRIES", k == 0)
                mp.setattr(FlatRadixTree, "DEFER_AFTER", 0)
                if op == 0 or int(tree.evictable_size) > 90 * P:
                    res = tree.evict(amount)
                    outs.append((res.nodes.tolist(), res.values.tolist()))
                elif op == 1:
                    outs.append(tree._walk_scalar(seq, len(seq), ns))
                elif op == 5:  # one query's match: by the walk while entries are deferred, then its splits
                    outs.append([x.tolist() for x in tree.match(torch.from_numpy(seq)[None], torch.tensor([len(seq)]),
                                                                torch.tensor([ns]))])
                elif op == 2:
                    outs.append(tree.insert_and_match(torch.from_numpy(seq), torch.arange(len(seq)) + step * 100, ns))
                else:
                    outs.append(tree.insert(torch.from_numpy(seq), torch.arange(len(seq)) + step * 100, ns))
                if step % 20 == 19:  # besides those a full pool makes
                    tree.compact()
        assert outs[0] == outs[1], (step, op, outs)
        a = trees[0]
        if a._pend:
            kinds.add("deferred")
            ids = np.flatnonzero(a._np("alive")[: a.node_bound()])[1:]
            assert not (a._np("hslot")[a._np("key_off")[ids] + P - 1] == radix_module.PENDING).any(), step
            marked = np.flatnonzero(a._np("hslot") == radix_module.PENDING)  # each one listed (`_flush_pending`)
            assert np.isin(marked, np.concatenate(a._pend)).all(), step
        assert_same_tree(*trees, step, layout=False)
    assert "deferred" in kinds and any(compactions), (kinds, compactions)  # compacted with deferred entries
    for t in trees:
        t.check_integrity()
    assert_same_tree(*trees, "entered", layout=False)


def test_deferring_pauses_after_a_flush(monkeypatch):
    """A host insert defers entries only when no flush (a table read that entered deferred
    entries) came in the last `DEFER_AFTER` host inserts: where the table is read between
    most inserts (an lpm ordering at every step) every entry goes in at once."""
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 3)
    P = 1
    tree = FlatRadixTree(P, max_nodes=256, token_capacity=4000, seed=5)
    rng = np.random.default_rng(3)
    deferred = []
    for k in range(12):
        seq = torch.from_numpy(rng.integers(0, 1000, 20).astype(np.int32))
        tree.insert(seq, torch.arange(20) + 100 * k, 0)
        deferred.append(tree._pend_n > 0)
        if k == 2:
            tree.hkeys  # a read: the deferred entries entered
    # deferring from the start, paused for 3 inserts after the read, then again
    assert deferred == [True, True, True, False, False, False, True, True, True, True, True, True], deferred
    tree.check_integrity()


def test_a_flush_that_fails_keeps_the_rest_deferred(monkeypatch):
    """A table read whose flush stops at an error (the probe limit of a table too full) keeps
    the entries it did not enter deferred: the table's entries (`entries`) are what they
    were, and the next read enters them."""
    monkeypatch.setattr(FlatRadixTree, "DEFER_AFTER", 0)
    monkeypatch.setattr(FlatRadixTree, "FLUSH_BATCH", 8)
    tree = FlatRadixTree(1, max_nodes=256, token_capacity=4000, seed=5)
    rng = np.random.default_rng(4)
    for k in range(6):
        tree.insert(torch.from_numpy(rng.integers(0, 1000, 30).astype(np.int32)), torch.arange(30) + 100 * k, 0)
    before = tree.entries()
    assert tree._pend_n > 16
    calls = []
    orig = FlatRadixTree._table_insert

    def failing(self, *a, **k):  # the flush's second batch fails
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("prefix hash table: probe limit reached (table too full)")
        return orig(self, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(FlatRadixTree, "_table_insert", failing)
        with pytest.raises(RuntimeError, match="probe limit"):
            tree.hkeys
    assert tree._pend and np.array_equal(tree.entries(), before)
    tree.check_integrity()  # the rest entered now
    assert not tree._pend and np.array_equal(tree.entries(), before)


def test_device_cache_sizes_read_both_counters_as_the_reference_keeps_them(monkeypatch):
    """`DeviceRadixCache.sizes()` (the plan's evictable and protected sizes in one read) equals
    the two properties and the reference cache's counters after inserts, a lock and an
    eviction, on the CPU's views and in the one-copy form a GPU tree takes; a disabled cache
    has none."""
    from gpu_sched.device_cache import DeviceRadixCache

    ref, dev = RadixCache(KVPool(4096), 4), DeviceRadixCache(KVPool(4096), 4)
    rng = random.Random(5)
    for k in range(8):
        q = np.array([rng.randrange(6) for _ in range(rng.randrange(8, 60))])
        n1, n2 = ref.insert(q, ref.pool.alloc(q.size)), dev.insert(q, dev.pool.alloc(q.size))
        assert n1 == n2
    node_ref, node_dev = ref.match_prefix(q)[1], dev.match_prefix(q)[1]
    ref.inc_lock_ref(node_ref)
    dev.inc_lock_ref(node_dev)
    ref.evict(5)
    dev.evict(5)
    want = (ref.evictable_size, ref.protected_size)
    assert want[0] > 0 and want[1] > 0
    assert dev.sizes() == (dev.evictable_size, dev.protected_size) == want
    monkeypatch.setattr(dev.tree, "_on_cpu", False)  # the stacked read-back of a GPU tree
    got = dev.sizes()
    assert got == want and all(type(v) is int for v in got)
    assert DeviceRadixCache(KVPool(64), 1, disable=True).sizes() == (0, 0)
