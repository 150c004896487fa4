"""The reference scheduler's step (SPEC.md R-STEP-1..4) and decode side (R-DEC-2/3), with
`check_integrity()` after every call of the multi-step flows."""

import pytest

from gpu_sched import PrefillPlan, Request, SchedulerConfig
from gpu_sched.plan import STOP_REASONS, DecisionDigest
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.scheduler import GpuScheduler


def R(rid, prompt, max_new=4, **kw):
    return Request(rid, list(prompt), max_new, **kw)


def mk(pool=1000, **cfg):
    return ReferenceScheduler(SchedulerConfig(**cfg), pool)


def toks(start, n):
    return list(range(start, start + n))


def qids(s):
    return [r.rid for r in s.queue]


def run_ids(s):
    return [r.rid for r in s.running]


class Checked:
    """Wraps a scheduler and runs check_integrity() after every engine call."""

    def __init__(self, s):
        self.s = s
        s.check_integrity()

    def __getattr__(self, name):
        fn = getattr(self.s, name)
        if not callable(fn):
            return fn

        def call(*a, **k):
            out = fn(*a, **k)
            self.s.check_integrity()
            return out

        return call


# ---- R-STEP-1 -----------------------------------------------------------------------------------
def test_r_step_1_empty_queue_no_prefill():
    """R-STEP-1: empty queue, no chunked request: no prefill batch, nothing ordered."""
    s = mk()
    plan = s.step(1.0)
    assert plan.stop == "no_prefill_empty" and not plan.ordered and plan.admitted == []
    assert plan.budgets is None and plan.budgets_start is None and plan.batch_is_full is False
    assert plan.available == 1000


def test_r_step_1_full_mark_exit_and_sticky():
    """R-STEP-1: with requests running and preemption off, a set full mark is kept and the step
    returns no prefill batch without ordering; the queue is untouched."""
    s = mk(schedule_policy="lof")
    s.seed_running(R("run", [1], 10, output_ids=[5]))
    s.submit([R("a", [2], 1), R("b", [3], 50)])
    s.batch_is_full = True
    plan = s.step(1.0)
    assert plan.stop == "no_prefill_full" and not plan.ordered and plan.batch_is_full is True
    assert qids(s) == ["a", "b"] and plan.queue_order == ["a", "b"]
    assert s.step(1.0).stop == "no_prefill_full"  # stays set


def test_r_step_1_full_mark_cleared_when_nothing_runs():
    """R-STEP-1: the full mark is cleared at the start when the running batch is empty."""
    s = mk()
    s.submit([R("a", [2])])
    s.batch_is_full = True
    plan = s.step(1.0)
    assert plan.admitted_rids == ["a"] and plan.batch_is_full is False


def test_r_step_1_full_mark_cleared_when_preemption_enabled():
    """R-STEP-1: with priority preemption on the mark is cleared at every step start."""
    s = mk(enable_priority_scheduling=True, enable_priority_preemption=True)
    s.seed_running(R("run", [1], 10, output_ids=[5]))
    s.submit([R("a", [2])])
    s.batch_is_full = True
    plan = s.step(1.0)
    assert plan.admitted_rids == ["a"] and plan.batch_is_full is False


def test_r_step_1_max_running_exit_before_ordering():
    """R-STEP-1: len(running) >= max_running_requests, no chunked request, preemption off: mark
    full and return before ordering (lof would have put b first; no match call either)."""
    s = mk(schedule_policy="lof", max_running_requests=2)
    s.seed_cache([2, 3])
    s.seed_running(R("r1", [1], 10, output_ids=[5]))
    s.seed_running(R("r2", [9], 10, output_ids=[5]))
    s.submit([R("a", [2, 3, 4], 1), R("b", [3], 50)])
    clock = s.cache.clock
    plan = s.step(1.0)
    assert plan.stop == "no_prefill_max_running" and plan.batch_is_full is True and not plan.ordered
    assert plan.active_policy is None and plan.queue_order == ["a", "b"] and qids(s) == ["a", "b"]
    assert s.cache.clock == clock
    # next step: the mark is now set (requests still run): the full-mark exit
    assert s.step(1.0).stop == "no_prefill_full"


