"""Tests for gpu_sched.sim.traces: real-trace readers, malformed rows, synthetic workload, stats."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from gpu_sched.sim.traces import (
    BLOCK_TOKENS, Trace, TraceFormatError, TraceRequest, assign_keys, output_token_ids, read_azure,
    read_mooncake, read_trace, synthetic_workload, trace_stats,
)

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
AZURE = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"


def _need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"trace not available: {path}")
    return path


@pytest.fixture(scope="module")
def mooncake():
    return read_mooncake(_need(MOONCAKE))


@pytest.fixture(scope="module")
def azure():
    return read_azure(_need(AZURE))


def _arrivals(trace):
    return np.array([r.arrival_s for r in trace.requests])


# ---- real traces -------------------------------------------------------------------------

def test_mooncake_full_read(mooncake):
    assert len(mooncake) == 12031 and mooncake.bad_rows == 0
    assert mooncake.name == "conversation_trace"
    r0 = mooncake[0]
    assert (r0.index, r0.arrival_s, r0.input_len, r0.output_len) == (0, 0.0, 6758, 500)
    assert r0.hash_ids == tuple(range(14)) and r0.output_key == 0
    arr = _arrivals(mooncake)
    assert arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
    assert all(len(r.hash_ids) == math.ceil(r.input_len / BLOCK_TOKENS) for r in mooncake)


def test_azure_full_read(azure):
    assert len(azure) == 8819 and azure.bad_rows == 0
    r0, r1 = azure[0], azure[1]
    assert (r0.index, r0.arrival_s, r0.input_len, r0.output_len) == (0, 0.0, 4808, 10)
    assert r0.hash_ids is None and r0.session is None
    # 18:17:04.0319600 - 18:17:03.9799600, exact to the 100 ns digit
    assert r1.arrival_s == pytest.approx(0.052, abs=1e-9)
    assert (r1.input_len, r1.output_len) == (3180, 8)
    arr = _arrivals(azure)
    assert np.all(np.diff(arr) >= 0) and 3000 < arr[-1] < 3700


def test_read_trace_dispatch_limit_and_rate_scale():
    m = read_trace(_need(MOONCAKE), limit=50)
    a = read_trace(_need(AZURE), limit=50, rate_scale=2.0)
    assert len(m) == 50 and m[0].hash_ids is not None
    assert len(a) == 50 and a[0].hash_ids is None
    a1 = read_azure(AZURE, limit=50)
    np.testing.assert_allclose(_arrivals(a), _arrivals(a1) / 2.0)
    m4 = read_mooncake(MOONCAKE, limit=400, rate_scale=0.5)
    m1 = read_mooncake(MOONCAKE, limit=400)
    np.testing.assert_allclose(_arrivals(m4), _arrivals(m1) * 2.0)
    assert _arrivals(m1)[-1] > 0
    assert len(read_mooncake(MOONCAKE, limit=0)) == 0


def test_read_trace_sniffs_content(tmp_path):
    p = tmp_path / "trace.txt"
    p.write_text('\n{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [5]}\n')
    assert len(read_trace(p)) == 1 and read_trace(p)[0].hash_ids is not None
    q = tmp_path / "trace.dat"
    q.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,5,1\n")
    assert read_trace(q)[0].input_len == 5
    u = tmp_path / "trace.bin"
    u.write_text("hello\n")
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        read_trace(u)


def test_prompt_tokens_mooncake(mooncake):
    r0, r1, r2 = mooncake[0], mooncake[1], mooncake[2]
    p0, p1, p2 = r0.prompt_ids(), r1.prompt_ids(), r2.prompt_ids()
    for r, p in ((r0, p0), (r1, p1), (r2, p2)):
        assert p.dtype == np.int32 and p.shape == (r.input_len,) and not p.flags.writeable
        assert p.min() >= 0 and p.max() < 2**31 - 1
    # rows 0..2 all start with hash id 0, then diverge: shared prefix of exactly one block
    assert r0.hash_ids[0] == r1.hash_ids[0] == r2.hash_ids[0] == 0
    np.testing.assert_array_equal(p0[:BLOCK_TOKENS], p1[:BLOCK_TOKENS])
    np.testing.assert_array_equal(p0[:BLOCK_TOKENS], p2[:BLOCK_TOKENS])
    assert p0[BLOCK_TOKENS] != p1[BLOCK_TOKENS]
    np.testing.assert_array_equal(p0, r0.prompt_ids())  # deterministic
    # a block id means the same 512 tokens wherever it appears
    a = TraceRequest(0, 0.0, 3 * BLOCK_TOKENS, 1, hash_ids=(7, 8, 9)).prompt_ids()
    b = TraceRequest(1, 0.0, 2 * BLOCK_TOKENS + 10, 1, hash_ids=(1, 8, 3)).prompt_ids()
    np.testing.assert_array_equal(a[BLOCK_TOKENS:2 * BLOCK_TOKENS], b[BLOCK_TOKENS:2 * BLOCK_TOKENS])
    assert len(b) == 2 * BLOCK_TOKENS + 10


def test_distinct_ids_give_distinct_runs():
    ids = tuple(range(1000))
    p = TraceRequest(0, 0.0, 1000 * BLOCK_TOKENS, 1, hash_ids=ids).prompt_ids()
    firsts = p.reshape(1000, BLOCK_TOKENS)[:, 0]
    assert len(np.unique(firsts)) == 1000


def test_prompt_tokens_azure_unique(azure):
    reqs = azure.requests[:200]
    prompts = [r.prompt_ids() for r in reqs]
    assert all(p.shape == (r.input_len,) and p.dtype == np.int32 for r, p in zip(reqs, prompts))
    heads = {tuple(p[:4]) for p in prompts}
    assert len(heads) == len(prompts)
    np.testing.assert_array_equal(prompts[0], read_azure(AZURE, limit=1)[0].prompt_ids())


def test_output_token_ids():
    a = output_token_ids(3, 0, 100)
    assert a.dtype == np.int32 and a.shape == (100,) and not a.flags.writeable
    np.testing.assert_array_equal(output_token_ids(3, 40, 10), a[40:50])
    assert not np.array_equal(output_token_ids(4, 0, 100), a)
    r = TraceRequest(3, 0.0, 100, 5, hash_ids=(0,), output_key=3)
    np.testing.assert_array_equal(r.output_ids(0, 100), a)
    assert len(np.intersect1d(a, r.prompt_ids())) == 0
    assert output_token_ids(0, 0, 0).shape == (0,)
    hand = TraceRequest(9, 0.0, 7, 1).prompt_ids()  # no hash_ids/segments: unique per index
    assert hand.shape == (7,) and not np.array_equal(hand, TraceRequest(8, 0.0, 7, 1).prompt_ids())
    with pytest.raises(ValueError):
        output_token_ids(-1, 0, 3)


# ---- malformed rows ----------------------------------------------------------------------

GOOD_M = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
BAD_M = [
    ("{not json", "bad JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({k: v for k, v in GOOD_M.items() if k != "output_length"}), "missing field 'output_length'"),
    (json.dumps({**GOOD_M, "input_length": -3}), "input_length must be a positive int, got -3"),
    (json.dumps({**GOOD_M, "input_length": 0}), "input_length must be a positive int"),
    (json.dumps({**GOOD_M, "input_length": 6.5}), "input_length must be a positive int"),
    (json.dumps({**GOOD_M, "output_length": -1}), "output_length must be a non-negative int"),
    (json.dumps({**GOOD_M, "timestamp": "x"}), "timestamp must be a non-negative int"),
    (json.dumps({**GOOD_M, "hash_ids": [0, 1, 2]}), "hash_ids has 3 ids, expected"),
    (json.dumps({**GOOD_M, "hash_ids": [0, -1]}), "hash_ids must be a list of ints"),
]


@pytest.mark.parametrize("line,msg", BAD_M)
def test_mooncake_bad_rows(tmp_path, line, msg):
    p = tmp_path / "t.jsonl"
    good = json.dumps(GOOD_M)
    p.write_text("\n".join([good, "", good, line, good]) + "\n")  # bad row on line 4
    with pytest.raises(TraceFormatError) as ei:
        read_mooncake(p)
    assert str(ei.value).startswith("t.jsonl line 4: ") and msg in str(ei.value)
    t = read_mooncake(p, skip_bad_rows=True)
    assert len(t) == 3 and t.bad_rows == 1 and [r.index for r in t] == [0, 1, 2]


AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens"
AZ_GOOD = "2023-11-16 18:17:03.9799600,4808,10"
BAD_A = [
    ("2023-11-16 18:17:04.1,5", "expected 3 columns, got 2"),
    ("2023-11-16 18:17:04.1,5,1,2", "expected 3 columns, got 4"),
    ("yesterday,5,1", "unparsable TIMESTAMP"),
    ("2023-11-16 18:17:04.1x,5,1", "unparsable TIMESTAMP"),
    ("2023-11-16 18:17:04.1,0,1", "ContextTokens must be a positive int, got 0"),
    ("2023-11-16 18:17:04.1,1.5,1", "ContextTokens must be an int"),
    ("2023-11-16 18:17:04.1,5,-2", "GeneratedTokens must be a non-negative int, got -2"),
]


@pytest.mark.parametrize("line,msg", BAD_A)
def test_azure_bad_rows(tmp_path, line, msg):
    p = tmp_path / "a.csv"
    p.write_text("\n".join([AZ_HEAD, AZ_GOOD, line, AZ_GOOD]) + "\n")  # bad row on line 3
    with pytest.raises(TraceFormatError) as ei:
        read_azure(p)
    assert str(ei.value).startswith("a.csv line 3: ") and msg in str(ei.value)
    t = read_azure(p, skip_bad_rows=True)
    assert len(t) == 2 and t.bad_rows == 1


def test_azure_bad_header_and_skip_count(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text("time,in,out\n" + AZ_GOOD + "\n")
    with pytest.raises(TraceFormatError, match="h.csv line 1: expected header"):
        read_azure(p, skip_bad_rows=True)
    q = tmp_path / "many.csv"
    q.write_text("\n".join([AZ_HEAD, AZ_GOOD] + [b for b, _ in BAD_A] + [AZ_GOOD]))
    t = read_azure(q, skip_bad_rows=True)
    assert len(t) == 2 and t.bad_rows == len(BAD_A)
    assert read_azure(q, skip_bad_rows=True, limit=1).bad_rows == 0  # stops after 1 valid row


def test_missing_file_and_bad_args(tmp_path):
    missing = tmp_path / "nope.jsonl"
    for reader in (read_mooncake, read_azure, read_trace):
        with pytest.raises(FileNotFoundError, match="nope.jsonl"):
            reader(missing)
    for reader in (read_mooncake, read_azure, read_trace):
        with pytest.raises(FileNotFoundError, match="is a directory, not a trace file; it holds no .jsonl or .csv"):
            reader(tmp_path)  # empty so far
    p = tmp_path / "ok.jsonl"
    p.write_text(json.dumps(GOOD_M) + "\n")
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rate_scale"):
            read_mooncake(p, rate_scale=bad)
    with pytest.raises(ValueError, match="limit"):
        read_mooncake(p, limit=-1)


def test_unsorted_file_sorted_stably(tmp_path):
    p = tmp_path / "u.jsonl"
    rows = [{**GOOD_M, "timestamp": ts, "output_length": i} for i, ts in enumerate([2000, 0, 2000, 1000])]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = read_mooncake(p)
    assert [r.index for r in t] == [1, 3, 0, 2] and [r.arrival_s for r in t] == [0.0, 1.0, 2.0, 2.0]


# ---- synthetic ---------------------------------------------------------------------------

def test_synthetic_deterministic():
    a, b = synthetic_workload(120, seed=5), synthetic_workload(120, seed=5)
    c = synthetic_workload(120, seed=6)
    assert a.name == "synthetic" and len(a) == 120
    assert a.requests == b.requests
    assert all(np.array_equal(x.prompt_ids(), y.prompt_ids()) for x, y in zip(a, b))
    assert a.requests != c.requests
    assert not np.array_equal(a[0].prompt_ids()[:64], c[0].prompt_ids()[:64])
    arr = _arrivals(a)
    assert np.all(np.diff(arr) >= 0) and [r.index for r in a] == list(range(120))
    assert len({r.output_key for r in a}) == 120


def test_synthetic_multi_turn_prefix_sharing():
    t = synthetic_workload(200, seed=1, turns=(2, 4), system_prompt_len=256)
    by_session = {}
    for r in t:
        by_session.setdefault(r.session, []).append(r)
    pairs = 0
    for turns in by_session.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.arrival_s >= prev.arrival_s
            pp, pn = prev.prompt_ids(), nxt.prompt_ids()
            out = output_token_ids(prev.output_key, 0, prev.output_len)
            np.testing.assert_array_equal(pn[: len(pp)], pp)
            np.testing.assert_array_equal(pn[len(pp): len(pp) + prev.output_len], out)
            assert nxt.input_len > prev.input_len + prev.output_len
            pairs += 1
    assert pairs > 50
    # sessions of one group share the system prompt; lengths within the ranges
    for r in t:
        assert r.prompt_ids().shape == (r.input_len,)
        assert 32 <= r.output_len <= 256
    firsts = {tuple(r.prompt_ids()[:256]) for r in t if r.turn == 0}
    assert 1 < len(firsts) <= 8


def test_synthetic_bad_args():
    with pytest.raises(ValueError, match="user_len"):
        synthetic_workload(10, user_len=(0, 5))
    with pytest.raises(ValueError, match="request_rate"):
        synthetic_workload(10, request_rate=0)
    assert len(synthetic_workload(0)) == 0


# ---- stats -------------------------------------------------------------------------------

def test_trace_stats_hand_checked():
    reqs = [
        TraceRequest(0, 0.0, 600, 10, hash_ids=(0, 1)),
        TraceRequest(1, 1.0, 1000, 20, hash_ids=(0, 2)),
        TraceRequest(2, 2.0, 1500, 30, hash_ids=(0, 2, 3)),
        TraceRequest(3, 4.0, 100, 40, hash_ids=(4,)),
    ]
    s = trace_stats(Trace("hand", reqs))
    assert s["num_requests"] == 4 and s["duration_s"] == 4.0 and s["request_rate"] == 1.0
    assert s["input_mean"] == 800.0 and s["input_p50"] == 800.0
    assert s["input_p99"] == pytest.approx(1000 + 0.97 * 500)  # numpy linear interpolation
    assert s["output_mean"] == 25.0 and s["output_p50"] == 25.0
    assert s["total_input_tokens"] == 3200 and s["total_output_tokens"] == 100
    # blocks in arrival order: 0 1 | 0 2 | 0 2 3 | 4 -> repeats: 0, 0, 2 = 3 of 8
    assert s["repeat_block_frac"] == 3 / 8
    e = trace_stats(Trace("empty", []))
    assert e["num_requests"] == 0 and math.isnan(e["input_mean"]) and e["repeat_block_frac"] is None


def test_trace_stats_real(mooncake, azure):
    s = trace_stats(mooncake)
    assert s["num_requests"] == 12031 and 0.0 < s["repeat_block_frac"] < 1.0
    assert s["duration_s"] > 3000 and s["request_rate"] == pytest.approx(12031 / s["duration_s"])
    assert trace_stats(azure)["repeat_block_frac"] is None


def test_assign_keys_on_mooncake_tell_conversations_apart(mooncake):
    """On the Mooncake trace (every request's first block is block 0) `--routing-keys 16`
    spreads the requests over all 16 keys, none holding most of them, and a conversation's
    turns (requests sharing their first two blocks) share one."""
    out = assign_keys(mooncake, routing_keys=16)
    counts = np.bincount([int(r.routing_key[3:]) for r in out.requests], minlength=16)
    assert (counts > 0).all() and counts.max() < len(out.requests) // 4, counts
    by_pair = {}
    for r in out.requests:
        if len(r.hash_ids) >= 2:
            by_pair.setdefault(tuple(r.hash_ids[:2]), set()).add(r.routing_key)
    assert sum(len(v) > 1 for v in by_pair.values()) == 0 and max(map(len, by_pair.values())) == 1


def test_assign_keys_groups_by_prefix_and_session():
    """Routing keys follow a request's first prefix block (Mooncake) or its session (synthetic),
    else a seeded draw; priorities are seeded draws in [0, K); the input trace is unchanged."""
    reqs = [TraceRequest(index=0, arrival_s=0.0, input_len=600, output_len=1, hash_ids=(7, 8)),
            TraceRequest(index=1, arrival_s=0.1, input_len=600, output_len=1, hash_ids=(7, 9)),
            TraceRequest(index=2, arrival_s=0.2, input_len=600, output_len=1, hash_ids=(12,)),
            TraceRequest(index=3, arrival_s=0.3, input_len=10, output_len=1, session=5),
            TraceRequest(index=4, arrival_s=0.4, input_len=10, output_len=1)]
    tr = Trace(name="t", requests=reqs, source="src")
    out = assign_keys(tr, routing_keys=4, priority_levels=3, seed=1)
    keys = [r.routing_key for r in out.requests]
    assert keys[:4] == ["key3", "key3", "key0", "key1"] and keys[4] in {f"key{j}" for j in range(4)}
    assert all(0 <= r.priority < 3 for r in out.requests) and len({r.priority for r in out.requests}) > 1
    assert out == assign_keys(tr, routing_keys=4, priority_levels=3, seed=1)  # deterministic
    assert out.source == "src" and all(r.routing_key is None and r.priority is None for r in tr.requests)
    assert [r.prompt_ids().tolist() for r in out.requests] == [r.prompt_ids().tolist() for r in reqs]
    # every request starts with the same block (the Mooncake trace's block 0, a shared system
    # prompt): keys come from the first block that tells them apart, the last one if none does
    shared = Trace(name="s", requests=[TraceRequest(index=i, arrival_s=0.1 * i, input_len=1000, output_len=1, hash_ids=h)
                                       for i, h in enumerate([(0, 7, 8), (0, 7, 9), (0, 10), (0,), (0, 5)])])
    assert [r.routing_key for r in assign_keys(shared, routing_keys=4).requests] == ["key3", "key3", "key2", "key0", "key1"]
    none = assign_keys(tr, routing_keys=0, priority_levels=0)
    assert all(r.routing_key is None and r.priority is None for r in none.requests)
    with pytest.raises(ValueError, match="routing_keys must be >= 0"):
        assign_keys(tr, routing_keys=-1)
    with pytest.raises(TypeError, match="priority_levels must be an int"):
        assign_keys(tr, priority_levels=2.0)


def test_azure_timestamps_with_utc_offsets(tmp_path):
    """The 2024 Azure files write `+00:00` after each timestamp: an offset is taken to UTC, so
    rows written in different zones order by their instants; `Z` is UTC; malformed ones are
    refused with the row named."""
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2024-05-10 00:00:00.009930+00:00,10,2\n"
                 "2024-05-10 02:00:01.5+02:00,10,2\n"  # 00:00:01.5 UTC
                 "2024-05-10 00:00:03Z,10,2\n"
                 "2024-05-09 22:30:04-01:30,10,2\n")  # 00:00:04 UTC, the next day
    tr = read_azure(p)
    assert [r.arrival_s for r in tr.requests] == pytest.approx([0.0, 1.49007, 2.99007, 3.99007])
    bad = tmp_path / "bad.csv"
    for row, why in (("2024-05-10 00:00:00+0", "unparsable TIMESTAMP"),
                     ("2024-05-10 00:00:00+24:00", "UTC offset out of range"),
                     ("2024-05-10 00:00:00-00:75", "UTC offset out of range")):
        bad.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{row},10,2\n")
        with pytest.raises(ValueError, match=f"line 2.*{why}"):
            read_azure(bad)
    # a naive time among zoned ones (or the other way round) has no instant to order by
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00+00:00,10,2\n"
                   "2024-05-10 00:00:01,10,2\n2024-05-10 00:00:02+00:00,10,2\n")
    with pytest.raises(ValueError, match="line 3.*lacks a UTC offset, unlike the first row's"):
        read_azure(bad)
    assert [r.arrival_s for r in read_azure(bad, skip_bad_rows=True).requests] == [0.0, 2.0]


def test_trace_stats_burstiness():
    reqs = [TraceRequest(i, t, 10, 1) for i, t in enumerate([0.0, 1.0, 2.0, 10.0, 70.0, 71.0])]
    s = trace_stats(Trace("b", reqs))
    gaps = np.array([1.0, 1.0, 8.0, 60.0, 1.0])
    assert s["interarrival_cv"] == pytest.approx(gaps.std() / gaps.mean()) and s["max_gap_s"] == 60.0
    assert s["peak_rate_60s"] == pytest.approx(4 / 60)  # [0, 60) holds 4; [10, 70) 1; [70, 130) 2
    edge = trace_stats(Trace("e", [TraceRequest(0, 0.0, 10, 1), TraceRequest(1, 60.0, 10, 1)]))
    assert edge["peak_rate_60s"] == pytest.approx(1 / 60)  # [t, t + 60): the arrival at 60 s is the next window's
    short = trace_stats(Trace("s", reqs[:3]))
    assert math.isnan(short["peak_rate_60s"]) and short["interarrival_cv"] == pytest.approx(0.0)
    assert math.isnan(trace_stats(Trace("one", reqs[:1]))["interarrival_cv"])
