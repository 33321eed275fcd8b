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


def check_path(path: Path) -> Path:
    """The PNG path, checked before any simulation runs."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise BadInput(f"--plot: {path} must end in .png")
    if not path.parent.exists():
        raise BadInput(f"--plot: directory {path.parent} does not exist")
    return path


def _throughput(ax, result: Result, label: str | None = None) -> None:
    tl = result.timeline
    minutes = [i * BIN_S / 60 for i in range(len(tl.generated_bins))]
    ax.plot(minutes, [n / BIN_S for n in tl.generated_bins], label=label or result.policy, lw=1.2)


def _fleet(ax, result: Result) -> None:
    tl = result.timeline
    labels = [lab for lab in _ORDER if any(lab in c for _, c in tl.fleet_samples)]
    times = [t / 60 for t, _ in tl.fleet_samples] + [tl.duration_s / 60]
    for_labels = [[c.get(lab, 0) for _, c in tl.fleet_samples] for lab in labels]
    series = [vals + vals[-1:] for vals in for_labels]
    if labels:
        ax.stackplot(times, *series, labels=labels, step="post", alpha=0.8)
    if tl.availability:
        at = [t / 60 for t, _ in tl.availability] + [tl.duration_s / 60]
        av = [tl.reserved_gpus + g for _, g in tl.availability]
        ax.step(at, av + av[-1:], where="post", color="k", lw=1, ls="--", label="dedicated available")
    ax.set_ylabel("GPUs")
    ax.legend(fontsize=7, loc="upper right")


def plot_run(result: Result, path: Path) -> Path:
    """Throughput over time, then GPUs by zone and role with the preemptible availability."""
    path = check_path(path)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    _throughput(top, result)
    for t in result.timeline.training_ends:
        top.axvline(t / 60, color="grey", lw=0.4, alpha=0.5)
    top.set_ylabel("generated tok/s")
    top.set_title(f"{result.scenario} — {result.policy}: {result.tokens_per_s:,.0f} tokens/s")
    _fleet(bottom, result)
    bottom.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(results: dict[str, Result], path: Path) -> Path:
    """Overlaid throughput of every system, then one fleet panel per system."""
    path = check_path(path)
    n = len(results)
    fig, axes = plt.subplots(n + 1, 1, figsize=(10, 2.4 * (n + 1)), sharex=True)
    for name, result in results.items():
        _throughput(axes[0], result, f"{name} ({result.tokens_per_s:,.0f} tok/s)")
    axes[0].set_ylabel("generated tok/s")
    axes[0].legend(fontsize=7)
    first = next(iter(results.values()))
    axes[0].set_title(first.scenario)
    for ax, (name, result) in zip(axes[1:], results.items(), strict=True):
        _fleet(ax, result)
        ax.set_title(name, fontsize=9)
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
