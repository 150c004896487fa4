"""PNG plots of a replay (headless, matplotlib Agg backend).

`plot_run` draws one run: queue length and KV usage over simulated time (seconds), the TTFT
CDF (milliseconds) and the scheduler's own time per step (microseconds) against queue length.
`plot_comparison` draws a bar chart per metric across runs (e.g. per policy), `plot_ttft_cdfs`
the runs' TTFT CDFs on one axis, `plot_rate_sweep` latency and throughput against the offered
request rate, a line per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import textwrap  # noqa: E402

__all__ = ["plot_run", "plot_comparison", "plot_ttft_cdfs", "plot_rate_sweep"]


def _title(ax, text: str, width: int) -> None:
    """An axis title wrapped to `width` characters (a long trace name is not cut off)."""
    ax.set_title("\n".join(textwrap.wrap(text, width)) if len(text) > width else text)


def _ttft_ms(requests) -> np.ndarray:
    return np.sort([(r.first_token_s - r.arrival_s) * 1e3 for r in requests if r.first_token_s is not None])


def _log_if_wide(ax, values) -> None:
    """A log x axis when the positive values span more than 100x (a latency tail)."""
    pos = [v for v in values if v > 0]
    if pos and max(pos) > 100 * min(pos):
        ax.set_xscale("log")


def _bar_label(y: float) -> str:
    return "n/a" if np.isnan(y) else f"{y:,.0f}" if abs(y) >= 1000 else f"{y:.3g}"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes)


def plot_run(out_dir, requests, steps, title: str = "") -> list[Path]:
    """Write queue_len.png, kv_usage.png, ttft_cdf.png, sched_time.png into `out_dir`; return their paths.

    Time axes are simulated seconds, TTFT milliseconds, scheduler time microseconds (real time,
    non-idle steps, log-log with a symmetric-log x axis so queue length 0 is shown).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    requests, steps = list(requests), list(steps)
    t = np.asarray([s.t_s for s in steps], dtype=float)
    sfx = f" - {title}" if title else ""
    paths = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if steps:
        # both counts as each step leaves them (a request admitted by a step is not waiting)
        ax.step(t, [s.waiting for s in steps], where="post", lw=1, label="waiting")
        ax.step(t, [s.running for s in steps], where="post", lw=1, label="running")
        ax.legend(loc="upper right")
    else:
        _empty(ax, "steps")
    ax.set(xlabel="simulated time (s)", ylabel="requests")
    _title(ax, f"Queue length{sfx}", 70)
    paths.append(_save(fig, out / "queue_len.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    kv = [(s.t_s, s.kv_used_tokens / s.kv_pool_tokens) for s in steps if s.kv_pool_tokens > 0]
    if kv:
        ax.step(*zip(*kv), where="post", lw=1)
        ax.set_ylim(0, 1.05)
    else:
        _empty(ax, "KV data")
    ax.set(xlabel="simulated time (s)", ylabel="KV pool in use (fraction)")
    _title(ax, f"KV usage{sfx}", 70)
    paths.append(_save(fig, out / "kv_usage.png"))

    fig, ax = plt.subplots(figsize=(5, 4))
    ttft = _ttft_ms(requests)
    if ttft.size:
        ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post")
        ax.set_ylim(0, 1.02)
        _log_if_wide(ax, ttft)
    else:
        _empty(ax, "first tokens")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests")
    _title(ax, f"TTFT CDF{sfx}", 45)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(5, 4))
    pts = [(s.queue_len, s.sched_wall_s * 1e6) for s in steps if s.kind != "idle" and s.sched_wall_s > 0]
    if pts:
        q, us = map(np.asarray, zip(*pts))
        ax.scatter(q, us, s=4, alpha=0.4)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_yscale("log")
    else:
        _empty(ax, "scheduling steps")
    ax.set(xlabel="queue length (waiting requests)", ylabel="scheduler time per step (us)")
    _title(ax, f"Scheduler time vs queue{sfx}", 45)
    ax.grid(alpha=0.3, which="both")
    paths.append(_save(fig, out / "sched_time.png"))
    return paths


def plot_comparison(out_dir, summaries: dict, title: Optional[str] = None) -> Path:
    """Bar charts per run (`{run name: summarize() dict}`) of prefix-cache hit rate (%), mean
    and p99 TTFT (ms), output throughput (tok/s) and the scheduler's calls (all of them, real
    seconds on this machine: what differs between backends, whose decisions agree), under
    `title` (the workload) when given; writes and returns `out_dir/comparison.png`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(summaries)
    val = lambda s, k, f=1.0: np.nan if s.get(k) is None else f * s[k]  # noqa: E731
    panels = (("Prefix cache hit rate (%)", "prefix_cache_hit_rate", 100.0),
              ("Mean TTFT (ms)", "mean_ttft_ms", 1.0), ("P99 TTFT (ms)", "p99_ttft_ms", 1.0),
              ("Output throughput (tok/s)", "output_throughput", 1.0),
              ("Scheduler calls, real time (s)", "sched_calls_total_s", 1.0))
    rows = {n: dict(summaries[n], sched_calls_total_s=(sum(summaries[n]["sched_calls_s"].values())
                                                       if summaries[n].get("sched_calls_s") else None))
            for n in names}
    fig, axes = plt.subplots(1, len(panels), figsize=(3 + 0.9 * max(len(names), 1) * len(panels), 3.8))
    x = np.arange(len(names))
    for ax, (label, key, f) in zip(axes, panels):
        ys = [val(rows[n], key, f) for n in names]
        bars = ax.bar(x, np.nan_to_num(ys), color=[f"C{i % 10}" for i in range(len(names))])
        for b, y in zip(bars, ys):
            ax.annotate(_bar_label(y), (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, names, rotation=20)
        _title(ax, label, 18)
        if not np.nansum(np.abs(ys)):  # all zero (or n/a): no axis around 0 +- 0.06
            ax.set_ylim(0, 1)
        else:
            ax.margins(y=0.15)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, out / "comparison.png")


def plot_ttft_cdfs(out_dir, requests_by_run: dict, title: Optional[str] = None) -> Path:
    """The TTFT CDF (ms) of every run (`{run name: RequestRecord list}`) on one axis, a log x
    axis where the TTFTs span more than 100x; writes and returns `out_dir/ttft_cdf.png`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    seen = []
    for i, (name, requests) in enumerate(requests_by_run.items()):
        ttft = _ttft_ms(requests)
        if ttft.size:
            ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", color=f"C{i % 10}",
                    linestyle=("-", "--", ":", "-.")[i % 4], label=name)
            seen.extend(ttft.tolist())
    if seen:
        ax.set_ylim(0, 1.02)
        _log_if_wide(ax, seen)
        ax.legend(fontsize=8, loc="lower right")
    else:
        _empty(ax, "first tokens")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests")
    _title(ax, "TTFT CDF" + (f" - {title}" if title else ""), 60)
    ax.grid(alpha=0.3)
    return _save(fig, out / "ttft_cdf.png")


