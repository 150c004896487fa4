"""`gpu-sched` command line: replay, trace-stats, conformance.

  gpu-sched replay [--trace PATH] [--policy POLICY] [--kv-tokens N] [--cost-model NAME] [--check]
                   [--out DIR] [--compare-policies fcfs,lpm,dfs-weight | --compare-backends reference,torch]
                   [--scheduler-time free|blocking|overlap] [--rate-scales X1,X2,...] [--seeds S1,S2,...]
                   [SGLang scheduler flags]
  gpu-sched trace-stats PATH
  gpu-sched conformance FILE

User errors (missing file, malformed trace row, bad config value) print one line
`gpu-sched: error: ...` on stderr and exit 2; a replay that cannot go on (integrity violation
under --check, a request that never fits) exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import math
import os
import sys
from typing import List, Optional

from .config import CAPTURE_CAPACITY_MAX as MAX_CAPTURE  # --capture's largest queue capacity

BACKENDS = ("reference", "torch", "triton")  # the one list of scheduler backends

#: --threads' largest (torch.set_num_threads itself crashes on some huge counts)
MAX_THREADS = 4096


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def make_scheduler_factory(backend: str, device: Optional[str] = None, capture: int = 0,
                           max_len: Optional[int] = None, threads: Optional[int] = None):
    """`factory(config, kv_pool_size, shuffle=None)` for a backend name (one of BACKENDS).
    capture > 0: device backends take the recorded step (`GpuScheduler.capture`) with that
    queue capacity (and running capacity), and `max_len` [tokens] as its bound on fill
    lengths when given (fewer search and tree rounds than the default, the pool's size).
    threads: device backends set torch's intra-op CPU threads to it (`torch.set_num_threads`;
    0 or None: torch's default, one per core)."""
    if not 0 <= capture <= MAX_CAPTURE:
        raise CliError(f"--capture must be in [0, {MAX_CAPTURE}], got {capture}")
    if threads is not None and not 0 <= threads <= MAX_THREADS:
        raise CliError(f"--threads must be in [0, {MAX_THREADS}], got {threads}")
    if backend == "reference":
        if capture:
            raise CliError("--capture needs a device backend (torch or triton), not the reference")
        # the reference runs on the host: any other device would be silently ignored
        if device not in (None, "cpu"):
            raise CliError(f"--device {device} needs a device backend (torch or triton); "
                           "the reference runs on the host")
        from .reference import ReferenceScheduler

        return lambda cfg, kv, shuffle=None: ReferenceScheduler(cfg, kv, shuffle=shuffle)
    if backend in ("torch", "triton"):
        import torch

        from .scheduler import GpuScheduler

        dev = device or "cpu"
        check_device(dev)
        if threads:
            torch.set_num_threads(threads)

        def factory(cfg, kv, shuffle=None):
            s = GpuScheduler(cfg, kv, shuffle=shuffle, backend=backend, device=dev)
            if capture:
                s.capture(queue_capacity=capture, running_capacity=capture, max_len=max_len)
            return s

        return factory
    raise CliError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def check_device(device: str) -> None:
    """CliError unless torch can run on `device`: checked up front, because an unusable device
    otherwise fails inside the first scheduler (a traceback, or every conformance scenario)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise CliError(f"--device {device!r} is not a torch device ({e})") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                raise CliError(f"--device {device}: torch {torch.__version__} has no CUDA")
            raise CliError(f"--device {device}: torch {torch.__version__} sees no CUDA device")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise CliError(f"--device {device}: torch sees {n} CUDA device{'s' if n != 1 else ''} "
                           f"(cuda:0 to cuda:{n - 1})")
        return
    mod = getattr(torch, dev.type, None)  # mps, xpu, ...: torch.<type>.is_available() where it exists
    if mod is None or not callable(getattr(mod, "is_available", None)) or not mod.is_available():
        raise CliError(f"--device {device}: torch {torch.__version__} has no available {dev.type} device")


# ---- SchedulerConfig knobs under SGLang's server-argument names ----------------------------
def _none_if_le0(v: int) -> Optional[int]:
    return None if v <= 0 else v


def _none_if_neg(v: int) -> Optional[int]:
    return None if v < 0 else v


# (flag, SchedulerConfig field, kind, help); kind: int, float, flag, or a converter int -> value
CONFIG_FLAGS = (
    ("--page-size", "page_size", int, "KV page size P [tokens]"),
    ("--max-prefill-tokens", "max_prefill_tokens", int, "prefill token budget per step"),
    ("--chunked-prefill-size", "chunked_prefill_size", _none_if_le0, "chunk budget per step; 0 or negative = off"),
    ("--max-running-requests", "max_running_requests", int, "cap on running requests"),
    ("--enable-priority-scheduling", "enable_priority_scheduling", "flag", "order fcfs/lof by priority first"),
    ("--schedule-low-priority-values-first", "schedule_low_priority_values_first", "flag",
     "lower priority values are scheduled first"),
    ("--priority-scheduling-preemption-threshold", "priority_scheduling_preemption_threshold", int,
     "priority gap a preemption victim must exceed"),
    ("--enable-priority-preemption", "enable_priority_preemption", "flag", "preempt lower-priority running requests"),
    ("--schedule-conservativeness", "schedule_conservativeness", float, "scales the initial new-token ratio"),
    ("--disable-radix-cache", "disable_radix_cache", "flag", "no prefix cache (cache-aware policies become fcfs)"),
    ("--enable-mixed-chunk", "enable_mixed_chunk", "flag", "decode running requests inside prefill steps"),
    ("--prefill-max-requests", "prefill_max_requests", int, "cap on requests admitted per step"),
    ("--truncation-align-size", "truncation_align_size", int, "chunk length alignment [tokens]"),
    ("--lpm-fallback-queue-len", "lpm_fallback_queue_len", _none_if_neg,
     "lpm falls back to fcfs above this queue length; negative = never"),
    ("--in-batch-prefix-caching-check-threshold", "in_batch_prefix_caching_check_threshold", int,
     "in-batch deprioritization check threshold; -1 disables"),
    ("--in-batch-prefix-caching-deprioritize-threshold", "in_batch_prefix_caching_deprioritize_threshold", int,
     "in-batch deprioritization threshold [tokens]"),
    ("--clip-max-new-tokens", "clip_max_new_tokens", int, "cap on the max-new-tokens estimate for budgeting"),
    ("--random-seed", "random_seed", int, "seed of the random policy"),
)

_FLAG_OF = {field: flag for flag, field, _, _ in CONFIG_FLAGS}  # config field -> its flag, for errors

# what an unset (None) SchedulerConfig field means, for the defaults shown in --help
_NONE_MEANS = {"chunked_prefill_size": "off", "max_running_requests": "no cap", "prefill_max_requests": "no cap",
               "truncation_align_size": "off", "lpm_fallback_queue_len": "never"}


def _preset_default(field: str) -> str:
    """' (default V)' from the presets themselves, so --help cannot drift from config.py."""
    from .config import PRESETS

    def show(v):
        if v is None:
            return _NONE_MEANS.get(field, "none")
        return ("on" if v else "off") if isinstance(v, bool) else v

    shown = {name: show(getattr(make(), field)) for name, make in PRESETS.items()}
    others = "".join(f"; {name} preset {v}" for name, v in shown.items() if v != shown["default"])
    return f" (default {shown['default']}{others})"


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler (SGLang server-argument names; unset = the preset's value)")
    g.add_argument("--preset", choices=("default", "sglang"), default="default",
                   help="'default' (the default): SchedulerConfig defaults; "
                        "'sglang': SGLang's exactly (lpm fallback at 128)")
    g.add_argument("--policy", "--schedule-policy", dest="schedule_policy", default=None,
                   help="lpm, dfs-weight, fcfs, lof, random or routing-key"
                        + _preset_default("schedule_policy"))
    for flag, field, kind, help_ in CONFIG_FLAGS:
        if kind == "flag":
            g.add_argument(flag, dest=field, action="store_true", default=None, help=help_ + _preset_default(field))
        else:
            g.add_argument(flag, dest=field, type=float if kind is float else int, default=None,
                           metavar="X" if kind is float else "N",
                           help=help_ + _preset_default(field))


def config_from_args(args):
    """The SchedulerConfig the flags describe (preset + the flags that were given)."""
    from .config import PRESETS

    overrides = {}
    if args.schedule_policy is not None:
        overrides["schedule_policy"] = args.schedule_policy
    for _, field, kind, _ in CONFIG_FLAGS:
        v = getattr(args, field)
        if v is None:
            continue
        overrides[field] = kind(v) if callable(kind) and kind not in (int, float) else v
    try:
        return PRESETS[args.preset](**overrides)
    except (ValueError, TypeError) as e:  # the config names its field: name the flag that set it too
        field = str(e).partition(" ")[0]  # the config's messages start "<field> must ..."
        flag = "--policy" if field == "schedule_policy" else _FLAG_OF.get(field)
        if flag is None or field not in overrides:
            raise
        raise type(e)(f"{flag} {getattr(args, field)!r}: {e}") from None


# ---- replay --------------------------------------------------------------------------------
def load_trace(args):
    """The trace a replay/trace-stats command names (or the synthetic workload)."""
    from .sim.traces import Trace, assign_keys, read_trace, synthetic_workload

    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    if not args.rate_scale > 0 or args.rate_scale == float("inf"):
        raise ValueError(f"--rate-scale must be a finite number > 0, got {args.rate_scale}")
    keys, levels = getattr(args, "routing_keys", 0), getattr(args, "priority_levels", 0)  # replay's options
    for flag, v in (("--routing-keys", keys), ("--priority-levels", levels)):
        if not 0 <= v <= 2**62:  # numpy draws them as int64
            raise ValueError(f"{flag} must be in [0, 2^62], got {v}")
    if getattr(args, "seed", 0) < 0:  # numpy's generators take seeds >= 0
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if getattr(args, "trace", None):
        tr = read_trace(args.trace, limit=args.limit, rate_scale=args.rate_scale, skip_bad_rows=args.skip_bad_rows)
    else:
        if args.synthetic_requests < 0:
            raise ValueError(f"--synthetic-requests must be >= 0, got {args.synthetic_requests}")
        flag = getattr(args, "rate_flag", "--rate-scale")  # a sweep's scale names its own flag
        if not math.isfinite(8.0 * args.rate_scale):
            raise ValueError(f"{flag} {args.rate_scale} makes the synthetic workload's rate "
                             f"(8 requests/s x it) overflow")
        tr = synthetic_workload(args.synthetic_requests, seed=args.seed, request_rate=8.0 * args.rate_scale)
        if not all(math.isfinite(r.arrival_s) for r in tr.requests):  # a tiny rate: arrivals past a float
            raise ValueError(f"{flag} {args.rate_scale} puts arrivals past a float's range")
        if args.limit is not None:
            tr = Trace(name=tr.name, requests=tr.requests[: args.limit], source=tr.source)
    if keys or levels:
        tr = assign_keys(tr, routing_keys=keys, priority_levels=levels, seed=args.seed)
    return tr


def _run_info(args, trace, config, cost, backend: Optional[str] = None) -> dict:
    """results.json's "config": what the run replayed and with what, enough to run it again
    (`argv` is the command line; `version` the package's, `commit` the checkout's when known)."""
    src = os.path.abspath(trace.source) if getattr(args, "trace", None) and trace.source else trace.source
    return {"trace": src or trace.name, "num_requests": len(trace), "bad_rows": trace.bad_rows,
            "limit": args.limit, "rate_scale": args.rate_scale,
            "synthetic_seed": None if getattr(args, "trace", None) else args.seed,
            "routing_keys": args.routing_keys, "priority_levels": args.priority_levels,
            "key_seed": args.seed if (args.routing_keys or args.priority_levels) else None,
            "backend": backend or args.backend,
            # what this run's scheduler took (--compare-backends' reference takes neither)
            "device": None if backend == "reference" else args.device,
            "capture": 0 if backend == "reference" else args.capture, "kv_tokens": args.kv_tokens,
            "cost_model": dataclasses.asdict(cost), "check": args.check,
            "scheduler_time": getattr(args, "scheduler_time", "free"),
            "max_new_tokens": getattr(args, "max_new_tokens", None),
            "scheduler": dataclasses.asdict(config), "argv": getattr(args, "argv", None),
            "version": _version(), "commit": _commit()}


def _scheduler_label(args, backend: str) -> str:
    if backend == "reference":
        return "reference scheduler (sequential, SPEC.md)"
    return (f"GpuScheduler, {backend} backend on {args.device or 'cpu'}"
            + (f", recorded step (capture, queue capacity {args.capture})" if args.capture else ", eager step"))


def _run_header(args, trace, cost, per_seed: bool = False, rate_swept: bool = False) -> str:
    """The lines printed above a replay's summary: what was replayed (`per_seed`: a workload
    drawn again per seed; `rate_swept`: replayed at several rates), that its serving figures
    are simulated by the cost model (not measured), and which scheduler decided."""
    if getattr(args, "compare_backends", None):
        sched = "; ".join(f"{b}: {_scheduler_label(args, b)}" for b in args.compare_backends)
    else:
        sched = _scheduler_label(args, args.backend)
    mode = getattr(args, "scheduler_time", "free")
    charged = {"free": "the scheduler's calls take no simulated time",
               "blocking": "each step also waits for the scheduler's calls (real time, --scheduler-time blocking)",
               "overlap": "each step also waits for what of the scheduler's calls outlasts the previous "
                          "forward (real time, --scheduler-time overlap)"}[mode]
    return "\n".join([
        f"Workload:  {'per seed, ' if per_seed else ''}{'rate swept, ' if rate_swept else ''}"
        f"{_workload_label(args, trace)}",
        f"Engine:    simulated, cost model {cost.name!r}" + (f" ({cost.description})" if cost.description else ""),
        "           (duration, throughput, TTFT, TPOT, ITL, E2EL: simulated time; the scheduler",
        "           sections: real wall time of this machine's scheduler calls);",
        f"           {charged}",
        f"Scheduler: {sched}"])


def _workload_label(args, trace) -> str:
    """The replayed workload in a line (plot titles): the trace and the options that reshape it."""
    parts = [trace.name, f"{len(trace)} requests"]
    if args.rate_scale != 1.0:
        parts.append(f"rate x{args.rate_scale:g}")
    if getattr(args, "routing_keys", 0):
        parts.append(f"{args.routing_keys} routing keys")
    if getattr(args, "priority_levels", 0):
        parts.append(f"{args.priority_levels} priority levels")
    if getattr(args, "max_new_tokens", None) is not None:
        parts.append(f"max_new_tokens {args.max_new_tokens}")
    parts.append(f"KV {args.kv_tokens} tokens")
    return ", ".join(parts)


@functools.lru_cache(maxsize=None)
def _version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("gpu-sched")
    except Exception:  # not installed as a distribution (a bare checkout on sys.path)
        return None


@functools.lru_cache(maxsize=None)
def _commit() -> Optional[str]:
    """The git commit of the checkout this package runs from, or None (not a checkout, no git)."""
    import subprocess
    from pathlib import Path

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _parse_backends(args, policies) -> Optional[list]:
    """--compare-backends as a list of distinct BACKENDS names, or None; ValueError naming the
    flag otherwise, or with --compare-policies (one comparison at a time) or --backend (the
    backends named twice)."""
    raw = getattr(args, "compare_backends", None)
    if raw is None:
        return None
    names = [b.strip() for b in raw.split(",")]
    if len(names) < 2 or len(set(names)) != len(names) or not all(b in BACKENDS for b in names):
        raise ValueError(f"--compare-backends needs two or more distinct names of {', '.join(BACKENDS)}, "
                         f"comma-separated, got {raw!r}")
    if policies is not None:
        raise ValueError("--compare-policies and --compare-backends: compare one of them at a time")
    if args.backend != "reference":
        raise ValueError(f"--backend {args.backend} and --compare-backends {raw} name the backends twice: "
                         f"give one of them")
    return names


def _parse_seeds(args):
    """--seeds as a list of distinct ints >= 0, or None; ValueError when they would replay the
    same requests every time (a trace with neither --routing-keys nor --priority-levels)."""
    if not getattr(args, "seeds", None):
        return None
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated ints, got {args.seeds!r}") from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds needs distinct ints >= 0, got {args.seeds!r}")
    if getattr(args, "trace", None) and not (args.routing_keys or args.priority_levels):
        raise ValueError("--seeds re-seeds the synthetic workload and the --routing-keys / --priority-levels "
                         "draws; with --trace and neither, every seed replays the same requests")
    if args.check:
        raise ValueError("--seeds and --check: check one seed's run at a time (--seed)")
    return seeds


def _parse_rate_scales(args) -> Optional[list]:
    """--rate-scales as an increasing list of two or more distinct finite floats > 0, or None;
    ValueError naming the flag otherwise, or with --rate-scale other than 1 (the rate given
    twice)."""
    raw = getattr(args, "rate_scales", None)
    if raw is None:
        return None
    try:
        rates = [float(x) for x in raw.split(",")]
    except ValueError:
        raise ValueError(f"--rate-scales takes comma-separated numbers, got {raw!r}") from None
    if len(rates) < 2 or len(set(rates)) != len(rates) or not all(0 < x < float("inf") for x in rates):
        raise ValueError(f"--rate-scales needs two or more distinct finite numbers > 0, got {raw!r}")
    if args.rate_scale != 1.0:
        raise ValueError(f"--rate-scale {args.rate_scale:g} and --rate-scales {raw} give the rate twice: "
                         f"give one of them")
    return sorted(rates)


def scale_label(x: float) -> str:
    """A rate scale as the sweep names it (folders `rate_x<label>`, sweep.json's keys, table
    rows): Python's shortest repr that reads back as the same float, without a trailing ".0",
    so distinct scales never share a name (1.0000001 is not "1")."""
    r = repr(float(x))
    return r[:-2] if r.endswith(".0") else r


def _offered_rate(trace) -> Optional[float]:
    """The trace's offered request rate [req/s]: its mean arrival rate, (requests - 1) over the
    span of their arrival times (None when they all arrive at one time, or so close together
    that the rate overflows a float)."""
    ts = [r.arrival_s for r in trace.requests]
    span = max(ts) - min(ts) if ts else 0.0
    rate = (len(ts) - 1) / span if span > 0 else None
    return rate if rate is None or math.isfinite(rate) else None  # a span below 1 / float max


def _replay_rates(args, configs: dict, base, cost, rates, policies, seeds=None) -> int:
    """--rate-scales: every config replayed once per rate scale (arrivals as --rate-scale X
    makes them) and, with --seeds, per seed at each scale (each point the plain run with that
    --rate-scale and --seed); every point's trace read before the first run, so that one that
    cannot be replayed stops the sweep before it starts. Then each metric by offered request
    rate (with seeds, mean +- std over them). With --out: each scale's runs as --out writes
    one replay, in rate_x<X>/ (not with seeds, as --seeds writes no per-run files), and
    sweep.json / sweep.png."""
    from pathlib import Path

    from .sim.metrics import format_rate_sweep, seed_spread, strict_json, sweep_rows
    from .sim.plots import plot_rate_sweep

    sds = seeds or [None]
    points = {}
    for x in rates:  # every point's trace read first: one that cannot be replayed stops the sweep before any run
        for sd in sds:
            a = _args_with(args, rate_scale=x, rate_flag="--rate-scales' scale", seed=args.seed if sd is None else sd)
            points[x, sd] = (a, _replay_trace(a, configs, notes=(x, sd) == (rates[0], sds[0])))
    per_point, offered = {}, {}
    for x in rates:
        for sd in sds:
            a, trace = points.pop((x, sd))
            got = _replay_runs(a, configs, trace, cost)
            if isinstance(got, int):
                return got
            per_point[x, sd] = got[0]
            offered.setdefault(x, []).append(_offered_rate(trace))
            print(f"rate x{scale_label(x)}{'' if sd is None else f', seed {sd}'}: "
                  + ", ".join(f"{n} {s['digest'][:12]}" for n, s in got[0].items()), flush=True)
            if args.out and sd is None:  # as the sweep goes: a scale's per-request records are not kept past it
                _write_runs(a, Path(args.out) / f"rate_x{scale_label(x)}", trace, configs, base, cost, got, policies)
        rs = offered[x]
        mean = None if None in rs else sum(r / len(rs) for r in rs)  # the mean over the seeds (no overflow in a sum)
        offered[x] = mean if mean is None or math.isfinite(mean) else None
        if x == rates[0] and all(r is None for r in rs):
            print("gpu-sched: note: the requests all arrive at one time, which no rate scale changes: every "
                  "scale replays the same arrivals", file=sys.stderr)
    if seeds is None:
        per_rate = {x: per_point[x, None] for x in rates}
    else:
        rows = sweep_rows([s for by_run in per_point.values() for s in by_run.values()])
        per_rate = {x: seed_spread({sd: per_point[x, sd] for sd in seeds}, rows) for x in rates}
    a = _args_with(args, rate_scale=1.0)
    label = _workload_label(a, trace)
    print(_run_header(a, trace, cost, per_seed=seeds is not None, rate_swept=True))
    print(format_rate_sweep(per_rate, offered, scale_label, seeds))
    if args.compare_backends:
        print(_backends_agreement(args, base, {f"x{scale_label(x)}" + ("" if sd is None else f" seed {sd}"): s
                                               for (x, sd), s in per_point.items()},
                                  every="at every rate scale" + ("" if seeds is None else " and seed")))
    if args.check:
        print(_check_passed(list(configs) if policies or args.compare_backends else None, sweep=True))
    if args.out:
        drop = ("rate_scale",) + (("synthetic_seed", "key_seed") if seeds is not None else ())
        doc = {"workload": label, "rate_scales": list(rates), "offered_request_rate": [offered[x] for x in rates],
               "runs": list(configs),
               "summaries": {scale_label(x): (per_rate[x] if seeds is None else
                                              {str(sd): per_point[x, sd] for sd in seeds}) for x in rates},
               "config": _sweep_config(a, trace, configs, cost, drop)}
        if seeds is not None:
            doc.update(seeds=list(seeds), spread={scale_label(x): per_rate[x] for x in rates},
                       spread_keys=_derived_keys(per_rate.values()))
        with _writing(args.out) as out:
            over = "" if seeds is None else f"; mean +- std over seeds {', '.join(str(sd) for sd in seeds)}"
            plot_rate_sweep(out, per_rate, offered, title=label + over, spread=seeds is not None)
            (out / "sweep.json").write_text(strict_json(doc) + "\n")
        print(f"results written to {args.out}")
    return 0


def _replay_trace(args, configs: dict, notes: bool = True):
    """The trace a replay runs (`load_trace`; CliError when it cannot be read or holds no
    request), and with `notes`, a note on stderr for each policy with nothing to order by."""
    try:
        trace = load_trace(args)
    except (FileNotFoundError, ValueError, TypeError) as e:  # TraceFormatError is a ValueError
        raise CliError(str(e)) from None
    if not trace.requests:  # a summary of nothing (all n/a) would read as a run
        given = (f" with --limit {args.limit}" if args.limit == 0 else
                 " with --synthetic-requests 0" if not getattr(args, "trace", None) else "")
        raise CliError(f"no requests to replay in {trace.source or trace.name}{given}")
    reqs = trace.requests
    if notes and trace.bad_rows:
        print(f"gpu-sched: note: skipped {trace.bad_rows} malformed row{'s' if trace.bad_rows != 1 else ''} "
              f"of {trace.source} (--skip-bad-rows)", file=sys.stderr)
    if notes and getattr(args, "priority_levels", 0) and not any(c.enable_priority_scheduling for c in configs.values()):
        print("gpu-sched: note: --priority-levels gives requests priorities, which only "
              "--enable-priority-scheduling reads; without it they change nothing", file=sys.stderr)
    seen = set()
    for cfg in configs.values() if notes else ():
        name = cfg.schedule_policy
        if name in seen:  # one note per policy (runs compared by backend share it)
            continue
        seen.add(name)
        if name == "routing-key" and not any(r.routing_key for r in reqs):
            how = "plain fcfs (no priority sort)" if cfg.enable_priority_scheduling else "fcfs"
            print(f"gpu-sched: note: no request has a routing key, so routing-key orders as {how}; "
                  "--routing-keys N gives them keys", file=sys.stderr)
        if cfg.enable_priority_scheduling and all(r.priority is None for r in reqs):
            print("gpu-sched: note: no request has a priority, so priority scheduling changes nothing; "
                  "--priority-levels K gives them priorities", file=sys.stderr)
        if name in ("lpm", "dfs-weight") and getattr(args, "trace", None) and not any(r.hash_ids for r in reqs):
            print(f"gpu-sched: note: {trace.name} records no prompt contents (each prompt is a unique "
                  f"stream), so nothing is shared and {name} finds no prefix to reuse", file=sys.stderr)
    for note in _ignored_options_notes(args, configs, trace) if notes else ():
        print(f"gpu-sched: note: {note}", file=sys.stderr)
    return trace


def _ignored_options_notes(args, configs: dict, trace) -> List[str]:
    """Notes for options this replay reads nowhere (each given on the command line,
    `args.given`), and for priorities that a policy's order does not read."""
    given = getattr(args, "given", frozenset())
    notes = []
    if getattr(args, "trace", None):
        if "synthetic_requests" in given:
            notes.append("--synthetic-requests sizes the synthetic workload: with --trace it changes nothing")
        if "seed" in given and not (args.routing_keys or args.priority_levels):
            notes.append("--seed seeds the synthetic workload and the --routing-keys / --priority-levels draws: "
                         "with --trace and neither of those it changes nothing")
    if getattr(args, "seeds", None) and "seed" in given:
        notes.append("--seed is replaced by each of --seeds in turn: it changes nothing here")
    if set(_run_backends(args, configs).values()) == {"reference"}:  # (a --device other than cpu is refused)
        for dest, what in (("threads", "--threads sets torch's threads"), ("device", "--device cpu picks the device")):
            if dest in given and (dest != "device" or str(args.device).split(":")[0] == "cpu"):
                notes.append(f"{what} of the torch and triton backends: the reference scheduler ignores it")
    cfgs = list(configs.values())
    if "schedule_low_priority_values_first" in given and not any(
            c.enable_priority_scheduling or c.enable_priority_preemption for c in cfgs):
        notes.append("--schedule-low-priority-values-first sets the priority direction, which only "
                     "--enable-priority-scheduling and --enable-priority-preemption read: it changes nothing here")
    # (with --priority-levels the key draws move the priority draws: keys then change them)
    if getattr(args, "routing_keys", 0) and not getattr(args, "priority_levels", 0) and not any(
            c.schedule_policy == "routing-key" for c in cfgs):
        notes.append("--routing-keys gives requests routing keys, which only the routing-key policy reads: "
                     "they change nothing here")
    if any(r.priority is not None for r in trace.requests):
        deaf = sorted({c.schedule_policy for c in cfgs if c.enable_priority_scheduling
                       and c.schedule_policy not in ("fcfs", "lof")})
        if deaf:
            notes.append(f"{', '.join(deaf)} {'does' if len(deaf) == 1 else 'do'} not sort by priority (SPEC R-ORD: "
                         f"only fcfs and lof do, with --enable-priority-scheduling); priorities change "
                         f"{'its' if len(deaf) == 1 else 'their'} decisions only through "
                         f"--enable-priority-preemption's choice of victims")
    if any(c.schedule_policy == "lof" for c in cfgs) and getattr(args, "max_new_tokens", None) is None:
        notes.append("each request's max_new_tokens is its trace output length, so lof sorts by the true output "
                     "length (an oracle no engine has) and the KV budgets reserve exactly what each request "
                     "generates; --max-new-tokens N gives every request the same max_new_tokens, as clients "
                     "that leave max_tokens at a default")
    return notes


