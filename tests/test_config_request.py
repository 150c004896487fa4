"""SchedulerConfig and Request validation, and submit's all-or-nothing behaviour on bad input."""

import math

import numpy as np
import pytest

from gpu_sched import NewTokenRatio, Request, SchedulerConfig
from gpu_sched.config import INT64_MAX, INT64_MIN, POLICIES
from gpu_sched.reference import ReferenceScheduler


# ---- SchedulerConfig --------------------------------------------------------------------------
def test_config_defaults_match_spec_section_1():
    """SPEC section 1 defaults; D3: the plain constructor has no LPM fallback, the preset 128."""
    c = SchedulerConfig()
    assert c.schedule_policy == "fcfs"
    assert c.page_size == 1
    assert c.max_prefill_tokens == 16384
    assert c.chunked_prefill_size == 8192
    assert c.max_running_requests is None
    assert c.enable_priority_scheduling is False
    assert c.schedule_low_priority_values_first is False
    assert c.priority_scheduling_preemption_threshold == 10
    assert c.enable_priority_preemption is False
    assert c.clip_max_new_tokens == 4096
    assert c.in_batch_prefix_caching_check_threshold == 32
    assert c.in_batch_prefix_caching_deprioritize_threshold == 32
    assert c.lpm_fallback_queue_len is None  # D3
    assert c.enable_mixed_chunk is False
    assert c.prefill_max_requests is None
    assert c.truncation_align_size is None
    assert c.disable_radix_cache is False
    assert c.schedule_conservativeness == 1.0
    s = SchedulerConfig.sglang()
    assert s.lpm_fallback_queue_len == 128  # D3: the SGLang-compatible preset
    assert s.replace(lpm_fallback_queue_len=None) == c


def test_config_derived_sign_absent_priority_and_effective_policy():
    """SPEC section 0/1: sign +1 when low values go first; absent priority is the last possible;
    R-ORD-1: a cache-aware policy with the cache disabled becomes fcfs."""
    assert SchedulerConfig().priority_sign == -1
    assert SchedulerConfig().absent_priority == -(2**63)
    low = SchedulerConfig(schedule_low_priority_values_first=True)
    assert low.priority_sign == 1
    assert low.absent_priority == 2**63 - 1
    assert SchedulerConfig(schedule_policy="lpm", disable_radix_cache=True).effective_policy == "fcfs"
    assert SchedulerConfig(schedule_policy="dfs-weight", disable_radix_cache=True).effective_policy == "fcfs"
    assert SchedulerConfig(schedule_policy="lof", disable_radix_cache=True).effective_policy == "lof"
    assert SchedulerConfig(schedule_policy="lpm").effective_policy == "lpm"


@pytest.mark.parametrize("policy", POLICIES)
def test_r_ord_1_every_policy_name_is_accepted(policy):
    """R-ORD-1: the six policy names."""
    assert SchedulerConfig(schedule_policy=policy).schedule_policy == policy


BAD_FIELDS = [
    # (field, value, exception)
    ("schedule_policy", "longest", ValueError),  # R-ORD-1: any other name is an error
    ("schedule_policy", "LPM", ValueError),
    ("schedule_policy", 3, TypeError),
    ("page_size", 0, ValueError),
    ("page_size", -4, ValueError),
    ("page_size", 4.0, TypeError),
    ("page_size", True, TypeError),
    ("page_size", None, TypeError),
    ("max_prefill_tokens", 0, ValueError),
    ("max_prefill_tokens", "16384", TypeError),
    ("chunked_prefill_size", 0, ValueError),
    ("chunked_prefill_size", 8192.5, TypeError),
    ("max_running_requests", 0, ValueError),
    ("max_running_requests", -1, ValueError),
    ("enable_priority_scheduling", 1, TypeError),
    ("schedule_low_priority_values_first", "yes", TypeError),
    ("enable_mixed_chunk", None, TypeError),
    ("disable_radix_cache", 0, TypeError),
    ("priority_scheduling_preemption_threshold", 1.5, TypeError),
    ("clip_max_new_tokens", -1, ValueError),
    ("in_batch_prefix_caching_check_threshold", -2, ValueError),
    ("in_batch_prefix_caching_deprioritize_threshold", -1, ValueError),
    ("lpm_fallback_queue_len", -1, ValueError),
    ("prefill_max_requests", 0, ValueError),
    ("truncation_align_size", 0, ValueError),
    ("truncation_align_size", 2.0, TypeError),
    ("random_seed", "seed", TypeError),
    ("random_seed", -1, ValueError),  # numpy's generator refuses it
    ("random_seed", 2**64, ValueError),  # torch's manual_seed overflows
    ("schedule_conservativeness", 0, ValueError),
    ("schedule_conservativeness", -0.5, ValueError),
    ("schedule_conservativeness", float("nan"), ValueError),
    ("schedule_conservativeness", float("inf"), ValueError),
    ("schedule_conservativeness", "1.0", TypeError),
    ("schedule_conservativeness", True, TypeError),
]


