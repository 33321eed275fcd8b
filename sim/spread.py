"""Figures over seeds: mean, spread and a 95% confidence interval (Student's t).

A simulated run is deterministic for its seed; the seed draws the rollout batches (turns, tokens,
environment waits). Repeating a scenario over N seeds and reporting the interval of the mean says
how much of a difference between systems is the workload's luck. Ratios between two systems are
taken per seed first (both ran the same seeded batches), then summarized the same way.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; beyond, the normal's 1.96
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def t95(dof: int) -> float:
    """The two-sided 95% quantile of Student's t with `dof` degrees of freedom (dof >= 1)."""
    if dof < 1:
        raise ValueError("dof must be >= 1")
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


@dataclass(frozen=True)
class Spread:
    """N values of one figure: their mean, sample standard deviation and 95% interval of the mean
    (None with one value: one seed says nothing about the spread)."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.values) if self.n > 1 else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        if self.n < 2:
            return None
        half = t95(self.n - 1) * statistics.stdev(self.values) / math.sqrt(self.n)
        return self.mean - half, self.mean + half

    def spans(self, value: float) -> bool | None:
        """Whether the 95% interval contains `value` (None with one value)."""
        ci = self.ci95
        return None if ci is None else ci[0] <= value <= ci[1]

    def as_dict(self, digits: int = 4) -> dict:
        ci = self.ci95
        return {"mean": round(self.mean, digits), "sd": None if self.sd is None else round(self.sd, digits),
                "ci95": None if ci is None else [round(ci[0], digits), round(ci[1], digits)], "n": self.n}


def spread(values: list[float] | tuple[float, ...]) -> Spread:
    return Spread(tuple(float(v) for v in values))
