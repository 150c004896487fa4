"""Discrete-event serving simulator: a trace, a scheduler and a step-cost model.

How a replay works (read this first):
  * Requests arrive by their trace timestamps: request `i` of the trace becomes
    `Request(rid=f"r{i}", prompt=TraceRequest.prompt_ids(), max_new_tokens=max(output_len, 1),
    enqueue_time=arrival)` and is submitted when simulated time reaches its arrival. When
    nothing is running or waiting the clock jumps to the next arrival (an "idle" step). So by
    default each request's max_new_tokens is exactly what it will generate: lof orders by
    the true output length and the KV budgets reserve exactly the tokens each request will
    need, which no engine knows in advance. `replay(max_new_tokens=N)` gives every request
    max_new_tokens N instead, as clients that leave max_tokens at a default: it still stops at
    its trace output length (as at an EOS), cut at N.
  * Each iteration is one engine step, as in SGLang's event loop: `plan = sched.step(ratio,
    now=t)` (its wall-clock time is the scheduler's own time per step). If the plan admitted
    requests, the engine runs a prefill step and calls `complete_prefill`; requests whose extend
    range reaches the end of their fill get their next output token. Otherwise, if requests are
    running, it runs a decode step: `decode_fits()` or else `retract_decode()` (R-DEC-2), then
    `decode(tokens)`. Requests that reach their planned output length finish (R-DEC-3); a
    request with one output token finishes right after its prefill.
  * With `enable_mixed_chunk` (and chunked prefill on) the running requests also decode one
    token inside each prefill step, as SGLang mixes them in; the scheduler's budgets already
    reserve those tokens (R-ADM `mixed`).
  * The new-token ratio follows R-DEC-1 (`NewTokenRatio`); "idle" (back to init) is an iteration
    that runs no batch: nothing running and nothing admitted (empty queue, or a queue that must
    wait for the next arrival), as in SGLang's event loop.
  * Simulated step time comes from a `CostModel`: fixed + per prefill token + per decode
    request + per KV token read. Generated tokens are `output_token_ids(output_key, k, 1)` for
    output position k, so runs are deterministic. The scheduler's own calls take no simulated
    time unless `scheduler_time` says so ("blocking" / "overlap": their real time is charged
    to the clock before each forward, and the run then depends on the machine's speed).
  * Every plan that admitted or preempted something updates a `DecisionDigest`; equal digests
    mean equal scheduling decisions (to compare runs and backends).

`replay()` is the entry point; `make_scheduler(config, kv_pool_size)` builds any scheduler with
the `ReferenceScheduler` API (submit/step/complete_prefill/decode_fits/retract_decode/decode/
finish/check_integrity, property kv_used).
"""

from __future__ import annotations

import copy
import math
import numbers
import sys
import time
from dataclasses import KW_ONLY, dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

from ..config import SchedulerConfig
from ..plan import DecisionDigest
from ..ratio import NewTokenRatio
from ..request import Request
from .metrics import RequestRecord, StepRecord, summarize
from .traces import BLOCK_TOKENS, MAX_TRACE_TOKENS, Trace, output_token_ids

__all__ = ["CostModel", "COST_MODELS", "DEFAULT_COST_MODEL", "get_cost_model", "NewTokenRatio",
           "SimulationError", "replay"]


class SimulationError(RuntimeError):
    """The replay cannot go on: an integrity violation (`check=True`), a request that can never
    be admitted, or a request that outgrows the KV pool. The message names step, time, request."""


# ---- cost model ---------------------------------------------------------------------------
COST_FIELDS = ("fixed_s", "prefill_token_s", "decode_request_s", "kv_token_s")
#: the largest cost a CostModel field may give [s] (per step or per token): an hour keeps every
#: simulated clock finite
MAX_COST_S = 3600.0


