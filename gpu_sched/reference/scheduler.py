"""The reference scheduler: SPEC.md's step (R-STEP-1..4) and decode side (R-DEC-2/3).

How a step works (read this first):
  1. R-STEP-1 early exits: nothing queued, batch marked full, or running at the cap.
  2. Order the queue (R-ORD, `policy.py`), build the budgets (R-ADM, `adder.py`), admit the
     in-flight chunked request first (R-ADM-5).
  3. Walk the new order: stop on OTHER budget; mark the batch full at the request cap; when
     full, try priority preemption (R-ADM-7) or stop; re-match the request with its prefix
     capped (R-STEP-3.4); `add_one_req` (R-ADM-3); stop at the first non-CONTINUE.
  4. Admitted requests leave the queue holding their prefix locks; preempted ones rejoin its
     tail. The engine then runs the prefill and calls `complete_prefill`.

The same calls (`submit`, `step`, `complete_prefill`, `decode`, `retract_decode`, `finish`,
`abort`) are what the device scheduler exposes; tests hold one against the other.
"""

from __future__ import annotations

import collections
import collections.abc
import operator
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np

from ..config import RETRACT_DECODE_STEPS, SchedulerConfig, _check_int
from ..plan import PrefillPlan
from ..request import INT32_MAX, Request, check_real, check_time, check_token_id
from .adder import AddResult, PrefillAdder
from .policy import order_queue
from .radix_cache import KVPool, RadixCache
from .state import ReqState

_RID = operator.attrgetter("rid")



def _distinct(what: str, rids: Iterable[str]) -> List[str]:
    """rids as a list; TypeError unless an iterable other than a single string (a string would
    be taken for its characters), ValueError naming the first rid given twice."""
    if isinstance(rids, (str, bytes)):
        raise TypeError(f"{what} takes an iterable of rids, got the string {rids!r}: pass [{rids!r}]")
    if not isinstance(rids, collections.abc.Iterable):
        raise TypeError(f"{what} takes an iterable of rids, got {type(rids).__name__} {rids!r}")
    rids = list(rids)
    for r in rids:
        if not isinstance(r, collections.abc.Hashable):  # a rid is a dict key
            raise TypeError(f"{what}: a rid must be hashable (a str), got {type(r).__name__} {r!r}")
    if len(set(rids)) != len(rids):
        dup = next(r for r, c in collections.Counter(rids).items() if c > 1)
        raise ValueError(f"{what}: request {dup!r} is given twice")
    return rids


class _SeededShuffle:
    """The `random` policy's default shuffle (R-ORD-6): numpy's generator seeded with
    `config.random_seed`. An object rather than a closure, so that a deep copy or a pickle of
    a scheduler carries its own generator (a copied closure would share the original's)."""

    __slots__ = ("rng",)

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.permutation(n)


def _check_seed_request(where: str, req) -> None:
    """TypeError naming the call unless req is one `Request` (as `submit` checks its items)."""
    if not isinstance(req, Request):
        raise TypeError(f"{where} takes one Request object, got {type(req).__name__}")


