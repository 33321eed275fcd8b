"""The plan store: decisions, plans and their steps as rows; applying a plan; the steps' progression.

Lifecycle of a plan (`PlanStatus`; the allowed edges are the rows of `plan_transitions`, a trigger
refuses any other):
  proposed  --apply, fleet still at base_version-->  applying  --every step succeeded-->  succeeded
  proposed  --apply, fleet moved on-->  stale          applying  --a step failed, or abort-->  failed
  proposed  --a newer plan is written-->  superseded
A plan is refused when written if it could never finish: a step waiting for a key the plan does not
have (or, through a cycle, for itself), or a step addressed to a node its worker does not live on.

Steps (`StepStatus`; edges in `step_transitions`): written `blocked` with `pending` = how many steps
they wait for (one `plan_step_deps` row each); on apply those with none become `ready` (the NOTIFY
trigger wakes their node's agent: channel `pearl_steps_<node id>`, payload the node id); an agent claims one
(`claim_steps`, only steps of the applying plan), enacts it, and reports through `finish_step` in the
same transaction as the end of its effect (`step_effects`): a step succeeds exactly when its effect
is in the rows, under the claim's fence. A success decrements the pending count of its dependents
only (`release_dependents`): those at zero become ready, a `barrier` succeeds at once (it is how an
expansion group meets: invariant 6), and the plan succeeds when no step is left unfinished. A
failure fails the plan: its steps not yet run are cancelled (a running one stops when its agent
renews its lease and sees the plan is no longer applying, or is cancelled by the rescuer when its
claim expires), and a cleanup plan, applied in the same transaction, drains and releases every
worker the failed plan left between states (a member of an expansion group not fully admitted gives
its GPUs back, even if already admitted). A cleanup plan that fails writes no further cleanup.

Concurrency. Whole-fleet writers (applies, aborts, amendments, failures, the reaper) take the whole
fleet first (`transitions.lock_fleet`), then the plan row, then steps. A report that succeeds (or is
cancelled) and the effect it lands with take only the step's node (`transitions.lock_node`, in
`step_effects.claimed_step`), then the step, then the dependents they release: reports of different
nodes run at once, and none runs beside a whole-fleet writer, so a plan cannot fail under a report.
The plan row is locked by a report only to finish the plan (`_finish_if_done`); a report of the
plan's tail also concludes after its commit (`conclude`), so of the last reports at once, which see
each other's steps still running, one finishes it. Claims take no fleet lock; they skip rows that
are locked (`SKIP LOCKED`), so a claim never waits. They read the plan row under a key-share lock,
which a report finishing the plan (FOR NO KEY UPDATE) passes, and failing a plan takes it FOR
UPDATE, which claims skip, so a claim never takes a step of a plan being failed. Every change of
plans and plan_steps is written to `events` by triggers (invariant 5).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from graphlib import CycleError, TopologicalSorter
from typing import Any

from pearl.controlplane.core import fleet
from pearl.controlplane.core.domain import Activity, PlanStatus, StepAction, StepStatus
from pearl.controlplane.errors import BadInput, PearlError, StalePlan
from pearl.controlplane.store import signals, step_effects
from pearl.controlplane.store.db import after_commit, transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import Decision, Node, PlanStepDep, Worker
from pearl.controlplane.store.schema import Plan as PlanRow
from pearl.controlplane.store.schema import PlanStep as StepRow
from pearl.controlplane.store.transitions import lock_fleet, lock_node
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session

log = logging.getLogger("pearl.plans")

UNFINISHED = (StepStatus.BLOCKED, StepStatus.READY)  # cancelled when the plan fails (running ones stop)
# Steps that keep an applying plan from succeeding (a step cancelled by `amend_release` does not: the
# amendment replaced it).
NOT_DONE = (StepStatus.BLOCKED, StepStatus.READY, StepStatus.RUNNING, StepStatus.FAILED)


class NoPlan(BadInput):
    """There is no such plan."""


class NothingToApply(PearlError):
    """No proposed plan: run `pearlctl plan` first."""


class PlanNotApplicable(PearlError):
    """The plan cannot be applied in its status."""


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
    readied: tuple[str, ...] = ()  # steps made ready by this call (barriers that succeeded included)
    cancelled: tuple[str, ...] = ()  # steps cancelled by this call
    release: tuple[int, ...] = ()  # workers the cleanup plan drains and releases
    cleanup: int | None = None  # the cleanup plan written when this call failed the plan


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
        "warm_up": sorted(target.warm_up),
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
    row = PlanRow(decision_id=decision_id, base_version=plan.base_version, d_worker=plan.d_worker, d_role=plan.d_role)
    _insert(session, row, plan.steps)
    session.execute(
        update(PlanRow)
        .where(PlanRow.status == PlanStatus.PROPOSED, PlanRow.id != row.id)
        .values(status=PlanStatus.SUPERSEDED, finished_at=func.now(), error=f"superseded by plan {row.id}")
        .execution_options(synchronize_session=False)
    )
    return row.id


def _insert(session: Session, row: PlanRow, steps: tuple[fleet.PlanStep, ...]) -> None:
    """The plan row, its steps (`pending` = how many steps each waits for) and one dependency row per edge."""
    session.add(row)
    session.flush()
    _insert_steps(session, row, steps, {})


def _insert_steps(session: Session, row: PlanRow, steps: tuple[fleet.PlanStep, ...], existing: dict[str, int]) -> None:
    """Steps of plan `row`, which may wait for its `existing` steps (key -> id) as well as for each other;
    `pending` counts the dependencies not yet succeeded."""
    nodes = {name: node_id for name, node_id in session.execute(select(Node.name, Node.id))}
    missing = sorted({s.node for s in steps} - nodes.keys())
    if missing:
        raise BadInput(f"plan.steps.node: unknown node(s) {missing}")
    _check_steps(steps, {w: n for w, n in session.execute(select(Worker.id, Worker.node_id))}, nodes,
                 set(existing))
    done = set(session.scalars(select(StepRow.key).where(
        StepRow.plan_id == row.id, StepRow.status == StepStatus.SUCCEEDED))) if existing else set()
    # Ids taken from the sequence first, in the steps' order, so that the steps and their edges go in
    # by COPY (a 4,096-GPU switch is 12,290 steps and 14,336 edges); the rows' triggers fire as for an
    # INSERT (the audit log, the wake-up of agents).
    taken = sorted(session.scalars(text(
        "SELECT nextval(pg_get_serial_sequence('plan_steps', 'id')) FROM generate_series(1, :n)"), {"n": len(steps)}))
    ids = {s.key: taken[i] for i, s in enumerate(steps)}
    every = {**existing, **ids}
    cursor = session.connection().connection.driver_connection.cursor()
    with cursor.copy("COPY plan_steps (id, plan_id, key, worker_id, node_id, action, args, expansion_group, "
                     "depends_on, pending, status) FROM STDIN") as copy:
        for s in steps:
            copy.write_row((ids[s.key], row.id, s.key, s.worker_id, nodes[s.node], str(s.action),
                            json.dumps(json_safe(dict(s.args))), f"plan{row.id}.{s.group}" if s.group else None,
                            list(s.after), len(set(s.after) - done), str(StepStatus.BLOCKED)))
    with cursor.copy("COPY plan_step_deps (step_id, after_id) FROM STDIN") as copy:
        for s in steps:
            for k in dict.fromkeys(s.after):
                copy.write_row((ids[s.key], every[k]))


def _check_steps(steps: tuple[fleet.PlanStep, ...], worker_nodes: dict[int, int], nodes: dict[str, int],
                 existing: set[str] | None = None) -> None:
    """Refuse a plan that could never finish: a step waiting for a key the plan does not have, or
    for itself through a cycle, or addressed to a node its worker does not live on."""
    keys = {s.key for s in steps} | (existing or set())
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
        raise PlanNotApplicable(f"plan {other} is still applying, so plan {plan.id} cannot: watch plan {other} "
                                f"finish with `pearlctl status --watch` (or give it up with `pearlctl apply --abort "
                                f"{other}`), then run `pearlctl plan` again (plan {plan.id} will be stale by then)")
    plan.status, plan.applied_at = PlanStatus.APPLYING, func.now()
    session.flush()
    free = session.scalars(select(StepRow.id).where(
        StepRow.plan_id == plan.id, StepRow.status == StepStatus.BLOCKED, StepRow.pending == 0)).all()
    ready = _settle(session, list(free))
    blocked = session.scalar(
        select(func.count()).where(StepRow.plan_id == plan.id, StepRow.status == StepStatus.BLOCKED)
    )
    names = _node_names(session)
    nodes = session.execute(select(StepRow.key, StepRow.node_id).where(StepRow.key.in_(ready),
                                                                        StepRow.plan_id == plan.id)).all()
    _finish_if_done(session, plan)
    return AppliedPlan(plan.id, plan.base_version, tuple(sorted(ready)), blocked or 0,
                       tuple(sorted({names[n] for _, n in nodes})))


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


def _settle(session: Session, step_ids: list[int]) -> list[str]:
    """Steps whose dependencies all succeeded: each becomes ready, or, a barrier, succeeds at once
    (and its own dependents follow). Returns the keys settled."""
    keys: list[str] = []
    queue = list(step_ids)
    while queue:
        rows = session.execute(
            update(StepRow).where(StepRow.id.in_(queue), StepRow.status == StepStatus.BLOCKED, StepRow.pending == 0,
                                  StepRow.action != StepAction.BARRIER)
            .values(status=StepStatus.READY).returning(StepRow.key).execution_options(synchronize_session=False)
        ).scalars().all()
        keys.extend(rows)
        barriers = session.execute(
            update(StepRow).where(StepRow.id.in_(queue), StepRow.status == StepStatus.BLOCKED, StepRow.pending == 0,
                                  StepRow.action == StepAction.BARRIER)
            .values(status=StepStatus.SUCCEEDED, finished_at=func.now(), started_at=func.now())
            .returning(StepRow.id, StepRow.key).execution_options(synchronize_session=False)
        ).all()
        queue = []
        for barrier_id, key in barriers:
            keys.append(key)
            queue.extend(_dependents_free(session, barrier_id))
    return keys


def _dependents_free(session: Session, step_id: int) -> list[int]:
    """One dependency fewer for each step waiting on `step_id`; the ids of those left with none."""
    return [r.id for r in session.execute(query("release_dependents"), {"step_id": step_id}) if r.pending == 0]


def _finish_if_done(session: Session, plan: PlanRow) -> bool:
    """An applying plan with no step left unfinished succeeds (an index probe, not a scan). The plan
    row is locked only then, and the probe made again under it: of two reports finishing it at once,
    the second waits and then sees it finished."""
    def left() -> bool:
        return session.scalar(select(StepRow.id).where(StepRow.plan_id == plan.id, StepRow.status.in_(NOT_DONE))
                              .limit(1)) is not None

    if plan.status is not PlanStatus.APPLYING or left():
        return False
    if _locked_plan(session, plan.id).status is not PlanStatus.APPLYING or left():
        return False
    plan.status, plan.finished_at = PlanStatus.SUCCEEDED, func.now()
    session.flush()
    return True


def _locked_plan(session: Session, plan_id: int) -> PlanRow:
    """The plan row, locked against other writers but not against claims (FOR NO KEY UPDATE)."""
    return session.scalars(
        select(PlanRow).where(PlanRow.id == plan_id).with_for_update(key_share=True)
        .execution_options(populate_existing=True)
    ).one()


def claim_steps(session: Session, node_id: int, agent_id: int | None, *, lease_s: float, limit: int,
                busy: Collection[int] = ()) -> list[dict[str, Any]]:
    """Claim up to `limit` ready steps of a node (`claim_steps` in queries.sql): at most one per worker,
    none of a `busy` worker (one its agent is still at work on), each with a lease and a fresh fence."""
    rows = session.execute(query("claim_steps"), {"node_id": node_id, "agent_id": agent_id, "lease_s": lease_s,
                                                  "limit": limit, "busy": sorted(busy)}).mappings().all()
    return [dict(r) for r in rows]


def finish_step(
    session: Session,
    step_id: int,
    fence: int,
    status: StepStatus,
    *,
    error: str | None = None,
) -> PlanProgress:
    """An agent's report under its claim, then the plan's progression (its dependents only).

    `succeeded` only when the step's effect is in the rows (`step_effects.effect_missing`; write it
    with `complete_step`) and the plan still applies; `failed` fails the plan; `cancelled` only once
    the plan stopped applying (the agent stopped the step). Raises ClaimLost when the step is not
    running under `fence` (nothing changes), PlanStopped for a success after the plan stopped,
    EffectMissing for a success without its effect.
    """
    if status not in (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.CANCELLED):
        raise BadInput(f"status: a step finishes succeeded, failed or cancelled, not {status}")
    if status is StepStatus.FAILED:
        lock_fleet(session)  # it fails the plan: the whole fleet (else only the step's node, in claimed_step)
    step = step_effects.claimed_step(session, step_id, fence, applying=status is StepStatus.SUCCEEDED)
    plan = (_locked_plan(session, step.plan_id) if status is StepStatus.FAILED
            else session.get(PlanRow, step.plan_id, populate_existing=True))  # it cannot fail meanwhile
    assert plan is not None
    if status is StepStatus.CANCELLED and plan.status is PlanStatus.APPLYING:
        raise BadInput(f"status: step {step.key} cannot be cancelled while plan {plan.id} applies; report it "
                       "failed")
    if status is StepStatus.SUCCEEDED:
        missing = step_effects.effect_missing(session, step)
        if missing:
            raise step_effects.EffectMissing(f"step {step.key} ({step.action}) cannot succeed: {missing}")
    session.execute(query("finish_step"), {"step_id": step_id, "fence": fence, "status": status.value,
                                           "error": error})
    if status is StepStatus.FAILED:
        if plan.status is not PlanStatus.APPLYING:
            return PlanProgress(plan.id, plan.status)
        return _fail(session, plan, f"step {step.key} ({step.action.value} on worker {step.worker_id}) "
                                    f"failed: {error or 'no reason given'}")
    if status is StepStatus.CANCELLED:
        return PlanProgress(plan.id, plan.status)
    readied = _settle(session, _dependents_free(session, step_id))
    if not _finish_if_done(session, plan) and plan.status is PlanStatus.APPLYING and not session.scalar(
            select(StepRow.id).where(StepRow.plan_id == plan.id, StepRow.status.in_(UNFINISHED)).limit(1)):
        after_commit(session, lambda engine: conclude(engine, plan.id, step.node_id))
    return PlanProgress(plan.id, plan.status, readied=tuple(readied))


def conclude(engine: Engine, plan_id: int, node_id: int) -> bool:
    """After a report of the plan's tail committed (no step left blocked or ready, some still running
    or being reported): the plan succeeds if no step is left. Reports of different nodes run at once,
    so the last two may each see the other's step still running inside their transactions; each then
    concludes after its commit, waiting for the reports in flight (their steps' row locks), and the
    later one sees both. A conclusion that does not happen (the process died, the database was away)
    is the reaper's (`reconcile`). Whether the plan succeeded here."""
    try:
        with transaction(engine, reason=f"conclude plan {plan_id}") as session:
            lock_node(session, node_id)  # no plan amended or failed meanwhile
            session.execute(select(StepRow.id).where(StepRow.plan_id == plan_id, StepRow.status.in_(NOT_DONE))
                            .order_by(StepRow.id).with_for_update())  # waits for the reports in flight
            plan = session.get(PlanRow, plan_id, populate_existing=True)
            return plan is not None and plan.status is PlanStatus.APPLYING and _finish_if_done(session, plan)
    except PearlError as exc:
        log.warning("plan %s: not concluded (%s); the reaper will", plan_id, exc)
        return False


def complete_step(session: Session, step_id: int, fence: int, **effect: Any) -> PlanProgress:
    """The end of the step's effect (`step_effects.end`, e.g. `endpoint=` for a start) and its
    success, in the caller's transaction: both land, or neither."""
    step = step_effects.claimed_step(session, step_id, fence)
    step_effects.end(session, step, **effect)
    return finish_step(session, step_id, fence, StepStatus.SUCCEEDED)


def reconcile(session: Session, plan_id: int) -> PlanProgress:
    """Bring an applying plan in line with its steps (idempotent; the reaper runs it after rescuing
    claims): a failed step fails the plan; steps whose dependencies all succeeded settle; the plan
    succeeds once every step has."""
    lock_fleet(session)
    plan = _locked_plan(session, plan_id)
    if plan.status is not PlanStatus.APPLYING:
        return PlanProgress(plan.id, plan.status)
    failed = session.scalars(select(StepRow).where(StepRow.plan_id == plan_id, StepRow.status == StepStatus.FAILED)
                             .order_by(StepRow.id).limit(1)).first()
    if failed is not None:
        return _fail(session, plan, f"step {failed.key} ({failed.action.value} on worker {failed.worker_id}) "
                                    f"failed: {failed.error or 'no reason given'}")
    free = session.scalars(select(StepRow.id).where(
        StepRow.plan_id == plan_id, StepRow.status == StepStatus.BLOCKED, StepRow.pending == 0)).all()
    readied = _settle(session, list(free))
    _finish_if_done(session, plan)
    return PlanProgress(plan.id, plan.status, readied=tuple(readied))


def _fail(session: Session, plan: PlanRow, error: str) -> PlanProgress:
    """Fail the plan with `error`, cancel its steps not yet run, and (unless it is itself a cleanup)
    write and apply the cleanup plan of the workers it left between states."""
    # FOR UPDATE: claims skip the plan from here on (a report's lock lets them pass); waits for the
    # claims in flight, whose steps are then running and stop when their agents renew
    session.execute(select(PlanRow.id).where(PlanRow.id == plan.id).with_for_update())
    plan.status, plan.finished_at, plan.error = PlanStatus.FAILED, func.now(), error
    session.flush()
    cancelled = session.execute(
        update(StepRow).where(StepRow.plan_id == plan.id, StepRow.status.in_(UNFINISHED))
        .values(status=StepStatus.CANCELLED, error=f"cancelled: {error}", finished_at=func.now())
        .returning(StepRow.key).execution_options(synchronize_session=False)
    ).scalars().all()
    release = () if plan.cleans_up is not None else _left_between_states(session, plan.id)
    cleanup = _write_cleanup(session, plan.id, release) if release else None
    return PlanProgress(plan.id, PlanStatus.FAILED, cancelled=tuple(sorted(cancelled)), release=release,
                        cleanup=cleanup)


def _left_between_states(session: Session, plan_id: int) -> tuple[int, ...]:
    """Workers a failed plan leaves to clean up: every worker of its steps that is transitioning, and
    every member of an expansion group whose admits did not all succeed (all-or-nothing, invariant 6)."""
    touched = set(session.scalars(select(StepRow.worker_id).where(StepRow.plan_id == plan_id)))
    transitioning = set(session.scalars(select(Worker.id).where(Worker.id.in_(touched),
                                                                Worker.activity == Activity.TRANSITIONING)))
    groups = set(session.scalars(select(StepRow.expansion_group).where(
        StepRow.plan_id == plan_id, StepRow.action == StepAction.ADMIT, StepRow.status != StepStatus.SUCCEEDED,
        StepRow.expansion_group.is_not(None))))
    members = set(session.scalars(select(StepRow.worker_id).where(
        StepRow.plan_id == plan_id, StepRow.expansion_group.in_(groups)))) if groups else set()
    serving = set(session.scalars(select(Worker.id).where(Worker.id.in_(members),
                                                          Worker.activity != Activity.INACTIVE)))
    return tuple(sorted(transitioning | serving))


def _write_cleanup(session: Session, failed_id: int, workers: tuple[int, ...]) -> int:
    """A plan, applying at once, that drains (if serving), interrupts and releases `workers`."""
    rows = session.execute(select(Worker.id, Worker.activity, Worker.zone, Node.name)
                           .join(Node, Node.id == Worker.node_id).where(Worker.id.in_(workers))).all()
    steps: list[fleet.PlanStep] = []
    for wid, activity, zone, node in sorted(rows):
        after: tuple[str, ...] = ()
        if activity is Activity.ACTIVE:
            steps.append(fleet.PlanStep(f"w{wid}.drain", StepAction.DRAIN, wid, node))
            after = (f"w{wid}.drain",)
        steps.append(fleet.PlanStep(f"w{wid}.interrupt", StepAction.INTERRUPT, wid, node, {"keep_partials": True},
                                    after))
        steps.append(fleet.PlanStep(f"w{wid}.release", StepAction.RELEASE, wid, node, {"zone": str(zone)},
                                    (f"w{wid}.interrupt",)))
    version = lock_fleet(session)
    row = PlanRow(base_version=version, status=PlanStatus.APPLYING, applied_at=func.now(), cleans_up=failed_id,
                  d_worker=len(rows), d_role=0)
    _insert(session, row, tuple(steps))
    _settle(session, list(session.scalars(select(StepRow.id).where(
        StepRow.plan_id == row.id, StepRow.status == StepStatus.BLOCKED, StepRow.pending == 0))))
    return row.id


@dataclass(frozen=True)
class Amendment:
    """What `amend_release` changed in an applying plan."""

    plan_id: int
    release: tuple[int, ...]  # workers the amendment drains and releases
    cancelled: tuple[str, ...]  # steps it cancelled (never run)
    added: tuple[str, ...]  # the steps it added


def amend_release(session: Session, plan_id: int, workers: set[int], reason: str) -> Amendment:
    """Release `workers` now, inside the applying plan, instead of aborting it (shrinking is urgent:
    borrowed GPUs the trainer wants back, GPUs under a revocation notice).

    Their steps not yet run are cancelled; an expansion group one of them belongs to can no longer be
    admitted as a whole, so its barrier and admits are cancelled and its other members are released
    too (all-or-nothing, invariant 6); so is every step that waited, directly or not, for a
    cancelled one. Each released worker gets a drain -> interrupt -> release chain, after its step
    still running (a start finishes, then gives its GPUs back). The rest of the plan goes on."""
    lock_fleet(session)
    plan = _locked_plan(session, plan_id)
    if plan.status is not PlanStatus.APPLYING:
        raise PlanNotApplicable(f"plan {plan_id} is {plan.status.value}; only an applying plan is amended")
    steps = session.scalars(select(StepRow).where(StepRow.plan_id == plan_id).order_by(StepRow.id)
                            .execution_options(populate_existing=True)).all()
    release = set(workers)
    admitted = {s.expansion_group: s.status is StepStatus.SUCCEEDED for s in steps if s.action is StepAction.ADMIT}
    groups = {s.expansion_group for s in steps if s.worker_id in release and s.expansion_group
              and not all(ok for g, ok in admitted.items() if g == s.expansion_group)}
    release |= {s.worker_id for s in steps if s.expansion_group in groups}
    doomed = {s.id for s in steps if s.status in UNFINISHED and (s.worker_id in release or s.expansion_group in groups)}
    frontier = list(doomed)
    while frontier:  # whatever waited for a cancelled step would wait for ever
        frontier = [d for d in session.scalars(select(PlanStepDep.step_id).where(PlanStepDep.after_id.in_(frontier)))
                    if d not in doomed]
        doomed |= set(frontier)
    cancelled = session.execute(
        update(StepRow).where(StepRow.id.in_(doomed), StepRow.status.in_(UNFINISHED))
        .values(status=StepStatus.CANCELLED, error=f"cancelled: {reason}", finished_at=func.now())
        .returning(StepRow.key).execution_options(synchronize_session=False)
    ).scalars().all()
    running = {s.worker_id: s.key for s in steps if s.status is StepStatus.RUNNING}
    rows = session.execute(select(Worker.id, Worker.activity, Worker.zone, Node.name)
                           .join(Node, Node.id == Worker.node_id).where(Worker.id.in_(release))).all()
    n = sum(1 for s in steps if ".amend" in s.key) + 1
    added: list[fleet.PlanStep] = []
    for wid, activity, zone, node in sorted(rows):
        if activity is Activity.INACTIVE and wid not in running:
            continue  # it never took its GPUs: nothing to give back
        keys = [f"w{wid}.{a}.amend{n}" for a in ("drain", "interrupt", "release")]
        first_after = (running[wid],) if wid in running else ()
        added += [fleet.PlanStep(keys[0], StepAction.DRAIN, wid, node, {}, first_after),
                  fleet.PlanStep(keys[1], StepAction.INTERRUPT, wid, node, {"keep_partials": True}, (keys[0],)),
                  fleet.PlanStep(keys[2], StepAction.RELEASE, wid, node, {"zone": str(zone)}, (keys[1],))]
    if added:
        _insert_steps(session, plan, tuple(added), {s.key: s.id for s in steps})
        free = session.scalars(select(StepRow.id).where(
            StepRow.plan_id == plan_id, StepRow.status == StepStatus.BLOCKED, StepRow.pending == 0)).all()
        _settle(session, list(free))
    _finish_if_done(session, plan)  # what it cancelled may have been all that was left
    signals.start_training_if_returned(session)  # a training step waiting for a cancelled start begins
    return Amendment(plan_id, tuple(sorted(r[0] for r in rows)), tuple(sorted(cancelled)),
                     tuple(s.key for s in added))


def call_off_borrowing(session: Session, reason: str) -> Amendment | None:
    """The trainer wants its GPUs: the servers an applying plan is still to start on them are not
    started (their steps are cancelled; one under way finishes, then gives the GPUs back), in the
    transaction of the trainer's request. Otherwise the training step could start on GPUs a start then
    finds taken, failing the plan. None when no such start is left."""
    lock_fleet(session)
    overtaken = signals.borrowing_under_way(session)
    if not overtaken:
        return None
    plan_id = session.scalar(select(PlanRow.id).where(PlanRow.status == PlanStatus.APPLYING))
    return amend_release(session, plan_id, set(overtaken), reason)


def abort(engine: Engine, plan_id: int, *, actor: str = "pearlctl apply --abort") -> PlanProgress:
    """Fail an applying plan that cannot finish (its agents are gone, a step hangs): its steps not
    yet run are cancelled and a cleanup plan releases the workers it left between states, as when a
    step fails. Raises NoPlan or PlanNotApplicable."""
    with transaction(engine, actor=actor, reason=f"abort plan {plan_id}") as session:
        lock_fleet(session)
        plan = _plan_for_update(session, plan_id)
        if plan.status is not PlanStatus.APPLYING:
            raise PlanNotApplicable(f"plan {plan.id} is {plan.status.value}; only an applying plan can be aborted")
        return _fail(session, plan, f"aborted by {actor}")


def step_counts(summary: Mapping[str, Any]) -> dict[str, int]:
    """Steps per status in a `plan_summary`."""
    return dict(Counter(s["status"] for s in summary["steps"]))


# -- reading -----------------------------------------------------------------------------------------


def _node_names(session: Session) -> dict[int, str]:
    return {node_id: name for node_id, name in session.execute(select(Node.id, Node.name))}


def applying_plan(engine: Engine) -> int | None:
    """The id of the plan now applying, if one is (there is at most one)."""
    with transaction(engine) as session:
        return session.scalar(select(PlanRow.id).where(PlanRow.status == PlanStatus.APPLYING))


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
