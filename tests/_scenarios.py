"""Random whole-step scenarios for the step differential tests (tests/test_step_differential.py).

A scenario is one complete scheduler state, built through the public API only (`seed_cache`,
`seed_running`, `seed_chunked`, `submit`, the full mark), plus the step's new-token ratio: a
config, a warm prefix cache of shared prefixes over a small vocabulary, a running batch, maybe an
in-flight chunked request, and a waiting queue. Scenarios come in families (`make_family`,
deterministic) that share everything but the queue, the ratio and the full mark, so the costly
part of a state (seeding the running batch) is built once per family and copied per variant;
`build` builds one scenario from scratch through the same calls.

The budgets are drawn relative to the scenario's own demand (the running reservation and the
waiting requests' costs), so every stop reason of R-STEP occurs over a few hundred families;
`ObservedReference` records which rule decided each step (`outcomes`), and the tests assert that
every outcome was hit, so the generator cannot silently go weak.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from gpu_sched.config import SchedulerConfig
from gpu_sched.reference import ReferenceScheduler
from gpu_sched.request import Request

POLICIES = ("fcfs", "lof", "lpm", "dfs-weight", "routing-key", "random")


@dataclass
class Scenario:
    """One step's starting state. `family`/`variant` name it: the variants of a family share
    the config, the pool, the warm cache, the running batch and the chunked request (built
    once, then copied), and differ in the waiting queue, the ratio and the full mark."""

    family: int
    variant: int
    config: SchedulerConfig
    kv_pool_size: int
    ratio: float
    cache: List[Tuple[List[int], Optional[str]]] = field(default_factory=list)
    running: List[dict] = field(default_factory=list)  # Request kwargs, output_ids included
    chunked: Optional[Tuple[dict, int]] = None  # (Request kwargs, tokens done)
    waiting: List[dict] = field(default_factory=list)
    batch_is_full: bool = False

    @property
    def name(self) -> str:
        return f"family {self.family} variant {self.variant}"

    def describe(self) -> str:
        return (f"{self.name}: kv={self.kv_pool_size} ratio={self.ratio!r} waiting={len(self.waiting)} "
                f"running={len(self.running)} chunked={self.chunked is not None} cache_seeds={len(self.cache)} "
                f"full={self.batch_is_full}\n  {self.config}")


def _size(rng: random.Random, buckets) -> int:
    """Draw from [(probability, lo, hi)] buckets (inclusive ranges)."""
    u = rng.random()
    acc = 0.0
    for p, lo, hi in buckets:
        acc += p
        if u < acc:
            return rng.randint(lo, hi)
    return rng.randint(buckets[-1][1], buckets[-1][2])


# skewed: most queues and batches are small (the step's cost grows with them), some are large
QUEUE_SIZES = [(0.06, 0, 0), (0.65, 1, 12), (0.23, 13, 120), (0.05, 121, 1000), (0.01, 1001, 3000)]
QUEUE_SIZES_SMALL = [(0.1, 0, 0), (0.9, 1, 10)]
RUNNING_SIZES = [(0.3, 0, 0), (0.51, 1, 6), (0.15, 7, 40), (0.03, 41, 150), (0.01, 151, 500)]
RUNNING_SIZES_SMALL = [(0.3, 0, 0), (0.7, 1, 6)]
VARIANTS = 4  # scenarios per family


def _config(rng: random.Random, n_running: int) -> SchedulerConfig:
    P = rng.choice([1, 1, 4, 16])
    prio = rng.random() < 0.35
    preempt = prio and rng.random() < 0.6
    chunk = rng.choice([None, None, P, 8, 16, 32, 64, 128, 512, 8192])
    if chunk is not None and chunk < P and rng.random() < 0.7:
        chunk = P
    cap = None
    u = rng.random()
    if preempt and n_running and u < 0.7:  # a full batch is where preemption is tried
        cap = max(1, n_running + rng.randint(-2, 1))
    elif u < 0.4:
        cap = max(1, n_running + rng.randint(-2, 6))
    elif u < 0.5:
        cap = rng.choice([1, 2, 3, 64])
    align = None
    if chunk is not None and rng.random() < 0.25:
        align = rng.choice([P, 2 * P, 8, 24, 64])
    return SchedulerConfig(
        schedule_policy=rng.choice(POLICIES),
        page_size=P,
        max_prefill_tokens=rng.choice([1, 8, 32, 64, 100, 256, 1024, 4096, 16384]),
        chunked_prefill_size=chunk,
        max_running_requests=cap,
        enable_priority_scheduling=prio,
        schedule_low_priority_values_first=rng.random() < 0.5,
        priority_scheduling_preemption_threshold=rng.choice([0, 0, 1, 3, 10]),
        enable_priority_preemption=preempt,
        in_batch_prefix_caching_check_threshold=rng.choice([32, 32, -1, 8, 200]),
        in_batch_prefix_caching_deprioritize_threshold=rng.choice([32, 32, 4, 16]),
        lpm_fallback_queue_len=rng.choice([None, None, None, 2, 8, 50]),
        enable_mixed_chunk=rng.random() < 0.2,
        prefill_max_requests=rng.choice([None, None, None, 1, 2, 5, 20]),
        truncation_align_size=align,
        disable_radix_cache=rng.random() < 0.2,
        random_seed=rng.randrange(1000),
    )


class _Gen:
    """Token and request generators of one family (shared prefixes over a small vocabulary)."""

    def __init__(self, rng: random.Random, cfg: SchedulerConfig):
        self.rng = rng
        self.nrng = np.random.default_rng(rng.randrange(2**32))  # token runs (fast, int32 arrays)
        self.vocab = rng.choice([2, 3, 5, 20, 1000])
        self.bases = [self.toks(rng.choice([0, 4, 17, 40, 64, 130, 300])) for _ in range(rng.randint(1, 5))]
        self.namespaces = [None] if rng.random() < 0.6 else [None, None, "ns1", "ns2"]
        self.tail_max = rng.choice([3, 12, 40, 120])
        self.ignore_p = 0.6 if cfg.disable_radix_cache else 0.15

    def toks(self, n) -> np.ndarray:
        return self.nrng.integers(0, self.vocab, n, dtype=np.int32)

    def prompt(self):
        rng = self.rng
        b = rng.choice(self.bases)
        cut = len(b) if rng.random() < 0.4 else rng.randint(0, len(b))
        return np.concatenate([b[:cut], self.toks(rng.randint(1, self.tail_max))])

    def request(self, rid, t, outputs=0, max_news=(0, 1, 2, 5, 16, 64, 300, 1000, 5000)):
        rng = self.rng
        return dict(rid=rid, prompt_ids=self.prompt(), max_new_tokens=rng.choice(max_news),
                    output_ids=self.toks(outputs).tolist(), ignore_eos=rng.random() < self.ignore_p,
                    priority=rng.choice([None, -5, 0, 1, 2, 3, 10, 20, 50]),
                    routing_key=rng.choice([None, "", "a", "b", "c", "d"]), extra_key=rng.choice(self.namespaces),
                    return_logprob=rng.random() < 0.1, logprob_start_len=rng.choice([-1, 0, 3, 20]),
                    enqueue_time=t)

    def queue(self, n):
        rng = self.rng
        out, t = [], 0.0
        for i in range(n):
            if rng.random() < 0.7:
                t += rng.choice([0.0, 1.0, 0.5])
            outs = rng.randint(1, 8) if rng.random() < 0.1 else 0  # retracted ones keep their output
            out.append(self.request(f"w{i}", t, outs))
        return out

    def ratio(self):
        rng = self.rng
        return rng.choice([0.7, 1.0, 0.3, 0.05, round(rng.uniform(0.01, 1.0), 6), rng.uniform(0.01, 1.0)])


def make_family(family: int, small: bool = False) -> List[Scenario]:
    """The VARIANTS scenarios of family number `family` (deterministic); `small` keeps the queue
    <= 10 and the running batch <= 6 (for the Triton interpreter)."""
    rng = random.Random(family * 7919 + (1 if small else 0))
    n_run = _size(rng, RUNNING_SIZES_SMALL if small else RUNNING_SIZES)
    cfg = _config(rng, n_run)
    g = _Gen(rng, cfg)
    cache = []
    if not cfg.disable_radix_cache:  # warm cache: bases, their prefixes and earlier prompts
        for _ in range(rng.choice([0, 1, 3, 6, 12])):
            b = rng.choice(g.bases)
            toks = b[: rng.randint(0, len(b))] if rng.random() < 0.4 else g.prompt()
            cache.append((toks, rng.choice(g.namespaces)))
    running = []
    # big batches get small max_new: the pool (and the tree's capacity) follows ratio * N
    max_news = (1, 2, 5, 16, 64, 300) if n_run > 40 else (1, 2, 5, 16, 64, 300, 1000, 5000)
    for i in range(n_run):
        d = g.request(f"run{i}", float(rng.randint(-50, 0)), max_news=max_news)
        d["output_ids"] = g.toks(rng.randint(1, min(d["max_new_tokens"], 30))).tolist()
        running.append(d)
    chunked = None
    if cfg.chunked_prefill_size is not None and rng.random() < 0.3:
        d = g.request("chunk0", -60.0)
        d["prompt_ids"] = np.concatenate([d["prompt_ids"], g.toks(rng.choice([0, 10, 100, 600]))])
        done = rng.randint(0, len(d["prompt_ids"]) - 1)
        if rng.random() < 0.5:
            done = done // cfg.page_size * cfg.page_size
        chunked = (d, done)
    out = []
    for v in range(VARIANTS):
        n_wait = _size(rng, QUEUE_SIZES_SMALL if small else QUEUE_SIZES)
        out.append(Scenario(family, v, cfg, 0, g.ratio(), cache, running, chunked, g.queue(n_wait),
                            batch_is_full=n_run > 0 and rng.random() < 0.12))
    kv = _pool_size(out, rng)
    for sc in out:
        sc.kv_pool_size = kv
    return out


def _pool_size(fam: List[Scenario], rng: random.Random) -> int:
    """Pool size = what the seeded state occupies + a free amount A drawn around the demand (the
    running reservation at one variant's ratio and that variant's queue), so budgets run out
    before the first request, partway or never; sometimes A puts that variant's first request
    right at an edge of R-ADM-3 (refused only under its temporary lock, admitted but leaving
    NO_TOKEN behind, refused at equality)."""
    sc = rng.choice(fam)
    bound = sum(len(t) for t, _ in sc.cache) + sum(len(d["prompt_ids"]) + len(d["output_ids"]) for d in sc.running)
    if sc.chunked is not None:
        bound += sc.chunked[1]
    dry = build_base(sc, lambda cfg, kv, shuffle: ReferenceScheduler(cfg, kv, shuffle=shuffle), kv_pool_size=bound)
    used = bound - dry.available
    cfg = sc.config
    clip = cfg.clip_max_new_tokens
    N = sum(min(d["max_new_tokens"] - len(d["output_ids"]), clip) for d in sc.running)
    mixed = len(sc.running) if cfg.enable_mixed_chunk and cfg.chunked_prefill_size is not None else 0
    F = sc.ratio * N
    base = F + mixed - dry.evictable
    demand = sum(len(d["prompt_ids"]) + len(d["output_ids"]) + min(d["max_new_tokens"], clip) + cfg.page_size
                 for d in sc.waiting[:64])
    u = rng.random()
    if cfg.enable_priority_preemption and sc.running and rng.random() < 0.3:
        # little free room and a warm cache: releasing victims then evicts (R-ADM-7's shortfall)
        return used + rng.randint(0, 20 * len(sc.running))
    if u < 0.2 and sc.chunked is None and sc.waiting:
        A = _edge(sc, dry, rng, F, mixed)
        if A is not None:
            return used + A
    if u < 0.12:
        A = base + rng.uniform(-0.2, 0.02) * max(demand, 10)  # nothing fits
    elif u < 0.75:
        A = base + rng.uniform(0, 1) * demand  # part of the head of the queue fits
    elif u < 0.9:
        A = base + 3 * demand + 100  # plenty
    else:
        A = rng.randint(0, 200)
    return used + max(0, int(A))


def _edge(sc: Scenario, dry, rng: random.Random, F: float, mixed: int) -> Optional[int]:
    """A free amount A that puts the first request of the variant's order at an R-ADM-3 edge."""
    dry.submit([Request(**d) for d in sc.waiting])
    first = dry._order().queue[0]
    dry._rematch(first)
    cfg, P = sc.config, sc.config.page_size
    ext = first.fill_len - first.prefix_len
    e = -(-ext // P) * P
    total = ext + min(max(first.max_new - first.out_len, 0), cfg.clip_max_new_tokens) + P
    ev0 = dry.evictable
    dry.cache.inc_lock_ref(first.last_node)
    drop = ev0 - dry.evictable
    windows = [(total - 1, total)]  # refused at equality (total >= rem_total)
    if drop:
        windows.append((total, total + drop))  # refused only under the temporary lock
    after = e + min(first.max_new, cfg.clip_max_new_tokens) + P + drop  # admitted, then NO_TOKEN
    if after > total + drop:
        windows.append((total + drop, after))
    lo, hi = rng.choice(windows)
    for A in range(max(0, int(lo + F) - mixed - ev0 - 2), int(hi + F) - ev0 + mixed + 3):
        if lo < float(A + ev0 - mixed) - F <= hi:
            return A
    return None


def make_shuffle(seed: int) -> Callable[[int], List[int]]:
    """The `random` policy's permutation, injected into both schedulers (R-ORD-6 lets backends
    differ on it, so the tests fix it)."""
    rng = np.random.default_rng(seed)
    return lambda n: rng.permutation(n).tolist()


def build_base(sc: Scenario, make: Callable, kv_pool_size: Optional[int] = None):
    """`make(config, kv_pool_size, shuffle)` with the family's shared state: cache, running, chunked."""
    s = make(sc.config, sc.kv_pool_size if kv_pool_size is None else kv_pool_size, make_shuffle(sc.family))
    for toks, ns in sc.cache:
        s.seed_cache(toks, ns)
    for d in sc.running:
        s.seed_running(Request(**d))
    if sc.chunked is not None:
        d, done = sc.chunked
        s.seed_chunked(Request(**d), done)
    return s


def add_variant(s, sc: Scenario):
    """Submit the variant's queue and set its full mark on a copy of the family's base state."""
    s.shuffle = make_shuffle(sc.family * VARIANTS + sc.variant)  # a copy must not share the base's generator
    s.submit([Request(**d) for d in sc.waiting])
    s.batch_is_full = sc.batch_is_full
    return s


def build(sc: Scenario, make: Callable):
    """The whole scenario built from scratch through the API (what a copy of the base must equal)."""
    return add_variant(build_base(sc, make), sc)


# ---- outcome classification --------------------------------------------------------------------
class ObservedReference(ReferenceScheduler):
    """The reference scheduler, unchanged, plus a record of which rule decided each request of
    the admission loop (`events`). Observation only: every decision is the reference's."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.events: List[str] = []

    def _admit_one(self, r, adder, running_bs):
        cfg = self.config
        n0, p0, full0 = len(adder.can_run), len(adder.preempted), self.batch_is_full
        stop = super()._admit_one(r, adder, running_bs)
        admitted = len(adder.can_run) > n0
        ev = self.events
        eos_path = r.req.ignore_eos and self.cache.disable
        if len(adder.preempted) > p0:
            ev.append("preempted")
        if stop == "batch_full":
            if cfg.enable_priority_preemption:
                ev.append("preempt_failed")
            ev.append("batch_full_mark" if full0 else "batch_full_cap")
        if admitted:
            ev.append("admit_ignore_eos" if eos_path else "admit")
            if adder.new_chunked is r:
                ev.append("chunk_new_ignore_eos" if eos_path else "chunk_new")
            if stop == "add_no_token":
                ev.append("no_token_after_admit")
            elif stop == "add_other":
                ev.append("other_after_admit")
        elif stop == "add_other":
            pmr = cfg.prefill_max_requests
            if pmr is not None and n0 >= pmr:
                ev.append("other_prefill_max_requests")
            elif eos_path:
                ev.append("other_ignore_eos_chunk")
            elif adder.rem_chunk is None:
                ev.append("other_input_budget")
            else:
                t = adder.rem_chunk // cfg.page_size * cfg.page_size
                a = cfg.truncation_align_size
                ev.append("other_align" if a is not None and t < a else "other_chunk_empty")
        elif stop == "add_no_token":
            P = cfg.page_size
            ext = r.fill_len - r.prefix_len
            if eos_path:
                e = -(-ext // P) * P
                ev.append("no_token_ignore_eos_budget" if e > min(adder.cur_rem, adder.rem_total)
                          else "no_token_ignore_eos_scan")
            else:
                mn = min(max(r.max_new - r.out_len, 0), cfg.clip_max_new_tokens)
                ev.append("no_token_total" if ext + mn + P >= adder.rem_total else "no_token_under_lock")
            if not self.batch_is_full:
                ev.append("no_token_clears_full")
        return stop

    def step(self, *a, **k):
        chunk = self.chunked
        plan = super().step(*a, **k)
        ev = self.events
        ev.append("stop:" + plan.stop)
        if chunk is not None and plan.admitted and plan.admitted[0][0] == chunk.rid:
            ev.append("inflight_chunk_continues" if plan.chunked_rid_after == chunk.rid else "inflight_chunk_done")
        if plan.active_policy is not None and plan.active_policy != self.config.schedule_policy:
            ev.append("policy_fallback:" + plan.active_policy)
        if plan.deprioritized:
            ev.append("deprioritized")
        if plan.preempt_evicted_tokens:
            ev.append("preempt_evicted")
        return plan


# Every one of these must occur over the step differential set.
REQUIRED_OUTCOMES = (
    "stop:no_prefill_full", "stop:no_prefill_empty", "stop:no_prefill_max_running", "stop:budget_other",
    "stop:batch_full", "stop:add_no_token", "stop:add_other", "stop:queue_end",
    "preempted", "preempt_failed", "preempt_evicted", "batch_full_cap", "batch_full_mark",
    "admit", "admit_ignore_eos", "chunk_new", "chunk_new_ignore_eos",
    "no_token_after_admit", "other_after_admit", "other_prefill_max_requests", "other_input_budget",
    "other_align", "no_token_ignore_eos_budget", "no_token_ignore_eos_scan", "no_token_total",
    "no_token_under_lock", "no_token_clears_full", "inflight_chunk_continues", "inflight_chunk_done",
    "policy_fallback:fcfs", "deprioritized",
)


def counts(events) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for e in events:
        out[e] = out.get(e, 0) + 1
    return out


# ---- cache contents as id-free triples ---------------------------------------------------------
def ref_triples(cache) -> set:
    """The reference tree as {((namespace, full token prefix), key length, lock_ref)}."""
    out = set()
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix + tuple(child.key.tolist())
            out.add(((child.ns, p), len(child.key), child.lock_ref))
            stack.append((child, p))
    return out


def dev_triples(cache) -> set:
    """The same triples of a `DeviceRadixCache` (one host copy of the tree's arrays)."""
    if cache.disable:
        return set()
    t = cache.tree
    names = {v: k for k, v in cache._ns.items()}
    alive = t.alive.cpu().numpy()
    parent, off, ln = t.parent.cpu().numpy(), t.key_off.cpu().numpy(), t.key_len.cpu().numpy()
    lock, ns, tok = t.lock_ref.cpu().numpy(), t.ns.cpu().numpy(), t.tok.cpu().numpy()
    prefix = {0: ()}

    def pre(n):
        chain = []
        while n not in prefix:
            chain.append(n)
            n = int(parent[n])
        p = prefix[n]
        for m in reversed(chain):
            p = p + tuple(tok[off[m] : off[m] + ln[m]].tolist())
            prefix[m] = p
        return p

    out = set()
    for n in np.flatnonzero(alive).tolist():
        if n != 0:
            out.add(((names[int(ns[n])], pre(n)), int(ln[n]), int(lock[n])))
    return out


def decode_pair(a, b, rng: random.Random, vocab: int, ratio: float) -> Tuple[float, list]:
    """One decode step of two schedulers' running batches (equal so far), as an engine takes
    it: the batch retracted where it does not fit (the same rids on both; the new-token ratio
    then rises by 0.1, at most 1), a token per running request drawn from rng (below
    `vocab`), then the ratio's decay (-0.05, at least 0.1). Returns (ratio, retracted rids)."""
    out = []
    if not a.decode_fits():
        out = a.retract_decode()
        assert out == b.retract_decode()
        ratio = min(1.0, ratio + 0.1)
    else:
        assert b.decode_fits()
    toks = {r.rid: rng.randrange(vocab) for r in a.running}
    a.decode(toks)
    b.decode(toks)
    return max(0.1, ratio - 0.05), out

