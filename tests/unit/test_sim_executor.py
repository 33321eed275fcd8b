"""The simulator's executor: step order and durations, all-or-nothing groups, superseding plans,
flips on an idle server, and a start that waits for a release under way."""

from __future__ import annotations

import heapq

import pytest
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Activity, Role
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.predictor import Config
from pearl.controlplane.core.switching import SwitchCosts, switch_cost_s
from pearl.policies.base import colocated, split
from pearl.sim.engine import Engine, EngineTiming, Request
from pearl.sim.executor import Executor
from pearl.sim.scenario import load_scenario
from pearl.sim.trajectories import Trajectory
from pearl.sim.workers import Cluster

pytestmark = pytest.mark.unit

SCENARIO = load_scenario("paper-qwen3-8b-seg1")  # cold 60, admit 12, flip 8, on 6, off 3.5, weights 2
TIMING = EngineTiming(PerfModel(default_catalog().model("qwen3-8b"), default_catalog().gpu("h800"), 2))


class Bench:
    """The executor over a real cluster layout, with a recording actuator and a clock."""

    def __init__(self) -> None:
        self.cluster = Cluster(SCENARIO)
        for w in self.cluster.preemptible:
            w.granted = True
        self.workers = {w.id: w for w in self.cluster.workers}
        self.log: list[tuple[float, str, int]] = []
        self.queue: list = []
        self.finished: list = []
        self.ex = Executor(SCENARIO.reconfig, SCENARIO.training.weight_sync_s, self, self.workers)
        self.now = 0.0

    # actuator
    def drain(self, w, now): self.log.append((now, "drain", w.id))
    def interrupt(self, w, now): self.log.append((now, "interrupt", w.id))
    def stop(self, w, now):
        self.log.append((now, "stop", w.id))
        w.engine = None
    def freed(self, w, now):
        w.holds_gpus = False
        self.log.append((now, "freed", w.id))
    def bound(self, w, now):
        w.holds_gpus = True
        self.log.append((now, "bound", w.id))
    def started(self, w, role, now):
        w.engine = Engine(w.id, role, TIMING, 1_000_000)
        self.log.append((now, f"started:{role}", w.id))
    def loaded(self, w, now): self.log.append((now, "loaded", w.id))
    def admitted(self, w, now): self.log.append((now, "admitted", w.id))
    def schedule(self, t, run): heapq.heappush(self.queue, (t, id(run), run))
    def plan_finished(self, plan, now): self.finished.append((now, plan.failed))

    def apply(self, target):
        snap = self.cluster.snapshot(0, overlap_free=True)
        return self.ex.apply(orchestrate(snap, target), self.now)

    def advance(self, until=float("inf")):
        while self.queue and self.queue[0][0] <= until:
            t, _, run = heapq.heappop(self.queue)
            self.now = t
            self.ex.completed(run, t)
        self.now = max(self.now, until) if until != float("inf") else self.now

    def when(self, what, wid):
        return [t for t, w_, i in self.log if w_ == what and i == wid]


def test_growth_costs_cold_start_then_weights_then_admission():
    b = Bench()
    b.apply(colocated([0, 1], "grow"))
    assert [w.activity for w in (b.workers[0], b.workers[1])] == [Activity.TRANSITIONING] * 2
    b.advance()
    assert b.when("bound", 0) == [0.0] and b.when("started:colocated", 0) == [60.0]
    assert b.when("loaded", 0) == [62.0] and b.when("admitted", 0) == [74.0] and b.when("admitted", 1) == [74.0]
    assert b.workers[0].activity is Activity.ACTIVE
    assert b.finished == [(74.0, False)]
    assert b.ex.durations["start_dedicated"] == 60.0 and b.ex.durations["admit"] == 12.0


