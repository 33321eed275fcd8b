"""The paper's Table 2 in our simulator: `sim ratio` on its six settings, one JSON object.

Settings: sim/scenarios/ablation-qwen3-8b-dedicated{10,12,16}.yaml (Qwen3-8B, TP2, 16 training
GPUs), each on its dedicated GPUs alone and with the training GPUs added (`--overlap`). Per
setting: the configuration the predictor selects (profile fitted on a colocated run that is no
candidate), the empirical best over every candidate simulated on the same batches, the gap, the
predictor's MAPE beside the paper's formulas', and the paper's own selected and best ratios with
what that ratio measures here. Target (the paper's own result): the selected configuration within
1% of the empirical best in at least 5 of the 6 settings.

Every system routes a trajectory's turns to the worker that holds its prefix, where a turn reuses
the prompt and `perfmodel.TURN_PREFIX_REUSE` of the rest (0 as calibrated: it prefills its context
after the prompt again), in the simulated engine and in the predictor alike. Neither the simulator
nor the selector is tuned to imitate the paper: where the results differ, they are reported as
they are.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pearl.controlplane.core.predictor import Config
from pearl.sim.ratio import RatioResult, ratio
from pearl.sim.scenario import load_scenario

GPUS = (10, 12, 16)
# docs/method.md: the paper's Table 2 (selected; best where it differs)
PAPER = {
    (10, False): ("2P3D", "2P3D"),
    (10, True): ("4P9D", "5P8D"),
    (12, False): ("3P3D", "3P3D"),
    (12, True): ("4P10D", "4P10D"),
    (16, False): ("3P5D", "3P5D"),
    (16, True): ("4P12D", "4P12D"),
}
GAP_LIMIT = 0.01


def _config(label: str) -> Config:
    p, _, d = label.rstrip("D").partition("P")
    return Config.split(int(p), int(d))


def row(result: RatioResult, gpus: int, overlap: bool) -> dict:
    data = result.as_dict()
    best = result.simulated(result.empirical_best)
    ranking = sorted(result.candidates, key=lambda c: c.simulated_s)
    paper_selected, paper_best = PAPER[(gpus, overlap)]
    paper_config = _config(paper_selected)
    splits = [c for c in result.candidates if c.config.n_prefill]
    best_split = min(splits, key=lambda c: c.simulated_s) if splits else None
    colocated = result.simulated(Config.colocated(result.budget_workers))
    return {
        "selected": data["selected"],
        "empirical_best": data["empirical_best"],
        "gap": data["gap"],
        "selected_is_best": data["selected"] == data["empirical_best"],
        "selected_rank": next(i for i, c in enumerate(ranking, 1) if c.config == result.selected)
        if result.selected is not None else None,
        "mape": data["mape"],
        "mape_by_mode": data["mape_by_mode"],
        "paper_formulas_mape": data["paper_mape"],
        "paper_formulas_selected": data["paper_selected"],
        "paper_formulas_gap": data["paper_gap"],
        "selected_from_prior": data["selected_from_prior"],
        "paper": {"selected": paper_selected, "best": paper_best,
                  "selected_is_best": paper_selected == paper_best},
        "paper_ratio_here": {
            "config": paper_selected,
            "simulated_s": round(result.simulated(paper_config), 3),
            "gap_vs_best": round(result.simulated(paper_config) / best - 1, 5),
            "rank": next(i for i, c in enumerate(ranking, 1) if c.config == paper_config),
        },
        "best_split": {"config": best_split.config.label,
                       "gap_vs_colocated": round(best_split.simulated_s / colocated - 1, 5)}
        if best_split else None,
        "budget_gpus": data["budget_gpus"],
        "profile_config": data["profile_config"],
        "profile_steps": data["profile_steps"],
        "measured_steps": data["measured_steps"],
        "candidates": [{k: c[k] for k in ("config", "predicted_s", "paper_s", "simulated_s", "feasible")}
                       for c in data["candidates"]],
        "wall_s": data["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=None,
                        help="simulated seconds of the profiling run (default: the scenarios' own, 7200); "
                             "every candidate is measured on as many steps as it finished")
    parser.add_argument("--jobs", type=int, default=0, help="processes for the candidates (0: one per CPU)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    settings = {}
    for gpus in GPUS:
        for overlap in (False, True):
            overrides = [f"duration_s={args.duration_s}"] if args.duration_s else []
            sc = load_scenario(f"ablation-qwen3-8b-dedicated{gpus}", overrides)
            result = ratio(sc, overlap, jobs=args.jobs)
            settings[f"dedicated{gpus}{'+overlap' if overlap else ''}"] = row(result, gpus, overlap)
    rows = settings.values()
    hits = sum(r["selected_is_best"] for r in rows)
    within = sum(r["gap"] is not None and r["gap"] <= GAP_LIMIT for r in rows)
    max_gap = max(r["gap"] for r in rows if r["gap"] is not None)
    out = {
        "settings": settings,
        "selected_is_best": hits,
        "selected_within_1pct": within,
        "of": len(settings),
        "max_gap": max_gap,
        "mape": {"ours_mean": round(sum(r["mape"] for r in rows) / len(settings), 5),
                 **{f"ours_{mode}_mean": round(sum(r["mape_by_mode"][mode] for r in rows) / len(settings), 5)
                    for mode in ("colocated", "split")},
                 "paper_formulas_mean": round(sum(r["paper_formulas_mape"] for r in rows) / len(settings), 5)},
        "paper": {"selected_is_best": sum(v[0] == v[1] for v in PAPER.values()), "of": len(PAPER),
                  "max_gap": 0.004},
        "acceptance": {"selected_within_1pct_at_least_5_of_6": within >= 5,
                       "mape_at_most_3pct_per_mode": all(
                           sum(r["mape_by_mode"][m] for r in rows) / len(settings) <= 0.03
                           for m in ("colocated", "split"))},
        "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
