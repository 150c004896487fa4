"""Calls that fail leave a scheduler as it was (README: every call checks its arguments before it
changes anything), on both schedulers (they share these calls): complete_prefill short of KV
slots, seeding short of free slots, an out-of-range token for the chunked request; config knobs
past int64 or 2^40; request inputs the caller may reuse or that read as something else."""

import copy

import numpy as np
import pytest
import torch

from _scenarios import dev_triples, ref_triples
from gpu_sched import Request, SchedulerConfig
from gpu_sched.config import INT64_MAX, INT64_MIN, PAGE_SIZE_MAX, TOKEN_KNOB_MAX
from gpu_sched.plan import PrefillPlan
from gpu_sched.ratio import NewTokenRatio
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.reference.state import KV_DECODE_HEADROOM
from gpu_sched.scheduler import GpuScheduler

SCHEDULERS = [ReferenceScheduler, GpuScheduler]


def triples(s):
    return dev_triples(s.cache) if isinstance(s, GpuScheduler) else ref_triples(s.cache)


def state(s) -> dict:
    return dict(queue=[r.rid for r in s.queue], running=[r.rid for r in s.running],
                prefilling=[r.rid for r in s.prefilling], chunked=s.chunked.rid if s.chunked else None,
                sizes=(s.available, s.evictable, s.protected), reqs=sorted(s.reqs),
                outs={rid: list(r.req.output_ids) for rid, r in s.reqs.items()},
                kv={rid: r.kv[: r.kv_len].tolist() for rid, r in s.reqs.items()}, tree=triples(s))


