"""The reaper: what keeps the step protocol live when agents die. Idempotent; any process may run it.

One pass, in one transaction under an advisory lock (two passes never interleave; each is safe to
repeat), taking the fleet row first as every writer does:
0. revoke the preemptible GPUs whose notice ran out (`signals.enforce_deadlines`), and start a
   training step whose borrowed GPUs are all back (`signals.start_training_if_returned`);
1. rescue expired claims (`rescue_expired_steps`): back to ready for another attempt, failed after
   the last one, cancelled when their plan no longer applies;
2. reconcile the applying plan: a step failed (by the rescue or a report) fails it, cancels its steps
   not yet run and applies the cleanup plan that frees the GPUs of an abandoned expansion group;
   steps whose dependencies all succeeded settle; a plan with nothing left succeeds;
3. agents whose heartbeat is older than `agent_timeout_s` are marked stopped, and the workers serving
   on a node left with no live agent are marked unreachable (`workers.unreachable_since`): nobody can
   enact or watch them until an agent of that node heartbeats again.
Every agent runs passes while it holds the `reaper` leader lease; `pearlctl reap` runs one from cron.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pearl.controlplane.core.domain import Activity, PlanStatus
from pearl.controlplane.store import plan_store, signals
from pearl.controlplane.store.agent_registry import DEFAULT_AGENT_TIMEOUT_S
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import Agent, Plan, Worker
from pearl.controlplane.store.transitions import lock_fleet
from sqlalchemy import Engine, func, select, text, update

REAPER_LOCK = 0x7065_6172_72  # advisory lock key: one reaper pass at a time
DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class ReapReport:
    rescued: tuple[tuple[int, str], ...] = ()  # (step id, its new status)
    failed_plans: tuple[tuple[int, int | None], ...] = ()  # (plan, the cleanup plan its failure applied)
    finished_plans: tuple[int, ...] = ()
    silent_agents: tuple[int, ...] = ()
    unreachable_workers: tuple[int, ...] = ()
    revoked_gpus: tuple[int, ...] = ()  # preemptible GPUs whose notice ran out
    training_started: int | None = None  # a training step whose borrowed GPUs were all back

    def to_dict(self) -> dict[str, object]:
        return {"rescued": [{"step": s, "status": st} for s, st in self.rescued],
                "failed_plans": [{"plan": p, "cleanup": c} for p, c in self.failed_plans],
                "finished_plans": list(self.finished_plans), "silent_agents": list(self.silent_agents),
                "unreachable_workers": list(self.unreachable_workers), "revoked_gpus": list(self.revoked_gpus),
                "training_started": self.training_started}

    @property
    def empty(self) -> bool:
        return not (self.rescued or self.failed_plans or self.finished_plans or self.silent_agents
                    or self.unreachable_workers or self.revoked_gpus or self.training_started is not None)


def reap(engine: Engine, *, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
         agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S, actor: str = "reaper",
         now: datetime | None = None) -> ReapReport:
    """One pass (see the module docstring). `now` pins the database's clock for the pass (tests)."""
    with transaction(engine, actor=actor, reason="reap") as session:
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": REAPER_LOCK})
        if now is not None:
            session.execute(text("SELECT set_config('pearl.now', :t, true)"), {"t": now.isoformat()})
        lock_fleet(session)
        revoked = signals.enforce_deadlines(session)
        started = signals.start_training_if_returned(session)
        rescued = session.execute(query("rescue_expired_steps"), {"max_attempts": max_attempts}).all()
        failed, finished = [], []
        for plan_id in session.scalars(select(Plan.id).where(Plan.status == PlanStatus.APPLYING)).all():
            progress = plan_store.reconcile(session, plan_id)
            if progress.status is PlanStatus.FAILED:
                failed.append((plan_id, progress.cleanup))
            elif progress.status is PlanStatus.SUCCEEDED:
                finished.append(plan_id)
        silent = sorted(session.execute(query("stop_silent_agents"), {"timeout_s": agent_timeout_s}).all(),
                        key=lambda a: a.id)  # marked stopped
        live_nodes = select(Agent.node_id).where(Agent.stopped_at.is_(None))
        unreachable = session.scalars(
            update(Worker)
            .where(Worker.activity != Activity.INACTIVE, Worker.unreachable_since.is_(None),
                   Worker.node_id.in_([a.node_id for a in silent]), Worker.node_id.not_in(live_nodes))
            .values(unreachable_since=func.pearl_now()).returning(Worker.id)
            .execution_options(synchronize_session=False)
        ).all() if silent else []
        return ReapReport(
            rescued=tuple((r.id, r.status) for r in rescued), failed_plans=tuple(failed),
            finished_plans=tuple(finished), silent_agents=tuple(a.id for a in silent),
            unreachable_workers=tuple(sorted(unreachable)), revoked_gpus=tuple(revoked), training_started=started,
        )
