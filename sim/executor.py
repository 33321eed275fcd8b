"""Enacts plans in simulated time: each step after its dependencies, for the reconfiguration cost.

Durations (scenario `reconfig`, the same for every system):
- drain, interrupt, router_sync: ~0 (a router change; partial trajectories are kept and resubmitted);
- release: `toggle_off_s` for an overlap worker (release device memory), ~0 for a dedicated one;
- start: `cold_start_s` on dedicated GPUs; on overlap GPUs the server process sleeps between loans
  in the mode it was launched in, so it resumes in `toggle_on_s`, plus `role_switch_s` for a
  prefill <-> decode change, or restarts (`cold_start_s`) for a colocated <-> split change;
- load_weights: `training.weight_sync_s` (lazy: only once the server is up);
- admit: `admit_s` for a dedicated expansion group (all-or-nothing), ~0 for overlap workers and for
  workers that flipped in place (a router add);
- flip_role: waits until the drained server is idle, then `role_switch_s`.

Several plans may be in flight. A newer plan's chain for a worker supersedes the unfinished steps of
an older one, except a release under way: that one is urgent and finishes first. Cancelling any
unfinished step of an expansion group (a plan has up to two: its dedicated workers and its borrowed
ones) cancels the group: its members not yet admitted stop and free their GPUs (docs/state-machine.md,
invariant 6). A flip on a worker whose server is not up becomes a restart.
"""

from __future__ import annotations

from typing import Protocol

from pearl.controlplane.core.domain import Activity, Role, StepAction, WorkerZone
from pearl.controlplane.core.fleet import Plan, PlanStep

from .scenario import Reconfig
from .workers import Worker

BLOCKED, RUNNING, WAITING_IDLE, DONE, CANCELLED = range(5)


class Actuator(Protocol):
    """What the executor's steps do to the simulated engines, router and GPUs (the runner)."""

    def drain(self, worker: Worker, now: float) -> None: ...
    def interrupt(self, worker: Worker, now: float) -> None: ...
    def stop(self, worker: Worker, now: float) -> None: ...  # the server is gone (GPUs still held)
    def freed(self, worker: Worker, now: float) -> None: ...  # its GPUs are free
    def bound(self, worker: Worker, now: float) -> None: ...  # its GPUs are taken for a start
    def started(self, worker: Worker, role: Role, now: float) -> None: ...
    def loaded(self, worker: Worker, now: float) -> None: ...
    def admitted(self, worker: Worker, now: float) -> None: ...
    def schedule(self, t: float, run: StepRun) -> None: ...
    def plan_finished(self, plan: PlanRun, now: float) -> None: ...


class StepRun:
    __slots__ = ("plan", "step", "worker", "status", "waiting_on", "dependents", "begin", "end")

    def __init__(self, plan: PlanRun, step: PlanStep, worker: Worker) -> None:
        self.plan = plan
        self.step = step
        self.worker = worker
        self.status = BLOCKED
        self.waiting_on = len(step.after)
        self.dependents: list[StepRun] = []
        self.begin = 0.0
        self.end = 0.0


class PlanRun:
    __slots__ = ("id", "plan", "runs", "open", "groups", "member_of", "cancelled", "failed")

    def __init__(self, pid: int, plan: Plan) -> None:
        self.id = pid
        self.plan = plan
        self.runs: dict[str, StepRun] = {}
        self.open = 0  # steps neither done nor cancelled
        self.groups: dict[str, set[int]] = {}  # the plan's expansion groups (dedicated, borrowed) -> workers
        self.member_of: dict[int, str] = {}  # worker -> its expansion group in this plan
        self.cancelled: set[str] = set()  # groups cancelled
        self.failed = False