def _run_backends(args, configs: dict) -> dict:
    """{run name: backend}: each run's from --compare-backends (runs named by backend), else
    --backend's."""
    return {name: name for name in configs} if getattr(args, "compare_backends", None) else dict.fromkeys(
        configs, args.backend)


def _replay_runs(args, configs: dict, trace, cost):
    """Replay `trace` once per config: ({name: summary}, {name: (requests, steps)}), or exit
    status 1 after printing where a replay stopped. With --compare-backends each run takes its
    own backend (--capture for the device backends only)."""
    from .sim.engine import SimulationError, replay

    # after the trace: a device backend imports torch (seconds), a wrong path should not wait
    # a request's fill is its prompt and at most max(output_len, 1) generated tokens (engine.py)
    max_len = max((r.input_len + max(r.output_len, 1) for r in trace.requests), default=1)  # --max-new-tokens only cuts
    backends = _run_backends(args, configs)
    factories = {}
    for b in dict.fromkeys(backends.values()):
        # compared with others, the reference leaves them --device and --capture
        ref = b == "reference" and bool(getattr(args, "compare_backends", None))
        factories[b] = make_scheduler_factory(b, None if ref else args.device, 0 if ref else args.capture,
                                              max_len, args.threads)
    progress = not args.no_progress and sys.stderr.isatty()
    summaries, runs = {}, {}
    for name, cfg in configs.items():
        factory = factories[backends[name]]
        gc.collect()  # the previous run's scheduler holds reference cycles (queue views <-> scheduler)
        try:
            summary, requests, steps = replay(trace, cfg, kv_tokens=args.kv_tokens,
                                              make_scheduler=lambda c, kv, f=factory: f(c, kv),
                                              cost_model=cost, check=args.check, progress=progress,
                                              scheduler_time=getattr(args, "scheduler_time", "free"),
                                              max_new_tokens=getattr(args, "max_new_tokens", None))
        except SimulationError as e:
            print(f"gpu-sched: error: replay ({name}) stopped at {e}", file=sys.stderr)
            return 1
        summaries[name] = summary
        runs[name] = (requests, steps)
    return summaries, runs