@pytest.mark.parametrize("field,value,exc", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_config_bad_field_names_field_and_value(field, value, exc):
    """Every bad field raises ValueError/TypeError whose message names the field and the value."""
    with pytest.raises(exc) as ei:
        SchedulerConfig(**{field: value})
    msg = str(ei.value)
    assert field in msg
    assert repr(value) in msg or str(value) in msg


def test_random_seed_range_edges_build_both_schedulers():
    """The ends of the accepted seed range, [0, 2^64), build both schedulers' generators."""
    from gpu_sched.scheduler import GpuScheduler

    for seed in (0, 2**64 - 1):
        cfg = SchedulerConfig(schedule_policy="random", random_seed=seed)
        ReferenceScheduler(cfg, 100)
        GpuScheduler(cfg, 100, backend="torch", device="cpu")


def test_config_bad_field_via_replace_and_preset():
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig().replace(page_size=0)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        SchedulerConfig.sglang(max_prefill_tokens=0)


def test_config_preemption_needs_priority_scheduling():
    """R-ADM-7 orders victims by priority: preemption without priority scheduling is refused."""
    with pytest.raises(ValueError, match="enable_priority_preemption=True"):
        SchedulerConfig(enable_priority_preemption=True)
    ok = SchedulerConfig(enable_priority_preemption=True, enable_priority_scheduling=True)
    assert ok.enable_priority_preemption


def test_config_is_frozen():
    c = SchedulerConfig()
    with pytest.raises(Exception):
        c.page_size = 4  # type: ignore[misc]


def test_config_optional_fields_accept_none():
    c = SchedulerConfig(chunked_prefill_size=None, max_running_requests=None, lpm_fallback_queue_len=None,
                        prefill_max_requests=None, truncation_align_size=None)
    assert c.chunked_prefill_size is None


def test_scheduler_rejects_non_config():
    with pytest.raises(TypeError, match="config"):
        ReferenceScheduler({"page_size": 1}, 10)
    with pytest.raises(ValueError, match="kv_pool_size"):
        ReferenceScheduler(SchedulerConfig(), -1)
    for bad in ("10", 1.5, None, True):  # a wrong type is a TypeError, as for the config's fields
        with pytest.raises(TypeError, match="kv_pool_size must be an int >= 0, got"):
            ReferenceScheduler(SchedulerConfig(), bad)
    with pytest.raises(ValueError, match=r"kv_pool_size must be <= 2\^40 tokens"):
        ReferenceScheduler(SchedulerConfig(), 2**40 + 1)


def test_kv_pool_past_host_memory_is_named(kv_pool_out_of_memory):
    """A pool the host cannot hold the free list of is a MemoryError naming kv_pool_size and its
    size, not numpy's bare allocation error."""
    with pytest.raises(MemoryError, match=r"kv_pool_size 1099511627776 slots: no memory for its free list \(8192.0 GiB\)"):
        ReferenceScheduler(SchedulerConfig(), 2**40)


def test_policy_name_and_device_errors_point_at_the_fix():
    for bad, guess in (("dfs_weight", "dfs-weight"), ("LPM", "lpm"), ("routing_key", "routing-key")):
        with pytest.raises(ValueError, match=f"got '{bad}' .did you mean '{guess}'"):
            SchedulerConfig(schedule_policy=bad)
    with pytest.raises(ValueError, match=r"must be one of .*; got 'shortest'$"):
        SchedulerConfig(schedule_policy="shortest")
    from gpu_sched.scheduler import GpuScheduler

    for bad in ("tpu", 3.5, "cuda:x"):
        with pytest.raises(ValueError, match=f"device {bad!r} is not a torch device"):
            GpuScheduler(SchedulerConfig(), 10, device=bad)


# ---- Request ----------------------------------------------------------------------------------
def test_request_normalises_fields():
    r = Request("a", [1, 2, 3], 5, output_ids=np.array([7], np.int64), priority=np.int64(4), enqueue_time=2)
    assert r.prompt_ids.dtype == np.int32 and list(r.prompt_ids) == [1, 2, 3]
    assert not r.prompt_ids.flags.writeable
    assert r.output_ids == [7]
    assert r.priority == 4 and type(r.priority) is int
    assert r.enqueue_time == 2.0
    assert r.fill_len == 4
    assert list(r.fill_ids()) == [1, 2, 3, 7]
    # boundary token ids 0 and 2^31-1 are valid
    assert list(Request("b", [0, 2**31 - 1], 0).prompt_ids) == [0, 2**31 - 1]
    # int64 priority bounds are valid
    assert Request("c", [1], 1, priority=INT64_MIN).priority == INT64_MIN
    assert Request("d", [1], 1, priority=INT64_MAX).priority == INT64_MAX


BAD_REQUESTS = [
    # (kwargs, exception, words that must appear in the message)
    (dict(max_new_tokens=-1), ValueError, ["max_new_tokens", "-1"]),
    (dict(max_new_tokens=2**63), ValueError, ["max_new_tokens", str(2**63)]),
    (dict(max_new_tokens=2.0), TypeError, ["max_new_tokens", "2.0"]),
    (dict(max_new_tokens=True), TypeError, ["max_new_tokens", "True"]),
    (dict(prompt_ids=[1, -1, 2]), ValueError, ["prompt_ids[1]", "-1"]),
    (dict(prompt_ids=[1, 2**31]), ValueError, ["prompt_ids[1]", "2147483648"]),
    (dict(prompt_ids=[2**64]), ValueError, ["prompt_ids[0]", str(2**64)]),
    (dict(prompt_ids=np.array([5, 2**31], np.int64)), ValueError, ["prompt_ids[1]", "2147483648"]),
    (dict(prompt_ids=np.array([1.0, 2.0])), TypeError, ["prompt_ids", "float64"]),
    (dict(prompt_ids=[1, 1.5]), TypeError, ["prompt_ids[1]", "1.5"]),
    (dict(prompt_ids=[1, "2"]), TypeError, ["prompt_ids[1]", "'2'"]),
    (dict(prompt_ids=[1, None]), TypeError, ["prompt_ids[1]", "None"]),
    (dict(prompt_ids=[True, False]), TypeError, ["prompt_ids[0]", "True"]),
    (dict(prompt_ids="abc"), TypeError, ["prompt_ids", "str"]),
    (dict(prompt_ids=[]), ValueError, ["prompt_ids", "0"]),
    (dict(output_ids=[3, -2]), ValueError, ["output_ids[1]", "-2"]),
    (dict(priority="high"), TypeError, ["priority", "'high'"]),
    (dict(priority=1.5), TypeError, ["priority", "1.5"]),
    (dict(priority=True), TypeError, ["priority", "True"]),
    (dict(priority=2**63), ValueError, ["priority", str(2**63)]),
    (dict(priority=-(2**63) - 1), ValueError, ["priority", str(-(2**63) - 1)]),
    (dict(ignore_eos=1), TypeError, ["ignore_eos", "1"]),
    (dict(return_logprob="no"), TypeError, ["return_logprob", "'no'"]),
    (dict(routing_key=5), TypeError, ["routing_key", "5"]),
    (dict(extra_key=b"ns"), TypeError, ["extra_key", "b'ns'"]),
    (dict(logprob_start_len=1.0), TypeError, ["logprob_start_len", "1.0"]),
    (dict(enqueue_time="now"), TypeError, ["enqueue_time", "'now'"]),
    (dict(enqueue_time=float("nan")), ValueError, ["enqueue_time", "finite", "nan"]),
    (dict(enqueue_time=float("inf")), ValueError, ["enqueue_time", "finite", "inf"]),
    (dict(prompt_ids=None), TypeError, ["prompt_ids", "sequence", "NoneType"]),
    (dict(prompt_ids=5), TypeError, ["prompt_ids", "sequence", "int 5"]),
    (dict(prompt_ids=(t for t in range(3))), TypeError, ["prompt_ids", "sequence", "generator"]),
    (dict(output_ids=None), TypeError, ["output_ids", "sequence", "NoneType"]),
]


# ids without reprs: a generator's repr holds its address, which differs between xdist workers
@pytest.mark.parametrize("kwargs,exc,words", BAD_REQUESTS, ids=[f"{i}-{next(iter(k))}" for i, (k, _, _) in enumerate(BAD_REQUESTS)])
def test_request_bad_field_names_field_and_value(kwargs, exc, words):
    base = dict(rid="r1", prompt_ids=[1, 2, 3], max_new_tokens=4)
    base.update(kwargs)
    with pytest.raises(exc) as ei:
        Request(**base)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)
    assert "'r1'" in msg  # the request is named


