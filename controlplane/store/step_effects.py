"""What each plan step changes in the rows, written only under the claim that runs it.

A step's effect and its report are fenced by the claim (docs/state-machine.md, invariant 4): every
write here first locks the step (`claimed_step`: running under the caller's fencing token, its plan
applying and share-locked), and stamps the worker with the token (`workers.last_fence`, which a
trigger never lets go down). An agent whose claim was rescued, or whose plan failed or was aborted,
changes nothing: `ClaimLost` / `PlanStopped`.

Each action's effect has up to two parts: `begin` (before the server is touched: a start takes its
GPUs first, so no two servers ever share a GPU; a drain takes the worker out of service; a release
marks its GPUs draining) and `end` (written with the report in one transaction: the endpoint, the
weights version, the admission, the new role, the front door's mode). Both are idempotent: a second
run after a rescue finds the rows already changed and changes nothing. `effect_missing` says what
the rows lack for the step to count as done; `plan_store.finish_step` refuses a success without it.

  action        begin (before the server)         end (with the report)          done when the rows show
  drain         active -> transitioning           -                              not active
  interrupt     -                                 -                              not active
  release       its GPUs -> draining              GPUs free, worker inactive     inactive, holding no GPU
  start         inactive -> transitioning, GPUs   the server's endpoint (launched?) transitioning in role, endpoint
  load_weights  -                                 weights_version (never down)   at the trainer's version
  admit         -                                 transitioning -> active        active in its role
  flip_role     -                                 role                           in the new role
  router_sync   -                                 routers.mode                   every live front door in mode
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pearl.controlplane.core.domain import Activity, GPUState, PlanStatus, Role, StepAction, WorkerZone
from pearl.controlplane.errors import BadInput, ClaimLost, PearlError
from pearl.controlplane.store import signals, transitions
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import GPU, PlanStep, Router, TrainingStep, Worker
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session


class PlanStopped(ClaimLost):
    """The step's plan is no longer applying (it failed or was aborted): the step must stop."""


class EffectMissing(PearlError):
    """A step cannot succeed: its effect is not in the rows."""


@dataclass(frozen=True)
class ClaimedStep:
    """A running step, as the claim that holds it sees it."""

    id: int
    plan_id: int
    key: str
    worker_id: int
    node_id: int
    action: StepAction
    args: dict[str, Any]
    group: str | None
    fence: int


def claimed_step(session: Session, step_id: int, fence: int, *, applying: bool = True) -> ClaimedStep:
    """Lock the step for this transaction; raise ClaimLost unless it runs under `fence`, and
    PlanStopped when `applying` is asked and its plan no longer applies. Takes the step's node first
    (`transitions.lock_node`; a transaction holding the whole fleet keeps it), then the step: a plan
    fails only under the whole fleet, so it cannot fail before this transaction ends."""
    node = session.scalar(select(PlanStep.node_id).where(PlanStep.id == step_id))
    if node is None:
        raise ClaimLost(f"step {step_id} does not exist")
    transitions.lock_node(session, node)
    row = session.execute(query("claimed_step"), {"step_id": step_id, "fence": fence}).mappings().first()
    if row is None:
        raise ClaimLost(f"step {step_id} is not running under fence {fence}: the claim expired or was taken over")
    if applying and row["plan_status"] != PlanStatus.APPLYING.value:
        raise PlanStopped(f"step {row['key']} (plan {row['plan_id']}): the plan is {row['plan_status']}; "
                          "the step stops")
    return ClaimedStep(row["id"], row["plan_id"], row["key"], row["worker_id"], row["node_id"],
                       StepAction(row["action"]), dict(row["args"] or {}), row["expansion_group"], row["fence"])


def claim_state(session: Session, step_id: int, fence: int) -> str | None:
    """None while the claim under `fence` still drives the step and its worker and its plan applies;
    else "claim" or "plan", what stopped it (no lock; `claim_state` in queries.sql)."""
    row = session.execute(query("claim_state"), {"step_id": step_id, "fence": fence}).first()
    if row is None or not row.claim_holds:
        return "claim"
    return None if row.plan_applies else "plan"


def _stamp(session: Session, step: ClaimedStep) -> None:
    """The worker was last changed under this claim (the trigger refuses an older fence)."""
    session.execute(update(Worker).where(Worker.id == step.worker_id).values(last_fence=step.fence)
                    .execution_options(synchronize_session=False))


def _worker(session: Session, worker_id: int) -> Worker:
    return session.scalars(select(Worker).where(Worker.id == worker_id).execution_options(populate_existing=True)).one()


def trainer_version(session: Session) -> int:
    """The newest weights version the trainer has produced (0: the initial weights)."""
    return session.scalar(select(func.coalesce(func.max(TrainingStep.weights_version), 0))) or 0


