"""What `pearlctl sim run | compare` do: one system on a scenario, or every system side by side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .metrics import Result
from .runner import simulate
from .scenario import Scenario
from .spread import spread
from .systems import ABLATIONS, SYSTEMS, system

Progress = Callable[[str, float], None]  # (system, simulated seconds so far)
BASELINES_FOR_RATIOS = ("roll", "rlboost-plus")
# The oracle is greedy per step (sim/oracle.py): a step it ends first may leave the next one in a
# slightly worse phase of the trainer and the trace, so its step end may trail another system's a little.
STEP_END_TOLERANCE = 0.01


def run_system(scenario: Scenario, name: str, progress: Progress | None = None) -> Result:
    """Simulate system `name` on `scenario` (on the GPUs that system may use)."""
    chosen = system(name)
    cluster = chosen.cluster(scenario)
    report = (lambda t: progress(name, t)) if progress is not None else None
    if chosen.run is not None:
        result = chosen.run(cluster, report)
    else:
        result = simulate(cluster, chosen.policy(cluster), report)
    if progress is not None:  # the run reports at events, at most once a simulated minute: now it is over
        progress(name, scenario.duration_s)
    return result


@dataclass
class Comparison:
    scenario: str
    systems: dict[str, Result]
    ablations: dict[str, Result] = field(default_factory=dict)
    with_ablations: bool = False  # `--ablations`: the JSON then has an `ablations` key

    def ratios(self, name: str, group: str = "systems") -> dict[str, float | None]:
        """tokens_per_s of `name` over each baseline's (None when a baseline did not run or is 0)."""
        results = getattr(self, group)
        mine = results[name].tokens_per_s
        out: dict[str, float | None] = {}
        for base in BASELINES_FOR_RATIOS:
            ref = self.systems.get(base)
            out[f"vs_{base}"] = round(mine / ref.tokens_per_s, 4) if ref and ref.tokens_per_s > 0 else None
        return out

    def checks(self) -> dict[str, Any]:
        """`oracle_upper_bound`: the oracle is at least every other system and ablation (docs/method.md),
        step by step and by the window metric; a violation is reported, never hidden.

        What the oracle maximizes is how early each step ends (every system trains the same seeded
        batches). So it is checked there: over the training steps both completed, the oracle ends
        each no later than the other system, within STEP_END_TOLERANCE of that system's end time.
        `margin` is (their end - the oracle's end) / their end, negative when the oracle ended later;
        the worst (smallest) over every system and step is reported. The window metric (the trained
        steps' tokens over the run) follows from the step ends and is checked too. The per-step
        metric, a mean of each step's rate, does not: a system that ends its first step late (that
        step is dropped) and its second early scores a high rate on that one interval, so a short run
        can put it above the oracle's while the oracle ended every step first."""
        oracle = self.systems.get("oracle")
        if oracle is None:
            return {}
        others = {n: r for n, r in {**self.systems, **self.ablations}.items() if n != "oracle"}
        bound = round(oracle.tokens_per_s_window, 3)
        violations = [
            {"system": n, "tokens_per_s_window": round(r.tokens_per_s_window, 3), "oracle_tokens_per_s_window": bound}
            for n, r in others.items() if r.tokens_per_s_window > oracle.tokens_per_s_window
        ]
        steps = _step_end_check(oracle, others)
        return {"oracle_upper_bound": {"ok": not violations and steps["ok"], "violations": violations,
                                       "step_ends": steps}}

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "systems": {n: {**r.as_dict(), **self.ratios(n)} for n, r in self.systems.items()},
        }
        if self.with_ablations:
            out["ablations"] = {n: {**r.as_dict(), **self.ratios(n, "ablations")} for n, r in self.ablations.items()}
        out["checks"] = self.checks()
        return out


def _training_ends(result: Result) -> list[float]:
    return list(result.timeline.training_ends) if result.timeline is not None else []


def _step_end_check(oracle: Result, others: dict[str, Result]) -> dict[str, Any]:
    """The step-level half of `Comparison.checks`."""
    mine = _training_ends(oracle)
    worst: dict[str, Any] | None = None
    violations = []
    for name, r in others.items():
        for step, (end, theirs) in enumerate(zip(mine, _training_ends(r), strict=False)):
            margin = (theirs - end) / theirs if theirs > 0 else 0.0
            row = {"system": name, "step": step, "oracle_end_s": round(end, 1), "end_s": round(theirs, 1),
                   "margin": round(margin, 4)}
            if worst is None or margin < worst["margin"]:
                worst = row
            if margin < -STEP_END_TOLERANCE:
                violations.append(row)
    return {"ok": not violations, "tolerance": STEP_END_TOLERANCE, "worst": worst, "violations": violations}


