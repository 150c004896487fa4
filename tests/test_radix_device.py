"""FlatRadixTree (torch) against the reference radix cache, operation by operation (R-RC-1..7).

Compared after every operation: per-query match length and last node (by full prefix, not id),
the tree as a set of (prefix, key length, lock_ref) triples, evictable/protected sizes, and the
evicted node order (by prefix).
"""

import random

import numpy as np
import pytest
import torch

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

    def __init__(self, page_size, chunk_pages=None, seed=0):
        self.pool = KVPool(1 << 16)
        self.ref = RadixCache(self.pool, page_size)
        self.flat = FlatRadixTree(page_size, max_nodes=4096, token_capacity=1 << 14, chunk_pages=chunk_pages, seed=seed)
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


@pytest.mark.parametrize("page_size,chunk_pages", [(1, None), (1, 1), (1, 3), (4, None), (4, 2), (16, None)])
def test_random_operation_sequences(page_size, chunk_pages):
    n_seq = 100 if page_size == 1 and chunk_pages is None else 30
    for s in range(n_seq):
        rng = random.Random(1000 * page_size + s)
        vocab = rng.choice([2, 3, 5])
        bases = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(4)]
        pr = Pair(page_size, chunk_pages, seed=s)
        for _ in range(50):
            op = rng.random()
            if op < 0.35:
                qs = [random_seq(rng, bases, vocab) for _ in range(rng.randrange(1, 7))]
                nss = [rng.randrange(2) for _ in qs]
                nodes, want = pr.match(qs, nss)
                if rng.random() < 0.5:
                    # lock what the last query matched (same node on both sides)
                    k = rng.randrange(len(qs))
                    m, node = pr.ref.match_prefix(np.array(qs[k], np.int32), NS_NAMES[nss[k]])
                    t, lens = pad([qs[k]])
                    _, fl = pr.flat.match(t, lens, torch.tensor([nss[k]]))
                    pr.ref.inc_lock_ref(node)
                    pr.flat.lock(fl)
                    pr.ref_locks.append(node)
                    pr.flat_locks.append(int(fl[0]))
            elif op < 0.7:
                pr.insert(random_seq(rng, bases, vocab), rng.randrange(2))
            elif op < 0.8 and pr.ref_locks:
                k = rng.randrange(len(pr.ref_locks))
                pr.ref.dec_lock_ref(pr.ref_locks.pop(k))
                pr.flat.unlock(torch.tensor([pr.flat_locks.pop(k)]))
            else:
                pr.evict(rng.randrange(1, 40))
            pr.check()


def test_page_size_short_query_matches_nothing():
    """R-RC-3: with P = 4 a 3-token run matches nothing and inserts nothing."""
    tree = FlatRadixTree(4, max_nodes=16, token_capacity=64)
    assert tree.insert(torch.tensor([1, 2, 3], dtype=torch.int32), torch.arange(3), 0) == 0
    t, lens = pad([[1, 2, 3]])
    m, last = tree.match(t, lens, torch.tensor([0]))
    assert int(m[0]) == 0 and int(last[0]) == 0
    assert tree.triples() == set()


def test_batched_match_splits_like_sequential():
    """R-RC-4 / SPEC 8: several queries cutting one node at different depths in one batch."""
    pr = Pair(1)
    pr.insert(list(range(20)), 0)
    qs = [list(range(12)) + [99], list(range(5)) + [98], list(range(12)) + [97], list(range(16)) + [1]]
    pr.match(qs, [0, 0, 0, 0])
    pr.check()
    pr.evict(100)
    pr.check()
