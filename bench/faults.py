"""The fault matrix: each fault injected into a live run of its own (agents/faults.py), one row per fault.

Each run is `pearlctl demo`'s live system on embedded PostgreSQL and Redis under a temporary
PEARL_HOME, with steady traffic from the trainer emulator, borrowing plans and weight syncs; the fault
comes `--at-s` wall seconds after the trainer starts (a partition lasts `--hold-s`), and the run ends
after `--steps` training steps. `--json` prints `{"faults": [...]}` with, per fault: `fault`,
`recovered_s`, `plans_failed`, `steps_applied_twice`, `gpus_double_held`, `late_returns`,
`requests_lost`, `requests_resubmitted`, `weights_mismatched`, `violations` (and `detail`). The exit
code is 1 when a row shows a loss (a lost request, a double application, a double hold, a mismatch,
a violation, a failed plan) or no recovery within `--recover-within-s`.

  python bench/faults.py --json                       # all nine
  python bench/faults.py --fault postgres_restart --fault clock_skew
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from pearl.agents.faults import FAULTS, FaultReport, run_fault

LOSSES = ("plans_failed", "steps_applied_twice", "gpus_double_held", "requests_lost", "weights_mismatched",
          "violations")


def failures(report: FaultReport, recover_within_s: float) -> list[str]:
    row = report.to_dict()
    found = [f"{key} {row[key]}" for key in LOSSES if row[key]]
    if report.recovered_s is None or report.recovered_s > recover_within_s:
        found.append(f"recovered_s {report.recovered_s}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", action="append", choices=FAULTS, help="a fault to run (repeat; default all)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run")
    parser.add_argument("--speed", type=float, default=10.0, help="model seconds per wall second")
    parser.add_argument("--at-s", type=float, default=6.0, help="wall seconds after the trainer starts")
    parser.add_argument("--hold-s", type=float, default=30.0, help="how long the partition lasts (wall s)")
    parser.add_argument("--recover-within-s", type=float, default=60.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows, bad = [], {}
    for fault in args.fault or FAULTS:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"pearl-fault-{fault}-") as home:
            Path(home).chmod(0o755)  # the embedded PostgreSQL runs as its own user under root
            report = run_fault(fault, Path(home), steps=args.steps, speed=args.speed, at_s=args.at_s,
                               hold_s=args.hold_s)
        row = {**report.to_dict(), "wall_s": round(time.monotonic() - started, 1)}
        rows.append(row)
        if failures(report, args.recover_within_s):
            bad[fault] = failures(report, args.recover_within_s)
        if not args.json:
            print(f"{fault:20s} recovered {report.recovered_s} s; lost {report.requests_lost}, "
                  f"resubmitted {report.requests_resubmitted}, plans failed {report.plans_failed}, "
                  f"violations {report.violations}" + (f"  <- {bad[fault]}" if fault in bad else ""), flush=True)
    if args.json:
        print(json.dumps({"faults": rows, "failed": bad}, indent=1, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
