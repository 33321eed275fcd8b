"""Hysteresis for PD reconfiguration: switch only when the predicted gain pays for the switch.

Pure: no I/O. The selector calls `decide_switch` for a candidate that beats the current
configuration; the costs are measured (scenario `reconfig` figures to start with, then the
durations the executor observes, `SwitchCosts.observe`).

Derivation. Let W be the rollout time the choice will govern, in the current configuration's
seconds: the predicted remainder of this step plus `horizon_s`, the time the new configuration is
expected to stay (until the next budget change, or the steps still ahead). A candidate predicted
to run the same work in T_new instead of T_cur saves
    gain = (1 - T_new / T_cur) * W.
Switching stalls the rollout for
    ratio change (N_P -> N_P', same N): k = |N_P' - N_P| workers flip in place, each out of service
        for role_switch_s (a flipped server keeps its process and weights and only re-registers
        with the router: no group admission, no admit_s); the other N - k keep serving, so the step
        is delayed by about k * role_switch_s / N  (lost worker-seconds spread over the fleet);
    mode change (colocated <-> split): every worker restarts (drain, interrupt keeping partial
        trajectories, release, cold start, load weights, admit as one group) and the router's
        front door changes, so nothing serves for cold_start_s + weight_sync_s + admit_s; the
        live trajectories then re-prefill their whole context on the new fleet (`refill_s`).
Switch iff gain > cost + margin * W. The margin keeps the fleet still when two predictions differ by
less than the predictor can tell apart, and comes from the prediction's measured error
(`margin`): one standard deviation of the difference of the two predictions. Across modes the two
errors are independent, each the mode's error after what ran in it (`Profile.mode_adjustment`:
MODEL_ERROR for a mode that never ran, less as the steps of a mode measure its correction); within a
mode the correction is shared and only the model's error from one ratio to another is left
(RATIO_ERROR). Since a mode change also costs a whole-fleet cold start and a ratio change a few
in-place flips, the mode-switch threshold is always the larger one. A forced switch (nothing
running, the current shape infeasible, or the budget no longer has its worker count) is never
blocked: the selector only applies this between feasible candidates of the new budget.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pearl.controlplane.core.predictor import Config
from pearl.controlplane.errors import BadInput

NOISE_MARGIN = 0.02  # the margin when the caller knows nothing of the prediction's error
# The model's error from one P:D ratio to another of the same mode, once the mode's own correction is
# shared: the spread (sd) of log(predicted / simulated) among the splits within 5% of the best in each
# Table 2 setting (bench/table2.py: 0.8-1.3%, about 1%)
RATIO_ERROR = 0.01
COST_EMA = 0.3  # weight of a newly observed duration in the measured costs
# measured plan-step durations (by action) -> the cost they measure
STEP_COSTS = {
    "start_dedicated": "cold_start_s",
    "load_weights": "weight_sync_s",
    "admit": "admit_s",
    "flip_role": "role_switch_s",
}


@dataclass(frozen=True)
class ReconfigCosts:
    """What each actuator costs before anything is measured: the paper's latencies (docs/method.md:
    inter-scale preparation 56-67 s in the background, admission 11-18 s, borrow activation ~6 s,
    return 3-4 s; docs/calibration.md: SGLang role switch, weight sync ~2 s for an 8B model). The
    same figures as the shipped Qwen3-8B scenarios' `reconfig` block; the live policy starts from
    them and folds in what its steps measure."""

    cold_start_s: float = 60.0  # start a server (a colocated <-> split change restarts every one)
    admit_s: float = 12.0  # admit a ready expansion group
    role_switch_s: float = 8.0  # prefill <-> decode in place
    toggle_on_s: float = 6.0  # resume a borrowed GPU's sleeping server
    toggle_off_s: float = 3.5  # return it: drain, keep partials, release memory
    weight_sync_s: float = 2.0  # load the latest weights into a (re)started server


DEFAULT_RECONFIG = ReconfigCosts()


@dataclass(frozen=True)
class SwitchCosts:
    """Measured durations (seconds) of the actuators a reconfiguration uses."""

    cold_start_s: float  # start a server on its GPUs (a mode change restarts every worker)
    admit_s: float  # make a ready worker or group visible to the router
    role_switch_s: float  # prefill <-> decode in place on an idle server
    weight_sync_s: float = 0.0  # load the latest weights into a (re)started server

    def __post_init__(self) -> None:
        for name in ("cold_start_s", "admit_s", "role_switch_s", "weight_sync_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise BadInput(f"switch costs: {name} must be a finite number >= 0, got {v}")

    @classmethod
    def from_reconfig(cls, reconfig: Any, weight_sync_s: float = 0.0) -> SwitchCosts:
        """The scenario's `reconfig` block (and `training.weight_sync_s`): the costs before any is measured."""
        return cls(reconfig.cold_start_s, reconfig.admit_s, reconfig.role_switch_s, weight_sync_s)

    def with_measured(self, step_durations: Mapping[str, float], alpha: float = COST_EMA) -> SwitchCosts:
        """Fold the executor's latest measured step durations (by action, as the simulator and the
        plan store report them: start_dedicated, load_weights, admit, flip_role) into the costs."""
        costs = self
        for action, name in STEP_COSTS.items():
            if action in step_durations:
                costs = costs.observe(name, step_durations[action], alpha)
        return costs

    def observe(self, name: str, seconds: float, alpha: float = COST_EMA) -> SwitchCosts:
        """Fold one observed duration of `name` (e.g. "role_switch_s") into the estimate."""
        if name not in ("cold_start_s", "admit_s", "role_switch_s", "weight_sync_s"):
            raise BadInput(f"switch costs: unknown cost {name!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise BadInput(f"switch costs: observed {name} must be a finite number >= 0, got {seconds}")
        return replace(self, **{name: (1 - alpha) * getattr(self, name) + alpha * seconds})


@dataclass(frozen=True)
class SwitchDecision:
    """Whether to move from `current` to `candidate`, with the numbers that decided it."""

    switch: bool
    gain_s: float  # predicted seconds saved over the governed work
    cost_s: float  # predicted stall of the switch
    threshold_s: float  # cost + noise margin: the gain must exceed it
    work_s: float  # the rollout time the choice governs
    reason: str


def switch_cost_s(current: Config, candidate: Config, costs: SwitchCosts, refill_s: float = 0.0) -> float:
    """The stall a switch causes (module docstring). Worker-count changes are not charged here:
    they follow the budget whatever the shape."""
    if current.mode is not candidate.mode:
        return costs.cold_start_s + costs.weight_sync_s + costs.admit_s + refill_s
    if current.n_colocated:
        return 0.0
    flips = abs(candidate.n_prefill - round(current.n_prefill * candidate.workers / current.workers))
    return flips * costs.role_switch_s / candidate.workers


def decide_switch(
    current: Config,
    current_s: float,
    candidate: Config,
    candidate_s: float,
    costs: SwitchCosts,
    *,
    horizon_s: float = 0.0,
    refill_s: float = 0.0,
    margin: float = NOISE_MARGIN,
) -> SwitchDecision:
    """Switch iff (1 - T_new/T_cur) * W > cost + margin * W, W = current_s + horizon_s.

    `current_s` and `candidate_s` are the predicted remaining makespans of this step; `margin` the
    relative error of their difference (`margin`).
    """
    if not all(math.isfinite(x) and x >= 0 for x in (current_s, candidate_s, horizon_s, refill_s, margin)):
        raise BadInput("switching: predicted seconds, horizon_s, refill_s and margin must be finite numbers >= 0")
    work = current_s + horizon_s
    cost = switch_cost_s(current, candidate, costs, refill_s)
    gain = (1 - candidate_s / current_s) * work if current_s > 0 else 0.0
    threshold = cost + margin * work
    kind = "mode switch" if current.mode is not candidate.mode else "ratio change"
    verdict = "switch" if gain > threshold else "keep"
    reason = (
        f"{verdict}: {candidate} saves {gain:.1f} s over {work:.0f} s of rollout; "
        f"{kind} threshold {threshold:.1f} s (cost {cost:.1f} s + {margin:.1%} margin)"
    )
    return SwitchDecision(gain > threshold, gain, cost, threshold, work, reason)


def margin(current_error: float, candidate_error: float, same_mode: bool) -> float:
    """One standard deviation of the relative difference of two predictions (module docstring):
    `*_error` are the modes' errors (`Profile.mode_adjustment`)."""
    if same_mode:
        return math.sqrt(2) * RATIO_ERROR
    return math.sqrt(current_error**2 + candidate_error**2)


DEFAULT_COSTS = SwitchCosts.from_reconfig(DEFAULT_RECONFIG, DEFAULT_RECONFIG.weight_sync_s)
