"""Kernel tests of `gpu_sched.kernels.admission`, `.ignore_eos` and `.preempt` against the torch
versions in `gpu_sched.admission` (exact equality), at sizes 0, 1, BLOCK-1, BLOCK, BLOCK+1 and a
larger one; a failure names the first differing request. Without CUDA the kernels run in
Triton's interpreter: `TRITON_INTERPRET=1` is set below, before anything imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from gpu_sched import admission as S  # noqa: E402
from gpu_sched.kernels import admission as KA  # noqa: E402
from gpu_sched.kernels import ignore_eos as KE  # noqa: E402
from gpu_sched.kernels import preempt as KP  # noqa: E402
from gpu_sched.kernels import radix as KR  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
i64 = torch.int64
SIZES = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (300, None)]
SIZE_IDS = [f"n{n}-b{b or 'default'}" for n, b in SIZES]


def first_diff(name, got, want):
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got != want).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        return f"{name}: first differing request {i}: kernel {got[i].item()} != torch {want[i].item()}"
    return None


def t(xs, dtype=i64):
    return torch.tensor(xs, dtype=dtype, device=DEV)


# ---- per-request checks ----------------------------------------------------------------------------
def random_eval_inputs(rng, n, cfg):
    P = cfg.page_size
    fill = [rng.randrange(1, 120) for _ in range(n)]
    pre = [rng.randrange(0, f) // P * P for f in fill]
    out = [rng.randrange(0, 5) for _ in range(n)]
    maxn = [rng.choice([0, 1, 7, 300, 5000]) for _ in range(n)]
    drop = [rng.randrange(0, 20) for _ in range(n)]

    def excl(xs):
        acc, o = 0, []
        for x in xs:
            o.append(acc)
            acc += x
        return o

    e = [-(-(f - p) // P) * P for f, p in zip(fill, pre)]
    exI = excl([x + min(m, cfg.clip) + P for x, m in zip(e, maxn)])
    exC = excl([x + P for x in e])
    exE = excl(e)
    exD = excl(drop)
    scale = rng.choice([50, 500, 5000, 50000])
    sc = [rng.randrange(0, scale), rng.randrange(0, scale), rng.randrange(-10, scale // 4),
          rng.randrange(-10, scale // 4), rng.randrange(-50, scale // 2), rng.randrange(-50, scale // 2),
          rng.randrange(0, 3), rng.randrange(0, 8), int(rng.random() < 0.05)]
    cols = [t(x) for x in (fill, pre, out, maxn, drop)]
    ie = t([rng.random() < 0.4 for _ in range(n)], torch.bool)
    fail = t([rng.random() < 0.2 for _ in range(n)], torch.bool)
    return (t(sc), t(rng.uniform(0, scale / 2), torch.float64), *cols, ie, fail,
            t(exI), t(exC), t(exE), t(exD))


CFGS = [
    S.StepConfig(page_size=1),
    S.StepConfig(page_size=4, chunking=True, align=7, max_running=5, prefill_max=9, ignore_eos_path=True),
    S.StepConfig(page_size=16, chunking=True, max_running=3, preemption=True),
    S.StepConfig(page_size=4, chunking=False, prefill_max=2, ignore_eos_path=True),
]


@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
def test_eval_requests_kernel_equals_torch(n, block):
    rng = random.Random(n * 31 + (block or 0))
    for ci, cfg in enumerate(CFGS):
        for trial in range(6):
            args = random_eval_inputs(rng, n, cfg)
            want = S.eval_requests(cfg, *args)
            got = KA.eval_requests(cfg, *args, block=block)
            for name, g, w in zip(("stop", "kind", "chunk_len", "mark"), got, want):
                msg = first_diff(name, g, w)
                assert msg is None, f"cfg {ci} trial {trial}: {msg}"


# ---- ignore-EOS grid -------------------------------------------------------------------------------
# one program per candidate, each walking every state: the large size keeps the interpreter quick
EOS_SIZES = SIZES[:-1] + [(120, 64)]


@pytest.mark.parametrize("n,block", EOS_SIZES, ids=[f"n{n}-b{b}" for n, b in EOS_SIZES])
def test_ignore_eos_kernel_equals_torch(n, block):
    rng = random.Random(7 * n + 1)
    for trial in range(4 if n < 100 else 2):
        R = rng.choice([0, 1, 5, 17])
        ratio = t(rng.choice([1.0, 0.7, rng.random()]), torch.float64)

        def states(m):
            return S.eos_states(t([rng.randrange(0, 80) for _ in range(m)]), t([rng.randrange(0, 30) for _ in range(m)]),
                                t([rng.randrange(1, 60) for _ in range(m)]),
                                t([rng.random() < 0.5 for _ in range(m)], torch.bool), ratio)

        ql, qo = states(n)
        hl, ho = states(R)
        qv = t([rng.random() < 0.9 for _ in range(n)], torch.bool)
        hv = t([rng.random() < 0.9 for _ in range(R)], torch.bool)
        c = t([rng.randrange(-100, 3000) for _ in range(n)])
        want = S.ignore_eos_fail(c, ql, qo, qv, hl, ho, hv, rows=7)
        left = torch.cat([hl, ql])
        key = torch.where(torch.cat([hv, qv]) & (left > 0), left, float("inf"))
        order = torch.sort(key, stable=True).indices
        qidx = torch.cat([torch.full_like(ho, -1), torch.arange(n, device=DEV)])
        keep = torch.cat([hv, qv]) & (left > 0)
        got = KE.ignore_eos_scan(c, left[order], torch.cat([ho, qo])[order], qidx[order], keep[order], block=block)
        msg = first_diff("fail", got, want)
        assert msg is None, f"trial {trial}: {msg}"
        if n < 100:
            assert torch.equal(S.ignore_eos_fail(c, ql, qo, qv, hl, ho, hv, backend="triton"), want)


# ---- preemption ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,block", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("sign", [1, -1])
def test_preempt_kernel_equals_torch(n, block, sign):
    rng = random.Random(n * 3 + sign)
    prios = [0, 1, 5, 20, -3, 2**63 - 1, -(2**63)]
    for trial in range(8):
        thr = rng.choice([0, 1, 10, -2])
        valid = t([rng.random() < 0.9 for _ in range(n)], torch.bool)
        prio = t([rng.choice(prios) for _ in range(n)])
        tm = t([float(rng.randrange(4)) for _ in range(n)], torch.float64)
        res = t([rng.randrange(-5, 400) for _ in range(n)])
        args = (valid, prio, tm, res, t(rng.choice(prios)), t(rng.randrange(-2000, 20000)),
                t(rng.choice([1.0, 0.5, rng.random()]), torch.float64), t(rng.randrange(0, 20000)), sign, thr)
        want = S.preempt_select(*args)
        got = S.preempt_select(*args, backend="triton")
        msg = first_diff("victims", got.victims, want.victims)
        assert msg is None, f"trial {trial}: {msg}"
        assert bool(got.success) == bool(want.success) and int(got.V) == int(want.V), f"trial {trial}"
        if block is not None:  # the launcher at the odd block size too
            R = n
            o = torch.arange(R, device=DEV)
            k = KP.preempt_cut(prio, res, valid, args[4], args[5], args[6], args[7], sign, thr, block=block)
            k2 = KP.preempt_cut(prio, res, valid, args[4], args[5], args[6], args[7], sign, thr)
            assert int(k) == int(k2) and 0 <= int(k) <= R and o.numel() == R


# ---- the whole step with the triton backend -----------------------------------------------------------
def test_admit_step_triton_backend_equals_torch():
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_step_core import build, static_inputs

    seen = set()
    for seed in range(40):
        rng, cfg, ref, ratio, full0 = build(seed)
        # one queue padded past 1024 entries: the single-program walks take their wide blocks
        # (`scan_config`; one is enough, the interpreter's ignore-EOS grid grows as Q^2)
        pad = rng.choice([0, 3]) if seed else 1030
        scfg, st, q, held, chunked, _ = static_inputs(cfg, ref, ratio, full0, pad)
        mv = lambda x: None if x is None else type(x)(*[v.to(DEV) for v in x])  # noqa: E731
        st, q, held, chunked = mv(st), mv(q), mv(held), mv(chunked)
        want = S.admit_step(scfg, st, q, held, chunked)
        # the triton rounds (checks and the fused event/state update per round), all rounds
        # as a recorded step runs them and with the eager early exit
        for early in (False, True):
            got = S.admit_step(scfg, st, q, held, chunked, backend="triton", early_exit=early)
            for name, g, w in zip(S.StepResult._fields, got, want):
                if name != "packed":
                    assert torch.equal(g, w), f"seed {seed} early_exit={early}: {name} {g} != {w}"
            # the packed scalars (one read-back) hold the same values, in `read_step_result`'s order
            assert want.packed is None
            assert S.read_step_result(got) == S.read_step_result(want), (seed, early)
            packed = {"COUNT": want.admitted.sum(), "STOP_INDEX": want.stop_index, "STOP": want.stop,
                      "CHUNK_INDEX": want.chunk_index, "CHUNK_LEN": want.chunk_len, "FULL": want.batch_full,
                      "INFLIGHT_END": want.inflight_end, "INFLIGHT_LEFT": want.inflight_left, "I": want.I,
                      "CUR": want.cur_off, "RIN": want.rem_input, "RC": want.rem_chunk, "EV": want.evictable,
                      "HIT": want.hit_tokens, "INPUT": want.input_tokens, "DONE": want.decided,
                      "CUR_REM": want.cur_rem}
            for name, w in packed.items():
                assert int(got.packed[getattr(KA, "R_" + name)]) == int(w), (seed, early, name)
        seen.add(("stop", int(want.stop)))
        seen.add(("chunk", int(want.chunk_index) >= 0))
    # the rounds met chunks and several ways to stop
    assert ("chunk", True) in seen and len({v for k, v in seen if k == "stop"}) >= 3, seen



def test_admit_step_triton_in_flight_chunk_past_the_chunk_size():
    """The in-flight chunk with rem_chunk < 0 (more mixed decode tokens than
    chunked_prefill_size): the triton set-up gives it an empty extend range, as the torch form
    and the reference do (`test_step_core`)."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_step_core import mixed_past_chunk_size_state, static_inputs

    cfg, ref = mixed_past_chunk_size_state()
    scfg, st, q, held, chunked, _ = static_inputs(cfg, ref, 0.7, False, 1)
    mv = lambda x: None if x is None else type(x)(*[v.to(DEV) for v in x])  # noqa: E731
    st, q, held, chunked = mv(st), mv(q), mv(held), mv(chunked)
    want = S.admit_step(scfg, st, q, held, chunked)
    got = S.admit_step(scfg, st, q, held, chunked, backend="triton")
    assert (int(got.inflight_end), bool(got.inflight_left)) == (4, True)
    assert S.read_step_result(got) == S.read_step_result(want)

