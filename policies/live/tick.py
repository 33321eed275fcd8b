"""One policy pass for cron or the loop: observe -> decide -> plan -> apply what policy allows.

Safe at any rate and with several copies at once:
- leadership: a pass runs only while its holder holds the `policy` leader lease (a `pearlctl loop`
  leading elsewhere turns a cron `pearlctl tick` into a no-op; a cron tick holds the lease only for
  its pass);
- one pass per observed state: the pass first records a `ticks` row keyed by the fleet's
  state_version and a digest of the signals it will decide on; a second pass on the same state
  finds the key taken and plans nothing, unless the pass that took it decided nothing (it failed,
  its plan could not be applied, or it never finished within a leader lease: killed, the database
  lost): then the key is taken over and the state decided again;
- the plan write itself refuses a fleet that moved or a policy memory another pass wrote meanwhile
  (`policy_pass.write_planned`: StalePlan), so two passes never plan on one state.

Each pass first runs the reaper (deadlines, rescues, a training step whose GPUs are back), then:
- while a plan applies, it waits for it, unless a worker must give its GPUs back now and the plan
  does not release it: GPUs the trainer wants back, GPUs under a revocation notice, or a worker the
  policy no longer holds (the tail of a step: borrowed GPUs go back before it ends). Then the
  applying plan is amended (`plan_store.amend_release`): those workers (and the rest of an expansion
  group one of them belongs to) are drained and released within it at once, while the rest of the
  plan goes on. Growing waits for the plan.
- otherwise it decides (the PEARL policy, the same code the simulator runs) and writes the plan;
  then applies it: always when it returns GPUs the trainer wants or a notice reclaims; borrowing and
  PD changes too, unless `manual` (they then wait, proposed, for `pearlctl apply`). Borrowing and PD
  changes were already gated by the policy (the borrowing gate, the switching hysteresis).
A pass that changes nothing writes no decision row; every plan it writes has one, with the inputs
that drove it (`decisions.inputs`: the ranked candidates, the gate, the signals, the profile).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from pearl.controlplane.core.domain import Activity, GPUState, NodeZone, PlanStatus, StepAction, StepStatus, WorkerZone
from pearl.controlplane.errors import PearlError, StalePlan
from pearl.controlplane.store import agent_registry, plan_store, reaper, signals
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import GPU, Lease, Plan, PlanStep, Tick, TrainingStep, Worker
from pearl.policies.live import policy_pass
from sqlalchemy import Engine, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

LEADER = "policy"  # the leader lease of the policy loop


@dataclass(frozen=True)
class TickResult:
    ran: bool  # a decision was made
    note: str  # what happened, in words
    tick_id: int | None = None
    key: str | None = None
    decision: dict[str, Any] | None = None  # what was decided and why (None: no pass ran)
    plan: int | None = None  # the plan written
    applied: bool = False
    amended: int | None = None  # the applying plan, amended to release workers that must leave now
    leading: bool = True  # the pass held the leader lease (False: another process leads)
    # the policy asks to decide again once this few trajectories of the step remain (its tail)
    recheck_remaining: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "plan": self.plan, "applied": self.applied, "amended": self.amended,
                "tick": self.tick_id, "key": self.key, "leading": self.leading, "note": self.note}


def default_holder(kind: str = "tick") -> str:
    return f"{kind}:{socket.gethostname()}:{os.getpid()}"


def tick(engine: Engine, *, holder: str | None = None, manual: bool = False, lease_s: float = 30.0,
         event: str = "tick", keep_lease: bool = False) -> TickResult:
    """One pass (module docstring). `keep_lease`: the caller (the loop) holds the lease between passes."""
    holder = holder or default_holder()
    if not agent_registry.hold_leader_lease(engine, LEADER, holder, ttl_s=lease_s):
        return TickResult(False, f"another process leads the policy loop ({_leader(engine)}); nothing to do",
                          leading=False)
    try:
        return _pass(engine, holder=holder, manual=manual, event=event, lease_s=lease_s)
    finally:
        if not keep_lease:
            agent_registry.release_leader_lease(engine, LEADER, holder)


def _leader(engine: Engine) -> str:
    with transaction(engine) as session:
        return agent_registry.leader(session, LEADER) or "nobody"


def _pass(engine: Engine, *, holder: str, manual: bool, event: str, lease_s: float) -> TickResult:
    with transaction(engine) as session:  # when this pass saw the state it acts on (the database's clock)
        seen_at = session.scalar(select(func.pearl_now()))
    reaper.reap(engine, actor=f"reaper in {holder}")
    with transaction(engine, isolation_level="REPEATABLE READ") as session:
        applying = session.scalars(select(Plan).where(Plan.status == PlanStatus.APPLYING)).first()
        urgent = must_leave(session)
        uncovered = urgent - _released_by(session, applying.id) if applying is not None else set()
    if applying is not None:
        # Shrinking cannot wait for the plan: what must leave (the trainer's GPUs, a notice) and what
        # the policy gives back now (the tail of a step) are released within the applying plan.
        with transaction(engine, isolation_level="REPEATABLE READ") as session:
            planned = policy_pass.decide(session, event=event)
            released = _released_by(session, applying.id)
        serving = {w.id for w in planned.snapshot.workers if w.activity is not Activity.INACTIVE}
        leave = (uncovered | (serving - planned.target.members)) - released
        if not leave:
            return TickResult(False, f"plan {applying.id} is applying; the next pass decides after it",
                              recheck_remaining=planned.target.recheck_remaining)
        reason = (f"workers {sorted(leave)} give their GPUs back now"
                  + (f" ({sorted(uncovered)} must)" if uncovered else f": {planned.target.reason}"))
        with transaction(engine, actor=holder, reason=reason[:500]) as session:
            amended = plan_store.amend_release(session, applying.id, leave, reason)
            signals.borrowed_return_decided(session, set(amended.release), seen_at)
        return TickResult(False, f"amended plan {applying.id}: {reason}; releasing {list(amended.release)}, "
                                 f"{len(amended.cancelled)} step(s) cancelled", plan=applying.id, applied=True,
                          amended=applying.id, recheck_remaining=planned.target.recheck_remaining)
    with transaction(engine, isolation_level="REPEATABLE READ", whole_fleet=True) as session:  # the plan's base
        planned = policy_pass.decide(session, event=event)
    key = f"v{planned.snapshot.state_version}:{_digest(planned)}"
    tick_id = _claim_tick(engine, key, holder, lease_s)
    if tick_id is None:
        return TickResult(False, f"this state was decided already (tick {key})", key=key,
                          recheck_remaining=planned.target.recheck_remaining)
    try:
        planned = policy_pass.write_planned(engine, planned, actor=holder, record_unchanged=False)
    except StalePlan as exc:
        _finish(engine, tick_id, error=str(exc))
        return TickResult(False, f"the fleet moved while deciding; the next pass decides again ({exc})",
                          tick_id, key)
    except BaseException as exc:  # the next pass on this state decides again (a SIGKILL: see _claim_tick)
        _finish_quietly(engine, tick_id, f"{type(exc).__name__}: {exc}")
        raise
    decision = planned.as_dict()["decision"]
    applied, note, error = False, f"no change: {planned.target.reason}", None
    if planned.plan_id is not None:
        forced = urgent & (planned.plan.remove | set(planned.plan.reassign))
        note = f"plan {planned.plan_id} written"
        if not manual or forced:
            try:
                plan_store.apply(engine, planned.plan_id, actor=holder)
                if planned.plan.remove:
                    with transaction(engine, actor=holder) as session:
                        signals.borrowed_return_decided(session, set(planned.plan.remove), seen_at)
                applied, note = True, f"plan {planned.plan_id} applied" + (
                    f" (urgent: workers {sorted(forced)} must leave)" if forced else "")
            except PearlError as exc:  # stale by now: the next pass decides again
                note = f"plan {planned.plan_id} not applied: {exc}"
                error = note  # not a decided state: a pass on the same state decides again
            except BaseException as exc:
                _finish_quietly(engine, tick_id, f"{type(exc).__name__}: {exc}", planned.decision_id,
                                planned.plan_id)
                raise
        else:
            note += "; waiting for `pearlctl apply` (manual mode)"
    _finish(engine, tick_id, decision_id=planned.decision_id, plan_id=planned.plan_id, error=error)
    return TickResult(True, note, tick_id, key, decision, planned.plan_id, applied,
                      recheck_remaining=planned.target.recheck_remaining)


def must_leave(session: Session) -> set[int]:
    """Workers serving on GPUs that must be given back now: borrowed GPUs the trainer wants back (or
    trains on), with the overlap workers an applying plan is still to start on them, and GPUs under a
    revocation notice."""
    latest = session.scalars(select(TrainingStep).order_by(TrainingStep.step.desc()).limit(1)).first()
    trainer_wants = latest is not None and latest.ended_at is None
    out: set[int] = set()
    if trainer_wants:
        out |= set(session.scalars(select(Worker.id).where(Worker.zone == WorkerZone.OVERLAP,
                                                           Worker.activity != Activity.INACTIVE)))
        out |= set(signals.borrowing_under_way(session))  # a start the request overtook is called off
    noticed = select(GPU.slot_id).join(Lease, Lease.gpu_id == GPU.id).where(
        Lease.returned_at.is_(None), Lease.deadline.is_not(None), GPU.zone == NodeZone.PREEMPTIBLE,
        GPU.state.in_([GPUState.BOUND, GPUState.DRAINING]))
    out |= set(session.scalars(select(Worker.id).where(Worker.id.in_(noticed), Worker.activity != Activity.INACTIVE)))
    return out


def _released_by(session: Session, plan_id: int) -> set[int]:
    """Workers the plan leaves released: a release step of theirs will run (or ran) and no start of
    theirs is still to come (a restart's release does not give the GPUs back for good), or an
    amendment's release is (it follows whatever of theirs was running; the rest was cancelled)."""
    pending = [StepStatus.BLOCKED, StepStatus.READY, StepStatus.RUNNING]
    released = set(session.scalars(select(PlanStep.worker_id).where(
        PlanStep.plan_id == plan_id, PlanStep.action == StepAction.RELEASE,
        PlanStep.status.in_([*pending, StepStatus.SUCCEEDED]))))
    restarting = set(session.scalars(select(PlanStep.worker_id).where(
        PlanStep.plan_id == plan_id, PlanStep.action == StepAction.START, PlanStep.status.in_(pending))))
    amended = set(session.scalars(select(PlanStep.worker_id).where(  # an amendment's release follows them all
        PlanStep.plan_id == plan_id, PlanStep.action == StepAction.RELEASE, PlanStep.key.like("%.amend%"),
        PlanStep.status.in_([*pending, StepStatus.SUCCEEDED]))))
    return (released - restarting) | amended


def _digest(planned: policy_pass.Planned) -> str:
    """The signals the pass decides on, without the clock, and the slots it may not use (a start's
    back-off ends without a row changing): equal states give equal keys."""
    signals = {k: v for k, v in policy_pass.signals_dict(planned.signals).items() if k not in ("now", "event")}
    signals["unavailable"] = sorted(w.id for w in planned.snapshot.workers if not w.available)
    blob = json.dumps(signals, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _claim_tick(engine: Engine, key: str, holder: str, lease_s: float) -> int | None:
    """Record this pass under `key`; None when the state was decided already. A pass that finished
    with an error decided nothing, nor did one that took the key and never finished (killed, the
    database lost mid-pass) within a leader lease: its key is taken over, so the state is decided
    again. An unfinished pass younger than that may still be running: its key stays its own."""
    stmt = insert(Tick).values(key=key, holder=holder)
    stmt = stmt.on_conflict_do_update(
        index_elements=[Tick.key],
        set_={"holder": holder, "started_at": func.now(), "finished_at": None, "decision_id": None,
              "plan_id": None, "error": None},
        where=Tick.error.is_not(None) | (Tick.finished_at.is_(None) & (
            Tick.started_at < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, lease_s))))
    with transaction(engine, actor=holder) as session:
        return session.scalar(stmt.returning(Tick.id))


def _finish_quietly(engine: Engine, tick_id: int, error: str, decision_id: int | None = None,
                    plan_id: int | None = None) -> None:
    """Mark a pass that is failing as such, if the database lets us (else the next pass takes the key)."""
    try:
        _finish(engine, tick_id, decision_id=decision_id, plan_id=plan_id, error=error[:500])
    except Exception:  # the original error is what the caller raises
        pass


def _finish(engine: Engine, tick_id: int, *, decision_id: int | None = None, plan_id: int | None = None,
            error: str | None = None) -> None:
    with transaction(engine) as session:
        session.execute(update(Tick).where(Tick.id == tick_id).values(
            finished_at=func.now(), decision_id=decision_id, plan_id=plan_id, error=error))
