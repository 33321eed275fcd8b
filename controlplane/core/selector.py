"""The PD selector: rank colocated and every N_P:N_D split of the budget, keep or switch with hysteresis.

Pure: no I/O. On each elastic signal the policy calls `select(profile, budget_workers, current)`:
every candidate is predicted at once (`predictor.evaluate`, vectorised), infeasible ones are kept
in the ranking with their reason, and the chosen configuration is the best feasible one unless
the switch does not pay for itself (`switching.decide_switch`). `pearlctl plan --explain` renders
`Selection.explain()`; the decisions table stores `Selection.summary()`.

Forced switches are never blocked: with nothing running, the best is taken; when the current
shape is infeasible, the best is taken; when the budget no longer has the current worker count,
the reference becomes the same shape at the new count (colocated x N, or the split that keeps the
P:D ratio) and hysteresis applies between that reference and the best (the worker-count change
itself happens regardless).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.fleet import FleetSnapshot
from pearl.controlplane.core.predictor import (
    Config,
    Prediction,
    Workbook,
    evaluate,
    makespan_colocated_paper,
    makespan_disaggregated_paper,
    predict,
    prepare,
    search,
)
from pearl.controlplane.core.profile import Profile
from pearl.controlplane.core.switching import DEFAULT_COSTS, SwitchCosts, SwitchDecision, decide_switch, margin
from pearl.controlplane.errors import BadInput

REFINE = 16  # candidates re-timed with the time-aware tail model (the best of the round model)
# When the caller passes no costs (before any duration is measured): switching.DEFAULT_COSTS, the
# paper's latencies. Callers with a scenario or inventory use its own figures (SwitchCosts.from_reconfig).


@dataclass(frozen=True)
class Candidate:
    config: Config
    predicted_s: float  # pearl's predicted (remaining) makespan
    feasible: bool
    reason: str  # why it is infeasible, else ""
    refined: bool  # timed with the tail model (pass 2); the others with the round model only
    paper_s: float  # the paper's formula, for comparison (full step)


@dataclass(frozen=True)
class Selection:
    """The ranked candidates and the chosen configuration, with why."""

    chosen: Config | None  # None when nothing is feasible
    best: Config | None  # the smallest predicted makespan among the feasible
    current: Config | None
    candidates: tuple[Candidate, ...]  # feasible by predicted makespan, then the infeasible
    forced: bool  # the current shape could not stay (nothing running, infeasible, budget changed)
    reason: str
    decision: SwitchDecision | None = None  # the hysteresis numbers when they applied
    prediction: Prediction | None = None  # the chosen configuration with its components
    symbols: dict[str, float] = field(default_factory=dict)  # the profile's method symbols

    @property
    def switched(self) -> bool:
        return self.chosen is not None and self.chosen != self.current

    def summary(self, top: int = 10) -> dict[str, Any]:
        """JSON-able: what the decisions table stores and `plan --explain --json` prints."""
        return {
            "chosen": self.chosen.label if self.chosen else None,
            "chosen_workers": self.chosen.workers if self.chosen else 0,
            "best": self.best.label if self.best else None,
            "current": self.current.label if self.current else None,
            "forced": self.forced,
            "switched": self.switched,
            "reason": self.reason,
            "threshold_s": self.decision.threshold_s if self.decision else None,
            "gain_s": self.decision.gain_s if self.decision else None,
            "symbols": self.symbols,
            "candidates": [
                {
                    "config": c.config.label,
                    "predicted_s": round(c.predicted_s, 3),
                    "paper_s": round(c.paper_s, 3),
                    "feasible": c.feasible,
                    "reason": c.reason,
                }
                for c in self.candidates[:top]
            ],
        }

    def explain(self, top: int = 10) -> str:
        """Plain text for `pearlctl plan --explain`: the ranking and why one won."""
        lines = [f"{'rank':>4}  {'config':<14} {'predicted':>10} {'paper':>10}  note"]
        for i, c in enumerate(self.candidates[:top], 1):
            mark = "*" if c.config == self.chosen else ("=" if c.config == self.current else " ")
            note = c.reason if not c.feasible else ("" if c.refined else "round model")
            lines.append(f"{i:>4}{mark} {c.config!s:<14} {c.predicted_s:>9.1f}s {c.paper_s:>9.1f}s  {note}")
        hidden = len(self.candidates) - top
        if hidden > 0:
            lines.append(f"      ... {hidden} more")
        lines.append(self.reason)
        return "\n".join(lines)


def current_config(snapshot: FleetSnapshot) -> Config | None:
    """The shape of the fleet's current active set W (active or transitioning workers)."""
    counts: dict[Role, int] = {}
    for w in snapshot.active():
        counts[w.role] = counts.get(w.role, 0) + 1
    return Config.from_counts(counts)


