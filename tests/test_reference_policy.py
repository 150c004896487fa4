"""Ordering the waiting queue (SPEC.md R-ORD-1..11) on hand-computed cases."""

import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

from gpu_sched import Request, SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.reference.policy import (active_policy, dfs_weight_order, in_batch_deprioritized,
                                        order_queue)
from gpu_sched.reference.radix_cache import KVPool, RadixCache
from gpu_sched.reference.state import ReqState

BIG = 10**6


def mk(pool=BIG, shuffle=None, **cfg):
    return ReferenceScheduler(SchedulerConfig(**cfg), pool, shuffle=shuffle)


def R(rid, prompt, max_new=4, **kw):
    return Request(rid, list(prompt), max_new, **kw)


def order(s):
    """Order the scheduler's queue without admitting anything."""
    return order_queue(s.queue, s.config, s.cache, s.running, s.shuffle)


def rids(res):
    return [r.rid for r in res.queue]


# ---- R-ORD-1 / R-ORD-2 / R-ORD-3 --------------------------------------------------------------------
def test_r_ord_1_unknown_policy_is_an_error():
    """R-ORD-1: any other policy name is an error."""
    with pytest.raises(ValueError, match="schedule_policy"):
        SchedulerConfig(schedule_policy="shortest-first")


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_r_ord_1_cache_aware_with_disabled_cache_becomes_fcfs(policy):
    """R-ORD-1: lpm/dfs-weight with the cache disabled is fcfs, priority sort included (R-ORD-4)."""
    s = mk(schedule_policy=policy, disable_radix_cache=True, enable_priority_scheduling=True)
    s.submit([R("a", [1, 2], priority=1), R("b", [1, 2, 3], priority=7), R("c", [5], priority=3)])
    res = order(s)
    assert res.active_policy == "fcfs" and res.num_matched is None
    assert rids(res) == ["b", "c", "a"]  # priority descending (sign -1)


def test_r_ord_2_lpm_fallback_above_queue_len_no_match_no_sort():
    """R-ORD-2: lpm with more than lpm_fallback_queue_len queued requests: no prefix matching
    and no sort at all, not even the priority sort (the branch tests the configured policy)."""
    s = mk(schedule_policy="lpm", lpm_fallback_queue_len=2, enable_priority_scheduling=True)
    s.seed_cache([1, 2, 3, 4])
    clock = s.cache.clock  # 1 (one insert)
    s.submit([R("a", [9, 9], priority=0), R("b", [1, 2, 3, 4, 5], priority=5), R("c", [1, 2, 7], priority=9)])
    res = order(s)
    assert res.active_policy == "fcfs" and res.num_matched is None
    assert rids(res) == ["a", "b", "c"]  # unchanged despite prefixes and priorities
    assert s.cache.clock == clock  # no match call
    # with exactly lpm_fallback_queue_len requests, lpm applies: b matches 4, c matches 2
    s.abort(["a"])
    res = order(s)
    assert res.active_policy == "lpm" and rids(res) == ["b", "c"] and res.num_matched == [4, 2]
    assert s.cache.clock == clock + 2  # one stamp per request matched


def test_r_ord_2_sglang_preset_falls_back_at_129():
    """R-ORD-2 / D3: the SGLang preset's limit is 128 queued requests."""
    cfg = SchedulerConfig.sglang(schedule_policy="lpm")
    assert active_policy(cfg, 128) == "lpm"
    assert active_policy(cfg, 129) == "fcfs"
    assert active_policy(SchedulerConfig(schedule_policy="lpm"), 10**6) == "lpm"  # D3 default: never
    assert active_policy(SchedulerConfig(schedule_policy="dfs-weight", lpm_fallback_queue_len=0), 5) == "dfs-weight"
    s = ReferenceScheduler(cfg, BIG)
    s.seed_cache([1, 2, 3])
    s.submit([R(f"x{i}", [50 + i]) for i in range(128)] + [R("hit", [1, 2, 3, 4])])
    plan = s.step(1.0)
    assert plan.active_policy == "fcfs" and plan.num_matched is None
    assert plan.queue_order[-1] == "hit"  # 129 queued: not moved to the front


