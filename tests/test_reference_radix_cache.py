"""The reference radix prefix cache (SPEC.md R-RC-1..8, D4), on hand-built trees."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from gpu_sched.reference.radix_cache import KVPool, RadixCache


def T(*xs):
    return np.array(xs, dtype=np.int32)


def make(pool_size=64, P=1, disable=False):
    pool = KVPool(pool_size)
    return pool, RadixCache(pool, P, disable=disable)


def ins(cache, pool, toks, ns=None):
    """Insert with fresh slots for the new tail only (no duplicate KV to free)."""
    return cache.insert(T(*toks), pool.alloc, ns)


def kids(node):
    return list(node.children.values())


def prefix(cache, node):
    return list(cache.node_prefix(node)[1])


# ---- KV pool ------------------------------------------------------------------------------------
def test_kv_pool_alloc_free_and_errors():
    pool = KVPool(4)
    a = pool.alloc(3)
    assert sorted(a.tolist()) == [0, 1, 2] and pool.available == 1
    with pytest.raises(MemoryError, match="asked for 2 slots, 1 available"):
        pool.alloc(2)
    pool.free(a)
    assert pool.available == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(np.array([0], np.int64))
    with pytest.raises(ValueError):
        KVPool(-1)


# ---- R-RC-1 / R-RC-2 ------------------------------------------------------------------------------
def test_r_rc_1_root_and_node_fields():
    """R-RC-1: root has lock_ref 1 and no key; a node holds key, value (one slot per token),
    parent, children, lock_ref and a stamp."""
    pool, c = make()
    assert c.root.lock_ref == 1 and len(c.root.key) == 0 and c.root.parent is None
    ins(c, pool, [5, 6, 7])
    (leaf,) = kids(c.root)
    assert leaf.key.tolist() == [5, 6, 7] and len(leaf.value) == 3 and leaf.parent is c.root
    assert leaf.lock_ref == 0 and leaf.children == {}
    assert leaf.last_access == 1  # first call of the logical clock
    # the values are pool slots: 3 were taken
    assert pool.available == 61
    c.check_integrity()


def test_r_rc_2_child_keys_page_1_page_4_and_namespace():
    """R-RC-2: child-key is the first token (P == 1) or the first page (P > 1); the namespace
    joins the child-key at the root only."""
    pool, c = make()
    ins(c, pool, [5, 6, 7, 8], ns="ns")
    ins(c, pool, [5, 6, 9], ns="ns")  # splits [5,6,7,8] at 2
    (head,) = kids(c.root)
    assert list(c.root.children) == [("ns", 5)]
    assert list(head.children) == [7, 9]
    pool4, c4 = make(P=4)
    ins(c4, pool4, [1, 2, 3, 4, 5, 6, 7, 8])
    ins(c4, pool4, [1, 2, 3, 4, 9, 9, 9, 9])
    (h4,) = kids(c4.root)
    assert list(c4.root.children) == [(None, T(1, 2, 3, 4).tobytes())]
    assert list(h4.children) == [T(5, 6, 7, 8).tobytes(), T(9, 9, 9, 9).tobytes()]
    c.check_integrity()
    c4.check_integrity()


def test_r_rc_2_namespaces_never_share():
    """R-RC-2: the same tokens in different namespaces are different paths."""
    pool, c = make()
    assert ins(c, pool, [1, 2, 3], ns="a") == 0
    assert c.match_prefix(T(1, 2, 3), None)[0] == 0
    assert c.match_prefix(T(1, 2, 3), "b")[0] == 0
    assert c.match_prefix(T(1, 2, 3), "a")[0] == 3
    assert ins(c, pool, [1, 2, 3], ns="b") == 0  # nothing present in "b"
    assert ins(c, pool, [1, 2, 3]) == 0  # nor in the default namespace
    assert c.evictable_size == 9  # three separate 3-token leaves
    assert len(kids(c.root)) == 3
    assert ins(c, pool, [1, 2, 3, 4], ns="b") == 3
    c.check_integrity()


# ---- R-RC-3 -------------------------------------------------------------------------------------
def test_r_rc_3_page4_three_token_prompt_matches_and_inserts_nothing():
    """R-RC-3: with P = 4 a 3-token run is floored to 0: empty match, no node created."""
    pool, c = make(P=4)
    assert c.match_prefix(T(1, 2, 3)) == (0, c.root)
    assert c.insert(T(1, 2, 3), pool.alloc) == 0
    assert c.root.children == {} and c.evictable_size == 0 and pool.available == 64
    assert c._next_id == 1  # only the root was ever created


def test_r_rc_3_page_alignment_of_match_and_insert():
    """R-RC-3: insert floors to 8 of 10 tokens; matches are multiples of 4 (LCP 6 -> 4)."""
    pool, c = make(P=4)
    assert c.insert(T(*range(10)), pool.alloc) == 0
    assert c.evictable_size == 8  # floor4(10)
    assert pool.available == 56
    # query shares 6 tokens: floor4(6) = 4, and the node [0..7] is split at 4
    m, node = c.match_prefix(T(0, 1, 2, 3, 4, 5, 99, 99))
    assert m == 4
    assert node.key.tolist() == [0, 1, 2, 3]
    assert kids(node)[0].key.tolist() == [4, 5, 6, 7]
    # a query of 7 matching tokens is floored to 4 before matching
    assert c.match_prefix(T(0, 1, 2, 3, 4, 5, 6))[0] == 4
    # inserting 6 tokens that are present only stores floor4(6) = 4, all present
    assert c.insert(T(0, 1, 2, 3, 4, 5), pool.alloc) == 4
    c.check_integrity()


# ---- R-RC-4 -------------------------------------------------------------------------------------
def test_r_rc_4_match_split_keeps_slot_lock_and_stamps():
    """R-RC-4: a partial match splits the child; the head takes the child's slot in the parent's
    child order and its lock_ref, carries the call's stamp and a new, larger creation id; the
    whole visited path (root, head, tail) carries the same new stamp."""
    pool, c = make()
    ins(c, pool, [1, 2, 3, 4])  # clock 1, node id 1
    ins(c, pool, [5, 6])  # clock 2, node id 2
    a, b = kids(c.root)
    c.inc_lock_ref(a)
    assert (c.evictable_size, c.protected_size) == (2, 4)
    m, head = c.match_prefix(T(1, 2, 9))  # clock 3
    assert m == 2
    assert kids(c.root) == [head, b]  # head in a's former slot (first), b still second
    assert head.key.tolist() == [1, 2] and kids(head) == [a] and a.key.tolist() == [3, 4]
    assert a.parent is head and head.parent is c.root
    assert head.lock_ref == 1 and a.lock_ref == 1  # lock copied to the head
    assert (c.evictable_size, c.protected_size) == (2, 4)  # a split moves no tokens
    assert head.node_id == 3  # root 0, a 1, b 2: the next id
    assert (c.root.last_access, head.last_access, a.last_access, b.last_access) == (3, 3, 3, 2)
    assert c.clock == 3
    c.check_integrity([a])


def test_r_rc_4_one_stamp_per_call_and_clock_increases():
    """R-RC-4: one new stamp per match/insert call, from a logical clock (1, 2, 3, ...)."""
    pool, c = make()
    ins(c, pool, [1, 2])  # 1
    ins(c, pool, [3, 4])  # 2
    x, y = kids(c.root)
    c.match_prefix(T(1, 2, 7))  # 3: visits x only (full match, no split)
    assert (x.last_access, y.last_access, c.root.last_access) == (3, 2, 3)
    c.match_prefix(T(8))  # 4: no child matches, only the root is stamped
    assert (x.last_access, y.last_access, c.root.last_access) == (3, 2, 4)
    c.insert(T(3, 4), pool.alloc)  # 5: fully present, stamps y
    assert (x.last_access, y.last_access, c.clock) == (3, 5, 5)


def test_r_rc_4_match_walks_several_levels():
    pool, c = make()
    ins(c, pool, [1, 2, 3, 4, 5, 6])
    ins(c, pool, [1, 2, 3, 7])  # split at 3
    ins(c, pool, [1, 2, 3, 4, 5, 8])  # split [4,5,6] at 2
    m, node = c.match_prefix(T(1, 2, 3, 4, 5, 6, 9))
    assert m == 6 and node.key.tolist() == [6]
    assert prefix(c, node) == [1, 2, 3, 4, 5, 6]
    m, node = c.match_prefix(T(1, 2, 3, 4))
    assert m == 4 and prefix(c, node) == [1, 2, 3, 4]  # split [4,5] at 1
    c.check_integrity()


# ---- R-RC-5 -------------------------------------------------------------------------------------
def test_r_rc_5_insert_split_new_leaf_last_present_and_evictable():
    """R-RC-5: insert splits a partly matched node (the head keeps the slot and lock), the new
    remainder is a leaf appended last, evictable grows by its length, and the return value is
    the length already present."""
    pool, c = make()
    ins(c, pool, [9, 9])  # id 1, clock 1
    assert ins(c, pool, [1, 2, 3, 4]) == 0  # id 2, clock 2
    nine, a = kids(c.root)
    c.inc_lock_ref(a)
    assert ins(c, pool, [1, 2, 7, 7, 7]) == 2  # clock 3: split a at 2 (head id 3), leaf [7,7,7] id 4
    nine2, head = kids(c.root)
    assert nine2 is nine and head is not a  # head took a's slot (second)
    assert head.key.tolist() == [1, 2] and head.lock_ref == 1
    assert [k.key.tolist() for k in kids(head)] == [[3, 4], [7, 7, 7]]  # new leaf last
    new_leaf = kids(head)[1]
    assert (head.node_id, new_leaf.node_id) == (3, 4)
    assert (head.last_access, new_leaf.last_access, a.last_access, nine.last_access) == (3, 3, 3, 1)
    # evictable: [9,9] + [7,7,7] = 5; protected: [1,2] + [3,4] = 4
    assert (c.evictable_size, c.protected_size) == (5, 4)
    # inserting a prefix that ends inside a node splits it and adds nothing
    assert ins(c, pool, [1, 2, 7]) == 3
    assert (c.evictable_size, c.protected_size) == (5, 4)
    assert [k.key.tolist() for k in kids(head)] == [[3, 4], [7]]
    c.check_integrity([a])


def test_r_rc_5_insert_with_array_value_keeps_given_slots():
    """R-RC-5: with an array value, the new leaf stores value[present:]; the caller frees the
    duplicate head."""
    pool, c = make(pool_size=10)
    v1 = pool.alloc(3)
    assert c.insert(T(1, 2, 3), v1) == 0
    v2 = pool.alloc(5)
    assert c.insert(T(1, 2, 3, 4, 5), v2) == 3
    pool.free(v2[:3])  # the caller frees the duplicate KV
    (n1,) = kids(c.root)
    (n2,) = kids(n1)
    assert n1.value.tolist() == v1.tolist() and n2.value.tolist() == v2[3:].tolist()
    assert pool.available == 5
    assert sorted(c.cached_slots().tolist() + pool.free_slots().tolist()) == list(range(10))


# ---- R-RC-6 -------------------------------------------------------------------------------------
def test_r_rc_6_lock_unlock_counters():
    """R-RC-6: lock moves a node's length from evictable to protected only at lock_ref 0;
    unlock mirrors; unlocking an unlocked node is an error."""
    pool, c = make()
    ins(c, pool, [1, 2, 3, 4])
    ins(c, pool, [1, 2, 5])  # head [1,2], leaves [3,4], [5]
    head = kids(c.root)[0]
    l34, l5 = kids(head)
    assert (c.evictable_size, c.protected_size) == (5, 0)
    c.inc_lock_ref(l34)  # path [3,4] + [1,2]
    assert (c.evictable_size, c.protected_size) == (1, 4)
    c.inc_lock_ref(l5)  # only [5] moves: [1,2] is already locked
    assert (c.evictable_size, c.protected_size) == (0, 5)
    assert (head.lock_ref, l34.lock_ref, l5.lock_ref, c.root.lock_ref) == (2, 1, 1, 1)
    c.inc_lock_ref(l34)
    assert (c.evictable_size, c.protected_size) == (0, 5) and l34.lock_ref == 2
    c.check_integrity([l34, l5, l34])
    c.dec_lock_ref(l34)
    c.dec_lock_ref(l5)
    assert (c.evictable_size, c.protected_size) == (1, 4)  # [5] back; head still held by l34
    c.dec_lock_ref(l34)
    assert (c.evictable_size, c.protected_size) == (5, 0)
    assert (head.lock_ref, l34.lock_ref, l5.lock_ref) == (0, 0, 0)
    with pytest.raises(RuntimeError, match="lock_ref 0"):
        c.dec_lock_ref(l5)
    c.inc_lock_ref(c.root)  # locking the root is a no-op
    assert c.root.lock_ref == 1
    c.check_integrity([])


def test_r_rc_6_pool_invariant_with_private_slots():
    """R-RC-6: available + evictable + protected + private == pool size."""
    pool, c = make(pool_size=20)
    ins(c, pool, [1, 2, 3, 4])
    private = pool.alloc(5)
    (n,) = kids(c.root)
    c.inc_lock_ref(n)
    assert pool.available + c.evictable_size + c.protected_size + len(private) == 20  # 11 + 0 + 4 + 5


# ---- R-RC-7 / D4 --------------------------------------------------------------------------------
def test_r_rc_7_evict_lru_order():
    """R-RC-7: the oldest stamp goes first; matching refreshes a leaf."""
    pool, c = make()
    ins(c, pool, [1, 1])  # clock 1
    ins(c, pool, [2, 2])  # clock 2
    ins(c, pool, [3, 3])  # clock 3
    c.match_prefix(T(1, 1))  # clock 4: [1,1] is now the newest
    ev = c.evict(3)  # [2,2] (2 tokens), then [3,3] (4 >= 3): whole nodes, overshoot by 1
    assert [e.key.tolist() for e in ev] == [[2, 2], [3, 3]]
    assert c.evictable_size == 2 and pool.available == 62
    assert kids(c.root)[0].key.tolist() == [1, 1]
    c.check_integrity()


def test_r_rc_7_d4_ties_by_creation_id_and_parents_join():
    """R-RC-7/D4: equal stamps (nodes touched by one call) evict by creation id; a parent that
    becomes an unlocked leaf joins the candidates with its own stamp.

    insert [1,2,3] (clock 1, id 1); insert [1,2,4] (clock 2): head [1,2] id 2, leaf [4] id 3, tail
    [3] re-stamped 2; insert [7] (clock 3, id 4). Leaves: [3](2,id1) [4](2,id3) [7](3,id4).
    Order: [3], [4], then head [1,2] (stamp 2) joins and precedes [7] (stamp 3)."""
    pool, c = make()
    ins(c, pool, [1, 2, 3])
    ins(c, pool, [1, 2, 4])
    ins(c, pool, [7])
    ev = c.evict(100)
    assert [(e.key.tolist(), e.last_access, e.node_id) for e in ev] == [
        ([3], 2, 1), ([4], 2, 3), ([1, 2], 2, 2), ([7], 3, 4)]
    assert c.root.children == {} and c.evictable_size == 0 and pool.available == 64
    c.check_integrity()


def test_r_rc_7_whole_nodes_overshoot_and_locked_leaves_stay():
    """R-RC-7: a whole node is evicted even when that overshoots; locked leaves (and their
    locked ancestors) are never candidates; evict stops when no unlocked leaf is left."""
    pool, c = make()
    ins(c, pool, [1] * 10)  # clock 1
    ins(c, pool, [2, 2])  # clock 2
    ev = c.evict(1)
    assert [len(e.key) for e in ev] == [10]  # evicted 10 >= 1
    (keep,) = kids(c.root)
    c.inc_lock_ref(keep)
    assert c.evict(5) == []  # the only leaf is locked
    assert pool.available == 62
    c.dec_lock_ref(keep)
    assert [e.key.tolist() for e in c.evict(5)] == [[2, 2]]  # nothing else left: stops short
    assert c.evict(0) == []
    c.check_integrity()


def test_r_rc_7_locked_child_protects_parent():
    pool, c = make()
    ins(c, pool, [1, 2, 3])
    ins(c, pool, [1, 2, 4])  # head [1,2], leaves [3], [4]
    head = kids(c.root)[0]
    l3, l4 = kids(head)
    c.inc_lock_ref(l3)
    ev = c.evict(100)
    assert [e.key.tolist() for e in ev] == [[4]]  # head still has a (locked) child
    assert kids(c.root) == [head] and kids(head) == [l3]
    assert (c.evictable_size, c.protected_size) == (0, 3)
    c.check_integrity([l3])


# ---- R-RC-8 -------------------------------------------------------------------------------------
def test_r_rc_8_disabled_cache():
    """R-RC-8: match returns (0, root), insert keeps nothing, evictable stays 0."""
    pool, c = make(disable=True)
    assert c.insert(T(1, 2, 3), pool.alloc) == 0
    assert c.match_prefix(T(1, 2, 3)) == (0, c.root)
    assert c.evictable_size == 0 and c.root.children == {} and pool.available == 64
    c.inc_lock_ref(c.root)
    c.dec_lock_ref(c.root)
    assert c.evict(10) == []
    c.check_integrity()


# ---- check_integrity really checks ----------------------------------------------------------------
def _tree():
    pool, c = make()
    ins(c, pool, [1, 2, 3, 4])
    ins(c, pool, [1, 2, 5, 6])
    head = kids(c.root)[0]
    a, b = kids(head)
    c.inc_lock_ref(a)
    c.check_integrity([a])
    return c, head, a, b


def test_check_integrity_catches_counter_corruption():
    c, head, a, b = _tree()
    c.evictable_size += 1
    with pytest.raises(AssertionError, match="evictable/protected"):
        c.check_integrity()
    c, head, a, b = _tree()
    c.protected_size -= 2
    with pytest.raises(AssertionError, match="evictable/protected"):
        c.check_integrity()


def test_check_integrity_catches_lock_ref_corruption():
    c, head, a, b = _tree()
    b.lock_ref = 1  # counters not moved
    with pytest.raises(AssertionError):
        c.check_integrity()
    c, head, a, b = _tree()
    b.lock_ref = -1
    with pytest.raises(AssertionError, match="lock_ref -1"):
        c.check_integrity()
    c, head, a, b = _tree()
    head.lock_ref = 2  # counters unaffected, but the holders say 1
    with pytest.raises(AssertionError, match="holders"):
        c.check_integrity([a])
    c, head, a, b = _tree()
    with pytest.raises(AssertionError, match="holders"):
        c.check_integrity([])  # a is locked but nobody holds it
    c, head, a, b = _tree()
    head.lock_ref, a.lock_ref = 0, 0  # consistent with nothing... except the counters
    with pytest.raises(AssertionError):
        c.check_integrity()
    c, head, a, b = _tree()
    c.root.lock_ref = 2
    with pytest.raises(AssertionError, match="root"):
        c.check_integrity()


def test_check_integrity_catches_child_lock_above_parent():
    c, head, a, b = _tree()
    # a child locked more than its parent, counters kept consistent
    a.lock_ref = 3
    with pytest.raises(AssertionError, match="exceeds its parent"):
        c.check_integrity()


def test_check_integrity_catches_link_and_key_corruption():
    c, head, a, b = _tree()
    a.parent = c.root
    with pytest.raises(AssertionError, match="parent link"):
        c.check_integrity()
    c, head, a, b = _tree()
    b.key = T(9, 6)  # child key no longer matches its slot (5)
    with pytest.raises(AssertionError, match="child key"):
        c.check_integrity()
    c, head, a, b = _tree()
    b.value = b.value[:1]
    with pytest.raises(AssertionError, match="lengths differ"):
        c.check_integrity()
    c, head, a, b = _tree()
    del head.children[5]  # detach b: its 2 evictable tokens vanish from the recount
    with pytest.raises(AssertionError, match="evictable/protected"):
        c.check_integrity()


def test_check_integrity_catches_unaligned_key_and_detached_holder():
    pool, c = make(P=2)
    ins(c, pool, [1, 2, 3, 4])
    (n,) = kids(c.root)
    n.key, n.value = n.key[:3], n.value[:3]
    c.evictable_size = 3
    with pytest.raises(AssertionError, match="multiple of 2"):
        c.check_integrity()
    c2, head, a, b = _tree()
    c2.dec_lock_ref(a)
    c2.evict(100)
    with pytest.raises(AssertionError, match="no longer attached"):
        c2.check_integrity([a])


# ---- properties -----------------------------------------------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 3), min_size=0, max_size=9),
        st.sampled_from([None, "x"]),
        st.integers(0, 12),
    ),
    max_size=40,
)


@given(ops=OPS, P=st.sampled_from([1, 2, 3]))
def test_property_random_ops_keep_integrity(ops, P):
    """Random insert/match/lock/unlock/evict sequences keep every invariant; a just-inserted
    sequence matches floorP(len) tokens; matches are multiples of P; the pool is conserved."""
    pool, c = make(pool_size=400, P=P)
    held = []
    for op, toks, ns, n in ops:
        key = T(*toks)
        if op == "insert":
            present = c.insert(key, pool.alloc, ns)
            assert present % P == 0 and present <= len(toks)
            m, node = c.match_prefix(key, ns)
            assert m == len(toks) // P * P
            assert c.node_prefix(node) == (ns if m else None, tuple(toks[:m])) or m == 0
        elif op == "match":
            m, node = c.match_prefix(key, ns)
            assert m % P == 0 and m <= len(toks)
            if m:
                assert c.node_prefix(node)[1] == tuple(toks[:m])
        elif op == "lock":
            m, node = c.match_prefix(key, ns)
            c.inc_lock_ref(node)
            held.append(node)
        elif op == "unlock" and held:
            c.dec_lock_ref(held.pop(n % len(held)))
        elif op == "evict":
            before = c.evictable_size
            ev = c.evict(n)
            freed = sum(len(e.key) for e in ev)
            assert c.evictable_size == before - freed
            unlocked_leaves = [x for x in c._nodes() if x is not c.root and not x.children and x.lock_ref == 0]
            assert freed >= n or not unlocked_leaves  # stops only when done or out of candidates
            assert all(len(e.key) for e in ev) and (not ev or freed - len(ev[-1].key) < n)  # no extra node
        c.check_integrity(held)
        assert pool.available + c.evictable_size + c.protected_size == 400
    # everything unlocked can be evicted
    for h in held:
        c.dec_lock_ref(h)
    c.evict(10**9)
    assert c.evictable_size == 0 and c.protected_size == 0 and pool.available == 400
    c.check_integrity([])


@given(seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=12))
def test_property_match_equals_longest_common_prefix_with_inserted(seqs):
    """Without eviction, matching q gives the longest LCP of q with any inserted sequence (P=1)."""
    pool, c = make(pool_size=200)
    for s in seqs:
        c.insert(T(*s), pool.alloc)
    for q in seqs + [[0, 1, 2, 0], [2, 2]]:
        best = 0
        for s in seqs:
            k = 0
            while k < min(len(q), len(s)) and q[k] == s[k]:
                k += 1
            best = max(best, k)
        assert c.match_prefix(T(*q))[0] == best
    c.check_integrity()