def test_r_step_1_chunked_request_bypasses_exits():
    """R-STEP-1: with a chunked request in flight neither the full mark nor max_running stops
    the step; the chunk is admitted (R-ADM-5) and then the queue stops at the cap (R-STEP-3.2):
    running 1 + can_run 1 >= 1."""
    s = mk(max_running_requests=1)
    s.seed_running(R("run", [1], 10, output_ids=[5]))
    s.seed_chunked(R("c", toks(10, 6), 3), 2)
    s.submit([R("q", [7])])
    s.batch_is_full = True
    plan = s.step(1.0)
    assert plan.admitted == [("c", 2, 6)] and plan.stop == "batch_full" and plan.batch_is_full
    assert qids(s) == ["q"]
    s.check_integrity()


def test_r_step_1_sticky_full_mark_over_a_flow():
    """R-STEP-1/3.2 over steps: cap 1: a admitted, b stops the step at the cap (mark set);
    after a's prefill the mark stays (a runs); once a finishes (nothing runs) it is cleared."""
    s = Checked(mk(max_running_requests=1))
    s.submit([R("a", [1, 2], 2), R("b", [3, 4], 2)])
    p1 = s.step(1.0)
    assert p1.admitted_rids == ["a"] and p1.stop == "batch_full" and p1.batch_is_full
    s.complete_prefill({"a": 9})
    p2 = s.step(1.0)
    assert p2.stop == "no_prefill_full" and p2.admitted == []
    s.finish(["a"])
    p3 = s.step(1.0)
    assert p3.admitted_rids == ["b"] and p3.batch_is_full is False and p3.stop == "queue_end"


# ---- R-STEP-2 / R-STEP-3 ------------------------------------------------------------------------
def test_r_step_2_order_then_chunked_first_then_queue():
    """R-STEP-2: the queue is ordered (lpm: b matches 3, a 0) and the in-flight chunked request
    is admitted before any queued one."""
    s = mk(schedule_policy="lpm")
    s.seed_cache([5, 6, 7])
    s.seed_chunked(R("c", toks(100, 8), 2), 4)
    s.submit([R("a", [1, 2]), R("b", [5, 6, 7, 8])])
    plan = s.step(1.0)
    assert plan.queue_order == ["b", "a"] and plan.num_matched == [3, 0]
    assert plan.admitted == [("c", 4, 8), ("b", 3, 4), ("a", 0, 2)]
    s.check_integrity()


def test_r_step_3_1_budget_other_stops_before_the_next_request():
    """R-STEP-3.1: chunk 8, chunked request with 30 left: it takes the whole chunk (rem_chunk 0),
    so the budget is OTHER before the first queued request."""
    s = mk(chunked_prefill_size=8)
    s.seed_chunked(R("c", toks(1, 30), 2), 0)
    s.submit([R("q", [99])])
    plan = s.step(1.0)
    assert plan.admitted == [("c", 0, 8)] and plan.stop == "budget_other"
    assert plan.budgets["rem_chunk"] == 0 and qids(s) == ["q"]


def test_r_step_3_2_cap_marks_full():
    """R-STEP-3.2: cap 2, nothing running: a and b admitted, then 0 + 2 >= 2: full, stop."""
    s = mk(max_running_requests=2)
    s.submit([R("a", [1]), R("b", [2]), R("c", [3])])
    plan = s.step(1.0)
    assert plan.admitted_rids == ["a", "b"] and plan.stop == "batch_full" and plan.batch_is_full
    assert qids(s) == ["c"]


