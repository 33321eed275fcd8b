"""A trainer emulator: what an asynchronous agentic-RL framework does to the control plane and the front
door, with the work of the simulator's trainer, so a live run and a simulated one do the same work.

Rollout, by the simulator's rule (sim/trainer.py): each batch is the simulator's
(`sim.trajectories.sample_batch`: the same trajectories for the same seed and step), and each of the
scenario's environment slots runs its trajectories of a batch one after the other, then the next
batch's as soon as that batch exists. With `batching: async` batches 0..s exist from the start and
training step k's end creates batch k + s + 1; with `sync` batch k is created once batch k-1 is
complete and step k-s-1 has ended. Every trajectory runs through the front door turn by turn:
`/generate` with the whole context as token ids (the prompt, then each turn's output and the
environment's observation) and `max_new_tokens` the turn's generation, then the environment's wait
(scaled by `speed`). One reporter sends the rollout's position, in order: the batch under way (the
oldest not complete) with how many of its trajectories finished and how many trajectories of every
batch are in flight (`rollout_progress`: the live R of the borrowing gate and the fleet's load),
and, as each batch completes, its last count and the step's telemetry (the records the simulator
emits).

Training, with staleness s: training step k begins once batch k is complete and reported and step
k-1 is done with its weight update (`training_begin` waits for the borrowed GPUs and records any
lateness), lasts `step_s`, then writes the new weights as a snapshot and reports the step's end
with its version; the update takes `weight_sync_s` before the trainer asks for the next batch. The servers
load the new weights without dropping the turns under way (`training.weight_update: keep`, pearl's
weight sync): the emulator sends no aborts.

Preemptible GPUs: the scenario's trace replayed as grants and revocations with notice (the
simulator's availability schedule, by whole workers).

The run ends after its duration, or after `steps` training steps when that is given, whichever comes
first.

Times: the scenario's seconds are model seconds; the emulator sleeps them divided by `speed`, and
reports throughput in model seconds (tokens over wall time x speed), the simulator's three metrics.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pearl.controlplane.api import ControlPlane
from pearl.controlplane.core.telemetry import StepTelemetry
from pearl.controlplane.errors import BadInput, DatabaseUnavailable
from pearl.controlplane.weights import write_demo_snapshot
from pearl.sim.availability import availability_changes
from pearl.sim.metrics import step_rates
from pearl.sim.scenario import Scenario
from pearl.sim.trajectories import Trajectory, sample_batch

log = logging.getLogger("pearl.trainer")

VOCAB = 50000
REPORT_RETRY_S = 120.0  # how long a report to the control plane is tried again while the database is away


def generate_body(ids: list[int], max_new_tokens: int, rid: str) -> dict:
    """One turn's `/generate` request, as SGLang's `GenerateReqInput` takes it."""
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0}, "rid": rid}


@dataclass
class TrainerStats:
    """What the emulator did, for the live view and the summary."""

    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # the same moment on the wall clock (epoch s)
    rollout_steps: int = 0  # batches complete
    training_steps: int = 0  # optimizer steps done
    requests: int = 0  # /generate answered
    failed_requests: int = 0  # /generate that failed for good
    resubmitted: int = 0  # answers the front door completed after interruptions
    retried: int = 0  # requests answered after the trainer sent them again (the front door did not answer)
    report_retries: int = 0  # reports to the control plane sent again while the database was away
    generated_tokens: int = 0
    trained_tokens: int = 0  # the metric's tokens of trained batches (generated + all)
    training_wait_s: float = 0.0  # how long training waited for borrowed GPUs, in total (wall)
    rollout: tuple[int, int, int] = (-1, 0, 0)  # step under way, finished, batch size
    in_flight: int = 0  # trajectories being rolled out, of every batch
    training: str = "idle"  # idle, waiting, training
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (wall s, tokens generated so far)
    grants: int = 0
    revocations: int = 0
    errors: list[str] = field(default_factory=list)
    ended: float | None = None  # when the run ended (its duration, a stop or a failure): the window metric's
    last_trained_s: float = 0.0  # wall seconds into the run when the latest training step ended
    trained_ends: list[float] = field(default_factory=list)  # wall seconds into the run each step ended
    trained_step_tokens: list[int] = field(default_factory=list)  # the metric's tokens of each trained step

    def elapsed(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started


class TrainerEmulator:
    def __init__(self, scenario: Scenario, control_plane: ControlPlane, front_door: str, *, speed: float,
                 snapshot_dir: Path, duration_s: float | None = None, preemptible_node: str | None = None,
                 write_snapshot: Callable[[Path, int], str] | None = None, request_timeout_s: float = 600.0,
                 retry_s: float = 60.0, steps: int | None = None) -> None:
        self.sc = scenario
        self.cp = control_plane
        self.url = front_door.rstrip("/")
        self.speed = speed
        self.snapshot_dir = snapshot_dir
        self.duration_s = duration_s if duration_s is not None else scenario.duration_s  # model seconds
        self.preemptible_node = preemptible_node
        self.write_snapshot = write_snapshot or write_demo_snapshot
        self.request_timeout_s = request_timeout_s
        self.retry_s = retry_s
        self.steps = steps  # the run ends after this many training steps (None: its duration decides)
        self.stats = TrainerStats()
        self._stop = asyncio.Event()
        if scenario.training.weight_update != "keep":
            raise BadInput("training.weight_update: the trainer emulator sends no aborts; a live run needs keep "
                           f"(pearl's weight sync), not {scenario.training.weight_update}")
        self._reset()
        self.initial_granted = False  # `grant_initial` ran: the trace's t=0 grant is in place

    def _reset(self) -> None:
        self._batches: dict[int, list[Trajectory]] = {}  # created and not complete
        self._finished: dict[int, int] = {}  # per batch: trajectories finished
        self._created = 0
        self._batches_done = 0  # complete, the oldest first
        self._reported = 0  # complete and reported (count and telemetry): training may take them
        self._trained = 0
        self._changed = asyncio.Condition()  # batches created, completed, reported, trained
        self._dirty = asyncio.Event()  # something for the reporter
        self._tokens: dict[int, int] = {}  # rollout step -> the metric's tokens of its batch

    # -- the run -----------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def model_s(self) -> float:
        return self.stats.elapsed() * self.speed

    async def run(self) -> TrainerStats:
        self.stats = TrainerStats()
        self._reset()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            self._create_batches()
            tasks = [asyncio.create_task(self._reporter()), asyncio.create_task(self._training()),
                     *(asyncio.create_task(self._slot(http, i)) for i in range(self.sc.env_slots))]
            if self.preemptible_node and self.sc.cluster.preemptible is not None:
                tasks.append(asyncio.create_task(self._trace()))
            deadline = asyncio.create_task(self._sleep_model(self.duration_s))
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait([deadline, stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            self.stats.ended = time.monotonic()  # what follows (cancelling, stopping the fleet) is not the run
            self._stop.set()
            for t in (*tasks, deadline, stopped):
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for r in results:
                if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError):
                    self.stats.errors.append(f"{type(r).__name__}: {r}")
                    log.warning("trainer task failed: %s", r)
        return self.stats

    async def _report(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A report to the control plane, tried again (as a framework would) while the database does not
        answer, for up to `REPORT_RETRY_S` of wall time (a restart or a failover of PostgreSQL)."""
        give_up = time.monotonic() + REPORT_RETRY_S
        while True:
            try:
                return await asyncio.to_thread(call, *args, **kwargs)
            except DatabaseUnavailable as exc:  # DatabaseBusy included: nothing was kept, try again
                if time.monotonic() >= give_up or self._stop.is_set():
                    raise
                self.stats.report_retries += 1
                log.info("%s: the database did not take the report, retrying: %s", call.__name__, exc)
                await asyncio.sleep(0.5)

    async def _sleep_model(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.speed)

    def grant_initial(self) -> int:
        """The trace's GPUs at t=0, granted before the run starts (the simulator starts with them)."""
        self.initial_granted = True
        first = next(iter(availability_changes(self.sc)), None) if self.preemptible_node else None
        if first is None or first.t > 0 or not first.granted:
            return 0
        tp = self.sc.tp
        return len(self.cp.gpus_granted(self.preemptible_node,  # type: ignore[arg-type]
                                        [d for w in first.granted for d in range(w * tp, (w + 1) * tp)]))

    # -- rollout -------------------------------------------------------------------------------------

    def _can_create(self) -> bool:
        """The simulator's rule (sim/trainer.py): at most `staleness` batches ahead of training, and with
        sync batching only once the previous batch is complete."""
        k, training = self._created, self.sc.training
        if self._trained < k - training.staleness:
            return False
        return training.batching == "async" or self._batches_done >= k

    def _create_batches(self) -> None:
        while self._can_create():
            k = self._created
            self._batches[k] = sample_batch(self.sc.workload, self.sc.seed, k)
            self._finished[k] = 0
            self._created += 1
        self._dirty.set()

    async def _slot(self, http: aiohttp.ClientSession, slot: int) -> None:
        """Environment slot `slot`: trajectories slot, slot + S, ... of each batch in turn, batch after batch."""
        size, slots = self.sc.workload.batch_size, self.sc.env_slots
        k = 0
        while not self._stop.is_set():
            async with self._changed:
                await self._changed.wait_for(lambda k=k: k < self._created)
            batch = self._batches[k]  # it cannot complete before this slot's trajectories of it end
            for i in range(slot, size, slots):
                self.stats.in_flight += 1
                try:
                    await self._trajectory(http, batch[i])
                finally:
                    self.stats.in_flight -= 1
                await self._trajectory_done(k)
            k += 1

    async def _trajectory_done(self, k: int) -> None:
        self._finished[k] += 1
        async with self._changed:
            while self._batches_done in self._batches and \
                    self._finished[self._batches_done] == len(self._batches[self._batches_done]):
                done = self._batches_done
                self._tokens[done] = sum(t.metric_tokens for t in self._batches[done])
                self._batches_done += 1
                self.stats.rollout_steps += 1
            self._create_batches()
            self._changed.notify_all()
        self._dirty.set()

    async def _reporter(self) -> None:
        """The rollout's position, in order: each completed batch's last count and telemetry, then the
        batch under way with its count and the trajectories in flight."""
        size = self.sc.workload.batch_size
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            while self._reported < self._batches_done:
                k = self._reported
                batch = self._batches.pop(k)
                await self._report(self.cp.rollout_progress, k, size, size, in_flight=self.stats.in_flight)
                telemetry = StepTelemetry(step=k, batch_size=size, trajectories=[t.record() for t in batch])
                await self._report(self.cp.telemetry, telemetry.model_dump(mode="json"))
                async with self._changed:
                    self._reported = k + 1
                    self._changed.notify_all()
            k = self._batches_done
            if k < self._created:
                finished = self._finished[k]
                self.stats.rollout = (k, finished, size)
                await self._report(self.cp.rollout_progress, k, finished, size, in_flight=self.stats.in_flight)

    async def _trajectory(self, http: aiohttp.ClientSession, traj: Trajectory) -> None:
        rng = random.Random(traj.group)  # a group's members share their prompt, so its cached prefix
        context = [rng.randrange(VOCAB) for _ in range(traj.prompt)]
        own = random.Random(traj.id)
        for turn, gen in enumerate(traj.gen):
            output = await self._generate(http, context, gen, f"t{traj.id}-{turn}")
            context += output
            self.stats.generated_tokens += len(output)
            self.stats.timeline.append((self.stats.elapsed(), self.stats.generated_tokens))
            if turn < len(traj.obs):
                await self._sleep_model(traj.env_s[turn])
                context += [own.randrange(VOCAB) for _ in range(traj.obs[turn])]

    async def _generate(self, http: aiohttp.ClientSession, ids: list[int], gen: int, rid: str) -> list[int]:
        """One turn through the front door; retried (as a framework would) for up to `retry_s` of wall
        time when the front door does not answer or answers an error, then counted as failed."""
        body = generate_body(ids, gen, rid)
        give_up = time.monotonic() + self.retry_s
        attempt = 0
        while True:
            attempt += 1
            try:
                async with http.post(self.url + "/generate", json=body) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status == 200 and isinstance(answer, dict):
                        meta = answer.get("meta_info") or {}
                        if (meta.get("pearl") or {}).get("resubmitted"):
                            self.stats.resubmitted += 1
                        if attempt > 1:
                            self.stats.retried += 1
                        self.stats.requests += 1
                        out = answer.get("output_ids") or []
                        return list(out)[:gen] if len(out) >= gen else list(out) + [0] * (gen - len(out))
                    reason = f"{resp.status}: {str(answer)[:200]}"
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():  # the run is over: not a failure of the system
                return [0] * gen
            if time.monotonic() >= give_up:
                break
            log.info("%s: attempt %d failed, retrying: %s", rid, attempt, reason)
            await asyncio.sleep(min(2.0, 0.1 * attempt))
        log.warning("%s: failed after %d attempts: %s", rid, attempt, reason)
        self.stats.failed_requests += 1
        self.stats.errors.append(f"{rid}: {reason}")
        return [0] * gen

    # -- training ------------------------------------------------------------------------------------

    async def _training(self) -> None:
        k = 0
        while not self._stop.is_set():
            async with self._changed:
                await self._changed.wait_for(lambda k=k: self._reported > k)
            self.stats.training = "waiting"
            t0 = time.monotonic()
            await self._report(self.cp.training_begin, k, wait_s=3600.0)
            self.stats.training_wait_s += time.monotonic() - t0
            self.stats.training = "training"
            await self._sleep_model(self.sc.training.step_s)
            version = k + 1
            uri = await asyncio.to_thread(self.write_snapshot, self.snapshot_dir / f"v{version}", version)
            await self._report(self.cp.training_end, k, weights_version=version, snapshot=uri)
            tokens = self._tokens.pop(k, 0)
            self.stats.trained_tokens += tokens
            self.stats.training_steps += 1
            self.stats.last_trained_s = self.stats.elapsed()
            self.stats.trained_ends.append(self.stats.last_trained_s)
            self.stats.trained_step_tokens.append(tokens)
            self.stats.training = "idle"
            if self.steps is not None and k + 1 >= self.steps:
                return  # the run's last step: ends the run
            # the servers load the new weights (the simulator's update, `weight_sync_s`); then the trainer
            # asks for the next batch, which creates the one `staleness` ahead (ROLL's pipeline order)
            await self._sleep_model(self.sc.training.weight_sync_s)
            async with self._changed:
                self._trained = k + 1
                self._create_batches()
                self._changed.notify_all()
            k += 1

    # -- preemptible GPUs ----------------------------------------------------------------------------

    async def _trace(self) -> None:
        """The scenario's trace as grants and revocations (with the scenario's notice) of the preemptible
        node's GPUs, slot by slot (slot i is devices i*tp .. i*tp+tp-1)."""
        notice = self.sc.cluster.preemptible.notice_s  # type: ignore[union-attr]
        tp = self.sc.tp
        for change in availability_changes(self.sc):
            if change.t > self.duration_s:
                break
            if change.t == 0 and self.initial_granted:
                continue
            await self._sleep_model(change.t - self.model_s())
            if change.granted:
                devices = [d for w in change.granted for d in range(w * tp, (w + 1) * tp)]
                await self._report(self.cp.gpus_granted, self.preemptible_node, devices)
                self.stats.grants += 1
            if change.revoked:
                devices = [d for w in change.revoked for d in range(w * tp, (w + 1) * tp)]
                await self._report(self.cp.gpus_revoked, self.preemptible_node, devices,
                                        notice_s=notice / self.speed)
                self.stats.revocations += 1
        await self._stop.wait()  # the trace is over, not the run: ending here would end it early


def summary(stats: TrainerStats, speed: float) -> dict[str, Any]:
    """The run's figures; throughput in model seconds, as the simulator measures it (sim/metrics.py)."""
    wall = stats.elapsed()
    per_step, ratio_of_sums = step_rates([t * speed for t in stats.trained_ends], stats.trained_step_tokens)
    return {"rollout_steps": stats.rollout_steps, "training_steps": stats.training_steps,
            "requests": stats.requests, "failed_requests": stats.failed_requests,
            "resubmitted": stats.resubmitted,
            "tokens_per_s": per_step,
            "tokens_per_s_window": stats.trained_tokens / (wall * speed) if wall > 0 else 0.0,
            "tokens_per_s_ratio_of_sums": ratio_of_sums,
            "wall_s": wall, "model_s": wall * speed}