# ---- launcher checks -----------------------------------------------------------------------------
def test_launchers_check_arguments():
    cfg = CFGS[0]
    args = list(random_eval_inputs(random.Random(0), 5, cfg))
    bad = list(args)
    bad[2] = bad[2].to(torch.int32)
    with pytest.raises(TypeError, match="eval_requests: fill must have dtype int64"):
        KA.eval_requests(cfg, *bad)
    bad = list(args)
    bad[3] = bad[3][:3]
    with pytest.raises(ValueError, match="pre must have 5 elements"):
        KA.eval_requests(cfg, *bad)
    with pytest.raises(ValueError, match="sign must be"):
        KP.preempt_cut(t([1]), t([1]), t([True], torch.bool), t(0), t(0), t(1.0, torch.float64), t(0), 0, 1)
    with pytest.raises(TypeError, match="keep_s must have dtype bool"):
        KE.ignore_eos_scan(t([1]), t([1.0], torch.float64), t([1]), t([0]), t([1]))
    L = 4
    cols = [t([0] * L) for _ in range(3)] + [t([False] * L, torch.bool)] + [t([0] * L) for _ in range(8)]
    cols += [t([False] * L, torch.bool), t([0] * L)]
    base, st = t([0] * KA.BASE_LEN), t([0] * KA.STATE_LEN)
    with pytest.raises(ValueError, match="admission_round: state must have 16 elements"):
        KA.admission_round(cfg, *cols, base, t([0] * 3), st, t([0] * 9), t([0] * L))
    with pytest.raises(ValueError, match="admission_round: state_out must be another buffer"):
        KA.admission_round(cfg, *cols, base, st, st, t([0] * 9), t([0] * L))
    qc = [t([0] * L) for _ in range(6)] + [t([False] * L, torch.bool)]
    ratio = t(0.5, torch.float64)
    with pytest.raises(ValueError, match="admission_prepare: sv must have 15 elements"):
        KA.admission_prepare(cfg, *qc, t([0] * 3), ratio, False)
    with pytest.raises(TypeError, match="admission_prepare: ie must have dtype bool"):
        KA.admission_prepare(cfg, *qc[:6], t([0] * L), t([0] * KA.SV_LEN), ratio, False)
    with pytest.raises(TypeError, match="admission_round: mark must have dtype bool"):
        bad = list(cols)
        bad[3] = t([0] * L)
        KA.admission_round(cfg, *bad, base, st, st.clone(), t([0] * 9), t([0] * L))
    assert dataclasses.is_dataclass(cfg)


