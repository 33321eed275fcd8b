"""The systems of method.md by name: a policy and the cluster it runs on.

Every system runs on the scenario's workload, engine, router and costs; only the GPUs it may use
and its policy differ. `roll` uses the reserved rollout GPUs alone; `roll-large` a fixed reserve of
the reserved GPUs plus the trace's mean preemptible GPUs over the run, rounded up to a multiple of
tp, never preempted; `rlboost-plus` the reserved plus the preemptible GPUs of the trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pearl.controlplane.errors import BadInput
from pearl.policies.base import Policy
from pearl.policies.baselines import ElasticColocated, StaticColocated

from .scenario import Scenario


@dataclass(frozen=True)
class System:
    name: str
    description: str
    policy: Callable[[Scenario], Policy]
    cluster: Callable[[Scenario], Scenario]  # the scenario as this system sees it (its GPUs)


def _same(scenario: Scenario) -> Scenario:
    return scenario


def without_preemptible(scenario: Scenario, extra_reserved: int = 0) -> Scenario:
    cluster = scenario.cluster.model_copy(update={
        "preemptible": None, "reserved_rollout_gpus": scenario.cluster.reserved_rollout_gpus + extra_reserved})
    return scenario.model_copy(update={"cluster": cluster, "trace_data": None})


def roll_large_gpus(scenario: Scenario) -> int:
    """The trace's mean preemptible GPUs over the run, rounded up to a multiple of tp."""
    mean = scenario.mean_preemptible_gpus()
    return math.ceil(round(mean, 9) / scenario.tp) * scenario.tp


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("roll", "reserved rollout GPUs only, colocated, static",
               lambda sc: StaticColocated("roll"), without_preemptible),
        System("roll-large", "reserved + mean preemptible GPUs as a fixed reserve, colocated, static",
               lambda sc: StaticColocated("roll-large"),
               lambda sc: without_preemptible(sc, roll_large_gpus(sc))),
        System("rlboost-plus", "reserved + preemptible GPUs, elastic, colocated, no borrowing",
               lambda sc: ElasticColocated("rlboost-plus"), _same),
    )
}

ABLATIONS: dict[str, System] = {}  # pearl-pd-only, pearl-ungated, pearl-forced-split come with pearl


def system(name: str) -> System:
    """The system called `name`; BadInput listing the known ones otherwise."""
    found = SYSTEMS.get(name) or ABLATIONS.get(name)
    if found is None:
        known = ", ".join([*SYSTEMS, *ABLATIONS])
        raise BadInput(f"--policy: unknown system {name!r} (known: {known})")
    return found
