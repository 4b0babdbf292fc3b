"""PNG figures with matplotlib (imported here, on use: the `bench` extra).

- ttft_cdf.png: TTFT CDF per tier (a column per tier, a row per offered load), a line per
  server configuration, the tier's scaled TTFT objective dashed;
- slo_attainment.png: share of requests meeting both objectives against offered load, per
  tier, a line per configuration;
- throughput.png: goodput and output tokens/s against offered load.
With repeats, every figure is over all repetitions of a load together: their requests (CDF,
attainment) and their rates over all their time (report.py's headline pools them alike).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.serve.loadgen import RequestResult
from bench.serve.stats import RunSummary, share_of_requests, time_weighted
from bench.serve.sweep import LoadPoint, SweepResult
from policies import TierTable

__all__ = ["plot_run", "plot_sweep"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(result: SweepResult, out_dir: Path) -> list[Path]:
    """Write the three figures of a sweep; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    factors = sorted({p.load_factor for p in result.points})
    variants = list(dict.fromkeys(p.variant for p in result.points))
    tier_names = sorted({r.tier for p in result.points for r in p.record.results},
                        key=lambda name: result.tiers[name].priority)
    paths = []

    figure, axes = plt.subplots(len(factors), len(tier_names), squeeze=False,
                                figsize=(5 * len(tier_names), 3 * len(factors)))
    for row, factor in enumerate(factors):
        for column, tier in enumerate(tier_names):
            ax = axes[row][column]
            for variant in variants:
                results = [r for p in result.points_at(variant, factor) for r in p.record.results]
                _cdf(ax, [r for r in results if r.tier == tier], variant)
            _slo_line(ax, result.tiers, tier)
            ax.set_xlim(left=0)
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{tier} at {factor:g}x capacity")
            ax.set_xlabel("TTFT (s)")
            ax.set_ylabel("share of requests")
            ax.legend(fontsize="small")
    paths.append(_save(plt, figure, out_dir / "ttft_cdf.png"))

    figure, axes = plt.subplots(1, len(tier_names), squeeze=False,
                                figsize=(5 * len(tier_names), 3.5))
    for column, tier in enumerate(tier_names):
        ax = axes[0][column]
        for variant in variants:
            shares = [100 * _attainment(result.points_at(variant, f), tier) for f in factors]
            ax.plot(factors, shares, marker="o", label=variant)
        ax.set_title(f"{tier}: requests meeting TTFT and TPOT SLOs")
        ax.set_xlabel("offered load (x measured capacity)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(-2, 102)
        ax.legend(fontsize="small")
    paths.append(_save(plt, figure, out_dir / "slo_attainment.png"))

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for variant in variants:
        runs = [[p.record.summary for p in result.points_at(variant, f)] for f in factors]
        axes[0].plot(factors, [_over_time(r, lambda s: s.overall.goodput_rps) for r in runs],
                     marker="o", label=variant)
        axes[1].plot(factors,
                     [_over_time(r, lambda s: s.overall.output_tokens_per_s) for r in runs],
                     marker="o", label=variant)
    for ax, title in zip(axes, ("goodput (req/s meeting both SLOs)", "output tokens/s"),
                         strict=True):
        ax.set_title(title)
        ax.set_xlabel("offered load (x measured capacity)")
        ax.legend(fontsize="small")
    paths.append(_save(plt, figure, out_dir / "throughput.png"))
    return paths


def plot_run(results: Sequence[RequestResult], tiers: TierTable, out_dir: Path) -> list[Path]:
    """A single run: ttft_cdf.png with a line per tier."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    figure, ax = plt.subplots(figsize=(6, 4))
    for tier in sorted({r.tier for r in results}, key=lambda name: tiers[name].priority):
        _cdf(ax, [r for r in results if r.tier == tier], tier)
        _slo_line(ax, tiers, tier)
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.legend(fontsize="small")
    return [_save(plt, figure, out_dir / "ttft_cdf.png")]


def _attainment(points: Sequence[LoadPoint], tier: str) -> float:
    """Requests of the tier meeting both objectives over those sent, every run together."""
    groups = [p.record.summary.tier(tier) for p in points]
    return share_of_requests(groups, lambda g: g.slo_attainment)


def _over_time(summaries: Sequence[RunSummary], rate: Callable[[RunSummary], float]) -> float:
    return time_weighted([(rate(s), s.duration_s) for s in summaries])


def _cdf(ax: Any, results: Sequence[RequestResult], label: str) -> None:
    """Empirical CDF over the requests sent: shed and failed ones never reach 1."""
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    if not results:
        return
    shares = [(i + 1) / len(results) for i in range(len(ttfts))]
    ax.step(ttfts, shares, where="post", label=f"{label} (n={len(results)})")


def _slo_line(ax: Any, tiers: TierTable, tier: str) -> None:
    objective = tiers[tier].ttft_slo_s
    if objective is not None:
        ax.axvline(objective, linestyle="--", linewidth=0.8, color="grey")


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
