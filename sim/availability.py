"""The preemptible GPUs of a trace as grants and notices of whole workers.

At tick t the usable preemptible GPUs are min(trace, max_gpus) floored to a multiple of tp
(`Scenario.preemptible_gpus_at`). A rise grants the next slots at t; a drop is a notice at t for the
highest granted slots, which must be released by t + notice_s. Policies learn of each change when it
happens; only the oracle may read the whole list in advance.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scenario import Scenario


@dataclass(frozen=True)
class Change:
    """At `t`, the first `workers` preemptible slots are granted (the others are not)."""

    t: float
    workers: int
    granted: tuple[int, ...]  # slot indices (within the preemptible zone) granted at t
    revoked: tuple[int, ...]  # slot indices under notice from t, to be released by t + notice_s


def availability_changes(scenario: Scenario) -> list[Change]:
    """Every change of the preemptible worker count within `duration_s`, the one at t=0 included."""
    pre = scenario.cluster.preemptible
    if pre is None or scenario.trace_data is None:
        return []
    gap, tp = scenario.trace_data.gap_seconds, scenario.tp
    out: list[Change] = []
    current = 0
    tick = 0
    while tick * gap < scenario.duration_s:
        t = tick * gap
        workers = scenario.preemptible_gpus_at(t) // tp
        if workers != current or tick == 0:
            out.append(Change(t, workers, tuple(range(current, workers)), tuple(range(workers, current))))
            current = workers
        if tick >= len(scenario.trace_data.data):  # past the end the last value holds
            break
        tick += 1
    return out
