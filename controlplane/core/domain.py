"""Domain vocabulary shared by the database, the decision core, the agents and the simulator.

Pure: no I/O. The string values are what the database stores.
"""

from __future__ import annotations

from enum import StrEnum


class NodeZone(StrEnum):
    """Where a node's GPUs come from."""

    TRAINING = "training"  # the trainer's GPUs; lendable between optimizer steps (the overlap zone)
    ROLLOUT = "rollout"  # reserved rollout GPUs, always ours
    PREEMPTIBLE = "preemptible"  # spot GPUs: granted and revoked with notice


class WorkerZone(StrEnum):
    """Which capacity pool a rollout worker slot belongs to."""

    DEDICATED = "dedicated"  # on rollout or preemptible GPUs
    OVERLAP = "overlap"  # on training GPUs, active only while borrowed


class GPUState(StrEnum):
    """Lifecycle of one GPU. Allowed edges are data (`gpu_transitions`), enforced by a trigger."""

    UNAVAILABLE = "unavailable"  # a preemptible GPU not granted to us
    FREE = "free"  # ours and idle
    BOUND = "bound"  # serving an active (or transitioning) rollout worker
    TRAINING = "training"  # a training GPU running an optimizer step
    BORROWED = "borrowed"  # a training GPU lent to an overlap worker between steps
    DRAINING = "draining"  # being given back (return to training, or preemption notice)
    REVOKED = "revoked"  # a preemptible GPU taken away
    LOST = "lost"  # failed; needs an operator


class Role(StrEnum):
    """What a worker does."""

    COLOCATED = "colocated"  # prefill and decode on one server
    PREFILL = "prefill"
    DECODE = "decode"
    TRAINING = "training"  # an overlap slot while its GPUs train


ROLLOUT_ROLES = (Role.COLOCATED, Role.PREFILL, Role.DECODE)


class Activity(StrEnum):
    """Whether a worker is serving."""

    ACTIVE = "active"  # serving requests behind the router
    INACTIVE = "inactive"  # holds no GPU
    TRANSITIONING = "transitioning"  # starting, draining, switching role or loading weights


class PlanStatus(StrEnum):
    PROPOSED = "proposed"  # written by the policy, not yet applied
    APPLYING = "applying"  # accepted against the current state_version; steps are being enacted
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a step failed; remaining steps were cancelled
    STALE = "stale"  # refused: the fleet moved on since the plan was computed
    SUPERSEDED = "superseded"  # a newer plan replaced it before it was applied


class StepStatus(StrEnum):
    BLOCKED = "blocked"  # waiting for the steps it depends on
    READY = "ready"  # claimable by the agent of its node
    RUNNING = "running"  # claimed under a lease and a fencing token
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StepAction(StrEnum):
    """Ordered actuators, cheapest first (docs/method.md, orchestration)."""

    DRAIN = "drain"  # stop dispatching to the worker (router remove) and let requests finish
    INTERRUPT = "interrupt"  # abort what is still running, keep partial trajectories for resubmission
    RELEASE = "release"  # release device memory (overlap) or stop the server (dedicated) and free GPUs
    START = "start"  # bind GPUs and start (or resume) a server in a role
    LOAD_WEIGHTS = "load_weights"  # bring the server to the latest weights version
    ADMIT = "admit"  # make a ready group visible to the router, all at once
    FLIP_ROLE = "flip_role"  # prefill <-> decode in place on an idle server
    ROUTER_SYNC = "router_sync"  # reconcile the router's worker list with the active workers
    BARRIER = "barrier"  # an expansion group's meeting point: done when every member is ready (no agent runs it)


class Mode(StrEnum):
    COLOCATED = "colocated"
    SPLIT = "split"


class LeaseKind(StrEnum):
    """Why a GPU is ours only for a while."""

    BORROWED = "borrowed"  # a training GPU lent to rollout between optimizer steps
    PREEMPTIBLE = "preemptible"  # a spot GPU granted until revoked


class Provenance(StrEnum):
    """Where a performance profile's parameters come from."""

    CATALOG = "catalog"  # published figures (docs/calibration.md)
    MEASURED = "measured"  # measured on the device
    FITTED = "fitted"  # fitted from rollout telemetry
