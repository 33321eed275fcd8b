"""The paper's sensitivity figures: batch size 32-128 and maximum context 8K-32K, pearl vs rlboost-plus.

Prints one JSON object. Every setting is paper-qwen3-8b-seg1 with one key overridden (`--set`):
`workload.batch_size` in 32, 48, 64, 96, 128 (the GRPO group stays 16) and
`workload.max_context_tokens` in 8K, 16K, 32K. Per setting: tokens/s of both systems measured in the
same run, pearl's gain, each one's mean rollout-step makespan, and `makespan_gain` over the
`makespan_gain_steps` steps both completed (the same batches; the metric counts whole trained steps,
the makespan shows the finer difference), and the paper's range beside it
(docs/method.md: +5.3-63.7% over rlboost-plus across batch sizes, +9.8-26.5% across maximum lengths).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pearl.sim.experiments import run_system
from pearl.sim.metrics import common_mean_makespans
from pearl.sim.scenario import load_scenario

BATCHES = (32, 48, 64, 96, 128)
CONTEXTS = (8192, 16384, 32768)
PAPER = {"batch_size": (0.053, 0.637), "max_context_tokens": (0.098, 0.265)}


def setting(scenario: str, key: str, value: int) -> dict:
    sc = load_scenario(scenario, [f"workload.{key}={value}"])
    pearl, base = run_system(sc, "pearl"), run_system(sc, "rlboost-plus")
    pearl_common, base_common = common_mean_makespans(pearl, base)
    return {
        "pearl_tokens_per_s": round(pearl.tokens_per_s, 1),
        "rlboost_plus_tokens_per_s": round(base.tokens_per_s, 1),
        "gain": round(pearl.tokens_per_s / base.tokens_per_s - 1, 4),
        "pearl_training_steps": pearl.training_steps,
        "rlboost_plus_training_steps": base.training_steps,
        "pearl_mean_step_s": round(pearl.mean_step_makespan_s, 1),
        "rlboost_plus_mean_step_s": round(base.mean_step_makespan_s, 1),
        "makespan_gain": round(base_common / pearl_common - 1, 4),
        "makespan_gain_steps": min(len(pearl.step_makespans_s), len(base.step_makespans_s)),
        "wall_s": round(pearl.wall_s + base.wall_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", default="paper-qwen3-8b-seg1")
    args = parser.parse_args()
    t0 = time.perf_counter()
    sweeps = {
        "batch_size": {str(b): setting(args.scenario, "batch_size", b) for b in BATCHES},
        "max_context_tokens": {str(c): setting(args.scenario, "max_context_tokens", c) for c in CONTEXTS},
    }
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