def test_r_step_3_4_rematch_caps_at_max_prefix_len():
    """R-STEP-3.4: admission re-matches fill[:max_prefix_len]: a fully cached prompt of 10
    extends its last token [9, 10); with logprobs from 4 the prefix is 4: [4, 11)."""
    s = mk()
    s.seed_cache(toks(1, 10))
    s.submit([R("full", toks(1, 10)), R("lp", toks(1, 10) + [11], return_logprob=True, logprob_start_len=4)])
    plan = s.step(1.0)
    assert plan.admitted == [("full", 9, 10), ("lp", 4, 11)]
    assert (plan.log_hit_tokens, plan.log_input_tokens) == (13, 8)
    s.check_integrity()


def test_r_step_3_5_no_token_full_mark_reflects_running_or_admitted():
    """R-STEP-3.5: after NO_TOKEN the mark is whether anything runs or was admitted.
    pool 10: a (total 2 + 4 + 1 = 7 < 10) admitted; b (total 7 >= 10 - 7 = 3) NO_TOKEN: full."""
    s = mk(10)
    s.submit([R("a", [1, 2]), R("b", [3, 4])])
    plan = s.step(1.0)
    assert plan.admitted_rids == ["a"] and plan.stop == "add_no_token" and plan.batch_is_full is True
    s = mk(5)
    s.submit([R("a", [1, 2])])
    plan = s.step(1.0)
    assert plan.admitted == [] and plan.stop == "add_no_token" and plan.batch_is_full is False


# ---- R-STEP-4 -----------------------------------------------------------------------------------
def test_r_step_4_admitted_leave_queue_rest_keep_new_order():
    """R-STEP-4: admitted requests leave the queue (can_run in admission order); the others stay
    in the new order (lof: c 50, a 30, b 20, d 10; prefill_max_requests 2)."""
    s = mk(schedule_policy="lof", prefill_max_requests=2)
    s.submit([R("a", [1], 30), R("b", [2], 20), R("c", [3], 50), R("d", [4], 10)])
    plan = s.step(1.0)
    assert plan.queue_order == ["c", "a", "b", "d"]
    assert plan.admitted == [("c", 0, 1), ("a", 0, 1)]
    assert qids(s) == ["b", "d"]
    assert plan.stop in STOP_REASONS
    assert plan.extend_tokens == 2 and plan.admitted_rids == ["c", "a"]


def test_r_step_4_step_requires_complete_prefill_first():
    s = mk()
    s.submit([R("a", [1])])
    s.step(1.0)
    with pytest.raises(RuntimeError, match="complete_prefill"):
        s.step(1.0)
    with pytest.raises(ValueError, match="'a'"):
        s.complete_prefill({})  # a finished its prefill: it needs its first token
    s.check_integrity()
    s.complete_prefill({"a": 3})
    assert run_ids(s) == ["a"]


def test_plan_decision_bytes_and_digest():
    """R-STEP-4 output, serialised: admitted ranges, chunked request after, preempted rids."""
    p = PrefillPlan(admitted=[("a", 0, 3), ("b", 2, 4)], chunked_rid_after="b", preempted=["x", "y"])
    assert p.decision_bytes() == b"a:0:3|b:2:4|c=b|p=x,y\n"
    d1, d2 = DecisionDigest(), DecisionDigest()
    d1.update(p)
    d2.update(PrefillPlan(admitted=[("a", 0, 3), ("b", 2, 4)], chunked_rid_after="b", preempted=["x", "y"]))
    assert d1.hexdigest() == d2.hexdigest() and d1.steps == 1
    d2.update(PrefillPlan())
    assert d1.hexdigest() != d2.hexdigest()


