"""Prefill admission (SPEC.md R-ADM-1..7, D1, D5, D6, D7): budgets and decisions derived by hand."""

import math
import struct

import numpy as np

from gpu_sched import Request, SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.reference.adder import AddResult, PrefillAdder
from gpu_sched.reference.radix_cache import KVPool, RadixCache
from gpu_sched.reference.state import ReqState


def R(rid, prompt, max_new=4, **kw):
    return Request(rid, list(prompt), max_new, **kw)


def S(rid, prompt_len, max_new, out_len=0, ignore_eos=False, priority=0, t=0.0):
    """A bare ReqState (for adders built by hand)."""
    return ReqState(R(rid, range(1, prompt_len + 1), max_new, output_ids=[0] * out_len, ignore_eos=ignore_eos),
                    priority, t)


def adder(pool_size, running=(), ratio=1.0, mixed=0, **cfg):
    config = SchedulerConfig(**cfg)
    pool = KVPool(pool_size)
    cache = RadixCache(pool, config.page_size, disable=config.disable_radix_cache)
    return PrefillAdder(config, cache, pool, list(running), ratio, mixed)


def mk(pool, **cfg):
    return ReferenceScheduler(SchedulerConfig(**cfg), pool)


def toks(start, n):
    return list(range(start, start + n))


# ---- R-ADM-1 budget_state ------------------------------------------------------------------------
def test_r_adm_1_budget_state():
    """R-ADM-1: NO_TOKEN if rem_total <= 0 or cur_rem <= 0; else OTHER if rem_input <= 0 or
    rem_chunk <= 0; else CONTINUE."""
    # rem_total = 10 - 0.5 * 20 = 0.0 (<= 0, equality) -> NO_TOKEN although cur_rem = 10
    a = adder(10, running=[S("r", 1, 20)], ratio=0.5)
    assert (a.rem_total, a.cur_rem) == (0.0, 10)
    assert a.budget_state() is AddResult.NO_TOKEN
    # rem_total = 11 - 10 = 1.0 -> CONTINUE
    assert adder(11, running=[S("r", 1, 20)], ratio=0.5).budget_state() is AddResult.CONTINUE
    # cur_rem = 0 - 0 = 0 while rem_total = 0 - 1.0 * (2 - 5) = 3.0 > 0 (output beyond max_new)
    a = adder(0, running=[S("r", 1, 2, out_len=5)])
    assert (a.rem_total, a.cur_rem) == (3.0, 0)
    assert a.budget_state() is AddResult.NO_TOKEN
    # rem_input = 5 - 5 = 0 -> OTHER; I = 5 so rem_total = 100 - 5 = 95.0
    a = adder(100, mixed=5, max_prefill_tokens=5)
    assert (a.rem_total, a.cur_rem, a.rem_input, a.rem_chunk) == (95.0, 95, 0, 8187)
    assert a.budget_state() is AddResult.OTHER
    # rem_chunk = 3 - 3 = 0 -> OTHER
    assert adder(100, mixed=3, chunked_prefill_size=3).budget_state() is AddResult.OTHER
    # chunking off: rem_chunk None never stops
    a = adder(100, chunked_prefill_size=None)
    assert a.rem_chunk is None and a.budget_state() is AddResult.CONTINUE


# ---- R-ADM-2 commit --------------------------------------------------------------------------------
def test_r_adm_2_commit_updates_budgets():
    """R-ADM-2 with P = 4: commit(5, 6, 10): e = ceil4(6) = 8; I += 8 + 10 + 4 = 22;
    cur_off += 8 + 4 = 12; rem_input -= 8; rem_chunk -= 8; hit += 5; input += 8."""
    a = adder(1000, page_size=4, max_prefill_tokens=100, chunked_prefill_size=50)
    a._commit(5, 6, 10)
    assert (a.I, a.cur_off, a.rem_input, a.rem_chunk) == (22, 12, 92, 42)
    assert (a.log_hit_tokens, a.log_input_tokens) == (5, 8)
    assert a.rem_total == 978.0  # 1000 - 22
    assert a.cur_rem == 988  # 1000 - 12
    # chunking off: rem_chunk stays None; commits accumulate
    b = adder(1000, chunked_prefill_size=None)
    b._commit(0, 3, 2)
    b._commit(1, 1, 0)
    assert (b.I, b.cur_off, b.rem_input, b.rem_chunk) == (8, 6, 16380, None)  # (3+2+1)+(1+0+1); (3+1)+(1+1)
    assert (b.log_hit_tokens, b.log_input_tokens) == (1, 4)


def test_r_adm_2_initial_state_with_mixed_decode_tokens():
    """R-ADM state: I = cur_off = mixed; N = sum of min(max_new - out, CLIP) over running;
    rem_input = max_prefill - mixed; rem_chunk = chunk - mixed."""
    running = [S("a", 3, 10, out_len=4), S("b", 2, 5000), S("c", 1, 7, out_len=7)]
    a = adder(500, running=running, ratio=1.0, mixed=3, clip_max_new_tokens=4096)
    assert a.N == 4102  # 6 + min(5000, 4096) + 0
    assert (a.I, a.cur_off, a.rem_input, a.rem_chunk) == (3, 3, 16381, 8189)
    assert a.rem_total == -3605.0  # (500 - 3) - 4102
    assert a.cur_rem == 497