def after_eviction(s) -> set:
    """The cache left by evicting half its evictable tokens: which prefixes go first is the
    stamps' (LRU) order, which a failed call must not have touched either."""
    s.cache.evict(s.evictable // 2)
    s.check_integrity()
    return triples(s)


def _short_prefill(cls):
    """A plan admitted at step() whose slots decode() then uses up (40-slot pool)."""
    s = cls(SchedulerConfig(chunked_prefill_size=None), kv_pool_size=40)
    s.seed_cache([5, 6, 7, 8])
    s.seed_cache([9, 9, 9, 9])  # unlocked: evictable
    s.submit([Request("run", [1] * 10, 25)], now=0.0)
    s.step(0.01)
    s.complete_prefill({"run": 5})
    s.submit([Request("p1", [5, 6, 7, 8, 2, 2], 1), Request("p2", [3] * 15, 1)], now=1.0)
    assert [a[0] for a in s.step(0.01).admitted] == ["p1", "p2"]
    for _ in range(12):
        s.decode({"run": 6})
    return s


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_complete_prefill_short_of_slots_changes_nothing(cls):
    """More extend tokens than free + evictable slots: MemoryError naming the counts before any
    allocation or eviction; after finish() frees slots the same call goes through, and the
    scheduler equals a twin that never saw the failed call (its cache's LRU order included)."""
    s, twin = _short_prefill(cls), _short_prefill(cls)
    before = state(s)
    with pytest.raises(MemoryError, match=r"needs 17 KV slots, 10 free and 4 evictable"):
        s.complete_prefill({"p1": 7, "p2": 8})
    assert state(s) == before
    s.check_integrity()
    for x in (s, twin):
        x.finish(["run"])
        x.complete_prefill({"p1": 7, "p2": 8})
        x.check_integrity()
    assert state(s) == state(twin)
    assert after_eviction(s) == after_eviction(twin)


@pytest.mark.parametrize("cls", SCHEDULERS)
@pytest.mark.parametrize("max_new", [2**40, INT64_MAX])
def test_huge_max_new_tokens_reserve_a_bounded_kv_array(cls, max_new):
    """max_new_tokens up to int64's largest is a valid request: its KV array is sized for at
    most KV_DECODE_HEADROOM decode steps (not max_new_tokens), and grows past them."""
    s = cls(SchedulerConfig(), kv_pool_size=10_000)
    s.submit([Request("ok", [1, 2, 3], 16), Request("huge", [4, 5, 6], max_new)], now=0.0)
    assert [a[0] for a in s.step(0.7).admitted] == ["ok", "huge"]
    s.complete_prefill({"ok": 11, "huge": 12})
    assert len(s.reqs["huge"].kv) <= 3 + KV_DECODE_HEADROOM + 1
    for _ in range(KV_DECODE_HEADROOM + 5):  # past the headroom: the array doubles
        s.decode({"ok": 1, "huge": 2})
    assert s.reqs["huge"].kv_len == 3 + KV_DECODE_HEADROOM + 5
    s.check_integrity()


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_complete_prefill_checks_the_chunked_requests_token_too(cls):
    """A token given for the chunked request (whose prefill is not done) is not used, but a bad
    one is refused like any other, with nothing changed."""
    s = cls(SchedulerConfig(chunked_prefill_size=16), kv_pool_size=1000)
    s.submit([Request("a", list(range(40)), 4)], now=0.0)
    assert s.step(0.7).new_chunked_rid == "a"
    before = state(s)
    for bad, err in ((-1, ValueError), (2**31, ValueError), (1.0, TypeError)):
        with pytest.raises(err, match=r"first_tokens\['a'\]"):
            s.complete_prefill({"a": bad})
        assert state(s) == before
    s.complete_prefill({"a": 3})
    s.check_integrity()


def _seeded(cls):
    s = cls(SchedulerConfig(), 20)
    s.seed_cache([1, 2, 3, 4, 5, 6, 7, 8])
    s.seed_cache([9, 9, 9, 9])
    return s


@pytest.mark.parametrize("cls", SCHEDULERS)
@pytest.mark.parametrize("call", ["seed_running", "seed_chunked", "seed_cache"])
def test_seeding_short_of_free_slots_changes_nothing(cls, call):
    """Seeding evicts nothing: a request or prefix whose uncached tokens need more than the free
    slots raises MemoryError before it matches (stamps, splits) or locks anything."""
    s, twin = _seeded(cls), _seeded(cls)
    before = state(s)
    prompt = [1, 2, 3, 4, 5] + list(range(100, 120))  # a split of the cached 8-token node, 20 uncached
    with pytest.raises(MemoryError, match=r"needs \d+ KV slots .* 8 free"):
        if call == "seed_running":
            s.seed_running(Request("big", prompt, 4))
        elif call == "seed_chunked":
            s.seed_chunked(Request("big", prompt + [1], 4), done=len(prompt))
        else:
            s.seed_cache(prompt)
    assert state(s) == before
    s.check_integrity()
    assert after_eviction(s) == after_eviction(twin)


@pytest.mark.parametrize("call", ["seed_running", "seed_chunked", "seed_cache"])
def test_seeding_short_of_free_slots_names_no_new_namespace(call):
    """A request or prefix in a namespace the cache has not seen (its `extra_key`) that does
    not fit: the device cache's namespace ids stay as they were (the free-pool check reads
    a never-seen namespace as holding nothing, without giving it an id)."""
    s = _seeded(GpuScheduler)
    ids = dict(s.cache._ns)
    prompt = list(range(100, 120))
    with pytest.raises(MemoryError, match="needs"):
        if call == "seed_running":
            s.seed_running(Request("big", prompt, 4, extra_key="fresh"))
        elif call == "seed_chunked":
            s.seed_chunked(Request("big", prompt + [1], 4, extra_key="fresh"), done=len(prompt))
        else:
            s.seed_cache(prompt, extra_key="fresh")
    assert s.cache._ns == ids
    assert s.seed_cache([7, 7, 7], extra_key="fresh") == 3 and "fresh" in s.cache._ns  # fits: named now
    s.check_integrity()


@pytest.mark.parametrize("cls", SCHEDULERS)
@pytest.mark.parametrize("done", [2.0, "2", None, True])
def test_seed_chunked_done_not_an_int_changes_nothing(cls, done):
    """A `done` that is not an int is a TypeError naming the call and the field, raised before
    anything is matched or locked (a float once failed inside the slicing, unnamed); a numpy
    integer is taken as an int (it once reached the KV pool's free counter as a numpy int)."""
    s = _seeded(cls)
    before = state(s)
    with pytest.raises(TypeError, match=r"seed_chunked: done must be an int, got"):
        s.seed_chunked(Request("c", [1, 2, 3, 4, 50, 51], 4), done)
    assert state(s) == before
    s.check_integrity()
    s.seed_chunked(Request("c", [1, 2, 3, 4, 50, 51], 4), np.int64(2))
    assert s.chunked.rid == "c" and type(s.available) is int  # a numpy int once leaked into the pool's counter
    s.step(0.5).to_dict()  # and then broke every plan's to_dict


TOKEN_KNOBS = ["max_prefill_tokens", "chunked_prefill_size", "clip_max_new_tokens",
               "truncation_align_size"]
INT64_KNOBS = ["max_running_requests", "prefill_max_requests", "lpm_fallback_queue_len",
               "in_batch_prefix_caching_check_threshold", "in_batch_prefix_caching_deprioritize_threshold",
               "priority_scheduling_preemption_threshold"]


@pytest.mark.parametrize("name", ["page_size"] + TOKEN_KNOBS + INT64_KNOBS)
def test_config_knobs_have_an_upper_bound(name):
    """The page size up to 2^20 (the radix kernels' bound), other token knobs up to 2^40 (the
    device's int64 sums of them cannot overflow), the rest up to int64's largest (the device
    holds them as int64); one more is a ValueError naming the field and the value."""
    hi = PAGE_SIZE_MAX if name == "page_size" else TOKEN_KNOB_MAX if name in TOKEN_KNOBS else INT64_MAX
    assert getattr(SchedulerConfig(**{name: hi}), name) == hi
    with pytest.raises(ValueError, match=rf"{name} must be <= {hi} .*got {hi + 1}"):
        SchedulerConfig(**{name: hi + 1})


def test_config_threshold_lower_bound_and_numpy_integers():
    assert SchedulerConfig(priority_scheduling_preemption_threshold=INT64_MIN).priority_scheduling_preemption_threshold == INT64_MIN
    with pytest.raises(ValueError, match="priority_scheduling_preemption_threshold must be >="):
        SchedulerConfig(priority_scheduling_preemption_threshold=INT64_MIN - 1)
    c = SchedulerConfig(page_size=np.int64(4), max_running_requests=np.uint32(3), random_seed=np.uint64(2**64 - 1))
    assert (c.page_size, c.max_running_requests, c.random_seed) == (4, 3, 2**64 - 1)
    assert all(type(v) is int for v in (c.page_size, c.max_running_requests, c.random_seed))
    assert c.replace(page_size=np.int32(16)).page_size == 16
    with pytest.raises(TypeError, match="page_size must be an int, got bool"):
        SchedulerConfig(page_size=np.True_)


def test_request_keeps_its_own_copy_of_the_prompt():
    """The caller's buffer is neither frozen nor shared: an engine that reuses it does not change
    a queued prompt (an int32 array, a view of one, an int32 tensor)."""
    arr = np.array([1, 2, 3, 4], dtype=np.int32)
    t = torch.tensor([5, 6, 7], dtype=torch.int32)
    reqs = [Request("a", arr, 2), Request("v", arr[1:], 2), Request("t", t, 2)]
    assert arr.flags.writeable
    arr[:] = 9
    t[:] = 0
    assert [r.prompt_ids.tolist() for r in reqs] == [[1, 2, 3, 4], [2, 3, 4], [5, 6, 7]]
    assert not any(r.prompt_ids.flags.writeable for r in reqs)


@pytest.mark.parametrize("prompt,err,msg", [
    ([1, np.True_], TypeError, r"prompt_ids\[1\] must be an int, got bool"),
    ({1: 2}, TypeError, "prompt_ids must be a sequence of ints, got dict"),
])
def test_request_refuses_prompts_that_would_read_as_other_tokens(prompt, err, msg):
    with pytest.raises(err, match=msg):
        Request("a", prompt, 2)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_submit_of_a_non_iterable_names_what_it_takes(cls):
    s = cls(SchedulerConfig(), 100)
    for bad in (None, 7):
        with pytest.raises(TypeError, match="submit takes an iterable of Request objects, got"):
            s.submit(bad)
    assert state(s)["queue"] == []


# ---- copies and pickles of a scheduler mid-run ---------------------------------------------------
def _mid_run(cls, policy):
    s = cls(SchedulerConfig(schedule_policy=policy, max_prefill_tokens=8, chunked_prefill_size=None), 10_000)
    s.submit([Request(f"r{i}", [1, 2, i + 1] * 2, 4) for i in range(8)], now=0.0)
    s.step(0.5)
    s.complete_prefill({r.rid: 1 for r in s.prefilling})
    return s


def _go_on(s, steps=6) -> list:
    plans = []
    for t in range(steps):
        p = s.step(0.5)
        plans.append((list(p.admitted), list(p.queue_order)))
        s.complete_prefill({r.rid: 1 for r in s.prefilling})
        s.submit([Request(f"n{t}", [1, 2, 3, t], 2)], now=float(t + 1))
        s.check_integrity()
    return plans


@pytest.mark.parametrize("cls", SCHEDULERS)
@pytest.mark.parametrize("policy", ["random", "lpm", "fcfs"])
def test_a_copy_or_pickle_mid_run_goes_on_as_the_original(cls, policy):
    """A deep copy and a pickle round trip of a scheduler mid-run each decide what the
    original decides from there, `random`'s draws included: each carries its own generator
    (the reference's default shuffle was a closure, which a copy shared with the original, and
    the scheduler's views table did not pickle)."""
    import copy
    import pickle

    a = _mid_run(cls, policy)
    b, c = copy.deepcopy(a), pickle.loads(pickle.dumps(a))
    if hasattr(a, "hash_seed"):  # the secret prefix-hash bases travel with the copies (their rows hold hashes)
        assert b.hash_seed == c.hash_seed == a.hash_seed
        assert (b.cache.tree.B1, b.cache.tree.B2) == (c.cache.tree.B1, c.cache.tree.B2) == (a.cache.tree.B1, a.cache.tree.B2)
    want = _go_on(a)
    assert _go_on(b) == want and _go_on(c) == want


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "routing-key"])
def test_a_copy_or_pickle_of_a_recorded_step_goes_on_as_the_original(policy):
    """After `capture()` too: the copies' recorded step uploads its own inputs (its numpy view of
    the input stage was a detached copy, so a copied scheduler decided on stale inputs: a
    64-token prompt admitted as 2 cached tokens of another prompt plus one, or nothing), and
    each decides as the reference from the same point, before and after its first recorded
    step."""
    import copy
    import pickle

    from gpu_sched import GpuScheduler

    def prime(s):
        s.submit([Request("w", [1, 2, 3], 1)])
        s.step(0.7)
        s.complete_prefill({"w": 1})
        s.finish(["w"])
        s.submit([Request("a", list(range(10, 74)), 2)])

    cfg = SchedulerConfig(schedule_policy=policy)
    for copy_before_first_step in (True, False):
        ref, dev = ReferenceScheduler(cfg, 1500), GpuScheduler(cfg, 1500, backend="torch", device="cpu")
        dev.capture(queue_capacity=64, running_capacity=16)
        if copy_before_first_step:
            dev = copy.deepcopy(dev)
        for s in (ref, dev):
            prime(s)
        b, c = copy.deepcopy(dev), pickle.loads(pickle.dumps(dev))
        want = _go_on(ref)
        assert want[0][0] == [("a", 0, 64)]
        for s in (dev, b, c):
            assert _go_on(s) == want
            assert s._graph.runs > 0  # the recorded step decided


