"""gpu_sched.admission against the reference adder loop (SPEC R-ADM-*, R-STEP-3, D1, D5, D7).

Random scenarios are built on a `ReferenceScheduler` (seeded cache, running batch, in-flight
chunked request, queue); the static inputs of `admit_step` are read off a copy of it, and the
reference loop (`PrefillAdder` + `_admit_one`) runs on the original. Budgets are tight so every
stop reason occurs (the test checks that they all did). Also: lock-aware drops against a brute
force with partial covers, the ignore-EOS grid against `ignore_eos_fits`, preemption against
`preempt_for`, and the no-host-sync proof (meta tensors; torch.compile fullgraph).
"""

import copy
import itertools
import random

import pytest
import torch

from gpu_sched import policy as P
from gpu_sched.config import SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.reference.adder import AddResult, PrefillAdder
from gpu_sched.request import Request
from gpu_sched.admission import (STOP_NAMES, ChunkedCols, HeldCols, QueueCols, StepConfig, StepResult,
                                 StepState, admit_step, admit_step_host, eos_states, ignore_eos_fail, lock_drops,
                                 preempt_select, read_step_result)

i64 = torch.int64


def t0(x, dtype=i64):
    return torch.tensor(x, dtype=dtype)


def col(xs, pad, dtype=i64, fillv=0):
    return torch.tensor(list(xs) + [fillv] * pad, dtype=dtype)


# ---- scenario building -----------------------------------------------------------------------
def random_config(rng):
    chunk = rng.choice([None, None, 16, 40, 64, 256])
    return SchedulerConfig(
        page_size=rng.choice([1, 4, 16]),
        max_prefill_tokens=rng.choice([24, 64, 256, 4096]),
        chunked_prefill_size=chunk,
        max_running_requests=rng.choice([None, 3, 6, 12]),
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=rng.random() < 0.5,
        enable_priority_preemption=rng.random() < 0.2,
        disable_radix_cache=rng.random() < 0.25,
        enable_mixed_chunk=rng.random() < 0.3,
        prefill_max_requests=rng.choice([None, None, 2, 5]),
        truncation_align_size=rng.choice([None, None, 3, 8, 7]),
    )


def make_req(rng, rid, bases, vocab, *, out_max=6):
    base = bases[rng.randrange(len(bases))]
    prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    mx = rng.choice([1, 3, 8, 40, 300, 5000])
    out = [rng.randrange(vocab) for _ in range(rng.randrange(0, out_max))] if rng.random() < 0.3 else []
    return Request(rid=rid, prompt_ids=prompt, max_new_tokens=max(mx, len(out)), output_ids=out,
                   ignore_eos=rng.random() < 0.4, priority=rng.choice([None, 0, 1, 5, 20, -3]),
                   return_logprob=rng.random() < 0.1, logprob_start_len=rng.choice([-1, 3, 10]))


def build(seed, **over):
    rng = random.Random(seed)
    cfg = random_config(rng)
    if over:
        cfg = cfg.replace(**over)
    kv = rng.choice([150, 400, 1000, 4000])
    ref = ReferenceScheduler(cfg, kv)
    vocab = rng.choice([2, 4, 30])
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 80))] for _ in range(3)]
    for b in bases:
        if rng.random() < 0.7 and ref.pool.available > len(b) + 50:
            ref.seed_cache(b[: rng.randrange(len(b) + 1)])
    for i in range(rng.choice([0, 0, 1, 3, 8])):
        r = make_req(rng, f"run{i}", bases, vocab)
        if r.fill_len + 30 < ref.pool.available:
            r.output_ids = r.output_ids or [1]
            r.max_new_tokens = max(r.max_new_tokens, len(r.output_ids))
            ref.seed_running(r)
    if cfg.chunked_prefill_size is not None and rng.random() < 0.4:
        r = make_req(rng, "chunked", bases, vocab)
        done = rng.randrange(r.fill_len)
        if done + 30 < ref.pool.available:
            ref.seed_chunked(r, done)
    ref.submit([make_req(rng, f"q{i}", bases, vocab) for i in range(rng.choice([0, 1, 3, 10, 30]))], now=1.0)
    ratio = rng.choice([1.0, 0.7, rng.uniform(0.05, 1.0)])
    full0 = bool(ref.running) and not cfg.enable_priority_preemption and rng.random() < 0.1
    return rng, cfg, ref, ratio, full0


