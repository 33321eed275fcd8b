"""A trainer emulator: what an asynchronous agentic-RL framework does to the control plane and the front
door, with the work of the simulator's trainer, so a live run and a simulated one do the same work.

Rollout. Each rollout step's batch is the simulator's (`sim.trajectories.sample_batch`: the same
trajectories for the same seed and step). Every trajectory runs through the front door turn by turn:
`/generate` with the whole context as token ids (the prompt, then each turn's output and the
environment's observation) and `max_new_tokens` the turn's generation, then the environment's wait
(scaled by `speed`). The rollout reports each finished trajectory (`rollout_progress`: the live R of
the borrowing gate) and, when the batch is complete, the step's telemetry (the same records the
simulator emits).

Training, with staleness s (the simulator's rules): the rollout of batch j starts once batch j-1 is
complete and at least j-s training steps are done; training step k begins when batch k is complete
and step k-1 is done (`training_begin` waits for the borrowed GPUs and records any lateness), lasts
`step_s`, then writes the new weights as a snapshot and reports the step's end with its version.

Preemptible GPUs: the scenario's trace replayed as grants and revocations with notice (the
simulator's availability schedule, by whole workers).

The run ends after its duration, or after `steps` training steps when that is given, whichever comes
first.

Times: the scenario's seconds are model seconds; the emulator sleeps them divided by `speed`, and
reports throughput in model seconds (tokens over wall time x speed), like the simulator's metric.
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
from pearl.controlplane.weights import write_demo_snapshot
from pearl.sim.availability import availability_changes
from pearl.sim.scenario import Scenario
from pearl.sim.trajectories import Trajectory, sample_batch

log = logging.getLogger("pearl.trainer")

VOCAB = 50000


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
    generated_tokens: int = 0
    trained_tokens: int = 0  # the metric's tokens of trained batches (generated + all)
    training_wait_s: float = 0.0  # how long training waited for borrowed GPUs, in total (wall)
    rollout: tuple[int, int, int] = (-1, 0, 0)  # step under way, finished, batch size
    training: str = "idle"  # idle, waiting, training
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (wall s, tokens generated so far)
    grants: int = 0
    revocations: int = 0
    errors: list[str] = field(default_factory=list)
    ended: float | None = None  # when the run ended (its duration, a stop or a failure): the metric's window
    last_trained_s: float = 0.0  # wall seconds into the run when the latest training step ended

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
        self._batches_done = 0
        self._trained = 0
        self._batch_done = asyncio.Condition()
        self._tokens: dict[int, int] = {}  # rollout step -> the metric's tokens of its batch
        self._progress = asyncio.Lock()
        self.initial_granted = False  # `grant_initial` ran: the trace's t=0 grant is in place

    # -- the run -----------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def model_s(self) -> float:
        return self.stats.elapsed() * self.speed

    async def run(self) -> TrainerStats:
        self.stats = TrainerStats()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            tasks = [asyncio.create_task(self._rollouts(http)), asyncio.create_task(self._training())]
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

    async def _rollouts(self, http: aiohttp.ClientSession) -> None:
        step = 0
        while not self._stop.is_set():
            async with self._batch_done:  # staleness: at least step - s training steps done
                await self._batch_done.wait_for(lambda s=step: self._trained >= s - self.sc.training.staleness)
            batch = sample_batch(self.sc.workload, self.sc.seed, step)
            await asyncio.to_thread(self.cp.rollout_progress, step, 0, len(batch))
            self.stats.rollout = (step, 0, len(batch))
            await asyncio.gather(*(self._run_and_report(http, t, step, len(batch)) for t in batch))
            telemetry = StepTelemetry(step=step, batch_size=len(batch), trajectories=[t.record() for t in batch])
            await asyncio.to_thread(self.cp.telemetry, telemetry.model_dump(mode="json"))
            self._tokens[step] = sum(t.metric_tokens for t in batch)
            self.stats.rollout_steps += 1
            async with self._batch_done:
                self._batches_done = step + 1
                self._batch_done.notify_all()
            step += 1

    async def _run_and_report(self, http: aiohttp.ClientSession, traj: Trajectory, step: int, batch: int) -> None:
        await self._trajectory(http, traj)
        self.stats.rollout = (step, self.stats.rollout[1] + 1, batch)
        async with self._progress:  # one report at a time, each the latest count: it never goes down
            await asyncio.to_thread(self.cp.rollout_progress, step, self.stats.rollout[1])

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
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": gen, "temperature": 1.0}, "rid": rid}
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
            async with self._batch_done:
                await self._batch_done.wait_for(lambda k=k: self._batches_done > k)
            self.stats.training = "waiting"
            t0 = time.monotonic()
            await asyncio.to_thread(self.cp.training_begin, k, wait_s=3600.0)
            self.stats.training_wait_s += time.monotonic() - t0
            self.stats.training = "training"
            await self._sleep_model(self.sc.training.step_s)
            version = k + 1
            uri = await asyncio.to_thread(self.write_snapshot, self.snapshot_dir / f"v{version}", version)
            await asyncio.to_thread(self.cp.training_end, k, weights_version=version, snapshot=uri)
            self.stats.trained_tokens += self._tokens.get(k, 0)
            self.stats.training_steps += 1
            self.stats.last_trained_s = self.stats.elapsed()
            self.stats.training = "idle"
            async with self._batch_done:
                self._trained = k + 1
                self._batch_done.notify_all()
            k += 1
            if self.steps is not None and k >= self.steps:
                return  # the run's last step: ends the run

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
                await asyncio.to_thread(self.cp.gpus_granted, self.preemptible_node, devices)
                self.stats.grants += 1
            if change.revoked:
                devices = [d for w in change.revoked for d in range(w * tp, (w + 1) * tp)]
                await asyncio.to_thread(self.cp.gpus_revoked, self.preemptible_node, devices,
                                        notice_s=notice / self.speed)
                self.stats.revocations += 1
        await self._stop.wait()  # the trace is over, not the run: ending here would end it early


def summary(stats: TrainerStats, speed: float) -> dict[str, Any]:
    wall = stats.elapsed()
    return {"rollout_steps": stats.rollout_steps, "training_steps": stats.training_steps,
            "requests": stats.requests, "failed_requests": stats.failed_requests,
            "resubmitted": stats.resubmitted,
            "tokens_per_s": stats.trained_tokens / (wall * speed) if wall > 0 else 0.0,
            # the simulator's companion: the same tokens over the end of the last training step (a finer
            # comparison on a short run, where the metric moves by whole steps)
            "tokens_per_s_to_last_step": (stats.trained_tokens / (stats.last_trained_s * speed)
                                          if stats.last_trained_s > 0 else 0.0),
            "wall_s": wall, "model_s": wall * speed}