# ---- the simulator's inputs built in code ----------------------------------------------------------
@pytest.mark.parametrize("fields,err,msg", [
    (dict(arrival_s=float("nan"), input_len=10, output_len=3), ValueError, "arrival_s must be a finite number"),
    (dict(arrival_s=float("inf"), input_len=10, output_len=3), ValueError, "arrival_s must be a finite number"),
    (dict(arrival_s=0.0, input_len=0, output_len=3), ValueError, r"input_len must be in \[1, 16777216\], got 0"),
    (dict(arrival_s=0.0, input_len=10, output_len=-1), ValueError, r"output_len must be in \[0, 16777216\], got -1"),
    (dict(arrival_s=0.0, input_len=10, output_len=2**40), ValueError, "output_len must be in"),
    (dict(arrival_s=0.0, input_len=10.0, output_len=1), TypeError, "input_len must be an int"),
])
def test_replay_refuses_trace_requests_it_cannot_run(fields, err, msg):
    """A NaN arrival never arrives (the replay idled forever), a negative or huge length cannot
    be built: refused with the request named, before the replay starts."""
    from gpu_sched.sim.engine import replay
    from gpu_sched.sim.traces import Trace, TraceRequest

    trace = Trace("t", [TraceRequest(index=0, arrival_s=0.0, input_len=5, output_len=1),
                        TraceRequest(index=1, **fields)])
    with pytest.raises(err, match=rf"trace request 1: {msg}"):
        replay(trace, SchedulerConfig(), kv_tokens=1000, make_scheduler=ReferenceScheduler)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 1e308, True, "1"])
