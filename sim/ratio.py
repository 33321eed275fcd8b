"""`pearlctl sim ratio` (the paper's Table 2): the PD configuration the predictor selects for a fixed
budget, beside every candidate's makespan in the simulator.

The budget: the scenario's reserved rollout GPUs (preemptible GPUs ignored) and, with `overlap`,
every training GPU as well, held by rollout workers for the whole run. The trainer still runs its
steps (their timing, the weight sync that pauses every worker, the staleness that gates the next
rollout) but never takes its GPUs back: the budget stays fixed, as the contract has it.

1. Profiling: one colocated run of `profile_workers` workers for `duration_s`. By default one
   worker fewer than the budget: a configuration that is no candidate, so the profile that ranks
   the candidates is never fitted on the telemetry of one of them, while each worker carries
   about the load the candidates' workers do. Each step's telemetry and makespan, warm-up steps
   excepted, are folded into the catalog prior with `tracker.fit_profile`, as the live policy does.
2. Selection: `selector.select(profile, budget)` with nothing running (no hysteresis): the best
   predicted feasible candidate. `select_config` reads the profile and the budget only, never a
   simulated makespan.
3. Measurement: every candidate (colocated, and N_P = 1..N-1 prefill workers) as a static
   configuration (`policies.baselines`). Each run stops once it has finished `warmup + steps`
   rollout steps, so every candidate is measured on the same seeded batches; `simulated_s` is the
   mean makespan of the steps after the warm-up. The first step is the warm-up: it starts on
   engines fresh from the first install (SGLang's admission estimate not yet decayed) and no
   weight sync interrupts it, unlike every later step.

Deterministic: every run is a pure function of (scenario, configuration); with `jobs` > 1 the
candidates run in separate processes and the results are the same.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from pearl.controlplane.core.domain import Mode
from pearl.controlplane.core.predictor import Config
from pearl.controlplane.core.profile import Profile, profile_from_workload
from pearl.controlplane.core.selector import Selection, candidates_for, select
from pearl.controlplane.core.telemetry import StepTelemetry
from pearl.controlplane.core.tracker import fit_profile
from pearl.controlplane.errors import BadInput, PearlError
from pearl.policies.base import Policy
from pearl.policies.baselines import ColocatedBaseline, StaticSplit

from .runner import Simulation
from .scenario import Scenario, serving_perf

WARMUP_STEPS = 1  # the first rollout step (module docstring, 3)
MAX_STRETCH = 50  # a candidate must finish its steps within this many times `duration_s`

Progress = Callable[[str], None]  # called with each candidate's label as its run finishes


@dataclass(frozen=True)
class StaticRun:
    """One configuration run as a static fleet: the makespan and telemetry of every finished step."""

    config: Config
    makespans: tuple[float, ...]
    telemetry: tuple[StepTelemetry, ...]
    wall_s: float

    def mean_makespan(self, warmup: int, steps: int) -> float:
        """Mean makespan of steps warmup .. warmup + steps - 1."""
        chosen = self.makespans[warmup: warmup + steps]
        if len(chosen) < steps:
            raise PearlError(f"{self.config.label}: finished {len(self.makespans)} rollout steps, "
                             f"{warmup + steps} needed")
        return sum(chosen) / steps


class _Recorded(Simulation):
    """A run that keeps every step's telemetry and can stop once `stop_after` steps are finished."""

    def __init__(self, scenario: Scenario, policy: Policy, stop_after: int | None = None) -> None:
        super().__init__(scenario, policy)
        self.stop_after = stop_after
        self.telemetry_log: list[StepTelemetry] = []

    def _rollout_end(self) -> None:
        super()._rollout_end()
        assert self.telemetry is not None
        self.telemetry_log.append(self.telemetry)
        if self.stop_after is not None and len(self.makespans) >= self.stop_after:
            self.halted = True


def budget_workers(scenario: Scenario, overlap: bool) -> int:
    """Workers of the fixed budget: the reserved rollout GPUs, plus the training GPUs with `overlap`."""
    c = scenario.cluster
    return (c.reserved_rollout_gpus + (c.training_gpus if overlap else 0)) // scenario.tp


def with_workers(scenario: Scenario, workers: int) -> Scenario:
    """The scenario with exactly `workers` dedicated rollout workers and no preemptible GPUs."""
    cluster = scenario.cluster.model_copy(update={"preemptible": None,
                                                  "reserved_rollout_gpus": workers * scenario.tp})
    return scenario.model_copy(update={"cluster": cluster, "trace_data": None})