def test_request_rejects_bool_token_mixed_with_ints():
    """A bool is not a token id. `[True, False]` is refused (above); `[1, True]` must be too:
    numpy turns the list into an int64 array and the bool slips through as token 1."""
    with pytest.raises(TypeError, match=r"prompt_ids\[1\]"):
        Request("r1", [1, True], 4)


@pytest.mark.parametrize("arr,i,value", [(np.array([5, 2**64 - 1], dtype=np.uint64), 1, "18446744073709551615"),
                                         (np.array([2**31], dtype=np.uint32), 0, "2147483648"),
                                         (np.array([7, -3], dtype=np.int16), 1, "-3")])
def test_request_token_array_out_of_range_names_its_value(arr, i, value):
    """An array of ids is checked in its own dtype: a uint64 id is reported as it is, not as
    the negative number a cast to int64 would wrap it to."""
    with pytest.raises(ValueError, match=rf"prompt_ids\[{i}\] = {value} is outside the token id range"):
        Request("r1", arr, 4)
    assert Request("r1", np.array([0, 2**31 - 1], dtype=np.uint64), 4).prompt_ids.tolist() == [0, 2**31 - 1]


def test_request_bad_rid():
    with pytest.raises(ValueError, match="rid"):
        Request("", [1], 1)
    with pytest.raises(TypeError, match="rid"):
        Request(7, [1], 1)


