"""`prepare_prefill()` and `prepare_decode()`: a forward pass's KV slots before it runs
(README, "KV slots"). Calling them or not changes no decision and no slot; the slots they
return are the ones the requests keep; they allocate all or nothing; aborts, retractions and
finishes after them give back what they gave."""

import random

import numpy as np
import pytest

from _scenarios import ref_triples
from gpu_sched import Request, SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.scheduler import GpuScheduler
from test_scheduler_differential import make_request, random_config


def _copy(reqs):
    return [Request(**{k: getattr(r, k) for k in r.__dataclass_fields__}) for r in reqs]


@pytest.mark.parametrize("seed", range(40))
def test_prepared_prefill_decides_and_allocates_as_the_unprepared(seed):
    """Three schedulers on one random workload: the reference without prepare_prefill, the
    reference and GpuScheduler with it (before the "forward"). Every plan, every request's KV
    slots and the pool sizes stay equal; a prepared request's slots are the ones it keeps
    after complete_prefill (the chunked request's up to the part a finished request cached
    meanwhile, which the cache's slots replace) and no two live requests' private slots meet."""
    rng = random.Random(seed)
    cfg = random_config(rng)
    kv = rng.choice([300, 800, 3000])
    plain, prep, dev = ReferenceScheduler(cfg, kv), ReferenceScheduler(cfg, kv), GpuScheduler(cfg, kv)
    vocab = rng.choice([3, 8, 50])
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(10, 120))] for _ in range(3)]
    goal, next_id = {}, 0
    for t in range(60):
        if rng.random() < 0.5:
            reqs = [make_request(rng, next_id + j, bases, vocab, float(t)) for j in range(rng.randrange(1, 6))]
            next_id += len(reqs)
            goal.update({r.rid: rng.randrange(1, 8) for r in reqs})
            for s in (plain, prep, dev):
                s.submit(_copy(reqs), now=float(t))
        plans = [s.step(0.7, now=float(t)).to_dict() for s in (plain, prep, dev)]
        assert plans[0] == plans[1] == plans[2], f"seed {seed} step {t}"
        got = [s.prepare_prefill() for s in (prep, dev)]
        assert {k: v.tolist() for k, v in got[0].items()} == {k: v.tolist() for k, v in got[1].items()}
        assert got[0] == {} or set(got[0]) == {r.rid for r in prep.prefilling}
        assert {k: v.tolist() for k, v in prep.prepare_prefill().items()} == {k: v.tolist() for k, v in got[0].items()}
        for r in prep.prefilling:  # the extend range's slots: the pool's, held by this request alone
            new = got[0][r.rid][r.extend_start:]
            assert len(new) == r.extend_end - r.extend_start and len(set(new.tolist())) == len(new)
        private = np.concatenate([r.private_slots() for r in prep.reqs.values()] or [np.zeros(0, np.int64)])
        assert len(set(private.tolist())) == len(private), f"seed {seed} step {t}: a slot held twice"
        first = {rid: 7 for rid, _, _ in plans[0]["admitted"]}
        for s in (plain, prep, dev):
            s.complete_prefill(first)
        for rid, slots in got[0].items():
            r = prep.reqs[rid]
            if r is prep.chunked:  # from the cached length on, its own slots
                assert r.kv[r.cached_len : len(slots)].tolist() == slots[r.cached_len:].tolist()
            else:
                assert r.kv[: len(slots)].tolist() == slots.tolist()
        for rid, r in plain.reqs.items():
            for other in (prep, dev):
                assert other.reqs[rid].kv[: other.reqs[rid].kv_len].tolist() == r.kv[: r.kv_len].tolist(), rid
        if plain.running and rng.random() < 0.7:
            if not plain.decode_fits():
                out = plain.retract_decode()
                assert out == prep.retract_decode() == dev.retract_decode()
            else:
                assert prep.decode_fits() and dev.decode_fits()
            if rng.random() < 0.8:  # the decode's slots before its forward
                ds = [s.prepare_decode() for s in (prep, dev)]
                assert ds[0] == ds[1] == prep.prepare_decode() and set(ds[0]) == {r.rid for r in plain.running}
                assert not prep.decode_fits() or prep.decode_tokens_needed() == 0
            else:
                ds = None
            toks = {r.rid: rng.randrange(vocab) for r in plain.running}
            for s in (plain, prep, dev):
                s.decode(toks)
            if ds is not None:
                assert {r.rid: int(r.kv[r.kv_len - 1]) for r in prep.running} == ds[0]
        done = [r.rid for r in plain.running if len(r.req.output_ids) >= goal[r.rid]]
        if done:
            for s in (plain, prep, dev):
                s.finish(done)
        sizes = [(s.available, s.evictable, s.protected) for s in (plain, prep, dev)]
        assert sizes[0] == sizes[1] == sizes[2], f"seed {seed} step {t}"
        assert ref_triples(plain.cache) == ref_triples(prep.cache)
        for s in (prep, dev):
            s.check_integrity()