@dataclass(frozen=True)
class CostModel:
    """Simulated duration of one engine step (all times in seconds).

    prefill step = fixed_s + prefill_token_s * extend tokens + kv_token_s * cached prefix tokens
                   of the batch (extend_start summed: KV the prefill attention reads back)
    decode step  = fixed_s + decode_request_s * batch size + kv_token_s * KV tokens of the
                   running requests (their fill lengths: what decode attention reads)
    mixed step   = the prefill step + decode_request_s * batch + kv_token_s * their KV tokens.

    The four costs are keyword arguments (seconds, in [0, 3600]; ValueError otherwise); `name`
    and `description` label the run's summary and default to "custom" and "".
    """

    name: str = "custom"
    description: str = ""
    _: KW_ONLY
    fixed_s: float
    prefill_token_s: float
    decode_request_s: float
    kv_token_s: float

    def __post_init__(self) -> None:
        for k in ("name", "description"):
            if not isinstance(getattr(self, k), str):
                raise TypeError(f"CostModel {k} must be a str, got {getattr(self, k)!r}")
        for k in COST_FIELDS:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v <= MAX_COST_S):
                raise ValueError(f"CostModel {k} must be a number of seconds in [0, {MAX_COST_S:g}], got {v!r}")
            object.__setattr__(self, k, float(v))

    def prefill_s(self, extend_tokens: int, cached_tokens: int) -> float:
        return self.fixed_s + self.prefill_token_s * extend_tokens + self.kv_token_s * cached_tokens

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        return self.fixed_s + self.decode_request_s * batch + self.kv_token_s * kv_tokens


COST_MODELS: Dict[str, CostModel] = {
    "llama3-8b-h200": CostModel(
        name="llama3-8b-h200",
        description="Llama-3-8B, BF16, one H200 (141 GB HBM3e, ~4.8 TB/s)",
        fixed_s=4.0e-3,  # weights (16 GB) read once per step + launch overhead
        prefill_token_s=25e-6,  # ~16 GFLOP/token at ~650 TFLOP/s effective: ~40k prefill tok/s
        decode_request_s=20e-6,  # marginal GEMM/sampling cost per decoding request
        kv_token_s=33e-9,  # 128 KiB KV per token (32 layers x 8 KV heads x 128 x K,V x 2 B) at ~4 TB/s
    ),
    "qwen2.5-7b-a100": CostModel(
        name="qwen2.5-7b-a100",
        description="Qwen2.5-7B-Instruct, BF16, one A100-80GB (~2.0 TB/s)",
        fixed_s=8.5e-3,  # weights (15 GB) read once per step + launch overhead
        prefill_token_s=65e-6,  # ~15 GFLOP/token at ~230 TFLOP/s effective: ~15k prefill tok/s
        decode_request_s=40e-6,
        kv_token_s=36e-9,  # 56 KiB KV per token (28 layers x 4 KV heads x 128 x K,V x 2 B) at ~1.6 TB/s
    ),
}
"""Step-cost presets by name (`--cost-model`).

The numbers are rough engineering estimates from public peak figures (FLOP/s, memory bandwidth,
model size) with round efficiency factors, NOT measurements of any engine: use them to compare
scheduling policies under a plausible load, not to predict an engine's latency. The linear
model ignores attention's growth with context length in prefill and the memory-bound flat
region of small decode batches.
"""

DEFAULT_COST_MODEL = "llama3-8b-h200"


def get_cost_model(model: Union[str, CostModel]) -> CostModel:
    """A `CostModel` by preset name, from a JSON file (a path ending in .json holding the
    fields `fixed_s`, `prefill_token_s`, `decode_request_s`, `kv_token_s` in seconds, and
    optionally `name` and `description`), or the model itself. ValueError naming the choices
    or the bad field; FileNotFoundError for a missing file."""
    if isinstance(model, CostModel):
        return model
    if isinstance(model, str) and model.endswith(".json"):
        return _cost_model_file(model)
    if model not in COST_MODELS:
        raise ValueError(f"unknown cost model {model!r}; choose from {', '.join(COST_MODELS)} "
                         f"or give a .json file of CostModel's fields")
    return COST_MODELS[model]


def _cost_model_file(path: str) -> CostModel:
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"cost model file not found: {path}")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"cost model file {path}: not JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"cost model file {path}: not UTF-8 text ({e.reason})") from None
    times = COST_FIELDS
    if not isinstance(d, dict):
        raise ValueError(f"cost model file {path}: expected an object with {', '.join(times)}")
    extra = set(d) - set(times) - {"name", "description"}
    missing = [k for k in times if k not in d]
    if extra or missing:
        raise ValueError(f"cost model file {path}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(sorted(extra))}"] if extra else [])))
    try:
        return CostModel(name=str(d.get("name", p.stem)), description=str(d.get("description", f"from {path}")),
                         **{k: d[k] for k in times})
    except ValueError as e:
        raise ValueError(f"cost model file {path}: {e}") from None