def _args_with(args, **changes) -> argparse.Namespace:
    """A copy of `args` with `changes` (a sweep's point: its seed, its rate scale)."""
    return argparse.Namespace(**dict(vars(args), **changes))


def _sweep_config(args, trace, configs: dict, cost, drop=()) -> dict:
    """The "config" of seeds.json / sweep.json: `_run_info` without what varies over the sweep
    (`drop`) nor the one run's scheduler, with every run's scheduler configuration and, with
    --compare-backends, the backends."""
    info = {k: v for k, v in _run_info(args, trace, next(iter(configs.values())), cost).items()
            if k not in ("scheduler", *drop)}
    if args.compare_backends:  # the runs are the backends
        info["backend"] = list(args.compare_backends)
    return dict(info, schedulers={n: dataclasses.asdict(c) for n, c in configs.items()})


def _derived_keys(spreads) -> dict:
    """`metrics.DERIVED_KEYS` for the derived keys that `spreads` (`seed_spread` results) hold."""
    from .sim.metrics import DERIVED_KEYS

    held = {k for sp in spreads for by_key in sp.values() for k in by_key}
    return {k: v for k, v in DERIVED_KEYS.items() if k in held}


@contextlib.contextmanager
def _writing(out):
    """`out` as a Path, made if missing, for the files --out writes; an OSError while writing
    them becomes one CliError naming the folder."""
    from pathlib import Path

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        yield Path(out)
    except OSError as e:
        raise CliError(f"cannot write results to {out}: {e}") from None