# ---- multi-step flow (R-DEC-3) ----------------------------------------------------------------------
def test_flow_submit_step_prefill_decode_finish_then_prefix_reuse():
    """submit -> step -> complete_prefill -> decode -> finish with check_integrity after every
    call; finished sequences are then matched (R-DEC-3).
    a: prompt [1..8], first token 100, decode 101: kv_len 9; finish caches [1..8,100] (9 slots).
    b = [1..8,100,55] matches 9; c = [1,2,3,4,77] matches 4 (splitting [1..8,100] at 4)."""
    s = Checked(mk(64, schedule_policy="lpm"))
    s.submit([R("a", toks(1, 8), 3)])
    p = s.step(1.0)
    assert p.admitted == [("a", 0, 8)] and p.available == 64
    s.complete_prefill({"a": 100})
    assert (s.available, s.evictable, s.protected) == (56, 0, 0)
    s.decode({"a": 101})
    assert s.available == 55 and s.s.running[0].req.output_ids == [100, 101]
    s.finish(["a"])
    assert (s.available, s.evictable, s.protected) == (55, 9, 0)
    assert s.running == [] and "a" not in s.reqs
    s.submit([R("b", toks(1, 8) + [100, 55], 3), R("c", [1, 2, 3, 4, 77], 3)])
    p = s.step(1.0)
    assert p.queue_order == ["b", "c"] and p.num_matched == [9, 4]
    assert p.admitted == [("b", 9, 10), ("c", 4, 5)]
    assert (p.log_hit_tokens, p.log_input_tokens) == (13, 2)
    assert (p.evictable, p.protected) == (0, 9)
    s.complete_prefill({"b": 200, "c": 201})
    assert s.available == 53
    s.decode({"b": 300, "c": 301})
    assert s.available == 51
    s.finish(["c"])  # caches [1,2,3,4,77,201]: the new leaf [77,201] (2) is evictable
    assert (s.available, s.evictable, s.protected) == (51, 2, 9)
    s.finish(["b"])  # caches [..,100,55,200]: new leaf [55,200]
    assert (s.available, s.evictable, s.protected) == (51, 13, 0)
    s.submit([R("d", toks(1, 8) + [100, 55, 200, 9])])
    p = s.step(1.0)
    assert p.admitted == [("d", 11, 12)]


def test_r_dec_3_finish_page_aligned_insert_frees_tail():
    """R-DEC-3 with P = 4: prompt 6 + one decoded token: kv_len 7; finish inserts floor4(7) = 4
    tokens and frees the other 3 slots: available 32 - 7 + 3 = 28, evictable 4."""
    s = Checked(mk(32, page_size=4))
    s.submit([R("a", toks(1, 6), 4)])
    assert s.step(1.0).admitted == [("a", 0, 6)]
    s.complete_prefill({"a": 50})
    s.decode({"a": 51})
    assert s.available == 25
    s.finish(["a"])
    assert (s.available, s.evictable, s.protected) == (28, 4, 0)


def test_r_dec_3_finish_frees_duplicate_kv():
    """R-DEC-3: two requests with the same prompt computed it twice (pool 20: a total 3 + 4 + 1
    = 8 < 20, b 8 < 20 - 8). Each holds 4 slots (prompt 3 + 1 decode): available 12. Finishing
    a caches its 4; finishing b finds them present and frees its own 4: available 16."""
    s = Checked(mk(20))
    s.submit([R("a", [1, 2, 3]), R("b", [1, 2, 3])])
    assert s.step(1.0).admitted == [("a", 0, 3), ("b", 0, 3)]
    s.complete_prefill({"a": 7, "b": 7})
    s.decode({"a": 8, "b": 8})
    assert s.available == 12
    s.finish(["a"])
    assert (s.available, s.evictable) == (12, 4)
    s.finish(["b"])
    assert (s.available, s.evictable) == (16, 4)


def test_r_dec_3_chunked_prefix_inserted_and_lock_moved():
    """R-DEC-3: chunk 4, prompt 10: chunks [0,4), [4,8), [8,10). After each chunk's prefill the
    prefilled part is cached and locked (protected 4, then 8); the last chunk finishes the
    prefill and the request runs."""
    s = Checked(mk(64, chunked_prefill_size=4))
    s.submit([R("a", toks(1, 10), 2)])
    p = s.step(1.0)
    assert p.admitted == [("a", 0, 4)] and p.new_chunked_rid == "a" and p.chunked_rid_after == "a"
    s.complete_prefill({})
    assert (s.available, s.evictable, s.protected) == (60, 0, 4)
    p = s.step(1.0)
    assert p.admitted == [("a", 4, 8)] and p.new_chunked_rid is None and p.chunked_rid_after == "a"
    s.complete_prefill({})
    assert (s.available, s.evictable, s.protected) == (56, 0, 8)
    p = s.step(1.0)
    assert p.admitted == [("a", 8, 10)] and p.chunked_rid_after is None
    s.complete_prefill({"a": 77})
    assert run_ids(s) == ["a"] and s.chunked is None
    assert (s.available, s.evictable, s.protected) == (54, 0, 8)
    s.decode({"a": 78})
    s.finish(["a"])
    assert (s.available, s.evictable, s.protected) == (53, 11, 0)  # [1..10, 77] cached


