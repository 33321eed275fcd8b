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


def run_system(scenario: Scenario, name: str, progress: Progress | None = None) -> Result:
    """Simulate system `name` on `scenario` (on the GPUs that system may use)."""
    chosen = system(name)
    cluster = chosen.cluster(scenario)
    report = (lambda t: progress(name, t)) if progress is not None else None
    if chosen.run is not None:
        return chosen.run(cluster, report)
    return simulate(cluster, chosen.policy(cluster), report)


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
        """`oracle_upper_bound`: the oracle is at least every other system and ablation (method.md);
        a violation is reported, never hidden."""
        oracle = self.systems.get("oracle")
        if oracle is None:
            return {}
        others = {**self.systems, **self.ablations}
        bound = round(oracle.tokens_per_s, 3)
        violations = [
            {"system": n, "tokens_per_s": round(r.tokens_per_s, 3), "oracle_tokens_per_s": bound}
            for n, r in others.items() if n != "oracle" and r.tokens_per_s > oracle.tokens_per_s
        ]
        return {"oracle_upper_bound": {"ok": not violations, "violations": violations}}

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "systems": {n: {**r.as_dict(), **self.ratios(n)} for n, r in self.systems.items()},
        }
        if self.with_ablations:
            out["ablations"] = {n: {**r.as_dict(), **self.ratios(n, "ablations")} for n, r in self.ablations.items()}
        out["checks"] = self.checks()
        return out


def compare(scenario: Scenario, ablations: bool = False, progress: Progress | None = None) -> Comparison:
    """Every system (and with `ablations`, every ablation) on the same scenario, each its own run."""
    systems = {name: run_system(scenario, name, progress) for name in SYSTEMS}
    extra = {name: run_system(scenario, name, progress) for name in ABLATIONS} if ablations else {}
    return Comparison(scenario.name, systems, extra, ablations)
