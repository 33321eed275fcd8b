"""The policy interface: pure, stateless objects with an explicit memory.

`decide(snapshot, signals, memory) -> (Target, memory)`. Everything a policy may use is in its
arguments: the fleet (`FleetSnapshot`), what a live system can know at that instant (`Signals`), and
what the policy remembered from its earlier calls (a frozen dataclass it defines, so that the live
loop can store it in a database row between calls). No I/O, no clock, no randomness: the simulator
and the live loop call the same functions, and a call is a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.fleet import FleetSnapshot, Target
from pearl.controlplane.core.telemetry import StepTelemetry


@dataclass(frozen=True)
class Signals:
    """What a live control plane knows when the policy runs (never the future of the trace)."""

    now: float  # seconds since the run began
    event: str  # what triggered the call: start, rollout_begin, rollout_end, training_wanted,
    # training_begin, training_end, grant, notice, plan_done, plan_failed, forced_release (comma-joined)
    rollout_step: int  # the batch being rolled out (-1 before the first)
    batch_size: int  # B: trajectories per rollout step
    remaining: int  # R: trajectories of the batch in flight not finished yet
    training: bool  # an optimizer step occupies the training GPUs
    training_wanted: bool  # the trainer waits for borrowed GPUs: return them now
    deadlines: Mapping[int, float] = field(default_factory=dict)  # worker -> release-by time (notices)
    telemetry: StepTelemetry | None = None  # of the last finished rollout step
    toggle_costs: tuple[float, ...] = ()  # measured activation + return seconds of recent borrow cycles
    toggle_cycles: int = 0  # borrow cycles measured since the run began (toggle_costs keeps the latest)
    step_durations: Mapping[str, float] = field(default_factory=dict)  # latest measured seconds per action
    # (start_dedicated, start_overlap, load_weights, admit, flip_role, release_overlap), for the switch costs
    weights_version: int = 0
    plans_in_flight: int = 0  # plans being enacted
    last_training_s: float | None = None  # how long the last optimizer step took
    # The tails of the latest complete rollout steps (oldest first, a few): for each, how long before
    # the step's last trajectory finished each of its trajectories did (seconds, ascending; 0 first).
    step_tails: tuple[tuple[float, ...], ...] = ()
    # Trajectories being rolled out now, of every batch (the load on the fleet): with asynchronous
    # batching the environment slots that finished their trajectory of the batch under way already run
    # the next batch's. None: not reported, taken as `remaining` (one batch at a time).
    in_flight: int | None = None

    @property
    def others_in_flight(self) -> int:
        """Trajectories in flight beyond the batch under way's unfinished ones (later batches)."""
        return max(0, self.in_flight - self.remaining) if self.in_flight is not None else 0

    @property
    def remaining_fraction(self) -> float:
        """R/B of the borrowing gate (docs/method.md)."""
        return self.remaining / self.batch_size if self.batch_size else 0.0

    @property
    def load_fraction(self) -> float:
        """The work the fleet has in hand as a share of a batch: the trajectories in flight over B (at
        most 1), or R/B when `in_flight` is not reported. One batch at a time, the two are equal; with
        asynchronous batching the slots done with the batch under way run the next one, and the
        fleet's speed matters to all of them."""
        if self.in_flight is None or not self.batch_size:
            return self.remaining_fraction
        return min(1.0, max(self.in_flight, self.remaining) / self.batch_size)


class Policy(Protocol):
    """A decision rule. Implementations are stateless; their memory travels in and out of `decide`."""

    name: str

    def initial_memory(self) -> Any: ...

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: Any) -> tuple[Target, Any]: ...


@dataclass(frozen=True)
class NoMemory:
    """The memory of a policy that remembers nothing."""


def colocated(members: Iterable[int], reason: str) -> Target:
    """Every member serves prefill and decode on one server."""
    ids = frozenset(members)
    return Target(members=ids, counts={Role.COLOCATED: len(ids)} if ids else {}, reason=reason)


def split(members: Iterable[int], prefill: int, reason: str, pinned: Mapping[int, Role] | None = None) -> Target:
    """`prefill` members serve prefill, the others decode."""
    ids = frozenset(members)
    return Target(
        members=ids,
        counts={Role.PREFILL: prefill, Role.DECODE: len(ids) - prefill},
        pinned=dict(pinned or {}),
        reason=reason,
    )