def _replay_seeds(args, configs: dict, cost, seeds) -> int:
    """--seeds: every config replayed once per seed (the synthetic workload and the key and
    priority draws re-seeded), then each metric's mean and spread over the seeds."""
    from .sim.metrics import format_seed_spread, seed_spread, strict_json

    per_seed, label = {}, None
    for sd in seeds:
        a = _args_with(args, seed=sd)
        trace = _replay_trace(a, configs, notes=sd == seeds[0])
        got = _replay_runs(a, configs, trace, cost)
        if isinstance(got, int):
            return got
        per_seed[sd] = got[0]
        label = label or _workload_label(a, trace)
        print(f"seed {sd}: " + ", ".join(f"{n} {s['digest'][:12]}" for n, s in got[0].items()), flush=True)
    spread = seed_spread(per_seed)
    print(_run_header(args, trace, cost, per_seed=True))
    print(format_seed_spread(spread, seeds))
    if args.compare_backends:
        print(_backends_agreement(args, next(iter(configs.values())), {f"seed {sd}": per_seed[sd] for sd in seeds},
                                  every="with every seed"))
    if args.out:
        doc = {"workload": label, "seeds": list(seeds), "runs": list(configs), "spread": spread,
               "spread_keys": _derived_keys([spread]),
               "summaries": {str(sd): v for sd, v in per_seed.items()},
               "config": _sweep_config(args, trace, configs, cost, ("synthetic_seed", "key_seed"))}
        with _writing(args.out) as out:
            (out / "seeds.json").write_text(strict_json(doc) + "\n")
        print(f"results written to {args.out}")
    return 0


