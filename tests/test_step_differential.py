"""Whole scheduling steps: GpuScheduler against the reference scheduler on random scenarios.

2,000 scenarios (500 families of 4, `tests/_scenarios.py`) with the torch backend, once with
each form of admission windows, and 100 small ones with the Triton backend (interpreter on CPU). Each scenario is a complete state built
through the API on both schedulers: waiting queues of 0..3000 (most small), running batches of
0..500, page sizes 1/4/16, chunking on/off, every policy, budgets drawn around the scenario's own
demand, ignore-EOS requests with the cache disabled, priority scheduling with preemption on/off
in both directions, shared prefixes over small vocabularies with a warm cache, an in-flight
chunked request. One step each; the plans must be equal in every field (admitted rids and extend
ranges in order, the chunked request, preempted rids, the full mark, the stop reason, counters,
budgets bit for bit, pool/cache sizes), so must the queue left behind and the cache contents
(id-free triples), and both integrity checks must pass. A failure names the scenario (family,
variant) and its first difference; reproduce one with `run_family(FAMILY, "torch")` (or
`make_family(FAMILY)[VARIANT]` and `_scenarios.build`).

The set must stay strong: `test_every_outcome_occurs` asserts that every stop reason and every
admission rule (`_scenarios.REQUIRED_OUTCOMES`) decided at least one step.
"""

import copy
import os
import struct
from collections import Counter

import pytest

from _scenarios import (REQUIRED_OUTCOMES, VARIANTS, ObservedReference, add_variant, build_base, dev_triples,
                        make_family, ref_triples)
from gpu_sched.scheduler import GpuScheduler

DEVICE = os.environ.get("GPU_SCHED_TEST_DEVICE", "cpu")
FAMILIES = 500  # x VARIANTS = 2,000 scenarios
GROUP = 20  # families per test
TRITON_FAMILIES = 25  # x VARIANTS = 100 small scenarios

# (family, small) -> reason: families with a known, reported mismatch (xfail strict below)
KNOWN_MISMATCHES = {}

PLAN_FIELDS = (  # most telling first: the failure message shows the first that differs
    "admitted", "new_chunked_rid", "chunked_rid_after", "preempted", "stop", "batch_is_full",
    "log_hit_tokens", "log_input_tokens", "budgets_start", "budgets", "available", "evictable",
    "protected", "preempt_evicted_tokens", "ordered", "active_policy", "queue_order", "num_matched",
    "deprioritized",
)


def _bits(x):
    return struct.pack("<d", x) if isinstance(x, float) else x


def _first_list_diff(a, b) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at [{i}]: reference {x!r}, device {y!r} (lengths {len(a)}, {len(b)})"
    return f"lengths {len(a)} != {len(b)}; next: reference {a[len(b):len(b) + 3]!r}, device {b[len(a):len(a) + 3]!r}"


def diff_plans(pa, pb):
    """The first differing plan field as a readable line, or None."""
    for f in PLAN_FIELDS:
        a, b = getattr(pa, f), getattr(pb, f)
        if f in ("budgets", "budgets_start") and a is not None and b is not None:
            for k in sorted(set(a) | set(b)):
                if _bits(a.get(k)) != _bits(b.get(k)):
                    return f"{f}.{k}: reference {a.get(k)!r}, device {b.get(k)!r}"
            continue
        if a != b:
            if isinstance(a, list) and isinstance(b, list):
                return f"{f}: {_first_list_diff(a, b)}"
            return f"{f}: reference {a!r}, device {b!r}"
    return None


def diff_state(ref, dev):
    """Queue, pool/cache sizes, cache contents and integrity after a call, or None."""
    qa, qb = [r.rid for r in ref.queue], [r.rid for r in dev.queue]
    if qa != qb:
        return f"queue after the step: {_first_list_diff(qa, qb)}"
    sa = (ref.available, ref.evictable, ref.protected)
    sb = (dev.available, dev.evictable, dev.protected)
    if sa != sb:
        return f"(available, evictable, protected): reference {sa}, device {sb}"
    ta, tb = ref_triples(ref.cache), dev_triples(dev.cache)
    if ta != tb:
        only_a, only_b = sorted(ta - tb, key=repr)[:2], sorted(tb - ta, key=repr)[:2]
        return f"cache contents: only in reference {only_a}, only in device {only_b}"
    for who, s in (("reference", ref), ("device", dev)):
        try:
            s.check_integrity()
        except AssertionError as e:
            return f"{who} integrity: {e}"
    return None


def _flat_int_lists(obj, memo, depth=3):
    """Pre-copy long lists of ints found in `obj`'s attributes (e.g. a free-slot list): a shallow
    copy of such a list is its deep copy, and deepcopy would visit every element."""
    for v in getattr(obj, "__dict__", {}).values():
        if isinstance(v, list) and len(v) > 256 and id(v) not in memo and all(type(x) is int for x in v):
            memo[id(v)] = list(v)
        elif depth and hasattr(v, "__dict__") and not isinstance(v, type):
            _flat_int_lists(v, memo, depth - 1)
    return memo


def _fork(base, sc, make):
    """A copy of a family's base state (deepcopy; rebuilt through the API if it cannot be copied)."""
    try:
        s = copy.deepcopy(base, _flat_int_lists(base, {}))
    except Exception:  # pragma: no cover - e.g. a captured CUDA graph
        s = build_base(sc, make)
    return add_variant(s, sc)