# ---- the simulator ------------------------------------------------------------------------
def _progress_bar(enabled: bool, total: float, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=round(total, 1), unit="s", desc=desc, file=sys.stderr, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} sim s [{elapsed}<{remaining}{postfix}]")


#: the scheduler calls an engine makes besides `step()` (which the replay times per step)
ENGINE_CALLS = ("submit", "complete_prefill", "decode_fits", "retract_decode", "decode", "finish")

#: how a replay charges the scheduler's real time to its simulated clock (`replay`'s
#: `scheduler_time`): not at all, every call in turn with the forward, or only where the calls
#: outlast the previous forward they overlap
SCHEDULER_TIME_MODES = ("free", "blocking", "overlap")


class _TimedCalls:
    """The scheduler as the replay calls it: each `ENGINE_CALLS` method adds its real time to
    `seconds[name]` and 1 to `counts[name]` (calls the scheduler makes on itself are not
    counted); `step` and every other attribute are the scheduler's own (reads and writes go
    to it). A copy wraps the same scheduler (a deep copy: a deep copy of it), with the
    counts so far."""

    _OWN = frozenset(("_sched", "_clock", "seconds", "counts", "step") + ENGINE_CALLS)

    def __init__(self, sched, clock: Callable[[], float] = time.perf_counter):
        own = self.__dict__
        own["_sched"] = sched
        own["_clock"] = clock
        own["seconds"] = dict.fromkeys(ENGINE_CALLS, 0.0)
        own["counts"] = dict.fromkeys(ENGINE_CALLS, 0)
        own["step"] = sched.step  # looked up once: not inside the step's own timing
        for name in ENGINE_CALLS:
            f = getattr(sched, name, None)  # one it lacks fails when called, as without the timing
            if f is not None:
                own[name] = self._timed(name, f)

    def _timed(self, name: str, f):
        perf, seconds, counts = self._clock, self.seconds, self.counts

        def call(*args, **kwargs):
            t0 = perf()
            try:
                return f(*args, **kwargs)
            finally:
                seconds[name] += perf() - t0
                counts[name] += 1
        return call

    def _copy_with(self, sched) -> "_TimedCalls":
        new = _TimedCalls(sched, self._clock)
        new.seconds.update(self.seconds)
        new.counts.update(self.counts)
        return new

    def __copy__(self) -> "_TimedCalls":
        return self._copy_with(self._sched)

    def __deepcopy__(self, memo) -> "_TimedCalls":
        return self._copy_with(copy.deepcopy(self._sched, memo))

    def __getattr__(self, name: str):
        if name.startswith("__") or name in _TimedCalls._OWN:  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self._sched, name)

    def __setattr__(self, name: str, value) -> None:
        if name in _TimedCalls._OWN:
            raise AttributeError(f"{name} is the timing wrapper's own")
        setattr(self._sched, name, value)


