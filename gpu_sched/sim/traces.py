"""Request-trace readers and a synthetic multi-turn workload for the serving simulator.

Formats:
  * Mooncake JSONL (FAST'25): one object per line ``{"timestamp": ms, "input_length": int,
    "output_length": int, "hash_ids": [int, ...]}``; each hash id names one 512-token prompt
    block, and equal ids mean equal blocks and equal full prefixes.
  * Azure LLM inference CSV (2023, and the 2024 week-long files): header
    ``TIMESTAMP,ContextTokens,GeneratedTokens`` with wall-clock timestamps of up to 100 ns
    resolution, optionally with a UTC offset (``+00:00``, as the 2024 files write them, or
    ``Z``); no prefix information.

Prompts are never stored: `TraceRequest.prompt_ids()` regenerates the int32 token ids on demand
from a 64-bit hash (splitmix64) of a small description kept on the request (hash ids or token
segments), so the whole Mooncake trace costs a few MB instead of GBs. Token ids are in
[0, 2^31 - 1). Generated tokens come from `output_token_ids(req.output_key, start, n)`.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import numbers
import re
import zlib
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "BLOCK_TOKENS", "TraceFormatError", "TraceRequest", "Trace", "output_token_ids",
    "read_mooncake", "read_azure", "read_trace", "synthetic_workload", "trace_stats",
]

BLOCK_TOKENS = 512  # tokens per Mooncake hash-id block
#: the longest prompt or output a trace row may give [tokens]: the simulator builds prompts and
#: outputs whole (a row asking for 10^12 tokens would ask for terabytes), and real traces hold
#: at most ~10^5-10^6 tokens a request
MAX_TRACE_TOKENS = 2**24
#: the latest Mooncake timestamp [ms] (~285,000 years): exact in a float64 [s]
MAX_TIMESTAMP_MS = 2**53
_TOKEN_MOD = 2**31 - 1  # token ids in [0, 2^31 - 1): fits the int32 token pool
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Domain tags keep the token streams of blocks, prompts, user messages and outputs apart.
_D_BLOCK, _D_PROMPT, _D_SYS, _D_USER, _D_OUT = (0xB10C, 0x9A0, 0x575, 0x05E, 0x0D7)
_AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]

PathLike = Union[str, Path]


def _mix_int(x: int) -> int:
    """splitmix64 finalizer on a Python int (same function as `_mix`)."""
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * _C1) & _M64
    x = ((x ^ (x >> 27)) * _C2) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise on uint64 (wraps mod 2^64 by design)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_C1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_C2)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> int:
    """A 64-bit stream key hashed from a tuple of ints (order matters)."""
    h = 0
    for p in parts:
        h = _mix_int(h ^ (int(p) & _M64))
    return h


def _stream(keys: np.ndarray, start: int, n: int) -> np.ndarray:
    """Tokens at positions start..start+n-1 of the streams `keys` (uint64 [k]) -> int64 [k, n]."""
    pos = np.arange(start, start + n, dtype=np.uint64) * np.uint64(_GOLDEN)
    return (_mix(keys[:, None] + pos[None, :]) % np.uint64(_TOKEN_MOD)).astype(np.int64)


def output_token_ids(index: int, start: int, n: int) -> np.ndarray:
    """Synthetic generated tokens of the request with output key `index`.

    Returns a read-only int32 array of shape [n]: the tokens at output positions
    start..start+n-1 (0-based, counted from the first generated token). Deterministic, and
    drawn from a stream disjoint (in practice) from every prompt stream. Pass
    `TraceRequest.output_key`, not the request's position in a list.
    """
    if index < 0 or start < 0 or n < 0:
        raise ValueError(f"output_token_ids: index, start, n must be >= 0, got {index}, {start}, {n}")
    out = _stream(np.array([_key(_D_OUT, index)], dtype=np.uint64), start, n)[0].astype(np.int32)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        index: position in the trace (file row order among valid rows for read traces,
            arrival order for synthetic ones).
        arrival_s: arrival time [s] from trace start, after rate scaling.
        input_len: prompt length [tokens], >= 1.
        output_len: generated tokens [tokens] as recorded (may be 0; clamping to
            max_new_tokens >= 1 is the simulator's business).
        hash_ids: Mooncake prefix-block ids (512 tokens each) or None.
        session: conversation id (synthetic traces) or None.
        turn: 0-based turn within `session`, or None.
        output_key: key for `output_token_ids`; the simulator must use this, not `index`.
        segments: token-stream segments ``(stream_key, start, n)`` concatenated to form the
            prompt when `hash_ids` is None (lengths sum to input_len); if both are empty,
            the prompt is a stream unique to `index`.
        routing_key: the request's routing key (the routing-key policy, R-ORD-7) or None;
            the traces carry none: `assign_keys` sets them.
        priority: the request's priority (priority scheduling) or None (SPEC section 1:
            the last possible); set by `assign_keys`.
    """

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: Optional[tuple] = None
    session: Optional[int] = None
    turn: Optional[int] = None
    output_key: int = 0
    segments: tuple = ()
    routing_key: Optional[str] = None
    priority: Optional[int] = None

    def prompt_ids(self) -> np.ndarray:
        """The prompt token ids, generated on demand: read-only int32 array [input_len]."""
        if self.hash_ids is not None:
            # Block h -> 512 tokens that depend on h only, so equal ids give equal runs.
            keys = _mix(np.uint64(_key(_D_BLOCK)) ^ np.asarray(self.hash_ids, dtype=np.uint64))
            toks = _stream(keys, 0, BLOCK_TOKENS).reshape(-1)[: self.input_len]
        elif self.segments:
            toks = np.concatenate(
                [_stream(np.array([k], dtype=np.uint64), s, n)[0] for k, s, n in self.segments])
        else:  # hand-built request: a unique stream keyed on index
            toks = _stream(np.array([_key(_D_PROMPT, 0, self.index)], dtype=np.uint64),
                           0, self.input_len)[0]
        out = toks.astype(np.int32)
        out.setflags(write=False)
        return out

    def output_ids(self, start: int, n: int) -> np.ndarray:
        """Shorthand for ``output_token_ids(self.output_key, start, n)`` (int32 [n])."""
        return output_token_ids(self.output_key, start, n)


