"""The baselines of docs/method.md, as policies in the same interface as pearl's.

They are honest: the same simulator, engine, router and reconfiguration costs (every change goes
through the orchestrator and the executor like pearl's), and they run colocated, as the paper's do.
Which GPUs a baseline may use is the cluster it runs on (`sim/systems.py`): `roll` gets the reserved
rollout GPUs only, `roll-large` a fixed larger reserve, `rlboost-plus` the reserved plus the
preemptible GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pearl.controlplane.core.fleet import FleetSnapshot, Target
from pearl.controlplane.errors import BadInput

from .base import NoMemory, Signals, colocated, split
from .elasticity import dedicated_capacity


@dataclass(frozen=True)
class ColocatedBaseline:
    """`roll`, `roll-large` and `rlboost-plus`: every dedicated slot available, colocated, no borrowing.

    One rule for all three; the cluster each runs on makes the difference (sim/systems.py). On a fixed
    reserve it never changes; with preemptible GPUs it grows in the background as they are granted
    (lazy weights, all-or-nothing admission) and drains and releases before each notice runs out,
    keeping partial trajectories (policies/elasticity.py).
    """

    name: str = "roll"

    def initial_memory(self) -> NoMemory:
        return NoMemory()

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: NoMemory) -> tuple[Target, NoMemory]:
        members = [w.id for w in dedicated_capacity(snapshot)]
        reason = f"{self.name}: {len(members)} dedicated workers, colocated"
        if signals.deadlines:
            reason += f"; releasing {sorted(signals.deadlines)} before their notice runs out"
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
