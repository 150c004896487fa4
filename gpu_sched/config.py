"""Scheduler configuration (SPEC.md section 1), under SGLang's server-argument names.

`SchedulerConfig` is frozen and validated on construction: a bad value raises `ValueError`
(or `TypeError` for a wrong type) naming the field and the value. `SchedulerConfig.sglang()`
is the preset that reproduces SGLang's defaults exactly, including the 128-request LPM
fallback (R-ORD-2); the plain constructor differs only in `lpm_fallback_queue_len=None` (D3).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Optional

import numpy as np

CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
CACHE_AGNOSTIC_POLICIES = ("fcfs", "lof", "random", "routing-key")
POLICIES = CACHE_AWARE_POLICIES + CACHE_AGNOSTIC_POLICIES
#: decode steps reserved per request that stays running: in a release for preemption or
#: retraction (R-ADM-7, R-DEC-2) and in the new-token ratio after a retraction (R-DEC-1)
RETRACT_DECODE_STEPS = 20

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


#: the largest token knob (prefill and chunk budgets, CLIP, truncation alignment; the page size
#: has its own, smaller bound)
#: [tokens]: far past any KV cache, and small enough that the device's int64 sums of budgets
#: and per-request costs (a window of up to 2^20 requests, each an extend length, a
#: reservation of at most CLIP and a page) cannot overflow where the reference's Python ints
#: do not
TOKEN_KNOB_MAX = 2**40
#: largest queue / running capacity of a recorded step (`GpuScheduler.capture`, the CLI's
#: --capture): the benchmarks' largest queue is 2^20; the step's buffers grow with it
CAPTURE_CAPACITY_MAX = 2**24
_TOKEN_BOUND = dict(hi=TOKEN_KNOB_MAX, hi_is="2^40")  # `_check_int`'s bound of a token knob
#: the largest page size [tokens]: the radix kernels' bound (a page past it is far beyond any
#: KV cache's pages, 1 to a few hundred tokens)
PAGE_SIZE_MAX = 2**20


def _check_int(name: str, value, *, lo: Optional[int] = None, hi: int = INT64_MAX,
               hi_is: str = "int64's largest", none_means: Optional[str] = None) -> None:
    """TypeError/ValueError naming the field unless value is an int in [lo, hi] (hi: int64's
    largest by default: the device holds every knob as an int64); None passes where
    `none_means` says what None does (the message says it too). numpy integers are ints here
    (`SchedulerConfig` stores them as Python ints)."""
    alt = f" or None ({none_means})" if none_means else ""
    if value is None:
        if none_means:
            return
        raise TypeError(f"{name} must be an int, got None")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int{alt}, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}{alt}, got {value}")
    if value > hi:
        raise ValueError(f"{name} must be <= {hi} ({hi_is}){alt}, got {value}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Every scheduling knob of SPEC.md section 1.

    Attributes (units in brackets):
        schedule_policy: one of `lpm`, `dfs-weight`, `fcfs`, `lof`, `random`, `routing-key` (R-ORD-1).
        page_size: KV page size P [tokens], >= 1 (R-RC-3).
        max_prefill_tokens: prefill token budget per step [tokens] (R-ADM `rem_input`).
        chunked_prefill_size: chunk budget per step [tokens]; None turns chunked prefill off.
        max_running_requests: cap on running + admitted requests; None = no cap (R-STEP-1/3).
        enable_priority_scheduling: order fcfs/lof by priority first (R-ORD-4/5).
        schedule_low_priority_values_first: `sign = +1` when true, else -1.
        priority_scheduling_preemption_threshold: priority gap a victim must exceed (R-ADM-7).
        enable_priority_preemption: try R-ADM-7 when the batch is full; needs
            `enable_priority_scheduling=True` (ValueError otherwise).
        clip_max_new_tokens: CLIP [tokens], cap on the max-new-tokens estimate (SPEC section 0).
        in_batch_prefix_caching_check_threshold: R-ORD-9 check threshold [tokens]; -1 disables.
        in_batch_prefix_caching_deprioritize_threshold: R-ORD-9 threshold T [tokens].
        lpm_fallback_queue_len: queue length above which `lpm` falls back (R-ORD-2); None = never (D3).
        enable_mixed_chunk: mix decode tokens into prefill batches: `mixed = len(running)` when
            chunking is on (R-ADM budget state).
        prefill_max_requests: cap on requests admitted per step; None = no cap (R-ADM-3.1).
        truncation_align_size: chunk-length alignment [tokens]; None = off (R-ADM-3.7).
        disable_radix_cache: R-RC-8; cache-aware policies become fcfs (R-ORD-1).
        schedule_conservativeness: scales the initial new-token ratio (R-DEC-1). The
            schedulers do not read it: the ratio is `step(new_token_ratio=...)`'s argument,
            tracked by the engine (`gpu_sched.NewTokenRatio.from_config(config)` does R-DEC-1's
            tracking; `gpu-sched replay` uses it).
        random_seed: seed of the `random` policy's generator (R-ORD-6).
    """

    schedule_policy: str = "fcfs"
    page_size: int = 1
    max_prefill_tokens: int = 16384
    chunked_prefill_size: Optional[int] = 8192
    max_running_requests: Optional[int] = None
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    enable_priority_preemption: bool = False
    clip_max_new_tokens: int = 4096
    in_batch_prefix_caching_check_threshold: int = 32
    in_batch_prefix_caching_deprioritize_threshold: int = 32
    lpm_fallback_queue_len: Optional[int] = None
    enable_mixed_chunk: bool = False
    prefill_max_requests: Optional[int] = None
    truncation_align_size: Optional[int] = None
    disable_radix_cache: bool = False
    schedule_conservativeness: float = 1.0
    random_seed: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # numpy integers (e.g. read from an array) as Python ints
            v = getattr(self, f.name)
            if isinstance(v, np.integer):
                object.__setattr__(self, f.name, int(v))
        if not isinstance(self.schedule_policy, str):
            raise TypeError(f"schedule_policy must be a str, got {self.schedule_policy!r}")
        if self.schedule_policy not in POLICIES:
            close = difflib.get_close_matches(self.schedule_policy.lower().replace("_", "-"), POLICIES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"schedule_policy must be one of {', '.join(POLICIES)}; got {self.schedule_policy!r}{hint}"
            )
        _check_int("page_size", self.page_size, lo=1, hi=PAGE_SIZE_MAX, hi_is="2^20, the radix kernels' bound")
        _check_int("max_prefill_tokens", self.max_prefill_tokens, lo=1, **_TOKEN_BOUND)
        _check_int("chunked_prefill_size", self.chunked_prefill_size, lo=1, **_TOKEN_BOUND,
                   none_means="chunked prefill off")
        _check_int("max_running_requests", self.max_running_requests, lo=1, none_means="no cap")
        for name in (
            "enable_priority_scheduling",
            "schedule_low_priority_values_first",
            "enable_priority_preemption",
            "enable_mixed_chunk",
            "disable_radix_cache",
        ):
            _check_bool(name, getattr(self, name))
        _check_int("priority_scheduling_preemption_threshold", self.priority_scheduling_preemption_threshold, lo=INT64_MIN)
        _check_int("clip_max_new_tokens", self.clip_max_new_tokens, lo=0, **_TOKEN_BOUND)
        _check_int("in_batch_prefix_caching_check_threshold", self.in_batch_prefix_caching_check_threshold, lo=-1)
        _check_int(
            "in_batch_prefix_caching_deprioritize_threshold",
            self.in_batch_prefix_caching_deprioritize_threshold,
            lo=0,
        )
        _check_int("lpm_fallback_queue_len", self.lpm_fallback_queue_len, lo=0, none_means="never")
        _check_int("prefill_max_requests", self.prefill_max_requests, lo=1, none_means="no cap")
        _check_int("truncation_align_size", self.truncation_align_size, lo=1, **_TOKEN_BOUND,
                   none_means="off")
        _check_int("random_seed", self.random_seed, lo=0, hi=2**64 - 1, hi_is="the generators' largest seed")
        c = self.schedule_conservativeness
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, np.floating)):  # numpy ints: ints above
            raise TypeError(f"schedule_conservativeness must be a number, got {c!r}")
        if isinstance(c, np.floating):  # stored as a Python float, as numpy ints as ints
            c = float(c)
            object.__setattr__(self, "schedule_conservativeness", c)
        try:
            f = float(c)  # an int past float's range would fail later as a bare OverflowError
        except OverflowError:
            f = float("inf")
        if not (f > 0 and f != float("inf")):
            raise ValueError(f"schedule_conservativeness must be a finite number > 0, got {c}")
        if self.enable_priority_preemption and not self.enable_priority_scheduling:
            raise ValueError(
                "enable_priority_preemption=True needs enable_priority_scheduling=True "
                "(priority preemption orders victims by priority)"
            )

    # ---- derived values -------------------------------------------------------------------
    @property
    def priority_sign(self) -> int:
        """`sign` of SPEC section 0: +1 when low priority values are scheduled first."""
        return 1 if self.schedule_low_priority_values_first else -1

    @property
    def absent_priority(self) -> int:
        """The priority an absent one counts as: the last possible (SPEC section 1)."""
        return INT64_MAX if self.schedule_low_priority_values_first else INT64_MIN

    @property
    def cache_aware(self) -> bool:
        return self.schedule_policy in CACHE_AWARE_POLICIES

    @property
    def effective_policy(self) -> str:
        """R-ORD-1: a cache-aware policy with the cache disabled becomes fcfs."""
        if self.cache_aware and self.disable_radix_cache:
            return "fcfs"
        return self.schedule_policy

    def replace(self, **changes) -> "SchedulerConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def sglang(cls, **overrides) -> "SchedulerConfig":
        """SGLang's defaults exactly, including `lpm_fallback_queue_len=128` (R-ORD-2, D3)."""
        base = dict(
            schedule_policy="fcfs",
            page_size=1,
            max_prefill_tokens=16384,
            chunked_prefill_size=8192,
            max_running_requests=None,
            enable_priority_scheduling=False,
            schedule_low_priority_values_first=False,
            priority_scheduling_preemption_threshold=10,
            enable_priority_preemption=False,
            clip_max_new_tokens=4096,
            in_batch_prefix_caching_check_threshold=32,
            in_batch_prefix_caching_deprioritize_threshold=32,
            lpm_fallback_queue_len=128,
            enable_mixed_chunk=False,
            prefill_max_requests=None,
            truncation_align_size=None,
            disable_radix_cache=False,
            schedule_conservativeness=1.0,
            random_seed=0,
        )
        base.update(overrides)
        return cls(**base)


PRESETS = {"default": SchedulerConfig, "sglang": SchedulerConfig.sglang}