def static_policy(config: Config) -> Policy:
    if config.mode is Mode.COLOCATED:
        return ColocatedBaseline("static-colocated")
    return StaticSplit(config.n_prefill)


def run_static(scenario: Scenario, config: Config, stop_after: int | None = None) -> StaticRun:
    """`config` on exactly its workers, static. `stop_after` None: for `duration_s`; else until that
    many rollout steps are finished (at most MAX_STRETCH x `duration_s`)."""
    wall = time.perf_counter()
    sim = _Recorded(with_workers(scenario, config.workers), static_policy(config), stop_after)
    sim.begin()
    sim.advance(scenario.duration_s if stop_after is None else MAX_STRETCH * scenario.duration_s)
    return StaticRun(config, tuple(sim.makespans), tuple(sim.telemetry_log), time.perf_counter() - wall)


def prior_profile(scenario: Scenario) -> Profile:
    """The catalog prior: the scenario's workload block and the catalog performance model."""
    perf = serving_perf(scenario)
    return profile_from_workload(scenario.workload, perf, rollout=scenario.training.rollout())


def fit_from_run(prior: Profile, run: StaticRun, warmup: int = WARMUP_STEPS) -> Profile:
    """The prior refit with every step of `run` after the warm-up (telemetry and makespan, as the
    live policy folds them)."""
    profile = prior
    for telemetry, makespan in list(zip(run.telemetry, run.makespans, strict=True))[warmup:]:
        profile = fit_profile(profile, telemetry, makespan_s=makespan, config=run.config)
    return profile


def select_config(profile: Profile, workers: int) -> Selection:
    """The predictor's choice for `workers`, nothing running (no hysteresis). No simulated input."""
    return select(profile, workers, None, exhaustive=True)


def _simulate(args: tuple[Scenario, Config, int]) -> tuple[tuple[float, ...], float]:
    scenario, config, stop_after = args
    run = run_static(scenario, config, stop_after)
    return run.makespans, run.wall_s


@dataclass(frozen=True)
class CandidateResult:
    config: Config
    predicted_s: float  # pearl's predictor, with the fitted profile
    paper_s: float  # the paper's formulas, same profile
    feasible: bool
    reason: str
    simulated_s: float  # mean makespan over the measured steps
    makespans: tuple[float, ...]  # every measured step


@dataclass(frozen=True)
class RatioResult:
    scenario: str
    overlap: bool
    tp: int
    budget_workers: int
    selection: Selection
    selection_prior: Selection  # the same selection from the catalog prior alone, for reference
    candidates: tuple[CandidateResult, ...]  # colocated, then N_P = 1..N-1
    profile: Profile
    profile_config: Config
    profile_steps: int
    warmup: int
    steps: int
    wall_s: float

    @property
    def selected(self) -> Config | None:
        return self.selection.chosen

    @property
    def empirical_best(self) -> Config:
        return min(self.candidates, key=lambda c: c.simulated_s).config  # ties: the enumeration order

    def simulated(self, config: Config) -> float:
        return next(c.simulated_s for c in self.candidates if c.config == config)

    @property
    def gap(self) -> float | None:
        """simulated(selected) / simulated(best) - 1; None when nothing was feasible."""
        if self.selected is None:
            return None
        return self.simulated(self.selected) / self.simulated(self.empirical_best) - 1

    @property
    def paper_selected(self) -> Config | None:
        """What the paper's formulas would pick among the same feasible candidates."""
        feasible = [c for c in self.candidates if c.feasible and math.isfinite(c.paper_s)]
        return min(feasible, key=lambda c: c.paper_s).config if feasible else None

    def mape(self, paper: bool = False, mode: Mode | None = None) -> float | None:
        """Mean absolute percentage error of the predictions against the simulator, feasible candidates
        (of one mode when `mode` is given)."""
        rows = [c for c in self.candidates if c.feasible and mode in (None, c.config.mode)]
        if not rows:
            return None
        return sum(abs((c.paper_s if paper else c.predicted_s) / c.simulated_s - 1) for c in rows) / len(rows)

    def as_dict(self) -> dict[str, Any]:
        """The `sim ratio --json` object: the contract's keys first, then the extras."""
        label = _label
        paper_selected = self.paper_selected
        return {
            "selected": label(self.selected),
            "empirical_best": self.empirical_best.label,
            "gap": _round(self.gap, 5),
            "candidates": [
                {
                    "config": c.config.label,
                    "predicted_s": _round(c.predicted_s, 3),
                    "simulated_s": _round(c.simulated_s, 3),
                    "paper_s": _round(c.paper_s, 3),
                    "feasible": c.feasible,
                    "reason": c.reason,
                }
                for c in self.candidates
            ],
            "scenario": self.scenario,
            "overlap": self.overlap,
            "budget_gpus": self.budget_workers * self.tp,
            "budget_workers": self.budget_workers,
            "mape": _round(self.mape(), 5),
            "mape_by_mode": {m.value: _round(self.mape(mode=m), 5) for m in Mode},
            "paper_mape": _round(self.mape(paper=True), 5),
            "paper_selected": label(paper_selected),
            "paper_gap": _round(self.simulated(paper_selected) / self.simulated(self.empirical_best) - 1, 5)
            if paper_selected is not None else None,
            "selected_from_prior": label(self.selection_prior.chosen),
            "reason": self.selection.reason,
            "profile_config": str(self.profile_config),
            "profile_steps": self.profile_steps,
            "symbols": {k: _round(float(v), 9) for k, v in self.profile.symbols().items()},
            "warmup_steps": self.warmup,
            "measured_steps": self.steps,
            "wall_s": round(self.wall_s, 2),
        }


