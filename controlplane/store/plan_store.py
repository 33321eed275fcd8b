"""The plan store: decisions, plans and their steps as rows; applying a plan; the steps' progression.

Lifecycle of a plan (`PlanStatus`):
  proposed  --apply, fleet still at base_version-->  applying  --every step succeeded-->  succeeded
  proposed  --apply, fleet moved on-->  stale          applying  --a step failed, or abort-->  failed
  proposed  --a newer plan is written-->  superseded
A plan is refused when written if it could never finish: a step waiting for a key the plan does not
have (or, through a cycle, for itself), or a step addressed to a node its worker does not live on.
Steps (`StepStatus`): written `blocked`; on apply the steps with no dependency become `ready` (the
NOTIFY trigger wakes their node's agent: channel `pearl_steps`, payload the node id); an agent
claims one (`claim_steps`, only steps of the applying plan), runs it and reports through the fenced
`finish_step`; `finish_step` here then unblocks the steps whose dependencies all succeeded, finishes
the plan when every step succeeded, and fails it when a step failed, cancelling every step not yet
run (a running step whose claim later expires is cancelled by `rescue_expired_steps`, never run
again). The admits of an expansion group wait for every member's load_weights, so a member failing
means no admit of the group runs (invariant 6: all-or-nothing); releasing the GPUs the members of a
group not fully admitted already took is the agents' job (`PlanProgress.release` lists those
workers; a group whose admits all succeeded serves and is kept).

Concurrency. `apply` takes the fleet row first (`transitions.lock_fleet`), then the plan row: two
applies of one plan are serialised and the second finds it applying; a plan whose base_version is
not the fleet's state_version is marked stale and refused (invariant 3), nothing else changes.
`finish_step` and `abort` take the same two locks in the same order, so two agents finishing the
last two dependencies of a step cannot both miss the other's success, and no apply deadlocks with them.
Every change of plans and plan_steps is written to `events` by triggers (invariant 5).
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from graphlib import CycleError, TopologicalSorter
from typing import Any

from pearl.controlplane.core import fleet
from pearl.controlplane.core.domain import PlanStatus, StepAction, StepStatus
from pearl.controlplane.errors import BadInput, PearlError, StalePlan
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import Decision, Node, Worker
from pearl.controlplane.store.schema import Plan as PlanRow
from pearl.controlplane.store.schema import PlanStep as StepRow
from pearl.controlplane.store.transitions import StateConflict, lock_fleet
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session

UNFINISHED = (StepStatus.BLOCKED, StepStatus.READY)  # cancelled when the plan fails (running ones report later)


class NoPlan(BadInput):
    """There is no such plan."""


class NothingToApply(PearlError):
    """No proposed plan: run `pearlctl plan` first."""


class PlanNotApplicable(PearlError):
    """The plan cannot be applied in its status."""


class ClaimLost(StateConflict):
    """The step is no longer running under that fence: the claim expired or another agent took it."""


class PlanTimeout(PearlError):
    """The plan did not finish in time."""


@dataclass(frozen=True)
class DecisionRecord:
    """What the policy decided on one pass, as the `decisions` row stores it."""

    policy: str
    state_version: int
    reason: str
    target: Mapping[str, Any] | None  # None: keep the current configuration
    inputs: Mapping[str, Any] = field(default_factory=dict)  # selection summary, gate, signals, profile
    predicted_current_s: float | None = None
    predicted_target_s: float | None = None


@dataclass(frozen=True)
class AppliedPlan:
    plan_id: int
    base_version: int
    ready: tuple[str, ...]  # step keys made ready
    blocked: int  # steps waiting for their dependencies
    nodes: tuple[str, ...]  # nodes whose agents were woken


@dataclass(frozen=True)
class PlanProgress:
    """What one reconciliation of an applying plan did."""

    plan_id: int
    status: PlanStatus
    readied: tuple[str, ...] = ()  # steps made ready by this call
    cancelled: tuple[str, ...] = ()  # steps cancelled by this call
    release: tuple[int, ...] = ()  # workers of a cancelled expansion group that already took GPUs


def json_safe(value: Any) -> Any:
    """JSON that PostgreSQL accepts: enums as their values, numpy numbers as Python's, non-finite
    floats as null."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)  # a StrEnum as its value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value) if isinstance(value, set | frozenset) else value
        return [json_safe(v) for v in items]
    return str(value)


def target_to_dict(target: fleet.Target) -> dict[str, Any]:
    return {
        "mode": target.mode.value if target.mode else None,
        "members": sorted(target.members),
        "counts": {str(r): n for r, n in target.counts.items()},
        "pinned": {str(w): str(r) for w, r in sorted(target.pinned.items())},
        "reason": target.reason,
        "recheck_remaining": target.recheck_remaining,
    }


# -- writing -----------------------------------------------------------------------------------------


