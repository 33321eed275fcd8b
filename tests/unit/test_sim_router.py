"""Prefix-sticky routing: turns go back to their prefix holder, spread when a worker is much busier."""

from __future__ import annotations

import pytest
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.sim.engine import Engine, EngineTiming
from pearl.sim.router import Router
from pearl.sim.trajectories import Trajectory

pytestmark = pytest.mark.unit

TIMING = EngineTiming(PerfModel(default_catalog().model("qwen3-8b"), default_catalog().gpu("h800"), 2))


def _engines(*roles: Role) -> list[Engine]:
    return [Engine(i, role, TIMING, 1_000_000) for i, role in enumerate(roles)]


def _trajs(n: int) -> list[Trajectory]:
    return [Trajectory(i, 0, i, 100, [10, 10], [5], [1.0], False) for i in range(n)]


def test_first_turns_spread_evenly_then_stick_to_their_holder():
    router = Router()
    for e in _engines(Role.COLOCATED, Role.COLOCATED, Role.COLOCATED):
        router.admit(e)
    trajs = _trajs(9)
    first = [router.front(t).worker for t in trajs]
    assert sorted(first) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [router.front(t).worker for t in trajs] == first  # sticky


def test_a_new_worker_takes_trajectories_from_a_much_busier_holder():
    router = Router()
    (old,) = _engines(Role.COLOCATED)
    router.admit(old)
    trajs = _trajs(8)
    for t in trajs:
        router.front(t)
    new = Engine(1, Role.COLOCATED, TIMING, 1_000_000)
    router.admit(new)
    moved = [router.front(t).worker for t in trajs]
    assert moved.count(1) == 4  # moves while the holder has 2 more and 1.5x as many: ends 4 / 4
    assert router.owned[old] == 4 and router.owned[new] == 4


def test_a_removed_holder_sends_its_trajectories_to_the_least_loaded():
    router = Router()
    a, b = _engines(Role.COLOCATED, Role.COLOCATED)
    router.admit(a)
    router.admit(b)
    trajs = _trajs(4)
    for t in trajs:
        router.front(t)
    router.remove(a.worker)
    assert {router.front(t).worker for t in trajs} == {b.worker}
    router.finished(trajs[0])
    assert router.owned[b] == 3


def test_split_mode_prefill_sticky_and_decode_least_loaded():
    router = Router()
    p0, p1, d0, d1 = _engines(Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE)
    for e in (p0, p1, d0, d1):
        router.admit(e)
    assert router.can_serve()
    t = _trajs(1)[0]
    holder = router.front(t)
    assert holder.role is Role.PREFILL and router.front(t) is holder
    assert router.decode() is d0  # ties by id
    router.remove(d0.worker)
    assert router.decode() is d1
    router.remove(d1.worker)
    assert not router.can_serve()
