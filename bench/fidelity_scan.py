"""The pre-registered fit of the calibration round and its scan. One JSON object. The plan:
docs/fidelity.md, "1. The plan (fixed before fitting)".

Every setting is evaluated on Fig. 2a, 2b and 2c (`sim/fidelity.py`, `evaluate`; about 35 s of one
core each) and scored by `loss`, the plan's sum over its fourteen targets:

1. stage 1: the previous round's fit (`ROUND_1`) and a Latin hypercube of `--points` settings over
   the whole ranges (seed `--seed`);
2. stage 2: a Latin hypercube of `--local` settings over 30% of each range around stage 1's
   least-loss setting (seed `--seed` + 1);
3. the fit: the least-loss setting of both stages;
4. around the fit, each parameter alone at both ends of its range (`--no-sides` skips them);
5. the fit on seeds 2 .. `--noise-seeds` (the measurement's own noise).

Per target, `best_reachable` gives the closest any setting came and what that setting left
unreached. Settings run in parallel (`--jobs`, one per CPU by default); the result is the same for
any number of jobs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

from pearl.sim import fidelity


def _evaluate(point: dict) -> dict:
    t0 = time.perf_counter()
    figs = fidelity.evaluate(point["setting"], seed=point.get("seed"))
    return {**point, "figures": figs, "deviations": fidelity.deviations(figs), "loss": fidelity.loss(figs),
            "wall_s": round(time.perf_counter() - t0, 1)}


def _sides(fit: dict[str, float]) -> list[dict]:
    """Each parameter alone at both ends of its range, the others at the fit."""
    out = []
    for d in fidelity.scan_space():
        ends = (d.choices[0], d.choices[-1]) if d.choices else (d.low, d.high)
        for end in ends:
            if end != fit[d.name]:
                out.append({"kind": f"{d.name}={end:g}", "setting": {**fit, d.name: float(end)}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=64, help="stage 1: settings over the whole ranges")
    parser.add_argument("--local", type=int, default=32, help="stage 2: settings around stage 1's best")
    parser.add_argument("--seed", type=int, default=1, help="the first Latin hypercube's seed")
    parser.add_argument("--noise-seeds", type=int, default=3, help="the fit is evaluated on seeds 1 .. N")
    parser.add_argument("--no-sides", action="store_true", help="skip the one-at-a-time settings")
    parser.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    args = parser.parse_args()
    if args.points < 1 or args.local < 0 or args.noise_seeds < 1:
        parser.error("--points must be >= 1, --local >= 0, --noise-seeds >= 1")
    t0 = time.perf_counter()
    jobs = args.jobs or os.cpu_count() or 1
    dims = fidelity.scan_space()
    first = [{"kind": "round-1", "setting": dict(fidelity.ROUND_1)}]
    first += [{"kind": "latin-hypercube", "setting": s} for s in fidelity.latin_hypercube(args.points, dims, args.seed)]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        results = pool.map(_evaluate, first)
        best = min(results, key=lambda r: r["loss"])
        if args.local:
            local = fidelity.latin_hypercube(args.local, dims, args.seed + 1, fidelity.LOCAL_SPAN, best["setting"])
            results += pool.map(_evaluate, [{"kind": "local-hypercube", "setting": s} for s in local])
        fit = min(results, key=lambda r: r["loss"])
        sides = [] if args.no_sides else pool.map(_evaluate, _sides(fit["setting"]))
        noise = pool.map(_evaluate, [{"kind": f"fit, seed {k}", "setting": fit["setting"], "seed": k}
                                     for k in range(2, args.noise_seeds + 1)])
    runs = [fit["figures"], *(r["figures"] for r in noise)]
    mean = fidelity.mean_figures(runs)
    print(json.dumps({
        "space": [{"name": d.name, "low": d.low, "high": d.high, "log": d.log, "choices": list(d.choices)}
                  for d in dims],
        "settings": len(results) + len(sides),
        "fit": {"kind": fit["kind"], "setting": fit["setting"], "loss": fit["loss"], "figures": fit["figures"],
                "deviations": fit["deviations"],
                "reached": sorted(n for n, d in fit["deviations"].items() if d["reached"]),
                "unreached": sorted(n for n, d in fit["deviations"].items() if not d["reached"])},
        "fit_over_seeds": {"seeds": list(range(1, args.noise_seeds + 1)), "mean": mean,
                           "deviations": fidelity.deviations(mean), "loss": fidelity.loss(mean),
                           "per_seed": [{"seed": k + 1, "loss": r["loss"]} for k, r in
                                        enumerate([fit, *noise])]},
        "round_1": next(r for r in results if r["kind"] == "round-1"),
        "stage_1_best": {"setting": best["setting"], "loss": best["loss"]},
        "best_reachable": fidelity.best_reachable(results + sides),
        "sides": sides,
        "results": results,
        "noise": noise,
        "machine": {"cpus": os.cpu_count(), "jobs": jobs, "load_1m": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=1, default=str))


if __name__ == "__main__":
    main()