def test_cost_model_built_in_code_is_checked(value):
    from gpu_sched.sim.engine import CostModel

    with pytest.raises(ValueError, match=r"CostModel prefill_token_s must be a number of seconds in \[0, 3600\]"):
        CostModel("m", "", fixed_s=0.0, prefill_token_s=value, decode_request_s=0.0, kv_token_s=0.0)
    assert CostModel("m", "", fixed_s=1, prefill_token_s=0, decode_request_s=0, kv_token_s=0).fixed_s == 1.0


@pytest.mark.parametrize("page_size, disable", [(1, False), (4, False), (1, True)])
def test_gpu_seed_cache_searches_once_and_seeds_as_the_reference(page_size, disable, monkeypatch):
    """`seed_cache` asks a device cache for the present length once (given the slots as an
    array, its insert does not search for that length again, as it does for a callable) and
    leaves the same slots, cache and results as the reference's, over prompts that share
    prefixes, split nodes, end inside a page and use a second namespace."""
    cfg = SchedulerConfig(page_size=page_size, disable_radix_cache=disable)
    ref, dev = ReferenceScheduler(cfg, 400), GpuScheduler(cfg, 400)
    calls = []
    real = type(dev.cache).present_len
    monkeypatch.setattr(type(dev.cache), "present_len", lambda c, *a: calls.append(1) or real(c, *a))
    prompts = [([1, 2, 3, 4, 5, 6, 7, 8, 9], None), ([1, 2, 3, 4, 9, 9, 9, 9], None), ([1, 2, 3], None),
               ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], None), ([1, 2, 3, 4, 5, 6], "ns"), ([5] * 10, None)]
    for toks, ns in prompts:
        assert dev.seed_cache(toks, extra_key=ns) == ref.seed_cache(toks, extra_key=ns)
        assert (dev.available, dev.evictable) == (ref.available, ref.evictable)
    assert len(calls) == (0 if disable else len(prompts))
    assert triples(dev) == triples(ref)
    dev.check_integrity()