# ---- R-ADM-3 add_one_req through full steps -------------------------------------------------------
def test_r_adm_3_step_4_total_equal_to_rem_total_is_no_token():
    """R-ADM-3.4: prompt 10, max_new 5: total = 10 + 5 + 1 = 16; rem_total = A. A = 16 refuses
    (>=), A = 17 admits."""
    s = mk(16)
    s.submit([R("a", toks(1, 10), 5)])
    plan = s.step(1.0)
    assert plan.admitted == [] and plan.stop == "add_no_token"
    assert plan.batch_is_full is False  # R-STEP-3.5: nothing running or admitted
    assert plan.budgets == plan.budgets_start == {"rem_total": 16.0, "cur_rem": 16, "rem_input": 16384,
                                                  "rem_chunk": 8192}  # R-ADM-4: nothing committed
    s.check_integrity()
    s = mk(17)
    s.submit([R("a", toks(1, 10), 5)])
    plan = s.step(1.0)
    assert plan.admitted == [("a", 0, 10)] and plan.stop == "queue_end"
    # commit(0, 10, 5): I = 16, cur_off = 11
    assert plan.budgets == {"rem_total": 1.0, "cur_rem": 6, "rem_input": 16374, "rem_chunk": 8182}


def test_r_adm_3_step_4_chunking_off_rem_input():
    """R-ADM-3.4: chunking off, max_prefill 20. r1 (15) is admitted (can_run empty);
    r2 (in_paged 5 >= rem_input 5) is OTHER; had it been 4 it would fit."""
    s = mk(1000, chunked_prefill_size=None, max_prefill_tokens=20)
    s.submit([R("r1", toks(1, 15)), R("r2", toks(100, 5)), R("r3", toks(200, 1))])
    plan = s.step(1.0)
    assert plan.admitted_rids == ["r1"] and plan.stop == "add_other"
    assert plan.budgets["rem_input"] == 5 and plan.budgets["rem_chunk"] is None
    s2 = mk(1000, chunked_prefill_size=None, max_prefill_tokens=20)
    s2.submit([R("r1", toks(1, 15)), R("r2", toks(100, 4))])
    assert s2.step(1.0).admitted_rids == ["r1", "r2"]


def test_r_adm_3_step_8_first_request_admitted_even_when_budget_says_stop():
    """R-ADM-3.8: the first request (can_run empty) is admitted whole even beyond rem_input
    (chunking off); the OTHER budget state then stops the step."""
    s = mk(1000, chunked_prefill_size=None, max_prefill_tokens=20)
    s.submit([R("big", toks(1, 30)), R("small", [999])])
    plan = s.step(1.0)
    assert plan.admitted == [("big", 0, 30)] and plan.stop == "add_other"
    assert plan.budgets["rem_input"] == -10  # 20 - 30


def test_r_adm_3_step_5_temporary_lock_lowers_budget_and_is_released():
    """R-ADM-3.5: cache holds 10 evictable tokens, request = those 10 + 5 new, max_new 3:
    prefix 10, total = 5 + 3 + 1 = 9. Pool 19 (A = 9): before the lock rem_total = 9 + 10 = 19;
    with it 9 -> 9 >= 9: NO_TOKEN, and the lock is released (evictable back to 10)."""
    base = toks(1, 10)
    s = mk(19)
    s.seed_cache(base)
    s.submit([R("r", base + toks(50, 5), 3)])
    plan = s.step(1.0)
    assert plan.admitted == [] and plan.stop == "add_no_token"
    assert (plan.evictable, plan.protected, plan.available) == (10, 0, 9)
    s.check_integrity()
    # pool 20 (A = 10): locked rem_total 10 > 9: admitted; I = 5 + 3 + 1 = 9, cur_off = 6
    s = mk(20)
    s.seed_cache(base)
    s.submit([R("r", base + toks(50, 5), 3)])
    plan = s.step(1.0)
    assert plan.admitted == [("r", 10, 15)]
    assert (plan.evictable, plan.protected) == (0, 10)  # the permanent lock
    assert plan.budgets == {"rem_total": 1.0, "cur_rem": 4, "rem_input": 16379, "rem_chunk": 8187}
    assert (plan.log_hit_tokens, plan.log_input_tokens) == (10, 5)
    s.check_integrity()


def test_r_adm_3_step_6_reserve_is_total_max_new_clipped():
    """R-ADM-3.6: a request with 4 outputs of max_new 10: mn = 6 in the check, but the commit
    reserves min(max_new, CLIP) = 10 (quirk kept): I = 10 + 10 + 1 = 21 -> rem_total 79.0.
    With CLIP = 8 the reserve is 8: I = 19 -> 81.0."""
    s = mk(100)
    s.submit([R("r", toks(1, 6), 10, output_ids=[7, 7, 7, 7])])
    plan = s.step(1.0)
    assert plan.admitted == [("r", 0, 10)]
    assert plan.budgets["rem_total"] == 79.0 and plan.budgets["cur_rem"] == 89
    s = mk(100, clip_max_new_tokens=8)
    s.submit([R("r", toks(1, 6), 10, output_ids=[7, 7, 7, 7])])
    assert s.step(1.0).budgets["rem_total"] == 81.0


