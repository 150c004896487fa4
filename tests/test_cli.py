"""Tests for the `gpu-sched` command line (replay, trace-stats, error handling)."""

import json
import os
import subprocess
import sys
import re
from pathlib import Path

import pytest
import torch

from gpu_sched.cli import BACKENDS, build_parser, config_from_args, main

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
AZURE = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
DIGEST = re.compile(r"^decision digest: ([0-9a-f]{64})$", re.M)


def test_replay_synthetic_prints_summary_and_digest(capsys):
    assert main(["replay", "--synthetic-requests", "40", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "Mean TTFT (ms):" in out
    assert re.search(r"Successful requests:\s+40\n", out)
    assert len(DIGEST.findall(out)) == 1


def test_replay_says_what_it_replayed_and_that_serving_figures_are_simulated(capsys):
    """The lines above the summary name the workload, the cost model (its figures are
    simulated time, not measured) and the scheduler that decided, eager or recorded."""
    assert main(["replay", "--synthetic-requests", "20", "--no-progress"]) == 0
    head = capsys.readouterr().out.split("=====")[0]
    assert "Workload:  synthetic, 20 requests, KV 1000000 tokens" in head
    assert "cost model 'llama3-8b-h200'" in head and "simulated time" in head
    assert "Scheduler: reference scheduler" in head
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--backend", "torch",
                 "--capture", "64", "--kv-tokens", "5000", "--cost-model", "qwen2.5-7b-a100"]) == 0
    head = capsys.readouterr().out.split("=====")[0]
    assert "KV 5000 tokens" in head and "cost model 'qwen2.5-7b-a100'" in head
    assert "torch backend on cpu, recorded step (capture, queue capacity 64)" in head
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--backend", "torch"]) == 0
    assert "torch backend on cpu, eager step" in capsys.readouterr().out.split("=====")[0]


def test_replay_is_deterministic(capsys):
    argv = ["replay", "--synthetic-requests", "30", "--no-progress", "--policy", "lpm"]
    main(argv)
    first = DIGEST.findall(capsys.readouterr().out)
    main(argv)
    assert DIGEST.findall(capsys.readouterr().out) == first


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_replay_capture_bounds_fill_lengths_and_keeps_the_digest(policy, capsys, monkeypatch):
    """`--capture N`: the recorded step, bounded by the trace's longest fill (prompt plus
    max(output, 1) tokens: fewer rounds than the pool's size), decides as the reference."""
    from gpu_sched.scheduler import GpuScheduler

    seen = []
    capture = GpuScheduler.capture

    def spy(self, *a, **k):
        g = capture(self, *a, **k)
        seen.append(g)
        return g

    monkeypatch.setattr(GpuScheduler, "capture", spy)
    argv = ["replay", "--synthetic-requests", "30", "--no-progress", "--policy", policy]
    main(argv)
    want = DIGEST.findall(capsys.readouterr().out)
    main(argv + ["--backend", "torch", "--capture", "64"])
    assert DIGEST.findall(capsys.readouterr().out) == want
    from gpu_sched.sim.traces import synthetic_workload

    tr = synthetic_workload(30, seed=0, request_rate=8.0)
    assert [g.max_len for g in seen] == [max(r.input_len + max(r.output_len, 1) for r in tr.requests)]
    assert seen[0].runs > 10


def test_replay_capture_random_keeps_the_torch_digest(capsys, monkeypatch):
    """Under random the recorded step draws the eager step's permutations (the same seeded
    generator): `--capture` keeps the torch backend's digest (the reference's generator is
    numpy's: SPEC R-ORD-6 lets backends differ there)."""
    from gpu_sched.scheduler import GpuScheduler

    seen = []
    capture = GpuScheduler.capture
    monkeypatch.setattr(GpuScheduler, "capture", lambda self, *a, **k: seen.append(capture(self, *a, **k)) or seen[-1])
    argv = ["replay", "--synthetic-requests", "30", "--no-progress", "--policy", "random", "--backend", "torch"]
    main(argv)
    want = DIGEST.findall(capsys.readouterr().out)
    main(argv + ["--capture", "64"])
    assert DIGEST.findall(capsys.readouterr().out) == want
    assert seen[0].runs > 10


def test_replay_out_writes_results_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["completed"] == 20
    assert len(doc["summary"]["digest"]) == 64
    assert doc["config"]["scheduler"]["schedule_policy"] == "fcfs"
    assert doc["config"]["cost_model"]["name"] == "llama3-8b-h200"
    assert len(doc["requests"]) == 20
    for png in ("queue_len.png", "kv_usage.png", "ttft_cdf.png", "sched_time.png"):
        assert (out / png).stat().st_size > 0
    assert str(out) in capsys.readouterr().out


def test_routing_keys_and_priorities_change_the_order_and_are_recorded(tmp_path, capsys):
    """No trace records routing keys or priorities: without --routing-keys the routing-key
    policy orders as fcfs and says so; with keys it decides differently, the same on the
    reference and the torch backend, and results.json records what reproduces the run."""
    base = ["replay", "--synthetic-requests", "120", "--rate-scale", "4", "--no-progress"]

    def digest(*extra):
        assert main(base + list(extra)) == 0
        out = capsys.readouterr()
        return re.search(r"^decision digest: ([0-9a-f]{64})$", out.out, re.M).group(1), out.err

    fcfs, _ = digest("--policy", "fcfs")
    plain, note = digest("--policy", "routing-key")
    assert plain == fcfs and "no request has a routing key" in note
    keyed, note = digest("--policy", "routing-key", "--routing-keys", "4", "--out", str(tmp_path / "rk"))
    assert keyed != fcfs and note == ""
    assert digest("--policy", "routing-key", "--routing-keys", "4", "--backend", "torch")[0] == keyed
    prio_plain, note = digest("--policy", "fcfs", "--enable-priority-scheduling")
    assert prio_plain == fcfs and "no request has a priority" in note
    prio, note = digest("--policy", "fcfs", "--enable-priority-scheduling", "--priority-levels", "3")
    assert prio != fcfs and note == ""
    assert digest("--policy", "fcfs", "--enable-priority-scheduling", "--priority-levels", "3",
                  "--backend", "torch")[0] == prio
    cfg = json.loads((tmp_path / "rk" / "results.json").read_text())["config"]
    assert (cfg["routing_keys"], cfg["priority_levels"], cfg["key_seed"], cfg["rate_scale"], cfg["limit"],
            cfg["synthetic_seed"]) == (4, 0, 0, 4.0, None, 0)
    assert cfg["argv"][:2] == ["gpu-sched", "replay"] and cfg["version"]
    assert cfg["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", cfg["commit"])


