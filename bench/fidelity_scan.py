"""Can the free parameters reach the calibration figures the fit misses? One JSON object.

The fit (docs/fidelity.md, "2. The fit (frozen)") reaches Fig. 2a's scale and Fig. 2b but not Fig. 2a's
falls with more GPUs nor Fig. 2c's split-against-colocated over batch size. This scans every free
parameter of section 1 over its documented range (`sim/fidelity.py`, `scan_space`) in two stages:

1. Fig. 2a and 2b (~2 s of one core each) at the fit itself, at each parameter alone at both ends
   of its range, at a Latin hypercube of `--points` settings over all seven ranges together, and
   at a local one of `--local` settings over 30% of each range around the fit (where the settings
   that keep the reached figures lie: few of the first hypercube's do);
2. Fig. 2c (~20 s each) at the fit, at each parameter's two ends, and at the hypercube settings
   that keep the reached figures (at most `--fig2c-max` of them, the first drawn).

The fit is evaluated on `--noise-seeds` seeds too: `noise` gives each figure's spread over them,
the measurement's own noise, against which a distance to the paper's is to be read.

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
    figs = fidelity.evaluate(point["setting"], with_fig2c=False, seed=point.get("seed"))
    wall = round(time.perf_counter() - t0, 1)
    return {**point, "figures": figs, "broken": fidelity.held_broken(figs), "wall_s": wall}


def _stage2(point: dict) -> dict:
    return fidelity.evaluate_fig2c(point["setting"], seed=point.get("seed"))


def _noise(runs: list[dict]) -> dict:
    """Each missed figure's values over the fit's seeds, and their spread (max - min)."""
    out = {}
    for name in runs[0]["missed"]:
        values = [r["missed"][name]["value"] for r in runs if name in r["missed"]]
        numeric = [v for v in values if isinstance(v, int | float)]
        out[name] = {"values": values, "spread": round(max(numeric) - min(numeric), 4) if numeric else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=48, help="Latin-hypercube settings over the whole ranges")
    parser.add_argument("--local", type=int, default=64, help="Latin-hypercube settings around the fit")
    parser.add_argument("--seed", type=int, default=1, help="the Latin hypercubes' seed")
    parser.add_argument("--fig2c-max", type=int, default=10, help="hypercube settings that hold the reached "
                                                                     "figures evaluated on Fig. 2c, at most")
    parser.add_argument("--noise-seeds", type=int, default=3, help="seeds the fit is evaluated on")
    parser.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    args = parser.parse_args()
    if min(args.points, args.local, args.fig2c_max) < 0 or args.noise_seeds < 1:
        parser.error("--points, --local and --fig2c-max must be >= 0, --noise-seeds >= 1")
    t0 = time.perf_counter()
    jobs = args.jobs or os.cpu_count() or 1
    points = fidelity.scan_points(args.points, args.seed, args.local)
    fitted = points[0]["setting"]
    reseeded = [{"kind": f"fitted, seed {k}", "setting": fitted, "seed": k} for k in range(2, args.noise_seeds + 1)]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        results = pool.map(_stage1, points + reseeded)
        results, reseeded = results[: len(points)], results[len(points):]
        sampled = [r for r in results if r["kind"].endswith("hypercube") and not r["broken"]]
        second = [r for r in results if not r["kind"].endswith("hypercube")] + sampled[: args.fig2c_max] + reseeded
        for r, c in zip(second, pool.map(_stage2, second), strict=True):
            r["figures"]["fig2c"] = c
    for r in results + reseeded:
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
        "fig2c_settings": len(second) - len(reseeded),
        "held_by_kind": {kind: sum(not r["broken"] for r in results if r["kind"] == kind)
                         for kind in ("latin-hypercube", "local-hypercube")},
        "noise": _noise([results[0], *reseeded]),
        "broken_count": {name: sum(name in r["broken"] for r in results)
                         for name in sorted({n for r in results for n in r["broken"]})},
        "best_reachable": fidelity.best_reachable(results),
        "better_fit": better,
        "results": results,
        "fitted_reseeded": reseeded,
        "machine": {"cpus": os.cpu_count(), "jobs": jobs, "load_1m": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=1, default=str))


if __name__ == "__main__":
    main()