def _write_runs(args, out, trace, configs: dict, base, cost, got, policies) -> None:
    """--out for one replay of `configs` (`_replay_runs`' result `got`): each run's results.json
    and plots (in out/<run>/ when several are compared), and with several, comparison.json and
    comparison.png in `out`. CliError when a file cannot be written."""
    from .sim.metrics import strict_json, write_results
    from .sim.plots import plot_comparison, plot_run, plot_ttft_cdfs

    summaries, runs = got
    compared = policies or args.compare_backends
    backends = _run_backends(args, configs)
    rate = f", rate x{scale_label(args.rate_scale)}" if args.rate_scale != 1.0 else ""
    with _writing(out) as folder:
        for name, (requests, steps) in runs.items():
            d = folder / name if compared else folder
            write_results(d, summaries[name], requests, steps,
                          extra=_run_info(args, trace, configs[name], cost, backends[name]))
            run = name if not args.compare_backends else f"{configs[name].schedule_policy}, {name}"
            plot_run(d, requests, steps, title=f"{trace.name}, {run}{rate}")
        if compared:
            wl = _workload_label(args, trace)
            what = f", {base.schedule_policy}" if args.compare_backends else ""
            plot_comparison(out, summaries, title=wl + what)
            plot_ttft_cdfs(out, {name: requests for name, (requests, _) in runs.items()}, title=wl + what)
            # the runs side by side in one file: each run's summary and the shared setting
            shared = {k: v for k, v in _run_info(args, trace, base, cost).items() if k != "scheduler"}
            if policies:
                doc = {"workload": wl, "policies": list(summaries), "summaries": summaries,
                       "config": dict(shared, schedulers={n: dataclasses.asdict(c) for n, c in configs.items()})}
            else:
                shared.pop("backend")
                doc = {"workload": wl, "backends": list(summaries), "summaries": summaries,
                       "config": dict(shared, scheduler=dataclasses.asdict(base))}
            (folder / "comparison.json").write_text(strict_json(doc) + "\n")


