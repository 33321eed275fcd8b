"""The RL framework's loop (docs/simulator.md, "The trainer", the same for every system).

Batches are created, rolled out, trained on, in order, as ROLL's pipeline runs each step: the weight
update (`weight_sync_s`, the servers paused), then `get_batch` (which creates the next batches and
waits for the oldest), then the optimizer step. With staleness s:

- `async` (ROLL's asynchronous mode, `async_generation_ratio` = s): batches 0..s exist from the
  start; the weight update after training step k creates batch k + s + 1. Every environment slot
  runs its trajectories back to back, so a slot that finishes its trajectories of batch e starts
  batch e+1 at once if it exists, never more than s batches ahead of the weights.
- `sync`: batch k is created once batch k-1 is complete and the weights of step k-s-1 are in place;
  every trajectory of it starts then (a per-batch barrier).

Batch k is complete when its last trajectory finishes. Training step k starts when batch k is
complete, the weight update after step k-1 is done, and every borrowed training GPU is back; a late
return delays it and is counted. A step takes `step_s` on the training GPUs, then the new weights go
to the rollout workers. The trainer's wait for batch k (ROLL's `time/step_rollout`, the paper's
rollout time) runs from the end of that update to the batch's completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .scenario import Training


@dataclass
class Trainer:
    config: Training
    created: int = 0  # batches created: 0 .. created-1 exist
    batches_done: int = 0  # rollout batches complete (always the oldest first)
    trained: int = 0  # training steps done (= the weights version the rollout workers get)
    updated: int = 0  # weight updates done after them (the weights version the rollout workers run)
    ready_at: float = 0.0  # when the trainer last became ready for a batch (its update done)
    training: bool = False  # a step occupies the training GPUs
    step_started: float = 0.0
    wanted_since: float | None = None  # the next step could start but borrowed GPUs are not back
    late_returns: int = 0
    lateness_s: float = 0.0
    step_times: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each step

    @property
    def rollout_step(self) -> int:
        """The batch under way (the oldest not complete), or the last complete one while the next waits
        to be created (-1 before the first)."""
        return self.batches_done if self.batches_done < self.created else self.batches_done - 1

    @property
    def rolling(self) -> bool:
        """A batch is under way: created and not complete."""
        return self.batches_done < self.created

    def can_create(self) -> bool:
        """Whether the next batch may be created now."""
        k = self.created
        if self.updated < k - self.config.staleness:
            return False
        return self.config.batching == "async" or self.batches_done >= k

    def create(self) -> int:
        self.created += 1
        return self.created - 1

    def finish_rollout(self) -> None:
        self.batches_done += 1

    def wants_to_train(self) -> bool:
        """A batch is waiting to be trained on and the previous step is done, its weights in place."""
        return not self.training and self.updated == self.trained and self.batches_done > self.trained

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
        """The step ends; returns the new weights version (its update follows)."""
        self.training = False
        self.trained += 1
        self.step_times.append((self.step_started, now))
        return self.trained

    def finish_update(self, now: float) -> None:
        """The new weights are in place: the trainer asks for the next batch."""
        self.updated = self.trained
        self.ready_at = now