def test_lengths_only_trace_notes_that_lpm_has_nothing_to_reuse(tmp_path, capsys):
    """An Azure-format trace records lengths only (every prompt a unique stream): lpm says so;
    fcfs, which reuses nothing anyway, does not."""
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"2023-11-16 18:17:0{i}.0000000,{100 + i},4\n" for i in range(5)))
    assert main(["replay", "--trace", str(path), "--policy", "lpm", "--no-progress"]) == 0
    assert "records no prompt contents" in capsys.readouterr().err
    assert main(["replay", "--trace", str(path), "--policy", "fcfs", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_seeds_replay_each_seed_and_report_the_spread(tmp_path, capsys):
    """--seeds replays every policy once per seed and prints mean +- std over the seeds; each
    seed's runs are the plain runs with that --seed (same digests); seeds.json keeps them."""
    base = ["replay", "--synthetic-requests", "40", "--rate-scale", "4", "--no-progress"]
    assert main(base + ["--seeds", "3,5", "--compare-policies", "fcfs,lpm", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mean +- std (population, ddof=0) over seeds 3, 5" in out and re.search(r"Mean TTFT \(ms\) +[0-9.]+ \+- [0-9.]+", out)
    doc = json.loads((tmp_path / "seeds.json").read_text())
    assert doc["seeds"] == [3, 5] and doc["runs"] == ["fcfs", "lpm"]
    assert set(doc["spread_keys"]) >= {k for k in doc["spread"]["fcfs"] if k not in doc["summaries"]["3"]["fcfs"]}
    for sd in (3, 5):
        assert main(base + ["--seed", str(sd), "--policy", "lpm"]) == 0
        plain = re.search(r"^decision digest: ([0-9a-f]{64})$", capsys.readouterr().out, re.M).group(1)
        assert doc["summaries"][str(sd)]["lpm"]["digest"] == plain
    ttft = [doc["summaries"][str(sd)]["fcfs"]["mean_ttft_ms"] for sd in (3, 5)]
    spread = doc["spread"]["fcfs"]["mean_ttft_ms"]
    assert spread["n"] == 2 and spread["min"] == min(ttft) and abs(spread["mean"] - sum(ttft) / 2) < 1e-9
    for extra, message in ((["--seeds", "1,x"], "--seeds takes comma-separated ints"),
                           (["--seeds", "1,1"], "distinct ints >= 0"),
                           (["--seeds", "0,1", "--check"], "--seeds and --check"),
                           (["--seeds", "0,1", "--trace", str(tmp_path / "t.jsonl")], "every seed replays the same")):
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


def test_rate_scales_sweep_the_load(tmp_path, capsys):
    """--rate-scales replays every policy once per rate scale, each run the plain run with that
    --rate-scale (same digest and simulated figures); the table gives each metric by scale with the
    offered rate; --out keeps each scale's runs and sweep.json / sweep.png; bad values and
    clashing flags are one-line errors (exit 2), before any replay."""
    from gpu_sched.sim.metrics import _fmt

    base = ["replay", "--synthetic-requests", "40", "--no-progress"]
    assert main(base + ["--rate-scales", "0.5,4", "--compare-policies", "fcfs,lpm", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["rate_scales"] == [0.5, 4.0] and doc["runs"] == ["fcfs", "lpm"]
    assert "rate swept, synthetic, 40 requests" in out and "rate x" not in doc["workload"]
    assert "rate_scale" not in doc["config"] and set(doc["config"]["schedulers"]) == {"fcfs", "lpm"}
    assert (tmp_path / "sweep.png").stat().st_size > 0
    for x, key in ((0.5, "0.5"), (4, "4")):
        assert main(base + ["--rate-scale", str(x), "--policy", "lpm", "--out", str(tmp_path / f"plain{key}")]) == 0
        plain = json.loads((tmp_path / f"plain{key}" / "results.json").read_text())
        capsys.readouterr()
        swept = json.loads((tmp_path / f"rate_x{key}" / "lpm" / "results.json").read_text())
        assert doc["summaries"][key]["lpm"] == swept["summary"]
        simulated = ("digest", "completed", "duration", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                     "output_throughput", "prefix_cache_hit_rate", "mean_queue_len", "steps")
        assert {k: swept["summary"][k] for k in simulated} == {k: plain["summary"][k] for k in simulated}
        assert swept["config"]["rate_scale"] == x
        arrivals = sorted(r["arrival_s"] for r in plain["requests"])
        offered = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
        assert doc["offered_request_rate"][doc["rate_scales"].index(x)] == pytest.approx(offered)
        # the scale's row in the TTFT group: its label with the offered rate, both runs' values
        row = f"x{key} ({offered:.3g} req/s)"
        cells = [_fmt(doc["summaries"][key][p]["mean_ttft_ms"]) for p in ("fcfs", "lpm")]
        assert re.search(rf"{re.escape(row)} +{re.escape(cells[0])} +{re.escape(cells[1])}$", out, re.M), row
        assert (tmp_path / f"rate_x{key}" / "comparison.json").exists()
    assert out.index("Mean TTFT (ms)") < out.index("x4 (", out.index("Mean TTFT (ms)"))
    # a trace's arrivals scale exactly: 5 requests 1 s apart offer 1 req/s, times each scale
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:17:0{i}.0000000,{100 + i},4\n" for i in range(5)))
    assert main(["replay", "--trace", str(trace), "--no-progress", "--rate-scales", "3,0.5"]) == 0
    out = capsys.readouterr().out
    assert "x0.5 (0.5 req/s)" in out and "x3 (3 req/s)" in out
    assert out.index("x0.5 (") < out.index("x3 (")  # in increasing order, as given or not
    # scales that differ past 6 digits keep their own names; the backends' agreement and
    # --check's outcome are said for the whole sweep
    argv = base + ["--rate-scales", "1,1.0000001", "--compare-backends", "reference,torch", "--check",
                   "--out", str(tmp_path / "close")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "close" / "sweep.json").read_text())
    assert list(doc["summaries"]) == ["1", "1.0000001"] and doc["rate_scales"] == [1.0, 1.0000001]
    assert (tmp_path / "close" / "rate_x1.0000001" / "torch" / "results.json").exists()
    assert "the backends made the same decisions at every rate scale (equal digests)" in out
    assert "integrity check passed [reference, torch] at every rate scale" in out
    # where they differ (random draws its permutation per backend), the sweep names the scales
    assert main(base + ["--policy", "random", "--compare-backends", "reference,torch", "--rate-scales", "10,40"]) == 0
    assert "the backends' decisions differ at x10, x40 (their digests differ); random" in capsys.readouterr().out
    # arrivals at one time: no offered rate, and a note that every scale replays the same
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:17:00.0000000,100,4\n" * 3)
    assert main(["replay", "--trace", str(trace), "--no-progress", "--rate-scales", "1,2"]) == 0
    captured = capsys.readouterr()
    assert "every scale replays the same arrivals" in captured.err and "in brackets" not in captured.out
    assert re.search(r"^ +x2 +[0-9.]+$", captured.out, re.M)  # no offered rate beside the scale
    # a scale that cannot be replayed stops the sweep before any run, naming --rate-scales; an
    # offered rate past a float's range is left out (sweep.json stays strict JSON)
    assert main(base + ["--rate-scales", "1,1e308", "--out", str(tmp_path / "big")]) == 2
    captured = capsys.readouterr()
    assert "--rate-scales' scale 1e+308 makes the synthetic workload's rate" in captured.err
    assert captured.out == "" and not (tmp_path / "big").exists()
    close = tmp_path / "close.csv"  # 5 requests 0.1 s apart: at x1e308 their span is subnormal
    close.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:17:00.{i}000000,{100 + i},4\n" for i in range(5)))
    assert main(["replay", "--trace", str(close), "--no-progress", "--rate-scales", "1,1e308",
                 "--out", str(tmp_path / "huge")]) == 0
    text = (tmp_path / "huge" / "sweep.json").read_text()
    assert "Infinity" not in text and json.loads(text)["offered_request_rate"][1] is None
    capsys.readouterr()
    for extra, message in ((["--rate-scales", "2"], "two or more distinct finite numbers > 0"),
                           (["--rate-scales", "1,1"], "two or more distinct"),
                           (["--rate-scales", "0,1"], "> 0, got '0,1'"),
                           (["--rate-scales", "1,nan"], "> 0"), (["--rate-scales", "1,inf"], "finite"),
                           (["--rate-scales", "1,x"], "--rate-scales takes comma-separated numbers"),
                           (["--rate-scales", "1,2", "--rate-scale", "3"], "give the rate twice"),
                           (["--rate-scales", "1,2", "--seeds", "0,1", "--check"], "--seeds and --check")):
        assert main(base + extra) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.err.count("\n") == 1 and captured.out == "", captured


def test_rate_scales_with_seeds_give_mean_and_spread_by_scale(tmp_path, capsys):
    """--rate-scales with --seeds replays each scale once per seed, each point the plain run
    with that --rate-scale and --seed; the table and sweep.json give mean +- std over the
    seeds at each scale; no per-run folders (as --seeds alone)."""
    base = ["replay", "--synthetic-requests", "30", "--no-progress"]
    assert main(base + ["--compare-policies", "fcfs,lpm", "--rate-scales", "4,40", "--seeds", "0,1",
                        "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["seeds"] == [0, 1] and doc["rate_scales"] == [4.0, 40.0] and doc["runs"] == ["fcfs", "lpm"]
    assert "synthetic_seed" not in doc["config"] and sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json",
                                                                                                  "sweep.png"]
    assert "mean +- std (population) over seeds 0, 1" in out and "per seed, rate swept, synthetic" in out
    from gpu_sched.sim.metrics import SWEEP_ROWS, _fmt
    from gpu_sched.sim.traces import synthetic_workload

    for i, x in enumerate(("4", "40")):
        ttft, rates = [], []
        for sd in (0, 1):
            assert main(base + ["--rate-scale", x, "--seed", str(sd), "--compare-policies", "fcfs,lpm"]) == 0
            plain = dict(re.findall(r"^decision digest \[(\w+)\]: ([0-9a-f]{64})$", capsys.readouterr().out, re.M))
            for p in ("fcfs", "lpm"):
                assert doc["summaries"][x][str(sd)][p]["digest"] == plain[p]
            assert f"rate x{x}, seed {sd}: fcfs {plain['fcfs'][:12]}, lpm {plain['lpm'][:12]}\n" in out
            ttft.append(doc["summaries"][x][str(sd)]["lpm"]["mean_ttft_ms"])
            arrivals = [r.arrival_s for r in synthetic_workload(30, seed=sd, request_rate=8.0 * float(x)).requests]
            rates.append(29 / (max(arrivals) - min(arrivals)))
        spread = doc["spread"][x]["lpm"]["mean_ttft_ms"]
        assert spread["n"] == 2 and spread["mean"] == pytest.approx(sum(ttft) / 2)
        assert spread["std"] == pytest.approx(abs(ttft[0] - ttft[1]) / 2)
        assert doc["offered_request_rate"][i] == pytest.approx(sum(rates) / 2)  # the seeds' mean
    # every row of the sweep's table, each cell mean +- std
    assert set(doc["spread"]["40"]["fcfs"]) == {key for _, key in SWEEP_ROWS}
    for label, key in SWEEP_ROWS:
        cells = [f"{_fmt(doc['spread']['40'][p][key]['mean'])} +- {_fmt(doc['spread']['40'][p][key]['std'])}"
                 for p in ("fcfs", "lpm")]
        assert re.search(rf"x40 \([0-9.]+ req/s\) +{re.escape(cells[0])} +{re.escape(cells[1])}$", out, re.M), label
        assert label in out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_out_that_cannot_be_made_is_refused_before_the_run(capsys):
    """--out is tried, not only checked by permission bits (which root passes): a folder that
    cannot be made (in /proc) or one a file cannot be made in (/proc itself) is refused before
    any replay (exit 2, nothing on stdout); for other users the bits refuse it first."""
    root = os.geteuid() == 0  # others are refused by /proc's permission bits, before the probe
    for out, message in (("/proc/gpu_sched_out", "the folder /proc/gpu_sched_out cannot be made"),
                         ("/proc", "a file cannot be made in it")):
        assert main(["replay", "--synthetic-requests", "5", "--no-progress", "--out", out]) == 2
        captured = capsys.readouterr()
        assert f"cannot write results to {out}: {message if root else '/proc is not writable'}" in captured.err
        assert captured.out == ""


def test_compare_policies_prints_one_table(tmp_path, capsys):
    argv = ["replay", "--synthetic-requests", "30", "--no-progress", "--compare-policies", "fcfs,lpm",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("Metric") == 1 and "fcfs" in out and "lpm" in out
    assert "Successful requests:" not in out  # one table, not one summary per policy
    assert len(re.findall(r"^decision digest \[(fcfs|lpm)\]: [0-9a-f]{64}$", out, re.M)) == 2
    for p in ("fcfs", "lpm"):
        assert (tmp_path / p / "results.json").exists()
        assert (tmp_path / p / "ttft_cdf.png").exists()
    assert (tmp_path / "comparison.png").exists() and (tmp_path / "ttft_cdf.png").exists()  # every run's CDF
    # the runs side by side in one file, with the workload they share
    doc = json.loads((tmp_path / "comparison.json").read_text())
    assert doc["policies"] == ["fcfs", "lpm"] and doc["workload"].startswith("synthetic, 30 requests")
    for p in ("fcfs", "lpm"):
        assert doc["summaries"][p] == json.loads((tmp_path / p / "results.json").read_text())["summary"]
    assert doc["config"]["num_requests"] == 30 and "scheduler" not in doc["config"]
    assert {p: c["schedule_policy"] for p, c in doc["config"]["schedulers"].items()} == {"fcfs": "fcfs", "lpm": "lpm"}


def test_cost_model_from_a_json_file(tmp_path, capsys):
    """--cost-model takes a .json file of CostModel's fields: a slower model gives a longer
    simulated run, the same decisions-per-step machinery; bad files are one-line errors."""
    good = tmp_path / "slow.json"
    good.write_text(json.dumps({"fixed_s": 0.05, "prefill_token_s": 1e-4, "decode_request_s": 1e-4,
                                "kv_token_s": 0.0}))
    base = ["replay", "--synthetic-requests", "20", "--no-progress", "--out"]
    assert main(base + [str(tmp_path / "a")]) == 0
    assert main(base + [str(tmp_path / "b"), "--cost-model", str(good)]) == 0
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert b["summary"]["duration"] > a["summary"]["duration"]
    assert b["config"]["cost_model"] == {"name": "slow", "description": f"from {good}", "fixed_s": 0.05,
                                         "prefill_token_s": 1e-4, "decode_request_s": 1e-4, "kv_token_s": 0.0}
    capsys.readouterr()
    for text, message in (('{"fixed_s": 1}', "missing prefill_token_s, decode_request_s, kv_token_s"),
                          ('{"fixed_s": -1, "prefill_token_s": 0, "decode_request_s": 0, "kv_token_s": 0}',
                           "fixed_s must be a number of seconds in [0, 3600], got -1"),
                          ('{"fixed_s": 1, "prefill_token_s": 0, "decode_request_s": 0, "kv_token_s": 0, "x": 1}',
                           "unknown x"),
                          ("[1, 2]", "expected an object"), ("{", "not JSON")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert main(["replay", "--cost-model", str(bad), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["replay", "--cost-model", str(tmp_path / "none.json")]) == 2
    assert "cost model file not found" in capsys.readouterr().err


def test_config_flags_map_to_scheduler_config():
    args = build_parser().parse_args([
        "replay", "--policy", "dfs-weight", "--page-size", "16", "--chunked-prefill-size", "0",
        "--max-running-requests", "64", "--enable-priority-scheduling", "--enable-priority-preemption",
        "--schedule-low-priority-values-first", "--priority-scheduling-preemption-threshold", "3",
        "--schedule-conservativeness", "0.5", "--disable-radix-cache", "--enable-mixed-chunk",
        "--prefill-max-requests", "8", "--truncation-align-size", "32", "--lpm-fallback-queue-len", "-1",
        "--in-batch-prefix-caching-check-threshold", "-1", "--in-batch-prefix-caching-deprioritize-threshold", "5",
        "--clip-max-new-tokens", "512", "--random-seed", "9", "--max-prefill-tokens", "4096"])
    c = config_from_args(args)
    assert (c.schedule_policy, c.page_size, c.chunked_prefill_size, c.max_running_requests) == ("dfs-weight", 16, None, 64)
    assert c.enable_priority_scheduling and c.enable_priority_preemption and c.schedule_low_priority_values_first
    assert c.priority_scheduling_preemption_threshold == 3 and c.schedule_conservativeness == 0.5
    assert c.disable_radix_cache and c.enable_mixed_chunk
    assert (c.prefill_max_requests, c.truncation_align_size, c.lpm_fallback_queue_len) == (8, 32, None)
    assert (c.in_batch_prefix_caching_check_threshold, c.in_batch_prefix_caching_deprioritize_threshold) == (-1, 5)
    assert (c.clip_max_new_tokens, c.random_seed, c.max_prefill_tokens) == (512, 9, 4096)
    sg = config_from_args(build_parser().parse_args(["replay", "--preset", "sglang", "--policy", "lpm"]))
    assert sg.lpm_fallback_queue_len == 128 and sg.schedule_policy == "lpm"
    assert config_from_args(build_parser().parse_args(["replay"])).lpm_fallback_queue_len is None
    assert "reference" in BACKENDS


@pytest.mark.slow  # ~1000 steps x check_integrity over a 1M-slot pool (~15 ms each on a 2-core CPU)
@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_replay_mooncake_head_with_check(capsys):
    argv = ["replay", "--trace", str(MOONCAKE), "--limit", "50", "--check", "--no-progress", "--policy", "lpm"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+50\n", out)
    assert len(DIGEST.findall(out)) == 1


@pytest.mark.skipif(not AZURE.exists(), reason="Azure trace not present")
def test_trace_stats_azure(capsys):
    assert main(["trace-stats", str(AZURE)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"num_requests\s+8819\n", out)
    assert re.search(r"repeat_block_frac\s+n/a\n", out)
    assert "repeat_block_frac n/a: the trace has no prompt block hashes" in out  # says why
    assert "total_output_tokens" in out
    assert re.search(r"request_rate\s+2\.57  req/s\n", out) and re.search(r"input_p50\s+\S+  tokens\n", out)
    assert re.search(r"interarrival_cv\s+\d+\.\d{4}\n", out) and "peak_rate_60s" in out


def _bad_rows(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\nnot json\n')
    return p


@pytest.mark.parametrize("argv, message", [
    (["replay", "--trace", "/no/such/trace.jsonl"], "not found"),
    (["replay", "--policy", "bogus"], "schedule_policy"),
    (["replay", "--compare-policies", "fcfs,bogus"], "schedule_policy"),
    (["replay", "--policy", "lpm", "--compare-policies", "fcfs,lof"], "give one of them"),
    (["replay", "--random-seed", "-1"], "random_seed must be >= 0"),
    (["replay", "--kv-tokens", "-5"], "kv-tokens"),
    (["replay", "--page-size", "0"], "page_size"),
    (["replay", "--schedule-conservativeness", "nan"], "schedule_conservativeness"),
    (["replay", "--cost-model", "gpt-17"], "cost model"),
    (["replay", "--backend", "cuda-magic"], "backend"),
    (["replay", "--capture", "64"], "--capture needs a device backend"),
    (["replay", "--backend", "torch", "--capture", "-1"], "--capture must be in [0, 16777216], got -1"),
    (["replay", "--backend", "torch", "--capture", str(10**12)], "--capture must be in [0, 16777216]"),
    (["conformance", "BAD", "--backend", "torch", "--capture", str(10**12)], "--capture must be in [0, 16777216]"),
    (["replay", "--backend", "torch", "--threads", "-1"], "--threads must be in [0, 4096], got -1"),
    (["replay", "--backend", "torch", "--threads", "100000"], "--threads must be in [0, 4096], got 100000"),
    # values a reader or flag takes but no run can hold: one line each, not a traceback
    (["trace-stats", "HUGE"], "huge.jsonl line 1: output_length must be <= 16777216, got 100000000000000000000"),
    (["replay", "--trace", "HUGE"], "huge.jsonl line 1: output_length must be <= 16777216"),
    (["trace-stats", "LATE"], "late.jsonl line 1: timestamp must be <= 9007199254740992"),
    (["replay", "--trace", "SOON", "--rate-scale", "1e-309"], "rate_scale 1e-309 puts request 0's arrival past"),
    (["replay", "--rate-scale", "1e308"], "--rate-scale 1e+308 makes the synthetic workload's rate"),
    (["replay", "--synthetic-requests", "5", "--rate-scale", "1e-320"], "--rate-scale 1e-320 puts arrivals past"),
    (["trace-stats", "BIN"], "bin.jsonl: not UTF-8 text"),
    (["replay", "--cost-model", "COST"], "cost.json: CostModel fixed_s must be a number of seconds in [0, 3600]"),
    (["replay", "--cost-model", "BINCOST"], "bincost.json: not UTF-8 text"),
    (["replay", "--out", "OUTFILE"], "is a file, not a folder"),
    (["replay", "--out", "OUTFILE/sub/dir"], "outfile is a file, not a folder"),
    (["replay", "--out", ""], "--out must name a folder, got an empty string"),
    (["trace-stats", "EMPTY"], "no requests in"),
    (["replay", "--limit", "0"], "no requests to replay in synthetic"),
    (["replay", "--synthetic-requests", "0"], "no requests to replay in synthetic"),
    (["replay", "--trace", "BAD", "--limit", "0"], "no requests to replay in"),
    (["replay", "--device", "cuda"], "--device cuda needs a device backend"),
    (["conformance", "BAD", "--device", "cuda:0"], "--device cuda:0 needs a device backend"),
    (["replay", "--backend", "torch", "--device", "gpu"], "--device 'gpu' is not a torch device"),
    (["conformance", "BAD", "--backend", "torch", "--device", "cuda:x"], "--device 'cuda:x' is not a torch device"),
    (["replay", "--rate-scale", "0"], "rate-scale"),
    (["replay", "--routing-keys", "-1"], "--routing-keys must be in [0, 2^62], got -1"),
    (["replay", "--priority-levels", "-2"], "--priority-levels must be in [0, 2^62], got -2"),
    (["replay", "--trace", "BAD", "--no-progress"], "line 2"),
    (["trace-stats", "BAD"], "line 2"),
    (["trace-stats", "/no/such/file.csv"], "not found"),
    # a trace folder (as ../shared/traces/mooncake) names the trace files in it
    (["replay", "--trace", "DIR"], "is a directory, not a trace file; it holds bad.jsonl"),
    (["trace-stats", "DIR"], "is a directory, not a trace file; it holds bad.jsonl"),
    # the trace is read before the device is checked (a device backend imports torch first)
    (["replay", "--trace", "/no/such/trace.jsonl", "--backend", "torch", "--device", "gpu"], "not found"),
])
def test_bad_input_is_one_line_without_traceback(argv, message, tmp_path, capsys):
    files = {"BAD": _bad_rows(tmp_path), "DIR": tmp_path}
    for name, data in (("huge.jsonl", b'{"timestamp": 0, "input_length": 10, "output_length": 10' + b"0" * 19 + b', "hash_ids": [1]}\n'),
                       ("late.jsonl", b'{"timestamp": 1' + b"0" * 17 + b', "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'),
                       ("soon.jsonl", b'{"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'),
                       ("bin.jsonl", b"\xff\xfe{}"), ("bincost.json", b"\xff\xfe"), ("outfile", b""),
                       ("cost.json", b'{"fixed_s": 1e308, "prefill_token_s": 0, "decode_request_s": 0, "kv_token_s": 0}'),
                       ("empty.jsonl", b"")):
        (tmp_path / name).write_bytes(data)
        files[name.split(".")[0].upper()] = tmp_path / name
    head = lambda a: a.split("/", 1)[0]  # noqa: E731  (NAME/more: a path under a made file)
    argv = [str(files[head(a)]) + a[len(head(a)):] if head(a) in files else a for a in argv]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-sched: error: ") and message in lines[0]


BAD_SCENARIO_FILES = [
    # (file name, bytes, message): read before any scenario runs; one error line, exit 2
    ("notjson.jsonl", b'{"id": "a", "input": {}, "expected": {}}\nnot json\n', "notjson.jsonl line 2: invalid JSON"),
    ("list.jsonl", b"[1, 2]\n", "list.jsonl line 1: not a scenario"),
    ("noinput.jsonl", b'{"foo": 1}\n', "noinput.jsonl line 1: not a scenario"),
    ("empty.jsonl", b"\n", "no scenarios in"),
    ("fake.jsonl.gz", b"not gzip", "fake.jsonl.gz line 1: unreadable (BadGzipFile"),
    ("latin1.jsonl", b"\xff\xfe\n", "latin1.jsonl line 1: unreadable (UnicodeDecodeError"),
]


@pytest.mark.parametrize("name,data,message", BAD_SCENARIO_FILES, ids=[b[0] for b in BAD_SCENARIO_FILES])
def test_conformance_bad_file_is_one_error(tmp_path, capsys, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    rc = main(["conformance", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("gpu-sched: error: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
@pytest.mark.parametrize("command", [["replay"], ["conformance", "scenarios.jsonl"]])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_device_without_cuda_is_one_error(command, backend, capsys):
    # before any work: no traceback from the first scheduler, no "0 passed, N failed"
    rc = main(command + ["--backend", backend, "--device", "cuda"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    # a CPU-only torch has no CUDA; a CUDA build without a visible GPU sees no device
    assert re.fullmatch(r"gpu-sched: error: --device cuda: torch \S+ (has no CUDA|sees no CUDA device)\n", captured.err)


@pytest.mark.parametrize("flag, threads", [([], 1), (["--threads", "2"], 2)])
def test_replay_sets_torch_threads(flag, threads, capsys, monkeypatch):
    """Device backends run with one torch CPU thread unless --threads says otherwise (the
    step's ops are small: more threads cost more than they save, and stall under load)."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert main(["replay", "--synthetic-requests", "5", "--no-progress", "--backend", "torch"] + flag) == 0
    assert calls == [threads]
    calls.clear()
    assert main(["replay", "--synthetic-requests", "5", "--no-progress", "--backend", "torch", "--threads", "0"]) == 0
    assert main(["replay", "--synthetic-requests", "5", "--no-progress"] + flag) == 0  # the reference: no torch
    assert calls == []  # 0: torch's default, left alone


def test_cuda_index_beyond_device_count_is_one_error(monkeypatch, capsys):
    # one visible GPU, faked, so the check holds with or without CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rc = main(["replay", "--backend", "torch", "--device", "cuda:1"])
    assert rc == 2
    assert capsys.readouterr().err == "gpu-sched: error: --device cuda:1: torch sees 1 CUDA device (cuda:0 to cuda:0)\n"


def test_check_prints_that_it_passed(capsys):
    # a small pool keeps the per-step integrity check cheap
    argv = ["replay", "--synthetic-requests", "5", "--kv-tokens", "20000", "--no-progress"]
    assert main(argv + ["--check"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^integrity check passed.*$", out, re.M) == [
        "integrity check passed: tree, lock and KV-pool invariants held after every scheduler step"]
    assert len(DIGEST.findall(out)) == 1
    assert main(argv + ["--check", "--compare-policies", "fcfs,lpm"]) == 0
    assert re.findall(r"^integrity check passed \[fcfs, lpm\]: ", capsys.readouterr().out, re.M)
    assert main(argv) == 0
    assert "integrity check" not in capsys.readouterr().out


def test_a_failed_run_makes_no_out_folder(tmp_path, capsys):
    """--out is checked before the run (a file on its path is refused at once) but made only
    when the results are written: a run that fails leaves nothing behind."""
    out = tmp_path / "new" / "deep"
    assert main(["replay", "--trace", str(_bad_rows(tmp_path)), "--no-progress", "--out", str(out)]) == 2
    assert "line 2" in capsys.readouterr().err and not (tmp_path / "new").exists()
    assert main(["replay", "--synthetic-requests", "5", "--no-progress", "--out", str(out)]) == 0
    assert (out / "results.json").is_file()
    # refused up front, before the run: a link that leads nowhere (on the path or as it), a
    # name the system cannot hold
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    for bad, words in ((tmp_path / "dangling", "a link that leads nowhere"),
                       (tmp_path / "dangling" / "sub", "a link that leads nowhere"),
                       (tmp_path / ("x" * 300), "cannot write results to")):
        assert main(["replay", "--synthetic-requests", "5", "--no-progress", "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_skip_bad_rows(tmp_path, capsys):
    """The skipped rows are counted in a note (and in results.json, with the trace's absolute
    path: the run can be repeated from another folder)."""
    bad = _bad_rows(tmp_path)
    assert main(["replay", "--trace", str(bad), "--skip-bad-rows", "--no-progress", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr()
    assert re.search(r"Successful requests:\s+1\n", out.out)
    assert "gpu-sched: note: skipped 1 malformed row of" in out.err
    cfg = json.loads((tmp_path / "o" / "results.json").read_text())["config"]
    assert cfg["bad_rows"] == 1 and cfg["trace"] == str(bad.resolve())


def test_priority_levels_without_priority_scheduling_is_noted(capsys):
    assert main(["replay", "--synthetic-requests", "20", "--priority-levels", "3", "--no-progress"]) == 0
    assert "only --enable-priority-scheduling reads" in capsys.readouterr().err


def test_options_a_replay_does_not_read_are_noted(capsys):
    """Each option given that this replay reads nowhere gets a note naming it, and so do
    priorities under a policy that does not sort by them, and lof's oracle (each request's
    max_new_tokens is its true output length) unless --max-new-tokens sets one for all."""
    base = ["replay", "--synthetic-requests", "20", "--no-progress"]
    assert main(base + ["--threads", "2", "--routing-keys", "3", "--schedule-low-priority-values-first"]) == 0
    err = capsys.readouterr().err
    assert "--threads sets torch's threads" in err and "--routing-keys gives requests routing keys" in err
    assert "--schedule-low-priority-values-first sets the priority direction" in err
    assert main(base + ["--compare-policies", "fcfs,lpm,routing-key", "--enable-priority-scheduling",
                        "--priority-levels", "3"]) == 0
    err = capsys.readouterr().err
    assert "lpm, routing-key do not sort by priority" in err and "orders as plain fcfs (no priority sort)" in err
    assert "fcfs, lpm" not in err and "oracle" not in err
    assert main(base + ["--policy", "lof"]) == 0
    assert "lof sorts by the true output length (an oracle" in capsys.readouterr().err
    assert main(base + ["--policy", "lof", "--max-new-tokens", "64"]) == 0
    out, err = capsys.readouterr()
    assert "oracle" not in err and "Workload:  synthetic, 20 requests, max_new_tokens 64, KV" in out
    assert main(base + ["--threads", "1", "--backend", "torch", "--routing-keys", "3", "--policy", "routing-key"]) == 0
    assert "note" not in capsys.readouterr().err  # each of those read
    # with --priority-levels the key draws move the priority draws: the keys are not noted as unused
    assert main(base + ["--routing-keys", "3", "--priority-levels", "2", "--enable-priority-scheduling"]) == 0
    assert "--routing-keys" not in capsys.readouterr().err
    assert main(base + ["--seeds", "0,1", "--seed", "4"]) == 0
    assert "--seed is replaced by each of --seeds" in capsys.readouterr().err
    assert main(base + ["--device", "cpu"]) == 0
    assert "--device cpu picks the device of the torch and triton backends" in capsys.readouterr().err


@pytest.mark.skipif(not AZURE.exists(), reason="Azure trace not present")
def test_synthetic_options_with_a_trace_are_noted(capsys):
    assert main(["replay", "--trace", str(AZURE), "--limit", "20", "--no-progress", "--synthetic-requests", "5",
                 "--seed", "3"]) == 0
    err = capsys.readouterr().err
    assert "--synthetic-requests sizes the synthetic workload" in err and "--seed seeds the synthetic" in err


def test_max_new_tokens_is_recorded_and_cuts_outputs(tmp_path, capsys):
    argv = ["replay", "--synthetic-requests", "30", "--no-progress", "--max-new-tokens", "8", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["max_new_tokens"] == 8 and doc["summary"]["max_new_tokens"] == 8
    assert max(r["output_len"] for r in doc["requests"]) == 8
    assert all(k in doc["requests"][0] for k in ("queued_s", "preemptions", "priority", "routing_key"))


def test_seeds_with_compare_backends_say_whether_they_agree(capsys):
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--compare-backends", "reference,torch",
                 "--seeds", "0,1"]) == 0
    assert "the backends made the same decisions with every seed (equal digests)" in capsys.readouterr().out


def test_output_closed_early_is_not_a_traceback():
    """`gpu-sched ... | head`: the closed pipe ends the command quietly (more output than a
    pipe holds, so the write meets the closed pipe whatever the timing)."""
    code = ("import sys, gpu_sched.cli as c\n"
            "def long_output(args):\n    print('x' * 200000)\n    return 0\n"
            "c.cmd_trace_stats = long_output\n"
            "sys.exit(c.main(['trace-stats', 'any.jsonl']))\n")
    r = subprocess.run(f'"{sys.executable}" -c "$CODE" | head -c 1', shell=True, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CODE": code})
    assert r.stdout == "x" and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_request_that_never_fits_exits_nonzero(capsys):
    rc = main(["replay", "--synthetic-requests", "3", "--kv-tokens", "500", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "can never be admitted" in err


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["replay", "--kv-tokens", "many"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv,message", [
    (["--kv-tokens", str(10**20)], "--kv-tokens must be in [1, 2^40], got 100000000000000000000"),
    (["--routing-keys", str(2**64)], "--routing-keys must be in [0, 2^62]"),
    (["--priority-levels", str(2**64)], "--priority-levels must be in [0, 2^62]"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be in [1, 16777216], got 0"),
    (["--compare-policies", "fcfs,foo"], "--compare-policies fcfs,foo: schedule_policy must be one of"),
    # the scheduler config's own checks, with the flag that set the field in front
    (["--policy", "foo"], "--policy 'foo': schedule_policy must be one of"),
    (["--schedule-policy", "foo"], "--policy 'foo': schedule_policy must be one of"),
    (["--page-size", "0"], "--page-size 0: page_size must be >= 1, got 0"),
    (["--max-prefill-tokens", "-5"], "--max-prefill-tokens -5: max_prefill_tokens must be >= 1"),
    (["--random-seed", "-1"], "--random-seed -1: random_seed must be >= 0"),
    (["--schedule-conservativeness", "-1"], "--schedule-conservativeness -1.0: schedule_conservativeness must be"),
    (["--truncation-align-size", "-3"], "--truncation-align-size -3: truncation_align_size must be >= 1")])
def test_out_of_range_flags_are_one_error_naming_the_flag(argv, message, capsys):
    """Flags past what the run can take: one `gpu-sched: error` line naming the flag (a huge
    --kv-tokens once printed numpy's traceback, the others numpy's own words)."""
    assert main(["replay", "--synthetic-requests", "2", "--no-progress"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_kv_tokens_past_host_memory_is_one_error(kv_pool_out_of_memory, capsys):
    """--kv-tokens the host cannot hold the free list of: one line naming it, not a traceback
    (the allocation fails by a stand-in: a real one of 2^40 slots could be granted lazily)."""
    assert main(["replay", "--synthetic-requests", "2", "--no-progress", "--kv-tokens", str(2**40)]) == 2
    err = capsys.readouterr().err
    assert "MemoryError: kv_pool_size 1099511627776 slots" in err and err.count("\n") == 1, err


def test_replay_scheduler_time_charges_the_calls_and_says_so(capsys, tmp_path):
    """--scheduler-time blocking: the run says its steps wait for the scheduler's calls and how
    much that added; a bad mode is refused naming the flag."""
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--scheduler-time", "blocking"]) == 0
    out = capsys.readouterr().out
    assert "each step also waits for the scheduler's calls" in out.split("=====")[0]
    charged = float(re.search(r"Charged to the clock, blocking \(ms\):\s+([0-9.]+)", out).group(1))
    total = float(re.search(r"All scheduler calls \(ms\):\s+([0-9.]+)", out).group(1))
    assert 0 < charged <= total + 0.1
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--scheduler-time", "overlap",
                 "--compare-policies", "fcfs,lpm"]) == 0
    assert "Sched charged to clock (ms)" in capsys.readouterr().out
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--seeds", "0,1",
                 "--scheduler-time", "blocking"]) == 0
    assert re.search(r"Sched charged to clock \(ms\)\s+[0-9.]+ \+- [0-9.]+", capsys.readouterr().out)
    assert main(["replay", "--synthetic-requests", "20", "--no-progress"]) == 0
    assert "Charged to the clock" not in capsys.readouterr().out  # free: nothing charged, no row
    assert main(["replay", "--synthetic-requests", "20", "--no-progress", "--seeds", "0,1"]) == 0
    assert "charged" not in capsys.readouterr().out
    assert main(["replay", "--synthetic-requests", "10", "--no-progress", "--check", "--scheduler-time",
                 "overlap", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["scheduler_time"] == doc["summary"]["scheduler_time"] == "overlap"
    assert doc["summary"]["charged_sched_s"] == pytest.approx(sum(doc["steps"]["charged_s"]))
    assert "compare charged runs without --check" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["replay", "--scheduler-time", "slow"])
    assert e.value.code == 2
    assert "--scheduler-time: invalid choice: 'slow'" in capsys.readouterr().err


def test_replay_compare_backends_runs_each_backend_and_says_whether_they_agree(capsys, tmp_path):
    """--compare-backends: one table, a digest per backend and whether they are equal; --out
    writes each run under its backend's folder and the comparison beside them; --capture and
    --device reach the device backends only."""
    argv = ["replay", "--synthetic-requests", "30", "--no-progress", "--policy", "lpm"]
    assert main(argv + ["--compare-backends", "reference,torch", "--capture", "64", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    digests = dict(re.findall(r"^decision digest \[(\w+)\]: ([0-9a-f]{64})$", out, re.M))
    assert set(digests) == {"reference", "torch"} and len(set(digests.values())) == 1
    assert "the backends made the same decisions (equal digests)" in out
    assert "reference: reference scheduler" in out and "torch: GpuScheduler, torch backend on cpu, recorded step" in out
    main(argv)  # the plain reference run decides the same
    assert DIGEST.findall(capsys.readouterr().out) == [digests["reference"]]
    doc = json.loads((tmp_path / "comparison.json").read_text())
    assert doc["backends"] == ["reference", "torch"] and "backend" not in doc["config"]
    ref = json.loads((tmp_path / "reference" / "results.json").read_text())["config"]
    dev = json.loads((tmp_path / "torch" / "results.json").read_text())["config"]
    assert (ref["backend"], ref["capture"], dev["backend"], dev["capture"]) == ("reference", 0, "torch", 64)
    for bad, msg in ((["--compare-backends", "torch"], "two or more distinct names"),
                     (["--compare-backends", "reference,gpu"], "got 'reference,gpu'"),
                     (["--compare-backends", "reference,torch", "--backend", "torch"], "name the backends twice"),
                     (["--compare-backends", "reference,torch", "--compare-policies", "fcfs,lpm", "--policy", "lpm"],
                      "name the policies twice")):
        assert main(["replay", "--no-progress"] + bad) == 2
        assert msg in capsys.readouterr().err
    assert main(["replay", "--no-progress", "--compare-backends", "reference,torch", "--compare-policies",
                 "fcfs,lpm"]) == 2
    assert "compare one of them at a time" in capsys.readouterr().err
    # charged runs decide by their timing: their digests are not compared
    assert main(argv + ["--compare-backends", "reference,torch", "--scheduler-time", "blocking"]) == 0
    out = capsys.readouterr().out
    assert "the digests are not compared: with --scheduler-time blocking" in out
    assert "the backends made the same decisions" not in out and "decisions differ" not in out
    # per seed too: the header names both schedulers, seeds.json both backends
    assert main(argv + ["--seeds", "0,1", "--compare-backends", "reference,torch", "--out",
                        str(tmp_path / "seeds")]) == 0
    out = capsys.readouterr().out
    assert "Workload:  per seed, synthetic" in out
    assert "reference: reference scheduler (sequential, SPEC.md); torch: GpuScheduler" in out
    assert json.loads((tmp_path / "seeds" / "seeds.json").read_text())["config"]["backend"] == ["reference", "torch"]
    # random draws its own permutation on each backend (R-ORD-6): the decisions differ, and it says why
    assert main(["replay", "--synthetic-requests", "60", "--rate-scale", "20", "--no-progress", "--policy", "random",
                 "--compare-backends", "reference,torch"]) == 0
    out = capsys.readouterr().out
    assert len(set(re.findall(r"^decision digest \[\w+\]: ([0-9a-f]{64})$", out, re.M))) == 2
    assert "the backends' decisions differ (their digests differ); random draws its permutation" in out