def unwritable_reason(folder) -> Optional[str]:
    """Why files cannot be written into `folder` (it, or the folders missing on its path, made
    when written), or None: the nearest existing entry on its path is a link that leads
    nowhere, a file, or a folder without write and search permission, or the path itself is
    an error (too long, a folder on it that cannot be searched). Checked before a run, so that
    its end does not fail to write its results."""
    from pathlib import Path

    try:
        base = Path(folder).absolute()
        while not (base.exists() or base.is_symlink()):  # exists() is False for a dangling link
            base = base.parent
        if base.is_symlink() and not base.exists():
            return f"{base} is a link that leads nowhere"
        if not base.is_dir():
            return f"{base} is a file, not a folder"
        if not os.access(base, os.W_OK | os.X_OK):
            return f"{base} is not writable"
    except OSError as e:
        return str(e)
    return None


def _check_out_dir(out: str) -> None:
    """CliError unless `out` is a folder this run can write into, or one it can make there
    (made when the results are written: a run that fails leaves no empty folder)."""
    why = unwritable_reason(out)  # a file at `out` itself included
    if why is None:
        why = _write_probe(out)
    if why:
        raise CliError(f"cannot write results to {out}: {why}")


def _write_probe(folder) -> Optional[str]:
    """Why a file cannot be made in `folder` by trying (permission bits say nothing to root, nor
    about a read-only or special file system such as /proc): a temporary file made and removed
    in it, or where it is missing, its first missing folder made and removed. None when that
    works."""
    import tempfile
    from pathlib import Path

    path = Path(folder).absolute()
    if path.is_dir():
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            return f"a file cannot be made in it ({e.strerror or e})"
        return None
    first = path
    while not first.parent.exists():
        first = first.parent
    try:
        first.mkdir()
        first.rmdir()
    except OSError as e:
        return f"the folder {first} cannot be made ({e.strerror or e})"
    return None


