"""The policy engine adapter: the database -> the pure PEARL policy -> a decision and a plan as rows.

One pass (`plan`): in one REPEATABLE READ transaction (one consistent view) read the fleet snapshot
(`snapshot.load_snapshot`), the profile (`profile_store.load_profile`: fitted, else a measured engine over
the inventory's workload prior, else the catalog prior), the signals a live control plane knows
(below) and the policy's memory (`policy_memory`); call `PearlPolicy.decide`, then `orchestrate`.
Then, in a second short transaction (`write_planned`), write the decision, the plan
(`plan_store.write_plan`: proposed, base_version = the snapshot's state_version, older proposed plans
superseded) and the new memory. With `dry_run` nothing is written. The write takes the fleet row
first (`transitions.lock_fleet`); if the fleet's state_version is no longer the snapshot's, or the
stored memory changed since it was read (another pass wrote meanwhile), nothing is written and
StalePlan says so (`pearlctl plan` again is the remedy): a pass never overwrites a newer pass's
memory, and a plan is never computed against a state other than the one it records (invariant 3).

One profile. The policy's memory carries a profile it would refit from `signals.telemetry`; live,
the profiles table is the truth (telemetry is folded in when it is ingested, `telemetry_store`),
so the memory's profile is replaced by the stored one and its `fitted_step` set to the last step
ingested: no step is folded twice.

Signals (policies/base.py) as the rows know them: `now` and deadlines in seconds since the
inventory was imported (the database's clock); `training` while the latest optimizer step has
started and not ended, `training_wanted` while it is requested and not started (the trainer waits for
borrowed GPUs) or about to be (`training_imminent`: the batch it trains on is complete); deadlines
of preemptible GPUs under a revocation notice, per worker slot; the
latest telemetry; the rollout step under way and its unfinished trajectories R from
`rollout_progress` (before any report: the whole next step, B of the inventory's workload, else
the profile's); the borrow cycles measured (`borrow_cycles`: activation plus return, for the
gate's T_toggle); measured step durations (latest succeeded step per action, as the simulator
reports them, for the switch costs); the weights version; the plans applying; the last optimizer
step's length; the tails of the latest complete rollout steps (`signals.step_tails`: when each
trajectory finished before the step's end, from the audit log of the progress reports).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pearl.controlplane.core import fleet
from pearl.controlplane.core.domain import PlanStatus, StepAction, StepStatus
from pearl.controlplane.core.fleet import FleetSnapshot
from pearl.controlplane.core.inventory import Inventory
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.core.selector import Selection
from pearl.controlplane.core.switching import DEFAULT_RECONFIG, ReconfigCosts, SwitchCosts
from pearl.controlplane.core.telemetry import StepTelemetry, parse_telemetry
from pearl.controlplane.errors import BadInput, StalePlan
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.plan_store import (
    DecisionRecord,
    json_safe,
    plan_summary,
    target_to_dict,
    write_decision,
    write_plan,
)
from pearl.controlplane.store.profile_store import StoredProfile, fleet_inventory, fleet_key, load_profile
from pearl.controlplane.store.schema import Fleet, PolicyMemory, RolloutProgress, Telemetry, TrainingStep, Worker
from pearl.controlplane.store.schema import Plan as PlanRow
from pearl.controlplane.store.schema import PlanStep as StepRow
from pearl.controlplane.store.signals import step_tails
from pearl.controlplane.store.snapshot import load_snapshot, revocation_notices
from pearl.controlplane.store.transitions import lock_fleet
from pearl.policies.base import Signals
from pearl.policies.borrowing import GateDecision, borrowable, toggle_cost_prior
from pearl.policies.elasticity import dedicated_capacity
from pearl.policies.pearl import PearlMemory, PearlPolicy
from sqlalchemy import Engine, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

POLICY = "pearl"
TOGGLE_HISTORY = 8  # measured borrow cycles the signals carry (the policy folds in the new ones)
TAIL_HISTORY = 3  # complete rollout steps whose tail the signals carry (Signals.step_tails)


def live_policy(profile: StoredProfile, reconfig: ReconfigCosts = DEFAULT_RECONFIG) -> PearlPolicy:
    """The PEARL policy with the stored profile as its prior and the actuators' costs before any is
    measured (one source with the selector's defaults: `switching.DEFAULT_RECONFIG`)."""
    r = reconfig
    return PearlPolicy(
        prior=profile.profile,
        toggle_prior=toggle_cost_prior(r.toggle_on_s, r.toggle_off_s, r.weight_sync_s),
        costs_prior=SwitchCosts.from_reconfig(r, r.weight_sync_s),
        name=POLICY,
    )


@dataclass(frozen=True)
class MemoryMark:
    """Which write of the stored policy memory a pass read."""

    decision_id: int | None
    updated_at: datetime


@dataclass(frozen=True)
class Planned:
    """One pass of the policy engine: what it read, what it decided, what it wrote."""

    snapshot: FleetSnapshot
    signals: Signals
    profile: StoredProfile
    target: fleet.Target
    plan: fleet.Plan
    selection: Selection | None  # the ranking for the budget the target holds
    dedicated: Selection | None  # the ranking on the dedicated slots alone, when overlap slots were borrowable
    gate: GateDecision | None  # the borrowing gate's numbers, when overlap slots were borrowable
    memory: PearlMemory
    memory_note: str  # how the stored memory was used
    verdict: str = ""  # why the overlap slots are (or are not) held
    memory_seen: MemoryMark | None = None  # the stored memory row as read (None: there was none)
    decision_id: int | None = None
    plan_id: int | None = None

    def record(self) -> DecisionRecord:
        sel = self.selection
        return DecisionRecord(
            policy=POLICY,
            state_version=self.snapshot.state_version,
            reason=self.target.reason,
            target=target_to_dict(self.target),
            inputs={
                "selection": sel.summary() if sel else None,
                "dedicated_selection": self.dedicated.summary(top=3) if self.dedicated else None,
                "gate": _gate_dict(self.gate),
                "signals": signals_dict(self.signals),
                "profile": profile_dict(self.profile),
                "memory": self.memory_note,
            },
            predicted_current_s=_predicted(sel, sel.current) if sel else None,
            predicted_target_s=_predicted(sel, sel.chosen) if sel else None,
        )

    def explain(self) -> str:
        """Plain text for `pearlctl plan --explain`: the ranking, the gate's verdict, the decision."""
        p = self.profile.profile
        lines = [f"fleet state_version {self.snapshot.state_version}; profile: {self.profile.describe()}"]
        n_ded = len(dedicated_capacity(self.snapshot))
        n_over = len(borrowable(self.snapshot, self.signals))
        lines.append(f"budget: {n_ded} dedicated worker(s) available, {n_over} overlap worker(s) borrowable; "
                     f"B={p.batch_size}, S={p.S:.1f} turns, r={p.r:.0f} tok/turn, dL={p.delta_l:.0f} tok/turn")
        if self.selection is not None:
            workers = self.selection.candidates[0].config.workers if self.selection.candidates else 0
            lines.append(f"ranked candidates for {workers} worker(s) (* chosen, = current):")
            lines.append(self.selection.explain())
        if self.verdict:
            lines.append(f"borrowing: {self.verdict}")
        lines.append(f"decision: {self.target.reason}")
        return "\n".join(lines)

    def as_dict(self, written_plan: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON object for `pearlctl plan --json`."""
        record = self.record()
        plan: dict[str, Any] | None
        if self.plan.empty:
            plan = None
        elif written_plan is not None:
            plan = written_plan
        else:
            plan = {"id": None, "status": "dry-run", "base_version": self.plan.base_version,
                    "d_worker": self.plan.d_worker, "d_role": self.plan.d_role, "steps": steps_dict(self.plan)}
        return json_safe({
            "state_version": self.snapshot.state_version,
            "decision": {
                "id": self.decision_id,
                "policy": record.policy,
                "reason": record.reason,
                "target": record.target,
                "predicted_current_s": record.predicted_current_s,
                "predicted_target_s": record.predicted_target_s,
            },
            "selection": record.inputs["selection"],
            "gate": record.inputs["gate"],
            "profile": record.inputs["profile"],
            "signals": record.inputs["signals"],
            "plan": plan,
        })


def _predicted(sel: Selection, config: Any) -> float | None:
    found = next((c for c in sel.candidates if config is not None and c.config == config), None)
    return found.predicted_s if found is not None else None


def _gate_dict(g: GateDecision | None) -> dict[str, Any] | None:
    if g is None:
        return None
    return {"borrow": g.borrow, "gain_s": g.gain_s, "cost_s": g.cost_s, "reason": g.reason}


def steps_dict(plan: fleet.Plan) -> list[dict[str, Any]]:
    return [
        {"key": s.key, "action": str(s.action), "worker": s.worker_id, "node": s.node, "args": dict(s.args),
         "after": list(s.after), "group": s.group}
        for s in plan.steps
    ]


def profile_dict(stored: StoredProfile) -> dict[str, Any]:
    k = stored.profile.key
    return {
        "provenance": stored.provenance.value,
        "row_id": stored.row_id,
        "measured_id": stored.measured_id,
        "key": {"model": k.model, "gpu": k.gpu, "tp": k.tp, "device": k.device},
        "steps_observed": stored.profile.steps_observed,
    }


def signals_dict(s: Signals) -> dict[str, Any]:
    return {
        "now": s.now, "event": s.event, "rollout_step": s.rollout_step, "batch_size": s.batch_size,
        "remaining": s.remaining, "in_flight": s.in_flight, "training": s.training,
        "training_wanted": s.training_wanted,
        "deadlines": {str(w): t for w, t in sorted(s.deadlines.items())},
        "telemetry_step": s.telemetry.step if s.telemetry else None, "step_durations": dict(s.step_durations),
        "weights_version": s.weights_version, "plans_in_flight": s.plans_in_flight,
        "last_training_s": s.last_training_s,
    }


# -- reading what a live control plane knows -------------------------------------------------------


def live_signals(session: Session, snapshot: FleetSnapshot, batch_size: int, event: str,
                 time_scale: float = 1.0) -> Signals:
    """The signals of the module docstring, read in the caller's transaction. Every duration and
    time measured on the wall clock is multiplied by `time_scale` (the inventory's: simulated
    servers running faster than the wall clock)."""
    fleet_row = session.execute(select(Fleet.imported_at, func.pearl_now()).where(Fleet.id == 1)).one()
    origin: datetime = fleet_row[0] or fleet_row[1]

    def since(ts: datetime) -> float:
        return (ts - origin).total_seconds() * time_scale

    latest = session.scalars(select(TrainingStep).order_by(TrainingStep.step.desc()).limit(1)).first()
    running = latest is not None and latest.started_at is not None and latest.ended_at is None
    wanted = latest is not None and latest.requested_at is not None and latest.started_at is None \
        and latest.ended_at is None
    wanted = wanted or training_imminent(session, latest)
    ended = session.scalars(
        select(TrainingStep).where(TrainingStep.ended_at.is_not(None), TrainingStep.started_at.is_not(None))
        .order_by(TrainingStep.step.desc()).limit(1)
    ).first()
    notices: dict[int, datetime] = {}  # per worker slot, its earliest GPU deadline
    for slot, deadline in revocation_notices(session).values():
        notices[slot] = min(deadline, notices.get(slot, deadline))
    telemetry = latest_telemetry(session)
    weights = session.scalar(select(func.max(TrainingStep.weights_version)))
    if weights is None:
        weights = session.scalar(select(func.max(Worker.weights_version))) or 0
    progress = session.scalars(select(RolloutProgress).order_by(RolloutProgress.step.desc()).limit(1)).first()
    if progress is not None:  # the step under way and its unfinished trajectories, as the rollout reports them
        rollout_step, batch_size = progress.step, progress.batch_size
        remaining = progress.batch_size - progress.finished
        in_flight = progress.in_flight
    else:  # nothing reported yet: the whole of the next step is ahead
        rollout_step = telemetry.step + 1 if telemetry is not None else 0
        remaining = batch_size
        in_flight = None
    cycles = borrow_cycle_costs(session)
    return Signals(
        now=since(fleet_row[1]),
        event=event,
        rollout_step=rollout_step,
        batch_size=batch_size,
        remaining=remaining,
        toggle_costs=tuple(c * time_scale for c in cycles[-TOGGLE_HISTORY:]),
        toggle_cycles=len(cycles),
        training=running,
        training_wanted=wanted,
        deadlines={slot: since(deadline) for slot, deadline in notices.items()},
        telemetry=telemetry,
        step_durations={k: v * time_scale for k, v in step_durations(session).items()},
        weights_version=int(weights),
        plans_in_flight=session.scalar(select(func.count()).where(PlanRow.status == PlanStatus.APPLYING)) or 0,
        last_training_s=(ended.ended_at - ended.started_at).total_seconds() * time_scale if ended is not None else None,
        step_tails=tuple(tuple(x * time_scale for x in tail) for tail in step_tails(session, TAIL_HISTORY)),
        in_flight=in_flight,
    )


def training_imminent(session: Session, latest: TrainingStep | None) -> bool:
    """The trainer is about to ask for its GPUs: no optimizer step runs or waits, and the batch the
    next one trains on (training step k trains on rollout step k) is complete. The trainer sends
    `training-begin` as soon as it has published the last step's weights, a fraction of a second
    later: a loan in that gap could not pay for itself and would come back late (the simulator's
    trainer begins the step at that instant, so its policy never sees the gap)."""
    if latest is not None and latest.ended_at is None:
        return False  # a step is requested or running: `training` / `training_wanted` say so
    nxt = latest.step + 1 if latest is not None else 0
    return session.scalar(select(RolloutProgress.ended_at).where(RolloutProgress.step == nxt)) is not None


def borrow_cycle_costs(session: Session) -> list[float]:
    """Activation plus return (seconds) of every borrow cycle measured, oldest first (`borrow_cycles`);
    a cycle that began by launching a server (its first loan) is a cold start, not a toggle."""
    rows = session.execute(text(
        "SELECT activation_s + return_s FROM borrow_cycles WHERE activation_s IS NOT NULL "
        "AND return_s IS NOT NULL AND NOT cold_start ORDER BY returned_at")).scalars().all()
    return [float(x) for x in rows if x is not None and x >= 0]


def latest_telemetry(session: Session) -> StepTelemetry | None:
    row = session.scalars(select(Telemetry).order_by(Telemetry.step.desc()).limit(1)).first()
    return parse_telemetry(row.body, f"telemetry row {row.id}") if row is not None else None


def step_durations(session: Session) -> dict[str, float]:
    """The latest measured seconds per action, keyed as the simulator's executor keys them
    (start and release by zone: start_dedicated, start_overlap, release_overlap, ...)."""
    rows = session.execute(
        select(StepRow.action, StepRow.args, StepRow.started_at, StepRow.finished_at)
        .where(StepRow.status == StepStatus.SUCCEEDED, StepRow.started_at.is_not(None),
               StepRow.finished_at.is_not(None))
        .order_by(StepRow.finished_at)
    )
    out: dict[str, float] = {}
    for action, args, started, finished in rows:
        zone = (args or {}).get("zone")
        kind = f"{action.value}_{zone}" if action in (StepAction.START, StepAction.RELEASE) and zone else action.value
        out[kind] = max(0.0, (finished - started).total_seconds())
    return out


def _memory_mark(session: Session, *, lock: bool = False) -> MemoryMark | None:
    stmt = select(PolicyMemory.decision_id, PolicyMemory.updated_at).where(PolicyMemory.policy == POLICY)
    row = session.execute(stmt.with_for_update() if lock else stmt).first()
    return MemoryMark(row.decision_id, row.updated_at) if row is not None else None


def _load_memory(session: Session, policy: PearlPolicy, profile: StoredProfile) -> tuple[PearlMemory, str]:
    row = session.get(PolicyMemory, POLICY)
    memory, note = policy.initial_memory(), "initial"
    if row is not None:
        try:
            memory, note = PearlMemory.from_dict(row.memory), f"stored (decision {row.decision_id})"
        except BadInput as exc:
            note = f"initial: the stored memory was unreadable ({exc})"
    last = session.scalar(select(func.max(Telemetry.step)))
    fitted = max(memory.fitted_step, last if last is not None else -1)
    return replace(memory, profile=profile.profile, fitted_step=fitted), note


# -- one pass ----------------------------------------------------------------------------------------


def decide(session: Session, *, event: str = "plan") -> Planned:
    """Read everything and decide; writes nothing (the caller's transaction should be REPEATABLE READ)."""
    inventory: Inventory = fleet_inventory(session)
    stored = load_profile(session, fleet_key(inventory), inventory.workload,
                          rollout=inventory.rollout.rollout() if inventory.rollout else None)
    snapshot = load_snapshot(session)
    batch = inventory.workload.batch_size if inventory.workload is not None else stored.profile.batch_size
    signals = live_signals(session, snapshot, batch, event, inventory.time_scale or 1.0)
    policy = live_policy(stored)
    memory, note = _load_memory(session, policy, stored)
    target, after = policy.decide(snapshot, signals, memory)
    plan = orchestrate(snapshot, target)
    # The policy's own assessment (its memory after the fold): what `--explain` shows is what decided.
    seen = policy.assess(snapshot, signals, after)
    chosen = seen.with_overlap if seen.borrow and seen.with_overlap is not None else seen.on_dedicated
    return Planned(snapshot, signals, stored, target, plan,
                   chosen.selection if chosen is not None else None,
                   seen.on_dedicated.selection if seen.with_overlap is not None and seen.on_dedicated else None,
                   seen.gate, after, note, seen.verdict, _memory_mark(session))


def plan(engine: Engine, *, dry_run: bool = False, event: str = "plan", actor: str = "pearlctl plan",
         record_unchanged: bool = True) -> Planned:
    """One pass of the policy engine (module docstring); with `dry_run` nothing is written. Without
    `record_unchanged` a pass that changes nothing writes no decision row (only the policy's memory,
    when it changed): the loop decides on every signal, and `decisions` keeps the switches."""
    with transaction(engine, isolation_level="REPEATABLE READ", whole_fleet=True) as session:
        planned = decide(session, event=event)
    if dry_run:
        return planned
    return write_planned(engine, planned, actor=actor, record_unchanged=record_unchanged)


def write_planned(engine: Engine, planned: Planned, *, actor: str = "pearlctl plan",
                  record_unchanged: bool = True) -> Planned:
    """Write what `decide` decided, unless the fleet or the stored memory moved on since it read
    them: then nothing is written and StalePlan says why."""
    with transaction(engine, actor=actor, reason=planned.target.reason[:500]) as session:
        version = lock_fleet(session)
        if version != planned.snapshot.state_version:
            raise StalePlan(f"the fleet moved on while planning (state_version {planned.snapshot.state_version} "
                            f"-> {version}); nothing was written; run `pearlctl plan` again")
        mark = _memory_mark(session, lock=True)
        if mark != planned.memory_seen:
            raise StalePlan(f"another planning pass wrote the policy's memory meanwhile (decision "
                            f"{mark.decision_id if mark else None}); nothing was written; run `pearlctl plan` again")
        memory = json_safe(planned.memory.to_dict())
        if planned.plan.empty and not record_unchanged:
            stored = session.get(PolicyMemory, POLICY)
            if stored is None or stored.memory != memory:
                _store_memory(session, memory, stored.decision_id if stored is not None else None)
            return planned
        decision_id = write_decision(session, planned.record())
        plan_id = write_plan(session, planned.plan, decision_id)
        _store_memory(session, memory, decision_id)
    return replace(planned, decision_id=decision_id, plan_id=plan_id)


def _store_memory(session: Session, memory: dict[str, Any], decision_id: int | None) -> None:
    session.execute(
        insert(PolicyMemory)
        .values(policy=POLICY, memory=memory, decision_id=decision_id)
        .on_conflict_do_update(index_elements=[PolicyMemory.policy],
                               set_={"memory": memory, "decision_id": decision_id, "updated_at": func.now()})
    )


def written_plan(engine: Engine, planned: Planned) -> dict[str, Any] | None:
    """The stored plan of a pass, as `plan --json` prints it (None when nothing changes or dry run)."""
    if planned.plan_id is None:
        return None
    with transaction(engine) as session:
        return plan_summary(session, planned.plan_id)
