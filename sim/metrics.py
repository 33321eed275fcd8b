"""What a run reports: the metrics of docs/method.md, the costs, and timelines for the plots.

Every trained batch counts its generated tokens plus all its tokens (prompt, observations,
generated), once: re-prefills after a cache miss or an interruption are work, not tokens. With E_k
the end of training step k and N_k the tokens of its batch:

- tokens_per_s (the paper's per-step throughput): the mean over steps k >= 1 of N_k / (E_k - E_{k-1});
  the first step is dropped (its interval includes the start of the run).
- tokens_per_s_ratio_of_sums: the same steps' tokens over the same time, sum(N_k) / (E_last - E_0).
- tokens_per_s_window: the tokens of the steps completed within `duration_s`, over `duration_s`;
  it moves by a whole step's tokens when one more step fits in the run.

With a single step completed, the first two are its tokens over its end time; with none, 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

BIN_S = 60.0  # width of the throughput timeline's bins


@dataclass
class Timeline:
    """Samples for `--plot`: generated tokens per bin, GPUs by zone/role, the preemptible trace."""

    duration_s: float
    reserved_gpus: int = 0
    generated_bins: list[int] = field(default_factory=list)
    fleet_samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    availability: list[tuple[float, int]] = field(default_factory=list)
    training_ends: list[float] = field(default_factory=list)
    trained_tokens: list[int] = field(default_factory=list)  # the metric's tokens of each trained step

    def __post_init__(self) -> None:
        self.generated_bins = [0] * max(1, math.ceil(self.duration_s / BIN_S))

    def generated(self, t: float, tokens: int) -> None:
        self.generated_bins[min(int(t // BIN_S), len(self.generated_bins) - 1)] += tokens

    def fleet(self, t: float, counts: dict[str, int]) -> None:
        if self.fleet_samples and self.fleet_samples[-1][1] == counts:
            return
        self.fleet_samples.append((t, counts))

    def available(self, t: float, gpus: int) -> None:
        self.availability.append((t, gpus))

    def trained(self, t: float, tokens: int) -> None:
        self.training_ends.append(t)
        self.trained_tokens.append(tokens)


def step_rates(ends: list[float], tokens: list[int]) -> tuple[float, float]:
    """(per-step mean, ratio of sums) of the steps that ended at `ends` with `tokens` each (module
    docstring); 0 without a step."""
    if not ends:
        return 0.0, 0.0
    if len(ends) == 1:
        rate = tokens[0] / ends[0] if ends[0] > 0 else 0.0
        return rate, rate
    rates = [n / (end - before) for n, end, before in zip(tokens[1:], ends[1:], ends, strict=False)]
    return sum(rates) / len(rates), sum(tokens[1:]) / (ends[-1] - ends[0])


@dataclass
class Result:
    scenario: str
    policy: str
    tokens_per_s: float  # the metric (docs/method.md): per-step throughput
    tokens_per_s_window: float  # the trained steps' tokens over duration_s
    tokens_per_s_ratio_of_sums: float  # the per-step metric's tokens over its time
    rollout_steps: int  # rollout batches completed within the run
    training_steps: int  # training steps completed within the run (the ones the metric counts)
    gpu_seconds: float  # GPU-seconds held by rollout workers, dedicated and borrowed
    reconfigurations: int  # worker changes enacted: sum of D_worker + D_role over plans
    plans: int
    late_returns: int  # training steps delayed by borrowed GPUs coming back late
    lateness_s: float
    forced_releases: int  # preempted workers still there at their deadline
    cancelled_groups: int  # expansion groups cancelled (all-or-nothing)
    interrupted_requests: int  # turns interrupted and resubmitted with their partial progress
    retracted_requests: int  # turns a decode worker out of KV sent back to be prefilled again
    mean_step_makespan_s: float  # over this run's rollout steps (see `common_mean_makespans` to compare runs)
    events: int
    wall_s: float
    timeline: Timeline | None = None
    step_makespans_s: tuple[float, ...] = ()  # each rollout step's makespan, in order

    def as_dict(self) -> dict[str, Any]:
        """The `--json` keys (docs/formats.md) and the extra ones; the timeline and the per-step makespans are
        for plots and comparisons only."""
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            if key in ("timeline", "step_makespans_s"):
                continue
            out[key] = round(value, 3) if isinstance(value, float) and math.isfinite(value) else value
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None
        return out


def common_mean_makespans(a: Result, b: Result) -> tuple[float, float]:
    """The mean rollout-step makespans of `a` and `b` over the steps both completed, their first
    min(n_a, n_b): every system rolls out the same seeded batches, so these means compare like with
    like, where each run's own mean may cover batches the other never reached (NaN when none)."""
    n = min(len(a.step_makespans_s), len(b.step_makespans_s))
    if n == 0:
        return math.nan, math.nan
    return sum(a.step_makespans_s[:n]) / n, sum(b.step_makespans_s[:n]) / n