# ---- submit: all or nothing -------------------------------------------------------------------
def _snapshot(s: ReferenceScheduler):
    return ([r.rid for r in s.queue], s.available, s.evictable, s.protected, sorted(s.reqs), s.cache.clock)


@pytest.fixture
def loaded():
    """A scheduler with a cached prefix, one running request and two queued ones."""
    s = ReferenceScheduler(SchedulerConfig(), 100)
    s.seed_cache([1, 2, 3, 4])
    s.seed_running(Request("run", [1, 2, 3, 4, 5], 8, output_ids=[9], enqueue_time=0))
    s.submit([Request("q1", [7, 8], 4), Request("q2", [9, 9, 9], 4)])
    s.check_integrity()
    return s


def _bad_after_construction(kind):
    r = Request("bad", [1, 2, 3], 4)
    if kind == "neg_token":
        r.prompt_ids = [1, -1]
    elif kind == "big_token":
        r.prompt_ids = [2**31]
    elif kind == "float_token":
        r.prompt_ids = [1.5]
    elif kind == "empty_prompt":
        r.prompt_ids = []
    elif kind == "neg_max_new":
        r.max_new_tokens = -3
    elif kind == "bad_priority":
        r.priority = "urgent"
    return r


@pytest.mark.parametrize("kind", ["neg_token", "big_token", "float_token", "empty_prompt", "neg_max_new",
                                  "bad_priority"])
def test_submit_bad_request_leaves_state_unchanged(loaded, kind):
    """A record made bad after construction is caught by submit's validation; the good requests
    before it in the same call are not queued either."""
    before = _snapshot(loaded)
    with pytest.raises((TypeError, ValueError)):
        loaded.submit([Request("ok1", [5, 5], 2), _bad_after_construction(kind), Request("ok2", [6], 2)])
    assert _snapshot(loaded) == before
    loaded.check_integrity()


def test_submit_duplicate_rid_within_one_call(loaded):
    before = _snapshot(loaded)
    with pytest.raises(ValueError, match="submit: rid 'dup' is given twice in this call"):
        loaded.submit([Request("dup", [5], 2), Request("x", [6], 2), Request("dup", [7], 2)])
    assert _snapshot(loaded) == before


