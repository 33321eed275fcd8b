"""The asynchronous trainer (docs/simulator.md, "The trainer", the same for every system).

With staleness s, the rollout of batch j may start once batch j-1 is complete and the weights are at
most s versions old (training steps done >= j - s). Training step k starts when batch k is complete,
step k-1 is done, and every borrowed training GPU is back; a late return delays it and is counted.
A step takes `step_s` on the training GPUs, then the new weights sync to the rollout workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .scenario import Training


@dataclass
class Trainer:
    config: Training
    batches_done: int = 0  # rollout batches complete
    rollout_step: int = -1  # the batch being rolled out (-1: none yet)
    rolling: bool = False
    trained: int = 0  # training steps done (= the weights version the rollout workers get)
    training: bool = False  # a step occupies the training GPUs
    step_started: float = 0.0
    wanted_since: float | None = None  # the next step could start but borrowed GPUs are not back
    late_returns: int = 0
    lateness_s: float = 0.0
    step_times: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each step

    def can_roll_out(self) -> bool:
        """Whether the next batch's rollout may start now."""
        nxt = self.rollout_step + 1
        return not self.rolling and self.batches_done == nxt and self.trained >= nxt - self.config.staleness

    def start_rollout(self) -> int:
        self.rollout_step += 1
        self.rolling = True
        return self.rollout_step

    def finish_rollout(self) -> None:
        self.rolling = False
        self.batches_done += 1

    def wants_to_train(self) -> bool:
        """A batch is waiting to be trained on and the previous step is done."""
        return not self.training and self.batches_done > self.trained

    def start_training(self, now: float) -> float:
        """Start the next step (its GPUs are all back); returns when it ends."""
        if self.wanted_since is not None:
            late = now - self.wanted_since
            if late > 0:
                self.late_returns += 1
                self.lateness_s += late
            self.wanted_since = None
        self.training = True
        self.step_started = now
        return now + self.config.step_s

    def finish_training(self, now: float) -> int:
        """The step ends; returns the new weights version."""
        self.training = False
        self.trained += 1
        self.step_times.append((self.step_started, now))
        return self.trained