def flatten_tree(cache):
    """(parent, key_len, lock_ref, alive, index of each TreeNode) of the reference cache."""
    nodes = list(cache._nodes())
    nodes.remove(cache.root)
    nodes = [cache.root] + nodes
    ix = {id(n): i for i, n in enumerate(nodes)}
    parent = [ix[id(n.parent)] if n.parent is not None else -1 for n in nodes]
    return (t0(parent), t0([len(n.key) for n in nodes]), t0([n.lock_ref for n in nodes]),
            torch.ones(len(nodes), dtype=torch.bool), ix)


def static_inputs(cfg, ref, ratio, full0, pad):
    """Inputs of `admit_step` read off a copy of the reference scheduler before its loop."""
    probe = copy.deepcopy(ref)
    queue = probe.queue
    for r in queue:
        probe._rematch(r)
    if cfg.disable_radix_cache:
        drop = t0([0] * len(queue))
    else:
        parent, key_len, lock_ref, alive, ix = flatten_tree(probe.cache)
        last = t0([ix[id(r.last_node)] for r in queue])
        cover = key_len[last] if len(queue) else t0([])
        drop = lock_drops(parent, key_len, lock_ref, alive, last, cover, t0([r.prefix_len > 0 for r in queue], torch.bool))
    chunking = cfg.chunked_prefill_size is not None
    mixed = len(ref.running) if cfg.enable_mixed_chunk and chunking else 0
    n_res = sum(min(r.max_new - r.out_len, cfg.clip_max_new_tokens) for r in ref.running)
    q = QueueCols(
        n=t0(len(queue)), fill_len=col([r.fill_len for r in queue], pad), out_len=col([r.out_len for r in queue], pad),
        prompt_len=col([r.prompt_len for r in queue], pad), max_new=col([r.max_new for r in queue], pad),
        prefix_len=col([r.prefix_len for r in queue], pad), drop=torch.cat([drop, t0([0] * pad)]),
        ignore_eos=col([r.req.ignore_eos for r in queue], pad, torch.bool, False))
    st = StepState(
        available=t0(ref.pool.available), evictable=t0(ref.cache.evictable_size), I=t0(mixed), cur_off=t0(mixed),
        rem_input=t0(cfg.max_prefill_tokens - mixed),
        rem_chunk=t0((cfg.chunked_prefill_size or 0) - mixed), ratio=t0(ratio, torch.float64), N=t0(n_res),
        can_run=t0(0), running_bs=t0(len(ref.running)), batch_full=t0(full0, torch.bool))
    run = ref.running
    held = HeldCols(valid=col([True] * len(run), 2, torch.bool, False), max_new=col([r.max_new for r in run], 2),
                    out_len=col([r.out_len for r in run], 2), prompt_len=col([r.prompt_len for r in run], 2),
                    ignore_eos=col([r.req.ignore_eos for r in run], 2, torch.bool, False))
    chunked = None
    if chunking:
        c = ref.chunked
        chunked = ChunkedCols(present=t0(c is not None, torch.bool), fill_len=t0(c.fill_len if c else 0),
                              prefix_len=t0(c.prefix_len if c else 0), max_new=t0(c.max_new if c else 0),
                              out_len=t0(c.out_len if c else 0), prompt_len=t0(c.prompt_len if c else 0),
                              ignore_eos=t0(bool(c and c.req.ignore_eos), torch.bool))
    return StepConfig.from_config(cfg), st, q, held, chunked, [r.rid for r in queue]


def reference_loop(cfg, ref, ratio, full0):
    """R-ADM-5 + R-STEP-3 on the reference scheduler; stops where preemption would be tried."""
    chunking = cfg.chunked_prefill_size is not None
    mixed = len(ref.running) if cfg.enable_mixed_chunk and chunking else 0
    ref.batch_is_full = full0
    adder = PrefillAdder(cfg, ref.cache, ref.pool, ref.running, ratio, mixed)
    left = None
    if ref.chunked is not None:
        left = adder.add_chunked_req(ref.chunked)
    running_bs = len(ref.running)
    stop, at = "queue_end", len(ref.queue)
    cap = cfg.max_running_requests
    for i, r in enumerate(ref.queue):
        if cfg.enable_priority_preemption and adder.budget_state() is not AddResult.OTHER:
            if cap is not None and running_bs + len(adder.can_run) >= cap:
                ref.batch_is_full = True
            if ref.batch_is_full:
                stop, at = "needs_preempt", i
                break
        s = ref._admit_one(r, adder, running_bs)
        if s is not None:
            stop, at = s, i
            break
    return adder, left, stop, at


