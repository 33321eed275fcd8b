"""The PEARL policy: the decision core's selector, the borrowing gate, preemption and growth.

Pure: no I/O, no simulator imports; the simulator and the live policy loop call the same `decide`.
Each call:
1. folds what was measured since the last call into the memory: the step's telemetry refits the
   profile (`tracker.fit_profile`, with the step's makespan when it ran at one configuration, so
   that T_over is fitted), measured borrow cycles refine the toggle cost (`ToggleCost.update`),
   and measured plan-step durations refine the switch costs (`SwitchCosts.with_measured`);
2. takes the budget: the dedicated slots available now (granted, not under a notice: a slot
   under a notice leaves the target at once and is drained before the notice runs out, partial
   trajectories kept) plus, when borrowable, the overlap slots (none while an optimizer step runs
   or the trainer wants its GPUs back: the return is mandatory);
3. gates borrowing (docs/method.md): with T_ded and T_full the predicted makespans of a step on the
   dedicated slots alone and with the overlap slots added, borrow iff (R/B)(T_ded - T_full) >
   T_toggle: R/B scales the whole-step difference to the work left, as the method writes it.
   Each is the makespan of the configuration the selector would run on that budget (its choice
   after hysteresis, not a best it would not switch to). The predictor's remaining-time estimates
   are not used here: mid-step they can rank a superset of the workers slower than the subset
   (the remaining time is measured from the moment each configuration reaches R/B, not from now).
   Once borrowed, the activation is paid and the return is due whatever happens, so the overlap
   slots stay while they still shorten the step (gain > 0), until the tail: once the unfinished
   trajectories are no more than the dedicated workers (one each), the overlap workers no longer
   shorten the step and are given back at once, so that the return is done before the step ends and
   the trainer starts on time (invariant 2); the tail starts earlier by the trajectories expected to
   finish while a return takes (`tail_remaining`: at the step's pace, or as fast as the latest
   steps' ends measured, whichever is more); the target asks to be consulted at that point
   (`Target.recheck_remaining`). A loan of overlap slots that never ran a server must launch them:
   T_toggle then includes the cold start (`borrowing.cold_toggle`), and while no worker serves yet
   (the fleet starts) such slots are warmed up instead, launched and put to sleep at once
   (`Target.warm_up`, `borrowing.warm_ups`), so that later loans wake them in seconds;
4. lets the selector pick the configuration for that budget against the current one, with its
   hysteresis (`selector.select`); forced switches (the current shape became infeasible, or
   nothing runs) are never blocked there;
5. returns a Target: the members and the counts per role, with the reasons. New slots join it and
   the orchestrator starts them in the background as one all-or-nothing group.

Hysteresis horizon: a switch must pay for itself within the remainder of the step under way (the
selector's `horizon_s` = 0): the budget changes again at the next training begin when borrowing,
and with the preemptible trace's next change otherwise, so no later step can be counted on.

The ablations are constructor options: `borrow` = gated | never (pearl-pd-only) | always
(pearl-ungated), and `forced_split` (always split, at the ratio the predictor prefers among splits).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from pearl.controlplane.core.domain import Activity, Mode
from pearl.controlplane.core.fleet import FleetSnapshot, Target
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.predictor import Config, predict
from pearl.controlplane.core.profile import (
    Profile,
    Rollout,
    profile_from_dict,
    profile_from_workload,
    profile_to_dict,
)
from pearl.controlplane.core.selector import Candidate, Selection, current_config, select
from pearl.controlplane.core.switching import SwitchCosts, decide_switch, margin
from pearl.controlplane.core.tracker import fit_profile
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.errors import BadInput
from pydantic import BaseModel, ConfigDict, ValidationError

from .base import Signals, colocated, split
from .borrowing import GateDecision, ToggleCost, borrowable, cold_toggle, gate, toggle_cost_prior, warm_ups
from .elasticity import dedicated_capacity

MIXED = "mixed"  # the step ran at more than one configuration: its makespan says nothing about T_over


class Borrow(StrEnum):
    """When the policy borrows the training GPUs between optimizer steps."""

    GATED = "gated"  # the borrowing gate of docs/method.md
    NEVER = "never"  # pearl-pd-only
    ALWAYS = "always"  # pearl-ungated: whenever they are idle


@dataclass(frozen=True)
class PearlMemory:
    """What the policy carries between calls; `to_dict` / `from_dict` store it as one JSON value."""

    profile: Profile  # the prior, then refit from every step's telemetry
    toggle: ToggleCost  # T_toggle of the gate
    costs: SwitchCosts  # the hysteresis' switch costs
    fitted_step: int = -1  # the last rollout step whose telemetry is in the profile
    step: int = -1  # the rollout step under way, timed for the T_over fit
    step_began_s: float = 0.0
    step_config: str = ""  # the configuration the step ran at ("" before any, MIXED when it changed)
    durations: Mapping[str, float] = field(default_factory=dict)  # step durations already folded into costs

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": profile_to_dict(self.profile),
            "toggle": asdict(self.toggle),
            "costs": asdict(self.costs),
            "fitted_step": self.fitted_step,
            "step": self.step,
            "step_began_s": self.step_began_s,
            "step_config": self.step_config,
            "durations": dict(self.durations),
        }

    @classmethod
    def from_dict(cls, raw: Any) -> PearlMemory:
        """Rebuild from `to_dict`'s output; BadInput names the faulty field."""
        if not isinstance(raw, Mapping) or "profile" not in raw:
            raise BadInput("memory: a mapping with a profile is expected")
        rest = {k: v for k, v in raw.items() if k != "profile"}
        try:
            fields = _MemoryFields.model_validate(rest)
        except ValidationError as exc:
            where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise BadInput(f"memory: {where}") from None
        return cls(
            profile=profile_from_dict(raw["profile"]),
            toggle=ToggleCost(**fields.toggle.model_dump()),
            costs=SwitchCosts(**fields.costs.model_dump()),
            fitted_step=fields.fitted_step,
            step=fields.step,
            step_began_s=fields.step_began_s,
            step_config=fields.step_config,
            durations=dict(fields.durations),
        )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Toggle(_Strict):
    seconds: float
    measured: int = 0