def write_decision(session: Session, record: DecisionRecord) -> int:
    row = Decision(
        policy=record.policy,
        state_version=record.state_version,
        inputs=json_safe(record.inputs),
        target=json_safe(record.target) if record.target is not None else None,
        reason=record.reason,
        predicted_current_s=json_safe(record.predicted_current_s),
        predicted_target_s=json_safe(record.predicted_target_s),
    )
    session.add(row)
    session.flush()
    return row.id


def write_plan(session: Session, plan: fleet.Plan, decision_id: int | None) -> int | None:
    """Store a non-empty plan as `proposed` with its steps (all `blocked` until applied); older
    proposed plans become `superseded`. Returns the plan id, or None for an empty plan."""
    if plan.empty:
        return None
    nodes = {name: node_id for name, node_id in session.execute(select(Node.name, Node.id))}
    missing = sorted({s.node for s in plan.steps} - nodes.keys())
    if missing:
        raise BadInput(f"plan.steps.node: unknown node(s) {missing}")
    _check_steps(plan.steps, {w: n for w, n in session.execute(select(Worker.id, Worker.node_id))}, nodes)
    row = PlanRow(decision_id=decision_id, base_version=plan.base_version, d_worker=plan.d_worker, d_role=plan.d_role)
    session.add(row)
    session.flush()
    session.execute(
        update(PlanRow)
        .where(PlanRow.status == PlanStatus.PROPOSED, PlanRow.id != row.id)
        .values(status=PlanStatus.SUPERSEDED, finished_at=func.now(), error=f"superseded by plan {row.id}")
        .execution_options(synchronize_session=False)
    )
    session.add_all(
        StepRow(
            plan_id=row.id,
            key=s.key,
            worker_id=s.worker_id,
            node_id=nodes[s.node],
            action=s.action,
            args=json.loads(json.dumps(json_safe(dict(s.args)))),
            expansion_group=f"plan{row.id}.{s.group}" if s.group else None,
            depends_on=list(s.after),
            status=StepStatus.BLOCKED,
        )
        for s in plan.steps
    )
    session.flush()
    return row.id


def _check_steps(steps: tuple[fleet.PlanStep, ...], worker_nodes: dict[int, int], nodes: dict[str, int]) -> None:
    """Refuse a plan that could never finish: a step waiting for a key the plan does not have, or
    for itself through a cycle, or addressed to a node its worker does not live on."""
    keys = {s.key for s in steps}
    for s in steps:
        unknown = [k for k in s.after if k not in keys]
        if unknown:
            raise BadInput(f"plan.steps[{s.key}].after: {unknown} are not keys of the plan "
                           "(the step would wait forever)")
        if worker_nodes.get(s.worker_id) != nodes[s.node]:
            raise BadInput(f"plan.steps[{s.key}].worker: worker {s.worker_id} does not live on node {s.node!r}")
    try:
        TopologicalSorter({s.key: s.after for s in steps}).prepare()
    except CycleError as exc:
        raise BadInput(f"plan.steps.after: the steps {exc.args[1]} wait for each other in a cycle") from None


# -- applying ----------------------------------------------------------------------------------------


def _plan_for_update(session: Session, plan_id: int | None) -> PlanRow:
    stmt = select(PlanRow).with_for_update()
    if plan_id is None:
        stmt = stmt.where(PlanRow.status == PlanStatus.PROPOSED).order_by(PlanRow.id.desc()).limit(1)
    else:
        stmt = stmt.where(PlanRow.id == plan_id)
    row = session.scalars(stmt.execution_options(populate_existing=True)).first()
    if row is None:
        raise NoPlan(f"PLAN_ID: plan {plan_id} does not exist") if plan_id else NothingToApply()
    return row