@pytest.mark.parametrize("rid", ["q1", "run"])
def test_submit_duplicate_rid_against_existing(loaded, rid):
    """Against a queued request and against a running one."""
    before = _snapshot(loaded)
    with pytest.raises(ValueError, match=repr(rid)):
        loaded.submit([Request("fresh", [5], 2), Request(rid, [6], 2)])
    assert _snapshot(loaded) == before


def test_submit_non_request(loaded):
    before = _snapshot(loaded)
    with pytest.raises(TypeError, match="Request"):
        loaded.submit([Request("fresh", [5], 2), {"rid": "x"}])
    assert _snapshot(loaded) == before


def test_step_rejects_bad_ratio(loaded):
    before = _snapshot(loaded)
    for bad in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="new_token_ratio"):
            loaded.step(bad)
    assert _snapshot(loaded) == before


# ---- the engine-side calls: checked before anything changes ----------------------------------
def _engine_state(s):
    """What the engine-side calls change: queue, running and prefilling rids, each request's
    outputs and KV length, pool and cache counters."""
    return ([r.rid for r in s.queue], [r.rid for r in s.running], [r.rid for r in s.prefilling],
            {rid: (list(r.req.output_ids), r.kv_len) for rid, r in s.reqs.items()},
            s.available, s.evictable, s.protected)


@pytest.fixture(params=["reference", "torch"])
def serving(request):
    """A scheduler of each kind with requests a, b, ab admitted in one plan (not yet prefilled)."""
    from gpu_sched.scheduler import GpuScheduler

    cls = ReferenceScheduler if request.param == "reference" else GpuScheduler
    s = cls(SchedulerConfig(schedule_policy="lpm"), 1000)
    s.submit([Request(x, list(range(1, 9)), 4) for x in ("a", "b", "ab")], now=0.0)
    assert [rid for rid, _, _ in s.step(0.7).admitted] == ["a", "b", "ab"]
    return s


@pytest.mark.parametrize("tokens, exc, words", [
    ({"a": 1, "b": 2}, ValueError, "complete_prefill: first_tokens has no token for request 'ab'"),
    ({"a": 1, "b": 2, "ab": 3, "zz": 4}, ValueError, "['zz'] are not in the prefill"),
    ({"a": 1, "b": 2, "ab": -1}, ValueError, "first_tokens['ab'] = -1 is outside"),
    ({"a": 1, "b": 2, "ab": 3.5}, TypeError, "first_tokens['ab'] must be an int"),
    ({"a": 1, "b": True, "ab": 3}, TypeError, "first_tokens['b'] must be an int"),
    ([("a", 1)], TypeError, "mapping"),
])
def test_complete_prefill_bad_tokens_change_nothing(serving, tokens, exc, words):
    before = _engine_state(serving)
    with pytest.raises(exc) as e:
        serving.complete_prefill(tokens)
    assert words in str(e.value)
    assert _engine_state(serving) == before
    serving.complete_prefill({"a": 1, "b": 2, "ab": 3})  # the right call still works
    serving.check_integrity()
    assert [r.rid for r in serving.running] == ["a", "b", "ab"]


@pytest.mark.parametrize("kind", ["reference", "torch"])
def test_complete_prefill_before_any_step_says_so(kind):
    """complete_prefill() with no plan being run names that, not the rids."""
    from gpu_sched.scheduler import GpuScheduler

    cls = ReferenceScheduler if kind == "reference" else GpuScheduler
    s = cls(SchedulerConfig(), 1000)
    s.submit([Request("a", [1, 2, 3], 4)], now=0.0)
    with pytest.raises(ValueError, match=r"no prefill is being run \(call step\(\) first\), got tokens for \['a'\]"):
        s.complete_prefill({"a": 1})
    assert [r.rid for r in s.queue] == ["a"] and not s.running
    s.complete_prefill({})  # nothing to complete: a no-op, as before


def test_gpu_scheduler_on_cuda_without_cuda_says_so():
    import torch

    from gpu_sched.scheduler import GpuScheduler

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match=r"device 'cuda': torch.cuda.is_available\(\) is False"):
        GpuScheduler(SchedulerConfig(), 1000, device="cuda")


