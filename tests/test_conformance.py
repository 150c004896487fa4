"""The reference passes every shared conformance scenario (../shared/conformance), via the
runner and via the `gpu-sched conformance` command line."""

import gzip
import json
from pathlib import Path

import pytest

from gpu_sched.cli import main
from gpu_sched.conformance import compare, read_scenarios, run_file
from gpu_sched.reference import ReferenceScheduler

SCENARIOS = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "scenarios.jsonl.gz"


def factory(cfg, kv, shuffle=None):
    return ReferenceScheduler(cfg, kv, shuffle=shuffle)


@pytest.fixture(scope="module")
def scenarios_path():
    if not SCENARIOS.is_file():
        pytest.skip(f"conformance scenarios not available: {SCENARIOS}")
    return SCENARIOS


def test_reference_passes_every_scenario(scenarios_path):
    failures = []
    passed, failed = run_file(scenarios_path, factory, echo=failures.append)
    assert failed == 0, failures[:10]
    assert passed > 0
    assert failures[-1] == f"{passed} passed, 0 failed"
    assert passed == sum(1 for _ in read_scenarios(scenarios_path))


def test_cli_conformance_reference(scenarios_path, capsys):
    rc = main(["conformance", str(scenarios_path), "--backend", "reference"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert out[-1].endswith("0 failed")


def test_cli_missing_file_exit_code_2(tmp_path, capsys):
    rc = main(["conformance", str(tmp_path / "nope.jsonl.gz"), "--backend", "reference"])
    assert rc == 2
    assert "not found" in capsys.readouterr().err


def test_cli_unknown_backend_exit_code_2(tmp_path, capsys):
    rc = main(["conformance", str(tmp_path / "x.jsonl"), "--backend", "nonesuch"])
    assert rc == 2
    assert "unknown backend" in capsys.readouterr().err


def _one_scenario(expected_admitted):
    """A tiny hand-written scenario (FORMAT.md): one waiting request of 3 tokens, pool 100."""
    cfg = {
        "policy": "fcfs", "page_size": 1, "max_prefill_tokens": 16384, "chunked_prefill_size": 8192,
        "max_running_requests": None, "enable_priority_scheduling": False,
        "schedule_low_priority_values_first": False, "priority_preemption_threshold": 10,
        "enable_priority_preemption": False, "lpm_fallback": False, "enable_mixed_chunk": False,
        "prefill_max_requests": None, "truncation_align_size": None, "disable_radix_cache": False,
        "new_token_ratio": 1.0, "running_batch_is_full": False,
    }
    waiting = [{"rid": "a", "prompt": [1, 2, 3], "max_new_tokens": 4, "enqueue_time": 0}]
    return {"id": "hand-1", "input": {"config": cfg, "kv_pool_size": 100, "cache": [], "running": [],
                                      "chunked": None, "waiting": waiting},
            "expected": {"admitted": expected_admitted, "stop": "queue_end",
                         # commit(0, 3, 4): I = 3 + 4 + 1 = 8
                         "budgets": {"rem_total": 92.0, "cur_rem": 96, "rem_input": 16381, "rem_chunk": 8189}}}


def test_runner_on_hand_written_file_pass_and_fail(tmp_path, capsys):
    """The runner reports the first differing field; a CLI run with a failure exits 1."""
    path = tmp_path / "s.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(_one_scenario([["a", 0, 3]])) + "\n")
        f.write(json.dumps(_one_scenario([["a", 0, 2]])) + "\n")
    lines = []
    assert run_file(path, factory, echo=lines.append) == (1, 1)
    assert lines[0].startswith("FAIL hand-1: admitted")
    assert lines[-1] == "1 passed, 1 failed"
    assert main(["conformance", str(path)]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("1 failed")


def test_compare_checks_float_bits():
    """rem_total is compared bit for bit (D7): 0.0 and -0.0 differ."""
    mine = {"budgets": {"rem_total": -0.0, "cur_rem": 1, "rem_input": 2, "rem_chunk": None}}
    want = {"budgets": {"rem_total": 0.0, "cur_rem": 1, "rem_input": 2, "rem_chunk": None}}
    assert compare(mine, want) is not None
    assert compare(want, want) is None


def test_a_scenario_with_nothing_expected_fails():
    """An `expected` with no field to compare (only `random_permutation`, or nothing) checks
    nothing: it fails rather than passing unchecked."""
    assert compare({"stop": "queue_end"}, {}) == "expected holds no field to compare"
    assert compare({"stop": "queue_end"}, {"random_permutation": [0]}) == "expected holds no field to compare"
    assert compare({"stop": "queue_end"}, {"stop": "queue_end"}) is None