def test_first_admission_then_no_token_marks_batch_full():
    """R-STEP-3: a loop that admits its first request and then runs out of tokens marks the
    batch full (something was admitted), one that refuses it does not: page size 16 makes the
    commit (whole pages) larger than the check (tokens), so the first request passes and the
    budget after it is spent. Triton rounds (`admission_round`) against the reference."""
    from gpu_sched.config import SchedulerConfig
    from gpu_sched.reference.scheduler import ReferenceScheduler
    from gpu_sched.request import Request
    from gpu_sched.scheduler import GpuScheduler

    seen = set()
    for pool in (18, 20, 24):
        cfg = SchedulerConfig(page_size=16, chunked_prefill_size=None)
        got = []
        for s in (ReferenceScheduler(cfg, pool), GpuScheduler(cfg, pool, backend="triton", device=DEV)):
            s.submit([Request(rid="a", prompt_ids=[5], max_new_tokens=1),
                      Request(rid="b", prompt_ids=[6], max_new_tokens=1)], now=0.0)
            plan = s.step(0.7)
            got.append((plan.stop, tuple(a[0] for a in plan.admitted), s.batch_is_full))
        assert got[0] == got[1], (pool, got)
        seen.add(got[0])
    assert ("add_no_token", ("a",), True) in seen and ("add_no_token", (), False) in seen, seen