def test_r_adm_3_step_3_mn_never_negative_and_clipped():
    """R-ADM-3.3: mn = min(max(max_new - out, 0), CLIP). Cache holds 12 tokens; the request's
    fill is those 12 + 3 (12 outputs > max_new 10): prefix 12, ext 3, mn 0 (not -2), total 4.
    Locked rem_total = A: pool 16 (A = 4) refuses (4 >= 4; a negative mn would admit), pool 17
    admits; the reserve is min(10, CLIP) = 10: I = 3 + 10 + 1 = 14 -> rem_total 5 - 14 = -9.
    CLIP 2 with max_new 50, prompt 3: total = 3 + 2 + 1 = 6: pool 7 admits, pool 6 refuses."""
    for pool, ok in [(16, False), (17, True)]:
        s = mk(pool)
        s.seed_cache(toks(1, 12))
        s.submit([R("r", toks(1, 3), 10, output_ids=toks(4, 9) + [77, 78, 79])])
        plan = s.step(1.0)
        if ok:
            assert plan.admitted == [("r", 12, 15)]
            assert plan.budgets["rem_total"] == -9.0
        else:
            assert plan.admitted == [] and plan.stop == "add_no_token"
    s4 = mk(7, clip_max_new_tokens=2)
    s4.submit([R("r", toks(1, 3), 50)])
    assert s4.step(1.0).admitted == [("r", 0, 3)]
    s5 = mk(6, clip_max_new_tokens=2)
    s5.submit([R("r", toks(1, 3), 50)])
    assert s5.step(1.0).admitted == []


def test_r_adm_4_refused_request_commits_nothing_and_stops_the_step():
    """R-ADM-4: pool 30, 4 cached tokens (A = 26, evictable 4). a (5 new tokens, total 10 < 30)
    is admitted: I = 10, cur_off = 6. b (16 tokens, the first 4 cached: ext 12, total 17) passes
    step 4 (17 < 26 + 4 - 10 = 20) but not step 5 (17 >= 20 - 4 with its prefix locked): refused,
    nothing committed, the temporary lock undone, and the step stops there, so c (1 token, would
    fit) is not tried."""
    s = mk(30)
    s.seed_cache(toks(10, 4))
    s.submit([R("a", toks(100, 5)), R("b", toks(10, 16)), R("c", [999])])
    plan = s.step(1.0)
    assert plan.admitted == [("a", 0, 5)] and plan.stop == "add_no_token"
    # rem_total = 26 + 4 - 10, cur_rem = 26 + 4 - 6: as right after a's commit
    assert plan.budgets == {"rem_total": 20.0, "cur_rem": 24, "rem_input": 16379, "rem_chunk": 8187}
    assert (plan.log_hit_tokens, plan.log_input_tokens) == (0, 5)
    assert (plan.evictable, plan.protected) == (4, 0)
    assert [r.rid for r in s.queue] == ["b", "c"]
    s.check_integrity()


def _chunk_sched(**cfg):
    """P = 4, a cached prefix of 6 tokens (only floor4(6) = 4 are cached), a 30-token prompt
    starting with them, max_new 10. Re-match of fill[:29] (floor4 -> 28) gives prefix 4."""
    s = mk(200, page_size=4, **cfg)
    X = toks(1, 30)
    assert s.seed_cache(X[:6]) == 4
    s.submit([R("r", X, 10)])
    return s


def test_r_adm_3_step_7_chunk_page4_cached_prefix_ends_page_aligned():
    """R-ADM-3.7 (issue case): chunk 11: in_paged = ceil4(26) = 28 > 11: chunk t = floor4(11) = 8,
    t = floor4(4 + 8) - 4 = 8: extend [4, 12), page-aligned; commit(4, 8, 0): I = 8 + 0 + 4."""
    s = _chunk_sched(chunked_prefill_size=11)
    plan = s.step(1.0)
    assert plan.admitted == [("r", 4, 12)] and plan.extend_tokens == 8
    assert plan.admitted[0][2] % 4 == 0
    assert plan.new_chunked_rid == "r" and plan.chunked_rid_after == "r"
    # A = 196, evictable 0 (locked): rem_total 196 - 12, cur_rem 196 - 12, rem_chunk 11 - 8
    assert plan.budgets == {"rem_total": 184.0, "cur_rem": 184, "rem_input": 16376, "rem_chunk": 3}
    assert (plan.log_hit_tokens, plan.log_input_tokens) == (4, 8)
    s.check_integrity()


