"""The front door's supervision of its child routers (agents/router.py, `FrontDoor.supervise`): when a
dead child is started again, and how long it waits after a failure. The restart itself (a real
sglang-router started again and given back its workers under load) is tested end to end in
tests/e2e/test_frontdoor.py; here it is replaced by one that fails on demand, under a fake clock."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from pearl.agents.router import FrontDoor, FrontDoorConfig

pytestmark = pytest.mark.unit


def _exited() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc


def _supervised(door: FrontDoor, clock: list[float], fail_first: int, until_tries: int) -> list[float]:
    """Run the supervisor until `until_tries` restarts were tried; the fake clock's time of each."""
    tries: list[float] = []
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    async def restart(child) -> None:
        tries.append(clock[0])
        if len(tries) <= fail_first:
            raise RuntimeError("router colocated did not answer in 60 s")
        child.proc, child.started, child.restarting = sleeper, clock[0], False

    door._restart = restart  # type: ignore[method-assign]

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(door.supervise(stop, every_s=0.001, clock=lambda: clock[0]))
        for _ in range(20000):
            if len(tries) >= until_tries:
                break
            await asyncio.sleep(0.001)
            clock[0] += 0.25
        stop.set()
        await task

    try:
        asyncio.run(run())
    finally:
        sleeper.kill()
        sleeper.wait()
    return tries


def test_a_router_that_ran_a_while_is_started_again_at_once_and_one_that_keeps_failing_backs_off(tmp_path) -> None:
    door = FrontDoor(FrontDoorConfig(port=1, run_dir=str(tmp_path)))
    clock = [1000.0]
    colocated = door.children["colocated"]
    colocated.proc, colocated.started = _exited(), clock[0] - 600  # died after ten minutes up
    tries = _supervised(door, clock, fail_first=3, until_tries=4)
    assert tries[0] - 1000.0 < 1.0  # at once
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    for gap, wanted in zip(gaps, (2, 4, 8), strict=True):  # after each failed restart: 2, 4, 8 s
        assert wanted <= gap < wanted + 1.0  # (the fake clock moves in steps of 0.25 s)
    assert not colocated.restarting  # the last one started it: requests flow again


def test_a_router_that_dies_soon_after_its_start_waits_before_it_is_started_again(tmp_path) -> None:
    door = FrontDoor(FrontDoorConfig(port=1, run_dir=str(tmp_path)))
    clock = [1000.0]
    split = door.children["split"]
    split.proc, split.started = _exited(), clock[0] - 5  # a crash loop: up for 5 s
    tries = _supervised(door, clock, fail_first=0, until_tries=1)
    assert 2.0 <= tries[0] - 1000.0 < 3.0
    assert not split.restarting and door.children["colocated"].proc is None  # the other child untouched
