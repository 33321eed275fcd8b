"""Can the free parameters reach the calibration figures the fit misses? One JSON object.

The fit (docs/fidelity.md, sections 2-4) reaches Fig. 2a's scale and Fig. 2b but not Fig. 2a's
falls with more GPUs nor Fig. 2c's split-against-colocated over batch size. This scans every free
parameter of section 1 over its documented range (`sim/fidelity.py`, `scan_space`) in two stages:

1. Fig. 2a and 2b (~2 s of one core each) at the fit itself, at each parameter alone at both ends
   of its range, and at a Latin hypercube of `--points` settings over all seven together;
2. Fig. 2c (~20 s each) at the fit, at each parameter's two ends, and at every hypercube setting
   that keeps the reached figures (at most `--fig2c-max` of them).

Figures are evaluated exactly as `bench/fidelity.py` does. Per missed figure it reports the closest
it comes among the settings that keep every reached figure within 25% of the paper's (`held`) and
among all settings (`any`, with the figures that setting breaks). `better_fit` lists the settings
that hold every reached figure and reach a missed one: a better fit than the frozen one, if any.
Settings run in parallel (`--jobs`, one per CPU by default).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

from pearl.sim import fidelity


def _stage1(point: dict) -> dict:
    t0 = time.perf_counter()
    figs = fidelity.evaluate(point["setting"], with_fig2c=False)
    wall = round(time.perf_counter() - t0, 1)
    return {**point, "figures": figs, "broken": fidelity.held_broken(figs), "wall_s": wall}


def _stage2(setting: dict) -> dict:
    return fidelity.evaluate_fig2c(setting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=128, help="Latin-hypercube settings")
    parser.add_argument("--seed", type=int, default=1, help="the Latin hypercube's seed")
    parser.add_argument("--fig2c-max", type=int, default=12, help="hypercube settings that hold the reached "
                                                                     "figures evaluated on Fig. 2c, at most")
    parser.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    args = parser.parse_args()
    if args.points < 0 or args.fig2c_max < 0:
        parser.error("--points and --fig2c-max must be >= 0")
    t0 = time.perf_counter()
    jobs = args.jobs or os.cpu_count() or 1
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        results = pool.map(_stage1, fidelity.scan_points(args.points, args.seed))
        held_lhs = [r for r in results if r["kind"] == "latin-hypercube" and not r["broken"]]
        second = [r for r in results if r["kind"] != "latin-hypercube"] + held_lhs[: args.fig2c_max]
        for r, c in zip(second, pool.map(_stage2, [r["setting"] for r in second]), strict=True):
            r["figures"]["fig2c"] = c
    for r in results:
        r["missed"] = fidelity.missed(r["figures"])
    held = [r for r in results if not r["broken"]]
    better = []
    for r in held:
        reached = [name for name, m in r["missed"].items() if m["reached"]]
        if reached:
            better.append({"kind": r["kind"], "setting": r["setting"], "reached": reached})
    print(json.dumps({
        "space": [{"name": d.name, "low": d.low, "high": d.high, "fitted": round(d.fitted, 4), "log": d.log}
                  for d in fidelity.scan_space()],
        "tolerance": {"relative": fidelity.TOLERANCE, "split_gain_points": fidelity.SPLIT_GAIN_POINTS},
        "settings": len(results),
        "held": len(held),
        "fig2c_settings": len(second),
        "broken_count": {name: sum(name in r["broken"] for r in results)
                         for name in sorted({n for r in results for n in r["broken"]})},
        "best_reachable": fidelity.best_reachable(results),
        "better_fit": better,
        "results": results,
        "machine": {"cpus": os.cpu_count(), "jobs": jobs, "load_1m": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=1, default=str))


if __name__ == "__main__":
    main()
