"""PNG timelines of runs (matplotlib, Agg): throughput, GPUs by zone and role, the availability trace."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from pearl.controlplane.errors import BadInput  # noqa: E402

from .metrics import BIN_S, Result  # noqa: E402

_ORDER = ("dedicated/colocated", "dedicated/prefill", "dedicated/decode",
          "overlap/colocated", "overlap/prefill", "overlap/decode", "transitioning")
# One colour per worker state, the same in every figure: rollout GPUs in blues and greens, borrowed
# training GPUs in oranges, reconfiguring grey. Lines (throughput, availability) are black or grey.
STATE_COLOURS = {
    "dedicated/colocated": "#1f77b4", "dedicated/prefill": "#2ca02c", "dedicated/decode": "#17becf",
    "overlap/colocated": "#ff7f0e", "overlap/prefill": "#d62728", "overlap/decode": "#e6ab02",
    "transitioning": "#b0b0b0",
}
STATE_LABELS = {
    "dedicated/colocated": "rollout GPUs: colocated servers",
    "dedicated/prefill": "rollout GPUs: prefill servers",
    "dedicated/decode": "rollout GPUs: decode servers",
    "overlap/colocated": "borrowed training GPUs: colocated",
    "overlap/prefill": "borrowed training GPUs: prefill",
    "overlap/decode": "borrowed training GPUs: decode",
    "transitioning": "GPUs of servers starting or stopping",
}
AVAILABLE_LABEL = "GPUs available: reserved + granted preemptible"
THROUGHPUT_LABEL = "generated tokens/s (1-minute bins)"
STEP_LABEL = "a training step ends"


def check_path(path: Path) -> Path:
    """The PNG path, checked before any simulation runs."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise BadInput(f"--plot: {path} must end in .png", field="--plot")
    if not path.parent.exists():
        raise BadInput(f"--plot: directory {path.parent} does not exist", field="--plot")
    return path


def _throughput(ax, result: Result) -> None:
    tl = result.timeline
    minutes = [i * BIN_S / 60 for i in range(len(tl.generated_bins))]
    ax.plot(minutes, [n / BIN_S for n in tl.generated_bins], color="black", lw=1.0, label=THROUGHPUT_LABEL)
    for i, t in enumerate(tl.training_ends):
        ax.axvline(t / 60, color="grey", lw=0.5, ls=":", label=STEP_LABEL if i == 0 else None)


def _fleet(ax, result: Result) -> None:
    tl = result.timeline
    labels = [lab for lab in _ORDER if any(lab in c for _, c in tl.fleet_samples)]
    times = [t / 60 for t, _ in tl.fleet_samples] + [tl.duration_s / 60]
    series = [[c.get(lab, 0) for _, c in tl.fleet_samples] for lab in labels]
    series = [vals + vals[-1:] for vals in series]
    if labels:
        ax.stackplot(times, *series, labels=[STATE_LABELS[lab] for lab in labels],
                     colors=[STATE_COLOURS[lab] for lab in labels], step="post", alpha=0.85)
    if tl.availability:
        at = [t / 60 for t, _ in tl.availability] + [tl.duration_s / 60]
        av = [tl.reserved_gpus + g for _, g in tl.availability]
        ax.step(at, av + av[-1:], where="post", color="black", lw=1, ls="--", label=AVAILABLE_LABEL)
    ax.set_ylabel("GPUs serving rollout")


def _legend_outside(fig, axes) -> None:
    """One legend for the figure, right of the plots, with every entry once."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    order = [THROUGHPUT_LABEL, STEP_LABEL, AVAILABLE_LABEL, *(STATE_LABELS[s] for s in _ORDER)]
    labels = sorted(seen, key=lambda lab: order.index(lab) if lab in order else len(order))
    fig.legend([seen[lab] for lab in labels], labels, loc="upper left", bbox_to_anchor=(0.73, 0.98), fontsize=8,
               frameon=False)
    fig.subplots_adjust(right=0.68)


def run_figure(result: Result):
    """Throughput over time, then GPUs by state with the preemptible availability (the figure)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True)
    _throughput(top, result)
    top.set_ylabel("generated tokens/s")
    top.set_title(f"{result.scenario}, {result.policy}: {result.tokens_per_s:,.0f} tokens/s over the run "
                  "(generated + trained tokens of completed training steps)", fontsize=10)
    _fleet(bottom, result)
    bottom.set_xlabel("simulated minutes")
    fig.tight_layout()
    _legend_outside(fig, [top, bottom])
    return fig


