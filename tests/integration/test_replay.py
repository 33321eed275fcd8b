"""Replay: the live policy pass decides what the simulator's `pearl` decides for the same inputs.

The simulator runs the demo scenario with a recording policy; at each decision taken with no plan in
flight, the test rebuilds in PostgreSQL what the live control plane would know at that moment (the
workers and their GPUs, the training steps, the rollout progress with the trajectories in flight,
the preemptible leases and their notices, the latest telemetry, the tails of the latest complete
steps, the measured step durations and borrow cycles, the policy's stored memory and profile),
pins the database's clock to the moment, and runs the live pass's `decide`: the target (members,
roles, the tail wake-up) must be the simulator's. What is compared is the adapter: that the rows
give the policy the signals the simulator gives it.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from pearl.controlplane.core.domain import (
    Activity,
    GPUState,
    LeaseKind,
    NodeZone,
    PlanStatus,
    StepAction,
    StepStatus,
    WorkerZone,
)
from pearl.controlplane.core.fleet import FleetSnapshot, Target
from pearl.controlplane.core.profile import ProfileKey, Provenance
from pearl.controlplane.store import profile_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.plan_store import json_safe
from pearl.controlplane.store.schema import (
    GPU,
    Event,
    Fleet,
    Lease,
    Plan,
    PlanStep,
    PolicyMemory,
    RolloutProgress,
    Telemetry,
    TrainingStep,
    Worker,
)
from pearl.policies.base import Signals
from pearl.policies.live import policy_pass
from pearl.policies.pearl import PearlMemory, PearlPolicy
from pearl.sim.runner import Simulation
from pearl.sim.scenario import load_scenario
from pearl.sim.systems import system
from plan_support import import_cluster, pin_clock
from sqlalchemy import Engine, delete, select, text, update

pytestmark = pytest.mark.integration

SCENARIO = "demo-qwen3-30b-a3b-seg2"
DURATION_S = 900.0


class Recording:
    """The simulator's pearl policy, recording each call: (snapshot, signals, memory before, target)."""

    def __init__(self, policy: PearlPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.calls: list[tuple[FleetSnapshot, Signals, PearlMemory, Target, PearlMemory]] = []

    def initial_memory(self) -> PearlMemory:
        return self.policy.initial_memory()

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: PearlMemory) -> tuple[Target, Any]:
        target, after = self.policy.decide(snapshot, signals, memory)
        self.calls.append((snapshot, signals, memory, target, after))
        return target, after


@pytest.fixture(scope="module")
def recorded() -> tuple[Any, list]:
    sc = load_scenario(SCENARIO).model_copy(update={"duration_s": DURATION_S})
    policy = Recording(system("pearl").policy(sc))
    Simulation(sc, policy).run()
    return sc, policy.calls


def _inventory(sc: Any) -> dict[str, Any]:
    """The simulator's cluster as nodes whose worker ids are the simulator's plus one (same order)."""
    from pearl.agents.demo import inventory_for

    inv = inventory_for(sc, 1.0).model_dump(mode="json", exclude_none=True)
    inv.pop("time_scale", None)
    order = {"rollout": 0, "preemptible": 1, "training": 2}  # the simulator lays out slots in this order
    inv["nodes"] = sorted(inv["nodes"], key=lambda n: order[n["zone"]])
    return inv