@pytest.mark.parametrize("tokens, exc, words", [
    ({"a": 5, "b": "x", "ab": 1}, TypeError, "tokens['b'] must be an int token id, got str 'x'"),
    ({"a": 5, "b": 1, "ab": 1, "nope": 1}, ValueError, "['nope'] are not running"),
    ({"a": 5, "b": -7, "ab": 1}, ValueError, "tokens['b'] = -7 is outside"),
    ({"a": 5, "b": True, "ab": 1}, TypeError, "tokens['b'] must be an int token id, got bool"),
    ({"a": 5, "b": 1, "ab": 2.0}, TypeError, "tokens['ab'] must be an int token id, got float"),
    ({"a": 5, "b": np.array(1), "ab": 1}, TypeError, "got ndarray array(1) (pass int(token): a sampler's "
     "tensor output needs .tolist() first)"),
    ({"a": 2**40, "b": 1, "ab": 1}, ValueError, "tokens['a'] = 1099511627776 is outside"),
    ({"a": 5, "b": 1}, ValueError, "missing for running requests ['ab']"),
    ({"a": 5, "b": 1, "zz": 1}, ValueError, "['zz'] are not running (and no token for running requests ['ab'])"),
    ({"a": 5, "b": 1, 7: 1}, ValueError, "[7] are not running (and no token"),
])
def test_decode_bad_tokens_change_nothing(serving, tokens, exc, words):
    """A decode with one bad token used to append the others' tokens and take KV slots for
    all before failing; now nothing changes."""
    serving.complete_prefill({"a": 1, "b": 2, "ab": 3})
    before = _engine_state(serving)
    with pytest.raises(exc) as e:
        serving.decode(tokens)
    assert words in str(e.value)
    assert _engine_state(serving) == before
    serving.check_integrity()
    serving.decode({"a": 5, "b": 6, "ab": 7})
    assert [serving.reqs[x].req.output_ids for x in ("a", "b", "ab")] == [[1, 5], [2, 6], [3, 7]]
    serving.check_integrity()


@pytest.mark.parametrize("call, exc, words", [
    (lambda s: s.finish("ab"), TypeError, "got the string 'ab': pass ['ab']"),
    (lambda s: s.abort("ab"), TypeError, "got the string 'ab': pass ['ab']"),
    (lambda s: s.finish(["a", "b", "a"]), ValueError, "finish: request 'a' is given twice"),
    (lambda s: s.abort(["b", "b"]), ValueError, "abort: request 'b' is given twice"),
    (lambda s: s.finish(["a", "zz"]), ValueError, "'zz' is not running: no such request"),
    (lambda s: s.finish(None), TypeError, "finish takes an iterable of rids, got NoneType None"),
    (lambda s: s.abort(7), TypeError, "abort takes an iterable of rids, got int 7"),
])
def test_finish_and_abort_bad_rids_change_nothing(serving, call, exc, words):
    """A string is not read as its characters (finish("ab") used to finish a and b), and a rid
    given twice fails before the first is dropped."""
    serving.complete_prefill({"a": 1, "b": 2, "ab": 3})
    before = _engine_state(serving)
    with pytest.raises(exc) as e:
        call(serving)
    assert words in str(e.value)
    assert _engine_state(serving) == before
    serving.finish(["ab"])
    assert [r.rid for r in serving.running] == ["a", "b"]
    serving.check_integrity()


def test_finish_during_prefill_says_so(serving):
    """finish() of an admitted request before complete_prefill() names the state and what to
    do, not just "not running", and changes nothing."""
    before = _engine_state(serving)
    with pytest.raises(ValueError, match="finish: request 'a' is in the prefill being run: call complete_prefill"):
        serving.finish(["a"])
    assert _engine_state(serving) == before
    with pytest.raises(ValueError, match="finish: request 'zz' is not running: no such request"):
        serving.finish(["zz"])
    serving.submit([Request("w", [5, 6], 2)])
    with pytest.raises(ValueError, match="finish: request 'w' is not running: it is waiting in the queue"):
        serving.finish(["w"])
    assert [r.rid for r in serving.queue] == ["w"]