def _label(config: Config | None) -> str | None:
    return config.label if config is not None else None


def _round(x: float | None, digits: int) -> float | None:
    return round(x, digits) if x is not None and math.isfinite(x) else None


def ratio(
    scenario: Scenario,
    overlap: bool = False,
    *,
    steps: int | None = None,
    warmup: int = WARMUP_STEPS,
    profile_workers: int | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
) -> RatioResult:
    """The Table 2 experiment (module docstring). `steps` None: as many as the profiling run finished
    after its warm-up within `duration_s`. `jobs`: processes for the candidates (0: one per CPU)."""
    wall = time.perf_counter()
    n = budget_workers(scenario, overlap)
    if n < 1:
        what = "cluster.reserved_rollout_gpus" + (" + cluster.training_gpus" if overlap else "")
        raise BadInput(f"{what}: the budget holds no rollout worker of tp={scenario.tp} GPUs")
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0), ("profile_workers", profile_workers, 1),
                             ("jobs", jobs, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise BadInput(f"{name}: must be an integer >= {low}, got {value!r}")
    profile_config = Config.colocated(profile_workers or max(1, n - 1))
    profiling = run_static(scenario, profile_config)
    profile_steps = len(profiling.makespans) - warmup
    if profile_steps < 1:
        raise BadInput(f"duration_s: the profiling run ({profile_config}) finished {len(profiling.makespans)} "
                       f"rollout steps in {scenario.duration_s:g} s, {warmup + 1} needed; raise duration_s")
    prior = prior_profile(scenario)
    profile = fit_from_run(prior, profiling, warmup)
    selection = select_config(profile, n)
    selection_prior = select_config(prior, n)
    steps = steps or profile_steps
    configs = candidates_for(n)
    work = [(scenario, c, warmup + steps) for c in configs]
    jobs = jobs or os.cpu_count() or 1
    results: list[tuple[tuple[float, ...], float]] = []
    if jobs == 1 or len(work) == 1:
        for item in work:
            results.append(_simulate(item))
            if progress is not None:
                progress(item[1].label)
    else:
        # fork: the children need nothing re-imported, and a caller's script needs no __main__ guard
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        with ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=context) as pool:
            for item, result in zip(work, pool.map(_simulate, work), strict=True):
                results.append(result)
                if progress is not None:
                    progress(item[1].label)
    ranked = {c.config: c for c in selection.candidates}
    rows = []
    for config, (makespans, _) in zip(configs, results, strict=True):
        run = StaticRun(config, makespans, (), 0.0)
        c = ranked[config]
        rows.append(CandidateResult(config, c.predicted_s, c.paper_s, c.feasible, c.reason,
                                    run.mean_makespan(warmup, steps), makespans[warmup: warmup + steps]))
    return RatioResult(scenario.name, overlap, scenario.tp, n, selection, selection_prior, tuple(rows), profile,
                       profile_config, profile_steps, warmup, steps, time.perf_counter() - wall)