def cmd_replay(args) -> int:
    from .sim.engine import get_cost_model
    from .sim.traces import MAX_TRACE_TOKENS
    from .sim.metrics import format_comparison, format_summary

    try:
        if not 1 <= args.kv_tokens <= 2**40:
            raise ValueError(f"--kv-tokens must be in [1, 2^40], got {args.kv_tokens}")
        if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= MAX_TRACE_TOKENS:
            raise ValueError(f"--max-new-tokens must be in [1, {MAX_TRACE_TOKENS}], got {args.max_new_tokens}")
        cost = get_cost_model(args.cost_model)
        base = config_from_args(args)
        policies = [p.strip() for p in args.compare_policies.split(",")] if args.compare_policies else None
        if policies is not None and (not all(policies) or len(set(policies)) != len(policies)):
            raise ValueError(f"--compare-policies needs distinct comma-separated names, got {args.compare_policies!r}")
        if policies is not None and args.schedule_policy is not None:  # one of them would be ignored
            raise ValueError(f"--policy {args.schedule_policy} and --compare-policies {args.compare_policies} "
                             f"name the policies twice: give one of them")
        configs = {}
        for p in policies or ():
            try:
                configs[p] = base.replace(schedule_policy=p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"--compare-policies {args.compare_policies}: {e}") from None
        configs = configs or {base.schedule_policy: base}
        args.compare_backends = _parse_backends(args, policies)
        if args.compare_backends:
            configs = {b: base for b in args.compare_backends}
        seeds = _parse_seeds(args)
        rates = _parse_rate_scales(args)
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    if args.out is not None:  # before the run, not after it
        if not args.out.strip():
            raise CliError("--out must name a folder, got an empty string")
        _check_out_dir(args.out)
    if args.check and args.scheduler_time != "free":
        print(f"gpu-sched: note: --check's walks between steps leave the scheduler's next calls on cold "
              f"caches, so --scheduler-time {args.scheduler_time} charges more than without it: compare "
              f"charged runs without --check", file=sys.stderr)
    if rates is not None:
        return _replay_rates(args, configs, base, cost, rates, policies, seeds)
    if seeds is not None:
        return _replay_seeds(args, configs, cost, seeds)
    trace = _replay_trace(args, configs)
    got = _replay_runs(args, configs, trace, cost)
    if isinstance(got, int):
        return got
    summaries = got[0]
    compared = policies or args.compare_backends  # the runs' names, when several are compared
    if args.out:
        _write_runs(args, args.out, trace, configs, base, cost, got, policies)
    print(_run_header(args, trace, cost))
    if compared:
        print(format_comparison(summaries))
        for name, s in summaries.items():
            print(f"decision digest [{name}]: {s['digest']}")
        if args.compare_backends:
            print(_backends_agreement(args, base, {None: summaries}))
    else:
        (name, s), = summaries.items()
        label = name + (" + priority" if configs[name].enable_priority_scheduling else "")
        print(format_summary(s, title=f"Replay: {trace.name}, {label}, {args.backend}"))
        print(f"decision digest: {s['digest']}")
    if args.check:
        print(_check_passed(summaries if compared else None))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def _backends_agreement(args, base, points, every: str = "at every rate scale") -> str:
    """--compare-backends' closing line: whether the backends made the same decisions (equal
    digests) in every one of `points` ({point name: {backend: summary}}, one replay of a sweep
    each, or {None: ...} for one replay; a sweep names the points where they differ, and says
    `every` where they do not), or why their digests are not compared (charged runs)."""
    if args.scheduler_time != "free":
        return (f"the digests are not compared: with --scheduler-time {args.scheduler_time} each run's "
                f"decisions depend on its scheduler's timing")
    differ = [k for k, p in points.items() if len({s["digest"] for s in p.values()}) > 1]
    same = not differ
    where = ("" if list(points) == [None] else f" {every}" if same else
             f" at {', '.join(differ)}")
    return ((f"the backends made the same decisions{where} (equal digests)" if same else
             f"the backends' decisions differ{where} (their digests differ)")
            + ("; random draws its permutation per backend (SPEC R-ORD-6)"
               if not same and base.effective_policy == "random" else ""))


def _check_passed(runs, sweep: bool = False) -> str:
    """--check's closing line (a violation stops the replay with exit 1, so reaching it means
    every check held); `runs`: the compared runs' names, or None for one run."""
    names = f" [{', '.join(runs)}]" if runs else ""
    return (f"integrity check passed{names}{' at every rate scale' if sweep else ''}: tree, lock and KV-pool "
            f"invariants held after every scheduler step")


#: trace-stats' units by key (input_* / output_* by their prefix)
_STAT_UNITS = {"duration_s": "s", "request_rate": "req/s", "max_gap_s": "s", "peak_rate_60s": "req/s",
               "input": "tokens", "output": "tokens", "total_input_tokens": "tokens",
               "total_output_tokens": "tokens"}


def cmd_trace_stats(args) -> int:
    from .sim.traces import trace_stats

    try:
        trace = load_trace(args)
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    if not trace.requests:  # statistics of nothing would print rows of nan
        raise CliError(f"no requests in {trace.source or trace.name}"
                       + (f" ({trace.bad_rows} malformed rows skipped)" if trace.bad_rows else "")
                       + (f" with --limit {args.limit}" if args.limit == 0 else ""))
    stats = trace_stats(trace)
    print(f"trace {trace.name} ({trace.source}), {trace.bad_rows} bad rows skipped")
    width = max(len(k) for k in stats) + 2
    for k, v in stats.items():
        if v is None:
            s = "n/a"
        elif isinstance(v, int):
            s = str(v)
        else:
            s = f"{v:.4f}" if k in ("repeat_block_frac", "interarrival_cv") else f"{v:.2f}"
        unit = _STAT_UNITS.get(k.rsplit("_", 1)[0] if k.startswith(("input_", "output_")) else k, "")
        print(f"  {k:<{width}}{s:>16}" + (f"  {unit}" if unit else ""))
    print("  interarrival_cv: std / mean of the gaps between arrivals (1 for Poisson arrivals, above 1 "
          "for bursts); peak_rate_60s: the busiest 60 s window's arrivals / 60")
    if stats["repeat_block_frac"] is not None:
        print("  repeat_block_frac: the share of prompt blocks equal to an earlier one (an upper bound "
              "on the block hit rate of an infinite cache)")
    else:
        print("  repeat_block_frac n/a: the trace has no prompt block hashes (Mooncake's hash_ids)")
    return 0


def cmd_conformance(args) -> int:
    from .conformance import run_file

    factory = make_scheduler_factory(args.backend, args.device, args.capture, threads=args.threads)
    try:
        passed, failed = run_file(args.file, factory)
    except (FileNotFoundError, ValueError) as e:  # reading the file; a scenario's own errors are failures
        raise CliError(str(e)) from None
    if passed + failed == 0:
        raise CliError(f"no scenarios in {args.file}")
    return 1 if failed else 0


def _add_trace_reading(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=int, default=None, metavar="N", help="keep the first N requests (default: all)")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="X",
                   help="multiply the request rate by X (default %(default)s)")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip malformed trace rows instead of failing")


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="reference",
                   help=f"scheduler backend: {', '.join(BACKENDS)} (default %(default)s)")
    p.add_argument("--device", default=None,
                   help="torch device of the torch and triton backends, e.g. cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--capture", type=int, default=0, metavar="N",
                   help="device backends: the recorded step (CUDA graph on CUDA) for queues up to N "
                        "(default 0: off); on a CPU it runs the step's tensor forms, a check of its "
                        "decisions that is far slower than the eager path")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="device backends: torch's CPU threads (default %(default)s; 0: torch's default, one "
                        "per core). The scheduler's CPU tensor ops are small: more threads add fork/join "
                        "cost, and stall whenever another process holds a core")