def apply_in(session: Session, plan_id: int | None) -> AppliedPlan | StalePlan:
    """Apply a proposed plan (the latest with `plan_id` None) in the caller's transaction.

    Returns StalePlan (not raised) after marking the plan stale, so the caller commits the mark and
    then raises it; raises for every other refusal (nothing written).
    """
    version = lock_fleet(session)
    plan = _plan_for_update(session, plan_id)
    if plan.status is PlanStatus.SUPERSEDED:
        raise StalePlan(f"plan {plan.id} was {plan.error or 'superseded'}; run `pearlctl plan` again")
    if plan.status is not PlanStatus.PROPOSED:
        raise PlanNotApplicable(f"plan {plan.id} is {plan.status.value}; only a proposed plan can be applied")
    if plan.base_version != version:
        message = (f"plan {plan.id} was computed at state_version {plan.base_version}, the fleet is at {version}; "
                   "run `pearlctl plan` again")
        plan.status, plan.error, plan.finished_at = PlanStatus.STALE, message, func.now()
        session.flush()
        return StalePlan(message)
    other = session.scalar(select(PlanRow.id).where(PlanRow.status == PlanStatus.APPLYING))
    if other is not None:
        raise PlanNotApplicable(f"plan {other} is still applying; wait for it (`pearlctl apply {other} --wait`) "
                                f"before applying plan {plan.id}")
    plan.status, plan.applied_at = PlanStatus.APPLYING, func.now()
    session.flush()
    ready = session.execute(
        update(StepRow)
        .where(StepRow.plan_id == plan.id, StepRow.status == StepStatus.BLOCKED)
        .where(func.cardinality(StepRow.depends_on) == 0)
        .values(status=StepStatus.READY)
        .returning(StepRow.key, StepRow.node_id)
        .execution_options(synchronize_session=False)
    ).all()
    blocked = session.scalar(
        select(func.count()).where(StepRow.plan_id == plan.id, StepRow.status == StepStatus.BLOCKED)
    )
    names = _node_names(session)
    return AppliedPlan(
        plan.id, plan.base_version, tuple(sorted(k for k, _ in ready)), blocked or 0,
        tuple(sorted({names[n] for _, n in ready})),
    )


def apply(engine: Engine, plan_id: int | None = None, *, actor: str = "pearlctl apply") -> AppliedPlan:
    """Apply a proposed plan (the latest with `plan_id` None) in its own transaction.

    Raises StalePlan (the plan is then marked stale), PlanNotApplicable, NoPlan or NothingToApply.
    """
    with transaction(engine, actor=actor, reason=f"apply plan {plan_id or 'latest'}") as session:
        outcome = apply_in(session, plan_id)
    if isinstance(outcome, StalePlan):
        raise outcome
    return outcome


# -- progression -------------------------------------------------------------------------------------


def finish_step(
    session: Session,
    step_id: int,
    fence: int,
    status: StepStatus,
    *,
    error: str | None = None,
    now: datetime | None = None,
) -> PlanProgress:
    """An agent's report (the fenced `finish_step` query), then the plan's progression (`reconcile`).

    Raises ClaimLost when the step is not running under `fence`; nothing changes then.
    """
    if status not in (StepStatus.SUCCEEDED, StepStatus.FAILED):
        raise BadInput(f"status: a step finishes succeeded or failed, not {status}")
    lock_fleet(session)
    plan_id = session.scalar(select(StepRow.plan_id).where(StepRow.id == step_id))
    if plan_id is None:
        raise ClaimLost(f"step {step_id} does not exist")
    session.execute(select(PlanRow.id).where(PlanRow.id == plan_id).with_for_update())
    params = {"step_id": step_id, "fence": fence, "status": status.value, "error": error,
              "now": now or session.scalar(text("SELECT now()"))}
    if session.execute(query("finish_step"), params).first() is None:
        raise ClaimLost(f"step {step_id} is not running under fence {fence}: the claim expired or was taken over")
    return reconcile(session, plan_id)


def reconcile(session: Session, plan_id: int) -> PlanProgress:
    """Bring an applying plan in line with its steps (idempotent; also after claims were rescued):
    a failed step fails the plan and cancels the steps not yet run; otherwise the steps whose
    dependencies all succeeded become ready, and the plan succeeds once every step has."""
    plan = session.scalars(
        select(PlanRow).where(PlanRow.id == plan_id).with_for_update().execution_options(populate_existing=True)
    ).one()
    if plan.status is not PlanStatus.APPLYING:
        return PlanProgress(plan.id, plan.status)
    steps = session.scalars(
        select(StepRow).where(StepRow.plan_id == plan_id).order_by(StepRow.id).execution_options(populate_existing=True)
    ).all()
    failed = [s for s in steps if s.status is StepStatus.FAILED]
    if failed:
        first = failed[0]
        return _fail(session, plan, steps, f"step {first.key} ({first.action.value} on worker {first.worker_id}) "
                                           f"failed: {first.error or 'no reason given'}")
    done = {s.key for s in steps if s.status is StepStatus.SUCCEEDED}
    if len(done) == len(steps):
        plan.status, plan.finished_at = PlanStatus.SUCCEEDED, func.now()
        session.flush()
        return PlanProgress(plan.id, PlanStatus.SUCCEEDED)
    unblocked = [s.id for s in steps if s.status is StepStatus.BLOCKED and set(s.depends_on) <= done]
    if unblocked:
        session.execute(
            update(StepRow).where(StepRow.id.in_(unblocked), StepRow.status == StepStatus.BLOCKED)
            .values(status=StepStatus.READY).execution_options(synchronize_session=False)
        )
    return PlanProgress(plan.id, PlanStatus.APPLYING, readied=tuple(s.key for s in steps if s.id in set(unblocked)))


