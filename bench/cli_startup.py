"""Start-up cost of the command line: median CPU time (user + system) of `pearlctl --help` and
`pearlctl status --json`, each a fresh process.

Prints one JSON object. `status --json` runs against an embedded PostgreSQL under a temporary
`PEARL_HOME` (started, migrated and given the small inventory once before timing; stopped after),
so its figure is the command's own start-up plus one status read. CPU time is the child's
(`resource.getrusage(RUSAGE_CHILDREN)`), which a busy machine disturbs less than wall time.

    .venv/bin/python bench/cli_startup.py [--repeat 9]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEARLCTL = Path(sys.executable).parent / "pearlctl"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(args: list[str], env: dict[str, str], repeat: int) -> dict[str, float]:
    cpu, wall = [], []
    for _ in range(repeat):
        c0, w0 = _cpu(), time.perf_counter()
        proc = subprocess.run([str(PEARLCTL), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        wall.append(time.perf_counter() - w0)
        cpu.append(_cpu() - c0)
        if proc.returncode != 0:
            raise SystemExit(f"pearlctl {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"cpu_s_median": round(statistics.median(cpu), 3), "cpu_s_min": round(min(cpu), 3),
            "wall_s_median": round(statistics.median(wall), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="pearl-bench-cli-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARL_")}
    env["PEARL_HOME"] = str(home)
    try:
        for setup in (["init"], ["cluster", "import", str(REPO / "sim" / "inventories" / "small.yaml")]):
            subprocess.run([str(PEARLCTL), *setup], env=env, cwd=REPO, check=True, capture_output=True, timeout=300)
        results = {
            "pearlctl --help": measure(["--help"], env, args.repeat),
            "pearlctl status --json": measure(["status", "--json"], env, args.repeat),
        }
    finally:
        subprocess.run([str(PEARLCTL), "db", "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"benchmark": "cli_startup", "repeat": args.repeat, "python": platform.python_version(),
                      "load_avg_1m": round(os.getloadavg()[0], 2), "results": results}, indent=2))


if __name__ == "__main__":
    main()