class ReferenceScheduler:
    """Sequential oracle of SPEC.md.

    Args:
        config: a `SchedulerConfig`.
        kv_pool_size: KV pool size [tokens], an int in [0, 2^40] (TypeError / ValueError
            naming it otherwise; MemoryError when the host cannot hold its free list).
        shuffle: `shuffle(n) -> permutation of range(n)` for the `random` policy (R-ORD-6);
            default a `numpy` generator seeded with `config.random_seed`. The device
            scheduler's default is a torch generator, so with `random` the two agree only when
            given the same `shuffle` (SPEC R-ORD-6 lets backends differ there).

    Attributes (read them; change them through submit/step/complete_prefill/decode/finish/
    abort/retract_decode):
        queue: the waiting requests (`ReqState`s) in queue order; after a step, the ordered
            queue without the admitted ones (R-STEP-4).
        running: the decoding batch, in batch order.
        prefilling: the last plan's admitted requests, until `complete_prefill`.
        chunked: the request whose prefill is split across steps (R-ADM-5), or None.
        reqs: every held request by rid (queued, prefilling, running or the in-flight chunk).
        A `ReqState` holds the `Request` (`.req`, whose `output_ids` are the tokens decoded so
        far) and the scheduler's view of it (prefix_len, extend range, KV slots).
    """

    def __init__(self, config: SchedulerConfig, kv_pool_size: int,
                 shuffle: Optional[Callable[[int], Sequence[int]]] = None):
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.pool = KVPool(kv_pool_size)
        self.cache = self._make_cache()
        self.shuffle = _SeededShuffle(config.random_seed) if shuffle is None else shuffle
        self.queue: List[ReqState] = []
        self.running: List[ReqState] = []
        self.chunked: Optional[ReqState] = None
        self.prefilling: List[ReqState] = []
        self._prefill_ready = False  # the prefill being run holds its extend slots (`prepare_prefill`)
        self.batch_is_full = False
        self.reqs: Dict[str, ReqState] = {}
        self.now = 0.0

    def _make_cache(self):
        return RadixCache(self.pool, self.config.page_size, disable=self.config.disable_radix_cache)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Free KV slots of the token pool [tokens]: neither cached nor held by a request."""
        return self.pool.available

    @property
    def evictable(self) -> int:
        """Cached tokens no request locks [tokens]: what eviction can free (R-RC-6)."""
        return self.cache.evictable_size

    @property
    def protected(self) -> int:
        """Cached tokens locked by a waiting-for-prefill, chunked or running request [tokens] (R-RC-6)."""
        return self.cache.protected_size

    def flush_cache(self) -> int:
        """Evict every unlocked cached token (R-RC-7's order), as an engine's cache flush
        (SGLang's `flush_cache`); prefixes locked by waiting-for-prefill, chunked or running
        requests stay. Returns the tokens whose slots went back to the free pool."""
        n = self.cache.evictable_size
        if n > 0:
            self.cache.evict(n)
        return n

    @property
    def kv_used(self) -> int:
        """Slots of the token pool in use [tokens]: kv_pool_size - available (cached or held)."""
        return self.pool.size - self.pool.available

    def _state(self, req: Request, now: Optional[float]) -> ReqState:
        prio = req.priority if req.priority is not None else self.config.absent_priority
        t = req.enqueue_time if req.enqueue_time is not None else (self.now if now is None else now)
        return ReqState(req, prio, t)

    def _check_new(self, requests: Iterable[Request]) -> List[Request]:
        if isinstance(requests, Request):
            raise TypeError(f"submit takes an iterable of Request objects, got one Request "
                            f"(rid {requests.rid!r}): pass [request]")
        try:
            requests = list(requests)
        except TypeError:
            raise TypeError(f"submit takes an iterable of Request objects, got {type(requests).__name__}") from None
        seen = set()
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"submit takes Request objects, got {type(r).__name__} {r!r:.60} at position {i}")
            r.validate()
            if r.rid in seen:
                raise ValueError(f"submit: rid {r.rid!r} is given twice in this call")
            if r.rid in self.reqs:
                raise ValueError(f"rid {r.rid!r} is already known to the scheduler")
            seen.add(r.rid)
        return requests

    # ---- engine API ------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request], now: Optional[float] = None) -> None:
        """Append requests to the waiting queue tail (validated first: all or nothing).

        Sizes are not checked against the KV pool: as in SGLang, a request whose prompt plus
        reservation never fits is never admitted (steps stop at it with `add_no_token`), and
        under fcfs it holds back the requests behind it; the engine rejects such prompts up
        front (SGLang's max_req_input_len). Outside R-ADM-6's path (ignore_eos with the cache
        disabled) that is every request with `len(fill) + min(max(max_new_tokens - len(output),
        0), clip_max_new_tokens) + page_size >= kv_pool_size` [tokens]: R-ADM-3 step 4 refuses
        `total >= rem_total`, an exact fit included, and rem_total never exceeds the pool
        (chunking does not help: the check counts the whole extend).

        Raises TypeError/ValueError naming the field (bad record, duplicate rid)."""
        requests = self._check_new(requests)
        if now is not None:
            self.now = max(self.now, check_time("submit: now", now))
        for r in requests:
            st = self._state(r, now)
            self.reqs[r.rid] = st
            self.queue.append(st)

    def step(self, new_token_ratio: float, now: Optional[float] = None) -> PrefillPlan:
        """One scheduling step (R-STEP-1..4): order the waiting queue (R-ORD), admit requests
        under the KV-cache and prefill budgets (R-ADM), lock their cached prefixes and return
        the plan; the admitted requests then wait for `complete_prefill`.

        Args:
            new_token_ratio: the engine's current new-token ratio (R-DEC-1), in (0, 1]: the
                share of each running request's remaining `max_new_tokens` reserved in the
                KV budget.
            now: the engine clock [seconds], optional; stamps later submissions.
        Returns: a `PrefillPlan` (admitted rids with extend ranges [token positions], the new
            chunked request, preempted rids, stop reason, budgets, hit/input counters).
        Raises: RuntimeError when the previous plan was not completed; TypeError/ValueError
            for a ratio that is not a number in (0, 1] or a time that is not finite (nothing
            changes)."""
        if self.prefilling:
            rids = [r.rid for r in self.prefilling]
            raise RuntimeError(f"step() called before complete_prefill() of the previous plan (its prefill: "
                               f"{len(rids)} request(s), {rids[:5]}{' ...' if len(rids) > 5 else ''})")
        ratio = check_real("new_token_ratio", new_token_ratio, "a number in (0, 1]")
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"new_token_ratio must be in (0, 1], got {new_token_ratio}")
        now_before, full_before = self.now, self.batch_is_full
        if now is not None:
            self.now = max(self.now, check_time("step: now", now))
        cfg = self.config
        plan = PrefillPlan()  # queue_order: the queue as it is, or as ordered (R-STEP-2)
        # R-STEP-1
        if cfg.enable_priority_preemption or not self.running:
            self.batch_is_full = False
        if (not self.queue or self.batch_is_full) and self.chunked is None:
            plan.stop = "no_prefill_full" if self.batch_is_full else "no_prefill_empty"
            plan.queue_order = self._rid_list(self.queue)
            return self._close(plan)
        cap = cfg.max_running_requests
        if (cap is not None and len(self.running) >= cap and self.chunked is None
                and not cfg.enable_priority_preemption):
            self.batch_is_full = True
            plan.stop = "no_prefill_max_running"
            plan.queue_order = self._rid_list(self.queue)
            return self._close(plan)
        # R-STEP-2
        try:
            order = self._order()
        except BaseException:  # a custom shuffle (R-ORD-6) refused: the step changed nothing
            self.now, self.batch_is_full = now_before, full_before
            raise
        plan.ordered = True
        plan.active_policy = order.active_policy
        plan.queue_order = self._rid_list(order.queue)
        if order.num_matched is not None:
            plan.num_matched = order.num_matched
            plan.deprioritized = order.deprioritized
        mixed = len(self.running) if cfg.enable_mixed_chunk and cfg.chunked_prefill_size is not None else 0
        adder = PrefillAdder(cfg, self.cache, self.pool, self.running, ratio, mixed)
        plan.budgets_start = adder.budgets()
        chunk_left = None
        if self.chunked is not None:
            if adder.add_chunked_req(self.chunked):
                chunk_left = self.chunked
        # R-STEP-3
        batch_at_start = list(self.running)
        plan.stop = self._admission_loop(order.queue, adder)
        # R-STEP-4
        self.queue = self._unadmitted(order.queue, adder.can_run)
        victims = adder.preempted_in_batch_order(batch_at_start)
        for v in victims:
            self._requeue(v)
        plan.admitted = [(r.rid, r.extend_start, r.extend_end) for r in adder.can_run]
        plan.preempted = [v.rid for v in victims]
        if adder.new_chunked is not None:
            plan.new_chunked_rid = adder.new_chunked.rid
            self.chunked = adder.new_chunked
        elif chunk_left is None and self.chunked is not None and adder.can_run and adder.can_run[0] is self.chunked:
            self.chunked = None  # its last chunk runs now
        plan.chunked_rid_after = self.chunked.rid if self.chunked is not None else None
        plan.budgets = adder.budgets()
        plan.log_hit_tokens = adder.log_hit_tokens
        plan.log_input_tokens = adder.log_input_tokens
        plan.preempt_evicted_tokens = adder.preempt_evicted_tokens
        self.prefilling = list(adder.can_run)
        self._prefill_ready = False
        return self._close(plan)

    def _remove_queued(self, r: ReqState) -> None:
        """Take r out of the waiting queue (if there)."""
        self.queue = [x for x in self.queue if x is not r]

    def _rid_list(self, queue: Sequence[ReqState]) -> List[str]:
        """The rids of `queue` in order (the plan's queue_order)."""
        return list(map(_RID, queue))

    def _unadmitted(self, queue: List[ReqState], can_run: List[ReqState]) -> List[ReqState]:
        """R-STEP-4: the ordered queue without the requests admitted this step."""
        admitted = {id(r) for r in can_run}
        return [r for r in queue if id(r) not in admitted] if admitted else list(queue)

    def _order(self):
        """R-STEP-2 ordering (R-ORD); device schedulers override it."""
        return order_queue(self.queue, self.config, self.cache, self.running, self.shuffle)

    def _admission_loop(self, queue: List[ReqState], adder: PrefillAdder) -> str:
        """R-STEP-3 over the ordered queue; returns the stop reason. Device schedulers
        override it with a parallel scan that calls `_admit_one` only at events."""
        running_bs = len(self.running)  # SGLang reads the batch size once, before the loop
        for r in queue:
            stop = self._admit_one(r, adder, running_bs)
            if stop is not None:
                return stop
        return "queue_end"

    def _admit_one(self, r: ReqState, adder: PrefillAdder, running_bs: int) -> Optional[str]:
        """One iteration of R-STEP-3 for request r; returns a stop reason or None."""
        cfg = self.config
        cap = cfg.max_running_requests
        if adder.budget_state() is AddResult.OTHER:
            return "budget_other"
        if cap is not None and running_bs + len(adder.can_run) >= cap:
            self.batch_is_full = True
        if self.batch_is_full:
            if not cfg.enable_priority_preemption:
                return "batch_full"
            self._rematch(r)  # D5: the need uses the re-matched extend length
            if not self._preempt(r, adder):
                return "batch_full"
        return self._rematch_and_add(r, adder)

    def _preempt(self, r: ReqState, adder: PrefillAdder) -> bool:
        """R-ADM-7 for r, which found the batch full: victims chosen, released and requeued;
        False, nothing changed, when none make room. Device schedulers choose them on the
        device."""
        return adder.preempt_for(r, self._release)

    def _rematch_and_add(self, r: ReqState, adder: PrefillAdder) -> Optional[str]:
        """The end of R-STEP-3 for one request: re-match (D5), add_one_req, and the stop reason
        it gives (None: go on)."""
        self._rematch(r)
        res = adder.add_one_req(r)
        if res is AddResult.CONTINUE:
            return None
        if res is AddResult.NO_TOKEN:
            self.batch_is_full = bool(adder.can_run or self.running)
            return "add_no_token"
        return "add_other"

    def _close(self, plan: PrefillPlan) -> PrefillPlan:
        plan.batch_is_full = self.batch_is_full
        plan.available = self.pool.available
        plan.evictable, plan.protected = self.cache.sizes()  # one read of both (on a GPU tree, one sync)
        return plan

    def _rematch(self, r: ReqState) -> None:
        """R-STEP-3.4: match fill[:max_prefix_len]."""
        r.prefix_len, r.last_node = self.cache.match_prefix(r.fill()[: r.max_prefix_len()], r.req.extra_key)

    def _drop_kv(self, r: ReqState) -> None:
        """Free a request's private slots and its prefix lock; nothing enters the cache."""
        self.pool.free(r.private_slots())
        if r.lock_node is not None:
            self.cache.dec_lock_ref(r.lock_node)
        r.lock_node = r.last_node = None
        r.kv_len = r.cached_len = r.prefix_len = 0
        r.decode_ready = False

    def _evict_shortfall(self, remaining: int) -> int:
        need = remaining * RETRACT_DECODE_STEPS - self.pool.available
        if need <= 0:
            return 0
        return self.cache.evict_tokens(need)

    def _release(self, r: ReqState, remaining: int) -> int:
        self._drop_kv(r)
        return self._evict_shortfall(remaining)

    def _requeue(self, r: ReqState) -> None:
        r.retracted = True
        r.enqueue_time = self.now
        self.queue.append(r)

    def _alloc(self, n: int) -> np.ndarray:
        """Allocate n slots, evicting the cache first when the pool is short."""
        if n > self.pool.available:
            self.cache.evict(n - self.pool.available)
        return self.pool.alloc(n)

    def prepare_prefill(self) -> Dict[str, np.ndarray]:
        """Give the prefill being run (the last plan's admitted requests) the KV slots of its
        extend ranges, before the engine's forward pass writes them, as SGLang allocates a
        batch's extend KV before running it. Returns rid -> the request's KV slots over its
        fill so far: int64 [extend_end], the cached prefix's slots (positions below
        extend_start, reused) then the new ones (extend_start .. extend_end - 1, where the
        forward writes). Calling it again returns the same slots; `complete_prefill` calls it
        when the engine did not, so calling it right before `complete_prefill` (no scheduler
        call between) changes no decision and no slot. Calls between the two see the slots
        taken, as SGLang's scheduler does once a batch is prepared: a short pool is evicted
        here rather than there, seeding finds fewer free slots. The chunked request's prefilled
        part enters the cache only in `complete_prefill` (R-DEC-3), after the forward, so these
        slots stay the request's own until then.

        Returns {} when no prefill is being run (a step that admitted nothing). Raises (before
        changing anything) MemoryError when the extend ranges need more KV slots than are free
        and evictable (`complete_prefill` says what to do)."""
        self._prefill_slots()
        return {r.rid: r.kv[: r.kv_len].copy() for r in self.prefilling}

    def _prefill_slots(self) -> None:
        """`prepare_prefill`'s allocation (once per plan), without its copies of the slots."""
        if self.prefilling and not getattr(self, "_prefill_ready", False):
            # every extend range's slots at once, or nothing
            need = sum(r.extend_end - r.extend_start for r in self.prefilling)
            evictable = self.cache.evictable_size if need > self.pool.available else 0  # a device read: only when needed
            if need > self.pool.available + evictable:
                raise MemoryError(f"prepare_prefill / complete_prefill: the prefill needs {need} KV slots, "
                                  f"{self.pool.available} free and {evictable} evictable; finish() or abort() "
                                  f"running requests and call again, or abort() requests of this prefill "
                                  f"(retract_decode() frees slots only while the next decode step does not fit)")
            for r in self.prefilling:
                if r.kv_len == 0 and r.extend_start > 0 or r.lock_node is not None and r.cached_len == 0 and r.kv_len == 0:
                    # fresh admission: its cached prefix is the locked path
                    vals = self.cache.path_values(r.lock_node)
                    r.reserve_kv(r.fill_len)
                    r.kv[: len(vals)] = vals
                    r.kv_len = r.cached_len = len(vals)
                if r.kv_len != r.extend_start:
                    raise RuntimeError(f"request {r.rid!r}: KV covers {r.kv_len} tokens, extend starts at {r.extend_start}")
                n = r.extend_end - r.extend_start
                r.reserve_kv(r.extend_end)
                r.kv[r.kv_len : r.kv_len + n] = self._alloc(n)
                r.kv_len += n
            self._prefill_ready = True

    def complete_prefill(self, first_tokens: Mapping[str, int]) -> None:
        """The engine ran the last plan's prefill: allocate KV for the extend ranges (unless
        `prepare_prefill` did), cache the chunked request's prefilled part (R-DEC-3) and move
        finished prefills into the running batch with their first output token from
        `first_tokens[rid]` (a token given for the chunked request, whose prefill is not
        done, is ignored). After it, `reqs[rid].kv[:kv_len]` are a request's KV slots; for
        the chunked request a prefix another request cached meanwhile replaces its own slots
        there (the same tokens' KV: its own are freed).

        Raises (before changing anything) ValueError for a request that finished its prefill
        without a token, for rids that are not in the plan being run, or for a token id outside
        [0, 2^31-1] (the chunked request's too); TypeError for a token that is not an int;
        MemoryError when the extend ranges need more KV slots than are free and evictable
        (decode() between step() and here, or R-ADM-5's in-flight chunk, which is admitted
        whatever the budget, may have used them): free some (finish() or abort() running
        requests; retract_decode() frees slots only while the next decode step does not fit)
        and call again, or abort() requests of this prefill."""
        if not isinstance(first_tokens, Mapping):
            raise TypeError(f"complete_prefill takes a mapping rid -> first token, got {type(first_tokens).__name__}")
        in_prefill = {r.rid for r in self.prefilling}
        extra = [rid for rid in first_tokens if rid not in in_prefill]
        if extra:
            if not self.prefilling:
                raise ValueError(f"complete_prefill: no prefill is being run (call step() first), "
                                 f"got tokens for {extra[:5]}")
            raise ValueError(f"complete_prefill: requests {extra[:5]} are not in the prefill being run")
        for r in self.prefilling:
            if r.extend_end == r.fill_len and r.rid not in first_tokens:
                raise ValueError(f"complete_prefill: first_tokens has no token for request {r.rid!r}")
        for rid, t in first_tokens.items():
            check_token_id(f"first_tokens[{rid!r}]", t)
        self._prefill_slots()  # the slots first (MemoryError: nothing changed), as SGLang's batch
        for r in self.prefilling:
            if r is self.chunked:
                self._cache_unfinished(r)
            else:
                r.prefix_len = r.kv_len
                r.req.output_ids.append(int(first_tokens[r.rid]))
                self.running.append(r)
        self.prefilling = []
        self._prefill_ready = False

    def _cache_unfinished(self, r: ReqState) -> None:
        """R-DEC-3 for a chunk: insert the prefilled part, move the lock to the new last node."""
        fill = r.fill()[: r.kv_len]
        present, m, node = self.cache.insert_and_match(fill, r.kv[: r.kv_len], r.req.extra_key,
                                                       r.cached_len, r.lock_node)  # the locked prefix
        if present > r.cached_len:
            self.pool.free(r.kv[r.cached_len : present].copy())
        r.kv[:m] = self.cache.path_values(node)
        if r.lock_node is not None:
            self.cache.dec_lock_ref(r.lock_node)
        self.cache.inc_lock_ref(node)
        r.lock_node = r.last_node = node
        r.cached_len = m
        r.prefix_len = r.kv_len

    # ---- decode side (R-DEC) ---------------------------------------------------------------
    def decode_tokens_needed(self, reqs: Optional[Sequence[ReqState]] = None) -> int:
        """Slots the next decode step needs: one per request, and at least one page for each
        request whose length is a multiple of P (R-DEC-2). `reqs`: request states of this
        scheduler (`running` items); TypeError for anything else (a rid, say)."""
        if reqs is None:
            reqs = self.running
        else:
            bad = next((r for r in reqs if not isinstance(r, ReqState)), None)
            if bad is not None:
                raise TypeError(f"decode_tokens_needed / decode_fits: reqs must hold request states (items of "
                                f"`running`), got {type(bad).__name__} {bad!r}")
        if any(getattr(r, "decode_ready", False) for r in reqs):  # `prepare_decode` gave these their slot
            reqs = [r for r in reqs if not getattr(r, "decode_ready", False)]
        P = self.config.page_size
        pages = len(reqs) if P == 1 else sum(1 for r in reqs if r.fill_len % P == 0)
        return max(len(reqs), pages * P)

    def decode_fits(self, reqs: Optional[Sequence[ReqState]] = None) -> bool:
        """Whether the next decode step of `reqs` (default: the running batch) gets its KV
        slots (`decode_tokens_needed` tokens), evicting unlocked cache first if the free pool
        is short (R-DEC-2). When False, call `retract_decode()` before `decode()`."""
        need = self.decode_tokens_needed(reqs)
        if need > self.pool.available:
            self.cache.evict(need - self.pool.available)
        return need <= self.pool.available

    def retract_decode(self) -> List[str]:
        """R-DEC-2: retract running requests (fewest outputs, then longest prompt, first) until
        the next decode step fits, keeping at least one. Returns retracted rids."""
        order = sorted(self.running, key=lambda r: (r.out_len, -r.prompt_len), reverse=True)
        out: List[ReqState] = []
        while len(order) > 1 and not self.decode_fits(order):
            r = order.pop()
            out.append(r)
            self._drop_kv(r)
            self._evict_shortfall(len(order))
        gone = {id(r) for r in out}
        self.running = [r for r in self.running if id(r) not in gone]
        if out:
            self.batch_is_full = False  # the batch shrank (as SGLang's update_running_batch)
        for r in out:
            self._requeue(r)
        return [r.rid for r in out]

    def decode(self, tokens: Mapping[str, int]) -> None:
        """One decode step: each running request gets a KV slot for its last token and appends
        `tokens[rid]`. max_new_tokens is not enforced here: the engine finishes a request
        (SGLang's check_finished); past it the budgets read max_new - len(output) as SPEC
        section 4 writes them (negative in N_run). Raises, all before changing anything (no
        eviction either): MemoryError if the free and evictable pool cannot hold the step
        (retract first); ValueError for a running request without a token, a rid that is not
        running or a token id outside [0, 2^31-1]; TypeError for a token that is not an int."""
        if not isinstance(tokens, Mapping):
            raise TypeError(f"decode takes a mapping rid -> token, got {type(tokens).__name__}")
        missing = [r.rid for r in self.running if r.rid not in tokens]
        if missing or len(tokens) != len(self.running):  # else every key is a running rid
            running = {r.rid for r in self.running}
            extra = [rid for rid in tokens if rid not in running]
            if extra:  # named first: a wrong rid usually explains the missing one
                more = f" (and no token for running requests {missing[:5]})" if missing else ""
                raise ValueError(f"decode: requests {extra[:5]} are not running{more}")
            raise ValueError(f"decode tokens missing for running requests {missing[:5]}")
        tokens = dict(tokens.items())  # one snapshot: what is checked is what is appended
        ids = list(tokens.values())
        # plain ints in range, the common case, are taken as they are (one pass each for the
        # type and the bounds); anything else is checked and converted one by one, which
        # names the first bad request
        if not (all(type(t) is int for t in ids) and min(ids, default=0) >= 0 and max(ids, default=0) <= INT32_MAX):
            tokens = {rid: check_token_id(f"decode tokens[{rid!r}]", t) for rid, t in tokens.items()}
        self._decode_slots("decode")
        for r in self.running:
            r.decode_ready = False
            r.req.output_ids.append(tokens[r.rid])

    def prepare_decode(self) -> Dict[str, int]:
        """Give each running request the KV slot of its last token (fill position `kv_len`,
        the token the next decode forward feeds and whose KV it writes) before that forward, as
        SGLang allocates a decode batch's slots before running it; `decode(tokens)` then only
        appends the tokens (and allocates for requests that joined the batch since). Returns
        rid -> that slot (an int) for every running request. Calling it again returns the same
        slots. Called after `decode_fits()` / `retract_decode()` and right before `decode()`
        (no scheduler call between), it changes no decision and no slot. Calls between the two
        see the slots taken, as SGLang's scheduler does once a decode batch is prepared: a
        `step()` there budgets with fewer free slots, and `decode_fits()` counts only requests
        without their slot (a prepared one needs none, not a page). `finish()` gives back a
        prepared slot whose decode never ran; `abort()`, `retract_decode()` and preemption free
        it with the rest.

        Raises (before changing anything) MemoryError as `decode()` does."""
        self._decode_slots("prepare_decode")
        return {r.rid: int(r.kv[r.kv_len - 1]) for r in self.running}

    def _decode_slots(self, where: str) -> None:
        """The next decode step's slots for the running requests that have none yet, in batch
        order, evicting first when the free pool is short (all or nothing)."""
        todo = [r for r in self.running if not getattr(r, "decode_ready", False)]
        n = len(todo)
        if not n:
            return
        evictable = self.cache.evictable_size  # a device read on a device cache: once
        if n > self.pool.available + evictable:  # evicting would not be enough: say so first
            raise MemoryError(f"{where}: the step needs {n} KV slots, {self.pool.available} free and "
                              f"{evictable} evictable; call retract_decode() first (decode_fits), and if "
                              f"decode_fits() is still False after it (it keeps one request), finish() or "
                              f"abort() a running request")
        if n > self.pool.available:
            self.cache.evict(n - self.pool.available)
        slots = self.pool.alloc(n)
        for r, s in zip(todo, slots):
            r.ensure_kv_capacity(r.kv_len + 1)
            r.kv[r.kv_len] = s
            r.kv_len += 1
            r.decode_ready = True

    def finish(self, rids: Iterable[str]) -> None:
        """R-DEC-3: cache each finished request's computed sequence (page-aligned), free the
        duplicate and unaligned slots, release its lock and drop it. Raises (before changing
        anything) ValueError for a rid that is not running, TypeError for a single string."""
        rids = _distinct("finish", rids)
        index = {r.rid: r for r in self.running}
        for rid in rids:
            if rid not in index:
                if any(r.rid == rid for r in self.prefilling):
                    where = "is in the prefill being run: call complete_prefill() first"
                elif self.chunked is not None and self.chunked.rid == rid:
                    where = "is the chunked request: its prompt is still being prefilled, chunk by chunk"
                elif rid in self.reqs:
                    where = "is not running: it is waiting in the queue (abort() drops a waiting request)"
                else:
                    where = "is not running: no such request (never submitted, or finished or aborted already)"
                raise ValueError(f"finish: request {rid!r} {where}")
        for rid in rids:
            r = index[rid]
            if getattr(r, "decode_ready", False):  # its last token's slot, whose decode never ran: not cached
                r.kv_len -= 1
                self.pool.free(r.kv[r.kv_len : r.kv_len + 1].copy())
                r.decode_ready = False
            if self.cache.disable:
                self.pool.free(r.kv[: r.kv_len].copy())
            else:
                n = r.kv_len
                present = self.cache.insert(r.fill()[:n], r.kv[:n], r.req.extra_key,
                                            r.cached_len, r.lock_node)  # the locked prefix
                if present > r.cached_len:
                    self.pool.free(r.kv[r.cached_len : present].copy())
                aligned = n // self.config.page_size * self.config.page_size
                self.pool.free(r.kv[aligned:n].copy())
                if r.lock_node is not None:
                    self.cache.dec_lock_ref(r.lock_node)
            r.lock_node = None
            r.kv_len = r.cached_len = 0
            del self.reqs[rid]
        gone = set(rids)
        self.running = [r for r in self.running if r.rid not in gone]
        if rids:
            self.batch_is_full = False  # the batch shrank (as SGLang's update_running_batch)

    def abort(self, rids: Iterable[str]) -> None:
        """Drop requests wherever they are (queue, running, chunked, the prefill being run);
        nothing is cached. A request of the prefill being run (between step() and
        complete_prefill()) leaves that prefill: the engine must not run it, and
        complete_prefill() takes no token for it. That is also the way out when
        complete_prefill() raises MemoryError and nothing running can be freed (an in-flight
        chunk is admitted whatever the budget, R-ADM-5). Raises (before changing anything)
        ValueError for an unknown rid, TypeError for a single string."""
        rids = _distinct("abort", rids)
        for rid in rids:
            if rid not in self.reqs:
                raise ValueError(f"abort: unknown request {rid!r}")
        for rid in rids:
            r = self.reqs.pop(rid)
            if r is self.chunked:
                self.chunked = None
            self._drop_kv(r)
            self._remove_queued(r)
            if any(x is r for x in self.prefilling):
                self.prefilling = [x for x in self.prefilling if x is not r]
            if any(x is r for x in self.running):
                self.running = [x for x in self.running if x is not r]
                self.batch_is_full = False

    # ---- state seeding (tests, conformance, engines restoring state) -----------------------
    def seed_cache(self, tokens, extra_key: Optional[str] = None) -> int:
        """Insert `tokens` into the cache with freshly allocated slots (only floorP(len) tokens;
        tokens already present take none). Returns the newly cached token count (0 with the
        cache disabled). Raises MemoryError, nothing changed, when the free pool cannot hold the
        new ones; TypeError/ValueError naming the field for tokens that are not token ids in
        [0, 2^31 - 1] or an extra_key that is not a str or None (the cache disabled or not)."""
        from ..request import as_token_array
        toks = as_token_array(tokens, "seed_cache tokens")  # checked with the cache off too
        if extra_key is not None and not isinstance(extra_key, str):
            raise TypeError(f"seed_cache: extra_key must be a str or None, got {extra_key!r}")
        if self.cache.disable:
            return 0
        n = len(toks) // self.config.page_size * self.config.page_size
        present = self.cache.present_len(toks[:n], extra_key)
        self._check_seed_slots("seed_cache", n - present)
        # the new tail's slots from the length just found (the present part's values are not
        # read): a callable would make a device cache search for that length again
        slots = np.zeros(n, dtype=np.int64)
        slots[present:] = self.pool.alloc(n - present)
        return n - self.cache.insert(toks[:n], slots, extra_key)

    def _check_seed_slots(self, where: str, need: int) -> None:
        """MemoryError, before anything changes, when seeding needs more than the free KV
        slots (seeding evicts nothing)."""
        if need > self.pool.available:
            raise MemoryError(f"{where}: needs {need} KV slots for tokens the cache does not hold, "
                              f"{self.pool.available} free (seeding evicts nothing)")

    def _seed_holder(self, req: Request, match_len: int, kv_len: int, where: str) -> ReqState:
        self._check_new([req])
        st = self._state(req, None)
        self._check_seed_slots(f"{where} ({req.rid!r})", kv_len - self.cache.present_len(st.fill()[:match_len], req.extra_key))
        m, node = self.cache.match_prefix(st.fill()[:match_len], req.extra_key)
        self.cache.inc_lock_ref(node)
        st.lock_node = st.last_node = node
        st.reserve_kv(st.fill_len)
        st.kv[:m] = self.cache.path_values(node)
        st.kv[m:kv_len] = self.pool.alloc(kv_len - m)
        st.kv_len, st.cached_len = kv_len, m
        self.reqs[req.rid] = st
        return st

    def seed_running(self, req: Request) -> None:
        """Add a request that is already decoding: its prompt is matched (full length) and
        locked; it holds private slots for the rest of prompt + output (FORMAT.md 3.3).
        Raises MemoryError, nothing changed, when the free pool cannot hold those slots."""
        _check_seed_request("seed_running", req)
        st = self._seed_holder(req, len(req.prompt_ids), req.fill_len, "seed_running")
        st.prefix_len = st.kv_len
        self.running.append(st)

    def seed_chunked(self, req: Request, done: int) -> None:
        """Set the in-flight chunked request with `done` tokens prefilled (FORMAT.md 3.4).
        Raises MemoryError, nothing changed, when the free pool cannot hold the uncached ones;
        TypeError for a `done` that is not an int; ValueError when a chunked request is in
        flight already, for `done` outside [0, len(fill)), and when chunking is off (`chunked_prefill_size` None: R-ADM-5 budgets
        the in-flight chunk by `rem_chunk`, which chunking off leaves unset)."""
        _check_seed_request("seed_chunked", req)
        if self.config.chunked_prefill_size is None:
            raise ValueError(f"seed_chunked: chunking is off (chunked_prefill_size is None), so no request "
                             f"can be in flight as the chunked request; got {req.rid!r}")
        if self.chunked is not None:
            raise ValueError(f"seed_chunked: request {self.chunked.rid!r} is already in flight as the chunked "
                             f"request; got {req.rid!r}")
        _check_int("seed_chunked: done", done)  # a float would fail deep in the slicing, unnamed
        done = int(done)
        if not 0 <= done < req.fill_len:
            raise ValueError(f"seed_chunked: done must be in [0, {req.fill_len}), got {done}")
        st = self._seed_holder(req, done, done, "seed_chunked")
        st.prefix_len = done
        self.chunked = st

    # ---- invariants ------------------------------------------------------------------------
    def holders(self) -> List[ReqState]:
        """The request states that hold KV slots and cache locks: running, in the prefill being
        run (between `step()` and `complete_prefill()`), and the chunked request."""
        hs = list(self.running) + list(self.prefilling)
        if self.chunked is not None and self.chunked not in hs:
            hs.append(self.chunked)
        return hs

    def check_integrity(self) -> None:
        """Tree, lock and pool invariants (R-RC-6). Raises AssertionError on the first problem:
        tree structure and counters, lock_ref == number of holders, every holder's cached slots
        equal its locked path's values, and free + cached + private slots form exactly the pool."""
        holders = self.holders()
        self.cache.check_integrity([r.lock_node for r in holders if r.lock_node is not None])
        parts = [self.pool.free_slots(), self.cache.cached_slots()]
        for r in holders:
            if r.lock_node is not None and r.kv_len:
                path = self.cache.path_values(r.lock_node)
                if r.cached_len != len(path) or (path != r.kv[: r.cached_len]).any():
                    raise AssertionError(f"request {r.rid!r}: cached slots differ from its locked path")
            parts.append(r.private_slots())
        slots = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(slots) != self.pool.size:
            raise AssertionError(
                f"pool accounting: free {self.pool.available} + cached {self.cache.evictable_size + self.cache.protected_size}"
                f" + private {len(slots) - self.pool.available - self.cache.evictable_size - self.cache.protected_size}"
                f" != pool size {self.pool.size}"
            )
        if len(slots):
            # as many slots as the pool and every slot seen: each is owned exactly once
            seen = np.zeros(self.pool.size, dtype=bool)
            if slots.min() < 0 or slots.max() >= self.pool.size:
                raise AssertionError("pool accounting: a KV slot outside the pool")
            seen[slots] = True
            if not seen.all():
                raise AssertionError("pool accounting: a KV slot is owned twice or lost")