def build_parser() -> argparse.ArgumentParser:
    from .sim.engine import COST_MODELS, DEFAULT_COST_MODEL

    p = argparse.ArgumentParser(prog="gpu-sched", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay a trace through the scheduler and a simulated engine")
    r.add_argument("--trace", default=None, metavar="PATH",
                   help="Mooncake .jsonl or Azure .csv trace (default: the built-in synthetic workload)")
    _add_trace_reading(r)
    r.add_argument("--rate-scales", default=None, metavar="X1,X2,...",
                   help="a load sweep: replay once per rate scale (each policy or backend with "
                        "--compare-policies or --compare-backends) and print each metric by offered "
                        "request rate (the synthetic workload's grows less than the scale: its "
                        "think times do not scale); --out writes rate_x<X>/ per scale, sweep.json and "
                        "sweep.png; with --seeds, each scale once per seed, mean +- std over them, and --out "
                        "writes only sweep.json and sweep.png (not with --rate-scale)")
    r.add_argument("--synthetic-requests", type=int, default=400, metavar="N",
                   help="requests of the synthetic workload (default %(default)s; without --trace)")
    r.add_argument("--routing-keys", type=int, default=0, metavar="N",
                   help="give requests one of N routing keys (from the first prefix block not every request "
                        "shares, or the session; "
                        "sim.traces.assign_keys): no trace records any, and without keys routing-key "
                        "orders as fcfs (default 0: none)")
    r.add_argument("--priority-levels", type=int, default=0, metavar="K",
                   help="give requests priorities drawn from [0, K) (seeded by --seed), for "
                        "--enable-priority-scheduling (default 0: none)")
    r.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="replay once per seed (each policy or backend with --compare-policies or "
                        "--compare-backends) and print each "
                        "metric's mean +- std over the seeds (population std, ddof=0: with a few seeds "
                        "it reads ~0.8x the sample std); --out writes seeds.json (with --rate-scales: "
                        "sweep.json)")
    r.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic workload and of the --routing-keys / --priority-levels "
                        "draws (default %(default)s)")
    r.add_argument("--kv-tokens", type=int, default=1_000_000, metavar="N",
                   help="KV pool size [tokens] (default %(default)s)")
    r.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="give every request max_new_tokens N, as clients that leave max_tokens at a default; "
                        "each still stops at its trace output length (as at an EOS), cut at N. Default: each "
                        "request's max_new_tokens is its own output length, which the scheduler then knows "
                        "in advance (lof sorts by the true output length, the KV budgets reserve exactly "
                        "what each request generates)")
    _add_backend_flags(r)
    r.add_argument("--cost-model", default=DEFAULT_COST_MODEL,
                   help=f"step-cost preset: {', '.join(COST_MODELS)} (default {DEFAULT_COST_MODEL}), or a "
                        f".json file of sim.engine.CostModel's fields (fixed_s, prefill_token_s, "
                        f"decode_request_s, kv_token_s, in seconds)")
    r.add_argument("--scheduler-time", default="free", choices=("free", "blocking", "overlap"),
                   help="what the scheduler's own calls cost in simulated time: free (nothing: "
                        "deterministic, the same digest on every machine; the default), blocking (each "
                        "step waits for the real time of every scheduler call since the previous "
                        "forward, as SGLang's normal event loop) or overlap (only for what of it outlasts "
                        "the previous forward, as SGLang's overlap loop). The last two make the run "
                        "depend on this machine's speed, so its digest may change from run to run")
    r.add_argument("--check", action="store_true", help="check scheduler integrity after every step")
    r.add_argument("--out", default=None, metavar="DIR",
                   help="write results.json and PNG plots here (with --compare-policies or --compare-backends: "
                        "DIR/<policy>/ or DIR/<backend>/ "
                        "for each run and DIR/comparison.{json,png}; default: print the summary only)")
    r.add_argument("--compare-policies", default=None, metavar="P1,P2,...",
                   help="run each policy and print one comparison table (default: one run, of --policy; "
                        "not with --policy)")
    r.add_argument("--compare-backends", default=None, metavar="B1,B2,...",
                   help=f"run the same policy with each backend ({', '.join(BACKENDS)}) and print one comparison "
                        f"table, and with --scheduler-time free (the default) whether their decisions agree; "
                        f"with blocking or overlap it compares what each one's speed costs (their digests then "
                        f"depend on timing); --device and --capture apply to the device backends")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stderr is not a TTY)")
    _add_config_flags(r)
    r.set_defaults(func=cmd_replay)

    t = sub.add_parser("trace-stats", help="print summary statistics of a trace")
    t.add_argument("trace", metavar="PATH", help="Mooncake .jsonl or Azure .csv trace")
    _add_trace_reading(t)
    t.set_defaults(func=cmd_trace_stats)

    c = sub.add_parser("conformance", help="run conformance scenarios (the format: shared/conformance/FORMAT.md, "
                                           "beside this repository) and print 'N passed, M failed'")
    c.add_argument("file", help="scenario file (.jsonl or .jsonl.gz)")
    _add_backend_flags(c)
    c.set_defaults(func=cmd_conformance)
    return p


def _given_options(argv: List[str]) -> frozenset:
    """The dests of the options the command line gives (abbreviated or `--flag=value` forms
    included), from a second parse in which no option has a default: what a note may call
    ignored (its default value given explicitly counts as given)."""
    parser = build_parser()
    for action in parser._actions:  # the subcommands' parsers
        for sub in getattr(action, "choices", None).values() if isinstance(action, argparse._SubParsersAction) else ():
            for a in sub._actions:
                if a.dest not in ("help", "command"):
                    a.default = argparse.SUPPRESS
            sub.set_defaults(func=None)
    try:
        return frozenset(vars(parser.parse_args(argv)))
    except SystemExit:  # cannot happen after the first parse succeeded
        return frozenset()


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = ["gpu-sched"] + argv  # recorded in results.json
    args.given = _given_options(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"gpu-sched: error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # e.g. a pool or capture larger than this machine holds
        print(f"gpu-sched: error: MemoryError: {e or 'out of memory'}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed early (`| head`): no traceback, and none at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
