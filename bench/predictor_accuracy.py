"""Predictor accuracy against the simulator: MAPE of predicted vs simulated rollout-step makespan.

One JSON object. The grid varies one factor at a time around the paper's Qwen3-8B workload
(batch 64, 16 turns median, 1.5 s environment median): batch size, turns per trajectory (median,
p99 and max scaled together), environment latency (median and p99 scaled together); each workload
on budgets of 4, 8 and 16 GPUs (TP2), colocated and a few splits (N_P = 1, N/4, N/2, 3N/4).

Every configuration is simulated as a static fleet (`sim.ratio.run_static`) on the same seeded
batches; `simulated_s` is the mean makespan of the steps after the first (warm-up). Predictions
come from a profile fitted, as `sim ratio` fits it, on the telemetry of a colocated run of 3 workers
(a fleet that is none of the grid's), and, for reference, from the catalog prior (the scenario's
distributions and the catalog performance model, no telemetry). pearl's predictor
(`predictor.predict`) and the paper's formulas (`predictor.predict_paper`) are scored on the same
points with the same profile. Reported: MAPE overall and per axis value, the median and the 90th
percentile of the absolute errors, and the signed mean error (bias).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from pearl.controlplane.core.predictor import Config, predict, predict_paper
from pearl.controlplane.core.telemetry import StepTelemetry
from pearl.sim.ratio import StaticRun, fit_from_run, prior_profile, run_static
from pearl.sim.scenario import Scenario, load_scenario

BASE = "ablation-qwen3-8b-dedicated8"
WARMUP = 1
AXES: dict[str, dict[float, list[str]]] = {
    "batch_size": {32: ["workload.batch_size=32"], 64: [], 96: ["workload.batch_size=96"]},
    "turns_median": {
        8: ["workload.turns={dist: lognormal, median: 8, p99: 25, max: 32}"],
        16: [],
        32: ["workload.turns={dist: lognormal, median: 32, p99: 100, max: 128}"],
    },
    "env_median_s": {
        0.5: ["workload.env_latency_s={dist: lognormal, median: 0.5, p99: 10}"],
        1.5: [],
        5.0: ["workload.env_latency_s={dist: lognormal, median: 5, p99: 100}"],
    },
}
BASE_VALUES = {"batch_size": 64, "turns_median": 16, "env_median_s": 1.5}
BUDGET_GPUS = (4, 8, 16)
PROFILE_WORKERS = 3  # 6 GPUs: none of the grid's budgets


def configs(workers: int) -> list[Config]:
    """Colocated and the splits N_P = 1, N/4, N/2, 3N/4 (those that leave a decode worker)."""
    prefill = sorted({p for p in (1, workers // 4, workers // 2, 3 * workers // 4) if 1 <= p < workers})
    return [Config.colocated(workers)] + [Config.split(p, workers - p) for p in prefill]


def workloads() -> list[tuple[str, dict[str, float], list[str]]]:
    """(label, axis values, overrides): the base, then one factor changed at a time."""
    out = [("base", dict(BASE_VALUES), [])]
    for axis, values in AXES.items():
        for value, overrides in values.items():
            if value != BASE_VALUES[axis]:
                out.append((f"{axis}={value:g}", {**BASE_VALUES, axis: value}, overrides))
    return out


def _run(task: tuple[Scenario, Config, int]) -> tuple[tuple[float, ...], tuple[StepTelemetry, ...]]:
    scenario, config, stop_after = task
    run = run_static(scenario, config, stop_after)
    return run.makespans, run.telemetry


def _summary(errors: list[float]) -> dict[str, float | int]:
    e = np.asarray(errors)
    a = np.abs(e)
    return {"mape": round(float(a.mean()), 5), "median_ape": round(float(np.median(a)), 5),
            "p90_ape": round(float(np.quantile(a, 0.9)), 5), "max_ape": round(float(a.max()), 5),
            "bias": round(float(e.mean()), 5), "points": len(e)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="measured rollout steps per point (after the warm-up)")
    parser.add_argument("--profile-steps", type=int, default=24, help="steps of the profiling run (after the warm-up)")
    parser.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    grid = workloads()
    scenarios = [load_scenario(BASE, overrides) for _, _, overrides in grid]
    tasks = [(sc, Config.colocated(PROFILE_WORKERS), WARMUP + args.profile_steps) for sc in scenarios]
    points = [(i, gpus, c) for i, sc in enumerate(scenarios) for gpus in BUDGET_GPUS
              for c in configs(gpus // sc.tp)]
    tasks += [(scenarios[i], c, WARMUP + args.steps) for i, _, c in points]
    with ProcessPoolExecutor(max_workers=args.jobs or os.cpu_count() or 1,
                             mp_context=multiprocessing.get_context("fork")) as pool:
        runs = list(pool.map(_run, tasks))
    profiles = {}
    for i, sc in enumerate(scenarios):
        makespans, telemetry = runs[i]
        run = StaticRun(Config.colocated(PROFILE_WORKERS), makespans, telemetry, 0.0)
        profiles[i] = {"fitted": fit_from_run(prior_profile(sc), run, WARMUP), "prior": prior_profile(sc)}
    rows = []
    for (i, gpus, config), (makespans, _) in zip(points, runs[len(scenarios):], strict=True):
        measured = makespans[WARMUP: WARMUP + args.steps]
        if len(measured) < args.steps:
            raise SystemExit(f"{grid[i][0]} {gpus} GPUs {config.label}: {len(makespans)} steps finished")
        simulated = float(np.mean(measured))
        row = {"workload": grid[i][0], **grid[i][1], "budget_gpus": gpus, "config": config.label,
               "mode": str(config.mode), "simulated_s": round(simulated, 3)}
        for name, profile in profiles[i].items():
            ours = predict(profile, config)
            paper = predict_paper(profile, config)
            row[name] = {"ours_s": round(ours.makespan_s, 3), "paper_s": round(paper, 3),
                         "ours_error": round(ours.makespan_s / simulated - 1, 5),
                         "paper_error": round(paper / simulated - 1, 5), "feasible": ours.feasible}
        rows.append(row)

    def scored(name: str, pick=lambda r: True) -> dict:
        chosen = [r for r in rows if pick(r)]
        return {"ours": _summary([r[name]["ours_error"] for r in chosen]),
                "paper": _summary([r[name]["paper_error"] for r in chosen])}

    def per_axis(name: str) -> dict:
        out: dict = {}
        for axis in [*AXES, "budget_gpus", "mode"]:
            values = sorted({r[axis] for r in rows}, key=str) if axis == "mode" else sorted({r[axis] for r in rows})
            out[axis] = {}
            for value in values:
                s = scored(name, lambda r, a=axis, v=value: r[a] == v)
                out[axis][str(value)] = {"ours_mape": s["ours"]["mape"], "paper_mape": s["paper"]["mape"],
                                         "points": s["ours"]["points"]}
        return out

    result = {}
    for name in ("fitted", "prior"):
        overall = scored(name)
        result[name] = {
            "overall": overall,
            "feasible_only": scored(name, lambda r, n=name: r[n]["feasible"]),
            "per_axis": per_axis(name),
            "ours_lower": overall["ours"]["mape"] < overall["paper"]["mape"],
            "ours_within_10pct": overall["ours"]["mape"] <= 0.10,
        }
    print(json.dumps({
        "headline": {"profile": "fitted", "ours_mape": result["fitted"]["overall"]["ours"]["mape"],
                     "paper_mape": result["fitted"]["overall"]["paper"]["mape"],
                     "ours_lower": result["fitted"]["ours_lower"],
                     "ours_within_10pct": result["fitted"]["ours_within_10pct"]},
        **result,
        "grid": {"base": BASE, "axes": {a: list(v) for a, v in AXES.items()}, "budget_gpus": list(BUDGET_GPUS),
                 "profile": f"colocated x{PROFILE_WORKERS}", "warmup_steps": WARMUP, "steps": args.steps,
                 "profile_steps": args.profile_steps, "points": len(rows)},
        "points": rows,
        "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