def test_r_adm_3_step_7_truncation_align_size():
    """R-ADM-3.7 with truncation_align_size a = 3: t = floor4(11) = 8 -> (8 // 3) * 3 = 6 ->
    floor4(4 + 6) - 4 = 4: extend [4, 8). With a = 9: t = 8 < 9: OTHER, nothing committed."""
    s = _chunk_sched(chunked_prefill_size=11, truncation_align_size=3)
    plan = s.step(1.0)
    assert plan.admitted == [("r", 4, 8)]
    assert plan.budgets["rem_chunk"] == 7  # 11 - 4
    s = _chunk_sched(chunked_prefill_size=11, truncation_align_size=9)
    plan = s.step(1.0)
    assert plan.admitted == [] and plan.stop == "add_other" and plan.new_chunked_rid is None
    assert plan.budgets == plan.budgets_start
    assert (plan.evictable, plan.protected) == (4, 0)  # temporary lock released
    s.check_integrity()


def test_r_adm_3_step_7_chunk_below_one_page_is_other():
    """R-ADM-3.7: chunk 3 with P = 4: t = floor4(3) = 0 -> floor4(4) - 4 = 0 <= 0: OTHER."""
    s = _chunk_sched(chunked_prefill_size=3)
    plan = s.step(1.0)
    assert plan.admitted == [] and plan.stop == "add_other"


def test_r_adm_3_step_1_prefill_max_requests():
    """R-ADM-3.1: prefill_max_requests = 2: the third request is OTHER, not admitted."""
    s = mk(1000, prefill_max_requests=2)
    s.submit([R("a", [1]), R("b", [2]), R("c", [3])])
    plan = s.step(1.0)
    assert plan.admitted_rids == ["a", "b"] and plan.stop == "add_other"
    # R-ADM-4: c committed nothing: two commits of (1 + 4 + 1)
    assert plan.budgets["rem_total"] == 988.0
    assert [r.rid for r in s.queue] == ["c"]


# ---- R-ADM-5 the in-flight chunked request ----------------------------------------------------------
def test_r_adm_5_chunked_request_admitted_first_and_finishes():
    """R-ADM-5: chunked (prompt 20, done 8, max_new 7) with A = 92: room = min(8192, 92) = 92,
    ext = 12, n = 12 (last chunk): extend [8, 20), commit(0, 12, 7): I = 20, cur_off = 13.
    Then q1 (5 tokens): total 10 < 92 - 20: admitted after it."""
    s = mk(100)
    s.seed_chunked(R("c", toks(1, 20), 7), 8)
    s.submit([R("q1", toks(100, 5))])
    assert s.available == 92
    plan = s.step(1.0)
    assert plan.admitted == [("c", 8, 20), ("q1", 0, 5)]
    assert plan.new_chunked_rid is None and plan.chunked_rid_after is None
    assert plan.budgets_start["rem_total"] == 92.0
    # I = 20 + (5 + 4 + 1) = 30; cur_off = 13 + 6 = 19
    assert plan.budgets == {"rem_total": 62.0, "cur_rem": 73, "rem_input": 16367, "rem_chunk": 8175}
    assert (plan.log_hit_tokens, plan.log_input_tokens) == (0, 17)
    s.check_integrity()


def test_r_adm_5_room_limited_by_rem_total_not_page_aligned():
    """R-ADM-5: prompt 40, done 8, pool 28: A = 20, room = min(8192, int(20.0)) = 20, ext = 32:
    n = 20 (P = 1 here; never page-aligned anyway): extend [8, 28), still chunked; commit(0, 20, 0)
    -> rem_total = 20 - 21 = -1: q1 gets NO_TOKEN; the full mark is set (can_run non-empty)."""
    s = mk(28)
    s.seed_chunked(R("c", toks(1, 40), 7), 8)
    s.submit([R("q1", [500])])
    plan = s.step(1.0)
    assert plan.admitted == [("c", 8, 28)]
    assert plan.chunked_rid_after == "c" and plan.new_chunked_rid is None
    assert plan.budgets["rem_total"] == -1.0 and plan.stop == "add_no_token"
    assert plan.batch_is_full is True


def test_r_adm_5_room_when_rem_total_not_positive_is_rem_chunk():
    """R-ADM-5: a running request reserving 1000 makes rem_total = A - 1000 < 0: room =
    rem_chunk = 10 (chunk 10): n = min(32, 10) = 10."""
    s = mk(100, chunked_prefill_size=10)
    s.seed_running(R("run", [900], 1000))  # 1 private slot, n = 1000
    s.seed_chunked(R("c", toks(1, 40), 7), 8)
    plan = s.step(1.0)
    assert plan.budgets_start["rem_total"] == -909.0  # (100 - 1 - 8) - 1000
    assert plan.admitted == [("c", 8, 18)] and plan.chunked_rid_after == "c"


