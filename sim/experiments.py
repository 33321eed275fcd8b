"""What `pearlctl sim run | compare` do: one system on a scenario, or every system side by side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .metrics import Result
from .runner import simulate
from .scenario import Scenario
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
        by the metric and step by step; a violation is reported, never hidden.

        The metric moves in whole training steps (every system trains the same seeded batches), so it
        is also checked finer: over the training steps both completed, the oracle ends each no later
        than the other system, within STEP_END_TOLERANCE of that system's end time. `margin` is
        (their end - the oracle's end) / their end, negative when the oracle ended later; the worst
        (smallest) over every system and step is reported."""
        oracle = self.systems.get("oracle")
        if oracle is None:
            return {}
        others = {n: r for n, r in {**self.systems, **self.ablations}.items() if n != "oracle"}
        bound = round(oracle.tokens_per_s, 3)
        violations = [
            {"system": n, "tokens_per_s": round(r.tokens_per_s, 3), "oracle_tokens_per_s": bound}
            for n, r in others.items() if r.tokens_per_s > oracle.tokens_per_s
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
