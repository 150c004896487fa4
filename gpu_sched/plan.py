"""The result of one scheduling step (SPEC.md R-STEP-4), shared by every scheduler."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import List, Optional, Tuple

from .config import POLICIES

STOP_REASONS = (
    "no_prefill_full",  # R-STEP-1: nothing to do, the batch is marked full
    "no_prefill_empty",  # R-STEP-1: nothing to do, empty queue
    "no_prefill_max_running",  # R-STEP-1: running batch at max_running_requests
    "budget_other",  # R-STEP-3.1
    "batch_full",  # R-STEP-3.3: preemption off or failed
    "add_no_token",  # R-STEP-3.5 NO_TOKEN
    "add_other",  # R-STEP-3.5 OTHER
    "queue_end",  # every queued request processed
)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: `PrefillPlan.from_dict`'s check of each list field's entries, and what it names (the
#: optional ones may be None)
_LISTS = {"admitted": (lambda a: isinstance(a, (list, tuple)) and len(a) == 3 and isinstance(a[0], str)
                       and _int(a[1]) and _int(a[2]) and 0 <= a[1] <= a[2],
                       "(rid, extend_start, extend_end), 0 <= start <= end"),
          "preempted": (lambda x: isinstance(x, str), "a rid"),
          "queue_order": (lambda x: isinstance(x, str), "a rid"),
          "deprioritized": (lambda x: isinstance(x, str), "a rid"),
          "num_matched": (lambda x: _int(x) and x >= 0, "an int >= 0 (a match length)")}
_OPTIONAL_LISTS = ("num_matched", "deprioritized")
#: the other fields' checks, and what they name
_SCALARS = {"new_chunked_rid": (lambda x: x is None or isinstance(x, str), "a rid or None"),
            "chunked_rid_after": (lambda x: x is None or isinstance(x, str), "a rid or None"),
            "active_policy": (lambda x: x is None or x in POLICIES, f"one of {POLICIES} or None"),
            "ordered": (lambda x: isinstance(x, bool), "a bool"),
            "batch_is_full": (lambda x: isinstance(x, bool), "a bool"),
            "stop": (lambda x: x in STOP_REASONS, f"one of {STOP_REASONS}"),
            **{k: (lambda x: _int(x) and x >= 0, "an int >= 0") for k in (
                "log_hit_tokens", "log_input_tokens", "available", "evictable", "protected", "preempt_evicted_tokens")}}


@dataclass
class PrefillPlan:
    """One step's decisions.

    A request's fill is its prompt followed by the output tokens decoded so far; positions
    below are token positions in it. Extending [extend_start, extend_end) means prefilling
    those tokens: positions below extend_start are reused from the prefix cache (or were
    prefilled by an earlier chunk).

    Attributes:
        admitted: (rid, extend_start, extend_end) in admission order [token positions of fill];
            the in-flight chunked request, when there is one, first.
        new_chunked_rid: the request that became the chunked request this step, or None.
        chunked_rid_after: the chunked request after the step (new one, or the in-flight one
            if it still has tokens left), or None.
        preempted: rids of the victims, in running-batch order (R-ADM-7); they are back in
            the queue.
        ordered, active_policy, queue_order, num_matched, deprioritized: what ordering did
            (R-ORD); `num_matched`/`deprioritized` only for an active cache-aware policy.
        batch_is_full: the full mark after the step. stop: one of STOP_REASONS.
        budgets, budgets_start: {rem_total (float64), cur_rem, rem_input, rem_chunk} at the end
            of the step and right after the budgets were built; None on R-STEP-1 exits.
        log_hit_tokens, log_input_tokens: R-ADM-2 counters [tokens] over the admitted
            requests: cached prefix tokens reused (prefix_len), and tokens to prefill rounded
            up to whole pages (ceilP(ext)), as SGLang's prefill log counts them.
        available, evictable, protected: pool/cache sizes after the step [tokens].
        preempt_evicted_tokens: tokens evicted by R-ADM-7's releases.
    """

    admitted: List[Tuple[str, int, int]] = field(default_factory=list)
    new_chunked_rid: Optional[str] = None
    chunked_rid_after: Optional[str] = None
    preempted: List[str] = field(default_factory=list)
    ordered: bool = False
    active_policy: Optional[str] = None
    queue_order: List[str] = field(default_factory=list)
    num_matched: Optional[List[int]] = None
    deprioritized: Optional[List[str]] = None
    batch_is_full: bool = False
    stop: str = "no_prefill_empty"
    budgets: Optional[dict] = None
    budgets_start: Optional[dict] = None
    log_hit_tokens: int = 0
    log_input_tokens: int = 0
    available: int = 0
    evictable: int = 0
    protected: int = 0
    preempt_evicted_tokens: int = 0

    @property
    def admitted_rids(self) -> List[str]:
        """The admitted requests' rids, in admission order."""
        return [a[0] for a in self.admitted]

    @property
    def extend_tokens(self) -> int:
        """Tokens this step prefills: the sum of the extend ranges' lengths [tokens]."""
        return sum(e - s for _, s, e in self.admitted)

    def to_dict(self) -> dict:
        """Every field as plain Python values (lists, dicts, str, int, float, bool, None),
        ready for `json.dumps`: per-request lists a scheduler makes on first use
        (GpuScheduler's `LazyList`, which json does not take) are made into lists here."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, dict):
                v = dict(v)
            elif v is not None and not isinstance(v, (str, int, float, bool)):
                v = [list(x) if isinstance(x, tuple) else x for x in v]
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "PrefillPlan":
        """`to_dict`'s inverse (e.g. after a JSON round trip): admitted entries become (rid,
        extend_start, extend_end) tuples again, lists and dicts are copied; missing fields
        take their defaults. Raises TypeError for a `d` that is not a dict, ValueError naming
        the field for a key that is not a field or a value of another type than `to_dict`
        writes there (rids: str or None; active_policy: one of `config.POLICIES` or None; admitted: (str, int, int) with 0 <= start <= end;
        num_matched, counters and sizes: ints, >= 0 where counts; flags: bools; stop: one of
        `STOP_REASONS`; budgets: a dict or None). Checks types and ranges, not a plan's
        consistency (an admitted rid twice, a chunked rid not admitted)."""
        if not isinstance(d, dict):
            raise TypeError(f"PrefillPlan.from_dict takes a dict, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        extra = sorted(k for k in d if k not in names)
        if extra:
            raise ValueError(f"PrefillPlan.from_dict: unknown fields {extra[:5]}")
        kw = dict(d)
        for name, (ok, what) in _LISTS.items():
            if name not in kw or kw[name] is None and name in _OPTIONAL_LISTS:
                continue
            v = kw[name]
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"PrefillPlan.from_dict: {name} must be a list, got {v!r}")
            for x in v:
                if not ok(x):
                    raise ValueError(f"PrefillPlan.from_dict: {name} entry {x!r} is not {what}")
            kw[name] = [tuple(x) for x in v] if name == "admitted" else list(v)
        for name, (ok, what) in _SCALARS.items():
            if name in kw and not ok(kw[name]):
                raise ValueError(f"PrefillPlan.from_dict: {name} must be {what}, got {kw[name]!r}")
        for name in ("budgets", "budgets_start"):
            v = kw.get(name)
            if v is not None and not isinstance(v, dict):
                raise ValueError(f"PrefillPlan.from_dict: {name} must be a dict or None, got {v!r}")
            if v is not None:
                kw[name] = dict(v)
        return cls(**kw)

    def decision_bytes(self) -> bytes:
        """The decisions that define a run (admitted rids and extend ranges, chunked request,
        preempted rids), serialised for the replay digest."""
        parts = [f"{r}:{s}:{e}" for r, s, e in self.admitted]
        parts.append(f"c={self.chunked_rid_after}")
        parts.append("p=" + ",".join(self.preempted))
        return ("|".join(parts) + "\n").encode()


class DecisionDigest:
    """Running SHA-256 over every step's decisions (to compare runs and backends)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.steps = 0

    def update(self, plan: PrefillPlan) -> None:
        self._h.update(plan.decision_bytes())
        self.steps += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()