def test_r_adm_5_unaligned_chunks_page4_cache_page_aligned_part():
    """R-ADM-5 / R-DEC-3 with P = 4, chunk 10, prompt 30: the first chunk is page-aligned by
    R-ADM-3.7 (floor4(10) = 8: [0, 8)); continuing chunks take min(ext, room = 10) unaligned:
    [8, 18), [18, 28), then the last [28, 30). After each chunk floor4(done) tokens are cached
    and locked (8, 16, 28); the remainder stays private (18 - 16 = 2)."""
    s = Checked(mk(200, page_size=4, chunked_prefill_size=10))
    s.submit([R("a", toks(1, 30), 5)])
    expect = [((0, 8), 192, 8), ((8, 18), 182, 16), ((18, 28), 172, 28)]
    for (start, end), avail, prot in expect:
        p = s.step(1.0)
        assert p.admitted == [("a", start, end)] and p.chunked_rid_after == "a"
        s.complete_prefill({})
        assert (s.available, s.evictable, s.protected) == (avail, 0, prot)
    p = s.step(1.0)
    assert p.admitted == [("a", 28, 30)] and p.chunked_rid_after is None
    s.complete_prefill({"a": 99})
    assert run_ids(s) == ["a"] and (s.available, s.protected) == (170, 28)


def test_r_dec_3_disabled_cache_finish_frees_everything():
    """R-RC-8 / R-DEC-3: with the cache disabled a finished request frees all its slots."""
    s = Checked(mk(16, disable_radix_cache=True))
    s.submit([R("a", [1, 2, 3])])
    s.step(1.0)
    s.complete_prefill({"a": 4})
    s.decode({"a": 5})
    s.finish(["a"])
    assert (s.available, s.evictable, s.protected) == (16, 0, 0)


# ---- R-DEC-2 retraction -------------------------------------------------------------------------------
def test_r_dec_2_retract_order_and_requeue():
    """R-DEC-2: running A (prompt 5, out 3), B (prompt 8, out 1), C (prompt 4, out 1) hold
    8 + 9 + 5 = 22 of 23 slots; a decode needs 3 > 1. Order by descending (out, -prompt):
    A (3,-5), C (1,-4), B (1,-8); retract from the end: B frees 9 -> 10 free >= 2: stop.
    B rejoins the queue tail with its output and prefix_len 0."""
    s = Checked(mk(23))
    s.seed_running(R("A", toks(1, 5), 10, output_ids=[0, 0, 0]))
    s.seed_running(R("B", toks(100, 8), 10, output_ids=[0]))
    s.seed_running(R("C", toks(200, 4), 10, output_ids=[0]))
    s.submit([R("q", [999])])
    assert s.available == 1 and s.decode_tokens_needed() == 3
    assert s.retract_decode() == ["B"]
    assert run_ids(s) == ["A", "C"] and qids(s) == ["q", "B"]
    b = s.queue[1]
    assert b.retracted and b.prefix_len == 0 and b.kv_len == 0 and b.req.output_ids == [0]
    assert s.available == 10
    assert s.retract_decode() == []  # fits now: nothing more
    s.decode({"A": 1, "C": 2})
    assert s.available == 8


