"""The fault matrix (agents/faults.py, bench/faults.py): each of the nine faults injected into a live run
with steady traffic, plans applying and weight syncs; nothing is lost and the fleet recovers within
60 s. Each fault is a run of `bench/faults.py` in a process of its own, on embedded services of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pearl.agents.faults import FAULTS
from plan_support import REPO

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

LOSSES = ("plans_failed", "steps_applied_twice", "gpus_double_held", "requests_lost", "weights_mismatched",
          "violations")


@pytest.mark.xdist_group("fault_matrix")  # one after another: each run is timed against the wall clock
@pytest.mark.timeout(480)
@pytest.mark.parametrize("fault", FAULTS)
def test_the_fleet_survives_the_fault_with_nothing_lost(fault: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARL_")}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "faults.py"), "--fault", fault, "--json"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert done.stdout, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)["faults"]
    assert row["fault"] == fault
    losses = {key: row[key] for key in LOSSES if row[key]}
    assert not losses, (losses, row["detail"])
    assert row["recovered_s"] is not None and row["recovered_s"] <= 60, row
    assert row["detail"]["training_steps"] >= 4 and row["detail"]["stopped"] is None, row["detail"]
    assert done.returncode == 0, done.stderr[-3000:]