@pytest.mark.parametrize("cls", [ReferenceScheduler, GpuScheduler])
def test_prepare_prefill_errors_and_aborts(cls):
    """No prefill: {}. Short of slots: MemoryError with nothing allocated. An abort after it
    frees the request's new slots; complete_prefill then takes the rest."""
    s = cls(SchedulerConfig(page_size=1), 40)
    assert s.prepare_prefill() == {}
    s.seed_cache([1, 2, 3, 4])
    s.submit([Request("a", [1, 2, 3, 4, 5, 6], 4), Request("b", [9, 9, 9], 4)], now=0.0)
    plan = s.step(0.7)
    assert [x[0] for x in plan.admitted] == ["a", "b"]
    free = s.available
    slots = s.prepare_prefill()
    assert slots["a"][:4].tolist() == s.cache.path_values(s.reqs["a"].lock_node).tolist()  # the cached prefix
    assert len(slots["a"]) == 6 and len(slots["b"]) == 3 and s.available == free - 2 - 3
    s.abort(["b"])
    assert s.available == free - 2
    s.complete_prefill({"a": 5})
    assert s.reqs["a"].kv[:6].tolist() == slots["a"].tolist() and [r.rid for r in s.running] == ["a"]
    assert s.prepare_prefill() == {}

    t = cls(SchedulerConfig(page_size=1, chunked_prefill_size=64, max_prefill_tokens=256), 260)
    t.submit([Request("R", list(range(10, 60)), max_new_tokens=150, ignore_eos=True)], now=0.0)
    t.step(0.01)
    t.complete_prefill({"R": 5})
    t.submit([Request("C", list(range(1000, 1200)), max_new_tokens=4)], now=1.0)
    t.step(0.01)
    t.complete_prefill({})
    for _ in range(100):
        t.decode({"R": 7})
    t.step(1.0)  # the in-flight chunk (R-ADM-5), admitted whatever the budget
    before = (t.available, t.evictable, [r.kv_len for r in t.prefilling])
    with pytest.raises(MemoryError, match="prepare_prefill / complete_prefill: the prefill needs"):
        t.prepare_prefill()
    assert (t.available, t.evictable, [r.kv_len for r in t.prefilling]) == before
    t.abort(["R"])
    assert set(t.prepare_prefill()) == {"C"}
    t.complete_prefill({})


@pytest.mark.parametrize("cls", [ReferenceScheduler, GpuScheduler])
def test_prepare_decode_then_finish_abort_or_retract(cls):
    """A prepared decode slot whose forward never ran: finish() frees it and caches only the
    computed tokens, abort() and retract_decode() free it with the rest; requests joining
    the batch after prepare_decode get theirs in decode(). The pool comes back whole."""
    s = cls(SchedulerConfig(page_size=1), 64)
    s.submit([Request("a", [1, 2, 3], 8), Request("b", [4, 5, 6], 8), Request("c", [7, 8, 9], 8)], now=0.0)
    s.step(0.7)
    s.complete_prefill({"a": 10, "b": 11, "c": 12})
    free = s.available
    slots = s.prepare_decode()
    assert sorted(slots) == ["a", "b", "c"] and s.available == free - 3
    assert s.prepare_decode() == slots and s.decode_tokens_needed() == 0 and s.decode_fits()
    s.finish(["a"])  # its prompt (3 tokens) cached, the prepared slot and the unaligned rest freed
    s.abort(["b"])
    s.check_integrity()
    s.submit([Request("d", [1, 2, 3, 4], 8)], now=1.0)
    s.step(0.7)
    s.complete_prefill({"d": 13})
    assert s.decode_tokens_needed() == 1  # d has no slot yet; c has its own
    s.decode({"c": 20, "d": 21})
    assert int(s.reqs["c"].kv[s.reqs["c"].kv_len - 1]) == slots["c"]
    s.prepare_decode()
    assert s.retract_decode() == [] and s.decode_fits()
    s.finish(["c", "d"])
    s.check_integrity()
    cached = s.evictable
    assert cached > 0 and s.flush_cache() == cached  # the finished prompts' cached tokens
    assert s.evictable == 0 and s.available == 64 and s.flush_cache() == 0


@pytest.mark.parametrize("cls", [ReferenceScheduler, GpuScheduler])
def test_calls_between_prepare_and_commit_see_the_slots_taken(cls):
    """A step placed between prepare_decode and decode (an overlap engine scheduling the next
    prefill while the decode runs) budgets with the prepared slot taken, as SGLang's
    scheduler once its decode batch is prepared: here b no longer fits. Both schedulers
    alike; without the prepare, b is admitted."""
    def run(prep):
        s = cls(SchedulerConfig(schedule_policy="fcfs", page_size=1), 60)
        s.submit([Request("a", list(range(3, 18)), 4)], now=0.0)
        s.step(1.0)
        s.complete_prefill({"a": 7})
        s.submit([Request("b", list(range(100, 136)), 4)], now=1.0)
        assert s.decode_fits()
        if prep:
            s.prepare_decode()
        plan = s.step(1.0)
        return [x[0] for x in plan.admitted], plan.stop, plan.available

    assert run(False) == (["b"], "queue_end", 45)
    assert run(True) == ([], "add_no_token", 44)
