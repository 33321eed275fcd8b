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
from pearl.controlplane.store.schema import GPU, RolloutProgress
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
    speed = SPEED / 10  # the last change is 120 model s before the end: 1.2 s of wall time for its calls, on a
    # loaded machine too (0.5 s was short of it once, with three test workers on two cores)
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


def _front_door(answered: list[tuple[float, str]], turn_s: float):
    """A front door that answers every /generate after `turn_s` wall seconds, recording (when, rid)."""
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(turn_s)
        answered.append((time.monotonic(), body["rid"]))
        n = body["sampling_params"]["max_new_tokens"]
        return web.json_response({"output_ids": [1] * n, "meta_info": {}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


@pytest.mark.parametrize("batching", ["async", "sync"])
def test_the_emulator_runs_the_simulators_batch_rule_and_reports_the_trajectories_in_flight(
        db_engine: Engine, tmp_path: Path, batching: str) -> None:
    from aiohttp import web

    sc = load_scenario("demo-qwen3-30b-a3b-seg2", [
        "workload.batch_size=8", "workload.group_size=2", "training.trajectories_per_slot=2", "training.step_s=20",
        "training.weight_sync_s=1", f"training.batching={batching}", "workload.env_latency_s.median=0.5",
        "workload.env_latency_s.p99=1", "duration_s=100000"])
    with transaction(db_engine, actor="test", reason="demo inventory") as session:
        import_inventory(session, inventory_for(sc, SPEED))
    answered: list[tuple[float, str]] = []
    port = free_port()

    async def run() -> TrainerStats:
        runner = web.AppRunner(_front_door(answered, 0.002))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            trainer = TrainerEmulator(sc, ControlPlane(engine=db_engine), f"http://127.0.0.1:{port}", speed=SPEED,
                                      snapshot_dir=tmp_path, retry_s=0.05, steps=3)
            return await trainer.run()
        finally:
            await runner.cleanup()

    stats = asyncio.run(run())
    assert stats.training_steps == 3 and stats.failed_requests == 0
    first: dict[int, float] = {}  # trajectory id -> its first turn's answer
    last: dict[int, float] = {}
    for at, rid in answered:
        tid = int(rid[1:].partition("-")[0])
        first.setdefault(tid, at)
        last[tid] = at
    b, slots = 8, 4
    ends = [stats.started + s for s in stats.trained_ends]
    for tid, at in first.items():
        k, i = divmod(tid, b)
        if i >= slots:  # the slot's second trajectory of the batch follows its first
            assert at > last[tid - slots]
        elif k >= 1:  # and a slot's next batch follows its previous one
            assert at > last[k * b - b + i + slots]
        if batching == "async" and k >= 2:  # never more than one batch ahead of the weights it serves
            assert at > ends[k - 2]
    complete = {k: max(last[k * b + i] for i in range(b)) for k in range(3)}
    if batching == "sync":  # a barrier: nothing of batch k before batch k-1 is complete
        assert all(first[k * b + i] > complete[k - 1] for k in (1, 2) for i in range(b))
    else:  # slots ran ahead: some of batch 1 started before batch 0 was complete
        assert any(first[b + i] < complete[0] for i in range(b))
    with transaction(db_engine) as session:
        rows = session.execute(select(RolloutProgress.step, RolloutProgress.finished, RolloutProgress.in_flight)
                               .order_by(RolloutProgress.step)).all()
    assert [r.step for r in rows][:3] == [0, 1, 2] and all(r.finished == b for r in rows[:3])
    assert all(r.in_flight is not None and 0 <= r.in_flight <= slots for r in rows)
