"""Plot `bench_queue.py` rows: median time per call against queue length, log-log, one line per
backend/device, one panel per (policy, stage); p10..p90 is not stored, so the band drawn is
median..p90.

Usage: python benchmarks/plot_bench.py benchmarks/results/bench_queue_cpu.json
           [--out benchmarks/results/bench_queue_cpu.png] [--run RUN_ID | --all-runs]
           [--queue mooncake] [--per-request] [--markdown table.md | --markdown -]
By default only the latest run in the file (the `run` field) is drawn; rows from several runs
with the same (policy, stage, n, backend, device) would otherwise overlap.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STAGE_ORDER = ("order", "order-churn", "order-served", "order-arrivals", "admit", "step", "step-served", "graph", "gstep")
RECORDED = ("graph", "gstep")  # the recorded step's panels also draw the reference's whole step
POLICY_ORDER = ("fcfs", "lof", "routing-key", "lpm", "dfs-weight")
STYLE = {  # (backend, device) -> matplotlib style
    ("reference", "cpu"): dict(color="black", marker="o"),
    ("torch", "cpu"): dict(color="tab:blue", marker="s"),
    ("torch", "cuda"): dict(color="tab:green", marker="^"),
    ("triton", "cuda"): dict(color="tab:red", marker="v"),
}


def load_rows(path, run=None, all_runs=False, queue=None):
    p = Path(path)  # a .gz file too (older runs are archived compressed)
    rows = json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text())
    rows = [r for r in rows if r.get("median_s") is not None]
    if queue:
        rows = [r for r in rows if r.get("queue") == queue]
    if not rows:
        return []
    if not all_runs:
        run = run or max(r.get("run", "") for r in rows)
        rows = [r for r in rows if r.get("run", "") == run]
    last = {}  # a run continued by a second invocation: the later row of a key wins
    for r in rows:
        last[(r["policy"], r["stage"], r["n"], r["backend"], r["device"], r.get("run"))] = r
    return list(last.values())


def plot(rows, out, per_request=False, title=None):
    policies = [p for p in POLICY_ORDER if any(r["policy"] == p for r in rows)]
    policies += sorted({r["policy"] for r in rows} - set(policies))
    stages = [s for s in STAGE_ORDER if any(r["stage"] == s for r in rows)]
    fig, axes = plt.subplots(len(policies), len(stages), figsize=(4.2 * len(stages), 3.0 * len(policies)),
                             squeeze=False, sharex=True)
    series = defaultdict(list)
    for r in rows:
        series[(r["policy"], r["stage"], r["backend"], r["device"])].append(r)
    ykey = "us_per_req" if per_request else "median_s"
    for i, pol in enumerate(policies):
        for j, st in enumerate(stages):
            ax = axes[i][j]
            if not any((p, s) == (pol, st) for p, s, _, _ in series):  # a stage this policy has not
                ax.text(0.5, 0.5, "not timed for this policy", ha="center", va="center", fontsize=9,
                        transform=ax.transAxes, color="0.5")
                ax.set_title(f"{pol} / {st}", fontsize=10)
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            for (p, s, be, dev), rs in sorted(series.items()):
                if (p, s) != (pol, st):
                    continue
                rs = sorted(rs, key=lambda r: r["n"])
                xs = [r["n"] for r in rs]
                ys = [r[ykey] for r in rs]
                style = STYLE.get((be, dev), dict(marker="x"))
                ax.plot(xs, ys, label=f"{be} ({dev})", linewidth=1.4, markersize=4, **style)
                if not per_request:
                    ax.fill_between(xs, ys, [r["p90_s"] for r in rs], alpha=0.15, color=style.get("color"))
            ref = sorted(series.get((pol, "step", "reference", "cpu"), []), key=lambda r: r["n"])
            if st in RECORDED and ref:  # what the recorded step's ratio is taken against
                ax.plot([r["n"] for r in ref], [r[ykey] for r in ref], label="reference (cpu), whole step",
                        color="0.45", linestyle="--", linewidth=1.0, marker="o", markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{pol} / {st}", fontsize=10)
            if i == len(policies) - 1:
                ax.set_xlabel("waiting requests n")
            if j == 0:
                ax.set_ylabel("us per request" if per_request else "seconds per call")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles.keys()), loc="upper center", ncol=len(handles),
               bbox_to_anchor=(0.5, 1.0))
    if title:
        fig.suptitle(title, y=1.02, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def fmt_s(x):
    """Seconds in a short human unit."""
    if x is None:
        return ""
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def n_label(n: int) -> str:
    """2^k for a power of two, else the number itself (`bench_queue.py --sizes`)."""
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else f"{n:,}"


def markdown_table(rows):
    """Median per call, one line per (policy, stage, backend/device), one column per n; a
    `speedup` line under each device backend gives the reference's median over its own (above
    1: faster than the reference), the same figure bench_queue.py prints."""
    ns = sorted({r["n"] for r in rows})
    policies = [p for p in POLICY_ORDER if any(r["policy"] == p for r in rows)]
    policies += sorted({r["policy"] for r in rows} - set(policies))
    stages = [s for s in STAGE_ORDER if any(r["stage"] == s for r in rows)]
    backs = sorted({(r["backend"], r["device"]) for r in rows},
                   key=lambda b: list(STYLE).index(b) if b in STYLE else 99)
    cell = {(r["policy"], r["stage"], r["backend"], r["device"], r["n"]): r for r in rows}
    head = "| policy | stage | backend | " + " | ".join(n_label(n) for n in ns) + " |"
    lines = [head, "|" + "---|" * (3 + len(ns))]
    for pol in policies:
        for st in stages:
            for be, dev in backs:
                got = [cell.get((pol, st, be, dev, n)) for n in ns]
                if not any(got):
                    continue
                lines.append(f"| {pol} | {st} | {be} ({dev}) | "
                             + " | ".join(fmt_s(g["median_s"]) if g else "" for g in got) + " |")
                if be != "reference":
                    rat = [g.get("ratio_to_ref") if g else None for g in got]
                    if any(x is not None for x in rat):
                        lines.append(f"| {pol} | {st} | {be} ({dev}) speedup | "
                                     + " | ".join("" if not x else f"{1 / x:.3g}x" for x in rat) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None, help="PNG path (default: the JSON's name with .png)")
    ap.add_argument("--run", default=None, help="draw this run id (default: the latest)")
    ap.add_argument("--all-runs", action="store_true")
    ap.add_argument("--queue", default=None, help="only rows of this queue kind")
    ap.add_argument("--per-request", action="store_true", help="plot us per request instead of seconds")
    ap.add_argument("--markdown", default=None, help="also write the rows as a markdown table here ('-': stdout)")
    args = ap.parse_args(argv)
    try:
        rows = load_rows(args.json, args.run, args.all_runs, args.queue)
    except FileNotFoundError:
        ap.error(f"no such file: {args.json}")
    except (ValueError, OSError) as e:  # not JSON (or gzip), a folder, not UTF-8
        ap.error(f"{args.json}: not a JSON list of benchmark rows ({e})")
    except (AttributeError, TypeError):  # JSON, but not a list of row objects
        ap.error(f"{args.json}: not a JSON list of benchmark rows")
    if not rows:
        raise SystemExit(f"no timed rows in {args.json}")
    out = args.out or str(Path(args.json).with_suffix(".png"))
    r0 = rows[0]
    title = (f"{r0.get('queue')} queue, warm cache {r0.get('cache_tokens')} tokens, prompt cap "
             f"{r0.get('max_prompt_len')}, {r0.get('threads')} thread(s), run {r0.get('run')}")
    plot(rows, out, args.per_request, title)
    # the written paths on stdout, unless the markdown table goes there (then they go to stderr)
    print(out, file=sys.stderr if args.markdown == "-" else sys.stdout)
    if args.markdown:
        table = markdown_table(rows)
        if args.markdown == "-":
            print(table)
        else:
            Path(args.markdown).write_text(table + "\n")
            print(args.markdown)


if __name__ == "__main__":
    main()