@pytest.mark.parametrize("policy", ["fcfs", "lof", "random", "routing-key"])
def test_r_ord_3_cache_agnostic_policies_do_not_match(policy):
    """R-ORD-3: a cache-agnostic policy does no prefix matching while ordering (no stamp)."""
    s = mk(schedule_policy=policy)
    s.seed_cache([1, 2, 3])
    s.seed_running(R("run", [7], routing_key="k", output_ids=[1]))  # one match call (clock 2)
    s.submit([R("a", [1, 2, 3, 4], routing_key="k"), R("b", [1, 2])])
    clock = s.cache.clock
    stamps = [n.last_access for n in s.cache._nodes()]
    res = order(s)
    assert res.active_policy == policy and res.num_matched is None and res.deprioritized == []
    assert s.cache.clock == clock and [n.last_access for n in s.cache._nodes()] == stamps
    assert all(r.prefix_len == 0 and r.last_node is None for r in s.queue)


# ---- R-ORD-4 fcfs --------------------------------------------------------------------------------
PRIO_QUEUE = [  # rid, priority, enqueue_time
    ("a", 1, 3.0), ("b", 5, 2.0), ("c", None, 0.0), ("d", 5, 1.0), ("e", 1, 3.0),
    ("f", -(2**63), 0.0), ("g", 2**63 - 1, 0.0),
]


def _prio_sched(**cfg):
    s = mk(**cfg)
    s.submit([R(rid, [i + 1], priority=p, enqueue_time=t) for i, (rid, p, t) in enumerate(PRIO_QUEUE)])
    return s


def test_r_ord_4_fcfs_without_priority_keeps_queue_order():
    """R-ORD-4: fcfs does not reorder (not even by enqueue time) without priority scheduling."""
    s = _prio_sched()
    assert rids(order(s)) == ["a", "b", "c", "d", "e", "f", "g"]


def test_r_ord_4_fcfs_priority_high_values_first_absent_last():
    """R-ORD-4 with sign -1: key (-priority, enqueue_time); absent = -2^63, tying with an explicit
    -2^63 (kept in queue order, R-ORD-11); no int64 overflow on -(-2^63).
    keys: g (-(2^63-1),0) d (-5,1) b (-5,2) a (-1,3) e (-1,3) c (2^63,0) f (2^63,0)."""
    s = _prio_sched(enable_priority_scheduling=True)
    assert rids(order(s)) == ["g", "d", "b", "a", "e", "c", "f"]