def test_abort_during_prefill_takes_the_request_out_of_it(serving):
    """abort() of a request of the prefill being run: it leaves the prefill (its prefix lock
    released, nothing allocated or cached), complete_prefill() refuses a token for it and
    completes the others."""
    serving.abort(["b"])
    assert "b" not in serving.reqs and [r.rid for r in serving.prefilling] == ["a", "ab"]
    serving.check_integrity()
    with pytest.raises(ValueError, match=r"\['b'\] are not in the prefill being run"):
        serving.complete_prefill({"a": 1, "b": 2, "ab": 3})
    serving.complete_prefill({"a": 1, "ab": 3})
    assert [r.rid for r in serving.running] == ["a", "ab"]
    serving.check_integrity()
    serving.finish(["a", "ab"])
    assert serving.protected == 0 and serving.available + serving.evictable == 1000


@pytest.mark.parametrize("kind", ["reference", "torch"])
def test_an_in_flight_chunk_that_cannot_fit_can_be_aborted(kind):
    """A chunked request restored with seed_chunked whose fill outgrows the pool: R-ADM-5 admits
    its next chunk whatever the budget, complete_prefill() raises MemoryError with nothing
    running to free, and step() waits for complete_prefill(). abort() of the request is the
    way out (it was refused as "in the prefill being run": the scheduler was stuck; a
    helper's finding, session 51); the scheduler then serves the queue again."""
    from gpu_sched.scheduler import GpuScheduler

    cls = ReferenceScheduler if kind == "reference" else GpuScheduler
    s = cls(SchedulerConfig(chunked_prefill_size=8), 20)
    s.seed_chunked(Request("c", list(range(1, 41)), 4), 8)
    with pytest.raises(MemoryError, match="abort\\(\\) requests of this prefill"):
        for _ in range(4):
            assert [rid for rid, _, _ in s.step(0.7).admitted] == ["c"]
            s.complete_prefill({})
    with pytest.raises(RuntimeError, match="complete_prefill"):
        s.step(0.7)
    s.abort(["c"])
    assert s.chunked is None and not s.prefilling and s.available + s.evictable == 20
    s.check_integrity()
    s.submit([Request("d", [1, 2, 3], 2)])
    assert s.step(0.7).admitted == [("d", 2, 3)]  # c's prefilled chunks stay cached


@pytest.mark.parametrize("kind", ["reference", "torch"])
def test_finish_of_the_chunked_request_says_so(kind):
    """Between its chunks a chunked request is neither running nor in the prefill being run:
    finish() says it is the chunked request."""
    from gpu_sched.scheduler import GpuScheduler

    cls = ReferenceScheduler if kind == "reference" else GpuScheduler
    s = cls(SchedulerConfig(chunked_prefill_size=4), 100)
    s.submit([Request("long", list(range(1, 11)), 4)], now=0.0)
    assert s.step(0.7).new_chunked_rid == "long"
    s.complete_prefill({})
    with pytest.raises(ValueError, match="finish: request 'long' is the chunked request"):
        s.finish(["long"])


@pytest.mark.parametrize("field, meaning", [("chunked_prefill_size", "chunked prefill off"),
                                            ("max_running_requests", "no cap"), ("truncation_align_size", "off")])
def test_config_optional_field_error_says_none(field, meaning):
    """An optional int field's error says what None means (the CLI's 0 = off is not the API's)."""
    with pytest.raises(ValueError, match=rf"{field} must be >= 1 or None \({meaning}\), got 0"):
        SchedulerConfig(**{field: 0})


def test_decode_checks_the_tokens_it_appends(serving):
    """The ids checked are the ids appended: a mapping whose lookups disagree with its items
    (a dict subclass converting on __getitem__) is read once, through its items."""
    class Odd(dict):
        def __getitem__(self, k):
            return "oops"

    serving.complete_prefill({"a": 1, "b": 2, "ab": 3})
    serving.decode(Odd({"a": 5, "b": 6, "ab": 7}))
    assert [serving.reqs[x].req.output_ids for x in ("a", "b", "ab")] == [[1, 5], [2, 6], [3, 7]]
    serving.check_integrity()


