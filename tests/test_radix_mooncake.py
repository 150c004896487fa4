"""FlatRadixTree (torch backend) against the reference RadixCache on a real trace: the first
Mooncake conversation requests (512 tokens per hash id, derived from the id, so shared prefixes
are shared token runs), matched and then inserted one by one in arrival order. Per-request match
lengths, the cumulative hit tokens and the final trees (node by node) must be equal.

Sizes: page size 16 runs the first 1,500 requests (about 30 s of one core on the 2-core CI
machine, half of it the reference's own inserts; the first 3,000, 40.5M prompt tokens, took
55-80 s there). Page size 1 runs the first 300 (the CI
budget): with P = 1 every token is a page, so the flat tree keeps one hash-table entry per cached
token and its per-request insert is bound by random memory access into a large table.
"""

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_sched.radix import FlatRadixTree
from gpu_sched.reference.radix_cache import KVPool, RadixCache
from gpu_sched.sim.traces import BLOCK_TOKENS, read_mooncake

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
N_REQUESTS = 3000
#: requests replayed per page size (a prefix of the N_REQUESTS read)
REQUESTS_FOR_PAGE = {1: 300, 16: 1500}

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"Mooncake trace not found at {TRACE}")


@pytest.fixture
def one_thread():
    """One intra-op thread: every op here is small or memory-bound, and spinning worker threads
    only cost time when the CPUs are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def prompts():
    trace = read_mooncake(TRACE, limit=N_REQUESTS)
    assert len(trace) == N_REQUESTS
    reqs = trace.requests
    # an upper bound of the distinct tokens (every distinct hash id is at most one block)
    blocks = {h for r in reqs for h in r.hash_ids}
    return [r.prompt_ids() for r in reqs], len(blocks) * BLOCK_TOKENS


def ref_nodes(cache: RadixCache):
    """{(chained digest of the node's key path, key length, lock_ref)} of the reference tree."""
    out, stack = set(), [(cache.root, b"")]
    while stack:
        node, dig = stack.pop()
        for child in node.children.values():
            d = hashlib.sha1(dig + np.ascontiguousarray(child.key, np.int32).tobytes()).digest()
            out.add((d, len(child.key), child.lock_ref))
            stack.append((child, d))
    return out


def flat_nodes(tree: FlatRadixTree):
    """The same set for the flat tree (parents are shallower, so visit by depth)."""
    ids = torch.nonzero(tree.alive).flatten()
    ids = ids[ids != 0]
    ids = ids[torch.argsort(tree.start[ids], stable=True)].tolist()
    parent, off, ln, lock = (getattr(tree, a).tolist() for a in ("parent", "key_off", "key_len", "lock_ref"))
    tok = tree.tok.numpy()
    dig, out = {0: b""}, set()
    for n in ids:
        d = hashlib.sha1(dig[parent[n]] + tok[off[n] : off[n] + ln[n]].tobytes()).digest()
        dig[n] = d
        out.add((d, ln[n], lock[n]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_mooncake_prefix_hits_equal_reference(prompts, page_size, one_thread):
    toks, distinct = prompts
    toks = toks[: REQUESTS_FOR_PAGE[page_size]]
    P = page_size
    longest = max(len(t) for t in toks)
    pool = KVPool(distinct + longest)
    ref = RadixCache(pool, P)
    flat = FlatRadixTree(P, max_nodes=2 * len(toks) + 2, token_capacity=distinct + P, chunk_pages=None)
    ns = torch.zeros(1, dtype=torch.int64)
    hits_ref = hits_flat = 0
    for i, t in enumerate(toks):
        m_ref, _ = ref.match_prefix(t)
        tt = torch.from_numpy(np.array(t, dtype=np.int32))
        m_flat, _ = flat.match(tt[None], torch.tensor([len(t)]), ns)
        m_flat = int(m_flat[0])
        assert m_ref == m_flat, f"request {i}: reference matched {m_ref}, flat {m_flat} (of {len(t)} tokens)"
        hits_ref += m_ref
        hits_flat += m_flat
        slots = pool.alloc(len(t) // P * P)
        a = ref.insert(t, slots)
        pool.free(slots[:a])
        b = flat.insert(tt, torch.from_numpy(slots), 0)
        assert a == b == m_ref, f"request {i}: present {a} (reference) vs {b} (flat), matched {m_ref}"
    assert hits_ref == hits_flat
    # the trace shares a lot (sanity of the setup): 8% of the first 300 requests' tokens, 20%+ of 1,000 or more
    assert hits_ref > (0.2 if len(toks) >= 1000 else 0.05) * sum(len(t) for t in toks)
    assert ref.evictable_size == int(flat.evictable_size) and ref.protected_size == int(flat.protected_size)
    flat.check_integrity()
    ref.check_integrity()
    assert ref_nodes(ref) == flat_nodes(flat)