def test_r_ord_4_fcfs_priority_low_values_first_absent_last():
    """R-ORD-4 with sign +1: key (priority, enqueue_time); absent = 2^63-1, tying with g.
    keys: f (-2^63,0) a (1,3) e (1,3) d (5,1) b (5,2) c (2^63-1,0) g (2^63-1,0)."""
    s = _prio_sched(enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert rids(order(s)) == ["f", "a", "e", "d", "b", "c", "g"]


# ---- R-ORD-5 lof ---------------------------------------------------------------------------------
def test_r_ord_5_lof_total_max_new_descending_stable():
    """R-ORD-5: key -max_new_tokens (the total, not the remainder); ties keep queue order.
    b has 100 total but 90 outputs: still sorted by 100."""
    s = mk(schedule_policy="lof")
    s.submit([R("a", [1], 10), R("b", [2], 100, output_ids=[0] * 90), R("c", [3], 50), R("d", [4], 10),
              R("e", [5], 100)])
    assert rids(order(s)) == ["b", "e", "c", "a", "d"]


def test_r_ord_5_lof_with_priority():
    """R-ORD-5: key (priority*sign, -max_new); sign -1, absent priority last.
    keys: a (-1,-10) b (-1,-100) c (-3,-5) d (2^63,-1000) e (-1,-100)."""
    s = mk(schedule_policy="lof", enable_priority_scheduling=True)
    s.submit([R("a", [1], 10, priority=1), R("b", [2], 100, priority=1), R("c", [3], 5, priority=3),
              R("d", [4], 1000), R("e", [5], 100, priority=1)])
    assert rids(order(s)) == ["c", "b", "e", "a", "d"]


# ---- R-ORD-6 random ------------------------------------------------------------------------------
def test_r_ord_6_random_is_a_seeded_permutation():
    """R-ORD-6: a permutation, reproducible per seed."""
    names = [f"r{i}" for i in range(12)]

    def run(seed):
        s = mk(schedule_policy="random", random_seed=seed)
        s.submit([R(n, [i + 1]) for i, n in enumerate(names)])
        return rids(order(s))

    a, b, c = run(3), run(3), run(4)
    assert sorted(a) == sorted(names) and a == b
    assert a != names or c != names  # 12! orders: a seeded shuffle is not the identity twice
    assert sorted(c) == sorted(names)


def test_r_ord_6_random_uses_injected_shuffle_and_checks_it():
    s = mk(schedule_policy="random", shuffle=lambda n: list(range(n))[::-1])
    s.submit([R("a", [1]), R("b", [2]), R("c", [3])])
    assert rids(order(s)) == ["c", "b", "a"]
    bad = mk(schedule_policy="random", shuffle=lambda n: [0] * n)
    bad.submit([R("a", [1]), R("b", [2])])
    with pytest.raises(ValueError, match="permutation"):
        order(bad)


# ---- R-ORD-7 routing-key ---------------------------------------------------------------------------
def _routing(running_keys, queue):
    s = mk(schedule_policy="routing-key")
    for i, k in enumerate(running_keys):
        s.seed_running(R(f"run{i}", [100 + i], routing_key=k, output_ids=[1]))
    s.submit([R(rid, [i + 1], routing_key=k) for i, (rid, k) in enumerate(queue)])
    return rids(order(s))


def test_r_ord_7_routing_key_counts():
    """R-ORD-7: running keys a:2, b:1 (absent not counted). Keys: q1 (1,0,"c"), q2 (0,-1,"b"),
    q3 (1,0,""), q4 (0,-2,"a"), q5 (0,-1,"b"), q6 (1,0,"a0"), q7 (0,-2,"a")."""
    queue = [("q1", "c"), ("q2", "b"), ("q3", None), ("q4", "a"), ("q5", "b"), ("q6", "a0"), ("q7", "a")]
    assert _routing(["a", None, "b", "a"], queue) == ["q4", "q7", "q2", "q5", "q3", "q6", "q1"]


def test_r_ord_7_routing_key_no_reorder_without_counted_key():
    """R-ORD-7: no running batch, or no counted key in it: no reordering."""
    queue = [("q1", "c"), ("q2", "b"), ("q3", None), ("q4", "a")]
    assert _routing([], queue) == ["q1", "q2", "q3", "q4"]
    assert _routing([None, None], queue) == ["q1", "q2", "q3", "q4"]


# ---- R-ORD-8 lpm ---------------------------------------------------------------------------------
def test_r_ord_8_lpm_sorts_by_capped_match():
    """R-ORD-8: cache [1..10]; matched = min(prefix_len, len(fill)-1, logprob_start_len).
    q1 0, q2 5, q3 10, q4 min(10, 9) = 9, q5 3, q6 min(10, 4) = 4, q7 5 (ties q2: queue order)."""
    s = mk(schedule_policy="lpm")
    base = list(range(1, 11))
    s.seed_cache(base)
    s.submit([
        R("q1", [50, 51]),
        R("q2", base[:5] + [99]),
        R("q3", base + [50]),
        R("q4", base),
        R("q5", base[:3] + [77]),
        R("q6", base + [60], return_logprob=True, logprob_start_len=4),
        R("q7", base[:5] + [98]),
    ])
    res = order(s)
    assert rids(res) == ["q3", "q4", "q2", "q7", "q6", "q5", "q1"]
    assert res.num_matched == [10, 9, 5, 5, 4, 3, 0]
    assert res.deprioritized == []  # every fill is shorter than T = 32
    by = {r.rid: r.prefix_len for r in s.queue}
    assert by == {"q1": 0, "q2": 5, "q3": 10, "q4": 10, "q5": 3, "q6": 10, "q7": 5}  # uncapped


def test_r_ord_8_lpm_ignores_priority_and_logprob_start_negative():
    """R-ORD-8: priority is ignored by lpm; logprob_start_len -1 does not cap."""
    s = mk(schedule_policy="lpm", enable_priority_scheduling=True)
    s.seed_cache([1, 2, 3, 4])
    s.submit([R("lo", [9], priority=100), R("hi", [1, 2, 3, 4, 5], priority=-5, return_logprob=True)])
    res = order(s)
    assert rids(res) == ["hi", "lo"] and res.num_matched == [4, 0]


# ---- R-ORD-9 in-batch deprioritization ---------------------------------------------------------------
def _groups():
    grp = {g: [1000 * (k + 1) + i for i in range(40)] for k, g in enumerate("ABC")}
    order_ = ["A0", "B0", "A1", "C0", "B1", "A2", "C1", "B2", "A3", "C2", "B3", "C3"]
    return [R(n, grp[n[0]] + [int(n[1]) + 1, 7, 7, 7, 7]) for n in order_]


def test_r_ord_9_in_batch_deprioritization_three_groups():
    """R-ORD-9 (issue case): empty cache, 3 groups of 4 prompts sharing 40 leading tokens within a
    group. Every prefix_len is 0 <= 32 (checked); the first of each group inserts, the 9 others
    share >= 32 tokens with it: key +inf, after the three firsts (all key 0), queue order kept."""
    s = mk(schedule_policy="lpm")
    s.submit(_groups())
    plan = s.step(1.0)
    firsts = ["A0", "B0", "C0"]
    rest = ["A1", "B1", "A2", "C1", "B2", "A3", "C2", "B3", "C3"]
    assert plan.active_policy == "lpm"
    assert plan.queue_order == firsts + rest
    assert plan.deprioritized == rest
    assert plan.num_matched == [0] * 12
    assert plan.admitted_rids == firsts + rest  # everything fits, admitted in the new order
    s.check_integrity()


def test_r_ord_9_threshold_minus_one_disables():
    """R-ORD-9: check threshold -1: nothing deprioritized; all keys 0: queue order kept."""
    s = mk(schedule_policy="lpm", in_batch_prefix_caching_check_threshold=-1)
    s.submit(_groups())
    res = order(s)
    assert res.deprioritized == []
    assert rids(res) == ["A0", "B0", "A1", "C0", "B1", "A2", "C1", "B2", "A3", "C2", "B3", "C3"]


def test_r_ord_9_checked_only_at_or_below_threshold_namespace_and_short_fills():
    """R-ORD-9 edges, T = 32, check threshold 32. Cache: X (40 tokens), Z (32 tokens).
    x1, x2: prefix 40 > 32: unchecked, never deprioritized, insert nothing.
    y1: first of Y; y2: shares 33 with y1 -> deprio; y3: Y in namespace "n": own group, kept;
    y4: Y[:31] shorter than T: kept; z1: prefix exactly 32 (checked), first of Z; z2: deprio.
    lpm keys: x1 -40, x2 -40, y1 0, y2 inf, y3 0, y4 0, z1 -32, z2 inf."""
    X = list(range(100, 140))
    Y = list(range(200, 240))
    Z = list(range(300, 332))
    s = mk(schedule_policy="lpm")
    s.seed_cache(X)
    s.seed_cache(Z)
    s.submit([
        R("x1", X + [1]), R("y1", Y + [1]), R("x2", X + [2]), R("y2", Y[:33] + [5]),
        R("y3", Y + [1], extra_key="n"), R("y4", Y[:31]), R("z1", Z + [1, 2]), R("z2", Z + [3, 4]),
    ])
    res = order(s)
    assert res.deprioritized == ["y2", "z2"]
    assert rids(res) == ["x1", "x2", "z1", "y1", "y3", "y4", "y2", "z2"]
    assert res.num_matched == [40, 40, 32, 0, 0, 0, 0, 32]


def test_r_ord_9_threshold_zero_deprioritizes_every_checked_request():
    """R-ORD-9 with T = 0: a zero-length match already reaches T, so every checked request
    (prefix_len <= 32) is deprioritized, the first one included; the unchecked one is not."""
    s = mk(schedule_policy="lpm", in_batch_prefix_caching_deprioritize_threshold=0)
    X = list(range(100, 140))
    s.seed_cache(X)
    s.submit([R("a", [1, 2]), R("b", X + [1]), R("c", [3])])
    res = order(s)
    assert res.deprioritized == ["a", "c"]
    assert rids(res) == ["b", "a", "c"]


def _naive_deprio(fills, prefix_lens, nss, check, T):
    """R-ORD-9 as literally specified: a scratch list of inserted fills."""
    inserted = []
    out = []
    for f, p, ns in zip(fills, prefix_lens, nss):
        if check == -1 or p > check:
            out.append(False)
            continue
        best = 0
        for g, gns in inserted:
            if gns != ns:
                continue
            k = 0
            while k < min(len(f), len(g)) and f[k] == g[k]:
                k += 1
            best = max(best, k)
        if best >= T:
            out.append(True)
        else:
            out.append(False)
            inserted.append((f, ns))
    return out


@given(
    reqs=st.lists(st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=6), st.integers(0, 4),
                            st.sampled_from([None, "n"])), max_size=10),
    check=st.sampled_from([-1, 0, 2, 4]),
    T=st.integers(0, 4),
)
def test_property_r_ord_9_closed_form_equals_sequential_definition(reqs, check, T):
    """R-ORD-9: the closed form equals the scratch-tree definition."""
    states = []
    for i, (fill, p, ns) in enumerate(reqs):
        st_ = ReqState(Request(f"r{i}", fill, 1, extra_key=ns), 0, 0.0)
        st_.prefix_len = p
        states.append(st_)
    got = in_batch_deprioritized(states, check, T)
    assert got == _naive_deprio([f for f, _, _ in reqs], [p for _, p, _ in reqs], [n for _, _, n in reqs], check, T)


