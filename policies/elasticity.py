"""Growing and shrinking with the GPUs that come and go: logic every elastic policy shares.

Shrinking is urgent and cheap: a worker whose GPUs are under a preemption notice (or, on the overlap
zone, wanted back by the trainer) is no longer `available`; leaving it out of the target makes the
orchestrator drain it, interrupt what it runs (the trajectories keep their partial progress and are
resubmitted elsewhere) and release its GPUs, well before the notice runs out.

Growing is slow and can wait: a newly available worker joins the target, and the orchestrator starts
it in the background while the others keep serving, loads the latest weights once it is up (lazy),
and admits the whole expansion group at once, all-or-nothing.
"""

from __future__ import annotations

from pearl.controlplane.core.domain import WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot


def dedicated_capacity(snapshot: FleetSnapshot) -> tuple[WorkerSlot, ...]:
    """Dedicated slots (reserved and granted preemptible) that can host a worker now, by id."""
    return tuple(sorted(snapshot.available(WorkerZone.DEDICATED), key=lambda w: w.id))


def overlap_capacity(snapshot: FleetSnapshot) -> tuple[WorkerSlot, ...]:
    """Training-GPU slots that can be borrowed now (between optimizer steps), by id."""
    return tuple(sorted(snapshot.available(WorkerZone.OVERLAP), key=lambda w: w.id))
