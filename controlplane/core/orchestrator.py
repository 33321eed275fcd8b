"""Minimal-change orchestration: from the fleet and a target to a plan of ordered, dependent steps.

Pure: no I/O. The policy engine and the simulator call `orchestrate`; the database adapter stores
the plan's steps as rows, and the agents (live) or the simulator's executor enact them.

Minimal change (docs/method.md). With W the current active set (every worker not `inactive`) and W' the
target's members:
  D_worker = |W' \\ W| + |W \\ W'|                     fixed by the members alone;
  D_role   = #survivors (W ∩ W') whose role changes   the orchestrator's choice.
Let c(r) = counts[r] minus the members pinned to r, and u(r) the unpinned survivors now serving in
r. At most c(r) of those u(r) can stay in r, so every assignment changes at least
  D_role* = #pinned survivors whose pin differs from their role + Σ_r max(0, u(r) - c(r)).
Keeping min(u(r), c(r)) unpinned survivors in r and filling the remaining places of each role with
the reassigned survivors and the added workers reaches D_role* (the places always suffice: the
counts sum to the members), so the plan is minimal. Ties are broken by worker id, so the output is
deterministic.

Step chains, one per changed worker (keys `w<id>.<action>`):
- removed: drain -> interrupt (keep partial trajectories) -> release;
- added: start{role, zone} -> load_weights -> admit;
- survivor prefill <-> decode: drain -> flip_role{role} -> admit (in place, on an idle server);
- survivor colocated <-> split: a restart, drain -> interrupt -> release -> start -> load_weights -> admit.
The admits of added and restarted workers form expansion groups, the dedicated workers one (`expand`)
and the overlap workers another (`borrow`: a borrow wakes a sleeping server in seconds and must not
wait for, or fail with, a cold start): each group's admits wait for one barrier step
(`expand.barrier`, `borrow.barrier`, no action of its own) that waits for every member's
load_weights, so a group is admitted all-or-nothing (docs/state-machine.md, invariant 6) with
O(members) dependencies. When the mode
changes, a final `router_sync` waits for every admit (the router's front door changes). Removals
never wait for anything else: shrinking is urgent.

Warm-up (`Target.warm_up`): an overlap slot that never ran a server is launched and put to sleep at
once (start -> release, no admission), so that its loans wake a sleeping server in seconds; one whose
warm-up is under way (transitioning, not a member) is left to finish it rather than removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pearl.controlplane.core.domain import ROLLOUT_ROLES, Role, StepAction, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, Plan, PlanStep, Target, WorkerSlot
from pearl.controlplane.errors import BadInput

EXPANSION_GROUP = "expand"  # the dedicated workers a plan starts; the store qualifies it with the plan id
BORROW_GROUP = "borrow"  # the overlap workers a plan starts (borrowed training GPUs)
_SHARED_KEYS = {StepAction.ROUTER_SYNC: "router_sync"}  # one per plan


def _group(slot: WorkerSlot) -> str:
    return BORROW_GROUP if slot.zone is WorkerZone.OVERLAP else EXPANSION_GROUP

# Order in which places are filled: deterministic, and survivors before added workers (see _resolve).
_ROLE_ORDER = (Role.COLOCATED, Role.PREFILL, Role.DECODE)


def orchestrate(snapshot: FleetSnapshot, target: Target) -> Plan:
    """The minimal-change plan from `snapshot` to `target` (see the module docstring).

    Raises BadInput naming the field when the target is malformed: counts that do not sum to the
    members, a shape other than all-colocated or split with at least one prefill and one decode,
    members that do not exist or are not available, pins outside the members or over the counts.
    """
    slots = snapshot.by_id()
    _validate(target, slots)
    current = {w.id for w in snapshot.active()}
    members = set(target.members)
    add = members - current
    remove = current - members - target.warm_up  # a warm-up under way ends in its own release
    # added workers in order of how long they can stay: dedicated slots before borrowed (overlap) ones
    added = sorted(add, key=lambda i: (slots[i].zone is WorkerZone.OVERLAP, i))
    roles = _resolve(target, [slots[i] for i in sorted(members & current)], added)
    reassign = {i: roles[i] for i in sorted(members & current) if roles[i] is not slots[i].role}
    steps = _expand(snapshot, target, slots, add, remove, reassign, roles)
    steps += _warm_up(slots, sorted(target.warm_up - current))
    return Plan(
        base_version=snapshot.state_version,
        add=frozenset(add),
        remove=frozenset(remove),
        reassign=reassign,
        roles=roles,
        steps=steps,
        target=target,
    )


def minimal_changes(snapshot: FleetSnapshot, target: Target) -> tuple[int, int]:
    """(D_worker, D_role) of the minimal plan, by the closed form of the module docstring."""
    slots = snapshot.by_id()
    _validate(target, slots)
    current = {w.id for w in snapshot.active()}
    d_worker = len(target.members - current) + len(current - target.members)
    survivors = [slots[i] for i in target.members & current]
    forced = sum(1 for w in survivors if w.id in target.pinned and target.pinned[w.id] is not w.role)
    pinned_per_role = _count(target.pinned.values())
    unpinned = _count(w.role for w in survivors if w.id not in target.pinned)
    excess = sum(max(0, n - (target.counts.get(r, 0) - pinned_per_role.get(r, 0))) for r, n in unpinned.items())
    return d_worker, forced + excess


# -- validation ---------------------------------------------------------------------------------


def _validate(target: Target, slots: Mapping[int, WorkerSlot]) -> None:
    counts = dict(target.counts)
    for role, n in counts.items():
        if role not in ROLLOUT_ROLES:
            raise BadInput(f"target.counts: {role!s} is not a rollout role (colocated, prefill, decode)")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise BadInput(f"target.counts.{role}: must be an integer >= 0, got {n!r}")
    total = sum(counts.values())
    if total != len(target.members):
        raise BadInput(f"target.counts: sum to {total} but there are {len(target.members)} members")
    colocated, prefill, decode = (counts.get(r, 0) for r in _ROLE_ORDER)
    if colocated and (prefill or decode):
        raise BadInput(
            f"target.counts: colocated {colocated} mixed with prefill {prefill} / decode {decode}; "
            "the shape is all colocated or all split"
        )
    if not colocated and total and not (prefill >= 1 and decode >= 1):
        raise BadInput(f"target.counts: a split needs at least one prefill and one decode (got {prefill}P{decode}D)")
    for wid in sorted(target.members):
        if wid not in slots:
            raise BadInput(f"target.members: worker {wid} does not exist")
        if not slots[wid].available:
            raise BadInput(f"target.members: worker {wid} is not available (its GPUs cannot host it now)")
    for wid, role in sorted(target.pinned.items()):
        if wid not in target.members:
            raise BadInput(f"target.pinned: worker {wid} is not a member")
        if counts.get(role, 0) == 0:
            raise BadInput(f"target.pinned.{wid}: role {role!s} has no place in the target counts")
    for role, n in _count(target.pinned.values()).items():
        if n > counts.get(role, 0):
            raise BadInput(f"target.pinned: {n} workers pinned to {role} but counts.{role} is {counts.get(role, 0)}")


    for wid in sorted(target.warm_up):
        slot = slots.get(wid)
        if slot is None:
            raise BadInput(f"target.warm_up: worker {wid} does not exist")
        if slot.zone is not WorkerZone.OVERLAP:
            raise BadInput(f"target.warm_up: worker {wid} is not an overlap slot (only loans are warmed up)")
        if wid in target.members:
            raise BadInput(f"target.warm_up: worker {wid} is a member (a member is started and admitted)")
        if not slot.available:
            raise BadInput(f"target.warm_up: worker {wid} is not available (its GPUs cannot host it now)")


def _count(roles: Iterable[Role]) -> dict[Role, int]:
    out: dict[Role, int] = {}
    for r in roles:
        out[r] = out.get(r, 0) + 1
    return out


# -- role assignment ----------------------------------------------------------------------------


def _resolve(target: Target, survivors: list[WorkerSlot], added: list[int]) -> dict[int, Role]:
    """Each member's role: pins first, then survivors kept in their role, then the rest fills up."""
    roles: dict[int, Role] = dict(target.pinned)
    free = {r: target.counts.get(r, 0) for r in _ROLE_ORDER}
    for role in roles.values():
        free[role] -= 1
    movers: list[int] = []
    for w in survivors:  # sorted by id: lower ids keep their role first
        if w.id in roles:
            continue
        if free.get(w.role, 0) > 0:
            roles[w.id] = w.role
            free[w.role] -= 1
        else:
            movers.append(w.id)
    # Reassigned survivors take places before added workers: a prefill->decode flip in place is
    # cheaper than anything else. Each role still to fill takes one place before any takes a second,
    # so that the first (dedicated) added workers hold one of each: when the borrowed ones go back, a
    # split keeps a prefill and a decode worker instead of losing its only one of a kind.
    pending = movers + [i for i in added if i not in roles]
    places = [r for r in _ROLE_ORDER if free[r] > 0] + [r for r in _ROLE_ORDER for _ in range(free[r] - 1)]
    for wid, role in zip(pending, places, strict=True):
        roles[wid] = role
    return dict(sorted(roles.items()))