def plot_rate_sweep(out_dir, per_rate: dict, offered: dict, title: Optional[str] = None,
                    spread: bool = False) -> Path:
    """Serving against load for a rate sweep (`gpu-sched replay --rate-scales`): mean and p99
    TTFT (s, log scale), mean TPOT (ms) and output throughput (tok/s) against the offered
    request rate (req/s; the rate scale where the trace gives no rate; a log axis where the
    points span more than 100x), a line per run.
    per_rate: {rate scale: {run name: summarize() dict}}, or with `spread` {rate scale:
    `metrics.seed_spread` dict}, drawn as means with +- std error bars; offered: {rate scale:
    req/s or None}. Writes and returns `out_dir/sweep.png`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rates = sorted(per_rate)
    names = list(per_rate[rates[0]]) if rates else []
    by_rate = all(offered.get(x) is not None for x in rates)
    xs = [offered[x] if by_rate else x for x in rates]
    panels = (("Mean TTFT (s)", "mean_ttft_ms", 1e-3, True), ("P99 TTFT (s)", "p99_ttft_ms", 1e-3, True),
              ("Mean TPOT (ms)", "mean_tpot_ms", 1.0, False), ("Output throughput (tok/s)", "output_throughput", 1.0,
                                                               False))
    with np.errstate(over="ignore"):  # axis limits near a float's range (scales up to ~1e308)
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
        for ax, (label, key, f, log) in zip(axes, panels):
            ymax = 0.0
            for i, n in enumerate(names):
                vals = [per_rate[x][n].get(key) for x in rates]
                ys = [np.nan if v is None else f * (v["mean"] if spread else v) for v in vals]
                err = [np.nan if v is None else f * v["std"] for v in vals] if spread else None
                ax.errorbar(xs, ys, yerr=err, marker="osD^vP*X"[i % 8], linestyle=("-", "--", ":", "-.")[i % 4],
                            markersize=7 - 1.5 * (i % 3), color=f"C{i % 10}", capsize=3,
                            label=n)  # equal runs stay visible
                ymax = max([ymax, *(y for y in ys if y > 0)])
            if log and ymax > 0:
                ax.set_yscale("log")
            if xs and max(xs) > 100 * min(xs):  # scales spread over decades
                ax.set_xscale("log")
            ax.set_xlabel("offered request rate (req/s)" if by_rate else "rate scale (x the trace's)")
            ax.set_title(label)
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
        if title:
            fig.suptitle(title, fontsize=10)
        return _save(fig, out / "sweep.png")