def compare(scenario: Scenario, ablations: bool = False, progress: Progress | None = None) -> Comparison:
    """Every system (and with `ablations`, every ablation) on the same scenario, each its own run."""
    systems = {name: run_system(scenario, name, progress) for name in SYSTEMS}
    extra = {name: run_system(scenario, name, progress) for name in ABLATIONS} if ablations else {}
    return Comparison(scenario.name, systems, extra, ablations)


def seeds_of(scenario: Scenario, n: int) -> list[int]:
    """The seeds of an n-seed comparison: the scenario's own seed, then the next n-1."""
    if n < 1:
        raise ValueError("seeds must be >= 1")
    return [scenario.seed + k for k in range(n)]


@dataclass
class SeededComparison:
    """One `Comparison` per seed (every system on the same seeded batches within a seed), summarized:
    each system's figures are means over the seeds; the three metrics and each ratio
    (taken per seed, then summarized) also get their spread and 95% interval (sim/spread.py)."""

    scenario: str
    seeds: list[int]
    runs: list[Comparison]

    @property
    def with_ablations(self) -> bool:
        return self.runs[0].with_ablations

    def _group(self, name: str, group: str) -> dict[str, Any]:
        rows = [run.as_dict()[group][name] for run in self.runs]
        out: dict[str, Any] = {}
        for key, value in rows[0].items():
            values = [r[key] for r in rows]
            if isinstance(value, bool) or not isinstance(value, int | float) or any(v is None for v in values):
                out[key] = value if len(rows) == 1 else (value if all(v == value for v in values) else None)
                continue
            mean = sum(values) / len(values)
            out[key] = mean if len(rows) > 1 or isinstance(value, float) else value
            if isinstance(out[key], float):
                out[key] = round(out[key], 4 if key.startswith("vs_") else 3)
        out["seeds"] = len(self.runs)
        for key in ("tokens_per_s", "tokens_per_s_window", "tokens_per_s_ratio_of_sums",
                    *(f"vs_{b}" for b in BASELINES_FOR_RATIOS)):
            values = [r.get(key) for r in rows]
            if any(v is None for v in values):
                continue
            s = spread(values)
            ci = s.ci95
            digits = 4 if key.startswith("vs_") else 1
            out[f"{key}_per_seed"] = [round(v, digits) for v in values]
            out[f"{key}_sd"] = None if s.sd is None else round(s.sd, digits + 1)
            out[f"{key}_ci95"] = None if ci is None else [round(ci[0], digits), round(ci[1], digits)]
            if key.startswith("vs_"):
                out[f"{key}_spans_1"] = s.spans(1.0)
        return out

    def checks(self) -> dict[str, Any]:
        """The oracle check of every seed: ok when it holds on every seed; violations name their seed."""
        per_seed = [(seed, run.checks().get("oracle_upper_bound")) for seed, run in zip(self.seeds, self.runs,
                                                                                        strict=True)]
        if any(b is None for _, b in per_seed):
            return {}
        violations = [{**v, "seed": seed} for seed, b in per_seed for v in b["violations"]]
        step_violations = [{**v, "seed": seed} for seed, b in per_seed for v in b["step_ends"]["violations"]]
        worsts = [{**b["step_ends"]["worst"], "seed": seed} for seed, b in per_seed
                  if b["step_ends"]["worst"] is not None]
        worst = min(worsts, key=lambda w: w["margin"]) if worsts else None
        ok = all(b["ok"] for _, b in per_seed)
        return {"oracle_upper_bound": {"ok": ok, "violations": violations,
                                       "step_ends": {"ok": not step_violations, "tolerance": STEP_END_TOLERANCE,
                                                     "worst": worst, "violations": step_violations}}}

    def as_dict(self) -> dict[str, Any]:
        first = self.runs[0]
        out: dict[str, Any] = {"scenario": self.scenario, "seeds": self.seeds,
                               "systems": {n: self._group(n, "systems") for n in first.systems}}
        if self.with_ablations:
            out["ablations"] = {n: self._group(n, "ablations") for n in first.ablations}
        out["checks"] = self.checks()
        return out


def compare_seeds(scenario: Scenario, seeds: int = 1, ablations: bool = False,
                  progress: Progress | None = None) -> SeededComparison:
    """`compare` on each of `seeds` seeds (seeds_of); with several, progress names each run
    "<system> (seed N)"."""
    chosen = seeds_of(scenario, seeds)

    def labelled(seed: int) -> Progress | None:
        if progress is None or len(chosen) == 1:
            return progress
        return lambda name, t: progress(f"{name} (seed {seed})", t)

    runs = [compare(scenario.model_copy(update={"seed": s}), ablations, labelled(s)) for s in chosen]
    return SeededComparison(scenario.name, chosen, runs)