# -- expansion into steps -----------------------------------------------------------------------


def _warm_up(slots: Mapping[int, WorkerSlot], workers: list[int]) -> tuple[PlanStep, ...]:
    """Launch each overlap slot's server and put it to sleep at once: start -> release, no admission.
    The server comes up colocated, the shape most loans take (a loan in a split wakes it and flips it)."""
    steps: list[PlanStep] = []
    for wid in workers:
        node, zone = slots[wid].node, str(slots[wid].zone)
        started = PlanStep(f"w{wid}.start", StepAction.START, wid, node,
                           {"role": str(Role.COLOCATED), "zone": zone, "warm_up": True})
        steps += [started, PlanStep(f"w{wid}.release", StepAction.RELEASE, wid, node, {"zone": zone}, (started.key,))]
    return tuple(steps)


def _restart(old: Role, new: Role) -> bool:
    """Colocated <-> split needs a restart; prefill <-> decode flips in place (SGLang pd_role_switch)."""
    return (old is Role.COLOCATED) != (new is Role.COLOCATED) or old not in ROLLOUT_ROLES


def _expand(
    snapshot: FleetSnapshot,
    target: Target,
    slots: Mapping[int, WorkerSlot],
    add: set[int],
    remove: set[int],
    reassign: Mapping[int, Role],
    roles: Mapping[int, Role],
) -> tuple[PlanStep, ...]:
    steps: list[PlanStep] = []

    def step(
        wid: int, action: StepAction, after: tuple[str, ...] = (), group: str | None = None, **args: object
    ) -> str:
        key = f"{group}.barrier" if action is StepAction.BARRIER else _SHARED_KEYS.get(action, f"w{wid}.{action}")
        steps.append(PlanStep(key, action, wid, slots[wid].node, args, after, group))
        return key

    def stop(wid: int) -> str:
        drained = step(wid, StepAction.DRAIN)
        interrupted = step(wid, StepAction.INTERRUPT, (drained,), keep_partials=True)
        return step(wid, StepAction.RELEASE, (interrupted,), zone=str(slots[wid].zone))

    def start(wid: int, after: tuple[str, ...]) -> str:
        started = step(wid, StepAction.START, after, role=str(roles[wid]), zone=str(slots[wid].zone))
        return step(wid, StepAction.LOAD_WEIGHTS, (started,))

    for wid in sorted(remove):
        stop(wid)

    flipped: dict[int, str] = {}
    loaded: dict[int, str] = {}
    for wid, role in sorted(reassign.items()):
        if _restart(slots[wid].role, role):
            loaded[wid] = start(wid, (stop(wid),))
        else:
            drained = step(wid, StepAction.DRAIN)
            flipped[wid] = step(wid, StepAction.FLIP_ROLE, (drained,), role=str(role), previous=str(slots[wid].role))
    for wid in sorted(add):
        loaded[wid] = start(wid, ())

    # Each expansion group meets at one barrier (O(members) dependencies, not members squared). The
    # dedicated workers (cold starts) and the overlap workers (a borrow: a sleeping server wakes in
    # seconds) form two groups, so a borrow never waits for a cold start, nor fails with it.
    barriers: dict[str, str] = {}
    for group in (EXPANSION_GROUP, BORROW_GROUP):
        members = sorted(i for i in loaded if _group(slots[i]) == group)
        if members:
            barriers[group] = step(members[0], StepAction.BARRIER, tuple(loaded[i] for i in members), group)
    admits = [
        step(wid, StepAction.ADMIT, (flipped[wid],), role=str(roles[wid]))
        if wid in flipped
        else step(wid, StepAction.ADMIT, (barriers[_group(slots[wid])],), _group(slots[wid]), role=str(roles[wid]))
        for wid in sorted(flipped.keys() | loaded.keys())
    ]

    if target.mode is not None and target.mode is not snapshot.mode():
        # One router per fleet, reconciled by the agent of the lowest member's node.
        step(min(target.members), StepAction.ROUTER_SYNC, tuple(admits), mode=str(target.mode))
    return tuple(steps)
