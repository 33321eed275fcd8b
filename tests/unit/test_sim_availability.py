"""Preemptible traces as grants and notices of whole workers; the policies never see ahead."""

from __future__ import annotations

import json

import pytest
from pearl.sim.availability import availability_changes
from pearl.sim.scenario import load_scenario

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
