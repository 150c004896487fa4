"""The request record an engine hands to a scheduler (SPEC.md section 1), with validation.

A `Request` is host-side data only: the scheduler keeps its own per-request state. Token ids
must fit int32 (the device token pool is int32); priorities must fit int64. Every check raises
`TypeError`/`ValueError` naming the field, the request and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_BOOLS = (bool, np.bool_)


def as_token_array(tokens, what: str) -> np.ndarray:
    """Tokens as a read-only 1-D int32 array of their own (never the caller's memory, which the
    caller may reuse); raises TypeError for a non-sequence (a str, a mapping, a set) or a
    non-int id (bools too, numpy's included), ValueError for an id outside [0, 2^31-1]."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"{what} must be a 1-D integer array, got dtype {tokens.dtype} ndim {tokens.ndim}")
        arr = tokens  # compared as it is: a cast to int64 first would wrap uint64 ids
    else:
        if isinstance(tokens, (str, bytes, bytearray, memoryview, Mapping)):  # a dict would read as its keys,
            # a byte buffer as its bytes
            raise TypeError(f"{what} must be a sequence of ints, got {type(tokens).__name__}")
        if not hasattr(tokens, "__len__") or not hasattr(tokens, "__getitem__"):  # None, an int, a generator
            raise TypeError(f"{what} must be a sequence of ints, got {type(tokens).__name__} {tokens!r}")
        try:
            n = len(tokens)
        except TypeError:  # a 0-d tensor or array-like: one number, not a sequence
            raise TypeError(f"{what} must be a sequence of ints, got {type(tokens).__name__} {tokens!r}") from None
        arr = np.asarray(tokens) if n else np.zeros(0, dtype=np.int64)
        # numpy silently turns True into 1 inside an int list: look for bools explicitly
        has_bool = arr.dtype.kind == "b" or (arr.dtype.kind in "iu" and any(type(t) in _BOOLS for t in tokens))
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or has_bool:
            # slow path only to name the offending element
            for i, t in enumerate(tokens):
                if isinstance(t, _BOOLS) or not isinstance(t, (int, np.integer)):
                    raise TypeError(f"{what}[{i}] must be an int, got {type(t).__name__} {t!r}")
            arr = np.array([int(t) for t in tokens], dtype=object)
            if len(arr) and (min(arr) < 0 or max(arr) > INT32_MAX):
                i = next(k for k, t in enumerate(arr) if t < 0 or t > INT32_MAX)
                raise ValueError(f"{what}[{i}] = {arr[i]} is outside the token id range [0, {INT32_MAX}]")
            arr = arr.astype(np.int64)
    if len(arr):
        bad = np.flatnonzero((arr < 0) | (arr > INT32_MAX))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"{what}[{i}] = {int(arr[i])} is outside the token id range [0, {INT32_MAX}]")
    out = np.ascontiguousarray(arr, dtype=np.int32)
    if out is tokens or out.base is not None:  # the caller's array or a view of its memory (a tensor's)
        out = out.copy()
    out.setflags(write=False)
    return out