def test_r_adm_5_chunked_counts_in_can_run_and_page_size():
    """R-ADM-5: the chunked request counts for prefill_max_requests; with P = 4 its chunk is
    min(ext, room) unaligned: done 4, prompt 11, ext 7 -> extend [4, 11); commit e = ceil4(7) = 8."""
    s = mk(100, page_size=4, prefill_max_requests=1)
    s.seed_chunked(R("c", toks(1, 11), 2), 4)
    s.submit([R("q", toks(50, 4))])
    plan = s.step(1.0)
    assert plan.admitted == [("c", 4, 11)] and plan.stop == "add_other"
    # A = 100 - 4 = 96; I = 8 + 2 + 4 = 14; cur_off = 12
    assert plan.budgets == {"rem_total": 82.0, "cur_rem": 84, "rem_input": 16376, "rem_chunk": 8184}


# ---- R-ADM-6 ignore-EOS (D1, D6) ----------------------------------------------------------------------
ISSUE_STATES = [("e1", 100, 40), ("e2", 30, 40), ("e3", 60, 50)]  # rid, prompt (= occupied), max_new (= left)


def test_r_adm_6_d1_ignore_eos_scan_threshold_direct():
    """R-ADM-6 / D1 (issue case): states (left, occupied) (40,100) (40,30) (50,60) + new
    (900,60), sorted by left: (40,100) (40,30) (50,60) (900,60), n = 4. Fit needs
    c + freed_k - left_k * bs_k > bs_k at every k:
      k0: c - 160 > 4 -> c > 164;  k1: c + 100 - 120 > 3 -> c > 23;
      k2: c + 130 - 100 > 2 -> c > -28;  k3: c + 190 - 900 > 1 -> c > 711.
    Smallest c = 712 (SGLang's insertion at n-1 would need c + 130 - 1800 > 2, c >= 1673).
    A state with left 0 (max_new 10, out 10) is dropped and changes nothing."""
    running = [S(rid, p, mn, ignore_eos=True) for rid, p, mn in ISSUE_STATES]
    running.append(S("done", 1000, 10, out_len=10, ignore_eos=True))  # left = 0: dropped
    new = S("new", 60, 900, ignore_eos=True)
    for pool, fits in [(772, True), (771, False)]:  # cur_rem = pool; c = cur_rem - 60
        a = adder(pool, running=running, ratio=1.0, disable_radix_cache=True)
        assert a.ignore_eos_fits(new, 60) is fits, pool


def test_r_adm_6_d1_ignore_eos_full_step():
    """R-ADM-6 / D1 through a step (cache disabled, ratio 1.0): the running requests hold
    100 + 30 + 60 = 190 slots, so A = pool - 190 and c = A - 60: pool 962 (c = 712) admits,
    961 (c = 711) refuses with NO_TOKEN (full mark set: requests are running). The pre-check
    ceilP(60) <= min(A, A - 130) holds in both."""
    for pool, admitted in [(962, True), (961, False)]:
        s = mk(pool, disable_radix_cache=True)
        for i, (rid, p, mn) in enumerate(ISSUE_STATES):
            s.seed_running(R(rid, toks(1000 * (i + 1), p), mn, ignore_eos=True))
        s.submit([R("new", toks(1, 60), 900, ignore_eos=True)])
        plan = s.step(1.0)
        if admitted:
            assert plan.admitted == [("new", 0, 60)]
            # commit(0, 60, 900): I = 961; rem_total = 772 - 961 - 130 = -319: budget_state
            # NO_TOKEN after the admission (R-ADM-3.8), full mark set
            assert plan.budgets["rem_total"] == -319.0
            assert plan.stop == "add_no_token" and plan.batch_is_full is True
        else:
            assert plan.admitted == [] and plan.stop == "add_no_token" and plan.batch_is_full is True
        s.check_integrity()


def test_r_adm_6_ratio_prime_and_no_clip():
    """R-ADM-6: left = max_new * ratio' - out, ratio' = 1 for ignore_eos else ratio, unclipped.
    ratio 0.5: normal running (100, out 10, prompt 20): left 40, occ 30; ignore_eos running
    (100, out 10, prompt 20): left 90, occ 30; new (60, prompt 10): left 60, occ 10.
    Sorted (40,30) (60,10) (90,30): k0 c - 120 > 3; k1 c + 30 - 120 > 2; k2 c + 40 - 90 > 1
    -> c >= 124 -> cur_rem >= 134."""
    running = [S("n", 20, 100, out_len=10), S("e", 20, 100, out_len=10, ignore_eos=True)]
    new = S("new", 10, 60, ignore_eos=True)
    assert adder(134, running=running, ratio=0.5, disable_radix_cache=True).ignore_eos_fits(new, 10)
    assert not adder(133, running=running, ratio=0.5, disable_radix_cache=True).ignore_eos_fits(new, 10)
    # unclipped: running ignore_eos max_new 5000 (left 5000, occ 1), new max_new 1 (left 1, occ 1):
    # k0 c - 2 > 2; k1 c + 1 - 5000 > 1 -> c >= 5001, c = cur_rem - 1 -> cur_rem >= 5002
    big = [S("big", 1, 5000, ignore_eos=True)]
    tiny = S("tiny", 1, 1, ignore_eos=True)
    assert adder(5002, running=big, disable_radix_cache=True).ignore_eos_fits(tiny, 1)
    assert not adder(5001, running=big, disable_radix_cache=True).ignore_eos_fits(tiny, 1)


