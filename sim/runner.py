"""The discrete-event loop: engines, router, trainer, preemptible trace, executor and the policy.

Every system runs here the same way: the policy sees a snapshot and the signals a live system has
(never the future of the trace), returns a Target, `orchestrate` turns it into a Plan, and the
executor enacts it at the scenario's reconfiguration costs. The fleet the policy first asks for is
in place at t=0 (a run joins training under way), for every system alike.

Events are (time, seq, kind, a, b) on one heap; seq makes the order total, so a run is a pure
function of (scenario, policy). Engines advance in closed form between events (engine.py).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

from pearl.controlplane.core.domain import Activity, Role, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.core.telemetry import IterationRecord, StepTelemetry
from pearl.policies.base import Policy, Signals

from .availability import Change, availability_changes
from .engine import TRANSFERRING, Engine, EngineTiming, Request
from .executor import Executor, PlanRun, StepRun
from .metrics import Result, Timeline, step_rates
from .router import Router
from .scenario import Scenario, serving_perf
from .trainer import Trainer
from .trajectories import Trajectory, sample_batch
from .workers import Cluster, Worker

EV_WAKE, EV_ENV, EV_KV, EV_STEP, EV_TRAIN_END, EV_TRACE, EV_DEADLINE, EV_DECIDE, EV_UPDATED = range(9)
ITERATIONS_PER_TELEMETRY = 64  # engine iteration records sampled into each step's telemetry
TOGGLE_HISTORY = 8  # borrow cycles whose measured cost the policy sees
TAIL_HISTORY = 3  # complete rollout steps whose tail (finish times before the end) the policy sees


class Simulation:
    """One run of one policy on one scenario."""

    def __init__(self, scenario: Scenario, policy: Policy, progress: Callable[[float], None] | None = None,
                 prefix_cache: bool = True) -> None:
        self.sc = scenario
        self.prefix_cache = prefix_cache
        self.policy = policy
        self.memory = policy.initial_memory()
        self.progress = progress
        self.perf = serving_perf(scenario)
        self.timing = EngineTiming(self.perf)
        self.timings = {role: EngineTiming(self.perf.for_role(role)) for role in (Role.PREFILL, Role.DECODE)}
        self.timings[Role.COLOCATED] = self.timing  # each role at its own serving efficiency
        self.cluster = Cluster(scenario)
        self.workers = {w.id: w for w in self.cluster.workers}
        self.router = Router()
        self.trainer = Trainer(scenario.training)
        self.executor = Executor(scenario.reconfig, scenario.training.weight_sync_s, self, self.workers)
        self.heap: list[tuple] = []
        self.seq = 0
        self.events = 0
        self.now = 0.0
        self.version = 0
        self.sink: list[tuple] = []
        self.nic_free: dict[Engine, float] = {}
        self.decide_pending: list[str] = []
        self.halted = False  # set by a subclass to stop `advance` after the current event (the oracle)
        self.batches: dict[int, list[Trajectory]] = {}  # batches created and not complete, by index
        self.unfinished: dict[int, int] = {}  # their unfinished trajectories
        slots = scenario.env_slots
        # environment slot i runs trajectories i, i + S, i + 2S, ... of each batch, one after the other
        self.slot_next = [(0, i) for i in range(slots)]  # (batch, index in it) of each slot's next trajectory
        self.slots_waiting = set(range(slots))  # slots whose next trajectory is not started
        self.begun = -1  # the latest batch that became the one under way (rollout_begin)
        self.started_at: dict[int, float] = {}  # trajectory id -> when its slot started it
        self.ended_at: dict[int, list[float]] = {}  # batch -> when each of its trajectories finished
        self.remaining = 0  # unfinished trajectories of the batch under way
        self.recheck_remaining: int | None = None  # the latest target's wake-up hint (Target.recheck_remaining)
        self.telemetry: StepTelemetry | None = None
        self.batch_tokens: dict[int, int] = {}
        self.step_begin = 0.0
        self.makespans: list[float] = []
        # the trainer's wait for each batch, from its last weight update to the batch's completion (0 when
        # the batch was complete first): ROLL's time/step_rollout, the paper's rollout time
        self.rollout_waits: list[float] = []
        self.trajectory_durations: list[float] = []  # each finished trajectory: its end - its start
        self.step_tails: tuple[tuple[float, ...], ...] = ()  # Signals.step_tails
        self.borrow: dict[int, list[float]] = {}  # overlap worker -> [bound, admitted, return began]
        self.toggle_costs: list[float] = []
        # metric accumulators
        self.tokens_trained = 0
        self.gpu_seconds = 0.0
        self.gpus = 0
        self.gpus_since = 0.0
        self.reconfigurations = 0
        self.plans = 0
        self.forced_releases = 0
        self.interrupted = 0
        self.retracted = 0
        self.turn_tokens = 0  # tokens of finished turns
        self.retired_decode_tokens = 0  # decoded by engines that no longer exist
        self.discarded_tokens = 0  # partial turns a weight update aborted (`weight_update: abort`)
        self.live = self.env_waiting = 0
        self.live_area = self.decoding_area = 0.0
        self.live_since = 0.0
        self.timeline = Timeline(scenario.duration_s, scenario.cluster.reserved_rollout_gpus)

    # -- the loop --------------------------------------------------------------------------------

    def push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def run(self) -> Result:
        wall = time.perf_counter()
        self.begin()
        self.advance(self.sc.duration_s)
        return self.finish(time.perf_counter() - wall)

    def begin(self) -> None:
        """t=0: the trace's first grant, the policy's first fleet, the first rollout step."""
        changes = availability_changes(self.sc)
        if changes and changes[0].t == 0:
            self._trace(changes.pop(0), initial=True)
        for change in changes:
            self.push(change.t, EV_TRACE, change)
        self._install()
        self._create_batches()

    def advance(self, until: float) -> None:
        """Process every event up to `until` (a run can be paused, copied and resumed: the oracle)."""
        heap, next_report = self.heap, self.now
        while heap and heap[0][0] <= until and not self.halted:
            t, _, kind, a, b = heapq.heappop(heap)
            self.now = t
            self.events += 1
            if kind == EV_WAKE:
                if a.epoch == b and a.busy_until == t:
                    self._outcomes(a, a.wake(t))
            elif kind == EV_ENV:
                self._resume(a)
            elif kind == EV_KV:
                self._kv_arrived(a)
            elif kind == EV_STEP:
                self.executor.completed(a, t)
            elif kind == EV_TRAIN_END:
                self._training_end()
            elif kind == EV_TRACE:
                self._trace(a)
            elif kind == EV_DEADLINE:
                self._deadline(a, b)
            elif kind == EV_DECIDE:
                self._decide()
            elif kind == EV_UPDATED:
                self._updated()
            if self.progress is not None and t >= next_report:
                self.progress(t)
                next_report = t + 60.0
        if not self.halted:
            self.now = max(self.now, until)

    def finish(self, wall_s: float = 0.0) -> Result:
        self._count_gpus(0)
        return self._result(self.events, wall_s)

    # -- policy ----------------------------------------------------------------------------------

    def _signals(self, event: str) -> Signals:
        tr = self.trainer
        return Signals(
            now=self.now, event=event, rollout_step=tr.rollout_step, batch_size=self.sc.workload.batch_size,
            remaining=self.remaining, training=tr.training, training_wanted=tr.wanted_since is not None,
            deadlines={w.id: w.deadline for w in self.cluster.workers if w.deadline is not None},
            telemetry=self.telemetry, toggle_costs=tuple(self.toggle_costs[-TOGGLE_HISTORY:]),
            toggle_cycles=len(self.toggle_costs), step_durations=dict(self.executor.durations),
            weights_version=tr.trained, plans_in_flight=len(self.executor.plans),
            last_training_s=(tr.step_times[-1][1] - tr.step_times[-1][0]) if tr.step_times else None,
            step_tails=self.step_tails, in_flight=self.live,
        )

    def _overlap_free(self) -> bool:
        return not self.trainer.training and self.trainer.wanted_since is None

    def _snapshot(self) -> FleetSnapshot:
        return self.cluster.snapshot(self.version, self._overlap_free())

    def request_decision(self, event: str) -> None:
        if not self.decide_pending:
            self.push(self.now, EV_DECIDE)
        self.decide_pending.append(event)

    def _decide(self) -> None:
        event = ",".join(dict.fromkeys(self.decide_pending))
        self.decide_pending = []
        snapshot = self._snapshot()
        target, self.memory = self.policy.decide(snapshot, self._signals(event), self.memory)
        self.recheck_remaining = target.recheck_remaining
        plan = orchestrate(snapshot, target)
        if plan.empty:
            return
        self.version += 1
        self.plans += 1
        self.reconfigurations += plan.d_worker + plan.d_role
        self.executor.apply(plan, self.now)
        self._sample_fleet()

    def _install(self) -> None:
        """The fleet of the policy's first decision, in place at t=0 at no cost."""
        snapshot = self._snapshot()
        target, self.memory = self.policy.decide(snapshot, self._signals("start"), self.memory)
        plan = orchestrate(snapshot, target)
        for wid, role in sorted(plan.roles.items()):
            w = self.workers[wid]
            w.role = role
            if w.zone is WorkerZone.OVERLAP:
                w.process_role = role
            self.bound(w, 0.0)
            self.started(w, role, 0.0)
            self.loaded(w, 0.0)
            w.activity = Activity.ACTIVE
            self.router.admit(w.engine)
        self.version += 1
        self._sample_fleet()

    # -- the executor's actuator -----------------------------------------------------------------

    def schedule(self, t: float, run: StepRun) -> None:
        self.push(t, EV_STEP, run)

    def drain(self, w: Worker, now: float) -> None:
        self.router.remove(w.id)
        if w.id in self.borrow and w.removing:
            self.borrow[w.id][2] = now

    def interrupt(self, w: Worker, now: float) -> None:
        if w.engine is not None:
            self._abort(w.engine)

    def stop(self, w: Worker, now: float) -> None:
        if w.engine is not None:
            self.router.remove(w.id)
            self._abort(w.engine)
            self.nic_free.pop(w.engine, None)
            self.retired_decode_tokens += w.engine.decode_tokens
            w.engine = None
        self._sample_fleet()

    def bound(self, w: Worker, now: float) -> None:
        w.holds_gpus = True
        self._count_gpus(len(w.gpus))
        if w.zone is WorkerZone.OVERLAP:
            self.borrow[w.id] = [now, math.nan, math.nan]

    def freed(self, w: Worker, now: float) -> None:
        if not w.holds_gpus:  # freed already (a forced release whose group was cancelled first)
            return
        w.holds_gpus = False
        self._count_gpus(-len(w.gpus))
        if w.zone is WorkerZone.OVERLAP:
            bound, admitted, returning = self.borrow.pop(w.id, (math.nan,) * 3)
            cost = (admitted - bound) + (now - returning)
            if bound > 0 and math.isfinite(cost):  # a full cycle, measured (the t=0 fleet cost nothing)
                self.toggle_costs.append(cost)
            self._try_train()
        self._sample_fleet()

    def started(self, w: Worker, role: Role, now: float) -> None:
        capacity = self.perf.kv_capacity_tokens
        w.engine = Engine(w.id, role, self.timings[role], capacity, self.sink, self.prefix_cache)

    def loaded(self, w: Worker, now: float) -> None:
        w.weights_version = self.trainer.trained

    def admitted(self, w: Worker, now: float) -> None:
        if w.engine is None:
            return
        self.router.admit(w.engine)
        if w.id in self.borrow and math.isnan(self.borrow[w.id][1]):  # the cycle's first admission (not a flip's)
            self.borrow[w.id][1] = now
        self._sample_fleet()
        if self.router.pending and self.router.can_serve():
            pending, self.router.pending = self.router.pending, []
            for traj in pending:
                self._dispatch(traj)

    def plan_finished(self, plan: PlanRun, now: float) -> None:
        self.request_decision("plan_failed" if plan.failed else "plan_done")

    # -- trajectories ----------------------------------------------------------------------------

    def _dispatch(self, traj: Trajectory) -> None:
        """Send the current turn (or what is left of it) to a worker."""
        router = self.router
        if not router.can_serve():
            router.pending.append(traj)
            return
        self.seq += 1
        req = Request(traj, self.seq, self.sc.workload.max_context_tokens - traj.context)
        engine = router.front(traj)
        self._outcomes(engine, engine.submit(req, self.now))

    def _outcomes(self, engine: Engine, out: list) -> None:
        for what, req in out:
            if what == "done":
                self._turn_done(req.traj, engine)
            elif what == "prefilled":
                self._to_decode(req)
            elif what == "retracted":  # a decode worker ran out of KV: the turn starts over elsewhere
                self.retracted += 1
                self._dispatch(req.traj)
            else:  # reserved on a decode worker: move the KV over the prefill worker's NIC
                pe = req.prefill_engine
                start = max(self.now, self.nic_free.get(pe, 0.0))
                end = start + self.perf.kv_transfer_time(req.context)
                self.nic_free[pe] = end
                self.push(end, EV_KV, req)
        self._arm(engine)
        if engine.worker in self.executor.idle_waiters and engine.idle:
            self.executor.worker_idle(self.workers[engine.worker], self.now)

    def _arm(self, engine: Engine) -> None:
        if engine.busy_until is not None and engine.armed != engine.epoch:
            engine.armed = engine.epoch
            self.push(engine.busy_until, EV_WAKE, engine, engine.epoch)

    def _to_decode(self, req: Request) -> None:
        decoders = self.router.routable(Role.DECODE)
        if not decoders:  # no decode worker admitted (mode change under way): start the turn again later
            pe = req.prefill_engine
            self._outcomes(pe, pe.cancel(req, self.now))
            self.router.pending.append(req.traj)
            return
        de = self.router.decode()
        self._outcomes(de, de.submit(req, self.now))

    def _kv_arrived(self, req: Request) -> None:
        if req.state != TRANSFERRING:
            return  # aborted meanwhile
        pe, de = req.prefill_engine, req.engine
        self._outcomes(pe, pe.transferred(req, self.now))
        self._outcomes(de, de.join(req, self.now))

    def _abort(self, engine: Engine, discard: bool = False) -> list[Request]:
        """Interrupt everything on `engine`; each trajectory keeps its progress and goes elsewhere. With
        `discard` (a weight update that aborts) the turns lose what they generated and the aborted
        requests are returned, to be sent again by the caller."""
        aborted, done = engine.interrupt(self.now)
        self._outcomes(engine, done)
        for req in aborted:
            for other in (req.prefill_engine, req.engine):
                if other is not None and other is not engine:
                    self._outcomes(other, other.cancel(req, self.now))
        if discard:
            for req in aborted:
                self.discarded_tokens += req.traj.turn_generated
                req.traj.turn_generated = 0
            return aborted
        self.interrupted += len(aborted)
        for req in aborted:
            self._dispatch(req.traj)
        return []

    def _turn_done(self, traj: Trajectory, engine: Engine) -> None:
        gen = traj.gen[traj.turn]
        if traj.turn_generated != gen:
            raise RuntimeError(f"trajectory {traj.id} turn {traj.turn}: generated {traj.turn_generated} of {gen}")
        traj.turn_generated = 0
        self.turn_tokens += gen
        self.timeline.generated(self.now, gen)
        if traj.turn == traj.turns - 1:
            self._trajectory_done(traj)
            return
        self._live_change(0, 1)
        self.push(self.now + traj.env_s[traj.turn], EV_ENV, traj)

    def _resume(self, traj: Trajectory) -> None:
        self._live_change(0, -1)
        traj.context += traj.gen[traj.turn] + traj.obs[traj.turn]
        traj.turn += 1
        self._dispatch(traj)

    def _live_change(self, live: int, env: int) -> None:
        dt = self.now - self.live_since
        self.live_area += self.live * dt
        self.decoding_area += (self.live - self.env_waiting) * dt
        self.live_since = self.now
        self.live += live
        self.env_waiting += env

    # -- batches, environment slots and training -------------------------------------------------

    def _create_batches(self) -> None:
        """Create every batch the trainer's rule allows now (sim/trainer.py); their slots start them."""
        while self.trainer.can_create():
            k = self.trainer.create()
            self.batches[k] = sample_batch(self.sc.workload, self.sc.seed, k)
            self.unfinished[k] = len(self.batches[k])
            self.ended_at[k] = []
            self._batch_created(k)
        self._begin_next()
        self._start_waiting_slots()

    def _batch_created(self, k: int) -> None:
        """Hook: batch k was just created (the oracle picks its fleet here)."""

    def _start_waiting_slots(self) -> None:
        for slot in sorted(self.slots_waiting):
            k, i = self.slot_next[slot]
            batch = self.batches.get(k)
            if batch is not None:
                self.slots_waiting.discard(slot)
                self._start(batch[i])

    def _start(self, traj: Trajectory) -> None:
        self.started_at[traj.id] = self.now
        self._live_change(1, 0)
        self._dispatch(traj)

    def _trajectory_done(self, traj: Trajectory) -> None:
        self._live_change(-1, 0)
        traj.done = True
        self.trajectory_durations.append(self.now - self.started_at.pop(traj.id))
        self.ended_at[traj.step].append(self.now)
        self.router.finished(traj)
        slots, b = len(self.slot_next), self.sc.workload.batch_size
        i = traj.id - traj.step * b
        self.slot_next[i % slots] = (traj.step, i + slots) if i + slots < b else (traj.step + 1, i % slots)
        self.slots_waiting.add(i % slots)
        self.unfinished[traj.step] -= 1
        if traj.step == self.begun:
            self.remaining = self.unfinished[traj.step]
            if self.remaining == 0:
                self._rollout_end()
            elif self.recheck_remaining is not None and self.remaining <= self.recheck_remaining:
                self.recheck_remaining = None  # once; the policy sets it again if it still wants it
                self.request_decision("tail")
        self._start_waiting_slots()

    def _begin_next(self) -> None:
        """The oldest incomplete batch becomes the one under way once it exists: its makespan, telemetry
        and the policy's R count from here."""
        k = self.trainer.batches_done
        if k == self.begun or k not in self.batches:
            return
        self.begun = k
        self.remaining = self.unfinished[k]
        self.step_begin = self.now
        self.sink.clear()
        self._live_change(0, 0)
        self.live_area = self.decoding_area = 0.0
        self._rollout_begin()

    def _rollout_begin(self) -> None:
        """Hook: the batch `begun` is now under way (the oracle pauses here)."""
        self.request_decision("rollout_begin")

    def _rollout_end(self) -> None:
        step = self.begun
        self._live_change(0, 0)
        makespan = self.now - self.step_begin
        self.makespans.append(makespan)
        self.rollout_waits.append(max(0.0, self.now - self.trainer.ready_at) if self.trainer.updated == step else 0.0)
        batch = self.batches.pop(step)
        self.step_tails = (*self.step_tails, tuple(sorted(min(makespan, self.now - end)
                                                           for end in self.ended_at.pop(step))))[-TAIL_HISTORY:]
        del self.unfinished[step]
        self.batch_tokens[step] = sum(t.metric_tokens for t in batch)
        self.telemetry = self._step_telemetry(step, batch)
        self.trainer.finish_rollout()
        self.request_decision("rollout_end")
        self._try_train()
        self._create_batches()

    def _step_telemetry(self, step: int, batch: list[Trajectory]) -> StepTelemetry:
        records = [r for r in self.sink if r[5] > 0]
        if len(records) > ITERATIONS_PER_TELEMETRY:
            stride = len(records) / ITERATIONS_PER_TELEMETRY
            records = [records[int(i * stride)] for i in range(ITERATIONS_PER_TELEMETRY)]
        fraction = self.decoding_area / self.live_area if self.live_area > 0 else None
        return StepTelemetry(
            step=step, batch_size=len(batch), trajectories=[t.record() for t in batch],
            iterations=[IterationRecord(worker=w, role=role, batch=b, context_tokens_mean=ctx, prefill_tokens=p,
                                        seconds=s) for w, role, b, ctx, p, s in records],
            decode_fraction=min(1.0, fraction) if fraction else None,
        )

    def _try_train(self) -> None:
        tr = self.trainer
        if not tr.wants_to_train():
            return
        if any(w.holds_gpus for w in self.cluster.overlap):
            if tr.wanted_since is None:  # borrowed GPUs must come back first
                tr.wanted_since = self.now
                self.request_decision("training_wanted")
            return
        self.push(tr.start_training(self.now), EV_TRAIN_END)
        self.request_decision("training_begin")

    def _training_end(self) -> None:
        version = self.trainer.finish_training(self.now)
        tokens = self.batch_tokens.pop(version - 1)
        self.tokens_trained += tokens
        until = self.now + self.sc.training.weight_sync_s
        aborted: list[Request] = []
        for w in self.cluster.workers:
            if w.engine is not None:
                if self.sc.training.weight_update == "abort":
                    aborted += self._abort(w.engine, discard=True)
                if w.engine is not None:  # the abort's outcomes may have ended a draining worker
                    self._outcomes(w.engine, w.engine.pause(self.now, until))
                w.weights_version = version
        for req in aborted:  # re-issued to the new weights: they wait for the pause
            self._dispatch(req.traj)
        self.timeline.trained(self.now, tokens)
        self.request_decision("training_end")
        self.push(until, EV_UPDATED)

    def _updated(self) -> None:
        """The weight update is done: the trainer asks for the next batch (ROLL's get_batch)."""
        self.trainer.finish_update(self.now)
        self._try_train()
        self._create_batches()

    # -- preemptible GPUs ------------------------------------------------------------------------

    def _trace(self, change: Change, initial: bool = False) -> None:
        pre = self.cluster.preemptible
        for i in change.granted:
            pre[i].granted = True
            pre[i].deadline = None  # a notice withdrawn before its deadline
        notice = self.sc.cluster.preemptible.notice_s if self.sc.cluster.preemptible else 0.0
        for i in change.revoked:
            w = pre[i]
            w.granted = False
            w.deadline = change.t + notice
            self.push(w.deadline, EV_DEADLINE, w, w.deadline)
        self.timeline.available(change.t, change.workers * self.sc.tp)
        if not initial:
            self.request_decision("grant" if change.granted else "notice")

    def _deadline(self, w: Worker, deadline: float) -> None:
        if w.deadline != deadline:
            return  # withdrawn
        w.deadline = None
        if w.holds_gpus:  # the policy did not release it in time: the GPUs go anyway
            self.forced_releases += 1
            self.executor.forget(w, self.now)  # may cancel its expansion group, which frees it
            self.stop(w, self.now)
            w.activity = Activity.INACTIVE
            self.freed(w, self.now)  # a no-op if the group's cancellation freed it already
            self.request_decision("forced_release")

    # -- accounting ------------------------------------------------------------------------------

    def token_balance(self) -> tuple[int, int]:
        """(tokens the engines decoded, tokens the trajectories hold): equal when nothing is lost."""
        engines = [w.engine for w in self.cluster.workers if w.engine is not None]
        decoded = self.retired_decode_tokens + sum(e.decode_tokens for e in engines)
        held = self.turn_tokens + self.discarded_tokens
        held += sum(t.turn_generated for batch in self.batches.values() for t in batch)
        return decoded, held + sum(e.decoding_progress() for e in engines)

    def _count_gpus(self, delta: int) -> None:
        self.gpu_seconds += self.gpus * (self.now - self.gpus_since)
        self.gpus_since = self.now
        self.gpus += delta

    def _sample_fleet(self) -> None:
        counts: dict[str, int] = {}
        for w in self.cluster.workers:
            if w.holds_gpus:
                label = "transitioning" if w.activity is not Activity.ACTIVE or w.removing else f"{w.zone}/{w.role}"
                counts[label] = counts.get(label, 0) + len(w.gpus)
        self.timeline.fleet(self.now, counts)

    def _result(self, events: int, wall_s: float) -> Result:
        tr = self.trainer
        per_step, ratio_of_sums = step_rates(self.timeline.training_ends, self.timeline.trained_tokens)
        return Result(
            scenario=self.sc.name, policy=self.policy.name,
            tokens_per_s=per_step, tokens_per_s_window=self.tokens_trained / self.sc.duration_s,
            tokens_per_s_ratio_of_sums=ratio_of_sums,
            rollout_steps=tr.batches_done, training_steps=tr.trained, gpu_seconds=self.gpu_seconds,
            reconfigurations=self.reconfigurations, plans=self.plans,
            late_returns=tr.late_returns, lateness_s=tr.lateness_s, forced_releases=self.forced_releases,
            cancelled_groups=self.executor.cancelled_groups, interrupted_requests=self.interrupted,
            retracted_requests=self.retracted,
            mean_step_makespan_s=(sum(self.makespans) / len(self.makespans)) if self.makespans else math.nan,
            events=events, wall_s=wall_s, timeline=self.timeline, step_makespans_s=tuple(self.makespans),
        )


def simulate(scenario: Scenario, policy: Policy, progress: Callable[[float], None] | None = None) -> Result:
    return Simulation(scenario, policy, progress).run()