class _Replay:
    """One replay's state. Per-request arrays are indexed by trace position i (rid f"r{i}")."""

    def __init__(self, trace: Trace, config: SchedulerConfig, kv_tokens: int, make_scheduler,
                 cost: CostModel, check: bool, progress: bool, scheduler_time: str = "free",
                 clock: Callable[[], float] = time.perf_counter, max_new_tokens: Optional[int] = None):
        self.trace = trace
        self.config = config
        self.kv_tokens = kv_tokens
        self.cost = cost
        self.check = check
        self.progress = progress
        self.clock = clock
        self.sched = _TimedCalls(make_scheduler(config, kv_tokens), clock)
        reqs = trace.requests
        n = len(reqs)
        self.rids = [f"r{i}" for i in range(n)]
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        self.target = [max(int(r.output_len), 1) for r in reqs]  # output tokens it generates
        if max_new_tokens is not None:  # one cap for all (a client default): outputs past it are cut there
            self.target = [min(t, max_new_tokens) for t in self.target]
        self.max_new = self.target if max_new_tokens is None else [max_new_tokens] * n
        self.wait_from: List[Optional[float]] = [None] * n  # start of the current wait in the queue
        self.prompt_len = [int(r.input_len) for r in reqs]
        self.gen = [0] * n  # output tokens generated so far
        self.tokens: List[Optional[list]] = [None] * n  # planned output tokens, made on first use
        self.admitted_once = [False] * n
        self.records = [RequestRecord(rid=self.rids[i], arrival_s=float(r.arrival_s), input_len=int(r.input_len),
                                      output_len=0, cached_tokens=0, first_token_s=None, finish_s=None,
                                      priority=r.priority, routing_key=r.routing_key)
                        for i, r in enumerate(reqs)]
        self.steps: List[StepRecord] = []
        self.running: Dict[str, int] = {}  # rid -> i, engine-side view of the running batch
        self.kv_running = 0  # sum of fill lengths of running requests [tokens]
        self.outstanding = 0  # submitted and not finished
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.digest = DecisionDigest()
        self.mixed = bool(config.enable_mixed_chunk and config.chunked_prefill_size is not None)
        self.t = 0.0
        self.sched_wall = 0.0  # real seconds in step(), `step_calls` calls
        self.step_calls = 0
        self.check_wall = 0.0
        self.scheduler_time = scheduler_time
        self.charged = 0.0  # simulated seconds added for the scheduler's calls (`_charge`)
        self._charged_upto = 0.0  # scheduler seconds (`_calls_s`) already charged or absorbed
        self._last_forward = 0.0  # the previous step's forward [simulated s]: what overlap hides

    def _calls_s(self) -> float:
        """Real seconds of every scheduler call so far: `step()` and `ENGINE_CALLS`."""
        return self.sched_wall + sum(self.sched.seconds.values())

    def _absorb(self, gap: float) -> None:
        """An idle gap of `gap` simulated seconds before the next arrival: the scheduler calls
        not yet charged ran in it, up to its length (the rest still delays the next step);
        no forward runs beside the next step's calls."""
        pending = self._calls_s() - self._charged_upto
        self._charged_upto += min(pending, max(gap, 0.0))
        self._last_forward = 0.0

    def _charge(self) -> float:
        """The simulated seconds this step waits for the scheduler, added to the clock before its
        forward: the real time of every scheduler call since the last charge (the previous
        step's results processed, arrivals submitted, this step's `step()`); with "blocking" all
        of it (an engine that schedules, runs the batch and processes its results in turn:
        SGLang's normal event loop), with "overlap" only what outlasts the previous step's
        forward, which it runs beside (SGLang's overlap loop); 0 with "free"."""
        if self.scheduler_time == "free":
            return 0.0
        total = self._calls_s()
        spent, self._charged_upto = total - self._charged_upto, total
        extra = spent if self.scheduler_time == "blocking" else max(0.0, spent - self._last_forward)
        self.t += extra
        self.charged += extra
        return extra

    # ---- per-request helpers ---------------------------------------------------------------
    def _request(self, i: int) -> Request:
        tr = self.trace.requests[i]
        return Request(rid=self.rids[i], prompt_ids=tr.prompt_ids(), max_new_tokens=self.max_new[i],
                       enqueue_time=float(tr.arrival_s), routing_key=tr.routing_key, priority=tr.priority)

    def _next_token(self, i: int) -> int:
        toks = self.tokens[i]
        if toks is None:
            toks = output_token_ids(self.trace.requests[i].output_key, 0, self.target[i]).tolist()
            self.tokens[i] = toks
        return toks[self.gen[i]]

    def _emit(self, i: int, t: float) -> None:
        """Request i produced its next token at time t."""
        self.gen[i] += 1
        rec = self.records[i]
        rec.token_times.append(t)
        if rec.first_token_s is None:
            rec.first_token_s = t

    def _leave_running(self, rid: str) -> int:
        i = self.running.pop(rid)
        self.kv_running -= self.prompt_len[i] + self.gen[i]
        return i

    def _finish_done(self, rids) -> None:
        done = [rid for rid in rids if self.gen[self.running[rid]] >= self.target[self.running[rid]]]
        if not done:
            return
        self.sched.finish(done)
        for rid in done:
            i = self._leave_running(rid)
            rec = self.records[i]
            rec.finish_s = self.t
            rec.output_len = self.gen[i]
            self.tokens[i] = None
            self.outstanding -= 1

    def _fail(self, what: str) -> SimulationError:
        return SimulationError(f"engine step {len(self.steps)} (t={self.t:.3f} s): {what}")

    # ---- step kinds ------------------------------------------------------------------------
    def _decode_running(self) -> Tuple[int, int]:
        """Append one token to every running request; returns (batch, KV tokens read)."""
        batch, kv = len(self.running), self.kv_running
        gen, toks = self.gen, self.tokens
        tokens = {rid: toks[i][gen[i]] for rid, i in self.running.items()}  # made at prefill
        self.sched.decode(tokens)
        return batch, kv

    def _after_decode(self) -> None:
        t = self.t
        for i in self.running.values():
            self._emit(i, t)
        self.kv_running += len(self.running)

    def _prefill(self, plan) -> Tuple[float, int]:
        """Run the plan's prefill (and a mixed decode); (its duration [s], the extend tokens it
        prefilled: the plan's ranges, not its page-rounded input counter)."""
        extend = cached = 0
        first_tokens: Dict[str, int] = {}
        completing: List[str] = []
        for rid, s, e in plan.admitted:
            i = self.index[rid]
            extend += e - s
            cached += s
            if not self.admitted_once[i]:
                self.admitted_once[i] = True
                self.records[i].cached_tokens = s
            if e == self.prompt_len[i] + self.gen[i]:
                first_tokens[rid] = self._next_token(i)
                completing.append(rid)
        duration = self.cost.prefill_s(extend, cached)
        decoded = []
        if self.mixed and self.running and self.sched.decode_fits():
            batch, kv = self._decode_running()
            duration += self.cost.decode_request_s * batch + self.cost.kv_token_s * kv
            decoded = list(self.running)
        self.sched.complete_prefill(first_tokens)
        self.t += duration
        if decoded:
            self._after_decode()
        for rid in completing:
            i = self.index[rid]
            self._emit(i, self.t)
            self.running[rid] = i
            self.kv_running += self.prompt_len[i] + self.gen[i]
        self._finish_done(decoded + completing)
        return duration, extend

    def _decode(self) -> float:
        if self.sched.decode_fits():
            self.ratio.decay()
        else:
            for rid in self.sched.retract_decode():
                i = self._leave_running(rid)
                self.records[i].retractions += 1
                self.wait_from[i] = self.t
            out = sum(self.gen[i] for i in self.running.values())
            max_new = sum(self.max_new[i] for i in self.running.values())
            self.ratio.after_retraction(out, len(self.running), max_new)
            if not self.sched.decode_fits():
                rid = next(iter(self.running))
                i = self.running[rid]
                raise self._fail(f"request {rid} alone ({self.prompt_len[i]} prompt + {self.gen[i]} output tokens) "
                                 f"outgrows the KV pool of {self.kv_tokens} tokens")
        batch, kv = self._decode_running()
        duration = self.cost.decode_s(batch, kv)
        self.t += duration
        self._after_decode()
        self._finish_done(list(self.running))
        return duration

    def _stalled(self, plan, next_arrival: Optional[float]) -> float:
        """Nothing admitted, nothing running: wait for the next arrival or give up. No batch ran,
        so the ratio goes back to init (SGLang resets it on every iteration without a batch)."""
        self.ratio.reset()
        if next_arrival is not None:
            gap = max(next_arrival - self.t, 0.0)
            self.t = max(self.t, next_arrival)  # later only when a charge for the scheduler passed it
            return gap
        waiting = plan.chunked_rid_after or (plan.queue_order[0] if plan.queue_order else None)
        if waiting is None:
            raise self._fail(f"{self.outstanding} requests are neither running nor admitted and none will arrive")
        i = self.index[waiting]
        cfg = self.config
        chunk, P, align = cfg.chunked_prefill_size, cfg.page_size, cfg.truncation_align_size
        if chunk is not None and chunk < P:  # R-ADM-3 step 7 cuts chunks at page boundaries
            why = (f"chunked_prefill_size {chunk} is below page_size {P}, so no prompt fits a chunk "
                   f"(chunks are cut at page boundaries)")
        elif chunk is not None and align is not None and chunk < align:
            why = (f"chunked_prefill_size {chunk} is below truncation_align_size {align}, so a prompt "
                   f"longer than a chunk can never be chunked")
        else:
            why = f"the KV pool holds {self.kv_tokens} tokens"
        raise self._fail(
            f"request {waiting} ({self.prompt_len[i]} prompt + {self.gen[i]} output tokens, max_new_tokens "
            f"{self.max_new[i]}) can never be admitted: nothing is running, no request will arrive, and "
            f"{why} (scheduler stop: {plan.stop})")

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> None:
        reqs = self.trace.requests
        n = len(reqs)
        arrivals = [float(r.arrival_s) for r in reqs]
        sched = self.sched
        nxt = 0
        last_arrival = arrivals[-1] if n else 0.0
        bar = _progress_bar(self.progress, last_arrival, f"replay {self.config.schedule_policy}")
        shown_t, shown_steps = 0.0, 0
        perf = self.clock
        try:
            while True:
                if nxt < n and arrivals[nxt] <= self.t:
                    batch = []
                    while nxt < n and arrivals[nxt] <= self.t:
                        batch.append(self._request(nxt))
                        self.wait_from[nxt] = arrivals[nxt]
                        nxt += 1
                    sched.submit(batch, now=self.t)
                    self.outstanding += len(batch)
                if self.outstanding == 0:
                    self.ratio.reset()
                    if nxt >= n:
                        break
                    gap = arrivals[nxt] - self.t
                    self._absorb(gap)
                    self.t = arrivals[nxt]
                    self.steps.append(StepRecord(self.t, "idle", gap, 0, 0, sched.kv_used, self.kv_tokens, 0, 0, 0.0,
                                                 kv_evictable_tokens=sched.evictable))
                    continue
                t0 = perf()
                t_plan = self.t
                plan = sched.step(self.ratio.value, now=self.t)
                wall = perf() - t0
                self.sched_wall += wall
                self.step_calls += 1
                charged = self._charge()
                if plan.admitted or plan.preempted:
                    self.digest.update(plan)
                for rid in plan.preempted:
                    i = self._leave_running(rid)
                    self.records[i].preemptions += 1
                    self.wait_from[i] = t_plan
                extend = 0  # tokens prefilled by this step
                for rid, _, _ in plan.admitted:  # a wait ends as the forward that prefills it starts
                    i = self.index[rid]
                    if self.wait_from[i] is not None:
                        self.records[i].queued_s += self.t - self.wait_from[i]
                        self.wait_from[i] = None
                if plan.admitted:
                    kind, (duration, extend) = "prefill", self._prefill(plan)
                elif self.running:
                    kind, duration = "decode", self._decode()
                else:
                    kind = "idle"
                    duration = self._stalled(plan, arrivals[nxt] if nxt < n else None)
                self._last_forward = duration if kind != "idle" else 0.0
                if self.check:
                    t1 = perf()
                    try:
                        sched.check_integrity()
                    except AssertionError as e:
                        raise self._fail(f"integrity check failed after a {kind} step: {e}") from None
                    self.check_wall += perf() - t1
                self.steps.append(StepRecord(self.t, kind, duration, len(plan.queue_order), len(self.running),
                                             sched.kv_used, self.kv_tokens, extend, plan.log_hit_tokens, wall,
                                             len(sched.queue), charged, sched.evictable))
                if not self.running and self.outstanding == 0:
                    self.ratio.reset()
                if bar is not None and len(self.steps) - shown_steps >= 200:
                    bar.update(round(min(self.t, last_arrival) - shown_t, 1))
                    shown_t = round(min(self.t, last_arrival), 1)
                    shown_steps = len(self.steps)
                    bar.set_postfix_str(f"done {nxt - self.outstanding}/{n}, run {len(self.running)}, "
                                        f"queue {len(plan.queue_order)}", refresh=False)
        finally:
            if bar is not None:
                bar.update(max(round(min(self.t, last_arrival) - shown_t, 1), 0))
                bar.close()