def test_r_adm_6_d6_admitted_normal_request_is_in_later_scans():
    """R-ADM-6 / D6: cache disabled, ratio 1: n1 (normal, prompt 10, max_new 100) is admitted
    first (total 111 < A); then e1 (ignore_eos, prompt 10, max_new 50). Its scan holds e1 (50,10)
    and n1 (100,10); c = cur_rem - 10 = (A - 11) - 10:
      k0: c - 100 > 2 -> c >= 103;  k1: c + 10 - 100 > 1.
    So A >= 124 admits; A = 123 (c = 102) refuses. The pre-check ceilP(10) <= min(cur_rem,
    rem_total = A - 111) holds at 123. Without n1 (SGLang) the need would be c >= 52."""
    for pool, both in [(124, True), (123, False)]:
        s = mk(pool, disable_radix_cache=True)
        s.submit([R("n1", toks(1, 10), 100), R("e1", toks(100, 10), 50, ignore_eos=True)])
        plan = s.step(1.0)
        assert plan.admitted_rids == (["n1", "e1"] if both else ["n1"]), pool
        if not both:
            assert plan.stop == "add_no_token" and plan.batch_is_full is True


def test_r_adm_6_precheck_and_unpaged_chunk():
    """R-ADM-6: NO_TOKEN if ceilP(ext) > min(cur_rem, rem_total); ext > rem_chunk admits the
    first rem_chunk tokens unpaged as the new chunked request, commit(0, rem_chunk, 0).
    P = 4, chunk 10, prompt 13 (ceil4 = 16), max_new 5, pool 100: scan: (5, 13) alone,
    c = 100 - 16 = 84: 84 - 5 > 1. Admits [0, 10); commit e = ceil4(10) = 12: I = 12 + 0 + 4."""
    s = mk(100, disable_radix_cache=True, page_size=4, chunked_prefill_size=10)
    s.submit([R("e", toks(1, 13), 5, ignore_eos=True)])
    plan = s.step(1.0)
    assert plan.admitted == [("e", 0, 10)] and plan.new_chunked_rid == "e"
    assert plan.budgets == {"rem_total": 84.0, "cur_rem": 84, "rem_input": 16372, "rem_chunk": -2}
    assert plan.stop == "add_other"
    # pre-check: pool 15 < ceil4(13) = 16 -> NO_TOKEN
    s = mk(15, disable_radix_cache=True, page_size=4)
    s.submit([R("e", toks(1, 13), 1, ignore_eos=True)])
    assert s.step(1.0).stop == "add_no_token"


def test_r_adm_6_only_with_cache_disabled():
    """R-ADM-3.2: with the cache enabled an ignore_eos request takes the normal path (no scan):
    total = 60 + 900 + 1 = 961 must be < rem_total = pool: 772 refuses, 962 admits."""
    s = mk(962 - 190)
    s.submit([R("new", toks(1, 60), 900, ignore_eos=True)])
    assert s.step(1.0).admitted == []  # normal path: total 961 >= rem_total 772
    s = mk(962)
    s.submit([R("new", toks(1, 60), 900, ignore_eos=True)])
    assert s.step(1.0).admitted == [("new", 0, 60)]


# ---- R-ADM-7 priority preemption (D5) -----------------------------------------------------------------
def _preempt_sched(pool, prios=(1, 0, 0), new_prio=100, low_first=False, cap=3, **cfg):
    """Three running requests r1, r2, r3 (enqueue 1, 2, 3), prompt 10 each, max_new 1000, no
    output (10 private slots each, reserving 1000 each); a new request, prompt 100, max_new 100."""
    s = mk(pool, enable_priority_scheduling=True, enable_priority_preemption=True, max_running_requests=cap,
           schedule_low_priority_values_first=low_first, **cfg)
    for i, p in enumerate(prios):
        s.seed_running(R(f"r{i + 1}", toks(1000 * (i + 1), 10), 1000, priority=p, enqueue_time=i + 1))
    s.submit([R("new", toks(1, 100), 100, priority=new_prio, enqueue_time=10)])
    return s


def test_r_adm_7_one_victim_least_important_newest():
    """R-ADM-7 (issue case): ratio 1, A = 2430 - 30 = 2400: need(V) = 100 + 100 - 2400 +
    (3000 - V) = 800 - V. Victim order (priority, -enqueue): r3 (0,-3), r2 (0,-2), r1 (1,-1).
    r3 (gap 100 > 10): V = 1000, need = -200 <= 0: exactly one victim, r3. Release frees 10
    (A = 2410); shortfall 2 * 20 - 2410 < 0: no eviction. N = 2000; new: total 201 <
    2410 - 2000 = 410: admitted; I = 201 -> rem_total 209.0, cur_rem 2410 - 101 = 2309."""
    s = _preempt_sched(2430)
    plan = s.step(1.0)
    assert plan.preempted == ["r3"]
    assert plan.admitted == [("new", 0, 100)] and plan.stop == "queue_end"
    assert plan.preempt_evicted_tokens == 0
    assert plan.budgets == {"rem_total": 209.0, "cur_rem": 2309, "rem_input": 16284, "rem_chunk": 8092}
    assert plan.batch_is_full is True  # marked at the cap (R-STEP-3.2), sticky for the step
    assert [r.rid for r in s.running] == ["r1", "r2"]
    assert [r.rid for r in s.queue] == ["r3"]  # R-STEP-4: victims join the tail
    r3 = s.queue[0]
    assert r3.retracted and r3.prefix_len == 0 and r3.kv_len == 0 and r3.lock_node is None
    assert plan.available == 2410
    s.check_integrity()


