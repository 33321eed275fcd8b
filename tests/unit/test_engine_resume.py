"""`Engine.resume`: a live server told to continue ends a pause before its time (the simulated
server pauses its engine indefinitely on pause_generation in place or retract)."""

from __future__ import annotations

import math

import pytest
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.sim.engine import Engine, EngineTiming, Request
from pearl.sim.trajectories import Trajectory

pytestmark = pytest.mark.unit


def test_resume_ends_an_open_ended_pause_and_the_work_goes_on():
    perf = PerfModel(default_catalog().model("qwen3-8b"), default_catalog().gpu("h100"), 1)
    engine = Engine(0, Role.COLOCATED, EngineTiming(perf), perf.kv_capacity_tokens)
    engine.pause(0.0, math.inf)
    req = Request(Trajectory(1, 0, 1, 100, [10], [], [], False), 1)
    engine.submit(req, 0.0)
    assert engine.busy_until == math.inf  # nothing runs while paused
    engine.resume(1.0)
    assert engine.busy_until is not None and 1.0 < engine.busy_until < math.inf
    done = []
    while engine.busy_until is not None:
        done += engine.wake(engine.busy_until)
    assert [what for what, _ in done] == ["done"] and req.traj.turn_generated == 10
    engine.resume(5.0)  # not paused: nothing changes
    assert engine.busy_until is None