class Executor:
    def __init__(self, reconfig: Reconfig, weight_sync_s: float, actuator: Actuator,
                 workers: dict[int, Worker]) -> None:
        self.cost = reconfig
        self.weight_sync_s = weight_sync_s
        self.act = actuator
        self.workers = workers
        self.plans: dict[int, PlanRun] = {}
        self.next_id = 0
        self.idle_waiters: dict[int, StepRun] = {}  # worker -> flip waiting for its server to drain
        # a flip waits for its drained server to finish what it holds; without (the oracle's free
        # reconfiguration) the server gives its requests up at once, each keeping its progress
        self.drain_wait = True
        self.release_waiters: dict[int, list[StepRun]] = {}  # worker -> first steps waiting for a release
        self.cancelled_groups = 0
        self.durations: dict[str, float] = {}  # latest measured seconds per action kind (policies' costs)

    # -- applying a plan -------------------------------------------------------------------------

    def apply(self, plan: Plan, now: float) -> PlanRun:
        pr = PlanRun(self.next_id, plan)
        self.next_id += 1
        self.plans[pr.id] = pr
        for step in plan.steps:
            run = StepRun(pr, step, self.workers[step.worker_id])
            pr.runs[step.key] = run
            pr.open += 1
            if step.group is not None:
                pr.groups.setdefault(step.group, set()).add(step.worker_id)
                pr.member_of[step.worker_id] = step.group
        for run in pr.runs.values():
            for key in run.step.after:
                pr.runs[key].dependents.append(run)
        touched = sorted({s.worker_id for s in plan.steps if s.action is not StepAction.ROUTER_SYNC})
        for wid in touched:
            self._supersede(self.workers[wid], now)
        # What the policies see from now on: leaving workers are gone, the others in their new role.
        for wid in touched:
            w = self.workers[wid]
            if wid in plan.remove:
                w.removing = True
            else:
                w.removing = False
                w.role = plan.roles[wid]
                w.activity = Activity.TRANSITIONING
        ready = []
        for run in pr.runs.values():
            if run.step.action is not StepAction.ROUTER_SYNC:
                run.worker.chain.append(run)
            if run.waiting_on == 0:
                ready.append(run)
        for run in ready:
            self._begin(run, now)
        self._check_finished(pr, now)
        return pr

    def _supersede(self, w: Worker, now: float) -> None:
        """Cancel `w`'s unfinished steps from older plans, except a release under way (urgent)."""
        old = [r for r in w.chain if r.status in (BLOCKED, RUNNING, WAITING_IDLE)
               and not (r.step.action is StepAction.RELEASE and r.status == RUNNING)]
        for run in old:
            self._cancel(run, now)

    # -- running steps ---------------------------------------------------------------------------

    def _duration(self, run: StepRun) -> float:
        a, w, c = run.step.action, run.worker, self.cost
        overlap = w.zone is WorkerZone.OVERLAP
        if a is StepAction.RELEASE:
            return c.toggle_off_s if overlap else 0.0
        if a is StepAction.START:
            if not overlap:
                return c.cold_start_s
            role = Role(run.step.args["role"])
            if (role is Role.COLOCATED) != (w.process_role is Role.COLOCATED):
                return c.cold_start_s
            return c.toggle_on_s + (c.role_switch_s if role is not w.process_role else 0.0)
        if a is StepAction.LOAD_WEIGHTS:
            return self.weight_sync_s
        if a is StepAction.ADMIT:
            return c.admit_s if run.step.group is not None and not overlap else 0.0
        if a is StepAction.FLIP_ROLE:
            return c.role_switch_s
        return 0.0

    def _begin(self, run: StepRun, now: float) -> None:
        a, w = run.step.action, run.worker
        if a is StepAction.FLIP_ROLE and w.engine is None:
            self._flip_as_restart(run, now)
            return
        if a is StepAction.FLIP_ROLE and not w.engine.idle and self.drain_wait:
            run.status = WAITING_IDLE
            self.idle_waiters[w.id] = run
            return
        if a is StepAction.START and w.releasing:
            self.release_waiters.setdefault(w.id, []).append(run)  # after the release under way
            return
        run.status = RUNNING
        if a is StepAction.DRAIN:
            self.act.drain(w, now)
        elif a is StepAction.INTERRUPT:
            self.act.interrupt(w, now)
        elif a is StepAction.RELEASE:
            w.releasing = True
            self.act.stop(w, now)
        elif a is StepAction.START:
            if not w.holds_gpus:
                self.act.bound(w, now)
        elif a is StepAction.FLIP_ROLE:
            self.act.stop(w, now)
        d = self._duration(run)
        run.begin = now
        if d <= 0:
            self._complete(run, now)
        else:
            run.end = now + d
            self.act.schedule(run.end, run)

    def _flip_as_restart(self, run: StepRun, now: float) -> None:
        """The server meant to flip is not up (its start was superseded): start it in the new role."""
        w = run.worker
        if not w.holds_gpus:
            self.act.bound(w, now)
        run.status = RUNNING
        run.begin = now
        run.end = now + self.cost.cold_start_s + self.weight_sync_s
        self.act.schedule(run.end, run)

    def worker_idle(self, w: Worker, now: float) -> None:
        """The runner's call when a drained server has nothing left: a waiting flip may go."""
        run = self.idle_waiters.pop(w.id, None)
        if run is not None and run.status == WAITING_IDLE:
            self._begin(run, now)

    def completed(self, run: StepRun, now: float) -> None:
        """A scheduled step's time is up (ignored if it was cancelled meanwhile)."""
        if run.status == RUNNING and run.end == now:
            self._complete(run, now)

    def _complete(self, run: StepRun, now: float) -> None:
        a, w = run.step.action, run.worker
        if run.end:
            kind = f"{a}_{w.zone}" if a in (StepAction.START, StepAction.RELEASE) else str(a)
            self.durations[kind] = now - run.begin
        run.status = DONE
        pr = run.plan
        pr.open -= 1
        if a is StepAction.RELEASE:
            w.releasing = False
            if w.removing:
                w.removing = False
                w.activity = Activity.INACTIVE
            w.weights_version = 0
            if w.holds_gpus:
                self.act.freed(w, now)
            for waiter in self.release_waiters.pop(w.id, []):
                if waiter.status == BLOCKED:
                    self._begin(waiter, now)
        elif a in (StepAction.START, StepAction.FLIP_ROLE):
            if w.zone is WorkerZone.OVERLAP:
                w.process_role = w.role
            self.act.started(w, w.role, now)
            if a is StepAction.FLIP_ROLE and w.weights_version == 0:
                self.act.loaded(w, now)  # a flip turned restart loaded its weights too
        elif a is StepAction.LOAD_WEIGHTS:
            self.act.loaded(w, now)
        elif a is StepAction.ADMIT:
            w.activity = Activity.ACTIVE
            self.act.admitted(w, now)
        if run in w.chain:
            w.chain.remove(run)
        for d in run.dependents:
            d.waiting_on -= 1
            if d.waiting_on == 0 and d.status == BLOCKED:
                self._begin(d, now)
        self._check_finished(pr, now)

    # -- cancellation ----------------------------------------------------------------------------

    def _cancel(self, run: StepRun, now: float) -> None:
        if run.status in (DONE, CANCELLED):
            return
        run.status = CANCELLED
        run.plan.open -= 1
        if self.idle_waiters.get(run.worker.id) is run:
            del self.idle_waiters[run.worker.id]
        if run in run.worker.chain:
            run.worker.chain.remove(run)
        pr = run.plan
        group = pr.member_of.get(run.worker.id)
        if group is not None and group not in pr.cancelled:
            self.cancel_group(pr, group, now)
        for d in run.dependents:  # what waited on it can no longer happen
            self._cancel(d, now)
        self._check_finished(pr, now)

    def cancel_group(self, pr: PlanRun, group: str, now: float) -> None:
        """All-or-nothing: the group's members not yet admitted stop and free their GPUs."""
        pr.cancelled.add(group)
        pr.failed = True
        self.cancelled_groups += 1
        for wid in sorted(pr.groups[group]):
            w = self.workers[wid]
            pending = [r for r in pr.runs.values() if r.worker is w and r.status in (BLOCKED, RUNNING, WAITING_IDLE)]
            if not pending:
                continue
            for r in pending:
                self._cancel(r, now)
            if w.activity is not Activity.ACTIVE and not w.releasing:
                self.act.stop(w, now)
                w.activity = Activity.INACTIVE
                w.weights_version = 0
                if w.holds_gpus:
                    self.act.freed(w, now)

    def forget(self, w: Worker, now: float) -> None:
        """The runner released `w` by force (notice deadline): drop whatever was planned for it."""
        for run in list(w.chain):
            self._cancel(run, now)
        w.chain = []
        for run in self.release_waiters.pop(w.id, []):
            self._cancel(run, now)
        w.removing = w.releasing = False

    def _check_finished(self, pr: PlanRun, now: float) -> None:
        if pr.open == 0 and pr.id in self.plans:
            del self.plans[pr.id]
            self.act.plan_finished(pr, now)
