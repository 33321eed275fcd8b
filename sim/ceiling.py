"""The throughput no system can exceed on a scenario: the floor of every rollout step.

A rollout step ends when its slowest trajectory does. However many GPUs a system has, a
trajectory cannot run faster than alone on a worker of its own: every turn prefills only its new
tokens (the prefix stays cached), decodes at batch 1, and waits for its environment. The slowest
of the batch on that footing is the step's floor. Playing the trainer's schedule (staleness,
training step) with every rollout step at its floor, and without the weight-sync pause, gives the
ceiling of the metric: more than unlimited GPUs and a perfect policy could reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import EngineTiming
from .scenario import Scenario, serving_perf
from .trajectories import Trajectory, sample_batch


@dataclass(frozen=True)
class Ceiling:
    tokens_per_s: float  # the metric with every step at its floor
    training_steps: int  # steps trained within duration_s
    mean_floor_s: float  # mean rollout-step floor over those steps
    floors_s: tuple[float, ...]  # the floor of each rollout step played


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


def ceiling(scenario: Scenario) -> Ceiling:
    """The trainer's schedule (docs/simulator.md, "The trainer") with every rollout step at its floor."""
    timing = EngineTiming(serving_perf(scenario))
    training, duration = scenario.training, scenario.duration_s
    rollout_end, train_end = 0.0, 0.0
    trained_ends: list[float] = []  # when each training step ended
    floors: list[float] = []
    tokens, steps, step = 0, 0, 0
    while True:
        # rollout k starts once rollout k-1 is complete and the weights are at most `staleness` old
        needed = step - training.staleness  # training steps that must be done before it starts
        start = max(rollout_end, trained_ends[needed - 1] if needed > 0 else 0.0)
        if start >= duration:
            break
        batch = sample_batch(scenario.workload, scenario.seed, step)
        floor = max(trajectory_floor_s(t, timing) for t in batch)
        rollout_end = start + floor
        train_end = max(rollout_end, train_end) + training.step_s
        if train_end > duration:
            break
        trained_ends.append(train_end)
        floors.append(floor)
        tokens += sum(t.metric_tokens for t in batch)
        steps += 1
        step += 1
    return Ceiling(tokens / duration, steps, sum(floors) / len(floors) if floors else 0.0, tuple(floors))
