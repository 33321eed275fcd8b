"""Whole runs: determinism, trace replay, preemption with notice, partial trajectories never lost,
the metric, borrowing's mandatory return, and the telemetry each rollout step emits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pearl.policies.base import NoMemory, colocated
from pearl.policies.baselines import StaticSplit
from pearl.policies.borrowing import borrowable
from pearl.policies.elasticity import dedicated_capacity
from pearl.sim.engine import Engine
from pearl.sim.experiments import run_system
from pearl.sim.metrics import step_rates
from pearl.sim.runner import EV_KV, Simulation
from pearl.sim.scenario import load_scenario
from pearl.sim.systems import system
from pearl.sim.trajectories import sample_batch

pytestmark = pytest.mark.unit

SHORT = ["duration_s=2400"]


def _sim(name: str, overrides: list[str] | None = None, scenario: str = "paper-qwen3-8b-seg1") -> Simulation:
    chosen = system(name)
    sc = chosen.cluster(load_scenario(scenario, overrides or SHORT))
    return Simulation(sc, chosen.policy(sc))


@dataclass(frozen=True)
class GreedyBorrow:
    """Test policy: every dedicated slot and every borrowable training slot, colocated."""

    name: str = "greedy-borrow"

    def initial_memory(self) -> NoMemory:
        return NoMemory()

    def decide(self, snapshot, signals, memory):
        members = [w.id for w in dedicated_capacity(snapshot)] + [w.id for w in borrowable(snapshot, signals)]
        return colocated(members, "greedy"), memory


def _without_time(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "wall_s"}


def test_a_run_is_deterministic():
    a, b = _sim("rlboost-plus"), _sim("rlboost-plus")
    ra, rb = a.run(), b.run()
    assert _without_time(ra.as_dict()) == _without_time(rb.as_dict())
    assert a.telemetry == b.telemetry
    assert ra.timeline.generated_bins == rb.timeline.generated_bins


def test_the_metric_counts_each_trained_batch_once():
    sim = _sim("roll", ["duration_s=5000"])
    r = sim.run()
    sc = sim.sc
    tokens = [sum(t.metric_tokens for t in sample_batch(sc.workload, sc.seed, k)) for k in range(r.training_steps)]
    assert r.tokens_per_s_window * sc.duration_s == pytest.approx(sum(tokens))
    assert r.rollout_steps >= r.training_steps > 2
    ends = r.timeline.training_ends
    assert len(ends) == r.training_steps and ends[-1] <= sc.duration_s and r.timeline.trained_tokens == tokens
    # the paper's metric: each step's tokens over the time since the previous step ended, the first dropped
    rates = [tokens[k] / (ends[k] - ends[k - 1]) for k in range(1, len(ends))]
    assert r.tokens_per_s == pytest.approx(sum(rates) / len(rates))
    assert r.tokens_per_s_ratio_of_sums == pytest.approx(sum(tokens[1:]) / (ends[-1] - ends[0]))


def test_step_rates_of_one_step_or_none():
    assert step_rates([], []) == (0.0, 0.0)
    assert step_rates([200.0], [1000]) == (5.0, 5.0)  # one step: over its end time
    assert step_rates([100.0, 300.0, 400.0], [7, 1000, 300]) == (pytest.approx((5.0 + 3.0) / 2), 1300 / 300)


def test_the_paper_metric_does_not_jump_with_where_the_run_ends():
    """One step more or less within the run moves the window metric by a whole step's tokens; the
    per-step metric, a rate over the steps that ended, moves far less between two run lengths that
    differ by one step."""
    short, long_ = (_sim("roll", [f"duration_s={d}"]).run() for d in (2400, 3000))
    assert long_.training_steps > short.training_steps
    window_move = abs(long_.tokens_per_s_window / short.tokens_per_s_window - 1)
    assert abs(long_.tokens_per_s / short.tokens_per_s - 1) < window_move
    assert abs(long_.tokens_per_s_ratio_of_sums / short.tokens_per_s_ratio_of_sums - 1) < window_move


def test_static_baselines_hold_their_gpus_and_never_reconfigure():
    for name, gpus in (("roll", 4), ("roll-large", 14)):
        r = _sim(name).run()
        assert r.gpu_seconds == pytest.approx(gpus * 2400)
        assert r.reconfigurations == r.plans == r.interrupted_requests == 0


def test_the_preemptible_trace_is_replayed_and_notices_are_honoured():
    sim = _sim("rlboost-plus")
    r = sim.run()
    tl = r.timeline
    notice = sim.sc.cluster.preemptible.notice_s
    reserved = sim.sc.cluster.reserved_rollout_gpus

    def level(u: float) -> int:
        return [g for at, g in tl.availability if at <= u][-1]

    for t, counts in tl.fleet_samples:
        # GPUs under a notice may stay until it runs out: the highest level of the last notice_s
        window = [level(max(t - notice, 0.0))] + [g for at, g in tl.availability if t - notice < at <= t]
        assert sum(counts.values()) <= reserved + max(window)
    assert r.forced_releases == 0  # drained and released before every notice ran out
    assert r.plans > 0 and r.reconfigurations >= r.plans
    changes = {t for t, _ in tl.availability}
    assert len(changes) > 5


def count_checked(sim: Simulation) -> list[tuple[float, int, int]]:
    """Record every instant the GPU count the metric integrates differs from the GPUs really held."""
    mismatches = []
    original = sim._count_gpus

    def checked(delta: int) -> None:
        original(delta)
        if sim.gpus != sim.cluster.gpus_held():
            mismatches.append((sim.now, sim.gpus, sim.cluster.gpus_held()))

    sim._count_gpus = checked
    return mismatches


def test_partial_trajectories_are_never_lost():
    for overrides in (SHORT, [*SHORT, "cluster.preemptible.notice_s=0"]):
        sim = _sim("rlboost-plus", overrides)
        mismatches = count_checked(sim)
        r = sim.run()
        decoded, held = sim.token_balance()
        assert r.interrupted_requests > 0
        assert decoded == held  # every decoded token is in some trajectory, exactly once
        assert mismatches == [] and sim.gpus == sim.cluster.gpus_held()  # gpu_seconds counts what is held
    assert r.forced_releases > 0  # no notice: the GPUs went before the policy could drain them


def test_a_forced_release_frees_a_starting_group_member_once():
    # seg1 without notice: a grant at 120 s starts an expansion group; its GPUs are taken back at
    # 180 s while a member still loads its weights: the group is cancelled and the GPUs freed once.
    sim = _sim("rlboost-plus", ["duration_s=600", "cluster.preemptible.notice_s=0"])
    mismatches = count_checked(sim)
    r = sim.run()
    assert r.forced_releases > 0 and r.cancelled_groups > 0
    assert mismatches == [] and sim.gpus == sim.cluster.gpus_held()
    assert r.gpu_seconds > sim.sc.cluster.reserved_rollout_gpus * sim.sc.duration_s


def test_borrowed_gpus_return_before_every_training_step():
    sc = load_scenario("paper-qwen3-8b-seg2", SHORT)
    sim = Simulation(sc, GreedyBorrow())
    starts = []
    original = sim.trainer.start_training

    def start(now: float) -> float:
        assert not any(w.holds_gpus for w in sim.cluster.overlap)
        starts.append(now)
        return original(now)

    sim.trainer.start_training = start
    r = sim.run()
    assert len(starts) == r.training_steps + (1 if sim.trainer.training else 0)
    # the greedy policy never returns early: each step waits for the return (toggle_off_s)
    assert r.late_returns == len(starts)
    assert r.lateness_s == pytest.approx(len(starts) * sc.reconfig.toggle_off_s)
    assert sim.toggle_costs and set(sim.toggle_costs) == {sc.reconfig.toggle_on_s + sc.training.weight_sync_s
                                                          + sc.reconfig.toggle_off_s}
    decoded, held = sim.token_balance()
    assert decoded == held


def test_every_rollout_step_emits_valid_telemetry():
    sim = _sim("roll")
    seen = []
    original = sim._step_telemetry

    def capture(step: int, batch):
        tel = original(step, batch)
        seen.append(tel)
        return tel

    sim._step_telemetry = capture
    r = sim.run()
    assert [t.step for t in seen] == list(range(r.rollout_steps))
    for tel in seen:
        assert tel.batch_size == len(tel.trajectories) == sim.sc.workload.batch_size
        assert 0 < tel.decode_fraction <= 1
        assert 0 < len(tel.iterations) <= 64
        assert {i.role.value for i in tel.iterations} == {"colocated"}
        assert any(i.prefill_tokens > 0 for i in tel.iterations) or any(i.batch > 0 for i in tel.iterations)


def test_the_policy_sees_the_tails_of_the_latest_steps():
    sim = _sim("roll", ["duration_s=600"], scenario="demo-qwen3-30b-a3b-seg2")
    tails = []
    original = sim._signals

    def capture(event: str):
        signals = original(event)
        tails.append(signals.step_tails)
        return signals

    sim._signals = capture
    r = sim.run()
    assert r.rollout_steps > 3 and tails[0] == () and len(tails[-1]) == 3
    batch = sim.sc.workload.batch_size
    for tail, makespan in zip(sim.step_tails, sim.makespans[-3:], strict=True):
        assert len(tail) == batch and tail[0] == 0.0 and list(tail) == sorted(tail)
        # a trajectory that finished before its batch was the one under way counts from the step's start
        assert tail[-1] <= makespan


def test_run_system_uses_the_systems_cluster():
    sc = load_scenario("paper-qwen3-30b-a3b-seg2", SHORT)
    seen = []
    r = run_system(sc, "roll-large", progress=lambda name, t: seen.append(name))
    assert r.policy == "roll-large" and r.gpu_seconds == pytest.approx(10 * 2400)
    assert seen and set(seen) == {"roll-large"}


def test_a_paused_run_can_be_copied_and_resumed():
    import copy

    whole = _sim("rlboost-plus").run().as_dict()
    sim = _sim("rlboost-plus")
    sim.begin()
    sim.advance(1000.0)
    fork = copy.deepcopy(sim)
    fork.advance(sim.sc.duration_s)
    sim.advance(sim.sc.duration_s)
    results = [_without_time(r.as_dict()) for r in (fork.finish(), sim.finish())]
    assert results[0] == results[1] == _without_time(whole)



def test_split_kv_moves_over_the_prefill_workers_nic_one_transfer_at_a_time(monkeypatch):
    # 8 dedicated GPUs of tp 2: 1 prefill worker, 3 decode workers; every KV leaves through one NIC
    sc = load_scenario("ablation-qwen3-8b-dedicated8", ["duration_s=1200", "workload.batch_size=32"])
    sim = Simulation(sc, StaticSplit(1))
    sent = {}  # request seq -> (prefill engine, sent at, arrives at, transfer seconds)
    joined = {}  # request seq -> when its decode worker took it
    push, join = sim.push, Engine.join

    def recording_push(t, kind, a=None, b=None):
        if kind == EV_KV:
            sent[a.seq] = (a.prefill_engine, sim.now, t, sim.perf.kv_transfer_time(a.context))
        push(t, kind, a, b)

    def recording_join(engine, req, now):
        joined[req.seq] = now
        return join(engine, req, now)

    sim.push = recording_push
    monkeypatch.setattr(Engine, "join", recording_join)
    r = sim.run()
    assert r.rollout_steps > 0 and len({e for e, *_ in sent.values()}) == 1
    assert len(sent) > 100 and {seq: at for seq, (_, _, at, _) in sent.items() if seq in joined} == joined
    free, waited = 0.0, 0
    for _, sent_at, arrives, transfer_s in sorted(sent.values(), key=lambda x: x[2]):
        start = arrives - transfer_s
        assert transfer_s > 0 and start >= max(sent_at, free) - 1e-9  # after the prefill, one at a time
        waited += start > sent_at + 1e-9
        free = arrives
    assert waited > 0  # the NIC was busy at times: contention, not a fixed delay
    decoded, held = sim.token_balance()
    assert decoded == held


def test_each_turn_waits_for_its_environment_before_the_next():
    sim = _sim("roll", ["duration_s=1500"])
    ended, resumed = {}, {}
    turn_done, resume = sim._turn_done, sim._resume

    def recording_turn_done(traj, engine):
        ended[traj.id, traj.turn] = sim.now
        turn_done(traj, engine)

    def recording_resume(traj):
        resumed[traj.id, traj.turn] = sim.now
        resume(traj)

    sim._turn_done, sim._resume = recording_turn_done, recording_resume
    sim.run()
    trajectories = {t.id: t for step in range(sim.trainer.created)
                    for t in sample_batch(sim.sc.workload, sim.sc.seed, step)}
    assert len(resumed) > 1000
    for (tid, turn), at in resumed.items():
        assert at - ended[tid, turn] == pytest.approx(trajectories[tid].env_s[turn], abs=1e-9)


def test_every_server_syncs_the_new_weights_after_each_training_step():
    sim = _sim("rlboost-plus")
    sync_s = sim.sc.training.weight_sync_s
    synced = []
    training_end = sim._training_end

    def checked_training_end():
        training_end()
        engines = [w for w in sim.cluster.workers if w.engine is not None]
        assert engines and all(w.weights_version == sim.trainer.trained for w in engines)
        assert all(w.engine.paused_until == pytest.approx(sim.now + sync_s) for w in engines)  # no iteration before
        synced.append(sim.now)

    sim._training_end = checked_training_end
    r = sim.run()
    assert sync_s > 0 and len(synced) == r.training_steps > 0


def _previous_of_its_slot(tid: int, b: int, slots: int) -> int | None:
    """The trajectory the same environment slot ran just before `tid` (None for a slot's first)."""
    k, i = divmod(tid, b)
    if i >= slots:
        return tid - slots
    return None if k == 0 else (k - 1) * b + i + (b // slots - 1) * slots


def _record_batches(sim: Simulation) -> tuple[dict, dict, dict]:
    """When each trajectory started and ended, and when each batch was created."""
    started, ended, created = {}, {}, {}
    start, done, made = sim._start, sim._trajectory_done, sim._batch_created

    def recording_start(traj):
        started[traj.id] = sim.now
        start(traj)

    def recording_done(traj):
        ended[traj.id] = sim.now
        done(traj)

    def recording_created(k):
        created[k] = sim.now
        made(k)

    sim._start, sim._trajectory_done, sim._batch_created = recording_start, recording_done, recording_created
    return started, ended, created


def test_async_slots_run_their_trajectories_back_to_back_one_batch_ahead_at_most():
    sim = _sim("roll", ["duration_s=5000", "training.trajectories_per_slot=2"])
    started, ended, created = _record_batches(sim)
    r = sim.run()
    b, slots = sim.sc.workload.batch_size, sim.sc.env_slots
    assert slots == b // 2
    ends = r.timeline.training_ends
    assert r.training_steps > 2 and created[0] == created[1] == 0.0
    sync_s = sim.sc.training.weight_sync_s
    for k in range(2, max(created) + 1):  # batch k appears once training step k - 2's weights are in place
        assert created[k] == pytest.approx(ends[k - 2] + sync_s)
    # each step trains after the update of the one before: ROLL's update, get_batch, train
    for (start, _), (_, end) in zip(sim.trainer.step_times[1:], sim.trainer.step_times, strict=False):
        assert start >= end + sync_s - 1e-9
    complete = {k: max(ended[k * b + i] for i in range(b)) for k in range(r.rollout_steps)}
    overlapped = 0
    for tid, at in started.items():
        k, before = tid // b, _previous_of_its_slot(tid, b, slots)
        if before is None:
            assert at == 0.0
            continue
        # the slot moves on the moment its previous trajectory ends, or when the batch appears
        assert at == max(ended[before], created[k])
        overlapped += k - 1 in complete and at < complete[k - 1]
    assert overlapped > b  # slots started the next batch before the previous one was complete
    decoded, held = sim.token_balance()
    assert decoded == held


def test_sync_batching_starts_each_batch_whole_after_the_previous_one():
    sim = _sim("roll", ["duration_s=5000", "training.batching=sync", "training.trajectories_per_slot=2"])
    started, ended, created = _record_batches(sim)
    r = sim.run()
    b, slots = sim.sc.workload.batch_size, sim.sc.env_slots
    assert r.rollout_steps > 2
    for k in range(1, r.rollout_steps):
        # every slot starts its first trajectory of the batch at its creation, the next one after it
        assert {started[k * b + i] for i in range(slots)} == {created[k]}
        assert all(started[k * b + i] == ended[k * b + i - slots] for i in range(slots, b))
        assert created[k] >= max(ended[(k - 1) * b + i] for i in range(b))
    # the makespan of a step is its batch's whole span: from its creation to its last trajectory
    for k, makespan in enumerate(sim.makespans):
        assert makespan == pytest.approx(max(ended[k * b + i] for i in range(b)) - created[k])


def test_an_aborting_weight_update_discards_the_partial_turns_and_loses_nothing_else():
    sim = _sim("rlboost-plus", ["duration_s=3000", "training.weight_update=abort"])
    r = sim.run()
    assert r.training_steps > 1 and sim.discarded_tokens > 0  # turns under way at an update started over
    decoded, held = sim.token_balance()
    assert decoded == held  # what was discarded was decoded once, and is counted as such
    keep = _sim("rlboost-plus", ["duration_s=3000", "training.weight_update=keep"])
    keep.run()
    assert keep.discarded_tokens == 0
