"""The paper's sensitivity figures: batch size 32-128 and maximum context 8K-32K, pearl vs rlboost-plus.

Prints one JSON object. Every setting is paper-qwen3-8b-seg1 with one key overridden (`--set`):
`workload.batch_size` in 32, 48, 64, 96, 128 (the GRPO group stays 16) and
`workload.max_context_tokens` in 8K, 16K, 32K. Per setting: tokens/s of both systems measured in the
same run, pearl's gain, each one's mean rollout-step makespan, and `makespan_gain` over the
`makespan_gain_steps` steps both completed (the same batches; the metric counts whole trained steps,
the makespan shows the finer difference), and the paper's range beside it
(docs/method.md: +5.3-63.7% over rlboost-plus across batch sizes, +9.8-26.5% across maximum lengths).
Every figure is the mean over `--seeds` seeds (5 by default); each gain also carries its per-seed
values and 95% interval (gains are taken per seed, then summarized) and says whether the interval
spans 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pearl.sim.experiments import run_system
from pearl.sim.metrics import common_mean_makespans
from pearl.sim.scenario import load_scenario
from pearl.sim.spread import spread

BATCHES = (32, 48, 64, 96, 128)
CONTEXTS = (8192, 16384, 32768)
PAPER = {"batch_size": (0.053, 0.637), "max_context_tokens": (0.098, 0.265)}


def _gain(values: list[float]) -> dict:
    s = spread(values)
    ci = s.ci95
    return {"mean": round(s.mean, 4), "per_seed": [round(v, 4) for v in values],
            "ci95": None if ci is None else [round(ci[0], 4), round(ci[1], 4)],
            "spans_0": None if ci is None else ci[0] <= 0 <= ci[1]}


def setting(scenario: str, key: str, value: int, seeds: int = 5) -> dict:
    sc = load_scenario(scenario, [f"workload.{key}={value}"])
    runs = []
    for k in range(seeds):
        seeded = sc.model_copy(update={"seed": sc.seed + k})
        runs.append((run_system(seeded, "pearl"), run_system(seeded, "rlboost-plus")))
    commons = [common_mean_makespans(pearl, base) for pearl, base in runs]

    def mean(values: list[float], digits: int) -> float:
        return round(sum(values) / seeds, digits)

    gain = _gain([pearl.tokens_per_s / base.tokens_per_s - 1 for pearl, base in runs])
    makespan = _gain([b / p - 1 for p, b in commons])
    return {
        "pearl_tokens_per_s": mean([p.tokens_per_s for p, _ in runs], 1),
        "rlboost_plus_tokens_per_s": mean([b.tokens_per_s for _, b in runs], 1),
        "gain": gain["mean"],
        "gain_per_seed": gain["per_seed"],
        "gain_ci95": gain["ci95"],
        "gain_spans_0": gain["spans_0"],
        "pearl_training_steps": mean([p.training_steps for p, _ in runs], 2),
        "rlboost_plus_training_steps": mean([b.training_steps for _, b in runs], 2),
        "pearl_mean_step_s": mean([p.mean_step_makespan_s for p, _ in runs], 1),
        "rlboost_plus_mean_step_s": mean([b.mean_step_makespan_s for _, b in runs], 1),
        "makespan_gain": makespan["mean"],
        "makespan_gain_ci95": makespan["ci95"],
        "makespan_gain_steps": min(min(len(p.step_makespans_s), len(b.step_makespans_s)) for p, b in runs),
        "seeds": seeds,
        "wall_s": round(sum(p.wall_s + b.wall_s for p, b in runs), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", default="paper-qwen3-8b-seg1")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per setting (means and 95%% intervals)")
    parser.add_argument("--sweep", choices=("batch_size", "max_context_tokens"), action="append",
                        help="one sweep only (default: both)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds: must be >= 1")
    t0 = time.perf_counter()
    values = {"batch_size": BATCHES, "max_context_tokens": CONTEXTS}
    sweeps = {key: {str(v): setting(args.scenario, key, v, args.seeds) for v in values[key]}
              for key in args.sweep or values}
    summary = {
        key: {"gain_min": min(r["gain"] for r in rows.values()), "gain_max": max(r["gain"] for r in rows.values()),
              "pearl_ahead_everywhere": all(r["gain"] > 0 for r in rows.values()), "paper_gain_range": PAPER[key]}
        for key, rows in sweeps.items()
    }
    print(json.dumps({"scenario": args.scenario, "sweeps": sweeps, "summary": summary,
                      "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)},
                      "wall_s": round(time.perf_counter() - t0, 1)}, indent=2))


if __name__ == "__main__":
    main()