# ---- R-ORD-10 dfs-weight -------------------------------------------------------------------------------
def test_r_ord_10_dfs_weight_hand_tree():
    """R-ORD-10: tree root -> A=[1,1,1] -> {A1=[3], A2=[4]}, root -> B=[2,2,2].
    last nodes: q1 B, q2 A1, q3 A2, q4 A2, q5 A, q6 root. Weights A1 1, A2 2, A 4, B 1.
    Visit A (4) before B (1), in A: A2 (2) before A1 (1); post-order emits
    q3 q4 (A2, queue order), q2 (A1), q5 (A), q1 (B), q6 (root)."""
    s = mk(schedule_policy="dfs-weight")
    s.seed_cache([1, 1, 1, 3])
    s.seed_cache([1, 1, 1, 4])
    s.seed_cache([2, 2, 2])
    s.submit([R("q1", [2, 2, 2, 9]), R("q2", [1, 1, 1, 3, 9]), R("q3", [1, 1, 1, 4, 9]),
              R("q4", [1, 1, 1, 4, 8]), R("q5", [1, 1, 1, 8]), R("q6", [5])])
    res = order(s)
    assert res.active_policy == "dfs-weight"
    assert rids(res) == ["q3", "q4", "q2", "q5", "q1", "q6"]
    assert res.num_matched == [4, 4, 4, 3, 3, 0]