@dataclass
class Trace:
    """A request trace: `requests` sorted by arrival (stable), `bad_rows` skipped rows."""

    name: str
    requests: list = field(default_factory=list)
    bad_rows: int = 0
    source: Optional[str] = None

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i):
        return self.requests[i]


class TraceFormatError(ValueError):
    """A malformed trace row; the message names the file, the 1-based line and the problem."""


class _Bad(Exception):
    """Internal: a row problem; `_collect` turns it into TraceFormatError with file and line."""


def _check_args(path: PathLike, limit, rate_scale) -> Path:
    """Validate reader arguments; returns the path, which must be an existing file."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral)
                              or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    if (isinstance(rate_scale, bool) or not isinstance(rate_scale, numbers.Real)
            or not math.isfinite(rate_scale) or rate_scale <= 0):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale!r}")
    p = Path(path)
    if p.is_dir():  # e.g. ../shared/traces/mooncake: name the trace files it holds
        inside = sorted(f.name for f in p.iterdir() if f.suffix in (".jsonl", ".csv"))
        hint = f"; it holds {', '.join(inside)}" if inside else "; it holds no .jsonl or .csv file"
        raise FileNotFoundError(f"trace path {p} is a directory, not a trace file{hint}")
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    return p


def _int_field(v, name: str, minimum: int, maximum: int = MAX_TRACE_TOKENS) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        kind = "a positive int" if minimum == 1 else "a non-negative int"
        raise _Bad(f"{name} must be {kind}, got {v!r}")
    if v > maximum:
        raise _Bad(f"{name} must be <= {maximum}, got {v}")
    return v


@contextlib.contextmanager
def _text(p: Path, **kw):
    """`open(p)` as UTF-8 text; a file that is not UTF-8 raises TraceFormatError naming it."""
    try:
        with open(p, encoding="utf-8", **kw) as f:
            yield f
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{p.name}: not UTF-8 text ({e.reason})") from None


def _collect(p: Path, rows, parse, limit, skip_bad_rows) -> tuple:
    """Parse (lineno, raw) rows with parse(raw, index) -> (valid parsed rows, bad row count).

    `index` counts valid rows so far, so it is the row's position among kept rows."""
    good, bad = [], 0
    for lineno, raw in rows:
        if limit is not None and len(good) >= limit:
            break
        try:
            good.append(parse(raw, len(good)))
        except _Bad as e:
            if not skip_bad_rows:
                raise TraceFormatError(f"{p.name} line {lineno}: {e}") from None
            bad += 1
    return good, bad