def test_r_dec_2_retract_several_and_keep_one():
    """R-DEC-2: X and Y hold no private slot (prompt fully cached, no output) and share the
    locked prefix; pool exhausted. Retracting frees nothing, yet at least one request is kept."""
    s = Checked(mk(3))
    s.seed_cache([1, 2, 3])
    s.seed_running(R("X", [1, 2, 3], 5))
    s.seed_running(R("Y", [1, 2, 3], 5))
    assert s.available == 0
    assert s.retract_decode() == ["Y"]  # equal keys: the later one in the batch goes first
    assert run_ids(s) == ["X"] and (s.evictable, s.protected) == (0, 3)


def test_r_dec_2_retraction_evicts_cache_first():
    """R-DEC-2: A (prompt 2, out 2) and B (prompt 3, out 1) hold 4 + 4 of pool 13, the other 5
    are cached (evictable): the decode needs 2 > 0 free, evicting the cache frees 5: it fits,
    nothing is retracted. Then C (prompt 3, out 2) takes those 5: order A (2,-2), C (2,-3),
    B (1,-3); B is retracted (frees 4 >= 2)."""
    s = Checked(mk(13))
    s.seed_cache(toks(50, 5))
    s.seed_running(R("A", [1, 2], 9, output_ids=[0, 0]))
    s.seed_running(R("B", [3, 4, 5], 9, output_ids=[0]))
    assert (s.available, s.evictable) == (0, 5)
    assert s.retract_decode() == []
    assert (s.available, s.evictable) == (5, 0)
    s.seed_running(R("C", [6, 7, 8], 9, output_ids=[0, 0]))  # 5 private slots
    assert s.available == 0
    assert s.retract_decode() == ["B"]
    assert run_ids(s) == ["A", "C"] and s.available == 4


def test_r_dec_2_decode_tokens_needed_pages():
    """R-DEC-2: one new page for each request whose length is a multiple of P (P = 4): fill
    lengths 8 (page) and 7: pages 1 -> max(2, 4) = 4; both 8: 8; P = 1: one each."""
    s = mk(100, page_size=4)
    s.seed_running(R("a", toks(1, 7), 5, output_ids=[0]))  # fill 8
    s.seed_running(R("b", toks(20, 6), 5, output_ids=[0]))  # fill 7
    assert s.decode_tokens_needed() == 4
    s2 = mk(100, page_size=4)
    s2.seed_running(R("a", toks(1, 7), 5, output_ids=[0]))
    s2.seed_running(R("b", toks(20, 7), 5, output_ids=[0]))
    assert s2.decode_tokens_needed() == 8
    s3 = mk(100)
    s3.seed_running(R("a", [1], 5))
    s3.seed_running(R("b", [2], 5))
    assert s3.decode_tokens_needed() == 2


def test_r_dec_2_retracted_request_readmitted_with_its_output():
    """R-DEC-2 then R-STEP: the retracted request is re-admitted with fill = prompt + output
    (its extend range covers both)."""
    s = Checked(mk(23))
    s.seed_running(R("A", toks(1, 5), 10, output_ids=[0, 0, 0]))
    s.seed_running(R("B", toks(100, 8), 10, output_ids=[7]))
    s.seed_running(R("C", toks(200, 4), 10, output_ids=[0]))
    assert s.retract_decode() == ["B"]
    s.finish(["A", "C"])  # their 8 + 5 slots become cached (evictable): A 10, evictable 13
    assert (s.available, s.evictable) == (10, 13)
    p = s.step(1.0)  # B: fill 9, total 9 + 9 + 1 = 19 < 23
    assert p.admitted == [("B", 0, 9)]


# ---- abort / errors -----------------------------------------------------------------------------------
def test_abort_from_queue_running_and_chunked():
    s = Checked(mk(64, chunked_prefill_size=4))
    s.submit([R("b", [50]), R("a", toks(1, 10))])
    assert s.step(1.0).admitted == [("b", 0, 1), ("a", 0, 3)]  # a chunked: rem_chunk 4 - 1 = 3
    s.complete_prefill({"b": 1})
    assert s.chunked is not None and run_ids(s) == ["b"]
    s.abort(["a", "b"])
    assert s.chunked is None and s.running == [] and s.queue == []
    assert (s.available, s.evictable, s.protected) == (61, 3, 0)  # a's cached chunk stays
    with pytest.raises(ValueError, match="unknown"):
        s.abort(["zzz"])