def run_family(family: int, backend: str = "torch", small: bool = False):
    """Run every variant of a family on both schedulers. Returns (errors, outcome counts)."""
    fam = make_family(family, small)
    mk_ref = lambda c, k, sh: ObservedReference(c, k, shuffle=sh)  # noqa: E731
    mk_dev = lambda c, k, sh: GpuScheduler(c, k, shuffle=sh, backend=backend, device=DEVICE)  # noqa: E731
    ref_base, dev_base = build_base(fam[0], mk_ref), build_base(fam[0], mk_dev)
    errors, outcomes = [], Counter()
    d = diff_state(ref_base, dev_base)
    if d:
        return [f"family {family} (small={small}) after seeding: {d}\n  {fam[0].config}"], outcomes
    for sc in fam:
        ref, dev = _fork(ref_base, sc, mk_ref), _fork(dev_base, sc, mk_dev)
        ref.events = []
        try:
            pa = ref.step(sc.ratio)
            pb = dev.step(sc.ratio)
            d = diff_plans(pa, pb) or diff_state(ref, dev)
        except Exception as e:  # a crash is a mismatch of that scenario, reported with its type
            d = f"raised {type(e).__name__}: {e}"
        outcomes.update(set(ref.events))
        if d:
            errors.append(f"{sc.name} (small={small}, backend={backend}): {d}\n  {sc.describe()}")
    return errors, outcomes


_OUTCOMES = {}  # (family, small) -> outcome counts of the reference, filled by the tests


def _run_group(families, backend, small):
    errors = []
    for f in families:
        errs, outs = run_family(f, backend, small)
        _OUTCOMES[(f, small)] = outs
        errors += errs
    assert not errors, f"{len(errors)} scenario(s) differ; first: " + "\n".join(errors[:3])


def _groups(n, size):
    fams = [f for f in range(n) if (f, False) not in KNOWN_MISMATCHES]
    return [fams[i : i + size] for i in range(0, len(fams), size)]


@pytest.mark.parametrize("families", _groups(FAMILIES, GROUP), ids=lambda fs: f"families{fs[0]}-{fs[-1]}")
@pytest.mark.parametrize("windows", ["scalar", "lead", "static"])
def test_torch_steps_match_reference(families, windows, monkeypatch):
    # every form of an admission window: one request at a time on the window's matches and
    # lock drops (`GpuScheduler._scalar_admission`, the default up to SCALAR_WINDOW requests,
    # first matches by scalar searches up to FIND_SCALAR_MAX rows); every window as a larger
    # one, "lead": by prefix sums up to the first request the loop does not simply admit,
    # then the same loop (`_window_lead`, with the cache on and no priority preemption), or
    # "static": the static step's checks of every request (`admit_step_host`); their first
    # matches by the array search
    if windows != "scalar":
        monkeypatch.setattr(GpuScheduler, "SCALAR_WINDOW", 0)
        monkeypatch.setattr(GpuScheduler, "FIND_SCALAR_MAX", 0)
    if windows == "static":
        monkeypatch.setattr(GpuScheduler, "LEAD_WINDOWS", False)
    _run_group(families, "torch", small=False)


def test_window_lead_equals_the_loop(monkeypatch):
    """`_window_lead`'s result equals `_window_loop` run from the window's first request, on
    every window of 40 families' steps (every window through the lead), and the lead skips
    requests in some of them."""
    lead, loop = GpuScheduler._window_lead, GpuScheduler._window_loop
    seen = Counter()

    def recorded_loop(self, rows, ms, drops, ev, adder, running_bs, start=None):
        if start is not None:  # the lead's first request left to the loop
            seen["skipped" if 0 < start[0] < len(rows) else "none" if start[0] == 0 else "all"] += 1
        return loop(self, rows, ms, drops, ev, adder, running_bs, start)

    def checked(self, rows, m, drop, ev, adder, running_bs, sel):
        got = lead(self, rows, m, drop, ev, adder, running_bs, sel)
        assert got == loop(self, rows, m, drop, ev, adder, running_bs)
        return got

    monkeypatch.setattr(GpuScheduler, "SCALAR_WINDOW", 0)
    monkeypatch.setattr(GpuScheduler, "_window_lead", checked)
    monkeypatch.setattr(GpuScheduler, "_window_loop", recorded_loop)
    _run_group(range(40), "torch", small=False)
    assert seen["skipped"] > 10 and seen["none"] > 10 and seen["all"] > 0, seen


@pytest.mark.parametrize("families", _groups(TRITON_FAMILIES, 5), ids=lambda fs: f"small{fs[0]}-{fs[-1]}")
def test_triton_steps_match_reference(families):
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _run_group(families, "triton", small=True)


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=r))
                                 for k, r in sorted(KNOWN_MISMATCHES.items())], ids=str)
def test_known_mismatches(key):
    family, small = key
    errors, _ = run_family(family, "triton" if small else "torch", small)
    assert not errors, errors[0]


def _reference_outcomes(family, small):
    """Outcome counts of a family from the reference alone (when its test did not run here)."""
    fam = make_family(family, small)
    base = build_base(fam[0], lambda c, k, sh: ObservedReference(c, k, shuffle=sh))
    out = Counter()
    for sc in fam:
        ref = add_variant(copy.deepcopy(base), sc)
        ref.events = []
        ref.step(sc.ratio)
        out.update(set(ref.events))
    return out


def test_every_outcome_occurs():
    """Over the torch set every stop reason and admission rule decided some step."""
    total = Counter()
    for f in range(FAMILIES):
        key = (f, False)
        if key not in _OUTCOMES:
            _OUTCOMES[key] = _reference_outcomes(f, False)
        total.update(_OUTCOMES[key])
    missing = [o for o in REQUIRED_OUTCOMES if total[o] == 0]
    assert not missing, f"the scenario generator never hit {missing}; counts: {dict(total)}"
    assert FAMILIES * VARIANTS >= 2000
