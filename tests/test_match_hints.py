"""Checked match hints and paths read off a match (FlatRadixTree.check_matches, depth_hashes,
path_position, version), against a fresh search (`_find`) on random trees, before and after
the tree changes (inserts, evictions). GpuScheduler keeps each waiting request's match from
one step to the next and checks it with two lookups instead of searching again; these tests
pin the rule it relies on: a guess is accepted exactly when it is the match. On CUDA when it is
there; the lookups with backend torch and triton (the probe kernel)."""

import contextlib
import random

import numpy as np
import pytest
import torch

from gpu_sched import policy as P
from gpu_sched.radix import FlatRadixTree

CONFIGS = [(1, None), (1, 3), (4, None), (4, 2), (16, None), (16, 1)]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(page_size, chunk_pages, seed, dev=DEV):
    rng = random.Random(seed)
    tree = FlatRadixTree(page_size, max_nodes=4096, token_capacity=1 << 15, chunk_pages=chunk_pages, seed=seed,
                         device=dev)
    bases = [[rng.randrange(6) for _ in range(rng.randrange(1, 120))] for _ in range(12)]
    slot = 0
    for _ in range(40):
        b = bases[rng.randrange(len(bases))]
        seq = b[: rng.randrange(len(b) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(0, 40))]
        ns = rng.randrange(2)
        tree.insert(torch.tensor(seq, dtype=torch.int32, device=dev), torch.arange(slot, slot + len(seq), device=dev),
                    ns)
        slot += len(seq)
    return rng, tree, bases


def queries(rng, bases, n):
    out = []
    for _ in range(n):
        b = bases[rng.randrange(len(bases))]
        out.append((b[: rng.randrange(len(b) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(0, 30))],
                    rng.randrange(2)))
    return out


class Csr:
    """Queries in the CSR form `_find_csr` takes (token pool, chunk-hash pool, offsets)."""

    def __init__(self, tree, qs):
        lens = np.array([len(q) for q, _ in qs], dtype=np.int64)
        L = max(int(lens.max(initial=0)), 1)
        pad = torch.zeros((len(qs), L), dtype=torch.int32)
        for i, (q, _) in enumerate(qs):
            pad[i, : len(q)] = torch.tensor(q, dtype=torch.int32)
        pad = pad.to(DEV)
        self.lens = torch.from_numpy(lens).to(DEV)
        self.ns = torch.tensor([ns for _, ns in qs], dtype=torch.int64, device=DEV)
        ch = tree.prefix_hashes(pad, self.lens, self.ns, tree.C)
        cnt = lens // tree.C
        self.tok = pad[torch.arange(L, device=DEV)[None, :] < self.lens[:, None]]
        self.ch = ch[torch.arange(ch.shape[1], device=DEV)[None, :] < torch.from_numpy(cnt).to(DEV)[:, None]]
        self.toff = torch.from_numpy(np.cumsum(lens) - lens).to(DEV)
        self.coff = torch.from_numpy(np.cumsum(cnt) - cnt).to(DEV)
        self.cnt = torch.from_numpy(cnt).to(DEV)

    def find(self, tree, lengths=None, be="torch"):
        lengths = self.lens if lengths is None else lengths
        return tree._find_csr(self.tok, self.toff, lengths, lengths, self.ns, self.ch, self.coff, self.cnt,
                              int(self.cnt.max()) if self.cnt.numel() else 0, be)

    def hashes(self, tree, d):
        return tree.depth_hashes(self.tok, self.toff, self.ns, self.ch, self.coff, d)