def test_finish_and_decode_errors():
    s = mk()
    s.seed_running(R("a", [1], 3, output_ids=[2]))
    with pytest.raises(ValueError, match="not running"):
        s.finish(["nope"])
    with pytest.raises(ValueError, match="missing"):
        s.decode({})
    s.check_integrity()


def test_scheduler_check_integrity_catches_pool_corruption():
    """The scheduler-level invariant (R-RC-6 with the pool) really checks."""
    s = mk(20)
    s.seed_cache([1, 2, 3])
    s.seed_running(R("a", [1, 2, 3, 4], 5, output_ids=[9]))
    s.check_integrity()
    s.pool._n_free -= 1  # a slot lost
    with pytest.raises(AssertionError, match="pool accounting"):
        s.check_integrity()
    s = mk(20)
    s.seed_running(R("a", [1, 2], 5, output_ids=[9]))
    r = s.running[0]
    r.kv[r.cached_len] = s.pool.free_slots()[0]  # a private slot that is also free
    with pytest.raises(AssertionError, match="owned twice"):
        s.check_integrity()
    s = mk(20)
    s.seed_cache([1, 2, 3])
    s.seed_running(R("a", [1, 2, 3, 4], 5, output_ids=[9]))
    r = s.running[0]
    r.kv[0] = 19  # cached slot no longer the locked path's
    with pytest.raises(AssertionError, match="locked path"):
        s.check_integrity()


def test_seed_chunked_validation():
    s = mk()
    with pytest.raises(ValueError, match="done"):
        s.seed_chunked(R("c", [1, 2, 3]), 3)
    s.seed_chunked(R("c", [1, 2, 3]), 1)
    with pytest.raises(ValueError, match="already"):
        s.seed_chunked(R("d", [1, 2, 3]), 1)


@pytest.mark.parametrize("make", ["reference", "torch"])
def test_seed_chunked_with_chunking_off_is_refused(make):
    """With chunking off no request can be the chunked one (R-ADM-5 reads rem_chunk, unset
    then): seeding one is refused, nothing changed, and steps go on (they raised TypeError
    in R-ADM-5 before)."""
    from gpu_sched.scheduler import GpuScheduler

    cfg = SchedulerConfig(chunked_prefill_size=None)
    s = ReferenceScheduler(cfg, 100) if make == "reference" else GpuScheduler(cfg, 100)
    with pytest.raises(ValueError, match="chunking is off"):
        s.seed_chunked(R("c", list(range(1, 41)), 4), 8)
    assert s.chunked is None and s.pool.available == 100 and "c" not in s.reqs
    s.check_integrity()
    s.submit([R("a", [1, 2, 3], 2)])
    assert s.step(0.7).admitted == [("a", 0, 3)]


