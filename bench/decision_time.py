"""Decision time of the pure core: select() + orchestrate() for clusters of 16 to 4096 GPUs.

Prints one JSON object. A decision (the headline figure) is one on a profile whose workbook is
built (between telemetry refits the policy asks again with the same profile; the question itself
is new, the evaluation memo is cleared): the selection searches colocated and the N_P:N_D splits of
the budget, and the chosen target is expanded into a plan against a fleet running another split (a
mode change: the largest plan). Measured in the same run: the exhaustive ranking of every split on
the same workbook (and whether it chooses the same), the first decision after a refit (a new
profile: its trajectory sample and matrices rebuilt), and the paper's closed-form formulas for the
same candidates (the baseline). The fleet runs a 1:3 split on
three quarters of the budget and the rest was just granted (preemptible GPUs arriving): the budget
change forces a decision, and the plan starts the new workers and flips or restarts survivors.

    .venv/bin/python bench/decision_time.py [--gpus 16,64,256,1024,4096] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from pearl.controlplane.core.domain import Activity, Role, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, Target, WorkerSlot
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.core.predictor import Config, makespan_colocated_paper, makespan_disaggregated_paper, prepare
from pearl.controlplane.core.profile import profile_from_workload
from pearl.controlplane.core.selector import select
from pearl.sim.scenario import load_scenario, serving_perf

SCENARIO = Path(__file__).resolve().parents[1] / "sim" / "scenarios" / "paper-qwen3-8b-seg1.yaml"
TARGET_MS = 20.0  # a decision between refits, select + orchestrate


def fleet(workers: int, current: Config, tp: int) -> FleetSnapshot:
    """`workers` slots; the first `current.workers` active in `current`'s roles, the rest idle."""
    roles = [Role.PREFILL] * current.n_prefill + [Role.DECODE] * current.n_decode
    roles += [Role.COLOCATED] * (workers - len(roles))
    slots = tuple(
        WorkerSlot(i, f"node-{i // 4}", tuple(range(tp * (i % 4), tp * (i % 4) + tp)), WorkerZone.DEDICATED, role,
                   Activity.ACTIVE if i < current.workers else Activity.INACTIVE)
        for i, role in enumerate(roles)
    )  # fmt: skip
    return FleetSnapshot(state_version=1, workers=slots, tp=tp)


def paper_baseline(profile, n: int) -> float:
    sym = profile.symbols()
    common = {k: sym[k] for k in ("S", "B", "r", "t_p", "A", "b")} | {"delta_l": sym["dL"]}
    p = np.arange(1, n, dtype=float)
    split = makespan_disaggregated_paper(
        N_P=p, N_D=n - p, theta=profile.theta, K=profile.K, BW=profile.BW, T_env=profile.T_env, **common
    )
    coloc = makespan_colocated_paper(N=n, T_over=profile.t_over_s, T_env=profile.T_env, **common)
    return float(min(coloc, split.min() if len(p) else coloc))


def ms(xs: list[float]) -> dict[str, float]:
    qs = np.percentile(xs, [10, 50, 90]) * 1e3
    return {"median_ms": round(float(qs[1]), 3), "p10_ms": round(float(qs[0]), 3), "p90_ms": round(float(qs[2]), 3)}


def run(gpus: int, repeat: int, prior, tp: int) -> dict:
    n = gpus // tp
    running = max(2, 3 * n // 4)
    current = Config.split(max(1, running // 4), running - max(1, running // 4))
    snapshot = fleet(n, current, tp)
    total, sel_t, orch_t, base_t, cpu, refit_t, full_t = [], [], [], [], [], [], []
    steps = 0
    chosen = exhaustive_choice = None
    for _ in range(repeat):
        # a decision between refits: the profile's workbook is built, this question was not asked yet
        wb = prepare(prior)
        wb.evaluations.clear()
        c0 = time.process_time()
        t0 = time.perf_counter()
        selection = select(prior, n, current, horizon_s=3600.0)
        t1 = time.perf_counter()
        target = Target(frozenset(range(n)), selection.chosen.counts(), reason=selection.reason)
        plan = orchestrate(snapshot, target)
        t2 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        paper_baseline(prior, n)
        t3 = time.perf_counter()
        # the exhaustive ranking of every split, on the same workbook
        wb.evaluations.clear()
        t4 = time.perf_counter()
        exhaustive_choice = select(prior, n, current, horizon_s=3600.0, exhaustive=True).chosen
        t5 = time.perf_counter()
        # the first decision after a telemetry refit: a new profile, its sample and matrices rebuilt
        profile = replace(prior)
        prepare.cache_clear()
        t6 = time.perf_counter()
        select(profile, n, current, horizon_s=3600.0)
        t7 = time.perf_counter()
        sel_t.append(t1 - t0)
        orch_t.append(t2 - t1)
        total.append(t2 - t0)
        base_t.append(t3 - t2)
        full_t.append(t5 - t4)
        refit_t.append(t7 - t6 + (t2 - t1))
        steps, chosen = len(plan.steps), selection.chosen
    median, base = statistics.median(total), statistics.median(base_t)
    return {
        "gpus": gpus,
        "workers": n,
        "candidates": n,
        "evaluated": len(selection.candidates),
        "running": current.label,
        "chosen": chosen.label if chosen else None,
        "same_choice_as_exhaustive": chosen == exhaustive_choice,
        "plan_steps": steps,
        **ms(total),
        "cpu_median_ms": round(statistics.median(cpu) * 1e3, 3),  # this process's CPU time (less sensitive to load)
        "select": ms(sel_t),
        "orchestrate": ms(orch_t),
        "select_exhaustive": ms(full_t),
        "after_refit": ms(refit_t),  # select on a new profile (sample and workbook rebuilt) + orchestrate
        "baseline_paper_formulas": ms(base_t),
        "ratio_to_baseline": round(median / base, 1) if base > 0 else None,
        "under_target": median * 1e3 < TARGET_MS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="16,64,256,1024,4096")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    sc = load_scenario(SCENARIO)
    perf = serving_perf(sc)
    prior = profile_from_workload(sc.workload, perf, rollout=sc.training.rollout())
    select(prior, 8)  # warm up imports and numpy
    results = [run(int(g), args.repeat, prior, sc.tp) for g in args.gpus.split(",")]
    print(
        json.dumps(
            {
                "bench": "decision_time",
                "scenario": sc.name,
                "model": sc.model,
                "gpu": sc.gpu,
                "tp": sc.tp,
                "repeat": args.repeat,
                "target_ms": TARGET_MS,
                "machine": {
                    "cpus": os.cpu_count(),
                    "load_average": os.getloadavg()[0],
                    "python": platform.python_version(),
                    "numpy": np.__version__,
                },
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