class _Shuffle:
    """A `shuffle=` that returns a non-permutation while `bad` is set."""
    bad = False

    def __call__(self, n):
        return [0] * n if self.bad else list(range(n))


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_step_refused_by_its_shuffle_changes_nothing(cls):
    """A step whose custom shuffle (R-ORD-6) is refused leaves the clock and the batch-full
    flag as they were: a request submitted later without `now` is stamped as on a twin that
    never saw the call (the failed step's `now` once stuck)."""
    s = cls(SchedulerConfig(schedule_policy="random"), 200, shuffle=_Shuffle())
    s.submit([Request("a", [1, 2, 3], 3), Request("b", [4, 5, 6], 3)], now=0.0)
    s.step(0.5, now=1.0)
    s.complete_prefill({"a": 1, "b": 2})
    s.submit([Request("c", [7, 8], 2), Request("d", [9, 9], 2)], now=1.0)
    twin = copy.deepcopy(s)
    before = (s.now, s.batch_is_full, state(s))
    s.shuffle.bad = True
    with pytest.raises(ValueError, match="not a permutation"):
        s.step(0.5, now=1000.0)
    assert (s.now, s.batch_is_full, state(s)) == before
    for x in (s, twin):
        x.shuffle.bad = False
        x.submit([Request("late", [3, 3], 1)])
    assert s.reqs["late"].enqueue_time == twin.reqs["late"].enqueue_time == 1.0
    assert s.step(0.5).to_dict() == twin.step(0.5).to_dict()


