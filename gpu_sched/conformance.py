"""Conformance runner for ../shared/conformance scenario files (see FORMAT.md there).

Each scenario is one complete state plus the step output SPEC.md prescribes. The runner builds
the state through the scheduler API only (`seed_cache`, `seed_running`, `seed_chunked`,
`submit`), runs one step and compares every expected field (`rem_total` bit for bit).
"""

from __future__ import annotations

import gzip
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

from .config import SchedulerConfig
from .request import Request

FIXED_CLIP = 4096
FIXED_IN_BATCH = 32


def read_scenarios(path) -> Iterator[dict]:
    """Yield scenario dicts from a JSON-lines file, gzipped or not (FORMAT.md: one object per
    line with "input" and "expected" objects). A generator: it raises on iteration, not at
    the call: FileNotFoundError, or ValueError naming the file and line for a file that is not (gzipped) UTF-8 text, a line that is not JSON,
    or a line that is not a scenario object."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"scenario file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    sc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path.name} line {lineno}: invalid JSON ({e.msg})") from None
                if not (isinstance(sc, dict) and isinstance(sc.get("input"), dict)
                        and isinstance(sc.get("expected"), dict)):
                    raise ValueError(f"{path.name} line {lineno}: not a scenario (an object with \"input\" and "
                                     f"\"expected\" objects; see FORMAT.md)")
                yield sc
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path.name} line {lineno + 1}: unreadable ({type(e).__name__}: {e})") from None


def _expand(tokens, blocks) -> List[int]:
    out: List[int] = []
    for t in tokens:
        if isinstance(t, str):
            if not t.startswith("@"):
                raise ValueError(f"bad token reference {t!r}")
            k = t[1:]
            out.extend(blocks[k] if isinstance(blocks, dict) else blocks[int(k)])
        else:
            out.append(t)
    return out


def scenario_config(cfg: dict) -> SchedulerConfig:
    """The SchedulerConfig a scenario's `config` object describes (FORMAT.md section 2)."""
    return SchedulerConfig(
        schedule_policy=cfg["policy"],
        page_size=cfg["page_size"],
        max_prefill_tokens=cfg["max_prefill_tokens"],
        chunked_prefill_size=cfg["chunked_prefill_size"],
        max_running_requests=cfg["max_running_requests"],
        enable_priority_scheduling=cfg["enable_priority_scheduling"],
        schedule_low_priority_values_first=cfg["schedule_low_priority_values_first"],
        priority_scheduling_preemption_threshold=cfg["priority_preemption_threshold"],
        enable_priority_preemption=cfg["enable_priority_preemption"],
        clip_max_new_tokens=FIXED_CLIP,
        in_batch_prefix_caching_check_threshold=FIXED_IN_BATCH,
        in_batch_prefix_caching_deprioritize_threshold=FIXED_IN_BATCH,
        lpm_fallback_queue_len=128 if cfg["lpm_fallback"] else None,
        enable_mixed_chunk=cfg["enable_mixed_chunk"],
        prefill_max_requests=cfg["prefill_max_requests"],
        truncation_align_size=cfg["truncation_align_size"],
        disable_radix_cache=cfg["disable_radix_cache"],
        random_seed=cfg.get("random_seed") or 0,
    )


def _request(d: dict, blocks, output: Optional[List[int]] = None) -> Request:
    return Request(
        rid=d["rid"],
        prompt_ids=_expand(d["prompt"], blocks),
        max_new_tokens=d["max_new_tokens"],
        output_ids=output if output is not None else _expand(d.get("output", []), blocks),
        ignore_eos=d.get("ignore_eos", False),
        priority=d.get("priority"),
        routing_key=d.get("routing_key"),
        extra_key=d.get("extra_key"),
        return_logprob=d.get("return_logprob", False),
        logprob_start_len=d.get("logprob_start_len", -1),
        enqueue_time=d["enqueue_time"],
    )


