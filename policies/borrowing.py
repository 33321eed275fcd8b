"""Borrowing the idle training GPUs between optimizer steps: the gate and the mandatory return.

The gate (docs/method.md): with R of B trajectories of the step still unfinished, T_ded the predicted
makespan on the dedicated workers alone and T_full with the overlap workers added, borrow only if

    (R/B) * (T_ded - T_full) > T_toggle,

T_toggle being what one borrow cycle costs: activation (resume memory, load weights) plus return
(drain, keep partials, release memory). It starts from the configured costs and becomes an
exponential moving average of the cycles measured (`Signals.toggle_costs`).

The return is never optional: while an optimizer step runs or the trainer waits for its GPUs
(`Signals.training_wanted`), the overlap slots are unavailable and no target may hold them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot
from pearl.controlplane.errors import BadInput

from .base import Signals
from .elasticity import overlap_capacity

TOGGLE_EMA = 0.3  # weight of a newly measured borrow cycle in the toggle-cost estimate


@dataclass(frozen=True)
class ToggleCost:
    """The toggle-cost estimate a policy keeps in its memory."""

    seconds: float  # T_toggle: activation plus return
    measured: int = 0  # borrow cycles folded in so far

    def update(self, signals: Signals) -> ToggleCost:
        """Fold in the cycles measured since the last call (`signals.toggle_cycles` counts them all)."""
        new = signals.toggle_cycles - self.measured
        if new <= 0:
            return self
        estimate = self.seconds
        for cost in signals.toggle_costs[-new:]:  # the signals keep the latest few; older ones are folded
            estimate = (1 - TOGGLE_EMA) * estimate + TOGGLE_EMA * cost
        return ToggleCost(estimate, signals.toggle_cycles)


def toggle_cost_prior(toggle_on_s: float, toggle_off_s: float, weight_sync_s: float) -> ToggleCost:
    """Before any cycle is measured: the configured activation, weight load and return."""
    for name, v in (("toggle_on_s", toggle_on_s), ("toggle_off_s", toggle_off_s), ("weight_sync_s", weight_sync_s)):
        if not math.isfinite(v) or v < 0:
            raise BadInput(f"reconfig.{name}: must be a finite number >= 0, got {v}")
    return ToggleCost(toggle_on_s + weight_sync_s + toggle_off_s)


def cold_toggle(toggle: ToggleCost, cold_start_s: float, cold: int) -> ToggleCost:
    """T_toggle of a loan that must launch `cold` servers (overlap slots with no sleeping server,
    `WorkerSlot.warm`): the launch comes on top of the cycle, and a launch under way cannot be cut
    short when the trainer wants its GPUs."""
    return replace(toggle, seconds=toggle.seconds + cold_start_s) if cold else toggle


@dataclass(frozen=True)
class GateDecision:
    borrow: bool
    gain_s: float  # (R/B) * (T_ded - T_full)
    cost_s: float  # T_toggle
    reason: str


def gate(remaining_fraction: float, t_dedicated_s: float, t_full_s: float, toggle: ToggleCost) -> GateDecision:
    """The borrowing gate of docs/method.md."""
    if not 0 <= remaining_fraction <= 1:
        raise BadInput(f"remaining_fraction: must be in [0, 1], got {remaining_fraction}")
    for name, v in (("t_dedicated_s", t_dedicated_s), ("t_full_s", t_full_s)):
        if math.isnan(v) or v < 0:
            raise BadInput(f"{name}: must be a number >= 0, got {v}")
    gain = remaining_fraction * (t_dedicated_s - t_full_s) if math.isfinite(t_dedicated_s) else math.inf
    borrow = gain > toggle.seconds
    verdict = "borrow" if borrow else "do not borrow"
    reason = f"{verdict}: (R/B) x (T_ded - T_full) = {gain:.1f} s vs T_toggle {toggle.seconds:.1f} s"
    return GateDecision(borrow, gain, toggle.seconds, reason)


def warm_ups(snapshot: FleetSnapshot, borrowable_now: tuple[int, ...], members: frozenset[int]) -> frozenset[int]:
    """The overlap slots to launch and put to sleep now (`Target.warm_up`): the borrowable ones that
    never ran a server and are not borrowed, while no worker serves. The fleet is then starting, and
    the trainer cannot want its GPUs before a batch has been rolled out on workers still to be
    started, so a launch (a cold start) finishes in time; later loans wake the server in seconds."""
    if any(w.active for w in snapshot.workers):
        return frozenset()
    slots = snapshot.by_id()
    return frozenset(i for i in borrowable_now if not slots[i].warm and i not in members)


def borrowable(snapshot: FleetSnapshot, signals: Signals) -> tuple[WorkerSlot, ...]:
    """The overlap slots a target may hold now: none while training runs or wants its GPUs back."""
    if signals.training or signals.training_wanted:
        return ()
    return overlap_capacity(snapshot)