def guesses(rng, m, lens, P):
    """Per query: its match, a page below/above, a random page-aligned depth, and bad values."""
    out = []
    for mi, L in zip(m.tolist(), lens.tolist()):
        out.append([mi, mi - P, mi + P, rng.randrange(L // P + 1) * P, -1, mi + 1 if P > 1 else L + P])
    return torch.tensor(out, dtype=torch.int64, device=DEV).T  # [6, B]


def check_all(tree, csr, g, h1, h2, be):
    m, pos = csr.find(tree)
    for k in range(g.shape[0]):
        ok, p = tree.check_matches(csr.lens, g[k], h1[k], h2[k], backend=be)
        want = g[k] == m
        assert torch.equal(ok, want), f"guess set {k}: accepted {ok.tolist()} != is-the-match {want.tolist()}"
        assert torch.equal(p[ok], torch.where(m > 0, pos, -1)[ok])
        assert bool((p[~ok] == -1).all())


@pytest.mark.parametrize("be", ["torch", "torch-forms", "triton"])
@pytest.mark.parametrize("page_size,chunk_pages", CONFIGS)
def test_check_matches_accepts_exactly_the_match(page_size, chunk_pages, be):
    if be == "torch-forms":  # on the CPU, the torch form rather than the numpy one
        with P.torch_forms():
            return check_matches_case(page_size, chunk_pages, "torch")
    check_matches_case(page_size, chunk_pages, be)


def check_matches_case(page_size, chunk_pages, be):
    rng, tree, bases = build(page_size, chunk_pages, seed=page_size * 10 + (chunk_pages or 0))
    qs = queries(rng, bases, 200)
    csr = Csr(tree, qs)
    m, _ = csr.find(tree)
    g = guesses(rng, m, csr.lens, page_size)
    hs = [csr.hashes(tree, torch.where((x >= 0) & (x % page_size == 0), x, 0)) for x in g]
    h1, h2 = torch.stack([h[0] for h in hs]), torch.stack([h[1] for h in hs])
    check_all(tree, csr, g, h1, h2, be)
    assert int((g[0] > 0).sum()) > 20  # the trees share prefixes with the queries
    # the tree changes under the kept hints: inserts extend some matches, evictions cut some
    v = tree.version
    for q, ns in qs[:30]:
        ext = q + [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
        tree.insert(torch.tensor(ext, dtype=torch.int32, device=DEV), torch.arange(len(ext), device=DEV) + 10**6, ns)
    assert tree.version != v
    m2, _ = csr.find(tree)
    assert bool((m2 != m).any())
    check_all(tree, csr, g, h1, h2, be)
    tree.evict(int(tree.evictable_size) // 2)
    m3, _ = csr.find(tree)
    assert bool((m3 != m2).any())
    check_all(tree, csr, g, h1, h2, be)


@pytest.mark.skipif(DEV.type != "cpu", reason="the scalar search is the CPU tree's")
@pytest.mark.parametrize("forms", ["numpy", "torch"])
@pytest.mark.parametrize("page_size,chunk_pages", CONFIGS)
def test_find_scalar_is_find_csr(page_size, chunk_pages, forms):
    """`_find_scalar` (one query, binary searches of scalar lookups) gives `_find_csr`'s
    matched length and position and `depth_hashes`' two hashes at that length, for queries
    cut at any length (what a capped match reads), short queries with no whole chunk (an
    empty chunk-hash pool) and empty ones (an empty token pool), on a tree before and after
    inserts and evictions; the array form on the CPU in its numpy and its torch form."""
    rng, tree, bases = build(page_size, chunk_pages, seed=7 + page_size * 10 + (chunk_pages or 0))
    qs = queries(rng, bases, 120) + [([rng.randrange(6) for _ in range(rng.randrange(tree.C))], 0) for _ in range(8)]
    csr = Csr(tree, qs)
    short = Csr(tree, qs[-8:])  # no whole chunk anywhere: the pool holds no chunk hash
    empty = Csr(tree, [([], 0), ([], 1)])  # no token at all: the window reads ones
    assert short.ch.numel() == 0 and empty.tok.numel() == 0
    cut = torch.tensor([rng.randrange(len(q) + 1) for q, _ in qs], dtype=torch.int64)
    hits = 0
    for step in range(3):
        for c, lengths in ((csr, None), (csr, cut), (short, None), (empty, None)):
            with contextlib.nullcontext() if forms == "numpy" else P.torch_forms():
                m, pos = c.find(tree, lengths)
                h1, h2 = c.hashes(tree, m)
            lens = (c.lens if lengths is None else lengths).tolist()
            tok, ch = c.tok.numpy(), c.ch.numpy()
            got = [tree._find_scalar(tok, ch, int(c.toff[i]), int(c.coff[i]), lens[i], int(c.ns[i]))
                   for i in range(len(lens))]
            want = list(zip(m.tolist(), pos.tolist(), h1.tolist(), h2.tolist()))
            assert got == want, (step, [(i, a, b) for i, (a, b) in enumerate(zip(got, want)) if a != b][:3])
            hits += int((m > 0).sum())
        if step == 0:  # longer matches for some queries
            for q, ns in qs[:30]:
                ext = q + [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
                tree.insert(torch.tensor(ext, dtype=torch.int32), torch.arange(len(ext)) + 10**6, ns)
        else:  # shorter ones
            tree.evict(int(tree.evictable_size) // 2)
    assert hits > 100


@pytest.mark.parametrize("page_size,chunk_pages", CONFIGS)
def test_path_position_is_the_capped_match(page_size, chunk_pages):
    rng, tree, bases = build(page_size, chunk_pages, seed=7 + page_size)
    qs = queries(rng, bases, 200)
    csr = Csr(tree, qs)
    m, pos = csr.find(tree)
    tree._apply(m, pos)  # splits: positions stay where they are
    d = torch.tensor([rng.randrange(x // page_size + 1) * page_size for x in m.tolist()], dtype=torch.int64,
                     device=DEV)
    d[:20] = m[:20]
    d[20:40] = 0
    want_m, want_pos = csr.find(tree, torch.minimum(csr.lens, d))  # a match capped at d
    assert torch.equal(want_m, d)
    want = torch.where(d > 0, want_pos, -1)
    on = d > 0
    node = torch.where(on, tree.owner[want.clamp(min=0)], 0)  # the node holding that token
    cover = torch.where(on, want - tree.key_off[node] + 1, 0)
    assert int((on & (cover < tree.key_len[node])).sum()) > 0  # some capped matches end inside a node
    assert int((on & (node != tree.owner[pos.clamp(min=0)])).sum()) > 5  # some climbed to an ancestor
    for forms in (contextlib.nullcontext, P.torch_forms):  # on the CPU: the numpy form, then torch's
        with forms():
            assert torch.equal(tree.path_position(m, pos, d), want)
            got = tree.path_position(m, pos, d, nodes=True)
        assert torch.equal(got[0], want)
        assert torch.equal(got[1], node)
        assert torch.equal(got[2], cover)


def test_version_moves_with_content_only():
    tree = FlatRadixTree(1, max_nodes=64, token_capacity=256, device=DEV)
    v0 = tree.version
    tree.insert(torch.arange(10, dtype=torch.int32, device=DEV), torch.arange(10, device=DEV), 0)
    v1 = tree.version
    assert v1 != v0
    t = torch.arange(5, dtype=torch.int32, device=DEV)[None]
    m, last = tree.match(t, torch.tensor([5], device=DEV), torch.tensor([0], device=DEV))  # splits the node
    tree.lock(last)
    tree.unlock(last)
    assert tree.version == v1
    tree.evict(3)
    assert tree.version != v1
    other = FlatRadixTree(1, max_nodes=64, token_capacity=256, device=DEV)
    assert other.version not in (v0, v1, tree.version)  # unique across trees


@pytest.mark.parametrize("page_size,chunk_pages", [(1, None), (4, 2), (16, 1)])
@pytest.mark.parametrize("log_max", [1 << 16, 64])
def test_change_log_keeps_exactly_the_unchanged_matches(page_size, chunk_pages, log_max, monkeypatch):
    """A match found at version v is kept without lookups when `unchanged` says neither of its
    hashes changed since: every kept row must still be the match with the same position, and
    every row whose match changed must be flagged. A short log (log_max) drops old entries:
    versions below its floor get None (checked by lookups instead). Compaction starts anew."""
    monkeypatch.setattr(FlatRadixTree, "CHANGE_LOG_MAX", log_max)
    rng, tree, bases = build(page_size, chunk_pages, seed=31 + page_size)
    qs = queries(rng, bases, 300)
    csr = Csr(tree, qs)
    v0 = tree.version
    m0, pos0 = csr.find(tree)
    h1, h2 = csr.hashes(tree, m0)
    assert tree.changed_since(v0).numel() == 0
    assert bool(tree.unchanged(tree.changed_since(v0), h1, h2).all())
    flagged_changed = 0
    for step in range(6):
        if step % 2 == 0:
            for q, ns in rng.sample(qs, 8):
                ext = q + [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
                tree.insert(torch.tensor(ext, dtype=torch.int32, device=DEV),
                            torch.arange(len(ext), device=DEV) + 10**6 + 100 * step, ns)
        else:
            tree.evict(int(tree.evictable_size) // 4)
        since = tree.changed_since(v0)
        if since is None:
            assert tree._log_floor > v0  # the short log no longer reaches v0
            break
        assert torch.equal(since, torch.sort(since).values)
        assert torch.equal(tree.changed_since(v0, limit=since.numel()), since)
        if since.numel():  # one hash past the limit: the caller looks its rows up instead
            assert tree.changed_since(v0, limit=since.numel() - 1) is None
        keep = tree.unchanged(since, h1, h2)
        m, pos = csr.find(tree)
        changed = (m != m0) | ((m > 0) & (pos != pos0))
        assert not bool((keep & changed).any()), "a kept match is no longer the match"
        flagged_changed += int(changed.sum())
        assert int((~keep).sum()) >= int(changed.sum())
    if log_max == 1 << 16:
        assert flagged_changed > 0 and since is not None
    else:
        assert since is None
    tree.compact()
    assert tree.changed_since(v0) is None and tree.changed_since(tree.version).numel() == 0
