"""The baselines' decisions on snapshots: dedicated GPUs only, colocated, notices honoured."""

from __future__ import annotations

import pytest
from pearl.controlplane.core.domain import Activity, Role, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.policies.base import NoMemory, Signals, colocated, split
from pearl.policies.baselines import ColocatedBaseline
from pearl.policies.elasticity import dedicated_capacity, overlap_capacity

pytestmark = pytest.mark.unit


def _slot(wid: int, zone: WorkerZone = WorkerZone.DEDICATED, available: bool = True,
          active: bool = False, role: Role = Role.COLOCATED) -> WorkerSlot:
    return WorkerSlot(id=wid, node="n", gpus=(2 * wid, 2 * wid + 1), zone=zone, role=role,
                      activity=Activity.ACTIVE if active else Activity.INACTIVE, available=available)


def _signals(**kw) -> Signals:
    base = dict(now=0.0, event="grant", rollout_step=0, batch_size=64, remaining=64, training=False,
                training_wanted=False)
    return Signals(**{**base, **kw})


SNAPSHOT = FleetSnapshot(1, (
    _slot(0, active=True), _slot(1, active=True),  # reserved
    _slot(2, active=True, available=False),  # preemptible under a notice
    _slot(3), _slot(4, available=False),  # preemptible: granted, not granted
    _slot(5, WorkerZone.OVERLAP, role=Role.TRAINING), _slot(6, WorkerZone.OVERLAP, role=Role.TRAINING),
), tp=2)


@pytest.mark.parametrize("policy", [ColocatedBaseline("roll"), ColocatedBaseline("rlboost-plus")])
def test_baselines_use_available_dedicated_slots_colocated_and_never_borrow(policy):
    target, memory = policy.decide(SNAPSHOT, _signals(deadlines={2: 30.0}), policy.initial_memory())
    assert memory == NoMemory()
    assert target.members == {0, 1, 3}
    assert target.counts == {Role.COLOCATED: 3}
    plan = orchestrate(SNAPSHOT, target)
    assert plan.remove == {2} and plan.add == {3}  # the noticed worker leaves, the granted one joins


def test_the_reason_names_the_system_and_the_workers_it_releases():
    target, _ = ColocatedBaseline("rlboost-plus").decide(SNAPSHOT, _signals(deadlines={2: 30.0}), NoMemory())
    assert target.reason == "rlboost-plus: 3 dedicated workers, colocated; releasing [2] before their notice runs out"
    target, _ = ColocatedBaseline("roll").decide(SNAPSHOT, _signals(), NoMemory())
    assert target.reason == "roll: 3 dedicated workers, colocated"


def test_elasticity_helpers():
    assert [w.id for w in dedicated_capacity(SNAPSHOT)] == [0, 1, 3]
    assert [w.id for w in overlap_capacity(SNAPSHOT)] == [5, 6]


def test_target_builders():
    t = colocated([3, 1], "r")
    assert t.members == {1, 3} and t.counts == {Role.COLOCATED: 2} and t.reason == "r"
    assert colocated([], "nothing").counts == {}
    s = split([0, 1, 2], 1, "r", pinned={0: Role.PREFILL})
    assert s.counts == {Role.PREFILL: 1, Role.DECODE: 2} and s.pinned == {0: Role.PREFILL}
    assert _signals(remaining=16).remaining_fraction == 0.25
