"""The throughput no system can exceed on a scenario: every trajectory at its floor.

However many GPUs a system has, a trajectory cannot run faster than alone on a worker of its own:
every turn prefills only its new tokens (the prefix stays cached), decodes at batch 1, each at the
fastest efficiency any role runs it at, and waits for its environment. Playing the trainer's
schedule (sim/trainer.py: batch creation, environment slots, staleness, the training step) with
every trajectory at that floor, and without the weight-sync pause, gives the ceiling of the metric:
more than unlimited GPUs and a perfect policy could reach.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pearl.controlplane.core.perfmodel import PerfModel, ServingEfficiency

from .engine import EngineTiming
from .metrics import step_rates
from .scenario import Scenario, serving_perf
from .trajectories import Trajectory, sample_batch


@dataclass(frozen=True)
class Ceiling:
    tokens_per_s: float  # the metric (per-step throughput) with every trajectory at its floor
    training_steps: int  # steps trained within duration_s
    mean_floor_s: float  # mean rollout-step makespan (interval between batch completions) over those steps
    floors_s: tuple[float, ...]  # the makespan of each rollout step played


def trajectory_floor_s(traj: Trajectory, timing: EngineTiming) -> float:
    """The trajectory alone on its own worker: cached prefix, batch-1 decode, environment waits."""
    total, context = 0.0, 0
    new = traj.prompt
    for turn, gen in enumerate(traj.gen):
        total += timing.prefill_iteration([(new, context)])
        context += new
        total += timing.decode_time(1, context, gen)
        context += gen
        if turn < len(traj.obs):
            total += traj.env_s[turn]
            new = traj.obs[turn]
    return total


def fastest(perf: PerfModel) -> PerfModel:
    """The worker at the fastest of its roles' efficiencies: decode as on a decode worker or a colocated
    one, prefill as on a prefill worker or a colocated one, whichever is faster."""
    s = perf.serving
    decode = max(s.decode, s.decode_only if s.decode_only is not None else 0.0)
    prefill = max(s.prefill, s.prefill_only if s.prefill_only is not None else 0.0)
    return replace(perf, serving=ServingEfficiency(decode, prefill))


def ceiling(scenario: Scenario) -> Ceiling:
    """The trainer's schedule (docs/simulator.md, "The trainer") with every trajectory at its floor."""
    timing = EngineTiming(fastest(serving_perf(scenario)))
    training, duration = scenario.training, scenario.duration_s
    slots = [0.0] * scenario.env_slots  # when each environment slot is free
    complete: list[float] = []  # when each batch completed
    trained_ends: list[float] = []  # when each training step ended
    floors: list[float] = []
    tokens: list[int] = []
    step = 0
    while True:
        # batch k exists once k - staleness training steps are done (sync: and batch k-1 is complete)
        needed = step - training.staleness
        created = trained_ends[needed - 1] if needed > 0 else 0.0
        if training.batching == "sync" and complete:
            created = max(created, complete[-1])
        if created >= duration:
            break
        batch = sample_batch(scenario.workload, scenario.seed, step)
        for i, traj in enumerate(batch):  # slot i % S runs trajectories i, i + S, ... in turn
            slot = i % len(slots)
            slots[slot] = max(slots[slot], created) + trajectory_floor_s(traj, timing)
        done = max(slots)
        begin = max(complete[-1] if complete else 0.0, created)
        complete.append(done)
        train_end = max(done, trained_ends[-1] if trained_ends else 0.0) + training.step_s
        if train_end > duration:
            break
        trained_ends.append(train_end)
        floors.append(done - begin)
        tokens.append(sum(t.metric_tokens for t in batch))
        step += 1
    per_step, _ = step_rates(trained_ends, tokens)
    return Ceiling(per_step, len(trained_ends), sum(floors) / len(floors) if floors else 0.0, tuple(floors))