def compare(seed, pad=None, **over):
    rng, cfg, ref, ratio, full0 = build(seed, **over)
    pad = rng.choice([0, 1, 5]) if pad is None else pad
    scfg, st, q, held, chunked, rids = static_inputs(cfg, ref, ratio, full0, pad)
    res = admit_step(scfg, st, q, held, chunked)
    adder, left, stop, at = reference_loop(cfg, ref, ratio, full0)
    msg = f"seed {seed} ({cfg})"
    assert bool(res.decided), msg
    got_stop = STOP_NAMES[int(res.stop)]
    assert got_stop == stop, f"{msg}: stop {got_stop} != {stop}"
    assert int(res.stop_index) == at, msg
    can = adder.can_run
    if ref.chunked is not None:
        assert can[0] is ref.chunked
        assert int(res.inflight_end) == ref.chunked.extend_end, msg
        assert bool(res.inflight_left) == left, msg
        can = can[1:]
    idx = {rid: i for i, rid in enumerate(rids)}
    want = [(idx[r.rid], r.extend_start, r.extend_end) for r in can]
    adm = res.admitted.tolist()
    got = [(i, int(res.extend_start[i]), int(res.extend_end[i])) for i in range(len(adm)) if adm[i]]
    if got != want:
        first = next(k for k in range(min(len(got), len(want)) + 1) if k >= len(got) or k >= len(want) or got[k] != want[k])
        raise AssertionError(f"{msg}: admitted differ at admission {first}: got {got[first:first + 2]}, want {want[first:first + 2]}")
    nc = adder.new_chunked
    assert int(res.chunk_index) == (idx[nc.rid] if nc is not None else -1), msg
    if nc is not None:
        assert int(res.chunk_len) == nc.extend_end - nc.extend_start
    assert bool(res.batch_full) == ref.batch_is_full, msg
    b = adder.budgets()
    assert float(res.rem_total) == b["rem_total"], msg
    assert int(res.cur_rem) == b["cur_rem"], msg
    assert int(res.rem_input) == b["rem_input"], msg
    if b["rem_chunk"] is not None:
        assert int(res.rem_chunk) == b["rem_chunk"], msg
    assert (int(res.I), int(res.cur_off)) == (adder.I, adder.cur_off), msg
    assert int(res.evictable) == ref.cache.evictable_size, msg
    assert int(res.hit_tokens) == adder.log_hit_tokens, msg
    assert int(res.input_tokens) == adder.log_input_tokens, msg
    return stop, nc is not None, sum(r.extend_end < r.fill_len for r in can)


def test_admit_step_matches_reference_loop():
    stops, chunks = {}, 0
    for seed in range(700):
        s, c, _ = compare(seed)
        stops[s] = stops.get(s, 0) + 1
        chunks += c
    assert set(stops) == set(STOP_NAMES.values()), stops  # every stop reason occurred
    assert chunks > 20


ROOM_FOR_A_SECOND_CHUNK = dict(page_size=4, truncation_align_size=7, max_prefill_tokens=4096,
                               prefill_max_requests=None, enable_priority_preemption=False)


