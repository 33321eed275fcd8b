"""Preemptible traces as grants and notices of whole workers; the policies never see ahead."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from pearl.policies.base import Policy
from pearl.sim.availability import availability_changes
from pearl.sim.runner import Simulation
from pearl.sim.scenario import load_scenario
from pearl.sim.systems import system

pytestmark = pytest.mark.unit


def _scenario(tmp_path, data, max_gpus=12, tp=2, duration=600):
    (tmp_path / "t.json").write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": data}))
    raw = load_scenario("paper-qwen3-8b-seg1").model_dump(mode="json", exclude={"source", "trace_data"})
    raw["cluster"]["preemptible"] = {"trace": str(tmp_path / "t.json"), "max_gpus": max_gpus, "notice_s": 30}
    raw["tp"], raw["duration_s"] = tp, duration
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(raw))
    return load_scenario(path)


def test_rises_grant_and_drops_revoke_the_highest_slots(tmp_path):
    changes = availability_changes(_scenario(tmp_path, [4, 4, 8, 3, 3, 12]))
    assert [(c.t, c.workers, c.granted, c.revoked) for c in changes] == [
        (0.0, 2, (0, 1), ()),
        (120.0, 4, (2, 3), ()),
        (180.0, 1, (), (1, 2, 3)),  # 3 GPUs floor to one TP2 worker
        (300.0, 6, (1, 2, 3, 4, 5), ()),
    ]


def test_capped_at_max_gpus_and_the_last_value_holds(tmp_path):
    sc = _scenario(tmp_path, [20, 2], max_gpus=8, duration=3600)
    changes = availability_changes(sc)
    assert [(c.t, c.workers) for c in changes] == [(0.0, 4), (60.0, 1)]
    assert sc.preemptible_gpus_at(3000) == 2


def test_no_preemptible_no_changes():
    sc = load_scenario("ablation-qwen3-8b-dedicated4")
    assert availability_changes(sc) == []


def test_the_shipped_trace_replays_with_its_mean(tmp_path):
    sc = load_scenario("paper-qwen3-8b-seg2")
    changes = availability_changes(sc)
    gap = sc.trace_data.gap_seconds
    ticks = int(sc.duration_s // gap)
    level, series, i = 0, [], 0
    for k in range(ticks):
        while i < len(changes) and changes[i].t <= k * gap:
            level = changes[i].workers
            i += 1
        series.append(level * sc.tp)
    assert sum(series) / ticks == pytest.approx(sc.mean_preemptible_gpus())


@dataclass
class Recorded:
    """A policy that logs every call it answers: (signals, snapshot, target)."""

    inner: Policy
    log: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.inner.name

    def initial_memory(self):
        return self.inner.initial_memory()

    def decide(self, snapshot, signals, memory):
        target, memory = self.inner.decide(snapshot, signals, memory)
        self.log.append((signals, snapshot, target))
        return target, memory


@pytest.mark.parametrize("name", ["rlboost-plus", "pearl"])
def test_decisions_before_a_trace_change_do_not_depend_on_what_follows_it(tmp_path, name):
    # two traces equal for the first 20 minutes (grants and a notice), then a rise in one and a drop in the other
    prefix = [8] * 5 + [4] * 5 + [10] * 10
    logs = []
    for i, rest in enumerate(([12] * 20, [2] * 20)):
        (tmp_path / str(i)).mkdir()
        sc = _scenario(tmp_path / str(i), prefix + rest, duration=2400)
        policy = Recorded(system(name).policy(sc))
        Simulation(sc, policy).run()
        logs.append(policy.log)
    split = 20 * 60.0
    before = [[call for call in log if call[0].now < split] for log in logs]
    assert before[0] == before[1]
    events = {e for signals, _, _ in before[0] for e in signals.event.split(",")}
    assert {"start", "grant", "notice", "rollout_end"} <= events
    after = [[call for call in log if call[0].now >= split] for log in logs]
    assert after[0] and after[1] and after[0] != after[1]  # the traces do differ from then on
