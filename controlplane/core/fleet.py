"""Value types at the boundary of the decision core: the fleet as the core sees it, targets and plans.

Pure: no I/O. The database adapter (`controlplane/store/snapshot.py`) and the simulator both build a
`FleetSnapshot`; the policies turn it into a `Target`; `orchestrator.orchestrate` turns the pair into
a `Plan` whose steps the agents (live) or the simulator's executor enact. One format for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pearl.controlplane.core.domain import Activity, Mode, Role, StepAction, WorkerZone


@dataclass(frozen=True)
class WorkerSlot:
    """A stable worker slot: bound for its lifetime to `gpus` (TP-size GPUs on one node)."""

    id: int  # stable; never renumbered; a new worker reuses an empty slot
    node: str
    gpus: tuple[int, ...]  # GPU ids (database ids live; indices in the simulator)
    zone: WorkerZone
    role: Role  # current role (the last one it served in, while inactive)
    activity: Activity
    weights_version: int = 0
    # Whether the slot's GPUs can host an active rollout worker right now: dedicated GPUs granted and
    # not under a preemption notice; overlap GPUs idle between optimizer steps.
    available: bool = True
    # Overlap slots: whether a server was launched on the slot before (an earlier loan or a warm-up,
    # under the node's present agent) and sleeps between loans, so that a loan wakes it in seconds;
    # False: a loan launches one, a cold start.
    warm: bool = True

    @property
    def active(self) -> bool:
        return self.activity is Activity.ACTIVE

    def evolve(self, **changes: Any) -> WorkerSlot:
        return replace(self, **changes)


@dataclass(frozen=True)
class FleetSnapshot:
    """Every worker slot, at one `state_version` of the fleet."""

    state_version: int
    workers: tuple[WorkerSlot, ...]
    tp: int = 1

    def by_id(self) -> dict[int, WorkerSlot]:
        return {w.id: w for w in self.workers}

    def active(self) -> tuple[WorkerSlot, ...]:
        return tuple(w for w in self.workers if w.activity is not Activity.INACTIVE)

    def available(self, zone: WorkerZone | None = None) -> tuple[WorkerSlot, ...]:
        return tuple(w for w in self.workers if w.available and (zone is None or w.zone is zone))

    def mode(self) -> Mode | None:
        """The shape of the active workers (None when nothing is active)."""
        roles = {w.role for w in self.active()}
        if not roles:
            return None
        return Mode.COLOCATED if Role.COLOCATED in roles else Mode.SPLIT


@dataclass(frozen=True)
class Target:
    """What the fleet should look like: which workers are active and how many serve in each role.

    Only two shapes exist (docs/method.md): every member colocated, or every member prefill or decode
    with at least one of each. Which member takes which role is the orchestrator's choice (the one
    with the fewest changes), unless `pinned` fixes some.
    """

    members: frozenset[int]  # worker ids that should be active
    counts: Mapping[Role, int]  # active workers per role; sums to len(members)
    pinned: Mapping[int, Role] = field(default_factory=dict)  # roles the policy fixes for some members
    reason: str = ""  # why (shown by `pearlctl plan --explain`, stored with the decision)
    # Consult the policy again once no more than this many trajectories of the step under way are
    # unfinished (e.g. to give borrowed GPUs back before the step ends); None: no such wake-up.
    recheck_remaining: int | None = None
    # Overlap slots, not members, to launch and put to sleep at once (start, then release), so that
    # later loans wake a sleeping server instead of paying a cold start (`WorkerSlot.warm`).
    warm_up: frozenset[int] = frozenset()

    @property
    def mode(self) -> Mode | None:
        if not self.members:
            return None
        return Mode.COLOCATED if self.counts.get(Role.COLOCATED, 0) else Mode.SPLIT


@dataclass(frozen=True)
class PlanStep:
    """One action on one worker; runs once every step in `after` has succeeded."""

    key: str  # unique within the plan, e.g. "w7.start"
    action: StepAction
    worker_id: int
    node: str
    args: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"role": "decode", "zone": "overlap"}
    after: tuple[str, ...] = ()  # keys of the steps this one depends on
    group: str | None = None  # an expansion group admitted all-or-nothing (invariant 6)


@dataclass(frozen=True)
class Plan:
    """The minimal change from the current active set to a target (docs/method.md, orchestration)."""

    base_version: int  # the state_version it was computed against (stale if the fleet moved on)
    add: frozenset[int]  # W_add: workers to start
    remove: frozenset[int]  # W_remove: workers to stop
    reassign: Mapping[int, Role]  # rho: survivors whose role changes
    roles: Mapping[int, Role]  # the resolved role of every target member
    steps: tuple[PlanStep, ...]
    target: Target

    @property
    def d_worker(self) -> int:
        return len(self.add) + len(self.remove)

    @property
    def d_role(self) -> int:
        return len(self.reassign)

    @property
    def empty(self) -> bool:
        return not self.steps