@pytest.mark.parametrize("cls", SCHEDULERS)
@pytest.mark.parametrize("disable", [False, True])
def test_seed_cache_checks_its_arguments_with_the_cache_on_or_off(cls, disable):
    """seed_cache checks tokens and extra_key whether or not the cache is disabled (with it
    off, anything was once taken and 0 returned); an int extra_key once became a namespace."""
    s = cls(SchedulerConfig(disable_radix_cache=disable), 100)
    before = state(s)
    for args, kw, err, match in (
            (([1, -1, 2**40],), {}, ValueError, r"seed_cache tokens\[1\] = -1 is outside"),
            (("abc",), {}, TypeError, "seed_cache tokens must be a sequence of ints"),
            ((None,), {}, TypeError, "seed_cache tokens must be a sequence of ints"),
            (([1, 2, 3, 4],), {"extra_key": 5}, TypeError, "seed_cache: extra_key must be a str or None, got 5"),
            (([1, 2, 3, 4],), {"extra_key": ["x"]}, TypeError, "seed_cache: extra_key must be a str or None")):
        with pytest.raises(err, match=match):
            s.seed_cache(*args, **kw)
        assert state(s) == before
    assert s.seed_cache([1, 2, 3, 4], extra_key="ns") == (0 if disable else 4)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_wrong_kinds_of_arguments_name_the_call(cls):
    """Unhashable rids, a seed of something other than a Request and decode_fits of
    something other than request states: a TypeError naming the call, nothing changed (bare
    'unhashable type' and AttributeErrors once; decode_fits(['a']) was taken at page size 1)."""
    for P in (1, 4):
        s = cls(SchedulerConfig(page_size=P), 100)
        s.submit([Request("a", [1, 2, 3], 3)])
        s.step(0.5)
        s.complete_prefill({"a": 1})
        before = state(s)
        for call, match in ((lambda: s.finish(["a", ["b"]]), r"finish: a rid must be hashable \(a str\), got list"),
                            (lambda: s.abort([{"x": 1}]), r"abort: a rid must be hashable \(a str\), got dict"),
                            (lambda: s.seed_running({"rid": "q"}), "seed_running takes one Request object, got dict"),
                            (lambda: s.seed_chunked("q", 1), "seed_chunked takes one Request object, got str"),
                            (lambda: s.decode_fits(["a"]), "decode_fits: reqs must hold request states")):
            with pytest.raises(TypeError, match=match):
                call()
            assert state(s) == before
        assert s.decode_fits(list(s.running))
    if cls is GpuScheduler:
        with pytest.raises(TypeError, match="queue: expected a sequence of request states, got NoneType"):
            s.queue = None


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_kv_pool_size_past_the_token_bound_names_it(cls):
    """kv_pool_size above 2^40 tokens is a ValueError naming it (numpy's 'array is too big'
    or 'Maximum allowed size exceeded' once)."""
    for kv in (2**40 + 1, 2**62, 10**20):
        with pytest.raises(ValueError, match=rf"kv_pool_size must be <= 2\^40 tokens, got {kv}"):
            cls(SchedulerConfig(), kv)


def test_capture_capacities_have_an_upper_bound():
    """Capacities above 2^24 and a max_len above 2^40 are ValueErrors naming the argument
    (torch's 'Storage size calculation overflowed' once), the previous recording kept."""
    s = GpuScheduler(SchedulerConfig(), 100)
    for kw, match in ((dict(queue_capacity=2**24 + 1), r"queue_capacity must be <= 16777216 \(2\^24\)"),
                      (dict(running_capacity=2**62), r"running_capacity must be <= 16777216 \(2\^24\)"),
                      (dict(max_len=2**40 + 1), r"max_len must be <= 1099511627776 \(2\^40\)")):
        with pytest.raises(ValueError, match=match):
            s.capture(**kw)
        assert s._graph is None


@pytest.mark.parametrize("tokens", [bytearray(b"ab"), memoryview(b"ab"), torch.tensor(3), np.int64(3)])
def test_prompts_that_are_not_token_sequences_are_refused(tokens):
    """Byte buffers (bytes were refused, bytearray and memoryview read as byte values) and a
    single number (a 0-d tensor failed in torch's len()) are TypeErrors naming the field."""
    with pytest.raises(TypeError, match="prompt_ids must be a sequence of ints"):
        Request("x", tokens, 1)


def test_conservativeness_numpy_and_past_float_range():
    """numpy floats are taken (np.float32 was refused while np.float64 passed), stored as
    Python numbers; an int past float's range is a ValueError naming the knob (it passed, and
    the new-token ratio then raised a bare OverflowError)."""
    for v in (np.float32(1.5), np.float64(1.5), np.int64(2)):
        c = SchedulerConfig(schedule_conservativeness=v)
        assert c.schedule_conservativeness == v and type(c.schedule_conservativeness) in (int, float)
    with pytest.raises(ValueError, match="schedule_conservativeness must be a finite number > 0"):
        SchedulerConfig(schedule_conservativeness=10**400)
    assert NewTokenRatio.from_config(SchedulerConfig(schedule_conservativeness=2**1000)).value == 1.0


def test_plan_from_dict_checks_match_lengths_and_policy_names():
    d = PrefillPlan().to_dict()
    with pytest.raises(ValueError, match="num_matched entry -1 is not an int >= 0"):
        PrefillPlan.from_dict({**d, "num_matched": [-1]})
    with pytest.raises(ValueError, match="active_policy must be one of"):
        PrefillPlan.from_dict({**d, "active_policy": "lpm2"})
    assert PrefillPlan.from_dict({**d, "active_policy": "lpm", "num_matched": [0, 3]}).num_matched == [0, 3]
