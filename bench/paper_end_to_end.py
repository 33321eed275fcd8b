"""The paper's end-to-end figure: every system on the six paper scenarios (simulated).

Prints one JSON object. Per scenario: each system's tokens/s, its ratios to `roll` and
`rlboost-plus` measured in the same run, steps, mean rollout-step makespan, GPU-hours,
reconfigurations, late returns and wall time; pearl/oracle; the oracle check; the paper's ratios
beside ours; and the ceiling (sim/ceiling.py: every rollout step at the floor of its slowest
trajectory alone on a worker, whatever the GPUs). Every figure is the mean over `--seeds` seeds
(5 by default; the scenario's seed and the next ones draw the batches); tokens/s (the paper's
per-step metric), the ratio of sums, the window rate and each ratio also carry their per-seed
values, spread and 95% interval, and each ratio says whether its interval spans 1 (sim/spread.py).
The runs are deterministic, so `--repeat` only repeats the wall-time measurement of the whole
compare.

The summary lists the issue's targets, met or missed and by how much:
pearl >= 2.17x roll on every 8B segment and >= 2.43x on every 30B-A3B segment; pearl > rlboost-plus
on every segment with the largest gain on seg2; pearl >= 0.90x oracle; `sim compare` of the five
systems on paper-qwen3-8b-seg2 under 60 seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pearl.sim.ceiling import ceiling
from pearl.sim.experiments import compare_seeds
from pearl.sim.scenario import load_scenario
from pearl.sim.spread import spread

SCENARIOS = [f"paper-qwen3-{m}-seg{s}" for m in ("8b", "30b-a3b") for s in (1, 2, 3)]
# docs/method.md: pearl vs roll is given as a range per model; vs rlboost-plus per segment
PAPER_VS_ROLL = {"8b": (2.17, 2.37), "30b-a3b": (2.43, 2.79)}
PAPER_VS_RLBOOST = {"8b": (1.058, 1.269, 1.106), "30b-a3b": (1.074, 1.363, 1.190)}
TARGET_VS_ROLL = {"8b": 2.17, "30b-a3b": 2.43}
TARGET_VS_ORACLE = 0.90
COMPARE_BUDGET_S = 60.0


def _model_segment(name: str) -> tuple[str, int]:
    model = "30b-a3b" if "30b-a3b" in name else "8b"
    return model, int(name.rsplit("seg", 1)[1])


def _row(d: dict) -> dict:
    """One system's figures from `SeededComparison.as_dict()` (means over the seeds, and intervals)."""
    interval = {f"{key}_{part}": d.get(f"{src}_{part}")
                for key, src in (("tokens_per_s", "tokens_per_s"), ("tokens_per_s_window", "tokens_per_s_window"),
                                 ("tokens_per_s_ratio_of_sums", "tokens_per_s_ratio_of_sums"),
                                 ("vs_roll", "vs_roll"), ("vs_rlboost_plus", "vs_rlboost-plus"))
                for part in ("per_seed", "sd", "ci95")}
    return {
        "tokens_per_s": round(d["tokens_per_s"], 1),
        "tokens_per_s_window": round(d["tokens_per_s_window"], 1),
        "tokens_per_s_ratio_of_sums": round(d["tokens_per_s_ratio_of_sums"], 1),
        "vs_roll": d["vs_roll"],
        "vs_rlboost_plus": d["vs_rlboost-plus"],
        "vs_roll_spans_1": d.get("vs_roll_spans_1"),
        "vs_rlboost_plus_spans_1": d.get("vs_rlboost-plus_spans_1"),
        "seeds": d["seeds"],
        **interval,
        "rollout_steps": d["rollout_steps"],
        "training_steps": d["training_steps"],
        "mean_step_makespan_s": d["mean_step_makespan_s"],
        "gpu_hours": round(d["gpu_seconds"] / 3600, 2),
        "reconfigurations": d["reconfigurations"],
        "late_returns": d["late_returns"],
        "forced_releases": d["forced_releases"],
        "wall_s": d["wall_s"],
    }