def _finish(name, p, reqs, bad, rate_scale) -> Trace:
    late = next((r for r in reqs if not math.isfinite(r.arrival_s)), None)
    if late is not None:
        raise ValueError(f"rate_scale {rate_scale!r} puts request {late.index}'s arrival past a float's range")
    reqs.sort(key=lambda r: r.arrival_s)  # list.sort is stable: ties keep file order
    return Trace(name=name, requests=reqs, bad_rows=bad, source=str(p))


def read_mooncake(path: PathLike, limit: Optional[int] = None, rate_scale: float = 1.0,
                  skip_bad_rows: bool = False) -> Trace:
    """Read a Mooncake JSONL trace.

    Args:
        path: the .jsonl file. Blank lines are ignored.
        limit: keep only the first `limit` valid rows (file order); None keeps all.
        rate_scale: > 0; multiplies the request rate: arrival_s = timestamp_ms / 1000 / rate_scale.
        skip_bad_rows: skip malformed rows and count them in `Trace.bad_rows` instead of raising.
    Raises:
        FileNotFoundError, ValueError (bad arguments), TraceFormatError (malformed row).
    """
    p = _check_args(path, limit, rate_scale)

    def parse(line: str, idx: int) -> TraceRequest:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _Bad(f"bad JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
        for k in ("timestamp", "input_length", "output_length", "hash_ids"):
            if k not in obj:
                raise _Bad(f"missing field {k!r}")
        ts = _int_field(obj["timestamp"], "timestamp", 0, MAX_TIMESTAMP_MS)
        n_in = _int_field(obj["input_length"], "input_length", 1)
        n_out = _int_field(obj["output_length"], "output_length", 0)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**63 for h in ids):
            raise _Bad("hash_ids must be a list of ints in [0, 2^63)")
        if len(ids) != -(-n_in // BLOCK_TOKENS):
            raise _Bad(f"hash_ids has {len(ids)} ids, expected ceil({n_in}/{BLOCK_TOKENS}) "
                       f"= {-(-n_in // BLOCK_TOKENS)}")
        return TraceRequest(index=idx, arrival_s=ts / 1000.0 / rate_scale, input_len=n_in,
                            output_len=n_out, hash_ids=tuple(ids), output_key=idx)

    with _text(p) as f:
        rows = ((n, ln) for n, ln in enumerate(f, start=1) if ln.strip())
        good, bad = _collect(p, rows, parse, limit, skip_bad_rows)
    return _finish(p.stem, p, good, bad, rate_scale)


_UTC_OFFSET = re.compile(r"(?:Z|([+-])(\d\d):?(\d\d))$")


def _parse_wallclock_ns(s: str) -> Tuple[int, bool]:
    """'YYYY-mm-dd HH:MM:SS[.fffffff][+HH:MM | -HH:MM | Z]' -> (integer ns since the epoch,
    whether an offset was given): in UTC when it was, else as written (naive). An offset's
    hours must be below 24 and its minutes below 60."""
    text = s.strip()
    shift = 0  # seconds east of UTC
    m = _UTC_OFFSET.search(text)
    zoned = bool(m) and len(text) > 19  # past the seconds: a date's own '-' never ends the string
    if zoned:
        if m.group(1):
            hh, mm = int(m.group(2)), int(m.group(3))
            if hh >= 24 or mm >= 60:
                raise _Bad(f"unparsable TIMESTAMP {s!r} (UTC offset out of range)")
            shift = (hh * 3600 + mm * 60) * (1 if m.group(1) == "+" else -1)
        text = text[: m.start()]
    whole, _, frac = text.partition(".")
    try:
        dt = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise _Bad(f"unparsable TIMESTAMP {s!r}") from None
    if frac and (not frac.isdigit() or len(frac) > 9):
        raise _Bad(f"unparsable TIMESTAMP {s!r}")
    secs = (dt.toordinal() * 86400 + dt.hour * 3600 + dt.minute * 60 + dt.second) - shift
    # strptime's %f stops at 6 digits; keep all of the 7 (100 ns) digits exactly.
    return secs * 10**9 + (int(frac.ljust(9, "0")) if frac else 0), zoned


def _parse_count(v: str, name: str, minimum: int) -> int:
    v = v.strip()
    if not (v.isdigit() or (v[:1] == "-" and v[1:].isdigit())):
        raise _Bad(f"{name} must be an int, got {v!r}")
    return _int_field(int(v), name, minimum)


def read_azure(path: PathLike, limit: Optional[int] = None, rate_scale: float = 1.0,
               skip_bad_rows: bool = False) -> Trace:
    """Read an Azure LLM inference CSV trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    arrival_s = (row time - earliest kept row time) / rate_scale [s]; for the (time-sorted)
    Azure files the earliest row is the first. Prompts are unique per request: tokens come from
    a seed hashed from the file name and the row index. Arguments as in `read_mooncake`; a bad
    header raises TraceFormatError even with skip_bad_rows.
    """
    p = _check_args(path, limit, rate_scale)
    salt = zlib.crc32(p.name.encode())  # trace-specific, stable across runs (unlike hash())
    zones: List[bool] = []  # whether the first kept row's timestamp has a UTC offset

    def parse(cols: list, idx: int) -> tuple:
        if len(cols) != 3:
            raise _Bad(f"expected 3 columns, got {len(cols)}")
        t_ns, zoned = _parse_wallclock_ns(cols[0])
        if zones and zoned != zones[0]:  # a naive time next to zoned ones has no instant to order by
            raise _Bad(f"TIMESTAMP {cols[0].strip()!r} {'has' if zoned else 'lacks'} a UTC offset, "
                       f"unlike the first row's")
        n_in = _parse_count(cols[1], "ContextTokens", 1)
        n_out = _parse_count(cols[2], "GeneratedTokens", 0)
        zones[:] = zones or [zoned]
        return t_ns, n_in, n_out, idx

    with _text(p, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip().lstrip("\ufeff") for h in header] != _AZURE_HEADER:
            raise TraceFormatError(f"{p.name} line 1: expected header {','.join(_AZURE_HEADER)}, "
                                   f"got {header!r}")
        rows = ((reader.line_num, c) for c in reader if c)  # line_num: 1-based, header is 1
        good, bad = _collect(p, rows, parse, limit, skip_bad_rows)
    t0 = min((r[0] for r in good), default=0)
    reqs = [TraceRequest(index=i, arrival_s=(t - t0) / 1e9 / rate_scale, input_len=n_in,
                         output_len=n_out, output_key=i,
                         segments=((_key(_D_PROMPT, salt, i), 0, n_in),))
            for t, n_in, n_out, i in good]
    return _finish(p.stem, p, reqs, bad, rate_scale)


def read_trace(path: PathLike, limit: Optional[int] = None, rate_scale: float = 1.0,
               skip_bad_rows: bool = False) -> Trace:
    """Read a trace, picking the format from the extension (.jsonl/.json: Mooncake, .csv: Azure)
    or else from the first non-blank line (``{`` -> Mooncake, ``TIMESTAMP`` header -> Azure)."""
    p = _check_args(path, limit, rate_scale)
    suffix = p.suffix.lower()
    if suffix not in (".jsonl", ".json", ".csv"):
        with _text(p) as f:
            first = next((ln.strip() for ln in f if ln.strip()), "")
        suffix = ".jsonl" if first.startswith("{") else ".csv" if first.startswith("TIMESTAMP") else ""
        if not suffix:
            raise TraceFormatError(f"{p.name} line 1: unknown trace format")
    reader = read_azure if suffix == ".csv" else read_mooncake
    return reader(p, limit=limit, rate_scale=rate_scale, skip_bad_rows=skip_bad_rows)


def _check_range(name: str, r: Sequence[int], lo_min: int) -> tuple:
    if len(r) != 2 or not (lo_min <= r[0] <= r[1]):
        raise ValueError(f"{name} must be a (lo, hi) range with {lo_min} <= lo <= hi, got {r!r}")
    return int(r[0]), int(r[1])


def synthetic_workload(num_requests: int = 400, *, seed: int = 0, request_rate: float = 8.0,
                       num_groups: int = 8, system_prompt_len: int = 1024,
                       user_len: tuple = (64, 512), output_len: tuple = (32, 256),
                       turns: tuple = (1, 4), think_time_s: float = 2.0) -> Trace:
    """A seeded multi-turn chat workload with real prefix sharing, named "synthetic".

    Sessions start as a Poisson process of rate request_rate / mean(turns) [sessions/s], so
    the long-run request rate is about `request_rate` [req/s]. Each session picks one of
    `num_groups` shared system prompts (`system_prompt_len` tokens) and runs
    uniform-in-`turns` turns (inclusive ranges; the last session is cut to `num_requests`).
    Turn k's prompt = system prompt + every earlier turn's user message and output + a new
    user message of uniform-in-`user_len` tokens; its output has uniform-in-`output_len`
    tokens, generated by `output_token_ids(req.output_key, ...)`. Turn k+1 arrives turn k's
    arrival + Exp(mean `think_time_s`) [s]. Requests are sorted by arrival and `index` is
    renumbered in that order; `output_key` keeps the creation id. Same seed => same trace.
    """
    if num_requests < 0 or request_rate <= 0 or not math.isfinite(request_rate):
        raise ValueError(f"need num_requests >= 0 and finite request_rate > 0, "
                         f"got {num_requests!r}, {request_rate!r}")
    if num_groups < 1 or system_prompt_len < 0 or think_time_s < 0:
        raise ValueError(f"need num_groups >= 1, system_prompt_len >= 0, think_time_s >= 0, got "
                         f"{num_groups!r}, {system_prompt_len!r}, {think_time_s!r}")
    u_lo, u_hi = _check_range("user_len", user_len, 1)  # >= 1 keeps every prompt non-empty
    o_lo, o_hi = _check_range("output_len", output_len, 0)
    t_lo, t_hi = _check_range("turns", turns, 1)
    rng = np.random.default_rng(seed)
    session_rate = request_rate / ((t_lo + t_hi) / 2)
    created: list = []
    t_start, session = 0.0, 0
    while len(created) < num_requests:
        t_start += float(rng.exponential(1.0 / session_rate))
        group = int(rng.integers(num_groups))
        n_turns = min(int(rng.integers(t_lo, t_hi + 1)), num_requests - len(created))
        history = ((_key(_D_SYS, seed, group), 0, system_prompt_len),) if system_prompt_len else ()
        t = t_start
        for turn in range(n_turns):
            if turn:
                t += float(rng.exponential(think_time_s)) if think_time_s > 0 else 0.0
            n_user = int(rng.integers(u_lo, u_hi + 1))
            n_out = int(rng.integers(o_lo, o_hi + 1))
            key = len(created)
            segs = history + ((_key(_D_USER, seed, session, turn), 0, n_user),)
            created.append(TraceRequest(index=-1, arrival_s=t, input_len=sum(s[2] for s in segs),
                                        output_len=n_out, session=session, turn=turn,
                                        output_key=key, segments=segs))
            # The next turn's prompt replays this turn's output tokens, like a chat template.
            history = segs + (((_key(_D_OUT, key), 0, n_out),) if n_out else ())
        session += 1
    created.sort(key=lambda r: r.arrival_s)  # stable: a session's turns stay in order
    return Trace(name="synthetic", requests=[replace(r, index=i) for i, r in enumerate(created)])


def _common_lead(blocks: List[Sequence[int]]) -> int:
    """How many leading prefix blocks every one of `blocks` (hash-id sequences) has in common
    (0 for none given)."""
    if not blocks:
        return 0
    first, lead = blocks[0], len(blocks[0])
    for h in blocks[1:]:
        k, m = 0, min(lead, len(h))
        while k < m and h[k] == first[k]:
            k += 1
        lead = k
        if not lead:
            break
    return lead


def assign_keys(trace: Trace, *, routing_keys: int = 0, priority_levels: int = 0, seed: int = 0) -> Trace:
    """A copy of `trace` whose requests carry routing keys and priorities, which no public
    trace records, so that the routing-key policy (R-ORD-7) and priority scheduling have
    something to order by.

    routing_keys N >= 1: request -> "key{j}", j in [0, N): for a Mooncake request from its
    first prefix block that not every request of the trace shares (`hash_ids[b] % N`, b = the
    length of the leading blocks all requests with blocks have in common, or its last block
    if it has no other: in the Mooncake trace every request starts with block 0, a shared
    system prompt, so b = 1 and a conversation's turns, which share their first 1k tokens,
    share a key), from the session for a synthetic one (`session % N`), else drawn uniformly
    (seeded). 0: no keys (None).
    priority_levels K >= 1: priorities drawn uniformly from [0, K) (seeded by `seed`); 0: none.
    Deterministic: the same arguments give the same keys on every machine.
    Raises ValueError for a negative count, TypeError for a non-int."""
    for name, v in (("routing_keys", routing_keys), ("priority_levels", priority_levels), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"assign_keys: {name} must be an int, got {v!r}")
        if v < 0:
            raise ValueError(f"assign_keys: {name} must be >= 0, got {v}")
    rng = np.random.default_rng(seed)
    n = len(trace.requests)
    drawn = rng.integers(0, max(routing_keys, 1), n)
    prio = rng.integers(0, max(priority_levels, 1), n)
    lead = _common_lead([r.hash_ids for r in trace.requests if r.hash_ids]) if routing_keys else 0
    reqs = []
    for i, r in enumerate(trace.requests):
        key, p = None, None
        if routing_keys:
            if r.hash_ids:
                j = int(r.hash_ids[min(lead, len(r.hash_ids) - 1)]) % routing_keys
            elif r.session is not None:
                j = int(r.session) % routing_keys
            else:
                j = int(drawn[i])
            key = f"key{j}"
        if priority_levels:
            p = int(prio[i])
        reqs.append(replace(r, routing_key=key, priority=p))
    return Trace(name=trace.name, requests=reqs, bad_rows=trace.bad_rows, source=trace.source)


def trace_stats(trace: Trace) -> dict:
    """Summary statistics of a trace.

    Keys: num_requests; duration_s (last - first arrival [s]); request_rate
    (num_requests / duration_s [req/s], nan if duration is 0); input_mean/p50/p99 and
    output_mean/p50/p99 [tokens] (numpy linear-interpolated percentiles; nan if empty);
    total_input_tokens, total_output_tokens; burstiness: interarrival_cv (std / mean of the
    gaps between consecutive arrivals: 1 for Poisson arrivals, above 1 for bursts; nan with
    fewer than two gaps or a zero mean), max_gap_s [s], peak_rate_60s (the most arrivals in
    any 60 s window / 60 [req/s]; nan when the trace spans under 60 s); repeat_block_frac: for
    traces whose requests all have hash_ids, the fraction of prompt blocks (in arrival order)
    equal to an earlier block -- an upper bound on the prefix-cache block hit rate with an
    infinite cache -- else None.
    """
    reqs = trace.requests
    n = len(reqs)
    arr = np.fromiter((r.arrival_s for r in reqs), dtype=np.float64, count=n)
    inp = np.fromiter((r.input_len for r in reqs), dtype=np.int64, count=n)
    out = np.fromiter((r.output_len for r in reqs), dtype=np.int64, count=n)
    duration = float(arr.max() - arr.min()) if n else 0.0

    def summ(x: np.ndarray, pre: str) -> dict:
        if not n:
            return {f"{pre}_mean": math.nan, f"{pre}_p50": math.nan, f"{pre}_p99": math.nan}
        return {f"{pre}_mean": float(x.mean()), f"{pre}_p50": float(np.percentile(x, 50)),
                f"{pre}_p99": float(np.percentile(x, 99))}

    repeat = None
    if n and all(r.hash_ids is not None for r in reqs):
        ids = np.fromiter((h for r in reqs for h in r.hash_ids), dtype=np.int64)
        # Every occurrence after an id's first one is a block an infinite cache would hold.
        repeat = float(1.0 - len(np.unique(ids)) / len(ids)) if len(ids) else 0.0
    gaps = np.diff(np.sort(arr))
    cv = float(gaps.std() / gaps.mean()) if gaps.size >= 2 and gaps.mean() > 0 else math.nan
    if duration >= 60:  # arrivals in [t, t + 60) for every arrival time t: the busiest minute
        a = np.sort(arr)
        peak = float((np.searchsorted(a, a + 60.0, side="left") - np.arange(n)).max() / 60.0)
    else:
        peak = math.nan
    return {"num_requests": n, "duration_s": duration,
            "request_rate": n / duration if duration > 0 else math.nan,
            "interarrival_cv": cv, "max_gap_s": float(gaps.max()) if gaps.size else math.nan,
            "peak_rate_60s": peak,
            **summ(inp, "input"), **summ(out, "output"),
            "total_input_tokens": int(inp.sum()), "total_output_tokens": int(out.sum()),
            "repeat_block_frac": repeat}
