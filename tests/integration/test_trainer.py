"""The trainer emulator against a real control plane: the run lasts its duration, whatever the trace, and
its throughput is measured over the run alone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pearl.agents.demo import NODES, inventory_for
from pearl.agents.drivers.process import free_port
from pearl.agents.trainer import TrainerEmulator, TrainerStats, summary
from pearl.controlplane.api import ControlPlane
from pearl.controlplane.core.domain import GPUState, NodeZone
from pearl.controlplane.store import signals
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.inventory_import import import_inventory
from pearl.controlplane.store.schema import GPU
from pearl.sim.availability import availability_changes
from pearl.sim.scenario import load_scenario
from sqlalchemy import Engine, select

pytestmark = pytest.mark.integration

SPEED = 1000.0  # model seconds per wall second


def test_the_run_outlasts_the_trace_and_replays_every_change_within_its_duration(db_engine: Engine,
                                                                                tmp_path: Path) -> None:
    sc = load_scenario("demo-qwen3-30b-a3b-seg2")
    changes = availability_changes(sc)
    assert changes[-1].t < sc.duration_s  # the trace ends before the run must
    with transaction(db_engine, actor="test", reason="demo inventory") as session:
        import_inventory(session, inventory_for(sc, SPEED))
    speed = SPEED / 4  # the last change is 120 model s before the end: 0.5 s of wall time for its calls
    trainer = TrainerEmulator(sc, ControlPlane(engine=db_engine), f"http://127.0.0.1:{free_port()}", speed=speed,
                              snapshot_dir=tmp_path, preemptible_node=NODES[NodeZone.PREEMPTIBLE], retry_s=0.05)
    assert trainer.grant_initial() == 2 * sc.tp  # the two slots granted at t=0

    stats = asyncio.run(trainer.run())

    assert stats.elapsed() * speed >= sc.duration_s
    window = stats.elapsed()
    time.sleep(0.05)
    assert stats.elapsed() == window  # the metric's window closed with the run, not when it is read
    later = [c for c in changes if c.t > 0]
    assert stats.grants == sum(bool(c.granted) for c in later)
    assert stats.revocations == sum(bool(c.revoked) for c in later)
    # the last change took every preemptible GPU back, with notice: once its notice has run out (on a
    # loaded machine, maybe only after the run's end), none is left
    time.sleep(sc.cluster.preemptible.notice_s / speed)
    with transaction(db_engine) as session:
        revoked = signals.enforce_deadlines(session)
        states = set(session.scalars(select(GPU.state).where(GPU.zone == NodeZone.PREEMPTIBLE)))
    assert revoked and states <= {GPUState.REVOKED, GPUState.UNAVAILABLE}, states


def test_the_summary_measures_the_simulators_three_metrics_in_model_seconds() -> None:
    stats = TrainerStats(started=100.0, trained_tokens=60_000, training_steps=3)
    stats.trained_ends, stats.trained_step_tokens = [10.0, 30.0, 50.0], [20_000, 16_000, 24_000]
    stats.last_trained_s, stats.ended = 50.0, 160.0  # the third step ended 50 s into a 60 s run
    s = summary(stats, speed=10.0)
    assert s["wall_s"] == 60.0 and s["model_s"] == 600.0
    assert s["tokens_per_s_window"] == 60_000 / 600.0
    assert s["tokens_per_s"] == pytest.approx((16_000 / 200.0 + 24_000 / 200.0) / 2)  # the first step dropped
    assert s["tokens_per_s_ratio_of_sums"] == pytest.approx(40_000 / 400.0)
    assert summary(TrainerStats(started=0.0, ended=1.0), speed=10.0)["tokens_per_s"] == 0.0


def test_a_run_given_steps_ends_after_its_last_training_step(db_engine: Engine, tmp_path: Path) -> None:
    sc = load_scenario("demo-qwen3-30b-a3b-seg2").model_copy(update={"duration_s": 36_000.0})
    with transaction(db_engine, actor="test", reason="demo inventory") as session:
        import_inventory(session, inventory_for(sc, SPEED))
    trainer = TrainerEmulator(sc, ControlPlane(engine=db_engine), f"http://127.0.0.1:{free_port()}", speed=SPEED,
                              snapshot_dir=tmp_path, retry_s=0.05, steps=2)

    stats = asyncio.run(trainer.run())

    assert stats.training_steps == 2
    assert stats.elapsed() * SPEED < sc.duration_s  # the steps ended it, not the duration
    assert stats.last_trained_s == pytest.approx(stats.elapsed(), abs=0.5)  # it ended with the last step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1", "v2"]  # a snapshot each step, no third
