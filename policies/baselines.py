"""The baselines of method.md, as policies in the same interface as pearl's.

They are honest: the same simulator, engine, router and reconfiguration costs (every change goes
through the orchestrator and the executor like pearl's), and they run colocated, as the paper's do.
Which GPUs a baseline may use is the cluster it runs on (`sim/systems.py`): `roll` gets the reserved
rollout GPUs only, `roll-large` a fixed larger reserve, `rlboost-plus` the reserved plus the
preemptible GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pearl.controlplane.errors import BadInput
from pearl.controlplane.fleet import FleetSnapshot, Target

from .base import NoMemory, Signals, colocated, split
from .elasticity import dedicated_capacity


@dataclass(frozen=True)
class StaticColocated:
    """`roll` and `roll-large`: every dedicated GPU of the cluster, colocated, never changed."""

    name: str = "roll"

    def initial_memory(self) -> NoMemory:
        return NoMemory()

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: NoMemory) -> tuple[Target, NoMemory]:
        members = [w.id for w in dedicated_capacity(snapshot)]
        return colocated(members, f"static: {len(members)} dedicated workers, colocated"), memory


@dataclass(frozen=True)
class ElasticColocated:
    """`rlboost-plus`: reserved plus preemptible GPUs, colocated, no borrowing.

    Grows in the background as GPUs are granted (lazy weights, all-or-nothing admission) and drains
    and releases before each notice runs out, keeping partial trajectories (policies/elasticity.py).
    """

    name: str = "rlboost-plus"

    def initial_memory(self) -> NoMemory:
        return NoMemory()

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: NoMemory) -> tuple[Target, NoMemory]:
        members = [w.id for w in dedicated_capacity(snapshot)]
        leaving = sorted(signals.deadlines)
        reason = f"elastic: {len(members)} dedicated workers, colocated"
        if leaving:
            reason += f"; releasing {leaving} before their notice runs out"
        return colocated(members, reason), memory


@dataclass(frozen=True)
class StaticSplit:
    """Every dedicated GPU of the cluster split into `n_prefill` prefill workers and the rest decode,
    never changed: the split candidates of `sim ratio`, measured as static configurations."""

    n_prefill: int
    name: str = "static-split"

    def __post_init__(self) -> None:
        if not isinstance(self.n_prefill, int) or self.n_prefill < 1:
            raise BadInput(f"n_prefill: must be an integer >= 1, got {self.n_prefill!r}")

    def initial_memory(self) -> NoMemory:
        return NoMemory()

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: NoMemory) -> tuple[Target, NoMemory]:
        members = [w.id for w in dedicated_capacity(snapshot)]
        if len(members) <= self.n_prefill:
            raise BadInput(f"n_prefill: {self.n_prefill} prefill workers leave no decode worker of {len(members)}")
        n_decode = len(members) - self.n_prefill
        return split(members, self.n_prefill, f"static: {self.n_prefill}P{n_decode}D"), memory
