"""Simulator speed: wall time of one 2-hour paper scenario per system, and of `sim compare`.

Prints one JSON object: per scenario and system, the median and spread of the wall time over
`--repeat` runs (one core, this process), simulated events per second, and tokens_per_s; each
system's median relative to `roll` measured in the same run; and the wall time of a whole compare.
Targets: one 2-hour 32-GPU scenario for one system under 30 s; compare under 3 minutes.
Every run starts with the predictor's caches empty (`prepare` and the evaluations it remembers), as
in a fresh process: a repeat would otherwise find the answers of the first and time only the engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pearl.controlplane.core.predictor import prepare
from pearl.sim.experiments import compare, run_system
from pearl.sim.scenario import load_scenario, shipped_scenarios
from pearl.sim.systems import SYSTEMS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scenario", action="append", help="default: every shipped paper scenario")
    args = parser.parse_args()
    names = args.scenario or [p.stem for p in shipped_scenarios() if p.stem.startswith("paper-")]
    out: dict = {"repeat": args.repeat, "scenarios": {}}
    for name in names:
        sc = load_scenario(name)
        rows = {}
        for system in SYSTEMS:
            walls, result = [], None
            for _ in range(args.repeat):
                prepare.cache_clear()
                t0 = time.perf_counter()
                result = run_system(sc, system)
                walls.append(time.perf_counter() - t0)
            rows[system] = {
                "wall_s_median": round(statistics.median(walls), 3),
                "wall_s_min": round(min(walls), 3), "wall_s_max": round(max(walls), 3),
                "events_per_s": round(result.events / statistics.median(walls)),
                "tokens_per_s": round(result.tokens_per_s, 1),
            }
        base = rows["roll"]["wall_s_median"]
        for row in rows.values():
            row["wall_vs_roll"] = round(row["wall_s_median"] / base, 2)
        prepare.cache_clear()
        t0 = time.perf_counter()
        compare(sc)
        out["scenarios"][name] = {"systems": rows, "compare_wall_s": round(time.perf_counter() - t0, 3)}
    rows = [r for s in out["scenarios"].values() for r in s["systems"].values()]
    out["max_one_system_wall_s"] = max(r["wall_s_max"] for r in rows)
    out["max_compare_wall_s"] = max(s["compare_wall_s"] for s in out["scenarios"].values())
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