def test_r_ord_10_dfs_weight_ties_keep_child_order():
    """R-ORD-10: equal weights visit children in the parent's child order (A1 inserted before
    A2), not queue order: q2 (A2) is queued first but emitted after q1 (A1)."""
    s = mk(schedule_policy="dfs-weight")
    s.seed_cache([1, 1, 1, 3])
    s.seed_cache([1, 1, 1, 4])
    s.submit([R("q2", [1, 1, 1, 4, 9]), R("q1", [1, 1, 1, 3, 9])])
    assert rids(order(s)) == ["q1", "q2"]


def _chain_node(root, depth):
    """The node at `depth` of a one-token-per-node chain (iterative walk)."""
    node = root
    for _ in range(depth):
        (node,) = node.children.values()
    return node


def test_r_ord_10_dfs_weight_100k_chain_no_recursion():
    """R-ORD-10: a chain of 100,000 nodes built by inserting prefixes of one sequence (longest
    first: each insert splits the first node, so building takes one short walk per call).
    Requests at depths 10, 0 (root), 99,999 and 50,000 (queued in that order): in a chain the
    post-order is deepest first."""
    n = 100_000
    t0 = time.process_time()  # CPU time of this process: other load on the machine does not count
    seq = np.arange(1, n + 1, dtype=np.int32)
    pool = KVPool(n)
    c = RadixCache(pool, 1)
    slots = pool.alloc(n)
    c.insert(seq, slots)
    for k in range(n - 1, 0, -1):
        c.insert(seq[:k], slots[:k])  # all present: splits the first node at k
    assert c.evictable_size == n and pool.available == 0
    assert sum(1 for _ in c._nodes()) == n + 1  # one token per node, plus the root
    build_s = time.process_time() - t0
    assert build_s < 20, f"building the chain took {build_s:.1f} CPU s"
    tail = n + 5  # a token not in the chain
    queue = []
    for rid, depth in [("d10", 10), ("root", 0), ("d99999", 99_999), ("d50000", 50_000)]:
        st_ = ReqState(Request(rid, list(seq[:depth]) + [tail], 4), 0, 0.0)
        st_.last_node = _chain_node(c.root, depth)
        st_.prefix_len = depth
        queue.append(st_)
    m, node = c.match_prefix(seq[:50_000])  # the real lookup agrees with the walk
    assert m == 50_000 and node is queue[3].last_node
    deep = queue[2].last_node
    assert deep.key.tolist() == [99_999] and [x.key.tolist() for x in deep.children.values()] == [[100_000]]
    assert [r.rid for r in dfs_weight_order(c.root, queue)] == ["d99999", "d50000", "d10", "root"]
    assert time.process_time() - t0 < 40