def test_decode_numpy_token_ids_become_python_ints(serving):
    """Token ids may be numpy integers (an engine's sampled tensor read back); outputs hold
    them as Python ints, as plain ints are held."""
    serving.complete_prefill({"a": 1, "b": 2, "ab": 3})
    serving.decode({"a": np.int32(5), "b": np.int64(6), "ab": 7})
    outs = [serving.reqs[x].req.output_ids for x in ("a", "b", "ab")]
    assert outs == [[1, 5], [2, 6], [3, 7]] and all(type(t) is int for o in outs for t in o)
    serving.check_integrity()


@pytest.mark.parametrize("kind", ["reference", "torch"])
def test_decode_that_cannot_fit_evicts_nothing(kind):
    """A decode step the free and evictable pool cannot hold fails before evicting: the cached
    pages stay (the engine retracts, then decodes). Three requests admitted at a low ratio
    overcommit the pool; two 1-token cache entries are all that is evictable at the end."""
    from gpu_sched.scheduler import GpuScheduler

    cls = ReferenceScheduler if kind == "reference" else GpuScheduler
    s = cls(SchedulerConfig(), 152)
    for t in (100, 101):
        s.seed_cache(np.array([t], np.int32))
    for i, x in enumerate("abc"):
        s.submit([Request(x, list(range(10 * i + 1, 10 * i + 9)), 100)], now=float(i))
        assert [rid for rid, _, _ in s.step(0.05).admitted] == [x]
        s.complete_prefill({x: 1})
    while s.available + s.evictable >= 3:
        s.decode({x: 5 for x in "abc"})
    assert (s.available, s.evictable) == (0, 2)  # 3 slots needed, 2 could be evicted
    before = _engine_state(s)
    with pytest.raises(MemoryError, match=r"decode: the step needs 3 KV slots, 0 free and 2 evictable; "
                                          r"call retract_decode\(\) first"):
        s.decode({x: 5 for x in "abc"})
    assert _engine_state(s) == before
    s.check_integrity()


def test_submit_and_step_reject_bad_arguments(serving):
    serving.complete_prefill({"a": 1, "b": 2, "ab": 3})
    before = _engine_state(serving)
    with pytest.raises(TypeError, match=r"got one Request \(rid 'z'\): pass \[request\]"):
        serving.submit(Request("z", [1], 1))
    with pytest.raises(ValueError, match="submit: now must be finite, got nan"):
        serving.submit([Request("z", [1], 1)], now=math.nan)
    with pytest.raises(TypeError, match="new_token_ratio must be a number in \\(0, 1\\], got str '0.5'"):
        serving.step("0.5")
    with pytest.raises(TypeError, match=r"got NewTokenRatio .* \(pass its \.value, 0\.7\)"):
        serving.step(NewTokenRatio())  # the object, not its value
    with pytest.raises(TypeError, match=r"got ndarray array\(0\.5\) \(pass float\(x\) or x\.item\(\)\)"):
        serving.step(np.array(0.5))
    with pytest.raises(ValueError, match="step: now must be finite, got inf"):
        serving.step(0.5, now=math.inf)
    with pytest.raises(TypeError, match="step: now must be a number"):
        serving.step(0.5, now="1")
    assert _engine_state(serving) == before
    serving.check_integrity()


def test_step_before_complete_prefill_names_the_prefill(serving):
    """A second step() before complete_prefill() is refused, naming the plan's requests still
    in prefill, and changes nothing."""
    before = _engine_state(serving)
    with pytest.raises(RuntimeError) as e:
        serving.step(0.7)
    assert "step() called before complete_prefill() of the previous plan (its prefill: 3 request(s), " \
           "['a', 'b', 'ab'])" in str(e.value)
    assert _engine_state(serving) == before
    serving.complete_prefill({"a": 1, "b": 2, "ab": 3})
    serving.step(0.7)


def test_package_exports_both_schedulers_lazily():
    """`from gpu_sched import GpuScheduler, ReferenceScheduler` works, and `import gpu_sched`
    alone does not import torch (the schedulers load on first use)."""
    import subprocess
    import sys

    import gpu_sched
    from gpu_sched.reference import ReferenceScheduler as Ref
    from gpu_sched.scheduler import GpuScheduler as Gpu

    assert gpu_sched.GpuScheduler is Gpu and gpu_sched.ReferenceScheduler is Ref
    assert {"GpuScheduler", "ReferenceScheduler"} <= set(gpu_sched.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Scheduler'"):
        gpu_sched.Scheduler
    code = "import sys, gpu_sched; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