def begin(session: Session, step: ClaimedStep) -> None:
    """The part of the step's effect written before the server is touched (idempotent)."""
    transitions.hold(session)
    w = _worker(session, step.worker_id)
    if step.action is StepAction.DRAIN:
        if w.activity is Activity.ACTIVE:
            transitions.set_activity(session, w.id, Activity.ACTIVE, Activity.TRANSITIONING)
    elif step.action is StepAction.RELEASE:
        if w.activity is Activity.ACTIVE:
            transitions.set_activity(session, w.id, Activity.ACTIVE, Activity.TRANSITIONING)
        if w.activity is not Activity.INACTIVE:
            transitions.begin_release(session, w.id)
    elif step.action is StepAction.START:
        role = Role(step.args["role"])
        if w.activity is Activity.INACTIVE:
            transitions.start_worker(session, w.id, role)
            if w.zone is WorkerZone.OVERLAP:
                signals.open_borrow_leases(session, w.id)
        elif w.role is not role or w.activity is not Activity.TRANSITIONING:
            raise EffectMissing(f"step {step.key}: worker {w.id} is {w.activity} as {w.role}, cannot start as {role}")
    else:
        return
    _stamp(session, step)


def end(session: Session, step: ClaimedStep, *, endpoint: str | None = None,
        weights_version: int | None = None, cold: bool = False) -> None:
    """The rest of the step's effect, written with its report (idempotent)."""
    transitions.hold(session)
    w = _worker(session, step.worker_id)
    a = step.action
    if a is StepAction.RELEASE:
        if w.activity is not Activity.INACTIVE:
            transitions.finish_release(session, w.id)
            if w.zone is WorkerZone.OVERLAP:
                signals.borrowed_worker_returned(session, w.id, step.plan_id)
    elif a is StepAction.START:
        if endpoint is None:
            raise BadInput(f"step {step.key}: a start reports the server's endpoint")
        if w.endpoint != endpoint:
            session.execute(update(Worker).where(Worker.id == w.id).values(endpoint=endpoint)
                            .execution_options(synchronize_session=False))
        if cold and w.zone is WorkerZone.OVERLAP:  # a launch, not a wake-up: this loan is not a toggle
            signals.borrowed_worker_launched(session, w.id)
    elif a is StepAction.LOAD_WEIGHTS:
        if weights_version is None:
            raise BadInput(f"step {step.key}: a load_weights reports the version loaded")
        transitions.set_weights_version(session, w.id, weights_version)
    elif a is StepAction.ADMIT:
        if w.activity is Activity.TRANSITIONING:
            transitions.set_activity(session, w.id, Activity.TRANSITIONING, Activity.ACTIVE)
            if w.zone is WorkerZone.OVERLAP:
                signals.borrowed_worker_admitted(session, w.id)
    elif a is StepAction.FLIP_ROLE:
        role = Role(step.args["role"])
        if w.role is not role:
            transitions.set_role(session, w.id, role)
        if endpoint is not None and w.endpoint != endpoint:  # refused in place, restarted in the new role
            session.execute(update(Worker).where(Worker.id == w.id).values(endpoint=endpoint)
                            .execution_options(synchronize_session=False))
    elif a is StepAction.ROUTER_SYNC:
        session.execute(update(Router).where(Router.stopped_at.is_(None)).values(mode=step.args["mode"])
                        .execution_options(synchronize_session=False))
    else:
        return
    _stamp(session, step)


def effect_missing(session: Session, step: ClaimedStep) -> str | None:
    """Why the rows do not (yet) show the step's effect, or None when they do."""
    w = _worker(session, step.worker_id)
    a = step.action
    held = session.scalar(select(func.count()).where(GPU.worker_id == w.id)) or 0
    if a in (StepAction.DRAIN, StepAction.INTERRUPT) and w.activity is Activity.ACTIVE:
        return f"worker {w.id} is still active (a {a} takes it out of service)"
    if a is StepAction.RELEASE and (w.activity is not Activity.INACTIVE or held):
        return f"worker {w.id} is {w.activity} holding {held} GPU(s) (a release leaves it inactive, holding none)"
    if a is StepAction.START:
        role = Role(step.args["role"])
        if w.activity is not Activity.TRANSITIONING or w.role is not role or not w.endpoint:
            return (f"worker {w.id} is {w.activity} as {w.role} with endpoint {w.endpoint} (a start leaves it "
                    f"transitioning as {role} with its server's endpoint)")
    if a is StepAction.LOAD_WEIGHTS:
        wanted = trainer_version(session)
        if w.weights_version < wanted:
            return f"worker {w.id} has weights version {w.weights_version}, the trainer is at {wanted}"
    if a is StepAction.ADMIT:
        role = Role(step.args["role"])
        if w.activity is not Activity.ACTIVE or w.role is not role:
            return f"worker {w.id} is {w.activity} as {w.role} (an admit leaves it active as {role})"
    if a is StepAction.FLIP_ROLE and w.role is not Role(step.args["role"]):
        return f"worker {w.id} is {w.role} (a flip makes it {step.args['role']})"
    if a is StepAction.ROUTER_SYNC:
        modes = set(session.scalars(select(Router.mode).where(Router.stopped_at.is_(None))))
        if modes - {step.args["mode"]}:
            return f"the front door serves {sorted(m or 'no mode' for m in modes)}, not {step.args['mode']}"
    return None


def gpus_of(session: Session, worker_id: int) -> list[tuple[int, int, GPUState]]:
    """(gpu id, device index, state) of the worker's slot, by device index."""
    return [tuple(r) for r in session.execute(
        select(GPU.id, GPU.device_index, GPU.state).where(GPU.slot_id == worker_id).order_by(GPU.device_index))]