@pytest.mark.parametrize("seed", range(24))
def test_lock_drops_triton_walks_equal_rounds(seed):
    """`lock_drops` with backend "triton" (first request per node by one atomic walk per
    request, `kernels.radix.lock_drops`) equals the brute-force sequential locking and the torch
    pointer-doubling rounds; with some nodes dead too (a walk stops after a dead node, as the
    rounds' ancestor table does)."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_step_core import brute_drops, random_lock_case

    rng, parent, key_len, lock_ref, last, cover, valid = random_lock_case(seed)
    N = len(parent)
    args = (t(parent), t(key_len), t(lock_ref))
    req = (t(last), t(cover), t(valid, torch.bool))
    alive = torch.ones(N, dtype=torch.bool, device=DEV)
    want = brute_drops(parent, key_len, lock_ref, last, cover, valid)
    got = S.lock_drops(*args, alive, *req, backend="triton").tolist()
    assert got == want
    dead = t([i > 0 and rng.random() < 0.2 for i in range(N)], torch.bool)
    assert torch.equal(S.lock_drops(*args, ~dead, *req, backend="triton"), S.lock_drops(*args, ~dead, *req))


@pytest.mark.parametrize("block", [16, None])
@pytest.mark.parametrize("seed", range(6))
def test_lock_drops_triton_crowded_partial_covers(seed, block):
    """Many requests ending inside the same few nodes, in blocks of 16: the partial covers'
    running maximum per node is carried across the sorted program's blocks (a cover that
    dips below an earlier one in another block gains nothing), and nodes covered whole by an
    earlier request give later partial covers nothing; equal to the brute-force sequential
    locking and to the torch form."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_step_core import brute_drops

    rng = random.Random(100 + seed)
    N = 6
    parent = [-1, 0, 1, 1, 0, 4]
    key_len = [0] + [rng.randrange(8, 20) for _ in range(1, N)]
    lock_ref = [1, 0, 0, rng.choice([0, 1]), 0, 0]
    Q = 1500 if block is None and seed >= 4 else rng.choice([40, 100])  # 1500: the wide walk (`scan_config`)
    last = [rng.choice([2, 3, 5, 5, 1]) for _ in range(Q)]
    valid = [rng.random() < 0.9 for _ in range(Q)]
    # mostly partial covers (below key_len), a few whole ones, some after many partial ones
    cover = [rng.randint(1, key_len[v] - 1) if rng.random() < 0.85 or i < Q // 2 else key_len[v]
             for i, v in enumerate(last)]
    last = [v if ok else 0 for v, ok in zip(last, valid)]
    cover = [c if ok else 0 for c, ok in zip(cover, valid)]
    args = (t(parent), t(key_len), t(lock_ref), torch.ones(N, dtype=torch.bool, device=DEV), t(last), t(cover),
            t(valid, torch.bool))
    want = brute_drops(parent, key_len, lock_ref, last, cover, valid)
    got = KR.lock_drops(*args, block=block)
    assert got.tolist() == want
    assert torch.equal(got, S.lock_drops(*args))