def plot_run(result: Result, path: Path) -> Path:
    """Write `run_figure` as a PNG."""
    path = check_path(path)
    fig = run_figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def comparison_figure(results: dict[str, Result], intervals: dict[str, tuple[float, float, float]] | None = None,
                      seeds: list[int] | None = None):
    """The metric of every system as bars (with `intervals`, name -> (mean, low, high) over `seeds`:
    the means with their 95% intervals), then one panel per system (GPUs by state and its generated
    tokens/s, the first seed's run), every panel on the same scales."""
    n = len(results)
    fig, axes = plt.subplots(n + 1, 1, figsize=(13, 1.2 + 2.3 * (n + 1)),
                             gridspec_kw={"height_ratios": [1.2] + [2] * n})
    first = next(iter(results.values()))
    names = list(results)
    if intervals:
        values = [intervals[name][0] for name in names]
        err = [[intervals[name][0] - intervals[name][1] for name in names][::-1],
               [intervals[name][2] - intervals[name][0] for name in names][::-1]]
        bars = axes[0].barh(names[::-1], values[::-1], color="#808080", xerr=err, capsize=3, ecolor="black")
        labels = [f"{intervals[name][0]:,.0f} [{intervals[name][1]:,.0f}, {intervals[name][2]:,.0f}]"
                  for name in names][::-1]
        high = max([intervals[name][2] for name in names] + [1])
        title = f"{first.scenario}: mean over seeds {', '.join(map(str, seeds or []))} with 95% intervals"
    else:
        values = [r.tokens_per_s for r in results.values()]
        bars = axes[0].barh(names[::-1], values[::-1], color="#808080")
        labels = [f"{v:,.0f}" for v in values[::-1]]
        high = max(values + [1])
        title = first.scenario
    axes[0].bar_label(bars, labels=labels, padding=3, fontsize=8)
    axes[0].set_xlabel("tokens/s (generated + trained tokens of completed training steps)")
    axes[0].set_xlim(0, high * 1.25)
    axes[0].set_title(title)
    panels = axes[1:]
    twins = []
    top_gpus = 0.0
    top_rate = 1.0
    for ax, (name, result) in zip(panels, results.items(), strict=True):
        _fleet(ax, result)
        twin = ax.twinx()
        _throughput(twin, result)
        twin.set_ylabel("generated tok/s", fontsize=8)
        twins.append(twin)
        seed = f" (seed {seeds[0]})" if intervals and seeds else ""
        ax.set_title(f"{name}{seed}: {result.tokens_per_s:,.0f} tokens/s", fontsize=9)
        top_gpus = max(top_gpus, ax.get_ylim()[1])
        top_rate = max(top_rate, twin.get_ylim()[1])
    for ax, twin in zip(panels, twins, strict=True):  # the same scales in every panel
        ax.set_ylim(0, top_gpus)
        twin.set_ylim(0, top_rate)
        ax.set_xlim(0, first.timeline.duration_s / 60)
        ax.label_outer()
    panels[-1].set_xlabel("simulated minutes")
    fig.tight_layout()
    _legend_outside(fig, [*panels, *twins])
    return fig


def plot_comparison(results: dict[str, Result], path: Path,
                    intervals: dict[str, tuple[float, float, float]] | None = None,
                    seeds: list[int] | None = None) -> Path:
    """Write `comparison_figure` as a PNG."""
    path = check_path(path)
    fig = comparison_figure(results, intervals, seeds)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
