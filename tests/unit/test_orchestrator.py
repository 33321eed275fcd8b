"""The orchestrator: minimal change (against brute force), step chains, ordering, validation."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pearl.controlplane.core.domain import Activity, Role, StepAction, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, Plan, Target, WorkerSlot
from pearl.controlplane.core.orchestrator import BORROW_GROUP, EXPANSION_GROUP, minimal_changes, orchestrate
from pearl.controlplane.errors import BadInput

pytestmark = pytest.mark.unit

C, P, D = Role.COLOCATED, Role.PREFILL, Role.DECODE


def slot(wid: int, role: Role = C, active: bool = True, zone: WorkerZone = WorkerZone.DEDICATED, **kw) -> WorkerSlot:
    return WorkerSlot(
        id=wid,
        node=f"n{wid // 4}",
        gpus=(2 * (wid % 4), 2 * (wid % 4) + 1),
        zone=zone,
        role=role,
        activity=Activity.ACTIVE if active else Activity.INACTIVE,
        **kw,
    )


def fleet(*workers: WorkerSlot, version: int = 7) -> FleetSnapshot:
    return FleetSnapshot(state_version=version, workers=tuple(workers), tp=2)


def target(members, **counts: int) -> Target:
    return Target(members=frozenset(members), counts={Role(k): v for k, v in counts.items()})


def chain(plan: Plan, wid: int) -> list[StepAction]:
    return [s.action for s in plan.steps
            if s.worker_id == wid and s.action not in (StepAction.ROUTER_SYNC, StepAction.BARRIER)]


def by_key(plan: Plan) -> dict:
    return {s.key: s for s in plan.steps}


# -- chains ---------------------------------------------------------------------------------------


def test_removed_worker_drains_interrupts_then_releases():
    plan = orchestrate(fleet(slot(0), slot(1)), target({0}, colocated=1))
    assert plan.remove == {1} and plan.add == frozenset() and plan.d_role == 0
    assert chain(plan, 1) == [StepAction.DRAIN, StepAction.INTERRUPT, StepAction.RELEASE]
    steps = by_key(plan)
    assert steps["w1.interrupt"].after == ("w1.drain",)
    assert steps["w1.interrupt"].args["keep_partials"] is True
    assert steps["w1.release"].after == ("w1.interrupt",)
    assert steps["w1.release"].args["zone"] == "dedicated"
    assert chain(plan, 0) == []
    assert all(s.node == "n0" for s in plan.steps)


def test_added_workers_start_load_and_are_admitted_by_group():
    snap = fleet(slot(0), slot(1, active=False), slot(5, active=False, zone=WorkerZone.OVERLAP, role=Role.TRAINING))
    plan = orchestrate(snap, target({0, 1, 5}, colocated=3))
    assert plan.add == {1, 5} and plan.d_worker == 2 and plan.d_role == 0
    assert chain(plan, 5) == [StepAction.START, StepAction.LOAD_WEIGHTS, StepAction.ADMIT]
    steps = by_key(plan)
    assert steps["w5.start"].args == {"role": "colocated", "zone": "overlap"}
    assert steps["w5.start"].node == "n1"
    # all-or-nothing by group: the dedicated worker 1 and the borrowed worker 5 meet at their own barriers,
    # so a borrow neither waits for a cold start nor fails with it
    for wid, group in ((1, EXPANSION_GROUP), (5, BORROW_GROUP)):
        barrier = steps[f"{group}.barrier"]
        assert barrier.action is StepAction.BARRIER and barrier.group == group
        assert barrier.after == (f"w{wid}.load_weights",) and barrier.worker_id == wid
        admit = steps[f"w{wid}.admit"]
        assert admit.group == group and admit.after == (f"{group}.barrier",)
    assert "router_sync" not in steps  # colocated stays colocated


def test_prefill_decode_flip_in_place_is_not_a_restart():
    snap = fleet(slot(0, P), slot(1, P), slot(2, D))
    plan = orchestrate(snap, target({0, 1, 2}, prefill=1, decode=2))
    assert plan.reassign == {1: D} and plan.d_role == 1 and plan.d_worker == 0
    assert chain(plan, 1) == [StepAction.DRAIN, StepAction.FLIP_ROLE, StepAction.ADMIT]
    steps = by_key(plan)
    assert steps["w1.flip_role"].args["role"] == "decode"
    assert steps["w1.admit"].after == ("w1.flip_role",)
    assert steps["w1.admit"].group is None
    assert "router_sync" not in steps


def test_mode_change_restarts_survivors_and_syncs_the_router_last():
    snap = fleet(slot(0), slot(1), slot(2), slot(3, active=False))
    plan = orchestrate(snap, target({0, 1, 2, 3}, prefill=1, decode=3))
    assert plan.d_role == 3 and plan.add == {3}
    restart = [
        StepAction.DRAIN,
        StepAction.INTERRUPT,
        StepAction.RELEASE,
        StepAction.START,
        StepAction.LOAD_WEIGHTS,
        StepAction.ADMIT,
    ]
    for wid in (0, 1, 2):
        assert chain(plan, wid) == restart
    steps = by_key(plan)
    assert steps["w0.start"].after == ("w0.release",)
    admits = {k for k, s in steps.items() if s.action is StepAction.ADMIT}
    assert admits == {"w0.admit", "w1.admit", "w2.admit", "w3.admit"}
    assert set(steps["expand.barrier"].after) == {f"w{i}.load_weights" for i in range(4)}
    for k in admits:
        assert steps[k].group == EXPANSION_GROUP
        assert steps[k].after == ("expand.barrier",)
    sync = plan.steps[-1]
    assert sync.key == "router_sync" and sync.action is StepAction.ROUTER_SYNC
    assert set(sync.after) == admits and sync.args == {"mode": "split"}
    assert sync.worker_id == 0 and sync.node == "n0"
    assert sorted(r for r in plan.roles.values()) == sorted([P, D, D, D])


def test_split_to_colocated_restarts_every_survivor():
    snap = fleet(slot(0, P), slot(1, D), slot(2, D))
    plan = orchestrate(snap, target({0, 1}, colocated=2))
    assert plan.remove == {2} and plan.reassign == {0: C, 1: C}
    assert by_key(plan)["router_sync"].args == {"mode": "colocated"}


def test_removals_never_wait_for_additions():
    snap = fleet(slot(0), slot(1), slot(2, active=False), slot(3, active=False))
    plan = orchestrate(snap, target({2, 3}, prefill=1, decode=1))
    steps = by_key(plan)
    for wid in (0, 1):
        for action in ("drain", "interrupt", "release"):
            assert all(a.startswith(f"w{wid}.") for a in steps[f"w{wid}.{action}"].after)
    assert not any(dep.startswith(("w0.", "w1.")) for s in plan.steps for dep in s.after if s.worker_id in (2, 3))


def test_unchanged_fleet_gives_an_empty_plan():
    snap = fleet(slot(0, P), slot(1, D), slot(2, active=False))
    plan = orchestrate(snap, target({0, 1}, prefill=1, decode=1))
    assert plan.empty and plan.d_worker == 0 and plan.d_role == 0
    assert plan.base_version == 7


def test_survivors_keep_roles_up_to_the_count_lowest_ids_first():
    snap = fleet(slot(0, D), slot(1, D), slot(2, D), slot(3, P), slot(4, active=False))
    plan = orchestrate(snap, target({0, 1, 2, 3, 4}, prefill=3, decode=2))
    # two decodes stay, one flips; the added worker fills the last prefill place
    assert plan.roles == {0: D, 1: D, 2: P, 3: P, 4: P}
    assert plan.reassign == {2: P}


def test_a_split_started_over_borrowed_workers_keeps_one_of_each_role_on_dedicated_ones():
    """Borrowed (overlap) workers go back at the step's tail: a split started on them and on dedicated
    workers puts one prefill and one decode on the dedicated ones first, so what stays is still a split."""
    borrowed = [slot(i, active=False, zone=WorkerZone.OVERLAP) for i in range(4)]
    snap = fleet(*borrowed, slot(4, active=False), slot(5, active=False))
    plan = orchestrate(snap, target(range(6), prefill=1, decode=5))
    assert plan.roles[4] is not plan.roles[5] and {plan.roles[4], plan.roles[5]} == {P, D}
    assert [plan.roles[i] for i in range(4)] == [D] * 4
    plan = orchestrate(snap, target(range(6), prefill=4, decode=2))
    assert {plan.roles[4], plan.roles[5]} == {P, D}


def test_pinned_roles_are_honoured_even_at_a_cost():
    snap = fleet(slot(0, P), slot(1, D))
    t = Target(members=frozenset({0, 1}), counts={P: 1, D: 1}, pinned={0: D})
    plan = orchestrate(snap, t)
    assert plan.roles == {0: D, 1: P} and plan.d_role == 2


def test_transitioning_workers_count_as_current():
    snap = fleet(slot(0), WorkerSlot(1, "n0", (2, 3), WorkerZone.DEDICATED, C, Activity.TRANSITIONING))
    plan = orchestrate(snap, target({0}, colocated=1))
    assert plan.remove == {1}


def test_steps_are_ordered_after_their_dependencies_and_deterministic():
    snap = fleet(*(slot(i, P if i % 3 else D, active=i < 5) for i in range(9)))
    t = target({1, 2, 4, 6, 7, 8}, prefill=2, decode=4)
    a, b = orchestrate(snap, t), orchestrate(snap, t)
    assert a == b
    seen: set[str] = set()
    for s in a.steps:
        assert set(s.after) <= seen, s.key
        seen.add(s.key)
    assert len(seen) == len(a.steps)


def test_a_warm_up_launches_the_server_and_puts_it_to_sleep_without_admitting_it():
    snap = fleet(slot(0, active=False), slot(4, Role.TRAINING, active=False, zone=WorkerZone.OVERLAP, warm=False))
    t = Target(frozenset({0}), {C: 1}, warm_up=frozenset({4}))
    plan = orchestrate(snap, t)
    assert chain(plan, 4) == [StepAction.START, StepAction.RELEASE]
    steps = by_key(plan)
    assert steps["w4.start"].args == {"role": "colocated", "zone": "overlap", "warm_up": True}
    assert steps["w4.release"].after == ("w4.start",) and steps["w4.start"].group is None
    assert plan.add == {0} and plan.d_worker == 1  # a warm-up is not a member: no reconfiguration
    assert chain(plan, 0) == [StepAction.START, StepAction.LOAD_WEIGHTS, StepAction.ADMIT]


def test_a_warm_up_under_way_is_left_to_finish():
    warming = WorkerSlot(4, "n1", (0, 1), WorkerZone.OVERLAP, C, Activity.TRANSITIONING, warm=False)
    snap = fleet(slot(0), warming)
    assert orchestrate(snap, Target(frozenset({0}), {C: 1}, warm_up=frozenset({4}))).empty
    # without the warm-up in the target it is a borrowed worker to give back
    assert chain(orchestrate(snap, target({0}, colocated=1)), 4) == [
        StepAction.DRAIN, StepAction.INTERRUPT, StepAction.RELEASE]


@pytest.mark.parametrize(("warm", "message"), [
    ({9}, "warm_up: worker 9 does not exist"),
    ({1}, "warm_up: worker 1 is not an overlap slot"),
    ({4}, "warm_up: worker 4 is a member"),
    ({5}, "warm_up: worker 5 is not available"),
])
def test_bad_warm_ups_are_refused_naming_the_field(warm: set[int], message: str):
    snap = fleet(slot(0), slot(1), slot(4, Role.TRAINING, active=False, zone=WorkerZone.OVERLAP),
                 slot(5, Role.TRAINING, active=False, zone=WorkerZone.OVERLAP, available=False))
    members = {0, 4} if warm == {4} else {0}
    with pytest.raises(BadInput, match=message):
        orchestrate(snap, Target(frozenset(members), {C: len(members)}, warm_up=frozenset(warm)))


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "message"),
    [
        (target({0, 1}, colocated=1), "sum to 1 but there are 2 members"),
        (target({0, 1}, colocated=1, decode=1), "all colocated or all split"),
        (target({0, 1}, decode=2), "at least one prefill and one decode"),
        (target({0, 9}, colocated=2), "worker 9 does not exist"),
        (target({0, 2}, colocated=2), "worker 2 is not available"),
        (Target(frozenset({0, 1}), {Role.TRAINING: 2}), "not a rollout role"),
        (Target(frozenset({0, 1}), {C: -1, P: 3}), "counts.colocated: must be an integer >= 0"),
        (Target(frozenset({0}), {C: 1}, pinned={1: C}), "worker 1 is not a member"),
        (Target(frozenset({0, 1}), {P: 1, D: 1}, pinned={0: P, 1: P}), "2 workers pinned to prefill"),
        (Target(frozenset({0, 1}), {P: 1, D: 1}, pinned={0: C}), "role colocated has no place"),
    ],
)
def test_bad_targets_are_refused_naming_the_field(t: Target, message: str):
    snap = fleet(slot(0), slot(1), slot(2, active=False, available=False))
    with pytest.raises(BadInput, match=message) as info:
        orchestrate(snap, t)
    assert str(info.value).startswith("target.")


def test_an_empty_target_removes_everything():
    plan = orchestrate(fleet(slot(0), slot(1)), Target(frozenset(), {}))
    assert plan.remove == {0, 1} and "router_sync" not in by_key(plan)


# -- minimality against brute force ------------------------------------------------------------


def brute_force_d_role(snapshot: FleetSnapshot, t: Target) -> int:
    """The smallest D_role over every role assignment that meets the counts and the pins."""
    members = sorted(t.members)
    current = {w.id: w.role for w in snapshot.active()}
    places = [r for r, n in t.counts.items() for _ in range(n)]
    best = None
    for perm in set(itertools.permutations(places)):
        assign = dict(zip(members, perm, strict=True))
        if any(assign[i] is not r for i, r in t.pinned.items()):
            continue
        d = sum(1 for i in members if i in current and current[i] is not assign[i])
        best = d if best is None else min(best, d)
    assert best is not None
    return best


@st.composite
def fleet_and_target(draw):
    n = draw(st.integers(1, 7))
    workers = []
    for wid in range(n):
        activity = draw(st.sampled_from(list(Activity)))
        role = draw(st.sampled_from([C, P, D])) if activity is not Activity.INACTIVE else draw(st.sampled_from(Role))
        zone = draw(st.sampled_from(list(WorkerZone)))
        workers.append(WorkerSlot(wid, f"n{wid // 2}", (wid,), zone, role, activity, available=draw(st.booleans())))
    snap = FleetSnapshot(state_version=draw(st.integers(0, 99)), workers=tuple(workers))
    available = [w.id for w in workers if w.available]
    members = draw(st.lists(st.sampled_from(available), unique=True) if available else st.just([]))
    k = len(members)
    if k == 0:
        counts: dict[Role, int] = {}
    elif k >= 2 and draw(st.booleans()):
        p = draw(st.integers(1, k - 1))
        counts = {P: p, D: k - p}
    else:
        counts = {C: k}
    places = [r for r, c in counts.items() for _ in range(c)]
    order = draw(st.permutations(places)) if places else []
    pinned = {m: order[i] for i, m in enumerate(members) if draw(st.booleans()) and draw(st.booleans())}
    return snap, Target(frozenset(members), counts, pinned)


@settings(max_examples=400, deadline=None)
@given(fleet_and_target())
def test_plan_is_minimal_against_brute_force(case):
    snap, t = case
    plan = orchestrate(snap, t)
    current = {w.id for w in snap.active()}
    assert plan.d_worker == len(t.members - current) + len(current - t.members)
    assert plan.d_role == brute_force_d_role(snap, t)
    assert (plan.d_worker, plan.d_role) == minimal_changes(snap, t)
    assert (plan.d_worker + plan.d_role == 0) == plan.empty
    # the resolved roles meet the target exactly
    assert set(plan.roles) == t.members
    for role, n in t.counts.items():
        assert sum(1 for r in plan.roles.values() if r is role) == n
    assert all(plan.roles[i] is r for i, r in t.pinned.items())
    # every step depends only on earlier steps; keys are unique
    seen: set[str] = set()
    for s in plan.steps:
        assert set(s.after) <= seen
        seen.add(s.key)
