"""The calibration set (the paper's §3) at the previous round's fit and at the model as it is, and the
parameters. One JSON object.

Every target figure of the plan (docs/fidelity.md, "1. The plan (fixed before fitting)") as the
paper gives it, at the previous round's fit under the present rollout model (`before`) and at
the present model (`after`), each with its distance to the paper's (relative; points for the
split gains of Fig. 2c; prefill workers for the best ratios) and whether it is reached; the loss
of each; and each parameter with its value and range. About 35 s of one core per evaluation.
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
    "agentic_decode_only_efficiency": (perfmodel.AGENTIC_DECODE_ONLY_EFFICIENCY,
                                       perfmodel.AGENTIC_DECODE_ONLY_EFFICIENCY_RANGE),
    "agentic_prefill_only_efficiency": (perfmodel.AGENTIC_PREFILL_ONLY_EFFICIENCY,
                                        perfmodel.AGENTIC_PREFILL_ONLY_EFFICIENCY_RANGE),
    "turn_prefix_reuse": (perfmodel.TURN_PREFIX_REUSE, perfmodel.TURN_PREFIX_REUSE_RANGE),
    "moe_expert_bw_efficiency (measured, not fitted)": (perfmodel.MOE_EXPERT_BW_EFFICIENCY, (0.54, 0.67)),
}


def rows(before: dict, after: dict) -> list[dict]:
    b, a = fidelity.deviations(before), fidelity.deviations(after)
    return [{"target": name, "paper": d["paper"], "before": b[name]["value"], "after": d["value"],
             "distance_before": b[name]["distance"], "distance_after": d["distance"],
             "reached_before": b[name]["reached"], "reached_after": d["reached"]} for name, d in a.items()]


def main() -> None:
    t0 = time.perf_counter()
    before, after = fidelity.before(), fidelity.evaluate(fidelity.fitted_setting())
    print(json.dumps({
        "parameters": {k: {"value": v, "range": list(r)} for k, (v, r) in PARAMETERS.items()},
        "workload": fidelity.fitted_setting(),
        "calibration": rows(before, after),
        "loss": {"before": fidelity.loss(before), "after": fidelity.loss(after)},
        "before": before, "after": after,
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=2, default=str))


if __name__ == "__main__":
    main()
