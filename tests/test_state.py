"""Tests for gpu_sched.state.RequestTable against a plain Python model (CPU, fast)."""

import numpy as np
import pytest
import torch

from gpu_sched.request import INT32_MAX, INT64_MAX, INT64_MIN, Request
from gpu_sched.state import (CHUNKED, COLUMNS, FREE, RUNNING, WAITING, CapacityError, RequestTable)

KEYS = [None, "", "a", "b", "ab", "B", "é", "z", "\U0001F600", "a\x00", "ä", "Zeta", " "]
NAMESPACES = [None, "", "ns1", "ns2"]


def _table(C=8, T=64, **kw):
    return RequestTable(C, T, absent_priority=kw.pop("absent_priority", INT64_MIN), **kw)


def _req(rng, rid, max_prompt=6, max_new=4):
    plen = int(rng.integers(1, max_prompt + 1))
    mnt = int(rng.integers(0, max_new + 1))
    nout = int(rng.integers(0, mnt + 1)) if rng.random() < 0.3 else 0
    return Request(
        rid=rid,
        prompt_ids=rng.integers(0, 1000, plen).tolist(),
        max_new_tokens=mnt,
        output_ids=rng.integers(0, 1000, nout).tolist(),
        ignore_eos=bool(rng.random() < 0.3),
        priority=None if rng.random() < 0.4 else int(rng.integers(-5, 5)),
        routing_key=KEYS[int(rng.integers(len(KEYS)))],
        extra_key=NAMESPACES[int(rng.integers(len(NAMESPACES)))],
        return_logprob=bool(rng.random() < 0.4),
        logprob_start_len=int(rng.integers(-1, 6)),
        enqueue_time=None if rng.random() < 0.5 else float(rng.integers(0, 100)),
    )


