"""The paper's ablation: what PD adaptation and borrowing each bring, at 4, 8 and 16 dedicated GPUs.

Prints one JSON object. Scenarios ablation-qwen3-8b-dedicated{4,8,16} (16 training GPUs, no
preemptible GPUs), and with `--model qwen3-30b-a3b` the same with that model and the training and
reconfiguration figures of its paper scenarios (`--set`).
Per setting: tokens/s of the baseline (`rlboost-plus`, which equals `roll` without preemptible
GPUs), `pearl-pd-only`, `pearl-ungated`, `pearl-forced-split` and `pearl`, all measured in the same
run, and each one's gain over the baseline beside the paper's (docs/method.md): at 4 rollout GPUs,
forcing a split -20.6% (8B) / -30.9% (30B-A3B), borrowing +93.6% / +118.3%, borrowing with the gate
+92.3% / +129.5%; at 8-16 rollout GPUs, PD alone +7.8-15.3% and everything +9.2-27.5% (per model
not given). Mean rollout-step makespans are reported too (the metric counts whole trained steps):
each run's own mean, and `makespan_gain_over_baseline` from the means over the steps both runs
completed (the same seeded batches).
`vs_pearl` sets each ablation against the whole policy: the forced split borrows too, so its cost
is clearest there. Every figure is the mean over `--seeds` seeds (5 by default); tokens/s and each
gain also carry their per-seed values and 95% interval (gains are taken per seed, then summarized),
and each gain says whether its interval spans 0 (the ratio spans 1).
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

GPUS = (4, 8, 16)
SYSTEMS = ("rlboost-plus", "pearl-pd-only", "pearl-ungated", "pearl-forced-split", "pearl")
MEANING = {
    "pearl-forced-split": "forcing a split",
    "pearl-ungated": "borrowing (no gate)",
    "pearl": "borrowing with the gate (everything)",
    "pearl-pd-only": "PD adaptation alone",
}
PAPER = {  # gain over the baseline, docs/method.md
    ("qwen3-8b", 4): {"pearl-forced-split": -0.206, "pearl-ungated": 0.936, "pearl": 0.923},
    ("qwen3-30b-a3b", 4): {"pearl-forced-split": -0.309, "pearl-ungated": 1.183, "pearl": 1.295},
}
# the 30B-A3B paper scenarios' training and reconfiguration figures (sim/scenarios/paper-qwen3-30b-a3b-*)
MOE_FIGURES = ["training.step_s=100", "training.weight_sync_s=5", "reconfig.cold_start_s=67", "reconfig.admit_s=18",
               "reconfig.toggle_off_s=4.4"]
PAPER_8_TO_16 = {"pearl-pd-only": (0.078, 0.153), "pearl": (0.092, 0.275)}


def _summary(values: list[float], digits: int) -> dict:
    s = spread(values)
    ci = s.ci95
    return {"mean": round(s.mean, digits), "per_seed": [round(v, digits) for v in values],
            "ci95": None if ci is None else [round(ci[0], digits), round(ci[1], digits)]}


def setting(model: str, gpus: int, seeds: int = 5) -> dict:
    overrides = [] if model == "qwen3-8b" else [f"model={model}", *MOE_FIGURES]
    sc = load_scenario(f"ablation-qwen3-8b-dedicated{gpus}", overrides)
    runs = [{name: run_system(sc.model_copy(update={"seed": sc.seed + k}), name) for name in SYSTEMS}
            for k in range(seeds)]
    rows = {}
    for name in SYSTEMS:
        mine = [run[name] for run in runs]
        tps = _summary([r.tokens_per_s for r in mine], 1)
        row = {"tokens_per_s": tps["mean"], "tokens_per_s_per_seed": tps["per_seed"],
               "tokens_per_s_ci95": tps["ci95"],
               "tokens_per_s_window": _summary([r.tokens_per_s_window for r in mine], 1)["mean"],
               "tokens_per_s_ratio_of_sums": _summary([r.tokens_per_s_ratio_of_sums for r in mine], 1)["mean"],
               "training_steps": round(sum(r.training_steps for r in mine) / seeds, 2),
               "mean_step_makespan_s": round(sum(r.mean_step_makespan_s for r in mine) / seeds, 1),
               "wall_s": round(sum(r.wall_s for r in mine), 2), "seeds": seeds}
        if name != "rlboost-plus":
            gain = _summary([run[name].tokens_per_s / run["rlboost-plus"].tokens_per_s - 1 for run in runs], 4)
            row["gain_over_baseline"] = gain["mean"]
            row["gain_over_baseline_per_seed"] = gain["per_seed"]
            row["gain_over_baseline_ci95"] = gain["ci95"]
            row["gain_spans_0"] = None if gain["ci95"] is None else gain["ci95"][0] <= 0 <= gain["ci95"][1]
            sums = _summary([run[name].tokens_per_s_ratio_of_sums / run["rlboost-plus"].tokens_per_s_ratio_of_sums
                             - 1 for run in runs], 4)
            row["ratio_of_sums_gain_over_baseline"] = sums["mean"]
            row["ratio_of_sums_gain_over_baseline_ci95"] = sums["ci95"]
            spans = [common_mean_makespans(run[name], run["rlboost-plus"]) for run in runs]
            row["makespan_gain_over_baseline"] = round(sum(b / m - 1 for m, b in spans) / seeds, 4)
            row["meaning"] = MEANING[name]
            row["vs_pearl"] = round(sum(run[name].tokens_per_s / run["pearl"].tokens_per_s - 1
                                        for run in runs) / seeds, 4)
            paper = PAPER.get((model, gpus), {}).get(name)
            if paper is None and gpus >= 8 and name in PAPER_8_TO_16:
                paper = PAPER_8_TO_16[name]
            row["paper_gain"] = paper
        rows[name] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", action="append", help="qwen3-8b (default) and/or qwen3-30b-a3b")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per setting (means and 95%% intervals)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    t0 = time.perf_counter()
    out: dict = {"baseline": "rlboost-plus (= roll: no preemptible GPUs in these settings)", "settings": {}}
    for model in args.model or ["qwen3-8b"]:
        for gpus in GPUS:
            out["settings"][f"{model}-dedicated{gpus}"] = setting(model, gpus, args.seeds)
    out["machine"] = {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