def candidates_for(budget_workers: int) -> list[Config]:
    """Colocated, then every split N_P = 1..N-1 (docs/method.md: only these two shapes)."""
    n = budget_workers
    return ([Config.colocated(n)] if n >= 1 else []) + [Config.split(p, n - p) for p in range(1, n)]


def select(
    profile: Profile,
    budget_workers: int,
    current: Config | None = None,
    *,
    costs: SwitchCosts | None = None,
    remaining_fraction: float = 1.0,
    horizon_s: float = 0.0,
    refine: int = REFINE,
    exhaustive: bool = False,
) -> Selection:
    """Rank the candidates for `budget_workers` and choose one (module docstring). The splits are
    searched (`predictor.search`: the same choice, the ranking holds the splits it evaluated);
    `exhaustive` ranks every one of them."""
    if not isinstance(budget_workers, int) or budget_workers < 0:
        raise BadInput(f"budget_workers: must be an integer >= 0, got {budget_workers!r}")
    if not 0 < remaining_fraction <= 1:
        raise BadInput(f"remaining_fraction: must be in (0, 1], got {remaining_fraction}")
    if not math.isfinite(horizon_s) or horizon_s < 0:
        raise BadInput(f"horizon_s: must be a finite number >= 0, got {horizon_s}")
    symbols = profile.symbols()
    if budget_workers == 0:
        return Selection(
            None, None, current, (), current is not None, "no rollout workers in the budget", None, None, symbols
        )
    reference = _continuation(current, budget_workers) if current is not None else None
    wb = prepare(profile)
    ranked, exact = _rank(profile, wb, budget_workers, remaining_fraction, refine, reference, exhaustive)
    feasible = [c for c in ranked if c.feasible]

    def outcome(chosen: Config | None, forced: bool, reason: str, decision: SwitchDecision | None = None) -> Selection:
        prediction = None
        if chosen is not None:
            prediction = exact.get(chosen) or predict(profile, chosen, remaining_fraction, wb)
        best = feasible[0].config if feasible else None
        return Selection(chosen, best, current, tuple(ranked), forced, reason, decision, prediction, symbols)

    if not feasible:
        return outcome(None, True, "no feasible configuration: " + "; ".join(sorted({c.reason for c in ranked})))
    best = feasible[0]
    if current is None or reference is None:
        return outcome(best.config, True, f"nothing running: start {best.config} ({best.predicted_s:.1f} s)")
    ref = next(c for c in ranked if c.config == reference)
    if not ref.feasible:
        return outcome(best.config, True, f"{reference} is infeasible ({ref.reason}): forced switch to {best.config}")
    forced = reference != current
    prefix = f"budget changed to {budget_workers} workers, {current} continues as {reference}; " if forced else ""
    if best.config == reference:
        return outcome(reference, forced, f"{prefix}{reference} is predicted best ({best.predicted_s:.1f} s)")
    costs = costs or DEFAULT_COSTS
    # the best overall, and the best of the same mode (a cheaper ratio change may pay when a mode switch does not)
    contenders = [best] + [c for c in feasible if c.config.mode is reference.mode and c.config != reference][:1]
    decisions = [
        (c, decide_switch(reference, ref.predicted_s, c.config, c.predicted_s, costs, horizon_s=horizon_s,
                          refill_s=_refill_s(profile, c.config, remaining_fraction),
                          margin=_margin(profile, reference, c.config)))
        for c in contenders
    ]  # fmt: skip
    passing = [(c, d) for c, d in decisions if d.switch]
    if passing:
        c, d = max(passing, key=lambda cd: cd[1].gain_s - cd[1].threshold_s)
        return outcome(c.config, forced, prefix + d.reason, d)
    return outcome(reference, forced, prefix + decisions[0][1].reason, decisions[0][1])


