"""The systems of docs/method.md by name: a policy and the cluster it runs on.

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
from pearl.policies.baselines import ColocatedBaseline
from pearl.policies.pearl import Borrow, PearlPolicy

from .metrics import Result
from .oracle import OraclePolicy, run_oracle
from .scenario import Scenario, serving_perf


@dataclass(frozen=True)
class System:
    name: str
    description: str
    policy: Callable[[Scenario], Policy]
    cluster: Callable[[Scenario], Scenario]  # the scenario as this system sees it (its GPUs)
    # its own kind of run (the oracle's search); None: one simulation of `policy`
    run: Callable[[Scenario, Callable[[float], None] | None], Result] | None = None


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


def pearl(name: str, borrow: Borrow = Borrow.GATED, forced_split: bool = False) -> Callable[[Scenario], Policy]:
    """The PEARL policy on a scenario: its workload and the catalog perf model as the prior."""

    def build(sc: Scenario) -> Policy:
        perf = serving_perf(sc)
        return PearlPolicy.build(sc.workload, perf, sc.reconfig, sc.training.weight_sync_s, name=name,
                                 borrow=borrow, forced_split=forced_split, rollout=sc.training.rollout())

    return build


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("roll", "reserved rollout GPUs only, colocated, static",
               lambda sc: ColocatedBaseline("roll"), without_preemptible),
        System("roll-large", "reserved + mean preemptible GPUs as a fixed reserve, colocated, static",
               lambda sc: ColocatedBaseline("roll-large"),
               lambda sc: without_preemptible(sc, roll_large_gpus(sc))),
        System("rlboost-plus", "reserved + preemptible GPUs, elastic, colocated, no borrowing",
               lambda sc: ColocatedBaseline("rlboost-plus"), _same),
        System("pearl", "reserved + preemptible GPUs, adaptive PD mode and ratio, gated borrowing",
               pearl("pearl"), _same),
        System("oracle", "pearl's GPUs with hindsight and free reconfiguration: best mode, ratio, borrowing per step",
               lambda sc: OraclePolicy(), _same, run_oracle),
    )
}

ABLATIONS: dict[str, System] = {
    s.name: s
    for s in (
        System("pearl-pd-only", "pearl without borrowing (adaptive PD only)",
               pearl("pearl-pd-only", Borrow.NEVER), _same),
        System("pearl-ungated", "pearl borrowing whenever the training GPUs are idle, no gate",
               pearl("pearl-ungated", Borrow.ALWAYS), _same),
        System("pearl-forced-split", "pearl always split, at the ratio the predictor prefers among splits",
               pearl("pearl-forced-split", forced_split=True), _same),
    )
}


def system(name: str) -> System:
    """The system called `name`; BadInput listing the known ones otherwise."""
    found = SYSTEMS.get(name) or ABLATIONS.get(name)
    if found is None:
        known = ", ".join([*SYSTEMS, *ABLATIONS])
        raise BadInput(f"--policy: unknown system {name!r} (known: {known})")
    return found
