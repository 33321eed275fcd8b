"""The calibration set (the paper's §3) before and after the fit, and the frozen parameters.

Prints one JSON object: every Fig. 2a-2c figure as the paper gives it, as the simulator gave it
before the fit (kernel-speed engine, MoE experts at 0.25, each turn reusing its whole cached
context, the former workload) and after it, each with its deviation (sim / paper - 1; for the
split gains of Fig. 2c, the difference in points), and each fitted parameter with its value and
range (docs/fidelity.md). About a minute per evaluation on one core.
"""

from __future__ import annotations

import json
import time

from pearl.controlplane.core import perfmodel
from pearl.sim import fidelity

PARAMETERS = {
    "agentic_decode_efficiency": (perfmodel.AGENTIC_DECODE_EFFICIENCY, perfmodel.AGENTIC_DECODE_EFFICIENCY_RANGE),
    "agentic_prefill_efficiency": (perfmodel.AGENTIC_PREFILL_EFFICIENCY,
                                   perfmodel.AGENTIC_PREFILL_EFFICIENCY_RANGE),
    "turn_prefix_reuse": (perfmodel.TURN_PREFIX_REUSE, perfmodel.TURN_PREFIX_REUSE_RANGE),
    "moe_expert_bw_efficiency (measured, not fitted)": (perfmodel.MOE_EXPERT_BW_EFFICIENCY, (0.54, 0.67)),
}


def rows(before: dict, after: dict) -> list[dict]:
    paper = fidelity.PAPER
    out = []

    def add(figure: str, name: str, p: float, b: float, a: float, points: bool = False) -> None:
        dev = (lambda s: round(s - p, 4)) if points else (lambda s: round(fidelity.deviation(p, s), 4))
        out.append({"figure": figure, "quantity": name, "paper": p, "before": b, "after": a,
                    "deviation_before": dev(b), "deviation_after": dev(a),
                    "deviation_unit": "points" if points else "relative"})

    a2a, b2a = after["fig2a"], before["fig2a"]
    for gpus, p in paper["fig2a"]["makespan_s"].items():
        add("2a", f"rollout time at {gpus} GPUs (s)", p, b2a["makespan_s"][gpus], a2a["makespan_s"][gpus])
    for key in ("fall_16_24", "fall_24_32", "trajectory_mean_s", "rollout_share_32"):
        add("2a", key, paper["fig2a"][key], b2a[key], a2a[key])
    low, high = paper["fig2a"]["rollout_over_training"]
    add("2a", "rollout / training at 32 GPUs", low, b2a["rollout_over_training"][0], a2a["rollout_over_training"][0])
    add("2a", "rollout / training at 16 GPUs", high, b2a["rollout_over_training"][1], a2a["rollout_over_training"][1])
    for key in ("prefill_token_share", "prefill_time_share"):
        add("2b", key, paper["fig2b"][key], before["fig2b"][key], after["fig2b"][key])
    for batch, p in paper["fig2c"]["split_gain"].items():
        add("2c", f"best split over colocated at batch {batch}", p, before["fig2c"]["split_gain"][batch],
            after["fig2c"]["split_gain"][batch], points=True)
    for batch, p in paper["fig2c"]["best_ratio"].items():
        out.append({"figure": "2c", "quantity": f"best ratio at batch {batch}", "paper": p,
                    "before": before["fig2c"]["best_ratio"][batch], "after": after["fig2c"]["best_ratio"][batch]})
    return out


def main() -> None:
    t0 = time.perf_counter()
    before, after = fidelity.before(), fidelity.figures()
    print(json.dumps({
        "parameters": {k: {"value": v, "range": list(r)} for k, (v, r) in PARAMETERS.items()},
        "calibration": rows(before, after),
        "before": before, "after": after,
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=2, default=str))


if __name__ == "__main__":
    main()