# ---- randomized flows -----------------------------------------------------------------------------------
def _random_flow(seed, steps=40):
    """Random configs and workloads through submit/step/complete_prefill/retract/decode/finish,
    with check_integrity() after every call and the pool conserved throughout."""
    import random

    rng = random.Random(seed)
    prio = rng.random() < 0.4
    cfg = SchedulerConfig(
        schedule_policy=rng.choice(["fcfs", "lof", "lpm", "dfs-weight", "random", "routing-key"]),
        page_size=rng.choice([1, 2, 4]),
        chunked_prefill_size=rng.choice([None, 8, 16, 64]),
        max_prefill_tokens=rng.choice([32, 128, 16384]),
        max_running_requests=rng.choice([None, 2, 4]),
        disable_radix_cache=rng.random() < 0.2,
        enable_priority_scheduling=prio,
        enable_priority_preemption=prio and rng.random() < 0.6,
        prefill_max_requests=rng.choice([None, 2]),
        truncation_align_size=rng.choice([None, None, 3]),
        enable_mixed_chunk=rng.random() < 0.3,
        in_batch_prefix_caching_deprioritize_threshold=rng.choice([4, 32]),
        in_batch_prefix_caching_check_threshold=rng.choice([-1, 8, 32]),
        lpm_fallback_queue_len=rng.choice([None, 3]),
    )
    pool_size = rng.choice([120, 300, 1000])
    s = Checked(ReferenceScheduler(cfg, pool_size))
    bases = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    n = tok = admitted = finished = 0
    for it in range(steps):
        if rng.random() < 0.5:
            reqs = []
            for _ in range(rng.randrange(1, 4)):
                prompt = rng.choice(bases + [[]]) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
                reqs.append(Request(f"r{n}", prompt, rng.randrange(1, 10), ignore_eos=rng.random() < 0.3,
                                    priority=rng.choice([None, 0, 5, 20]), routing_key=rng.choice([None, "a", "b"]),
                                    extra_key=rng.choice([None, None, "x"])))
                n += 1
            s.submit(reqs, now=it)
        plan = s.step(rng.choice([1.0, 0.5, 0.137]), now=it)
        assert plan.stop in STOP_REASONS
        assert len(set(plan.admitted_rids)) == len(plan.admitted_rids)
        assert not set(plan.admitted_rids) & set(plan.preempted)
        first = {}
        for rid, start, end in plan.admitted:
            assert 0 <= start < end
            tok += 1
            first[rid] = tok
        admitted += len(plan.admitted)
        s.complete_prefill(first)
        if s.running:
            if not s.s.decode_fits():
                s.retract_decode()
            if s.s.decode_fits():
                s.decode({r.rid: 100 + it for r in s.running})
            done = [r.rid for r in s.running if len(r.req.output_ids) >= r.max_new or rng.random() < 0.1]
            s.finish(done)
            finished += len(done)
        held = sum(len(r.private_slots()) for r in s.s.holders())
        assert s.available + s.evictable + s.protected + held == pool_size  # R-RC-6
    return admitted, finished


@pytest.mark.parametrize("seed", range(40))
def test_random_flows_keep_integrity(seed):
    admitted, finished = _random_flow(seed)
    assert admitted > 0 and finished > 0


@pytest.mark.parametrize("cls", [ReferenceScheduler, GpuScheduler])
def test_flush_cache_keeps_locked_prefixes(cls):
    """flush_cache evicts every unlocked cached token and keeps a prefix an admitted request
    locked; it returns the tokens freed."""
    s = cls(SchedulerConfig(page_size=1), 100)
    s.seed_cache([1, 2, 3, 4, 5])
    s.seed_cache([9, 8, 7])
    s.submit([Request("a", [1, 2, 3, 9], 4)], now=0.0)
    s.step(0.7)  # locks [1, 2, 3] for a's prefill
    assert (s.evictable, s.protected) == (5, 3)
    assert s.flush_cache() == 5 and (s.evictable, s.protected, s.available) == (0, 3, 97)
    s.complete_prefill({"a": 6})
    s.check_integrity()


@pytest.mark.parametrize("cls", [ReferenceScheduler, GpuScheduler])
@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("P", [1, 4])
def test_pool_size_bound_of_admission(cls, chunk, P):
    """submit()'s documented bound: len(fill) + min(max_new, CLIP) + P >= kv_pool_size is
    never admitted (an exact fit included, chunking or not, the pool idle and empty); one
    token less is admitted (whole or as a first chunk) by an idle scheduler."""
    pool, max_new = 64, 10
    for fill, admitted in ((pool - max_new - P, False), (pool - max_new - P - 1, True)):
        s = cls(SchedulerConfig(page_size=P, chunked_prefill_size=chunk, clip_max_new_tokens=4096), pool)
        s.submit([Request("r", list(range(1, fill + 1)), max_new)], now=0.0)
        plan = s.step(1.0)
        assert bool(plan.admitted) == admitted, (fill, plan.stop)
        if not admitted:
            assert plan.stop == "add_no_token"