def test_admit_step_one_chunk_a_step():
    """A truncation_align_size that is not a multiple of P can leave room for a second chunk
    after the first (the case that needs a third round). SPEC.md's R-ADM-3.7 would chunk it
    too and make it the new chunked request, leaving the first one cut short and not the
    chunked request (complete_prefill could not finish it); every form refuses it instead
    (OTHER, nothing committed), as the reference adder does. The refusals must occur here."""
    refused = 0
    for seed in range(300):
        over = dict(ROOM_FOR_A_SECOND_CHUNK, chunked_prefill_size=20 + seed % 13)
        _, chunk, k = compare(seed, **over)
        assert k <= 1, seed  # one admission short of its fill at most: the chunked request
        if not chunk:
            continue
        # the stopping request of the same scenario, re-matched by the loop: would R-ADM-3.7
        # (without the one-chunk rule) have chunked it?
        rng, cfg, ref, ratio, full0 = build(seed, **over)
        adder, _, stop, at = reference_loop(cfg, ref, ratio, full0)
        if stop != "add_other" or at >= len(ref.queue) or ref.queue[at].req.ignore_eos and cfg.disable_radix_cache:
            continue
        r, P, a = ref.queue[at], cfg.page_size, cfg.truncation_align_size
        if any(x is r for x in adder.can_run):  # admitted, then the budget stopped the loop
            continue
        rc = adder.rem_chunk
        if -(-(r.fill_len - r.prefix_len) // P) * P <= rc or rc // P * P < a:
            continue
        t = (r.prefix_len + rc // P * P // a * a) // P * P - r.prefix_len
        refused += t > 0
    assert refused > 0



def mixed_past_chunk_size_state():
    """An in-flight chunked request with more running requests than chunked_prefill_size and
    enable_mixed_chunk: rem_chunk = 2 - 3 < 0 (R-ADM-5 read literally: a negative extend)."""
    cfg = SchedulerConfig(chunked_prefill_size=2, enable_mixed_chunk=True)
    ref = ReferenceScheduler(cfg, 1000)
    for i in range(3):
        ref.seed_running(Request(f"run{i}", [5, i], 10, output_ids=[1]))
    ref.seed_chunked(Request("chunked", [7] * 20, 10), 4)
    ref.submit([Request("q0", [1, 2, 3], 4)], now=1.0)
    return cfg, ref


def test_in_flight_chunk_gets_no_tokens_when_mixed_tokens_pass_the_chunk_size():
    """The reference adder, `admit_step` and `admit_step_host` give the in-flight chunk an
    empty extend range (as at rem_chunk 0), not a negative one, and stop there (OTHER)."""
    cfg, ref = mixed_past_chunk_size_state()
    scfg, st, q, held, chunked, _ = static_inputs(cfg, ref, 0.7, False, 1)
    want = admit_step(scfg, st, q, held, chunked)
    adder, left, stop, at = reference_loop(cfg, ref, 0.7, False)
    assert (ref.chunked.extend_start, ref.chunked.extend_end, left) == (4, 4, True)
    assert (int(want.inflight_end), bool(want.inflight_left)) == (4, True)
    assert (STOP_NAMES[int(want.stop)], stop, int(want.stop_index), at) == ("budget_other", "budget_other", 0, 0)
    assert (int(want.I), int(want.cur_off), int(want.rem_chunk)) == (adder.I, adder.cur_off, adder.rem_chunk)
    check_host_result(admit_step_host(scfg, st, q, held, chunked), want, "mixed past the chunk size")


def host_equals_tensor_form(seed, **over):
    """`admit_step_host` (rounds' state on the host) == `admit_step` field by field, on the same
    inputs; returns the number of chunked admissions (so callers can check chunks occurred)."""
    rng, cfg, ref, ratio, full0 = build(seed, **over)
    pad = rng.choice([0, 1, 5])
    scfg, st, q, held, chunked, _ = static_inputs(cfg, ref, ratio, full0, pad)
    want = admit_step(scfg, st, q, held, chunked)
    # on the CPU its checks run as numpy calls; every third seed also through its torch form
    for host in (True, False) if seed % 3 == 0 else (True,):
        got = _with_host_paths(host, admit_step_host, scfg, st, q, held, chunked)
        check_host_result(got, want, f"seed {seed} host {host} ({cfg})")
    if not scfg.ignore_eos_path:  # the queue's columns as numpy arrays, as the scheduler passes them
        qn = QueueCols(q.n, *(v.numpy() for v in q[1:]))
        check_host_result(admit_step_host(scfg, st, qn, held, chunked), want, f"seed {seed} numpy columns ({cfg})")
    return int(want.chunk_index) >= 0


def check_host_result(got, want, msg):
    """A `HostStepResult` equals the static form's `StepResult` field by field."""
    assert got.decided == bool(want.decided), msg
    adm = want.admitted.tolist()
    na = sum(adm)
    assert adm == [True] * na + [False] * (len(adm) - na), msg  # the tensor form admits a prefix
    assert got.admitted == na, f"{msg}: admitted {got.admitted} != {na}"
    assert got.extend_end == want.extend_end[:na].tolist(), msg
    for f in ("stop_index", "stop", "chunk_index", "chunk_len", "inflight_end", "I", "cur_off", "rem_input",
              "rem_chunk", "evictable", "hit_tokens", "input_tokens"):
        assert getattr(got, f) == int(getattr(want, f)), f"{msg}: {f} {getattr(got, f)} != {int(getattr(want, f))}"
    assert got.batch_full == bool(want.batch_full), msg
    assert got.inflight_left == bool(want.inflight_left), msg
    # the triton eager path's one read-back of the tensor form gives the same record
    read = read_step_result(want)
    assert read == got, f"{msg}: " + ", ".join(f"{f} {a!r} != {b!r}" for f, a, b in zip(got._fields, read, got) if a != b)


def test_admit_step_host_equals_tensor_form():
    """The eager form against the static one over the random scenarios of the reference test
    (every stop reason, chunks, ignore-EOS, the in-flight chunk) and the multi-chunk configs."""
    chunks = sum(host_equals_tensor_form(seed) for seed in range(500))
    assert chunks > 20
    for seed in range(150):
        host_equals_tensor_form(seed, page_size=4, truncation_align_size=7, chunked_prefill_size=20 + seed % 13,
                                max_prefill_tokens=4096, prefill_max_requests=None, enable_priority_preemption=False)


def test_admit_step_host_first_admission_spends_budget():
    """One request admitted whole that leaves no token budget, nothing running or admitted
    before: the batch is marked full (the admission itself counts); both forms agree."""
    scfg = StepConfig(page_size=1, clip=4096)
    st = StepState(available=t0(100), evictable=t0(0), I=t0(0), cur_off=t0(0), rem_input=t0(1000),
                   rem_chunk=t0(0), ratio=t0(1.0, torch.float64), N=t0(0), can_run=t0(0), running_bs=t0(0),
                   batch_full=t0(False, torch.bool))
    q = QueueCols(n=t0(2), fill_len=t0([50, 5]), out_len=t0([10, 0]), prompt_len=t0([40, 5]), max_new=t0([50, 5]),
                  prefix_len=t0([0, 0]), drop=t0([0, 0]), ignore_eos=t0([False, False], torch.bool))
    want = admit_step(scfg, st, q)
    got = admit_step_host(scfg, st, q)
    assert (got.admitted, STOP_NAMES[got.stop], got.stop_index) == (1, "add_no_token", 0)
    assert got.batch_full is True and bool(want.batch_full)
    assert (got.I, got.cur_off) == (int(want.I), int(want.cur_off))

# ---- lock-aware drops ------------------------------------------------------------------------
def brute_drops(parent, key_len, lock_ref, last, cover, valid):
    locked = {}
    out = []
    for ln, c, v in zip(last, cover, valid):
        g = 0
        if v:
            node, cov = ln, c
            while node > 0:
                if lock_ref[node] == 0:
                    g += max(0, cov - locked.get(node, 0))
                    locked[node] = max(locked.get(node, 0), cov)
                node, cov = parent[node], None
                if node > 0:
                    cov = key_len[node]
        out.append(g)
    return out


def _with_host_paths(on: bool, fn, *args, **kwargs):
    """fn with the host (numpy) forms on CPU tensors, or (`on` False) its torch forms."""
    if on:
        return fn(*args, **kwargs)
    with P.torch_forms():
        return fn(*args, **kwargs)


def random_lock_case(seed: int):
    """A random tree (deep chains for odd seeds) with locks, and requests' matched paths:
    (rng, parent, key_len, lock_ref, last, cover, valid) as lists."""
    rng = random.Random(seed)
    N = rng.choice([1, 2, 5, 30, 100])
    parent = [-1] + [rng.randrange(max(0, i - 3), i) if seed % 2 else rng.randrange(i) for i in range(1, N)]
    key_len = [0] + [rng.randrange(1, 9) for _ in range(1, N)]
    lock_ref = [1] + [rng.choice([0, 0, 0, 1, 2]) for _ in range(1, N)]
    Q = rng.choice([0, 1, 7, 60])
    valid = [rng.random() < 0.85 and N > 1 for _ in range(Q)]
    last = [rng.randrange(1, N) if v else 0 for v in valid]
    cover = [rng.randint(1, key_len[ln]) if v else 0 for ln, v in zip(last, valid)]
    return rng, parent, key_len, lock_ref, last, cover, valid


@pytest.mark.parametrize("walk", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_lock_drops_partial_covers(seed, walk, monkeypatch):
    # the host form for few requests walks their paths (`_lock_drops_walk`), for more runs
    # the rounds over every node (`_lock_drops_host`): both, at every queue size here
    import gpu_sched.admission as A

    monkeypatch.setattr(A, "LOCK_WALK_MAX", 1 << 30 if walk else -1)
    rng, parent, key_len, lock_ref, last, cover, valid = random_lock_case(seed)
    N, Q = len(parent), len(last)
    depth = [0] * N
    for v in range(1, N):
        depth[v] = depth[parent[v]] + 1
    whole = [key_len[v] for v in last]  # the same paths, every match ending at its node's end
    for cov in (cover, whole):
        want = brute_drops(parent, key_len, lock_ref, last, cov, valid)
        for bound, early, host in itertools.product((None, max([depth[v] for v in last], default=0)),
                                                    (False, True), (True, False)):
            # the tight depth bound too; eager callers: doubling to its fixed point, no partial
            # part; on the CPU the numpy form (`_lock_drops_host`) and the torch form
            got = _with_host_paths(host, lock_drops, t0(parent), t0(key_len), t0(lock_ref),
                                   torch.ones(N, dtype=torch.bool), t0(last), t0(cov), t0(valid, torch.bool),
                                   max_depth=bound, early_exit=early).tolist()
            bad = [i for i in range(Q) if got[i] != want[i]]
            assert not bad, (f"max_depth {bound} early_exit {early} host {host}: first differing request "
                             f"{bad[0]}: {got[bad[0]]} != {want[bad[0]]}")
        # dead nodes: a path's first request stops after one, in every form
        alive = torch.tensor([i == 0 or rng.random() < 0.8 for i in range(N)], dtype=torch.bool)
        args = (t0(parent), t0(key_len), t0(lock_ref), alive, t0(last), t0(cov), t0(valid, torch.bool))
        want = _with_host_paths(False, lock_drops, *args)
        for early, host in itertools.product((False, True), (True, False)):
            assert torch.equal(_with_host_paths(host, lock_drops, *args, early_exit=early), want), (seed, early, host)


# ---- R-ADM-6 grid ----------------------------------------------------------------------------
def test_ignore_eos_grid_matches_scan():
    rng = random.Random(5)
    for trial in range(150):
        cfg = SchedulerConfig(disable_radix_cache=True, page_size=rng.choice([1, 4]))
        ref = ReferenceScheduler(cfg, 100000)
        ratio = rng.choice([1.0, 0.3, rng.random()])
        run = [Request(rid=f"r{i}", prompt_ids=[1] * rng.randrange(1, 50), max_new_tokens=rng.randrange(1, 60),
                       output_ids=[1] * rng.randrange(0, 20), ignore_eos=rng.random() < 0.5) for i in range(rng.randrange(0, 6))]
        for r in run:
            r.max_new_tokens = max(r.max_new_tokens, len(r.output_ids))
            ref.seed_running(r)
        reqs = [Request(rid=f"q{i}", prompt_ids=[1] * rng.randrange(1, 50), max_new_tokens=rng.randrange(0, 60),
                        output_ids=[1] * rng.randrange(0, 4), ignore_eos=rng.random() < 0.5) for i in range(rng.randrange(0, 8))]
        ref.submit(reqs)
        adder = PrefillAdder(cfg, ref.cache, ref.pool, ref.running, ratio, 0)
        q = ref.queue
        c = [rng.randrange(-50, 600) for _ in q]
        # ignore_eos_fits(r, ext=0) scans with c = cur_rem: drive cur_rem through cur_off
        want = []
        for j, r in enumerate(q):
            adder.can_run = list(q[:j])
            adder.cur_off = ref.pool.available + ref.cache.evictable_size - c[j]
            want.append(not adder.ignore_eos_fits(r, 0))
        ratio_t = t0(ratio, torch.float64)
        ql, qo = eos_states(t0([r.max_new for r in q]), t0([r.out_len for r in q]), t0([r.prompt_len for r in q]),
                            t0([r.req.ignore_eos for r in q], torch.bool), ratio_t)
        hl, ho = eos_states(t0([r.max_new for r in ref.running]), t0([r.out_len for r in ref.running]),
                            t0([r.prompt_len for r in ref.running]), t0([r.req.ignore_eos for r in ref.running], torch.bool), ratio_t)
        got = ignore_eos_fail(t0(c), ql, qo, torch.ones(len(q), dtype=torch.bool), hl, ho,
                              torch.ones(len(ref.running), dtype=torch.bool), rows=3).tolist()
        assert got == want, f"trial {trial}"


# ---- R-ADM-7 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("low_first", [False, True])
def test_preempt_select_matches_preempt_for(low_first):
    rng = random.Random(11 + low_first)
    for trial in range(200):
        cfg = SchedulerConfig(enable_priority_scheduling=True, enable_priority_preemption=True,
                              schedule_low_priority_values_first=low_first,
                              priority_scheduling_preemption_threshold=rng.choice([0, 1, 10, -2]))
        ref = ReferenceScheduler(cfg, 100000)
        prios = [None, 0, 1, 5, 20, -3, 2**62]
        for i in range(rng.randrange(0, 9)):
            r = Request(rid=f"r{i}", prompt_ids=[1] * rng.randrange(1, 20), max_new_tokens=rng.randrange(1, 400),
                        output_ids=[1], priority=rng.choice(prios), enqueue_time=float(rng.choice([0, 1, 2, 3])))
            ref.seed_running(r)
        new = Request(rid="new", prompt_ids=[1] * rng.randrange(1, 300), max_new_tokens=rng.randrange(1, 300),
                      priority=rng.choice(prios))
        ref.submit([new])
        r = ref.queue[0]
        ratio = rng.choice([1.0, 0.5, rng.random()])
        adder = PrefillAdder(cfg, ref.cache, ref.pool, ref.running, ratio, 0)
        adder.I = rng.randrange(0, 100000)
        base = r.fill_len - r.prefix_len + min(r.max_new, cfg.clip_max_new_tokens) - (
            ref.pool.available + ref.cache.evictable_size - adder.I)
        run = list(ref.running)
        N = adder.N
        got = preempt_select(torch.ones(len(run), dtype=torch.bool), t0([v.priority for v in run]),
                             t0([v.enqueue_time for v in run], torch.float64),
                             t0([min(v.max_new - v.out_len, cfg.clip_max_new_tokens) for v in run]),
                             t0(r.priority), t0(base), t0(ratio, torch.float64), t0(N),
                             cfg.priority_sign, cfg.priority_scheduling_preemption_threshold)
        ok = adder.preempt_for(r, lambda v, rem: 0)
        want = [any(v is p for p in adder.preempted) for v in run]
        assert bool(got.success) == ok, f"trial {trial}"
        assert got.victims.tolist() == want, f"trial {trial}"
        if ok:
            assert int(got.V) == N - adder.N


# ---- no host sync, no data-dependent shapes ------------------------------------------------------
def _inputs(device, Q=8, R=3, eos=True):
    def z(n=Q, dtype=i64):
        return torch.zeros(n, dtype=dtype, device=device)
    s = lambda v, dt=i64: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    q = QueueCols(n=s(5), fill_len=z() + 9, out_len=z(), prompt_len=z() + 9, max_new=z() + 4, prefix_len=z(),
                  drop=z(), ignore_eos=z(dtype=torch.bool))
    st = StepState(available=s(100), evictable=s(10), I=s(0), cur_off=s(0), rem_input=s(64), rem_chunk=s(32),
                   ratio=s(0.7, torch.float64), N=s(3), can_run=s(0), running_bs=s(1), batch_full=s(False, torch.bool))
    held = HeldCols(valid=z(R, torch.bool), max_new=z(R), out_len=z(R), prompt_len=z(R), ignore_eos=z(R, torch.bool))
    ch = ChunkedCols(present=s(True, torch.bool), fill_len=s(40), prefix_len=s(8), max_new=s(5), out_len=s(0),
                     prompt_len=s(40), ignore_eos=s(False, torch.bool))
    cfg = StepConfig(page_size=4, chunking=True, align=3, max_running=6, prefill_max=4, ignore_eos_path=eos)
    return cfg, st, q, held, ch


def test_admit_step_runs_on_meta_tensors():
    """Meta tensors have no data: any `.item()`, `.tolist()`, `nonzero`, boolean-mask indexing or
    data-dependent shape inside the step raises. The outputs' shapes are static."""
    for eos in (False, True):
        cfg, st, q, held, ch = _inputs("meta", eos=eos)
        res = admit_step(cfg, st, q, held, ch)
        assert res.admitted.shape == (8,) and res.extend_end.shape == (8,) and res.stop.shape == ()
    N, Q = 6, 8
    z = lambda n, dt=i64: torch.zeros(n, dtype=dt, device="meta")  # noqa: E731
    assert lock_drops(z(N), z(N), z(N), z(N, torch.bool), z(Q), z(Q), z(Q, torch.bool)).shape == (Q,)
    pr = preempt_select(z(5, torch.bool), z(5), z(5, torch.float64), z(5), z(()), z(()),
                        z((), torch.float64), z(()), 1, 10)
    assert pr.victims.shape == (5,)


def test_admit_step_compiles_fullgraph():
    """torch.compile(fullgraph=True) fails on any graph break (a host read included) and the
    compiled step equals eager."""
    torch._dynamo.reset()
    cfg, st, q, held, ch = _inputs("cpu")
    fn = torch.compile(lambda a, b, c, d: admit_step(cfg, a, b, c, d), fullgraph=True, backend="eager")
    got, want = fn(st, q, held, ch), admit_step(cfg, st, q, held, ch)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)  # `packed`: None on the torch backend


# ---- CUDA graph capture of the step (fixed capacities) ----------------------------------------------
Q_CAP, R_CAP = 40, 12
GRAPH_CONFIGS = {
    "cache": dict(page_size=4, chunked_prefill_size=64, max_running_requests=6, prefill_max_requests=5,
                  truncation_align_size=None, disable_radix_cache=False, enable_priority_preemption=False,
                  enable_mixed_chunk=False, max_prefill_tokens=256),
    "no-cache": dict(page_size=1, chunked_prefill_size=40, max_running_requests=None, prefill_max_requests=None,
                     truncation_align_size=8, disable_radix_cache=True, enable_priority_preemption=False,
                     enable_mixed_chunk=True, max_prefill_tokens=64),
}
GROUPS = (StepState, QueueCols, HeldCols, ChunkedCols)


def fixed_inputs(seed, over, device):
    """One random scenario's inputs padded to the fixed capacities Q_CAP / R_CAP (None if it does
    not fit), on `device`, flattened."""
    rng, cfg, ref, ratio, full0 = build(seed, **over)
    n = len(ref.queue)
    if n > Q_CAP or len(ref.running) + 2 > R_CAP:
        return None
    scfg, st, q, held, ch, _ = static_inputs(cfg, ref, ratio, full0, Q_CAP - n)
    held = HeldCols(*[torch.cat([x, x.new_zeros(R_CAP - x.numel())]) for x in held])
    return scfg, [t.to(device) for g in (st, q, held, ch) for t in g]


def unflatten(flat):
    out, i = [], 0
    for g in GROUPS:
        k = len(g._fields)
        out.append(g(*flat[i : i + k]))
        i += k
    return out


@pytest.mark.parametrize("name", sorted(GRAPH_CONFIGS))
def test_admit_step_graph_replay_equals_eager(name):
    """On CUDA: admit_step captured once in a CUDA graph over static input buffers, then 50
    random scenarios copied in and replayed, each equal to eager (100 steps over both configs).
    On CPU the same buffer protocol runs eagerly (checks the harness and fixed capacities)."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    over = GRAPH_CONFIGS[name]
    scfg, first = fixed_inputs(0, over, dev)
    static = [t.clone() for t in first]

    def call():
        return admit_step(scfg, *unflatten(static))

    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
    steps = 0
    for seed in range(1, 200):
        got_inputs = fixed_inputs(seed, over, dev)
        if got_inputs is None:
            continue
        cfg_s, flat = got_inputs
        assert cfg_s == scfg
        for dst, src in zip(static, flat):
            dst.copy_(src)
        if cuda:
            graph.replay()
        else:
            out = call()
        want = admit_step(scfg, *unflatten(flat))
        for field, g, w in zip(StepResult._fields, out, want):
            assert (g is None and w is None) or torch.equal(g, w), f"{name} seed {seed}: {field} {g} != {w}"
        steps += 1
        if steps == 50:
            break
    assert steps == 50