def scenario_figures(name: str, repeat: int, seeds: int = 5) -> dict:
    sc = load_scenario(name)
    walls, seeded = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        seeded = compare_seeds(sc, seeds)
        walls.append((time.perf_counter() - t0) / seeds)  # one seed's compare
    data = seeded.as_dict()
    systems = {n: _row(d) for n, d in data["systems"].items()}
    model, seg = _model_segment(name)
    roll = systems["roll"]["tokens_per_s"]
    top = ceiling(sc)
    per_seed = spread([p / o for p, o in zip(systems["pearl"]["tokens_per_s_per_seed"],
                                              systems["oracle"]["tokens_per_s_per_seed"], strict=True)])
    ci = per_seed.ci95
    return {
        "seeds": data["seeds"],
        "systems": systems,
        "pearl_vs_oracle": round(per_seed.mean, 4),
        "pearl_vs_oracle_ci95": None if ci is None else [round(ci[0], 4), round(ci[1], 4)],
        "checks": data["checks"],
        "paper": {"pearl_vs_roll_range": PAPER_VS_ROLL[model],
                  "pearl_vs_rlboost_plus": PAPER_VS_RLBOOST[model][seg - 1]},
        "ceiling": {"tokens_per_s": round(top.tokens_per_s, 1), "vs_roll": round(top.tokens_per_s / roll, 3),
                    "training_steps": top.training_steps, "mean_step_floor_s": round(top.mean_floor_s, 1)},
        "compare_wall_s": {"median": round(statistics.median(walls), 2), "min": round(min(walls), 2),
                           "max": round(max(walls), 2)},
    }


def targets(figures: dict[str, dict]) -> dict:
    out: dict[str, dict] = {}
    for name, f in figures.items():
        model, _ = _model_segment(name)
        pearl = f["systems"]["pearl"]
        out[f"{name}: pearl >= {TARGET_VS_ROLL[model]}x roll"] = {
            "met": pearl["vs_roll"] >= TARGET_VS_ROLL[model], "value": pearl["vs_roll"],
            "short_by": round(max(0.0, TARGET_VS_ROLL[model] - pearl["vs_roll"]), 3),
            "ceiling_vs_roll": f["ceiling"]["vs_roll"], "oracle_vs_roll": f["systems"]["oracle"]["vs_roll"]}
        out[f"{name}: pearl > rlboost-plus"] = {"met": pearl["vs_rlboost_plus"] > 1.0,
                                                "value": pearl["vs_rlboost_plus"]}
        out[f"{name}: pearl >= {TARGET_VS_ORACLE}x oracle"] = {"met": f["pearl_vs_oracle"] >= TARGET_VS_ORACLE,
                                                               "value": f["pearl_vs_oracle"]}
        out[f"{name}: oracle >= every system"] = {"met": f["checks"]["oracle_upper_bound"]["ok"]}
    for model in ("8b", "30b-a3b"):
        gains = {n: f["systems"]["pearl"]["vs_rlboost_plus"] for n, f in figures.items()
                 if _model_segment(n)[0] == model}
        if len(gains) == 3:
            best = max(gains, key=gains.get)
            out[f"qwen3-{model}: largest gain over rlboost-plus on seg2"] = {"met": best.endswith("seg2"),
                                                                             "gains": gains}
    seg2 = figures.get("paper-qwen3-8b-seg2")
    if seg2 is not None:
        wall = seg2["compare_wall_s"]["median"]
        out["sim compare paper-qwen3-8b-seg2 under 60 s"] = {"met": wall < COMPARE_BUDGET_S, "value_s": wall}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", action="append", help="default: the six paper scenarios")
    parser.add_argument("--repeat", type=int, default=1, help="compares per scenario (wall time only)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per scenario (means and 95%% intervals)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    t0 = time.perf_counter()
    figures = {name: scenario_figures(name, args.repeat, args.seeds) for name in args.scenario or SCENARIOS}
    print(json.dumps({
        "scenarios": figures,
        "targets": targets(figures),
        "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