def check_token_id(what: str, v) -> int:
    """v as an int token id; TypeError unless an int (bools and floats too), ValueError
    outside [0, 2^31-1]. `what` names the field in the message."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        hint = " (pass int(token): a sampler's tensor output needs .tolist() first)" if hasattr(v, "tolist") else ""
        raise TypeError(f"{what} must be an int token id, got {type(v).__name__} {v!r}{hint}")
    if not 0 <= v <= INT32_MAX:
        raise ValueError(f"{what} = {v} is outside the token id range [0, {INT32_MAX}]")
    return int(v)


def check_real(what: str, v, expected: str = "a number") -> float:
    """v as a float; TypeError (saying `what` must be `expected`) unless an int or float
    (bools and strings refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        inner = getattr(v, "value", None)  # e.g. a NewTokenRatio, whose number is its .value
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            hint = f" (pass its .value, {inner!r})"
        else:
            hint = " (pass float(x) or x.item())" if hasattr(v, "item") else ""
        raise TypeError(f"{what} must be {expected}, got {type(v).__name__} {v!r}{hint}")
    return float(v)


def check_time(what: str, v) -> float:
    """v as a finite float time [seconds]; TypeError unless a real number, ValueError for NaN
    or an infinity."""
    f = check_real(what, v)
    if not np.isfinite(f):
        raise ValueError(f"{what} must be finite, got {v!r}")
    return f


@dataclass
class Request:
    """One generation request.

    Attributes:
        rid: unique request id (non-empty str).
        prompt_ids: prompt token ids, int32 range; at least one token. Stored as a read-only
            int32 numpy array of shape [len(prompt)].
        max_new_tokens: generation limit [tokens], >= 0.
        output_ids: tokens generated so far (retracted/preempted requests keep them).
        ignore_eos: generate exactly max_new_tokens (R-ADM-6 when the cache is disabled).
        priority: int64 priority or None (absent: the last possible, SPEC section 1).
        routing_key: routing-key policy key (R-ORD-7) or None.
        extra_key: cache namespace (R-RC-2) or None for the default namespace.
        return_logprob, logprob_start_len: cap the usable prefix (R-ORD-8).
        enqueue_time: arrival time [seconds or any monotone unit]; None lets the scheduler stamp it.
    """

    rid: str
    prompt_ids: Sequence[int]
    max_new_tokens: int
    output_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    priority: Optional[int] = None
    routing_key: Optional[str] = None
    extra_key: Optional[str] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    enqueue_time: Optional[float] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raises TypeError/ValueError naming the field and value."""
        if not isinstance(self.rid, str):
            raise TypeError(f"rid must be a non-empty str, got {type(self.rid).__name__} {self.rid!r}")
        if not self.rid:
            raise ValueError("rid must be a non-empty str, got ''")
        who = f"request {self.rid!r}"
        self.prompt_ids = as_token_array(self.prompt_ids, f"{who}: prompt_ids")
        if len(self.prompt_ids) == 0:
            raise ValueError(f"{who}: prompt_ids must hold at least one token, got 0")
        out = as_token_array(self.output_ids, f"{who}: output_ids")
        self.output_ids = [int(t) for t in out]
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, (int, np.integer)):
            raise TypeError(f"{who}: max_new_tokens must be an int, got {self.max_new_tokens!r}")
        self.max_new_tokens = int(self.max_new_tokens)
        if not 0 <= self.max_new_tokens <= INT64_MAX:
            raise ValueError(f"{who}: max_new_tokens must be in [0, 2^63 - 1] (int64), got {self.max_new_tokens}")
        for name in ("ignore_eos", "return_logprob"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{who}: {name} must be a bool, got {getattr(self, name)!r}")
        if self.priority is not None:
            if isinstance(self.priority, bool) or not isinstance(self.priority, (int, np.integer)):
                raise TypeError(f"{who}: priority must be an int or None, got {self.priority!r}")
            self.priority = int(self.priority)
            if not INT64_MIN <= self.priority <= INT64_MAX:
                raise ValueError(f"{who}: priority {self.priority} does not fit int64")
        for name in ("routing_key", "extra_key"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{who}: {name} must be a str or None, got {v!r}")
        if isinstance(self.logprob_start_len, bool) or not isinstance(self.logprob_start_len, (int, np.integer)):
            raise TypeError(f"{who}: logprob_start_len must be an int, got {self.logprob_start_len!r}")
        self.logprob_start_len = int(self.logprob_start_len)
        if self.enqueue_time is not None:  # a finite number, as submit's and step's `now`
            self.enqueue_time = check_time(f"{who}: enqueue_time", self.enqueue_time)

    @property
    def fill_len(self) -> int:
        """len(prompt) + len(output) [tokens]: the length of `fill(r)` (SPEC section 0)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def fill_ids(self) -> np.ndarray:
        """`fill(r)`: prompt followed by the output so far, int32 array [fill_len]."""
        if not self.output_ids:
            return self.prompt_ids
        return np.concatenate([self.prompt_ids, np.asarray(self.output_ids, dtype=np.int32)])