def _assert_same_snapshot(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{k} changed"
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f"{k} changed"
        else:
            assert x == y, f"{k} changed"


class Model:
    """The table as plain Python: rid -> record; queue order by position counter."""

    def __init__(self, absent):
        self.rows = {}
        self.pos = 0
        self.absent = absent

    def add(self, reqs, state, now):
        for r in reqs:
            self.rows[r.rid] = dict(
                fill=list(r.fill_ids().tolist()), prompt_len=len(r.prompt_ids), output_len=len(r.output_ids),
                max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos,
                priority=self.absent if r.priority is None else r.priority,
                routing_key=r.routing_key or None, namespace=r.extra_key, return_logprob=r.return_logprob,
                logprob_start_len=r.logprob_start_len, prefix_len=0, last_node=-1, retracted=False, state=state,
                enqueue_time=now if r.enqueue_time is None else r.enqueue_time, queue_pos=self.pos,
                tok_cap=len(r.prompt_ids) + max(r.max_new_tokens, len(r.output_ids)))
            self.pos += 1

    def requeue(self, rids, now):
        for rid in rids:
            self.rows[rid].update(queue_pos=self.pos, enqueue_time=now, retracted=True, prefix_len=0,
                                  last_node=-1, state=WAITING)
            self.pos += 1

    def waiting(self):
        w = [rid for rid, r in self.rows.items() if r["state"] == WAITING]
        return sorted(w, key=lambda rid: self.rows[rid]["queue_pos"])

    def check(self, table):
        table.check_integrity()
        rows = table.to_host_rows()
        assert len(table) == len(rows) == len(self.rows)
        for row in rows:
            m = self.rows[row["rid"]]
            for k, v in m.items():
                assert row[k] == v, (row["rid"], k, row[k], v)
            fill = m["fill"]
            mpl = len(fill) - 1
            if m["return_logprob"] and m["logprob_start_len"] >= 0:
                mpl = min(mpl, m["logprob_start_len"])
            assert row["max_prefix_len"] == mpl
            assert row["routing_key_rank"] == table.routing_rank(m["routing_key"])
            assert table.slot_of(row["rid"]) == row["slot"] and table.rid_of(row["slot"]) == row["rid"]
            assert table.fill_tokens(row["slot"]).tolist() == fill
        want = self.waiting()
        assert [table.rid_of(s) for s in table.waiting_order().tolist()] == want
        order, count = table.waiting_order_static()
        assert int(count) == len(want)
        assert order[: len(want)].tolist() == table.waiting_order().tolist()
        assert sorted(order.tolist()) == list(range(table.capacity))


@pytest.mark.parametrize("seed", range(200))
def test_random_sequences_match_model(seed):
    rng = np.random.default_rng(seed)
    C = int(rng.integers(1, 10))
    T = int(rng.integers(10, 40))
    absent = INT64_MAX if seed % 2 else INT64_MIN
    table = _table(C, T, absent_priority=absent)
    model = Model(absent)
    n = 0
    now = 0.0
    max_prompt = int(rng.choice([4, 12]))
    for _ in range(16):
        op = rng.random()
        live = list(model.rows)
        now += 1.0
        if op < 0.35:
            reqs = []
            for _ in range(int(rng.integers(0, 4))):
                reqs.append(_req(rng, f"r{n}", max_prompt=max_prompt))
                n += 1
            state = [WAITING, WAITING, RUNNING, CHUNKED][int(rng.integers(4))]
            need_rows = len(reqs) > table.free_rows
            need_toks = sum(len(r.prompt_ids) + max(r.max_new_tokens, len(r.output_ids)) for r in reqs)
            if need_rows or need_toks > table.free_tokens:
                before = table.snapshot()
                with pytest.raises(CapacityError):
                    table.add(reqs, state=state, now=now)
                _assert_same_snapshot(before, table.snapshot())
            else:
                slots = table.add(reqs, state=state, now=now)
                assert slots.dtype == torch.int64 and len(slots) == len(reqs)
                model.add(reqs, state, now)
        elif op < 0.55 and live:
            pick = [live[i] for i in rng.permutation(len(live))[: int(rng.integers(1, len(live) + 1))]]
            table.remove([table.slot_of(r) for r in pick])
            for r in pick:
                del model.rows[r]
        elif op < 0.7 and live:
            pick = [live[i] for i in rng.permutation(len(live))[: int(rng.integers(1, len(live) + 1))]]
            table.requeue(torch.tensor([table.slot_of(r) for r in pick]), now)
            model.requeue(pick, now)
        elif op < 0.85 and live:
            room = [r for r in live if len(model.rows[r]["fill"]) < model.rows[r]["tok_cap"]]
            pick = [room[i] for i in rng.permutation(len(room))[: int(rng.integers(0, len(room) + 1))]]
            toks = rng.integers(0, INT32_MAX, len(pick), endpoint=True)
            table.append_tokens(np.array([table.slot_of(r) for r in pick], np.int64), toks)
            for r, t in zip(pick, toks.tolist()):
                model.rows[r]["fill"].append(t)
                model.rows[r]["output_len"] += 1
        elif op < 0.93 and live:
            pick = [live[i] for i in rng.permutation(len(live))[: int(rng.integers(1, len(live) + 1))]]
            st = [WAITING, RUNNING, CHUNKED][int(rng.integers(3))]
            table.set_state([table.slot_of(r) for r in pick], st)
            for r in pick:
                model.rows[r]["state"] = st
        elif op >= 0.97:
            table.compact()
            assert table.largest_free_range == table.free_tokens
        model.check(table)


def test_slot_recycling_is_lifo_and_queue_order_survives_removal():
    rng = np.random.default_rng(0)
    t = _table(C=5, T=100)
    s = t.add([_req(rng, f"r{i}") for i in range(5)])
    assert s.tolist() == [0, 1, 2, 3, 4]
    t.remove([3, 1])
    assert [t.rid_of(x) for x in t.waiting_order().tolist()] == ["r0", "r2", "r4"]
    s2 = t.add([_req(rng, "x"), _req(rng, "y")])
    assert s2.tolist() == [3, 1]  # first removed slot is reused first
    assert [t.rid_of(x) for x in t.waiting_order().tolist()] == ["r0", "r2", "r4", "x", "y"]
    t.requeue([0], now=9.0)
    assert [t.rid_of(x) for x in t.waiting_order().tolist()] == ["r2", "r4", "x", "y", "r0"]
    t.check_integrity()


def test_token_pool_holds_fills_and_append():
    t = _table(C=4, T=32)
    reqs = [Request("a", [5, 6, 7], 3), Request("b", [1], 2, output_ids=[9]), Request("c", [2, 2], 0)]
    slots = t.add(reqs).tolist()
    for r, s in zip(reqs, slots):
        assert t.fill_tokens(s).tolist() == r.fill_ids().tolist()
        off, cap = int(t.tok_off[s]), int(t.tok_cap[s])
        assert t.tokens[off:off + r.fill_len].tolist() == r.fill_ids().tolist()
        assert cap == len(r.prompt_ids) + r.max_new_tokens
    t.append_tokens([slots[0], slots[1]], [INT32_MAX, 0])
    assert t.fill_tokens(slots[0]).tolist() == [5, 6, 7, INT32_MAX]
    assert t.fill_tokens(slots[1]).tolist() == [1, 9, 0]
    assert t.output_len[slots[0]].item() == 1 and t.max_prefix_len[slots[0]].item() == 3
    out, ln = t.gather_fills(torch.tensor(slots + [-1]), 3)
    assert ln.tolist() == [4, 3, 2, 0]
    assert out.tolist() == [[5, 6, 7], [1, 9, 0], [2, 2, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="no room"):
        t.append_tokens([slots[1]], [1])  # b: prompt 1 + max_new 2 = 3 = fill
    t.check_integrity()


def test_max_prefix_len_tracks_logprob_cap():
    t = _table()
    s = t.add([Request("a", [1, 2, 3, 4], 5, return_logprob=True, logprob_start_len=4),
               Request("b", [1, 2], 5, return_logprob=True, logprob_start_len=-1),
               Request("c", [1, 2], 5, return_logprob=False, logprob_start_len=0)])
    assert t.max_prefix_len[s].tolist() == [3, 1, 1]
    t.append_tokens(s, [7, 7, 7])
    t.append_tokens(s, [7, 7, 7])
    assert t.max_prefix_len[s].tolist() == [4, 3, 3]
    t.check_integrity()


def _error_cases():
    """(name, callable(table, slots), exception, message fragment) run on a populated table."""
    bad_out = Request("bad_out", [1], 3)
    bad_out.output_ids.append(-3)
    return [
        ("dup in batch", lambda t, s: t.add([Request("n", [1], 1), Request("n", [2], 1)]), ValueError, "'n'"),
        ("dup live", lambda t, s: t.add([Request("n2", [1], 1), Request("a", [2], 1)]), ValueError, "'a'"),
        ("not a request", lambda t, s: t.add([Request("n", [1], 1), "x"]), TypeError, "requests[1]"),
        ("bad state", lambda t, s: t.add([Request("n", [1], 1)], state=FREE), ValueError, "state"),
        ("nan now", lambda t, s: t.add([Request("n", [1], 1)], now=float("nan")), ValueError, "now"),
        ("mutated output", lambda t, s: t.add([Request("n", [1], 1), bad_out]), ValueError, "output_ids"),
        ("max_new int32", lambda t, s: t.add([Request("n", [1], 2**31)]), ValueError, "max_new_tokens"),
        ("cap int32", lambda t, s: t.add([Request("n", [1, 2], INT32_MAX)]), ValueError, "prompt_len"),
        ("logprob int32", lambda t, s: t.add([Request("n", [1], 1, logprob_start_len=-2**40)]), ValueError,
         "logprob_start_len"),
        ("rows", lambda t, s: t.add([Request(f"n{i}", [1], 0) for i in range(3)]), CapacityError, "rows"),
        ("tokens", lambda t, s: t.add([Request("n", list(range(40)), 0)]), CapacityError, "tokens"),
        ("remove free", lambda t, s: t.remove([s[0], 5]), ValueError, "slot 5"),
        ("remove range", lambda t, s: t.remove([99]), ValueError, "slot 99"),
        ("remove negative", lambda t, s: t.remove([-1]), ValueError, "slot -1"),
        ("remove dup", lambda t, s: t.remove([s[0], s[1], s[0]]), ValueError, "more than once"),
        ("remove float", lambda t, s: t.remove(torch.tensor([0.0])), TypeError, "integers"),
        ("requeue free", lambda t, s: t.requeue([s[0], 6], now=1.0), ValueError, "slot 6"),
        ("requeue nan", lambda t, s: t.requeue([s[0]], now=float("nan")), ValueError, "now"),
        ("set_state free", lambda t, s: t.set_state([s[0]], FREE), ValueError, "state"),
        ("append full", lambda t, s: t.append_tokens([s[0], s[2]], [1, 1]), ValueError, "'c'"),
        ("append token big", lambda t, s: t.append_tokens([s[0], s[1]], [1, 2**31]), ValueError, "2147483648"),
        ("append token neg", lambda t, s: t.append_tokens([s[0]], [-1]), ValueError, "-1"),
        ("append token huge", lambda t, s: t.append_tokens([s[0]], [2**70]), ValueError, "int64"),
        ("append token float", lambda t, s: t.append_tokens([s[0]], [1.5]), TypeError, "integers"),
        ("append mismatch", lambda t, s: t.append_tokens([s[0], s[1]], [1]), ValueError, "shape"),
        ("append dup", lambda t, s: t.append_tokens([s[0], s[0]], [1, 2]), ValueError, "more than once"),
        ("rid_of free", lambda t, s: t.rid_of(5), ValueError, "slot 5"),
        ("slot_of unknown", lambda t, s: t.slot_of("zz"), KeyError, "zz"),
        ("gather bad slot", lambda t, s: t.gather_fills([3, 99], 2), ValueError, "99"),
    ]


@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[0])
def test_errors_change_nothing(case):
    _, fn, exc, frag = case
    t = _table(C=5, T=30)
    s = t.add([Request("a", [1, 2], 3, routing_key="k"), Request("b", [3], 2, extra_key="e"),
               Request("c", [4, 5], 0)], now=1.0).tolist()
    t.append_tokens([s[0]], [8])
    before = t.snapshot()
    with pytest.raises(exc) as info:
        fn(t, s)
    assert frag in str(info.value)
    _assert_same_snapshot(before, t.snapshot())
    t.check_integrity()


def test_routing_key_capacity_error_changes_nothing():
    t = _table(C=4, T=50, key_capacity=2)
    t.add([Request("a", [1], 1, routing_key="x"), Request("b", [1], 1, routing_key="y")])
    before = t.snapshot()
    with pytest.raises(CapacityError, match="routing keys"):
        t.add([Request("c", [1], 1, routing_key="z")])
    _assert_same_snapshot(before, t.snapshot())
    # a key held by no live row is reclaimed; keys still held keep their ids
    xid = t.intern_routing_key("x")
    t.remove([t.slot_of("b")])
    t.add([Request("c", [1], 1, routing_key="z")])
    assert t.intern_routing_key("x") == xid
    assert t.routing_rank("x") == 1 and t.routing_rank("z") == 2
    t.check_integrity()


@pytest.mark.parametrize("seed", range(20))
def test_routing_ranks_follow_python_str_order(seed):
    rng = np.random.default_rng(seed)
    keys = ["", "a", "b", "ab", "B", "é", "e\u0301", "z", "\U0001F600", "\uffff", "a\x00", "ä", "Zeta", " ",
            "aa", "a" * 30, "中文", "日本"]
    t = _table(C=64, T=512, key_capacity=len(keys))
    order = rng.permutation(len(keys))
    half = len(order) // 2
    for i in order[:half]:  # one at a time
        t.intern_routing_key(keys[i])
        t.check_integrity()
    # the rest through a batch add, in random order
    t.add([Request(f"r{j}", [1], 1, routing_key=keys[i]) for j, i in enumerate(order[half:])])
    ranked = sorted(keys, key=t.routing_rank)
    assert ranked == sorted(keys)
    assert t.routing_rank("") == 0 and t.intern_routing_key("") == -1 and t.intern_routing_key(None) == -1
    ranks = t.routing_rank_of_id.tolist()
    for k in keys[1:]:
        assert ranks[t.intern_routing_key(k)] == t.routing_rank(k)
    for row in t.to_host_rows():
        assert row["routing_key_rank"] == t.routing_rank(row["routing_key"])
    t.check_integrity()


def test_capacity_exactly_full_then_plus_one():
    t = _table(C=3, T=12)
    reqs = [Request("a", [1, 2], 2), Request("b", [3], 3), Request("c", [4, 5, 6], 1)]  # 4 + 4 + 4 = 12
    t.add(reqs)
    assert len(t) == 3 and t.free_rows == 0 and t.free_tokens == 0
    t.check_integrity()
    before = t.snapshot()
    with pytest.raises(CapacityError, match="rows"):
        t.add([Request("d", [1], 0)])
    _assert_same_snapshot(before, t.snapshot())
    t.remove([t.slot_of("b")])
    before = t.snapshot()
    with pytest.raises(CapacityError, match="tokens"):
        t.add([Request("d", [1, 2, 3], 2)])  # needs 5, 4 free
    _assert_same_snapshot(before, t.snapshot())
    t.add([Request("d", [1, 2, 3], 1)])  # exactly 4
    assert t.free_tokens == 0
    t.check_integrity()


def test_fragmentation_triggers_compaction():
    t = _table(C=8, T=16)
    reqs = [Request(f"r{i}", [i + 1, i + 1], 0) for i in range(8)]  # 8 x 2 tokens
    t.add(reqs)
    t.remove([t.slot_of(f"r{i}") for i in range(0, 8, 2)])  # four 2-token holes
    assert t.free_tokens == 8 and t.largest_free_range == 2
    offs_before = t.tok_off.clone()
    s = t.add([Request("big", [7] * 6, 2)])  # needs 8: fits only after compaction
    assert t.fill_tokens(int(s[0])).tolist() == [7] * 6
    for i in range(1, 8, 2):
        assert t.fill_tokens(t.slot_of(f"r{i}")).tolist() == [i + 1, i + 1]
    assert not torch.equal(offs_before, t.tok_off)
    assert t.free_tokens == 0
    t.check_integrity()


@pytest.mark.parametrize("seed", range(30))
def test_compaction_keeps_fills_random(seed):
    rng = np.random.default_rng(seed)
    t = _table(C=24, T=60)
    model = Model(INT64_MIN)
    n = 0
    while True:  # fill the pool with small requests
        r = _req(rng, f"r{n}", max_prompt=3, max_new=2)
        try:
            t.add([r])
        except CapacityError:
            break
        model.add([r], WAITING, 0.0)
        n += 1
    live = list(model.rows)
    gone = [live[i] for i in rng.permutation(len(live))[: len(live) // 2]]
    t.remove([t.slot_of(r) for r in gone])
    for r in gone:
        del model.rows[r]
    free = t.free_tokens
    r = Request("big", rng.integers(0, 9, free).tolist(), 0)  # exactly the free room
    t.add([r])
    model.add([r], WAITING, 0.0)
    assert t.free_tokens == 0
    model.check(t)


def test_free_ranges_coalesce():
    t = _table(C=4, T=12)
    t.add([Request(f"r{i}", [1, 2, 3], 0) for i in range(4)])
    t.remove([t.slot_of("r1"), t.slot_of("r2")])
    assert t.largest_free_range == 6  # neighbours merged
    t.remove([t.slot_of("r0"), t.slot_of("r3")])
    assert t.largest_free_range == 12
    t.check_integrity()


def test_constructor_validation():
    with pytest.raises(ValueError, match="capacity"):
        RequestTable(0, 10, absent_priority=INT64_MIN)
    with pytest.raises(TypeError, match="token_capacity"):
        RequestTable(1, 2.0, absent_priority=INT64_MIN)
    with pytest.raises(ValueError, match="absent_priority"):
        RequestTable(1, 10, absent_priority=0)
    t = RequestTable(2, 10, absent_priority=INT64_MAX)
    for name, dtype, _ in COLUMNS:
        col = getattr(t, name)
        assert col.dtype == dtype and col.shape == (2,), name


def test_columns_never_reallocated():
    rng = np.random.default_rng(1)
    t = _table(C=6, T=40)
    ptrs = {n: c.data_ptr() for n, c in t.columns().items()}
    ptrs["tokens"] = t.tokens.data_ptr()
    ptrs["rank"] = t.routing_rank_of_id.data_ptr()
    for i in range(30):
        live = [t.rid_of(s) for s in t.waiting_order().tolist()]
        if len(live) >= 4:
            t.remove([t.slot_of(live[0]), t.slot_of(live[2])])
        try:
            t.add([_req(rng, f"q{i}")])
        except CapacityError:
            pass
        t.compact()
    now = {n: c.data_ptr() for n, c in t.columns().items()}
    now["tokens"] = t.tokens.data_ptr()
    now["rank"] = t.routing_rank_of_id.data_ptr()
    assert now == ptrs


def _populated(device):
    t = RequestTable(16, 256, device, absent_priority=INT64_MIN)
    t.add([Request(f"r{i}", [i + 1] * (i + 1), 3, routing_key=KEYS[i % len(KEYS)]) for i in range(10)])
    return t


def test_static_waiting_order_on_meta_device():
    """A meta tensor has no data: any host sync (`.item()`, `nonzero`, `.tolist()`) on it fails,
    so running the static-shape readers on a meta table shows they never read the device."""
    t = _populated("meta")
    order, count = t.waiting_order_static()
    assert order.device.type == "meta" and order.shape == (16,) and order.dtype == torch.int64
    assert count.device.type == "meta" and count.shape == ()
    mask = t.waiting_mask()
    assert mask.shape == (16,) and mask.dtype == torch.bool
    fills, lens = t.gather_fills(torch.zeros(4, dtype=torch.int64, device="meta"), 8)
    assert fills.shape == (4, 8) and fills.dtype == torch.int32 and lens.shape == (4,)


def test_static_waiting_order_compiles_fullgraph():
    """torch.compile(fullgraph=True) raises on any graph break, which a host sync would cause.
    The `aot_eager` backend needs no C++ toolchain, so this runs on any CPU machine."""
    t = _populated("cpu")
    t.requeue([t.slot_of("r2"), t.slot_of("r0")], now=5.0)
    t.set_state([t.slot_of("r5")], RUNNING)
    torch._dynamo.reset()
    fn = torch.compile(t.waiting_order_static, fullgraph=True, backend="aot_eager")
    order, count = fn()
    want = t.waiting_order()
    assert int(count) == len(want) == 9
    assert order[:9].tolist() == want.tolist()
    assert [t.rid_of(s) for s in want.tolist()][-2:] == ["r2", "r0"]
    gf = torch.compile(lambda s: t.gather_fills(s, 12), fullgraph=True, backend="aot_eager")
    out, ln = gf(order)
    ref_out, ref_ln = t.gather_fills(order, 12)
    assert torch.equal(out, ref_out) and torch.equal(ln, ref_ln)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_and_no_sync():
    rng = np.random.default_rng(3)
    t = RequestTable(32, 1024, "cuda", absent_priority=INT64_MIN)
    model = Model(INT64_MIN)
    reqs = [_req(rng, f"r{i}") for i in range(20)]
    t.add(reqs, now=1.0)
    model.add(reqs, WAITING, 1.0)
    t.requeue([t.slot_of("r3")], now=2.0)
    model.requeue(["r3"], 2.0)
    model.check(t)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        order, count = t.waiting_order_static()
        t.gather_fills(order, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(count) == 20
