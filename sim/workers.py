"""The simulated fleet: one stable worker slot per TP group, and the snapshot the policies see.

Slots are laid out from the scenario: reserved rollout GPUs (zone dedicated, always ours), preemptible
GPUs (dedicated, granted by the trace), training GPUs (overlap, lendable between optimizer steps),
on nodes of 8 GPUs. Ids are stable: reserved first, then preemptible in trace order (the highest go
first on a notice), then overlap.
"""

from __future__ import annotations

from pearl.controlplane.core.domain import Activity, NodeZone, Role, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot

from .engine import Engine
from .scenario import GPUS_PER_NODE, Scenario


class Worker:
    """One slot's state in the simulator (mutable; `slot()` gives the policy's frozen view)."""

    __slots__ = ("id", "node", "gpus", "zone", "kind", "index", "role", "activity", "engine", "weights_version",
                 "granted", "deadline", "removing", "releasing", "holds_gpus", "process_role", "chain")

    def __init__(self, wid: int, node: str, gpus: tuple[int, ...], kind: NodeZone, index: int) -> None:
        self.id = wid
        self.node = node
        self.gpus = gpus
        self.kind = kind  # where its GPUs come from
        self.zone = WorkerZone.OVERLAP if kind is NodeZone.TRAINING else WorkerZone.DEDICATED
        self.index = index  # position within its kind (a preemptible slot's rank in the trace)
        self.role = Role.TRAINING if kind is NodeZone.TRAINING else Role.COLOCATED
        self.activity = Activity.INACTIVE
        self.engine: Engine | None = None
        self.weights_version = 0
        self.granted = kind is not NodeZone.PREEMPTIBLE  # preemptible GPUs start unavailable
        self.deadline: float | None = None  # under a preemption notice: release by then
        self.removing = False  # leaving the fleet: a drain/interrupt/release chain is under way
        self.releasing = False  # a release step is running (a new start waits for it)
        self.holds_gpus = False  # from the start of `start` to the end of `release`
        self.process_role = Role.COLOCATED  # overlap: the mode its sleeping server process was launched in
        self.chain: list = []  # the executor's unfinished steps for this worker


class Cluster:
    def __init__(self, scenario: Scenario) -> None:
        self.tp = scenario.tp
        self.workers: list[Worker] = []
        c = scenario.cluster
        self._add(NodeZone.ROLLOUT, "roll", c.reserved_rollout_gpus)
        self._add(NodeZone.PREEMPTIBLE, "spot", scenario.max_preemptible_gpus - scenario.max_preemptible_gpus % self.tp)
        self._add(NodeZone.TRAINING, "train", c.training_gpus)
        self.preemptible = [w for w in self.workers if w.kind is NodeZone.PREEMPTIBLE]
        self.overlap = [w for w in self.workers if w.kind is NodeZone.TRAINING]

    def _add(self, kind: NodeZone, prefix: str, gpus: int) -> None:
        per_node = GPUS_PER_NODE - GPUS_PER_NODE % self.tp
        for i in range(gpus // self.tp):
            first = i * self.tp
            node = f"{prefix}-{first // per_node}"
            local = tuple(range(first % per_node, first % per_node + self.tp))
            self.workers.append(Worker(len(self.workers), node, local, kind, i))

    def available(self, w: Worker, overlap_free: bool) -> bool:
        if w.kind is NodeZone.TRAINING:
            return overlap_free
        return w.granted and w.deadline is None

    def snapshot(self, version: int, overlap_free: bool) -> FleetSnapshot:
        """The policies' view. A worker being removed already counts as inactive: it is leaving."""
        slots = tuple(
            WorkerSlot(
                id=w.id, node=w.node, gpus=w.gpus, zone=w.zone, role=w.role,
                activity=Activity.INACTIVE if w.removing else w.activity,
                weights_version=w.weights_version, available=self.available(w, overlap_free),
            )
            for w in self.workers
        )
        return FleetSnapshot(state_version=version, workers=slots, tp=self.tp)

    def gpus_held(self) -> int:
        return sum(len(w.gpus) for w in self.workers if w.holds_gpus)