def _rebuild(engine: Engine, sc: Any, snapshot: FleetSnapshot, s: Signals, before: PearlMemory,
             after: PearlMemory) -> None:
    """The rows a live control plane would hold at this decision (module docstring)."""
    with transaction(engine, actor="replay") as session:
        origin = session.scalar(select(Fleet.imported_at))
        at = lambda seconds: origin + timedelta(seconds=seconds)  # noqa: E731
        # a state put in place at once, not reached by transitions: no guard, audit or check trigger
        session.execute(text("SET LOCAL session_replication_role = replica"))
        for table in (Lease, PlanStep, Plan, TrainingStep, RolloutProgress, Telemetry, PolicyMemory, Event):
            session.execute(delete(table))
        for w in snapshot.workers:
            wid = w.id + 1
            session.execute(update(Worker).where(Worker.id == wid).values(
                activity=w.activity, role=w.role, weights_version=w.weights_version))
            gpus = session.scalars(select(GPU).where(GPU.slot_id == wid)).all()
            for g in gpus:
                if w.activity is not Activity.INACTIVE:
                    state = GPUState.BORROWED if w.zone is WorkerZone.OVERLAP else GPUState.BOUND
                    g.state, g.worker_id = state, wid
                elif g.zone is NodeZone.TRAINING:
                    g.state, g.worker_id = (GPUState.TRAINING if s.training else GPUState.FREE), None
                elif g.zone is NodeZone.PREEMPTIBLE and not (w.available or wid - 1 in s.deadlines):
                    g.state, g.worker_id = GPUState.UNAVAILABLE, None
                else:
                    g.state, g.worker_id = GPUState.FREE, None
            if w.id in s.deadlines:
                session.add_all(Lease(gpu_id=g.id, kind=LeaseKind.PREEMPTIBLE, granted_at=origin,
                                      deadline=at(s.deadlines[w.id])) for g in gpus)
        session.flush()
        # the trainer: the last step it finished (its length, its weights) and the one under way
        done = max(s.weights_version, 1 if s.last_training_s is not None else 0)
        if s.last_training_s is not None:
            session.add(TrainingStep(step=done - 1, requested_at=at(0), started_at=at(0),
                                     ended_at=at(s.last_training_s), weights_version=s.weights_version))
            session.flush()
        if s.training or s.training_wanted:
            session.add(TrainingStep(step=done, requested_at=at(s.now), started_at=at(s.now) if s.training else None))
        # the latest complete rollout steps, each finish as the audit log of its progress reports holds it
        last_done = s.rollout_step if s.remaining == 0 else s.rollout_step - 1
        for i, tail in enumerate(s.step_tails):
            step = last_done - (len(s.step_tails) - 1 - i)
            latest = i == len(s.step_tails) - 1 and s.remaining == 0  # the row the live pass reads
            session.add(RolloutProgress(step=step, batch_size=len(tail), finished=len(tail), ended_at=at(0),
                                        in_flight=s.in_flight if latest else None))
            session.add_all(Event(at=at(tail[-1] - offset), state_version=0, entity="rollout_progress",
                                  entity_id=str(step), op="update", new={"finished": n + 1})
                            for n, offset in enumerate(reversed(tail)))
        if s.rollout_step >= 0 and s.remaining > 0:
            session.add(RolloutProgress(step=s.rollout_step, batch_size=s.batch_size,
                                        finished=s.batch_size - s.remaining, in_flight=s.in_flight))
        elif s.rollout_step >= 0 and not s.step_tails:
            session.add(RolloutProgress(step=s.rollout_step, batch_size=s.batch_size, finished=s.batch_size,
                                        in_flight=s.in_flight))
        if s.telemetry is not None:
            session.add(Telemetry(step=s.telemetry.step, body=s.telemetry.model_dump(mode="json")))
        # what the executor measured: the latest duration of each kind of step, and the borrow cycles
        plan = Plan(base_version=0, status=PlanStatus.SUCCEEDED)
        session.add(plan)
        session.flush()
        for i, (kind, seconds) in enumerate(sorted(s.step_durations.items())):
            action, _, zone = kind.partition("_") if kind.startswith(("start_", "release_")) else (kind, "", "")
            session.add(PlanStep(plan_id=plan.id, key=f"k{i}", worker_id=1, node_id=1, action=StepAction(action),
                                 args={"zone": zone} if zone else {}, status=StepStatus.SUCCEEDED,
                                 started_at=at(i), finished_at=at(i + seconds)))
        # the overlap slots whose server sleeps between loans (in the simulator, every one): launched before
        for w in snapshot.workers:
            if w.zone is WorkerZone.OVERLAP and w.warm:
                node = session.scalar(select(Worker.node_id).where(Worker.id == w.id + 1))
                session.add(PlanStep(plan_id=plan.id, key=f"w{w.id + 1}.launched", worker_id=w.id + 1, node_id=node,
                                     action=StepAction.START, args={"zone": "overlap"}, status=StepStatus.SUCCEEDED,
                                     started_at=at(0), finished_at=at(0)))
        training_gpu = session.scalar(select(GPU.id).where(GPU.zone == NodeZone.TRAINING).limit(1))
        first = s.toggle_cycles - len(s.toggle_costs)
        for i in range(s.toggle_cycles):  # the cycles the signals no longer carry weigh nothing: 0 s each
            cost = s.toggle_costs[i - first] if i >= first else 0.0
            session.add(Lease(gpu_id=training_gpu, kind=LeaseKind.BORROWED, granted_at=at(10 * i),
                              active_at=at(10 * i + cost / 2), return_began_at=at(10 * i + 5),
                              returned_at=at(10 * i + 5 + cost / 2), late_s=0.0))
        # the policy's memory before the call; its profile as the live rows hold it (folded already)
        key = after.profile.key
        fleet_key = ProfileKey(key.model, key.gpu, key.tp, profile_store.FLEET_DEVICE)
        stored = profile_store.save_profile(session, replace(after.profile, provenance=Provenance.FITTED,
                                                             key=fleet_key))
        memory = json_safe(before.to_dict())
        session.add(PolicyMemory(policy=policy_pass.POLICY, memory=memory, decision_id=None))
        session.flush()
        assert stored


def test_live_decisions_equal_the_simulators_for_the_same_inputs(db_engine: Engine, recorded: tuple) -> None:
    sc, calls = recorded
    import_cluster(db_engine, _inventory(sc))
    quiet = [c for c in calls if c[1].plans_in_flight == 0]
    assert len(quiet) >= 10
    borrowing = [c for c in quiet if any(w.zone is WorkerZone.OVERLAP for w in c[0].workers
                                         if w.id in c[3].members)]
    assert borrowing and any(c[1].deadlines for c in calls) and any(c[1].training for c in quiet)
    # a spread of them, the first borrowing and training ones included (each costs a rebuild and a pass)
    picked = sorted({0, quiet.index(borrowing[0]), *range(0, len(quiet), max(1, len(quiet) // 16)),
                     next(i for i, c in enumerate(quiet) if c[1].training)})
    compared = 0
    for snapshot, signals, before, target, after in (quiet[i] for i in picked):
        _rebuild(db_engine, sc, snapshot, signals, before, after)
        with transaction(db_engine, isolation_level="REPEATABLE READ") as session:
            origin = session.scalar(select(Fleet.imported_at))
            pin_clock(session, origin + timedelta(seconds=signals.now))
            live = policy_pass.decide(session, event=signals.event)
        ids = {w + 1 for w in target.members}
        assert live.target.members == ids, (signals, target.reason, live.target.reason)
        assert dict(live.target.counts) == dict(target.counts), (signals, target.reason, live.target.reason)
        assert live.target.recheck_remaining == target.recheck_remaining
        compared += 1
    assert compared == len(picked) >= 10