def test_a_member_revoked_before_admission_cancels_the_whole_group():
    b = Bench()
    b.apply(colocated([0, 1, 2], "grow"))
    b.advance(30.0)
    b.apply(colocated([0, 1], "worker 2 is preempted"))  # supersedes 2's start: the group falls
    b.advance()
    assert not b.when("admitted", 0) and not b.when("admitted", 1)
    assert all(not b.workers[i].holds_gpus for i in (0, 1, 2))
    assert all(b.workers[i].activity is Activity.INACTIVE for i in (0, 1, 2))
    assert b.ex.cancelled_groups == 1 and (30.0, True) in b.finished


def test_overlap_workers_toggle_on_and_off():
    b = Bench()
    overlap = [w.id for w in b.cluster.overlap[:2]]
    b.apply(colocated(overlap, "borrow"))
    b.advance()
    assert b.when("admitted", overlap[0]) == [6.0 + 2.0]  # resume memory, load weights; no admission cost
    b.apply(colocated([], "training wants them back"))
    assert b.workers[overlap[0]].removing and b.workers[overlap[0]].releasing
    b.advance()
    assert b.when("freed", overlap[0]) == [b.now] and b.now == pytest.approx(8.0 + 3.5)
    assert b.workers[overlap[0]].activity is Activity.INACTIVE


def test_an_overlap_worker_started_in_another_mode_restarts():
    b = Bench()
    ids = [w.id for w in b.cluster.overlap[:2]]
    b.apply(split(ids, 1, "borrow split"))  # the sleeping processes were launched colocated
    b.advance()
    assert b.when("admitted", ids[0]) == [60.0 + 2.0]


def test_a_flip_waits_for_the_drained_server_to_go_idle():
    b = Bench()
    b.apply(split([0, 1], 1, "split"))
    b.advance()
    decode = next(i for i in (0, 1) if b.workers[i].role is Role.DECODE)
    engine = b.workers[decode].engine
    traj = Trajectory(0, 0, 0, 100, [10], [], [], False)
    req = Request(traj, 1)
    assert engine.submit(req, b.now) == [("reserved", req)]  # a request in flight on the decode worker
    start = b.now
    b.apply(split([0, 1], 1, "swap roles", pinned={decode: Role.PREFILL}))
    b.advance()
    assert not b.when("admitted", decode)[1:]  # waiting: not idle
    engine.inbound.clear()
    b.now = start + 5.0
    b.ex.worker_idle(b.workers[decode], b.now)
    b.advance()
    assert b.when("admitted", decode)[-1] == pytest.approx(start + 5.0 + 8.0)
    assert b.workers[decode].role is Role.PREFILL


def test_the_hysteresis_charges_a_ratio_change_what_the_executor_takes():
    b = Bench()
    b.apply(split([0, 1, 2, 3], 1, "1P3D"))
    b.advance()
    start = b.now
    b.apply(split([0, 1, 2, 3], 2, "2P2D"))  # one idle decode server flips in place
    b.advance()
    flipped = [i for i in range(4) if len(b.when("admitted", i)) == 2]
    out_of_service = sum(b.when("admitted", i)[-1] - start for i in flipped)
    assert len(flipped) == 1 and out_of_service == pytest.approx(SCENARIO.reconfig.role_switch_s)
    costs = SwitchCosts.from_reconfig(SCENARIO.reconfig, SCENARIO.training.weight_sync_s)
    assert switch_cost_s(Config.split(1, 3), Config.split(2, 2), costs) * 4 == pytest.approx(out_of_service)


def test_a_start_waits_for_the_release_under_way():
    b = Bench()
    ov = b.cluster.overlap[0].id
    b.apply(colocated([ov], "borrow"))
    b.advance()
    b.apply(colocated([], "return"))  # release takes 3.5 s
    b.advance(b.now + 1.0)
    b.apply(colocated([ov], "borrow again"))
    b.advance()
    freed, bound = b.when("freed", ov), b.when("bound", ov)
    assert len(bound) == 2 and bound[1] >= freed[0]
    assert b.workers[ov].activity is Activity.ACTIVE
