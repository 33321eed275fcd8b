"""The PEARL policy's decisions on crafted fleets and signals: the gate, the mandatory return,
notices, growth, forced switches, the ablations' options, and its memory."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Activity, Mode, Role, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.predictor import Config, predict
from pearl.controlplane.core.selector import select
from pearl.controlplane.core.telemetry import StepTelemetry
from pearl.controlplane.errors import BadInput
from pearl.policies.base import Signals
from pearl.policies.borrowing import ToggleCost
from pearl.policies.pearl import Borrow, PearlMemory, PearlPolicy, tail_remaining
from pearl.sim.scenario import load_scenario
from pearl.sim.trajectories import sample_batch

pytestmark = pytest.mark.unit

SCENARIO = load_scenario("paper-qwen3-8b-seg2")
CATALOG = default_catalog()


def _policy(scenario=SCENARIO, **kw) -> PearlPolicy:
    perf = PerfModel(CATALOG.model(scenario.model), CATALOG.gpu(scenario.gpu), scenario.tp)
    return PearlPolicy.build(scenario.workload, perf, scenario.reconfig, scenario.training.weight_sync_s, **kw)


POLICY = _policy()


def _slot(wid: int, zone=WorkerZone.DEDICATED, role=Role.COLOCATED, active=False, available=True) -> WorkerSlot:
    return WorkerSlot(id=wid, node="train-0" if zone is WorkerZone.OVERLAP else "roll-0", gpus=(2 * wid, 2 * wid + 1),
                      zone=zone, role=role, activity=Activity.ACTIVE if active else Activity.INACTIVE,
                      available=available)


def _fleet(dedicated: int = 2, overlap: int = 8, overlap_active: bool = False, overlap_available: bool = True,
           extra: tuple[WorkerSlot, ...] = ()) -> FleetSnapshot:
    slots = [_slot(i, active=True) for i in range(dedicated)] + list(extra)
    base = len(slots)
    slots += [_slot(base + i, WorkerZone.OVERLAP, Role.COLOCATED if overlap_active else Role.TRAINING,
                    active=overlap_active, available=overlap_available) for i in range(overlap)]
    return FleetSnapshot(7, tuple(slots), tp=2)


def _signals(**kw) -> Signals:
    base = dict(now=100.0, event="training_end", rollout_step=3, batch_size=64, remaining=60, training=False,
                training_wanted=False)
    return Signals(**{**base, **kw})


def _overlap_ids(snapshot: FleetSnapshot) -> set[int]:
    return {w.id for w in snapshot.workers if w.zone is WorkerZone.OVERLAP}


def _telemetry(step: int = 0) -> StepTelemetry:
    trajectories = [t.record() for t in sample_batch(SCENARIO.workload, SCENARIO.seed, step)]
    return StepTelemetry(step=step, batch_size=len(trajectories), trajectories=trajectories, decode_fraction=0.4)


def test_borrows_when_the_gate_says_so_and_not_otherwise():
    fleet = _fleet()
    target, _ = POLICY.decide(fleet, _signals(), POLICY.initial_memory())
    assert _overlap_ids(fleet) <= target.members and "gate: borrow" in target.reason
    # the same decision with a toggle cost no gain can pay for
    costly = replace(POLICY.initial_memory(), toggle=ToggleCost(1e6))
    target, _ = POLICY.decide(fleet, _signals(), costly)
    assert not (_overlap_ids(fleet) & target.members) and "do not borrow" in target.reason
    assert target.members == {0, 1}


def _cold(snapshot: FleetSnapshot) -> FleetSnapshot:
    return replace(snapshot, workers=tuple(w.evolve(warm=False) if w.zone is WorkerZone.OVERLAP else w
                                           for w in snapshot.workers))


def test_a_loan_that_must_launch_its_servers_pays_their_cold_start():
    fleet = _fleet()
    warm, _ = POLICY.decide(fleet, _signals(), POLICY.initial_memory())
    assert _overlap_ids(fleet) <= warm.members
    gain = float(warm.reason.split("(R/B) x (T_ded - T_full) = ")[1].split(" s")[0])
    # a toggle cost the gain pays for while the servers sleep, but not with their launch on top
    memory = replace(POLICY.initial_memory(), toggle=ToggleCost(gain - 1.0),
                     costs=replace(POLICY.initial_memory().costs, cold_start_s=2.0))
    assert _overlap_ids(fleet) <= POLICY.decide(fleet, _signals(), memory)[0].members
    cold, _ = POLICY.decide(_cold(fleet), _signals(), memory)
    assert not (_overlap_ids(fleet) & cold.members)
    assert f"vs T_toggle {gain + 1.0:.1f} s" in cold.reason
    assert not cold.warm_up  # workers serve: no warm-up while a batch may be under way


def test_slots_that_never_ran_a_server_are_warmed_up_while_the_fleet_starts():
    empty = _cold(_fleet(dedicated=0, extra=tuple(_slot(i) for i in range(2))))
    # a loan that would pay even with the launch: borrowed (a member), not warmed up
    target, _ = POLICY.decide(empty, _signals(remaining=64), POLICY.initial_memory())
    assert _overlap_ids(empty) <= target.members and not target.warm_up
    # one that does not pay: every slot is warmed up instead
    costly = replace(POLICY.initial_memory(), toggle=ToggleCost(1e6))
    target, _ = POLICY.decide(empty, _signals(remaining=64), costly)
    overlap = _overlap_ids(empty)
    assert target.warm_up == overlap and not (overlap & target.members)
    assert "warming up" in target.reason
    plan = orchestrate(empty, target)
    assert {s.worker_id for s in plan.steps if s.args.get("warm_up")} == target.warm_up
    # never while the trainer runs or wants its GPUs, never for the pd-only ablation, never twice
    for signals in (_signals(training=True), _signals(training_wanted=True)):
        assert not POLICY.decide(empty, signals, costly)[0].warm_up
    pd_only = _policy(borrow="never")
    assert not pd_only.decide(empty, _signals(), pd_only.initial_memory())[0].warm_up
    warm = replace(empty, workers=tuple(w.evolve(warm=True) for w in empty.workers))
    assert not POLICY.decide(warm, _signals(), costly)[0].warm_up


def test_the_gate_scales_the_whole_step_gain_by_the_work_left():
    fleet, signals = _fleet(), _signals(remaining=32)
    profile = POLICY.prior
    # what the selector would run on each budget; the gate compares their whole-step makespans
    t_ded = predict(profile, select(profile, 2, Config.colocated(2), remaining_fraction=0.5).chosen).makespan_s
    t_full = predict(profile, select(profile, 10, Config.colocated(2), remaining_fraction=0.5).chosen).makespan_s
    gain = 0.5 * (t_ded - t_full)
    assert gain > 0
    just_below = replace(POLICY.initial_memory(), toggle=ToggleCost(gain * 0.99))
    just_above = replace(POLICY.initial_memory(), toggle=ToggleCost(gain * 1.01))
    assert _overlap_ids(fleet) <= POLICY.decide(fleet, signals, just_below)[0].members
    assert not _overlap_ids(fleet) & POLICY.decide(fleet, signals, just_above)[0].members
    a = POLICY.assess(fleet, signals, just_below)
    assert a.gate.gain_s == pytest.approx(gain) and a.borrow
    assert a.on_dedicated.workers == 2 and a.with_overlap.workers == 10


@pytest.mark.parametrize("borrow", list(Borrow))
@pytest.mark.parametrize("flags", [{"training": True}, {"training_wanted": True}])
def test_never_holds_an_overlap_slot_while_training_runs_or_wants_its_gpus(borrow, flags):
    policy = _policy(borrow=borrow)
    fleet = _fleet(overlap_active=True, overlap_available=False)  # borrowed, and the trainer wants them back
    target, _ = policy.decide(fleet, _signals(**flags), policy.initial_memory())
    assert not _overlap_ids(fleet) & target.members
    assert target.members == {0, 1}
    plan = orchestrate(fleet, target)
    assert plan.remove == _overlap_ids(fleet)


@pytest.mark.parametrize("borrow", [Borrow.GATED, Borrow.ALWAYS])
def test_borrowed_workers_go_back_at_the_tail_of_the_step(borrow):
    policy = _policy(borrow=borrow)
    borrowing = _fleet()
    target, _ = policy.decide(borrowing, _signals(), policy.initial_memory())
    assert _overlap_ids(borrowing) <= target.members
    # consult me again at the step's tail: once it fits the 2 dedicated workers, plus what finishes while
    # a return takes (T_toggle's worth of the batch at its pace), so that the return is done in time
    step_s = policy.assess(borrowing, _signals(), policy.initial_memory()).with_overlap.step_s
    tail = tail_remaining(2, 64, policy.initial_memory().toggle.seconds, step_s)
    assert target.recheck_remaining == tail and tail == 2 + math.ceil(64 * 11.5 / step_s) > 2
    holding = _fleet(overlap_active=True)
    for remaining in (tail, 1):
        target, _ = policy.decide(holding, _signals(event="tail", remaining=remaining), policy.initial_memory())
        assert not (_overlap_ids(holding) & target.members) and "tail:" in target.reason
        assert target.members == {0, 1} and target.recheck_remaining is None
    target, _ = policy.decide(holding, _signals(event="tail", remaining=tail + 1), policy.initial_memory())
    assert _overlap_ids(holding) <= target.members


def test_the_tail_starts_earlier_when_the_latest_steps_ended_in_a_burst():
    # Even pace: 2 dedicated + 64 x 10 s / 100 s. A step whose last 20 of 32 trajectories finished
    # within the 10 s a return takes asks for 2 + 40 of 64; the larger of the latest steps counts.
    paced = tail_remaining(2, 64, 10.0, 100.0)
    assert paced == 2 + 7
    even = tuple(float(i * 4) for i in range(32))  # no burst (3 of 32 within 10 s): the pace wins
    burst = tuple(sorted([0.0] + [9.5] * 19 + [50.0 + i for i in range(12)]))
    assert tail_remaining(2, 64, 10.0, 100.0, (even,)) == paced
    assert tail_remaining(2, 64, 10.0, 100.0, (even, burst)) == 42
    assert tail_remaining(2, 64, 10.0, 100.0, (burst, ())) == 42
    assert tail_remaining(2, 64, 5.0, 100.0, (burst,)) == 2 + 4  # only the last within 5 s: the pace
    assert tail_remaining(2, 64, 10.0, math.inf, ()) == 2
    policy = _policy()
    target, _ = policy.decide(_fleet(), _signals(step_tails=(burst,)), policy.initial_memory())
    assert policy.initial_memory().toggle.seconds >= 9.5 and target.recheck_remaining == 42
    holding = _fleet(overlap_active=True)
    target, _ = policy.decide(holding, _signals(event="tail", remaining=42, step_tails=(burst,)),
                              policy.initial_memory())
    assert not (_overlap_ids(holding) & target.members) and "tail:" in target.reason


def test_ungated_borrows_whatever_the_gain_and_pd_only_never_borrows():
    fleet, costly = _fleet(), ToggleCost(1e6)
    ungated = _policy(borrow=Borrow.ALWAYS)
    target, _ = ungated.decide(fleet, _signals(), replace(ungated.initial_memory(), toggle=costly))
    assert _overlap_ids(fleet) <= target.members
    pd_only = _policy(borrow=Borrow.NEVER)
    target, _ = pd_only.decide(fleet, _signals(remaining=64), pd_only.initial_memory())
    assert target.members == {0, 1}


def test_slots_under_a_notice_leave_the_target_at_once():
    noticed = _slot(2, active=True, available=False)
    fleet = _fleet(extra=(noticed, _slot(3, active=True)))
    target, _ = POLICY.decide(fleet, _signals(training=True, deadlines={2: 130.0}), POLICY.initial_memory())
    assert 2 not in target.members and {0, 1, 3} <= target.members
    assert "[2]" in target.reason
    assert orchestrate(fleet, target).remove == {2}


def test_granted_slots_join_as_one_all_or_nothing_group():
    fleet = _fleet(extra=(_slot(2), _slot(3)))  # granted, not started yet
    target, _ = POLICY.decide(fleet, _signals(training=True, event="grant"), POLICY.initial_memory())
    assert target.members == {0, 1, 2, 3}
    plan = orchestrate(fleet, target)
    assert plan.add == {2, 3}
    admits = [s for s in plan.steps if s.action.value == "admit"]
    assert {s.group for s in admits} == {"expand"} and len(admits) == 2


def test_a_split_that_lost_its_prefill_worker_switches_mode_at_once():
    fleet = FleetSnapshot(3, (
        _slot(0, role=Role.PREFILL, active=True, available=False),  # under a notice: the only prefill worker
        _slot(1, role=Role.DECODE, active=True), _slot(2, role=Role.DECODE, active=True),
        _slot(3, role=Role.DECODE, active=True)), tp=2)
    target, _ = POLICY.decide(fleet, _signals(training=True, deadlines={0: 130.0}), POLICY.initial_memory())
    assert target.members == {1, 2, 3}
    assert target.mode is not None
    assert "nothing running" in target.reason or "forced" in target.reason or "infeasible" in target.reason


def test_an_infeasible_current_split_is_left_despite_the_switch_cost():
    # a batch of 256: one decode worker's KV cannot hold the trajectories decoding at once
    moe = load_scenario("paper-qwen3-30b-a3b-seg2", ["workload.batch_size=256"])
    policy = _policy(moe)
    fleet = FleetSnapshot(3, (_slot(0, role=Role.PREFILL, active=True), _slot(1, role=Role.DECODE, active=True)), tp=2)
    selection = select(policy.prior, 2, Config.split(1, 1))
    assert not next(c for c in selection.candidates if c.config == Config.split(1, 1)).feasible
    target, _ = policy.decide(fleet, _signals(training=True), policy.initial_memory())
    assert target.mode is Mode.COLOCATED and "infeasible" in target.reason


def test_forced_split_runs_the_best_split():
    policy = _policy(forced_split=True)
    fleet = _fleet(dedicated=6, overlap=0)
    target, _ = policy.decide(fleet, _signals(event="rollout_begin", remaining=64), policy.initial_memory())
    assert target.mode is Mode.SPLIT
    ranked = select(policy.prior, 6, Config.colocated(6)).candidates
    best = next(c.config for c in ranked if c.feasible and c.config.mode is Mode.SPLIT)
    assert target.counts == {Role.PREFILL: best.n_prefill, Role.DECODE: best.n_decode}
    assert "forced split" in target.reason


def test_telemetry_refits_the_profile_and_times_the_step():
    memory = POLICY.initial_memory()
    fleet = _fleet(overlap=0)
    _, memory = POLICY.decide(fleet, _signals(event="rollout_begin", rollout_step=0, remaining=64, now=0.0), memory)
    assert memory.step == 0 and memory.step_config == "colocated/2"
    _, after = POLICY.decide(fleet, _signals(event="rollout_end,rollout_begin", rollout_step=1, remaining=64,
                                             now=400.0, telemetry=_telemetry(0)), memory)
    assert after.fitted_step == 0 and after.profile.steps_observed == 1
    assert after.profile.fit["makespan_s"] == 400.0 and after.profile.fit["config"] == "colocated"
    assert after.step == 1 and after.step_began_s == 400.0
    # the same telemetry seen again is not folded twice
    _, again = POLICY.decide(fleet, _signals(rollout_step=1, now=410.0, telemetry=_telemetry(0)), after)
    assert again.profile == after.profile


def test_measured_costs_are_folded_once():
    memory = POLICY.initial_memory()
    signals = _signals(toggle_costs=(20.0,), toggle_cycles=1, step_durations={"flip_role": 16.0})
    _, one = POLICY.decide(_fleet(), signals, memory)
    _, two = POLICY.decide(_fleet(), signals, one)
    assert one.toggle.measured == 1 and one.toggle.seconds > memory.toggle.seconds
    assert one.costs.role_switch_s > memory.costs.role_switch_s
    assert two.toggle == one.toggle and two.costs == one.costs


def test_a_decision_is_a_pure_function_of_its_arguments():
    fleet, signals = _fleet(), _signals(telemetry=_telemetry(0), rollout_step=1)
    memory = POLICY.initial_memory()
    first = POLICY.decide(fleet, signals, memory)
    second = POLICY.decide(fleet, signals, memory)
    assert first == second
    assert memory == POLICY.initial_memory()


def test_memory_round_trips_through_json():
    memory = POLICY.initial_memory()
    _, memory = POLICY.decide(_fleet(), _signals(rollout_step=0, now=0.0, remaining=64, toggle_costs=(14.0,),
                                                 toggle_cycles=1, step_durations={"admit": 11.0}), memory)
    _, memory = POLICY.decide(_fleet(), _signals(rollout_step=1, now=300.0, remaining=64,
                                                 telemetry=_telemetry(0)), memory)
    raw = json.loads(json.dumps(memory.to_dict()))
    back = PearlMemory.from_dict(raw)
    assert back == memory
    signals = _signals(rollout_step=1, now=320.0)
    assert POLICY.decide(_fleet(), signals, back) == POLICY.decide(_fleet(), signals, memory)


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda r: r["toggle"].update(seconds="soon"), "toggle.seconds"),
    (lambda r: r.update(step_began_s=float("nan")), "step_began_s"),
    (lambda r: r["costs"].update(admit_s=-1.0), "admit_s"),
    (lambda r: r.pop("profile"), "profile"),
])
def test_bad_memory_is_refused_naming_the_field(mutate, field):
    raw = json.loads(json.dumps(POLICY.initial_memory().to_dict()))
    mutate(raw)
    with pytest.raises(BadInput, match=field):
        PearlMemory.from_dict(raw)
