"""The simulated engine against docs/calibration.md's measured serving figures (sim/calibration.py).

Prints one JSON object: each anchor's measured figure, what the engine achieves on its load, and
the deviation (achieved / measured - 1). The engine is never tuned to these: this is the report.
"""

from __future__ import annotations

import json
import time

from pearl.sim.calibration import anchors


def main() -> None:
    t0 = time.perf_counter()
    rows = [{"anchor": a.name, "unit": a.unit, "measured": a.measured, "achieved": round(a.achieved, 5),
             "deviation": round(a.deviation, 4), "source": a.source} for a in anchors()]
    print(json.dumps({"anchors": rows, "wall_s": round(time.perf_counter() - t0, 2)}, indent=2))


if __name__ == "__main__":
    main()