def build(scenario: dict, make_scheduler: Callable):
    """Build the scheduler state of a scenario exactly as FORMAT.md section 3 says.

    `make_scheduler(config, kv_pool_size, shuffle)` returns a scheduler. Returns
    (scheduler, start sizes dict)."""
    inp = scenario["input"]
    exp = scenario.get("expected", {})
    blocks = inp.get("blocks") or {}
    cfg = scenario_config(inp["config"])
    perm_rids = exp.get("random_permutation")
    waiting_rids = [w["rid"] for w in inp["waiting"]]
    shuffle = None
    if perm_rids is not None:
        pos = {rid: i for i, rid in enumerate(waiting_rids)}
        perm = [pos[r] for r in perm_rids]
        shuffle = lambda n: perm  # noqa: E731 - inject the recorded permutation (FORMAT.md 4)
    sched = make_scheduler(cfg, inp["kv_pool_size"], shuffle)
    for entry in inp.get("cache") or []:
        sched.seed_cache(_expand(entry["tokens"], blocks), entry.get("extra_key"))
    for d in inp.get("running") or []:
        sched.seed_running(_request(d, blocks, output=[0] * d.get("output_len", 0)))
    if inp.get("chunked"):
        d = inp["chunked"]
        sched.seed_chunked(_request(d, blocks), d["done"])
    sched.submit([_request(d, blocks) for d in inp["waiting"]])
    sched.batch_is_full = inp["config"]["running_batch_is_full"]
    start = {"available": sched.available, "evictable": sched.evictable, "protected": sched.protected}
    return sched, start


def _bits(x) -> Optional[bytes]:
    return None if x is None else struct.pack("<d", float(x))


def _budgets_equal(mine: Optional[dict], want: Optional[dict]) -> Optional[str]:
    if want is None or mine is None:
        return None if want == mine else f"{mine} != {want}"
    for k in ("rem_total", "cur_rem", "rem_input", "rem_chunk"):
        a, b = mine.get(k), want.get(k)
        if k in ("rem_total", "cur_rem"):
            if _bits(a) != _bits(b):
                return f"{k}: {a!r} != {b!r}"
        elif a != b:
            return f"{k}: {a!r} != {b!r}"
    return None


def result_fields(plan, start: dict) -> dict:
    """The plan as FORMAT.md's `expected` fields."""
    return {
        "ordered": plan.ordered,
        "queue_order": None if plan.active_policy == "random" else list(plan.queue_order),
        "active_policy": plan.active_policy,
        "num_matched": None if plan.num_matched is None else list(plan.num_matched),
        "deprioritized": None if plan.deprioritized is None else list(plan.deprioritized),
        "admitted": [list(a) for a in plan.admitted],
        "new_chunked_rid": plan.new_chunked_rid,
        "chunked_rid_after": plan.chunked_rid_after,
        "preempted": list(plan.preempted),
        "batch_is_full": plan.batch_is_full,
        "stop": plan.stop,
        "evictable": plan.evictable,
        "protected": plan.protected,
        "available": plan.available,
        "preempt_evicted_tokens": plan.preempt_evicted_tokens,
        "budgets": plan.budgets,
        "budgets_start": plan.budgets_start,
        "log_hit_tokens": plan.log_hit_tokens,
        "log_input_tokens": plan.log_input_tokens,
        "start": start,
    }


def compare(mine: dict, expected: dict) -> Optional[str]:
    """First differing field as `field: mine != expected`, or None. An `expected` with no
    field to compare fails (FORMAT.md would pass it: nothing differs, but nothing was checked)."""
    if not any(k != "random_permutation" for k in expected):
        return "expected holds no field to compare"
    for key, want in expected.items():
        if key == "random_permutation":
            continue
        if key not in mine:
            return f"{key}: not produced"
        got = mine[key]
        if key in ("budgets", "budgets_start"):
            diff = _budgets_equal(got, want)
            if diff:
                return f"{key}.{diff}"
        elif got != want:
            return f"{key}: {got!r} != {want!r}"
    return None


@dataclass
class Outcome:
    id: str
    error: Optional[str]


def run_scenario(scenario: dict, make_scheduler: Callable) -> Outcome:
    sid = scenario.get("id", "?")
    try:
        sched, start = build(scenario, make_scheduler)
        ratio = scenario["input"]["config"]["new_token_ratio"]
        plan = sched.step(ratio)
        return Outcome(sid, compare(result_fields(plan, start), scenario["expected"]))
    except Exception as e:  # a crash is a failure of that scenario, reported with its type
        return Outcome(sid, f"raised {type(e).__name__}: {e}")


def run_file(path, make_scheduler: Callable, echo=print) -> Tuple[int, int]:
    """Run every scenario; print each failure's first differing field and a last line
    `N passed, M failed`. Returns (passed, failed)."""
    passed = failed = 0
    for sc in read_scenarios(path):
        out = run_scenario(sc, make_scheduler)
        if out.error is None:
            passed += 1
        else:
            failed += 1
            echo(f"FAIL {out.id}: {out.error}")
    echo(f"{passed} passed, {failed} failed")
    return passed, failed