def test_r_adm_7_two_victims_reported_in_batch_order():
    """R-ADM-7: A = 2199: need(V) = 1001 - V: r3 leaves need 1 > 0, r2 makes it -999: victims
    r3, r2, reported in running-batch order [r2, r3]."""
    s = _preempt_sched(2229)
    plan = s.step(1.0)
    assert plan.preempted == ["r2", "r3"]
    assert plan.admitted_rids == ["new"]
    assert [r.rid for r in s.queue] == ["r2", "r3"]
    s.check_integrity()


def test_r_adm_7_threshold_is_strict_and_failure_changes_nothing():
    """R-ADM-7: a priority gap of exactly the threshold (10) is not enough: no victim, return
    false, stop batch_full, nothing released."""
    s = _preempt_sched(2430, new_prio=10)
    plan = s.step(1.0)
    assert plan.preempted == [] and plan.admitted == [] and plan.stop == "batch_full"
    assert [r.rid for r in s.running] == ["r1", "r2", "r3"] and plan.available == 2400
    s = _preempt_sched(2430, new_prio=11)  # gap 11 > 10
    assert s.step(1.0).preempted == ["r3"]


def test_r_adm_7_stops_at_first_victim_not_less_important_enough():
    """R-ADM-7: priorities r1 0, r2 95, r3 0; order r3 (0,-3), r1 (0,-1), r2 (95,-2).
    A = 1199: need(V) = 2001 - V: after r3, r1 need = 1 > 0; r2's gap 5 <= 10: stop; need > 0:
    no change at all."""
    s = _preempt_sched(1229, prios=(0, 95, 0))
    plan = s.step(1.0)
    assert plan.preempted == [] and plan.admitted == [] and plan.stop == "batch_full"
    assert [r.rid for r in s.running] == ["r1", "r2", "r3"] and plan.available == 1199
    s.check_integrity()
    # with A = 1200 (need(2000) = 0) the two victims r3, r1 suffice
    s = _preempt_sched(1230, prios=(0, 95, 0))
    assert s.step(1.0).preempted == ["r1", "r3"]


def test_r_adm_7_low_values_first_sign():
    """R-ADM-7 with sign +1: victims sorted by (-priority, -enqueue): r3 (-90,-3), r2 (-90,-2),
    r1 (-50,-1); new priority 0: gap (0 - 90) * -1 = 90 > 10: one victim r3 (A as in the
    issue case)."""
    s = _preempt_sched(2430, prios=(50, 90, 90), new_prio=0, low_first=True)
    plan = s.step(1.0)
    assert plan.preempted == ["r3"] and plan.admitted_rids == ["new"]


def test_r_adm_7_release_evicts_by_shortfall():
    """R-ADM-7: running r1..r3 (prompt 10, max_new 20: N = 60), cache holds 50 evictable
    tokens, pool 80: A = 0. New: prompt 5, max_new 5: need(V) = 10 - (0 + 50) + (60 - V) =
    20 - V: one victim r3 (n = 20). Release: A = 10; shortfall 2 * 20 - 10 = 30 > 0: evict the
    whole 50-token node (overshoot). Then total 11 < 60 + 0 - 40 = 20: admitted."""
    s = mk(80, enable_priority_scheduling=True, enable_priority_preemption=True, max_running_requests=3)
    s.seed_cache(toks(5000, 50))
    for i in range(3):
        s.seed_running(R(f"r{i + 1}", toks(1000 * (i + 1), 10), 20, priority=0, enqueue_time=i + 1))
    s.submit([R("new", toks(1, 5), 5, priority=100)])
    assert s.available == 0
    plan = s.step(1.0)
    assert plan.preempted == ["r3"] and plan.preempt_evicted_tokens == 50
    assert plan.admitted == [("new", 0, 5)]
    assert (plan.available, plan.evictable) == (60, 0)
    s.check_integrity()


def _d5_sched(pool):
    """Cache X (80 tokens) locked by a high-priority running r0 (prompt X, 1 output, max_new 1:
    reserves 0); r1..r3 as in `_preempt_sched`; cap 4. new = X + 20 tokens, max_new 100."""
    X = toks(1, 80)
    s = mk(pool, enable_priority_scheduling=True, enable_priority_preemption=True, max_running_requests=4)
    s.seed_cache(X)
    s.seed_running(R("r0", X, 1, output_ids=[0], priority=200, enqueue_time=0))
    for i, p in enumerate((1, 0, 0)):
        s.seed_running(R(f"r{i + 1}", toks(1000 * (i + 1), 10), 1000, priority=p, enqueue_time=i + 1))
    s.submit([R("new", X + toks(500, 20), 100, priority=100, enqueue_time=10)])
    return s