@pytest.mark.parametrize("seed", range(12))
def test_match_lock_drops_forms_agree(seed):
    """`match_lock_drops` (requests given by match length and last pool position) with backend
    "triton" (the node and cover read in the first launch, `kernels.radix.lock_drops_matched`)
    and in the torch form equal the brute-force locking of the same paths; a request with a
    match but valid false, or valid with an empty match, locks nothing."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_step_core import brute_drops, random_lock_case

    rng, parent, key_len, lock_ref, last, cover, valid = random_lock_case(seed)
    N, Q = len(parent), len(last)
    key_off, top = [], 3  # each node's pool range, with gaps; owner marks them
    for v in range(N):
        key_off.append(top)
        top += key_len[v] + rng.randrange(3)
    owner = [-1] * (top + 2)
    for v in range(N):
        for j in range(key_len[v]):
            owner[key_off[v] + j] = v
    m = [rng.randrange(1, 50) if ok else 0 for ok in valid]
    pos = [key_off[v] + c - 1 if ok else rng.choice([-1, 0]) for v, c, ok in zip(last, cover, valid)]
    flags = list(valid)
    for i in range(Q):  # a match the caller marks invalid, or a valid row with no match: ignored
        if rng.random() < 0.15:
            flags[i] = not valid[i]
    args = (t(parent), t(key_len), t(lock_ref), torch.ones(N, dtype=torch.bool, device=DEV), t(owner), t(key_off),
            t(m), t(pos), t(flags, torch.bool))
    want = brute_drops(parent, key_len, lock_ref, last, cover, [f and k > 0 for f, k in zip(flags, m)])
    assert S.match_lock_drops(*args, backend="triton").tolist() == want
    assert S.match_lock_drops(*args).tolist() == want


@pytest.mark.parametrize("Q,block", [(100, 16), (1500, None)])
@pytest.mark.parametrize("chunked", [False, True])
def test_admission_prepare_blocks_carry_prefix_sums(chunked, Q, block):
    """`admission_prepare` with blocks of 16 over 100 requests (the prefix sums carried from
    block to block), and over 1500 in default blocks, against the torch formulas of
    `admit_step`'s set-up."""
    rng = random.Random(7 + chunked)
    cfg = S.StepConfig(page_size=4, clip=50, chunking=True)
    col = lambda lo, hi: t([rng.randrange(lo, hi) for _ in range(Q)])  # noqa: E731
    pre = t([4 * rng.randrange(0, 10) for _ in range(Q)])
    fill, out, maxn, drop = pre + col(1, 60), col(0, 5), col(1, 90), col(0, 9)
    prompt = fill - out
    ie = t([rng.random() < 0.3 for _ in range(Q)], torch.bool)
    n = 77
    sv = t([5000, 300, 40, 60, 800, 700, 3, 2, 1, 0, n, 1 if chunked else 0, 130, 16, 80])
    ratio = t(0.7, torch.float64)
    p = KA.admission_prepare(cfg, fill, out, prompt, maxn, pre, drop, ie, sv, ratio, chunked, block=block)
    pad = lambda x: torch.cat([x, x.new_zeros(1)])  # noqa: E731
    vm = (torch.arange(Q + 1, device=DEV) < n).to(torch.int64)
    e = -torch.div(-(pad(fill) - pad(pre)), 4, rounding_mode="floor") * 4
    wI, wC = e + pad(maxn).clamp(max=50) + 4, e + 4
    ex = lambda x: torch.cumsum(x * vm, 0) - x * vm  # noqa: E731
    for name, want in (("fill", pad(fill)), ("end", pad(fill)), ("pre", pad(pre)), ("drop", pad(drop)),
                       ("ie", pad(ie)), ("e", e), ("wI", wI), ("wC", wC), ("exI", ex(wI)), ("exC", ex(wC)),
                       ("exE", ex(e)), ("exD", ex(pad(drop))),
                       ("ev", 300 - ex(pad(drop)))):
        assert torch.equal(getattr(p, name).cpu(), want.cpu()), name
    rn = 0.7 * 3.0
    I, cur, rin, rc, can = 40, 60, 800, 700, 2
    if chunked:  # R-ADM-5 by hand: room from the budgets, a 114-token extend cut to whole pages
        room = min(700, int((5000 + 300 - 40) - rn))
        nc = min(130 - 16, room)
        ec = -(-nc // 4) * 4
        I, cur, rin, rc, can = I + ec + (min(80, 50) if nc == 114 else 0) + 4, cur + ec + 4, rin - ec, rc - ec, 3
        assert p.extra.tolist() == [ec, 16 + nc, int(nc < 114), rin]
    assert p.base.tolist() == [5000, 300, I, cur, rin, rc, can, 1, 0, n]
    assert p.sc.tolist() == p.base.tolist()[:9]
    assert p.state.tolist() == [0, 0, 0, 0, 0, -1, 0, 0, 0, 0, I, cur, rin, rc, 300, 0]
    assert float(p.rn) == rn


def test_recorded_head_reads_the_packed_result_fields():
    """The recorded step gathers its output head from `admission_result`'s packed scalars by
    the names `step._HEAD_FIELDS`: they name the head's fields in its order."""
    from gpu_sched.step import _HEAD_FIELDS, HEAD

    names = ["STOP", "STOP_INDEX", "CHUNK_INDEX", "FULL", "I", "CUR", "RIN", "RC", "HIT", "INPUT_NEW", "DONE",
             "COUNT", "INFLIGHT_END", "INFLIGHT_LEFT"]
    assert len(names) == HEAD
    assert _HEAD_FIELDS == tuple(names) and all(hasattr(KA, "R_" + n) for n in names)