def _margin(profile: Profile, current: Config, candidate: Config) -> float:
    """The switching margin from the predictions' measured errors (`switching.margin`)."""
    errors = [profile.mode_adjustment(c.mode.value)[1] for c in (current, candidate)]
    return margin(*errors, same_mode=current.mode is candidate.mode)


def _continuation(current: Config, n: int) -> Config:
    """The current shape at `n` workers: colocated x n, or the split keeping the P:D ratio."""
    if current.n_colocated or n < 2:
        return Config.colocated(n)
    p = min(n - 1, max(1, round(current.n_prefill * n / current.workers)))
    return Config.split(p, n - p)


def _refill_s(profile: Profile, config: Config, remaining_fraction: float) -> float:
    """Re-prefilling the live trajectories' contexts after a restart, spread over the prefill capacity."""
    live = remaining_fraction * profile.batch_size
    workers = config.n_colocated or config.n_prefill
    return live * profile.mean_context_tokens * profile.t_p / max(workers, 1)


def _rank(
    profile: Profile, wb: Workbook, n: int, remaining_fraction: float, refine: int, reference: Config | None,
    exhaustive: bool,
) -> tuple[list[Candidate], dict[Config, Prediction]]:
    """The candidates evaluated, ranked, and the full predictions of those the tail model timed."""
    sym = profile.symbols()
    common = {k: sym[k] for k in ("S", "B", "r", "t_p", "A", "b")} | {"delta_l": sym["dL"]}
    coloc_config = Config.colocated(n)
    coloc = evaluate(wb, False, np.array([float(n)]), None, remaining_fraction)
    paper = float(makespan_colocated_paper(N=n, T_over=profile.t_over_s, T_env=profile.T_env, **common))
    out = [Candidate(coloc_config, float(coloc.makespan_s[0]), bool(coloc.feasible[0]), coloc.reasons[0], True, paper)]
    exact = {coloc_config: coloc.prediction(0, coloc_config)}
    if n >= 2:
        p = np.arange(1, n, dtype=float)
        include = (reference.n_prefill - 1,) if reference is not None and reference.n_prefill else ()
        if exhaustive:
            idx = np.arange(n - 1)
            split = evaluate(wb, True, p, n - p, remaining_fraction, refine=refine, include=include)
        else:
            idx, split = search(wb, True, p, n - p, remaining_fraction, refine=refine, include=include)
        papers = makespan_disaggregated_paper(
            N_P=p[idx], N_D=n - p[idx], theta=profile.theta, K=profile.K, BW=profile.BW, T_env=profile.T_env,
            **common).tolist()
        every = _splits(n)
        configs = [every[i] for i in idx.tolist()]
        rows = zip(
            configs,
            split.makespan_s.tolist(),
            split.feasible.tolist(),
            split.reasons,
            split.refined.tolist(),
            papers,
            strict=True,
        )
        out.extend(Candidate(*row) for row in rows)
        exact.update({configs[i]: split.prediction(i, configs[i]) for i in np.flatnonzero(split.refined)})
    # feasible first, then by predicted makespan; ties keep the enumeration order (colocated, 1P, 2P, ...)
    order = np.lexsort((np.array([c.predicted_s for c in out]), np.array([not c.feasible for c in out])))
    return [out[i] for i in order], exact


@functools.lru_cache(maxsize=8)
def _splits(n: int) -> tuple[Config, ...]:
    """Every split of n workers (cached: the budget rarely changes between decisions)."""
    return tuple(Config.split(i, n - i) for i in range(1, n))