def test_r_ord_10_dfs_weight_full_step_on_deep_chain():
    """R-ORD-10 through a full step on a 5,000-node chain (5x the default recursion limit):
    matched depths 4,999 / 2,500 / 3 / 0 order deepest first; each admits its last token."""
    n = 5_000
    seq = list(range(1, n + 1))
    s = mk(pool=n + 100, schedule_policy="dfs-weight")
    s.seed_cache(seq)
    for k in range(n - 1, 0, -1):
        s.cache.insert(np.array(seq[:k], np.int32), s.pool.alloc)
    assert sum(1 for _ in s.cache._nodes()) == n + 1
    tail = n + 5
    s.submit([R("d3", seq[:3] + [tail]), R("root", [tail]), R("d4999", seq[:4999] + [tail]),
              R("d2500", seq[:2500] + [tail])])
    plan = s.step(1.0)
    assert plan.active_policy == "dfs-weight"
    assert plan.queue_order == ["d4999", "d2500", "d3", "root"]
    assert plan.num_matched == [4999, 2500, 3, 0]
    assert plan.admitted == [("d4999", 4999, 5000), ("d2500", 2500, 2501), ("d3", 3, 4), ("root", 0, 1)]
    s.check_integrity()


def _naive_dfs(root, queue):
    own = {}
    for r in queue:
        own.setdefault(id(r.last_node), []).append(r)

    def weight(node):
        return len(own.get(id(node), [])) + sum(weight(c) for c in node.children.values())

    out = []

    def visit(node):
        for c in sorted(node.children.values(), key=lambda c: -weight(c)):
            visit(c)
        out.extend(own.get(id(node), []))

    visit(root)
    return out


@given(
    cache=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), max_size=6),
    queue=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), max_size=8),
)
def test_property_r_ord_10_dfs_weight_equals_recursive_definition(cache, queue):
    """R-ORD-10: the iterative order equals the recursive definition on small trees."""
    pool = KVPool(200)
    c = RadixCache(pool, 1)
    for toks in cache:
        c.insert(np.array(toks, np.int32), pool.alloc)
    states = []
    for i, toks in enumerate(queue):
        st_ = ReqState(Request(f"r{i}", toks, 1), 0, 0.0)
        st_.prefix_len, st_.last_node = c.match_prefix(st_.fill())
        states.append(st_)
    assert [r.rid for r in dfs_weight_order(c.root, states)] == [r.rid for r in _naive_dfs(c.root, states)]


# ---- R-ORD-11 stability ------------------------------------------------------------------------------
@given(
    items=st.lists(st.tuples(st.integers(0, 3), st.one_of(st.none(), st.integers(-2, 2)),
                             st.sampled_from([0.0, 1.0])), max_size=12),
    policy=st.sampled_from(["fcfs", "lof"]),
    prio=st.booleans(),
    low_first=st.booleans(),
)
def test_property_r_ord_11_sorts_are_stable(items, policy, prio, low_first):
    """R-ORD-11: ties keep the current queue order: the result equals Python's stable sort with
    the SPEC key applied to the queue (an independent model of R-ORD-4/5)."""
    s = mk(schedule_policy=policy, enable_priority_scheduling=prio, schedule_low_priority_values_first=low_first)
    s.submit([R(f"r{i}", [1], mn, priority=p, enqueue_time=t) for i, (mn, p, t) in enumerate(items)])
    sign = 1 if low_first else -1
    absent = 2**63 - 1 if low_first else -(2**63)
    rows = [(f"r{i}", mn, absent if p is None else p, t) for i, (mn, p, t) in enumerate(items)]
    if policy == "fcfs":
        key = (lambda x: (x[2] * sign, x[3])) if prio else None
    else:
        key = (lambda x: (x[2] * sign, -x[1])) if prio else (lambda x: -x[1])
    want = [x[0] for x in (sorted(rows, key=key) if key else rows)]
    assert rids(order(s)) == want


def test_r_ord_11_lpm_ties_keep_queue_order():
    """R-ORD-11: all matches equal (empty cache, no deprioritization): order unchanged."""
    s = mk(schedule_policy="lpm")
    s.submit([R(n, [i + 1, 5]) for i, n in enumerate("edcba")])
    assert rids(order(s)) == list("edcba")
