"""What the trainer, the rollout and the provider report: each event as rows, bad ones refused naming
the field with nothing written (through the Python API, the command line and raw SQL alike)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from pearl.cli.app import app
from pearl.controlplane.api import ControlPlane, ReturnsLate
from pearl.controlplane.core.domain import Activity, GPUState, Role, StepStatus
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store import plan_store, reaper, signals
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import GPU, Lease, RolloutProgress, TrainingStep, WeightSnapshot, Worker
from pearl.controlplane.weights import write_snapshot
from plan_support import claim_ready, import_cluster, propose, report, run_plan, small_inventory
from sqlalchemy import Engine, func, select, text
from typer.testing import CliRunner

pytestmark = pytest.mark.integration


@pytest.fixture
def cp(db_engine: Engine) -> Iterator[ControlPlane]:
    import_cluster(db_engine, small_inventory())
    yield ControlPlane(engine=db_engine)


def gpu_states(engine: Engine, zone: str) -> set[GPUState]:
    with transaction(engine) as session:
        return set(session.scalars(select(GPU.state).where(GPU.zone == zone)))


def serve(engine: Engine, members: set[int]) -> None:
    """Plan and enact (as agents with no servers would, on the real clock) a colocated fleet of `members`."""
    plan_id = propose(engine, Target(frozenset(members), {Role.COLOCATED: len(members)}))
    plan_store.apply(engine, plan_id)
    run_plan(engine, datetime.now(UTC))


def small_snapshot(directory, version: int = 1) -> str:
    write_snapshot({"w.a": np.arange(16, dtype=np.float32) * version, "w.b": np.ones((2, 3), dtype=np.float16)},
                   directory, version=version)
    return str(directory)


def test_a_training_step_with_nothing_borrowed_starts_at_once_and_ends(cp: ControlPlane, tmp_path) -> None:
    started = cp.training_begin(3, wait_s=0)
    assert started.started and started.late_s == 0.0
    assert gpu_states(cp.engine, "training") == {GPUState.TRAINING}
    w1 = small_snapshot(tmp_path / "w1")
    cp.training_end(3, weights_version=1, snapshot=w1)
    assert gpu_states(cp.engine, "training") == {GPUState.FREE}
    with transaction(cp.engine) as session:
        row = session.get(TrainingStep, 3)
        assert row.started_at >= row.requested_at and row.ended_at >= row.started_at and row.weights_version == 1
    cp.training_end(3, weights_version=1, snapshot=w1)  # the same report again changes nothing
    with transaction(cp.engine) as session:
        snap = session.get(WeightSnapshot, 1, populate_existing=True)
        assert snap.uri == w1 and snap.tensors == 2
        assert snap.manifest["w.b"] == {"dtype": "F16", "shape": [2, 3], "checksum": snap.manifest["w.b"]["checksum"]}
        assert snap.manifest["w.b"]["checksum"].startswith("blake3:")


@pytest.mark.parametrize(("events", "message"), [
    ([("begin", 2), ("begin", 1)], "step: training step 1 is not after step 2"),
    ([("begin", 2), ("begin", 3)], "step: training step 3 cannot begin while step 2 has not ended"),
    ([("end", 4)], "step: training step 4 never began"),
    ([("begin", -1)], "step: must be an integer >= 0"),
    ([("begin", 1), ("end1", 1), ("begin", 2), ("end0", 2)], "weights_version: 0 is not newer than 1"),
], ids=["out-of-order", "overlapping", "end-without-begin", "negative", "weights-backwards"])
def test_bad_training_events_are_refused_naming_the_field(cp: ControlPlane, events: list, message: str) -> None:
    *ok, (kind, step) = events
    for k, s in ok:
        if k == "begin":
            cp.training_begin(s, wait_s=0)
        else:
            cp.training_end(s, weights_version=int(k[-1]))
    with transaction(cp.engine) as session:
        before = session.scalar(select(func.count()).select_from(TrainingStep))
    with pytest.raises(BadInput, match=message):
        if kind == "begin":
            cp.training_begin(step, wait_s=0)
        else:
            cp.training_end(step, weights_version=int(kind[-1]) if kind[-1].isdigit() else None)
    with transaction(cp.engine) as session:
        assert session.scalar(select(func.count()).select_from(TrainingStep)) == before


@pytest.mark.parametrize(("sql", "message"), [
    ("INSERT INTO training_steps (step, requested_at) VALUES (-1, now())", "step: must be >= 0"),
    ("INSERT INTO training_steps (step, requested_at) VALUES (5, now()); "
     "INSERT INTO training_steps (step, requested_at) VALUES (6, now())", "cannot begin while step 5"),
    ("INSERT INTO rollout_progress (step, batch_size, finished) VALUES (1, 8, 9)", "finished: must be between"),
    ("INSERT INTO rollout_progress (step, batch_size, finished) VALUES (1, 8, 4); "
     "UPDATE rollout_progress SET finished = 3 WHERE step = 1", "finished: rollout step 1 had 4"),
    ("INSERT INTO rollout_progress (step, batch_size) VALUES (1, 0)", "batch_size: must be > 0"),
], ids=["negative-step", "overlapping-steps", "more-than-the-batch", "count-goes-down", "empty-batch"])
def test_raw_sql_events_are_validated_by_the_database(cp: ControlPlane, sql: str, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        with transaction(cp.engine) as session:
            for statement in sql.split("; "):
                session.execute(text(statement))


def test_rollout_progress_counts_beyond_an_integer_column_are_refused_naming_the_field(cp: ControlPlane) -> None:
    # the fuzzer's find: a batch size of 4,589,975,250 reached the database as a DataError
    for kwargs, field in (({"batch_size": 2**31}, "batch_size"), ({"batch_size": 8, "in_flight": 2**31}, "in_flight")):
        with pytest.raises(BadInput, match=f"{field}: must be an integer between"):
            cp.rollout_progress(0, 0, **kwargs)
    with pytest.raises(BadInput, match="finished: must be an integer between"):
        cp.rollout_progress(0, 2**31, batch_size=8)
    with transaction(cp.engine) as session:
        assert session.get(RolloutProgress, 0) is None  # nothing written
    url = cp.engine.url.render_as_string(hide_password=False)
    res = CliRunner().invoke(app, ["event", "rollout-progress", "--step", "0", "--finished", "0",
                                   "--batch-size", "4589975250"], env={"PEARL_DATABASE_URL": url})
    assert res.exit_code == 2 and "batch_size" in res.output


def test_rollout_progress_is_the_live_remaining(cp: ControlPlane) -> None:
    with pytest.raises(BadInput, match="batch_size: the first report of rollout step 0 names its batch size"):
        cp.rollout_progress(0, 0)
    cp.rollout_progress(0, 0, batch_size=8)
    cp.rollout_progress(0, 5)
    with pytest.raises(BadInput, match="finished: rollout step 0 had 5 trajectories finished"):
        cp.rollout_progress(0, 4)
    with pytest.raises(BadInput, match="batch_size: rollout step 0 has 8 trajectories, not 9"):
        cp.rollout_progress(0, 6, batch_size=9)
    cp.rollout_progress(0, 8)
    with transaction(cp.engine) as session:
        row = session.get(RolloutProgress, 0)
        assert row.finished == 8 and row.ended_at is not None
        from pearl.policies.live.policy_pass import decide

        planned = decide(session)
    assert (planned.signals.rollout_step, planned.signals.remaining, planned.signals.batch_size) == (0, 0, 8)


def test_the_tails_of_complete_steps_are_when_each_trajectory_finished_before_the_end(cp: ControlPlane) -> None:
    import time

    cp.rollout_progress(0, 1, batch_size=4)
    time.sleep(0.2)
    cp.rollout_progress(0, 3)  # two at once
    time.sleep(0.1)
    cp.rollout_progress(0, 4)
    cp.rollout_progress(1, 2, batch_size=4)  # under way: not a tail yet
    with transaction(cp.engine) as session:
        (tail,) = signals.step_tails(session, 3)
        assert len(tail) == 4 and tail[0] == 0.0 and tail[1] == tail[2]
        assert 0.1 <= tail[1] < tail[3] and tail[3] - tail[1] >= 0.2
        from pearl.policies.live.policy_pass import decide

        planned = decide(session)
    assert planned.signals.step_tails == (tail,)  # on the model clock: this inventory runs at time_scale 1


def test_the_trainer_is_about_to_want_its_gpus_once_the_batch_it_trains_on_is_complete(cp: ControlPlane,
                                                                                       tmp_path) -> None:
    from pearl.policies.live.policy_pass import decide

    def wanted() -> bool:
        with transaction(cp.engine) as session:
            planned = decide(session)
        if planned.signals.training_wanted:  # no loan while the trainer is about to ask
            assert not {w.id for w in planned.snapshot.workers if w.zone == "overlap"} & planned.target.members
        return planned.signals.training_wanted

    cp.rollout_progress(0, 3, batch_size=4)
    assert not wanted()  # batch 0 under way: the GPUs are idle until it completes
    cp.rollout_progress(0, 4)
    assert wanted()  # complete: training step 0 begins as soon as the trainer gets to it
    cp.training_begin(0, wait_s=0)
    cp.rollout_progress(1, 4, batch_size=4)  # batch 1 completes while step 0 trains
    cp.training_end(0, weights_version=1, snapshot=small_snapshot(tmp_path / "w1"))
    assert wanted()  # step 0 ended and step 1's batch is ready: the trainer asks at once
    cp.training_begin(1, wait_s=0)
    cp.training_end(1, weights_version=2, snapshot=small_snapshot(tmp_path / "w2", 2))
    cp.rollout_progress(2, 1, batch_size=4)
    assert not wanted()  # batch 2 under way: a window to lend the GPUs in


def test_a_warm_up_leaves_a_sleeping_server_and_the_training_gpus_free(cp: ControlPlane) -> None:
    from pearl.controlplane.store.snapshot import load_snapshot
    from pearl.policies.live.policy_pass import borrow_cycle_costs

    with transaction(cp.engine) as session:
        assert not load_snapshot(session).by_id()[1].warm  # overlap slot 1 never ran a server
    plan_id = propose(cp.engine, Target(frozenset({3}), {Role.COLOCATED: 1}, warm_up=frozenset({1})))
    plan_store.apply(cp.engine, plan_id)
    run_plan(cp.engine, datetime.now(UTC))
    with transaction(cp.engine) as session:
        slots = load_snapshot(session).by_id()
        assert slots[1].warm and slots[1].activity is Activity.INACTIVE and not slots[2].warm
        assert slots[3].activity is Activity.ACTIVE
        leases = session.scalars(select(Lease).where(Lease.kind == "borrowed")).all()
        assert len(leases) == 2 and all(lease.returned_at is not None for lease in leases)
        assert all(lease.deadline is None and lease.active_at is None for lease in leases)
        assert borrow_cycle_costs(session) == []  # a launch, not a toggle: T_toggle learns nothing from it
    assert gpu_states(cp.engine, "training") == {GPUState.FREE}
    started = cp.training_begin(0, wait_s=0)
    assert started.started and started.late_s == 0.0


def test_training_waits_for_borrowed_gpus_and_the_lateness_is_recorded(cp: ControlPlane, clock) -> None:
    serve(cp.engine, {1, 3})  # overlap worker 1 borrows train-0's GPUs 0, 1
    assert gpu_states(cp.engine, "training") == {GPUState.BORROWED, GPUState.FREE}
    with pytest.raises(ReturnsLate, match=r"training step 1: 2 borrowed GPU\(s\) .* not back after 0 s"):
        cp.training_begin(1, wait_s=0)
    with transaction(cp.engine) as session:
        assert session.get(TrainingStep, 1).started_at is None  # it waits for them
        leases = session.scalars(select(Lease).where(Lease.kind == "borrowed")).all()
        assert len(leases) == 2 and all(lease.deadline is not None and lease.training_step == 1 for lease in leases)
    serve(cp.engine, {3})  # the return: worker 1 drains and releases; the step starts with it
    with transaction(cp.engine) as session:
        step = session.get(TrainingStep, 1)
        assert step.started_at is not None and step.late_s > 0
        leases = session.scalars(select(Lease).where(Lease.kind == "borrowed")).all()
        assert all(lease.returned_at is not None and lease.late_s > 0 for lease in leases)
        cycle = session.execute(text("SELECT activation_s, return_s FROM borrow_cycles")).one()
        assert cycle.activation_s >= 0 and cycle.return_s >= 0
    assert gpu_states(cp.engine, "training") == {GPUState.TRAINING}


def plan_status(engine: Engine, plan_id: int) -> str:
    with transaction(engine) as session:
        return session.execute(text("SELECT status FROM plans WHERE id = :p"), {"p": plan_id}).scalar_one()


def steps_of(engine: Engine, plan_id: int, worker: int) -> dict[str, str]:
    with transaction(engine) as session:
        return dict(session.execute(text("SELECT key, status FROM plan_steps WHERE plan_id = :p AND worker_id = :w"),
                                    {"p": plan_id, "w": worker}).all())


def test_a_borrowing_the_trainer_overtook_is_called_off_and_training_starts_at_once(cp: ControlPlane) -> None:
    serve(cp.engine, {3})
    plan_id = propose(cp.engine, Target(frozenset({1, 3}), {Role.COLOCATED: 2}))  # worker 1 would borrow
    plan_store.apply(cp.engine, plan_id)  # its start is ready, no agent has claimed it yet
    started = cp.training_begin(1, wait_s=0)
    assert started.started and started.late_s == 0.0
    assert gpu_states(cp.engine, "training") == {GPUState.TRAINING}
    assert set(steps_of(cp.engine, plan_id, 1).values()) == {"cancelled"}
    run_plan(cp.engine, datetime.now(UTC))  # nothing is left to find the GPUs taken: the plan does not fail
    assert plan_status(cp.engine, plan_id) != "failed"
    with transaction(cp.engine) as session:
        assert session.get(Worker, 1).activity is Activity.INACTIVE
        assert session.scalars(select(Lease).where(Lease.kind == "borrowed")).all() == []


def test_a_start_under_way_when_training_begins_finishes_then_gives_the_gpus_back(cp: ControlPlane) -> None:
    serve(cp.engine, {3})
    plan_id = propose(cp.engine, Target(frozenset({1, 3}), {Role.COLOCATED: 2}))
    plan_store.apply(cp.engine, plan_id)
    now = datetime.now(UTC)
    (start,) = [s for s in claim_ready(cp.engine, now) if s["worker_id"] == 1]  # an agent is at it
    with pytest.raises(ReturnsLate):  # training waits for that start: it would find the GPUs taken
        cp.training_begin(1, wait_s=0)
    assert gpu_states(cp.engine, "training") == {GPUState.FREE}
    report(cp.engine, start, StepStatus.SUCCEEDED, now)  # the server is up, on borrowed GPUs
    assert gpu_states(cp.engine, "training") == {GPUState.BORROWED, GPUState.FREE}  # its GPUs 0, 1
    run_plan(cp.engine, datetime.now(UTC))  # the amendment's drain, interrupt and release follow the start
    assert plan_status(cp.engine, plan_id) == "succeeded"
    assert {k: v for k, v in steps_of(cp.engine, plan_id, 1).items() if ".amend" in k} == {
        "w1.drain.amend1": "succeeded", "w1.interrupt.amend1": "succeeded", "w1.release.amend1": "succeeded"}
    with transaction(cp.engine) as session:
        assert session.get(TrainingStep, 1).started_at is not None
    assert gpu_states(cp.engine, "training") == {GPUState.TRAINING}


def test_a_training_request_written_by_hand_waits_for_the_policy_to_call_the_borrowing_off(
        cp: ControlPlane, db_engine: Engine) -> None:
    from pearl.policies.live import tick

    serve(cp.engine, {3})
    plan_id = propose(cp.engine, Target(frozenset({1, 3}), {Role.COLOCATED: 2}))
    plan_store.apply(cp.engine, plan_id)
    with transaction(cp.engine) as session:  # a trainer that writes its rows itself
        session.execute(text("INSERT INTO training_steps (step, requested_at) VALUES (1, now())"))
    reaper.reap(cp.engine)  # a pass's reaper does not start it on GPUs a start is about to take
    assert gpu_states(cp.engine, "training") == {GPUState.FREE}
    with transaction(cp.engine) as session:
        assert tick.must_leave(session) == {1}
    result = tick.tick(cp.engine, holder="test")
    assert result.amended == plan_id, result
    assert set(steps_of(cp.engine, plan_id, 1).values()) == {"cancelled"}
    assert gpu_states(cp.engine, "training") == {GPUState.TRAINING}


def test_an_overlap_server_that_crashed_gives_its_borrowed_gpus_back_and_training_starts(cp: ControlPlane,
                                                                                       clock) -> None:
    from pearl.controlplane.store import crashes

    serve(cp.engine, {1, 3})  # overlap worker 1 borrows train-0's GPUs 0, 1
    with pytest.raises(ReturnsLate):
        cp.training_begin(1, wait_s=0)
    with transaction(cp.engine) as session:
        seen = {s.worker_id: s for s in crashes.serving(session, "train-0")}
    assert set(seen) == {1}
    with transaction(cp.engine, actor="agent train-0", reason="the server of worker 1 is gone") as session:
        assert crashes.mark_crashed(session, seen[1])
    with transaction(cp.engine) as session:
        w1 = session.get(Worker, 1)
        assert w1.activity is Activity.INACTIVE and w1.role is Role.TRAINING and w1.endpoint is None
        assert session.get(TrainingStep, 1).started_at is not None  # it waited for them; they are back
        leases = session.scalars(select(Lease).where(Lease.kind == "borrowed")).all()
        assert len(leases) == 2 and all(lease.returned_at is not None for lease in leases)
        assert crashes.serving(session, "train-0") == [] and not crashes.mark_crashed(session, seen[1])
    assert gpu_states(cp.engine, "training") == {GPUState.TRAINING}


def test_a_revocation_notice_then_its_deadline_takes_the_gpus_whatever_holds_them(cp: ControlPlane, clock) -> None:
    with transaction(cp.engine) as session:
        spot = session.scalars(select(GPU.id).where(GPU.zone == "preemptible").order_by(GPU.id)).all()
    assert cp.gpus_granted("spot-0") == spot and gpu_states(cp.engine, "preemptible") == {GPUState.FREE}
    assert cp.gpus_granted("spot-0") == []  # granted already: nothing new
    serve(cp.engine, {3, 4})  # worker 4 serves on the spot GPUs
    cp.gpus_revoked("spot-0", notice_s=30)
    with transaction(cp.engine) as session:
        deadlines = session.scalars(select(Lease.deadline).where(Lease.kind == "preemptible")).all()
        assert len(deadlines) == 2 and all(d is not None for d in deadlines)
    assert reaper.reap(cp.engine).revoked_gpus == ()  # the notice has not run out
    swept = reaper.reap(cp.engine, now=max(deadlines) + timedelta(seconds=1))
    assert len(swept.revoked_gpus) == 2
    with transaction(cp.engine) as session:
        w4 = session.get(Worker, 4)
        assert w4.activity is Activity.INACTIVE and w4.endpoint is None  # out of service at the deadline
        assert set(session.scalars(select(GPU.state).where(GPU.zone == "preemptible"))) == {GPUState.REVOKED}
        late = session.scalars(select(Lease.late_s).where(Lease.kind == "preemptible")).all()
        assert all(x >= 0 for x in late)
    assert cp.gpus_granted("spot-0", [0]) and gpu_states(cp.engine, "preemptible") == {
        GPUState.FREE, GPUState.REVOKED}


def test_a_grant_within_the_notice_withdraws_it_and_one_after_it_grants_anew(cp: ControlPlane) -> None:
    """A trace whose GPUs come back while their notice runs (a notice longer than the trace's gap): the
    provider keeps them with us, the notice is withdrawn, nothing is refused; the workers on them are
    not taken out of service. Once a notice ran out, a grant finds the GPUs revoked and grants them anew."""
    spot = cp.gpus_granted("spot-0")
    serve(cp.engine, {3, 4})  # worker 4 serves on the spot GPUs
    cp.gpus_revoked("spot-0", [0, 1], notice_s=600)
    serve(cp.engine, {3})  # its drain is under way: the GPUs are draining, then free, still under notice
    assert cp.gpus_granted("spot-0", [0, 1]) == spot  # the trace gives them back: kept, not refused
    with transaction(cp.engine) as session:
        leases = session.scalars(select(Lease).where(Lease.kind == "preemptible", Lease.returned_at.is_(None))).all()
        assert len(leases) == 2 and all(lease.deadline is None for lease in leases)
    assert reaper.reap(cp.engine, now=datetime.now(UTC) + timedelta(seconds=700)).revoked_gpus == ()
    assert cp.gpus_granted("spot-0", [0, 1]) == []  # nothing new the second time
    cp.gpus_revoked("spot-0", [0, 1], notice_s=1)
    with transaction(cp.engine) as session:  # the notice ran out: the grant revokes them first, then grants
        session.execute(text("UPDATE leases SET deadline = now() - interval '1 s' WHERE deadline IS NOT NULL"))
    assert cp.gpus_granted("spot-0", [0, 1]) == spot
    with transaction(cp.engine) as session:
        rows = session.execute(select(Lease.gpu_id, Lease.returned_at, Lease.deadline).where(
            Lease.kind == "preemptible").order_by(Lease.id)).all()
    assert [r.gpu_id for r in rows if r.returned_at is not None] == spot  # the old leases ended at the deadline
    assert [r.gpu_id for r in rows if r.returned_at is None and r.deadline is None] == spot  # new, open ones
    assert gpu_states(cp.engine, "preemptible") == {GPUState.FREE}
    assert invariants_clean(cp.engine)


def invariants_clean(engine: Engine) -> bool:
    from pearl.controlplane.store import invariants

    found = invariants.check(engine).violations
    assert not found, [v.to_dict() for v in found]
    return True


def test_a_revocation_reported_again_changes_nothing(cp: ControlPlane) -> None:
    """A provider whose report's answer was lost (the database partitioned after the commit) sends the
    revocation again once the GPUs are revoked: nothing to do, no error."""
    assert cp.gpus_granted("spot-0", [0, 1])
    assert cp.gpus_revoked("spot-0", [0, 1], notice_s=0)
    with cp.engine.connect() as conn:
        before = conn.scalar(text("SELECT count(*) FROM events"))
    assert cp.gpus_revoked("spot-0", [0, 1], notice_s=5) == []
    with cp.engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM events")) == before
    assert gpu_states(cp.engine, "preemptible") >= {GPUState.REVOKED}


def test_bad_provider_events_are_refused_naming_the_option(cp: ControlPlane) -> None:
    with pytest.raises(BadInput, match="--node: train-0 is a training node"):
        cp.gpus_granted("train-0")
    with pytest.raises(BadInput, match="--node: no node named 'nope'"):
        cp.gpus_revoked("nope")
    with pytest.raises(BadInput, match=r"--gpus: spot-0 has no device \[7\]"):
        cp.gpus_granted("spot-0", [7])
    with pytest.raises(BadInput, match="--gpus: devices .* are not granted"):
        cp.gpus_revoked("spot-0", [0], notice_s=5)
    with pytest.raises(BadInput, match="--notice-s: must be a number of seconds"):
        cp.gpus_revoked("spot-0", notice_s=-1)
    assert gpu_states(cp.engine, "preemptible") == {GPUState.UNAVAILABLE}


def test_the_event_commands(cp: ControlPlane, database_url: str, tmp_path) -> None:
    env = {"PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(tmp_path)}
    run = CliRunner().invoke
    done = run(app, ["event", "gpus-granted", "--node", "spot-0", "--gpus", "0,1", "--json"], env=env)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == {"node": "spot-0", "granted": [7, 8]}
    done = run(app, ["event", "rollout-progress", "--step", "0", "--finished", "2", "--batch-size", "4"], env=env)
    assert done.exit_code == 0 and "rollout step 0: 2 finished" in done.stdout
    done = run(app, ["event", "training-begin", "--step", "1", "--json"], env=env)
    assert done.exit_code == 0 and json.loads(done.stdout)["started"] is True
    torn = small_snapshot(tmp_path / "torn")
    data = bytearray((tmp_path / "torn" / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the last byte of w.b
    (tmp_path / "torn" / "model.safetensors").write_bytes(bytes(data))
    for snapshot, message in ((torn, "snapshot: tensor w.b: checksum mismatch"),
                              (str(tmp_path / "none"), "no such file or directory"),
                              ("s3://bucket/w1", "only local paths and file:// URIs")):
        done = run(app, ["event", "training-end", "--step", "1", "--weights-version", "1", "--snapshot", snapshot],
                   env=env)
        assert done.exit_code == 2 and message in done.output, done.output
    with transaction(cp.engine) as session:  # nothing written
        assert session.get(TrainingStep, 1).ended_at is None
        assert session.scalar(select(func.count()).select_from(WeightSnapshot)) == 0
    w1 = small_snapshot(tmp_path / "w1")
    done = run(app, ["event", "training-end", "--step", "1", "--weights-version", "1", "--snapshot",
                     f"file://{w1}"], env=env)
    assert done.exit_code == 0 and "weights version 1" in done.stdout
    done = run(app, ["event", "gpus-revoked", "--node", "spot-0", "--notice-s", "30", "--json"], env=env)
    assert done.exit_code == 0 and json.loads(done.stdout)["notice_s"] == 30
    for args, message in ((["event", "gpus-granted", "--node", "spot-0", "--gpus", "a,b"], "--gpus: a comma"),
                          (["event", "rollout-progress", "--step", "0", "--finished", "1"], "finished: rollout step 0"),
                          (["event", "training-end", "--step", "9"], "step: training step 9 never began"),
                          (["event", "gpus-revoked", "--node", "\x00"], "--node: text may not contain a NUL"),
                          (["event", "training-end", "--step", "1", "--snapshot", "w\x00"], "--snapshot: text")):
        done = run(app, args, env=env)
        assert done.exit_code == 2 and message in done.output, done.output
    with pytest.raises(BadInput, match="text the database cannot store"):  # the same below the CLI
        cp.gpus_revoked("spot\x00", notice_s=5)
    with transaction(cp.engine) as session:
        assert session.get(RolloutProgress, 0).finished == 2


def test_start_training_is_the_step_the_trainer_asked_for(cp: ControlPlane) -> None:
    with transaction(cp.engine) as session:
        assert signals.start_training_if_returned(session) is None  # nothing requested
    cp.training_begin(1, wait_s=0)
    with transaction(cp.engine) as session:
        assert signals.start_training_if_returned(session) is None  # it started already
        assert signals.borrowed_gpus(session) == ()