def test_r_adm_7_d5_need_uses_rematched_extend_length():
    """R-ADM-7 / D5: the need uses ext = 100 - 80 = 20 from the re-match: A = pool - 80 - 1 - 30;
    evictable 0 (X locked by r0); need(V) = 20 + 100 - A + (3000 - V) = 3120 - A - V.
    A = 2120 (pool 2231): r3 alone gives need 0: one victim (with ext 100 it would take two).
    Then: A = 2130, N = 2000, total 121 < 130: admitted [80, 100); I = 121, cur_off = 21."""
    s = _d5_sched(2231)
    assert (s.available, s.evictable, s.protected) == (2120, 0, 80)
    plan = s.step(1.0)
    assert plan.preempted == ["r3"]
    assert plan.admitted == [("new", 80, 100)]
    assert plan.budgets == {"rem_total": 9.0, "cur_rem": 2109, "rem_input": 16364, "rem_chunk": 8172}
    assert (plan.log_hit_tokens, plan.log_input_tokens) == (80, 20)
    s.check_integrity()
    s = _d5_sched(2230)  # A = 2119: need(1000) = 1 > 0: r2 too
    plan = s.step(1.0)
    assert plan.preempted == ["r2", "r3"] and plan.admitted_rids == ["new"]
    s.check_integrity()


# ---- D7: the exact float64 reservation ----------------------------------------------------------------
def _bits(x):
    return struct.pack("<d", x)


def test_d7_rem_total_bits_product_not_sum():
    """D2/D7: rem_total = float64(A + evictable - I) - float64(ratio * N). Ten running requests
    each reserving 1 at ratio 0.1: ratio * N = 0.1 * 10 = 1.0 exactly (SGLang's running sum of
    ten 0.1 is 0.9999999999999999). A = 21 - 20 = 1: rem_total = 0.0 exactly -> NO_TOKEN."""
    s = mk(21)
    for i in range(10):
        s.seed_running(R(f"r{i}", [100 + i], 2, output_ids=[0]))  # 2 private slots, n = 1
    s.submit([R("q", [1], 1)])
    plan = s.step(0.1)
    assert _bits(plan.budgets_start["rem_total"]) == _bits(0.0)
    assert plan.budgets_start == {"rem_total": 0.0, "cur_rem": 1, "rem_input": 16384, "rem_chunk": 8192}
    assert plan.stop == "add_no_token" and plan.batch_is_full is True


def test_d7_rem_total_bits_non_round_ratio_and_mixed():
    """D7: ratio 0.7, N = 3 (one running request, max_new 5, 2 outputs): 0.7 * 3 =
    2.0999999999999996; A = 104 - 4 = 100; mixed chunk: I = len(running) = 1:
    rem_total = float(99) - 2.0999999999999996 = 96.9 (rounded); rem_input 16383, rem_chunk 8191."""
    s = mk(104, enable_mixed_chunk=True)
    s.seed_running(R("run", [7, 8], 5, output_ids=[1, 2]))
    s.submit([R("q", [1, 2, 3], 2)])
    plan = s.step(0.7)
    assert _bits(plan.budgets_start["rem_total"]) == _bits(96.9)  # 99 - 2.0999999999999996 == 96.9 in float64
    assert plan.budgets_start == {"rem_total": 96.9, "cur_rem": 99, "rem_input": 16383, "rem_chunk": 8191}
    # after q: commit(0, 3, 2): I = 1 + 6 = 7, cur_off = 1 + 4 = 5
    assert _bits(plan.budgets["rem_total"]) == _bits(90.9)  # 93 - 2.0999999999999996 == 90.9
    assert plan.budgets["cur_rem"] == 95
    # without chunking, mixed is 0 (SPEC: mixed = len(running) only when chunking is on)
    s = mk(104, enable_mixed_chunk=True, chunked_prefill_size=None)
    s.seed_running(R("run", [7, 8], 5, output_ids=[1, 2]))
    s.submit([R("q", [1, 2, 3], 2)])
    plan = s.step(0.7)
    assert plan.budgets_start == {"rem_total": 97.9, "cur_rem": 100, "rem_input": 16384, "rem_chunk": None}


def test_d7_rem_total_reads_evictable_live():
    """R-ADM state: rem_total and cur_rem read evictable live: locking a prefix lowers them.
    Pool 30, cache 10 tokens: A = 20, evictable 10: rem_total 30.0 before any lock."""
    a = adder(30)
    slots = a.pool.alloc(10)
    a.cache.insert(np.arange(10, dtype=np.int32), slots)
    assert (a.rem_total, a.cur_rem) == (30.0, 30)
    (node,) = a.cache.root.children.values()
    a.cache.inc_lock_ref(node)
    assert (a.rem_total, a.cur_rem) == (20.0, 20)
    assert not math.isnan(a.rem_total)