def _fail(session: Session, plan: PlanRow, steps: list[StepRow], error: str) -> PlanProgress:
    """Mark the plan failed with `error` and cancel the steps not yet run (running ones report later;
    a claim of theirs that expires is cancelled by the rescuer)."""
    plan.status, plan.finished_at, plan.error = PlanStatus.FAILED, func.now(), error
    cancel = [s for s in steps if s.status in UNFINISHED]
    if cancel:
        session.execute(
            update(StepRow).where(StepRow.id.in_([s.id for s in cancel]), StepRow.status.in_(UNFINISHED))
            .values(status=StepStatus.CANCELLED, error=f"cancelled: {plan.error}")
            .execution_options(synchronize_session=False)
        )
    # a group admitted all-or-nothing is abandoned as a whole when some member's admit did not succeed:
    # its members that already took GPUs give them back (a fully admitted group stays: it serves)
    groups = {s.expansion_group for s in steps
              if s.expansion_group and s.action is StepAction.ADMIT and s.status is not StepStatus.SUCCEEDED}
    members = {s.worker_id for s in steps if s.expansion_group in groups}
    took = {s.worker_id for s in steps if s.worker_id in members and s.action is StepAction.START
            and s.status in (StepStatus.SUCCEEDED, StepStatus.RUNNING)}
    session.flush()
    return PlanProgress(plan.id, PlanStatus.FAILED, cancelled=tuple(s.key for s in cancel), release=tuple(sorted(took)))


def abort(engine: Engine, plan_id: int, *, actor: str = "pearlctl apply --abort") -> PlanProgress:
    """Fail an applying plan that cannot finish (its agents are gone, a step hangs): its steps not
    yet run are cancelled, and the members of an expansion group not fully admitted that already took
    GPUs are listed for release, as when a step fails. Raises NoPlan or PlanNotApplicable."""
    with transaction(engine, actor=actor, reason=f"abort plan {plan_id}") as session:
        lock_fleet(session)
        plan = _plan_for_update(session, plan_id)
        if plan.status is not PlanStatus.APPLYING:
            raise PlanNotApplicable(f"plan {plan.id} is {plan.status.value}; only an applying plan can be aborted")
        steps = session.scalars(
            select(StepRow).where(StepRow.plan_id == plan.id).order_by(StepRow.id)
            .execution_options(populate_existing=True)
        ).all()
        return _fail(session, plan, list(steps), f"aborted by {actor}")


def step_counts(summary: Mapping[str, Any]) -> dict[str, int]:
    """Steps per status in a `plan_summary`."""
    return dict(Counter(s["status"] for s in summary["steps"]))


# -- reading -----------------------------------------------------------------------------------------


def _node_names(session: Session) -> dict[int, str]:
    return {node_id: name for node_id, name in session.execute(select(Node.id, Node.name))}


def plan_summary(session: Session, plan_id: int) -> dict[str, Any]:
    """A plan with its steps, as `pearlctl plan --json` and `apply --json` print it."""
    plan = session.get(PlanRow, plan_id, populate_existing=True)
    if plan is None:
        raise NoPlan(f"PLAN_ID: plan {plan_id} does not exist")
    names = _node_names(session)
    steps = session.scalars(select(StepRow).where(StepRow.plan_id == plan_id).order_by(StepRow.id)).all()
    return {
        "id": plan.id,
        "status": plan.status.value,
        "decision_id": plan.decision_id,
        "base_version": plan.base_version,
        "d_worker": plan.d_worker,
        "d_role": plan.d_role,
        "created_at": plan.created_at.isoformat() if plan.created_at else None,
        "applied_at": plan.applied_at.isoformat() if plan.applied_at else None,
        "finished_at": plan.finished_at.isoformat() if plan.finished_at else None,
        "error": plan.error,
        "steps": [
            {
                "id": s.id,
                "key": s.key,
                "action": s.action.value,
                "worker": s.worker_id,
                "node": names.get(s.node_id),
                "args": s.args,
                "after": list(s.depends_on),
                "group": s.expansion_group,
                "status": s.status.value,
                "attempts": s.attempts,
                "error": s.error,
            }
            for s in steps
        ],
    }


def wait_plan(
    engine: Engine,
    plan_id: int,
    *,
    timeout_s: float,
    poll_s: float = 0.5,
    on_poll: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Poll until the plan is no longer applying (NOTIFY is only a hint; the rows are the truth).

    Returns the final summary; raises PlanTimeout after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with transaction(engine) as session:
            summary = plan_summary(session, plan_id)
        if on_poll is not None:
            on_poll(summary)
        if summary["status"] != PlanStatus.APPLYING.value:
            return summary
        if time.monotonic() >= deadline:
            raise PlanTimeout(f"plan {plan_id} is still applying after {timeout_s:g} s "
                              f"(steps: {step_counts(summary)}); `pearlctl apply --abort {plan_id}` gives it up")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