class _Costs(_Strict):
    cold_start_s: float
    admit_s: float
    role_switch_s: float
    weight_sync_s: float = 0.0


class _MemoryFields(_Strict):
    toggle: _Toggle
    costs: _Costs
    fitted_step: int = -1
    step: int = -1
    step_began_s: float = 0.0
    step_config: str = ""
    durations: dict[str, float] = {}


@dataclass(frozen=True)
class Option:
    """What the policy would run on one budget of workers."""

    workers: int
    selection: Selection  # the selector's ranking and hysteresis numbers for this budget
    config: Config | None  # what would run (after hysteresis; the best split when forced); None: nothing feasible
    predicted_s: float  # its predicted remaining makespan of the step under way
    step_s: float  # its predicted makespan of a whole step: the gate's T_ded or T_full
    reason: str


@dataclass(frozen=True)
class Assessment:
    """The budgets and the borrowing verdict behind one decision."""

    dedicated: tuple[int, ...]  # dedicated slots available now
    overlap: tuple[int, ...]  # overlap slots borrowable now (none while training runs or wants them)
    on_dedicated: Option | None
    with_overlap: Option | None  # None when nothing is borrowable
    gate: GateDecision | None  # the gate's numbers, when it was consulted
    borrow: bool
    verdict: str  # why (or why not) the overlap slots are held


# The return's lead time, as a share of T_toggle (activation + weights + return): the whole of it, a
# bound on the return alone that keeps returns on time in the simulator (7 late returns of 13 steps on
# demo-qwen3-30b-a3b-seg2 with the dedicated count alone, 1 with half of T_toggle, none with all of it).
RETURN_SHARE = 1.0