def _check_requests(trace: Trace) -> None:
    """ValueError/TypeError naming the first trace request the replay cannot run: an arrival
    that is not a finite number (a NaN one would never arrive: the replay would idle forever),
    is negative (the simulated clock starts at 0: its wait would count from before the start)
    or comes before the previous request's (requests are submitted in trace order, so an
    early one listed late would wait for the one before it), or lengths outside
    [1, MAX_TRACE_TOKENS] (prompt) and [0, MAX_TRACE_TOKENS] (output); an index or
    output_key that is not an int in [0, 2^63); hash_ids that are not ceil(input_len / 512)
    ints in [0, 2^63); segments (used without hash_ids) that are not (key in [0, 2^64),
    start >= 0, n >= 0) int triples whose lengths add up to input_len; a routing_key that is
    not a str or None, a priority that is not an int or None. The trace readers check and sort
    their rows; this checks traces built in code, before the replay starts."""
    prev = 0.0
    for i, r in enumerate(trace.requests):
        a = r.arrival_s
        if isinstance(a, bool) or not isinstance(a, numbers.Real) or not math.isfinite(a):
            raise ValueError(f"trace request {i}: arrival_s must be a finite number of seconds, got {a!r}")
        if a < 0:
            raise ValueError(f"trace request {i}: arrival_s must be >= 0 (the replay starts at 0 s), got {a!r}")
        if a < prev:
            raise ValueError(f"trace request {i}: arrival_s {a!r} is before request {i - 1}'s ({prev!r}); "
                             f"sort the requests by arrival (sorted(trace.requests, key=lambda r: r.arrival_s))")
        prev = a
        for name, lo in (("input_len", 1), ("output_len", 0)):
            v = getattr(r, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"trace request {i}: {name} must be an int, got {v!r}")
            if not lo <= v <= MAX_TRACE_TOKENS:
                raise ValueError(f"trace request {i}: {name} must be in [{lo}, {MAX_TRACE_TOKENS}], got {v}")
        for name in ("index", "output_key"):
            _check_trace_int(i, name, getattr(r, name), 2**63)
        if r.hash_ids is not None:
            ids = r.hash_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)):
                raise TypeError(f"trace request {i}: hash_ids must be a tuple of ints or None, got {ids!r}")
            plain = all(type(h) is int for h in ids)  # the readers' form: checked in C-level passes
            if not plain or (ids and (min(ids) < 0 or max(ids) >= 2**63)):
                for h in ids:
                    _check_trace_int(i, "hash_ids item", h, 2**63)
            want = -(-r.input_len // BLOCK_TOKENS)
            if len(ids) != want:
                raise ValueError(f"trace request {i}: hash_ids has {len(ids)} ids, input_len {r.input_len} "
                                 f"needs ceil({r.input_len}/{BLOCK_TOKENS}) = {want}")
        elif r.segments:
            total = 0
            for seg in r.segments:
                if not isinstance(seg, (tuple, list)) or len(seg) != 3:
                    raise TypeError(f"trace request {i}: a segment must be a (key, start, n) triple, got {seg!r}")
                for name, v, hi in zip(("segment key", "segment start", "segment n"), seg, (2**64, 2**63, 2**63)):
                    _check_trace_int(i, name, v, hi)
                total += seg[2]
            if total != r.input_len:
                raise ValueError(f"trace request {i}: its segments hold {total} tokens, input_len is {r.input_len}")
        if r.routing_key is not None and not isinstance(r.routing_key, str):
            raise TypeError(f"trace request {i}: routing_key must be a str or None, got {r.routing_key!r}")
        if r.priority is not None:
            _check_trace_int(i, "priority", r.priority, 2**63, lo=-(2**63))


def _check_trace_int(i: int, name: str, v, hi: int, lo: int = 0) -> None:
    """TypeError / ValueError naming trace request i and the field unless v is an int in [lo, hi)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"trace request {i}: {name} must be an int, got {v!r}")
    if not lo <= v < hi:
        raise ValueError(f"trace request {i}: {name} must be in [{lo}, {hi}), got {v}")


def replay(trace: Trace, config: SchedulerConfig, *, kv_tokens: int,
           make_scheduler: Callable[[SchedulerConfig, int], object],
           cost_model: Union[str, CostModel] = DEFAULT_COST_MODEL, check: bool = False,
           progress: bool = False, scheduler_time: str = "free",
           clock: Callable[[], float] = time.perf_counter,
           max_new_tokens: Optional[int] = None) -> Tuple[dict, List[RequestRecord], List[StepRecord]]:
    """Replay `trace` through `make_scheduler(config, kv_tokens)` and a simulated engine.

    Args:
        trace: requests sorted by arrival (`gpu_sched.sim.traces`).
        config: the scheduler configuration.
        kv_tokens: KV pool size [tokens], >= 1.
        make_scheduler: `(config, kv_pool_size) -> scheduler` with the ReferenceScheduler API.
        cost_model: a `COST_MODELS` name or a `CostModel`.
        check: call `check_integrity()` after every step; the first AssertionError stops the
            replay with a `SimulationError` naming the step and the simulated time.
        progress: show a tqdm bar over simulated time on stderr.
        scheduler_time: what the scheduler's own calls cost in simulated time
            (`SCHEDULER_TIME_MODES`). "free" (the default): nothing, so the replay is
            deterministic and its digest the same on every machine. "blocking": before each
            step's forward the clock moves on by the real seconds of every scheduler call made
            since the previous step's forward (its results processed, arrivals submitted, this
            `step()`), as in an engine that schedules, runs and processes in turn (SGLang's
            normal event loop). "overlap": by what of those seconds outlasts the previous
            step's forward, which they run beside (SGLang's overlap loop, an approximation:
            one step of look-ahead). Calls made while the engine idles are hidden by the idle
            gap up to its length; the rest still delays the next step. Token times are taken at
            the forward's end, so a step's own result processing (`complete_prefill`,
            `finish`) is charged before the next forward, not before its tokens. A backend's
            one-time set-up in its first calls is charged too. With either mode, simulated times
            and so decisions may depend on this machine's speed: the digest may change from run
            to run.
        clock: the real-time clock [seconds] that times the scheduler's calls (default
            `time.perf_counter`; a test gives a fake one to charge known times).
        max_new_tokens: None (the default): each request's max_new_tokens is its trace
            output length (at least 1), so the scheduler knows every output length (lof's key,
            the KV reservation). An int >= 1: every request gets max_new_tokens N and
            generates min(its output length, N) tokens, stopping early as at an EOS.

    Returns:
        (summary, requests, steps): `metrics.summarize` plus "digest" (SHA-256 hex of every
        admitting or preempting plan), "digest_steps", "wall_s", "sched_wall_s" (real seconds in
        `step()`), "sched_calls_s" / "sched_calls_n" (real seconds and counts of `step()` and
        of each `ENGINE_CALLS` method: the scheduler's whole cost to the engine),
        "check_wall_s", "kv_tokens", "cost_model", "policy", "scheduler_time" and
        "charged_sched_s" (simulated seconds added for the scheduler); one `RequestRecord` per trace
        request in trace order (rid f"r{i}"; `output_len` = tokens generated, planned
        max(output_len, 1), cut at max_new_tokens; `cached_tokens` = extend_start of the request's first admission,
        i.e. its prefix-cache hit when first prefilled; later chunks and re-prefills after a
        retraction are not counted); one `StepRecord` per engine step.

    Raises:
        ValueError/TypeError for bad arguments; SimulationError when the replay cannot go on.
    """
    if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int):
        raise TypeError(f"kv_tokens must be an int, got {kv_tokens!r}")
    if kv_tokens < 1:
        raise ValueError(f"kv_tokens must be >= 1, got {kv_tokens}")
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
    if scheduler_time not in SCHEDULER_TIME_MODES:
        raise ValueError(f"scheduler_time must be one of {', '.join(SCHEDULER_TIME_MODES)}, got {scheduler_time!r}")
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
    if max_new_tokens is not None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(f"max_new_tokens must be an int or None, got {max_new_tokens!r}")
        if not 1 <= max_new_tokens <= MAX_TRACE_TOKENS:
            raise ValueError(f"max_new_tokens must be in [1, {MAX_TRACE_TOKENS}], got {max_new_tokens}")
        max_new_tokens = int(max_new_tokens)
    cost = get_cost_model(cost_model)
    _check_requests(trace)
    wall0 = time.perf_counter()
    sim = _Replay(trace, config, kv_tokens, make_scheduler, cost, check, progress, scheduler_time, clock,
                  max_new_tokens)
    sim.run()
    for rec, g in zip(sim.records, sim.gen):
        rec.output_len = g
    summary = summarize(sim.records, sim.steps)
    summary.update({"digest": sim.digest.hexdigest(), "digest_steps": sim.digest.steps,
                    "wall_s": time.perf_counter() - wall0, "sched_wall_s": sim.sched_wall,
                    "sched_calls_s": {"step": sim.sched_wall, **sim.sched.seconds},
                    "sched_calls_n": {"step": sim.step_calls, **sim.sched.counts},
                    "check_wall_s": sim.check_wall if check else None, "kv_tokens": kv_tokens,
                    "cost_model": cost.name, "policy": config.schedule_policy,
                    "scheduler_time": scheduler_time, "charged_sched_s": sim.charged,
                    "max_new_tokens": max_new_tokens})
    return summary, sim.records, sim.steps