def tail_remaining(dedicated: int, batch: int, toggle_s: float, step_s: float,
                   tails: tuple[tuple[float, ...], ...] = (), others: int = 0) -> int:
    """How many unfinished trajectories mark the tail of a step, when borrowed GPUs go back: one per
    dedicated worker not already busy with the `others` trajectories in flight of later batches
    (once every trajectory in flight fits the dedicated workers one each, the overlap workers no
    longer shorten anything), plus those expected to finish while a return takes (lead L = T_toggle
    x RETURN_SHARE), so that the return is done in time.

    The expected finishes are the larger of two estimates: the batch finishing at an even pace over
    the step (B x L / T_step), and what the latest steps measured (`Signals.step_tails`): the largest
    share of a step's trajectories that finished within L of its end, times B. A batch's trajectories
    start together and often end together (as the rollout thins out, the last ones decode faster),
    so the end of a step can run several times faster than its average pace, which the even pace
    alone misses."""
    lead = RETURN_SHARE * toggle_s
    paced = math.ceil(batch * lead / step_s) if math.isfinite(step_s) and step_s > 0 else 0
    measured = max((-(-batch * bisect.bisect_right(t, lead) // len(t)) for t in tails if t), default=0)
    return max(0, dedicated - others) + max(paced, measured)


@dataclass(frozen=True)
class PearlPolicy:
    """The `pearl` system's policy and its ablations (module docstring)."""

    prior: Profile  # the workload block with the catalog perf model, until telemetry arrives
    toggle_prior: ToggleCost
    costs_prior: SwitchCosts
    name: str = "pearl"
    borrow: Borrow = Borrow.GATED
    forced_split: bool = False
    # The last assessment and what it was made of, compared by identity: `decide` and the caller's
    # explanation ask the same question of the same objects within one pass (the memory after the
    # fold differs only in the step bookkeeping, which the assessment does not read).
    _assessed: list[Any] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        workload: Workload,
        perf: PerfModel,
        reconfig: Any,
        weight_sync_s: float,
        *,
        name: str = "pearl",
        borrow: Borrow = Borrow.GATED,
        forced_split: bool = False,
        rollout: Rollout | None = None,
    ) -> PearlPolicy:
        """From a scenario's or an inventory's workload block, perf model and `reconfig` costs."""
        return cls(
            prior=profile_from_workload(workload, perf, rollout=rollout),
            toggle_prior=toggle_cost_prior(reconfig.toggle_on_s, reconfig.toggle_off_s, weight_sync_s),
            costs_prior=SwitchCosts.from_reconfig(reconfig, weight_sync_s),
            name=name,
            borrow=Borrow(borrow),
            forced_split=forced_split,
        )

    def initial_memory(self) -> PearlMemory:
        return PearlMemory(self.prior, self.toggle_prior, self.costs_prior)

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: PearlMemory) -> tuple[Target, PearlMemory]:
        memory = _observe(memory, signals)
        a = self.assess(snapshot, signals, memory)
        notes = []
        if signals.deadlines:
            notes.append(f"releasing {sorted(signals.deadlines)} before their notice runs out")
        if self.borrow is not Borrow.NEVER and not a.overlap and (signals.training or signals.training_wanted):
            notes.append("training runs or wants its GPUs: no overlap slot")
        if a.verdict:
            notes.append(a.verdict)
        option = a.with_overlap if a.borrow else a.on_dedicated
        members = [*a.dedicated, *(a.overlap if a.borrow else ())]
        if option is None or not members:
            target = colocated([], "; ".join(["no rollout slot available", *notes]))
        elif option.config is None:
            target = colocated(members, "; ".join([f"{option.reason}: colocated", *notes]))
        elif option.config.mode is Mode.COLOCATED:
            target = colocated(members, "; ".join([option.reason, *notes]))
        else:
            target = split(members, option.config.n_prefill, "; ".join([option.reason, *notes]))
        if self.borrow is not Borrow.NEVER:
            warm = warm_ups(snapshot, a.overlap, target.members)
            if warm:
                target = replace(target, warm_up=warm, reason=target.reason + (
                    f"; warming up {sorted(warm)}: their servers launch now and sleep until a loan wakes them"))
        if a.borrow and a.dedicated:
            # wake the policy at the tail of the step to give the borrowed GPUs back in time
            step_s = a.with_overlap.step_s if a.with_overlap is not None else math.inf
            target = replace(target, recheck_remaining=tail_remaining(
                len(a.dedicated), signals.batch_size, memory.toggle.seconds, step_s, signals.step_tails,
                signals.others_in_flight))
        return target, _record(memory, signals, option.config if option is not None else None)

    def assess(self, snapshot: FleetSnapshot, signals: Signals, memory: PearlMemory) -> Assessment:
        """The budgets, what the selector would run on each, and the gate's verdict (module docstring,
        2-4); `decide` turns it into a target, `pearlctl plan --explain` can show it."""
        inputs = (snapshot, signals, memory.profile, memory.costs, memory.toggle)
        if self._assessed and all(a is b for a, b in zip(self._assessed[0], inputs, strict=True)):
            return self._assessed[1]
        assessment = self._assess(snapshot, signals, memory)
        self._assessed[:] = [inputs, assessment]
        return assessment

    def _assess(self, snapshot: FleetSnapshot, signals: Signals, memory: PearlMemory) -> Assessment:
        dedicated = tuple(w.id for w in dedicated_capacity(snapshot))
        overlap = tuple(w.id for w in borrowable(snapshot, signals)) if self.borrow is not Borrow.NEVER else ()
        # The shape of the workers that stay: those leaving (notices, mandatory return) do not count.
        current = current_config(FleetSnapshot(snapshot.state_version, tuple(
            w for w in snapshot.workers if w.available or w.activity is Activity.INACTIVE), snapshot.tp))
        # the work in hand (R/B one batch at a time); no step under way: the next, whole
        rf = signals.load_fraction if signals.remaining > 0 else 1.0

        def option(n: int) -> Option | None:
            if n <= 0:
                return None
            sel = select(memory.profile, n, current, costs=memory.costs, remaining_fraction=rf)
            config, predicted_s, reason = self._pick(sel, memory.costs)
            if config is None or not math.isfinite(predicted_s):
                step_s = math.inf
            elif rf >= 1:
                step_s = predicted_s
            else:
                step_s = predict(memory.profile, config).makespan_s
            return Option(n, sel, config, predicted_s, step_s, reason)

        on_dedicated = option(len(dedicated))
        if not overlap:
            return Assessment(dedicated, overlap, on_dedicated, None, None, False, "")
        with_overlap = option(len(dedicated) + len(overlap))
        ids = set(overlap)
        holding = any(w.id in ids and w.activity is not Activity.INACTIVE for w in snapshot.workers)
        # the tail, when borrowed workers go back; held ones early enough for their return to finish
        step_s = with_overlap.step_s if with_overlap is not None else math.inf
        tail = tail_remaining(len(dedicated), signals.batch_size, memory.toggle.seconds, step_s,
                              signals.step_tails, signals.others_in_flight) if holding or signals.in_flight \
            is not None else len(dedicated)
        if 0 < signals.remaining <= tail:
            # The tail of the step: the unfinished trajectories fit the dedicated workers one each (or
            # will by the time a return takes), so the overlap workers no longer shorten it; give
            # their GPUs back now, while the return can finish before the step ends and the trainer
            # wants them.
            verdict = (f"tail: {signals.remaining} unfinished trajectories (the tail starts at {tail}: "
                       f"{len(dedicated)} dedicated workers, and what finishes while a return takes); "
                       "the training GPUs go back before the step ends")
            return Assessment(dedicated, overlap, on_dedicated, with_overlap, None, False, verdict)
        if self.borrow is Borrow.ALWAYS:
            return Assessment(dedicated, overlap, on_dedicated, with_overlap, None, True,
                              f"borrowing {len(overlap)} overlap workers (ungated)")
        t_ded = on_dedicated.step_s if on_dedicated is not None else math.inf
        t_full = with_overlap.step_s if with_overlap is not None and math.isfinite(with_overlap.step_s) else t_ded
        # a loan that must launch servers (slots never warmed up) pays their cold start
        cold = sum(1 for w in snapshot.workers if w.id in ids and not w.warm and w.activity is Activity.INACTIVE)
        g = gate(rf, t_ded, t_full, cold_toggle(memory.toggle, memory.costs.cold_start_s, cold))
        if g.borrow:
            return Assessment(dedicated, overlap, on_dedicated, with_overlap, g, True, "gate: " + g.reason)
        if holding and g.gain_s > 0:
            verdict = f"gate: keep the borrowed workers, they still save {g.gain_s:.1f} s (activation paid)"
            return Assessment(dedicated, overlap, on_dedicated, with_overlap, g, True, verdict)
        return Assessment(dedicated, overlap, on_dedicated, with_overlap, g, False, "gate: " + g.reason)

    def _pick(self, sel: Selection, costs: SwitchCosts) -> tuple[Config | None, float, str]:
        """The configuration to run, its predicted remaining makespan (what the gate compares: the
        configuration that would actually run on that budget, hysteresis included; inf when nothing
        is feasible), and why."""
        if not self.forced_split:
            t = _predicted(sel, sel.chosen) if sel.chosen is not None else math.inf
            return sel.chosen, t, sel.reason
        splits = [c for c in sel.candidates if c.feasible and c.config.mode is Mode.SPLIT]
        note = ""
        if not splits:  # always split: the fastest predicted split even if the predictor deems none feasible
            splits = sorted((c for c in sel.candidates if c.config.mode is Mode.SPLIT), key=lambda c: c.predicted_s)
            note = " (no split is feasible by the predictor)"
        if not splits:
            t = _predicted(sel, sel.chosen) if sel.chosen is not None else math.inf
            return sel.chosen, t, f"forced split: one worker cannot split ({sel.reason})"
        best = splits[0]
        reference = _split_continuation(sel.current, best.config.workers)
        ref = next((c for c in splits if c.config == reference), None)
        if ref is None or ref.config == best.config:
            return best.config, best.predicted_s, f"forced split: {best.config} is the best split{note}"
        d = decide_switch(ref.config, ref.predicted_s, best.config, best.predicted_s, costs,
                          margin=margin(0.0, 0.0, same_mode=True))
        kept = best if d.switch else ref
        return kept.config, kept.predicted_s, f"forced split: {d.reason}{note}"


def _predicted(sel: Selection, config: Config) -> float:
    found: Candidate | None = next((c for c in sel.candidates if c.config == config), None)
    return found.predicted_s if found is not None and found.feasible else math.inf


def _split_continuation(current: Config | None, n: int) -> Config | None:
    """The current split at `n` workers, keeping its P:D ratio (None when it is not a split)."""
    if current is None or current.mode is not Mode.SPLIT or n < 2:
        return None
    p = min(n - 1, max(1, round(current.n_prefill * n / current.workers)))
    return Config.split(p, n - p)


def _observe(memory: PearlMemory, signals: Signals) -> PearlMemory:
    """Fold in what was measured since the last call (module docstring, 1)."""
    profile = memory.profile
    tel = signals.telemetry
    if tel is not None and tel.step > memory.fitted_step:
        config = _config_of(memory.step_config) if memory.step == tel.step else None
        makespan = signals.now - memory.step_began_s if config is not None else None
        profile = fit_profile(profile, tel, makespan_s=makespan if makespan and makespan > 0 else None,
                              config=config)
    changed = {k: v for k, v in signals.step_durations.items() if memory.durations.get(k) != v}
    costs = memory.costs.with_measured(changed) if changed else memory.costs
    return replace(
        memory,
        profile=profile,
        toggle=memory.toggle.update(signals),
        costs=costs,
        fitted_step=tel.step if tel is not None else memory.fitted_step,
        durations={**memory.durations, **changed},
    )


def _record(memory: PearlMemory, signals: Signals, chosen: Config | None) -> PearlMemory:
    """Time the step under way and note the configuration it runs at."""
    label = chosen.label + f"/{chosen.workers}" if chosen is not None else MIXED
    if signals.rollout_step != memory.step:
        if signals.remaining <= 0:
            return memory
        return replace(memory, step=signals.rollout_step, step_began_s=signals.now, step_config=label)
    if memory.step_config not in ("", label):
        label = MIXED
    return replace(memory, step_config=label)


def _config_of(label: str) -> Config | None:
    """The inverse of `_record`'s label ('colocated/8', '2P6D/8'); None for a mixed step."""
    if not label or label == MIXED:
        return None
    shape, _, workers = label.partition("/")
    if shape == "colocated":
        return Config.colocated(int(workers))
    p, _, d = shape.rstrip("D").partition("P")
    return Config.split(int(p), int(d))

