"""The control-plane database: SQLAlchemy 2 typed ORM of the unified GPU-worker-role state.

The tables here and migrations `0001_initial` .. `0010_step_insert_audit` match exactly (`alembic check`).
What the ORM cannot express lives in the migration's SQL: the transition trigger (edges are rows of
`gpu_transitions` and `worker_transitions`), the deferred check that a serving worker holds exactly
its slot's GPUs, the `state_version` bump, the append-only `events` written by triggers, and the views.

Invariant 1 (docs/state-machine.md) in constraints: a GPU belongs to one worker slot (`gpus.slot_id`) and is
held by at most that worker (`gpus.worker_id`); it is held iff it is bound, borrowed or draining;
a training GPU is never held, so an overlap GPU runs training or an active worker, never both.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pearl.controlplane.core.domain import (
    Activity,
    GPUState,
    LeaseKind,
    NodeZone,
    PlanStatus,
    Provenance,
    Role,
    StepAction,
    StepStatus,
    WorkerZone,
)
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    Sequence,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def pg_enum(cls: type[StrEnum], name: str) -> Enum:
    """A native PostgreSQL enum storing the domain enum's values (`free`, not `FREE`)."""
    return Enum(cls, name=name, values_callable=lambda e: [m.value for m in e], validate_strings=True)


NODE_ZONE = pg_enum(NodeZone, "node_zone")
WORKER_ZONE = pg_enum(WorkerZone, "worker_zone")
GPU_STATE = pg_enum(GPUState, "gpu_state")
ROLE = pg_enum(Role, "worker_role")
ACTIVITY = pg_enum(Activity, "worker_activity")
LEASE_KIND = pg_enum(LeaseKind, "lease_kind")
PROVENANCE = pg_enum(Provenance, "profile_provenance")
PLAN_STATUS = pg_enum(PlanStatus, "plan_status")
STEP_STATUS = pg_enum(StepStatus, "step_status")
STEP_ACTION = pg_enum(StepAction, "step_action")

TS = DateTime(timezone=True)
NOW = text("now()")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


# Fencing tokens of step claims: strictly increasing across the fleet (queries.sql, claim_steps).
STEP_FENCE = Sequence("plan_step_fence", metadata=Base.metadata)


FLEET_LOCK_COMMENT = ("never a row: its table lock is the fleet lock (EXCLUSIVE: the whole fleet; "
                      "ROW EXCLUSIVE: a node-scoped writer)")
# `transitions.lock_fleet` / `lock_node` (migration 0014): LOCK TABLE takes no snapshot, so it can come first
fleet_lock = Table("fleet_lock", Base.metadata, Column("nothing", Boolean), comment=FLEET_LOCK_COMMENT)


class Fleet(Base):
    """One row: the inventory the fleet was imported from. (Its `state_version` is the sequence
    `fleet_versions`, read with `pearl_state_version()`: `transitions.state_version`.)"""

    __tablename__ = "fleet"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True, server_default=text("1"), autoincrement=False)
    inventory_hash: Mapped[str | None] = mapped_column(Text)  # sha256 of the canonical inventory
    inventory: Mapped[dict[str, Any] | None] = mapped_column(JSONB)  # as imported, canonical form
    model: Mapped[str | None] = mapped_column(Text)
    gpu: Mapped[str | None] = mapped_column(Text)
    tp: Mapped[int | None] = mapped_column(Integer)
    imported_at: Mapped[datetime | None] = mapped_column(TS)


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (
        UniqueConstraint("id", "zone"),  # target of gpus' (node_id, zone) key: a GPU's zone is its node's
        CheckConstraint("gpu_count > 0", name="gpu_count_positive"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    zone: Mapped[NodeZone] = mapped_column(NODE_ZONE)
    address: Mapped[str] = mapped_column(Text)
    gpu_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)


class NodeRole(Base):
    """The database login of a node's agent (0012): its writes are kept to this node's rows."""

    __tablename__ = "node_roles"

    role_name: Mapped[str] = mapped_column(Text, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), unique=True)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)


class Worker(Base):
    """A stable worker slot: `tp` GPUs on one node, for its lifetime (ids are never renumbered)."""

    __tablename__ = "workers"
    __table_args__ = (
        UniqueConstraint("node_id", "slot"),
        UniqueConstraint("id", "node_id"),  # target of the (slot_id, node_id) and (worker_id, node_id) keys
        CheckConstraint("slot >= 0", name="slot_non_negative"),
        CheckConstraint("zone = 'overlap' OR role <> 'training'", name="training_role_is_overlap"),
        CheckConstraint("role <> 'training' OR activity = 'inactive'", name="training_role_is_inactive"),
        CheckConstraint("weights_version >= 0 AND generation >= 0", name="counters_non_negative"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    slot: Mapped[int] = mapped_column(SmallInteger)  # index of the slot within its node
    zone: Mapped[WorkerZone] = mapped_column(WORKER_ZONE)
    role: Mapped[Role] = mapped_column(ROLE)  # the role it serves in (the last one, while inactive)
    activity: Mapped[Activity] = mapped_column(ACTIVITY, server_default=text("'inactive'"))
    weights_version: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    endpoint: Mapped[str | None] = mapped_column(Text)  # http://host:port of its server while it runs
    generation: Mapped[int] = mapped_column(Integer, server_default=text("0"))  # +1 at each start
    # The fencing token of the plan step whose effect last changed it; never goes down (0004, trigger).
    last_fence: Mapped[int | None] = mapped_column(BigInteger)
    # Set by the reaper while its node has no live agent (nobody can enact or watch it); cleared by its agent.
    unreachable_since: Mapped[datetime | None] = mapped_column(TS)


class GPU(Base):
    __tablename__ = "gpus"
    __table_args__ = (
        UniqueConstraint("node_id", "device_index"),
        ForeignKeyConstraint(["node_id", "zone"], ["nodes.id", "nodes.zone"], ondelete="CASCADE"),
        ForeignKeyConstraint(["slot_id", "node_id"], ["workers.id", "workers.node_id"], ondelete="CASCADE"),
        CheckConstraint("device_index >= 0", name="device_index_non_negative"),
        CheckConstraint("worker_id IS NULL OR worker_id = slot_id", name="held_by_its_slot"),
        CheckConstraint(
            "(worker_id IS NOT NULL) = (state IN ('bound', 'borrowed', 'draining'))", name="held_iff_in_use"
        ),
        CheckConstraint(
            "(zone = 'training' AND state IN ('free', 'training', 'borrowed', 'draining', 'lost'))"
            " OR (zone = 'rollout' AND state IN ('free', 'bound', 'draining', 'lost'))"
            " OR (zone = 'preemptible' AND state IN ('unavailable', 'free', 'bound', 'draining', 'revoked', 'lost'))",
            name="state_fits_zone",
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(Integer)
    zone: Mapped[NodeZone] = mapped_column(NODE_ZONE)  # its node's zone (composite foreign key)
    device_index: Mapped[int] = mapped_column(SmallInteger)  # CUDA index on the node
    slot_id: Mapped[int] = mapped_column(Integer, index=True)  # the worker slot it belongs to, forever
    # The worker holding it now (only ever its slot's worker); NULL while free, training, unavailable,
    # revoked or lost.
    worker_id: Mapped[int | None] = mapped_column(ForeignKey("workers.id"))
    state: Mapped[GPUState] = mapped_column(GPU_STATE)


class GPUTransition(Base):
    """An allowed GPU state change; the trigger on `gpus` refuses any other."""

    __tablename__ = "gpu_transitions"

    zone: Mapped[NodeZone] = mapped_column(NODE_ZONE, primary_key=True)
    from_state: Mapped[GPUState] = mapped_column(GPU_STATE, primary_key=True)
    to_state: Mapped[GPUState] = mapped_column(GPU_STATE, primary_key=True)
    comment: Mapped[str] = mapped_column(Text)  # when and why this edge is taken


class WorkerTransition(Base):
    """An allowed worker activity change; the trigger on `workers` refuses any other."""

    __tablename__ = "worker_transitions"

    from_activity: Mapped[Activity] = mapped_column(ACTIVITY, primary_key=True)
    to_activity: Mapped[Activity] = mapped_column(ACTIVITY, primary_key=True)
    comment: Mapped[str] = mapped_column(Text)


class Lease(Base):
    """A GPU that is ours for a while: borrowed between optimizer steps, or granted preemptible."""

    __tablename__ = "leases"
    __table_args__ = (
        Index("uq_leases_open_gpu", "gpu_id", unique=True, postgresql_where=text("returned_at IS NULL")),
        CheckConstraint("late_s IS NULL OR late_s >= 0", name="late_s_non_negative"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"))
    kind: Mapped[LeaseKind] = mapped_column(LEASE_KIND)
    granted_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    # borrowed: when the trainer needs it back; preemptible: the end of a revocation notice (NULL until one)
    deadline: Mapped[datetime | None] = mapped_column(TS)
    training_step: Mapped[int | None] = mapped_column(BigInteger)  # borrowed: the step it must be back for
    returned_at: Mapped[datetime | None] = mapped_column(TS)
    late_s: Mapped[float | None] = mapped_column(Double)  # seconds past the deadline it came back (0: on time)
    active_at: Mapped[datetime | None] = mapped_column(TS)  # borrowed: its worker was admitted (0005)
    return_began_at: Mapped[datetime | None] = mapped_column(TS)  # borrowed: its worker's return began (0005)
    # borrowed: its worker launched a server rather than waking a sleeping one (0006); not a toggle
    cold_start: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


class TrainingStep(Base):
    """One optimizer step of the trainer, as its events report it. A new step is numbered after the
    latest and begins only once every earlier one ended (0005, trigger)."""

    __tablename__ = "training_steps"
    __table_args__ = (
        CheckConstraint("step >= 0", name="step_non_negative"),
        CheckConstraint("weights_version IS NULL OR weights_version >= 0", name="weights_version_non_negative"),
        CheckConstraint("(started_at IS NULL OR requested_at IS NULL OR started_at >= requested_at) "
                        "AND (ended_at IS NULL OR started_at IS NULL OR ended_at >= started_at)",
                        name="times_in_order"),
    )

    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    requested_at: Mapped[datetime | None] = mapped_column(TS)  # training-begin received
    started_at: Mapped[datetime | None] = mapped_column(TS)  # every borrowed GPU back
    ended_at: Mapped[datetime | None] = mapped_column(TS)
    weights_version: Mapped[int | None] = mapped_column(BigInteger)
    snapshot: Mapped[str | None] = mapped_column(Text)  # URI of the weights it produced
    late_s: Mapped[float | None] = mapped_column(Double)  # how long late returns delayed it


class WeightSnapshot(Base):
    """A weights version the trainer produced (0007): where its files are and their manifest (name ->
    dtype, shape, checksum). The payload stays outside the database; the files matched the manifest
    when it was registered."""

    __tablename__ = "weight_snapshots"
    __table_args__ = (
        CheckConstraint("version > 0", name="version_positive"),
        CheckConstraint("tensors >= 0 AND bytes >= 0", name="sizes_non_negative"),
    )

    version: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    uri: Mapped[str] = mapped_column(Text)
    manifest: Mapped[dict[str, Any]] = mapped_column(JSONB)
    tensors: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str] = mapped_column(Text)  # weights.files.manifest_digest of the manifest
    registered_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)


class WeightSync(Base):
    """Bringing one worker's server to one weights version (0007): at most one row per (worker, version).
    queued -> running -> done | failed | superseded (a newer version took over)."""

    __tablename__ = "weight_syncs"
    __table_args__ = (
        UniqueConstraint("worker_id", "version"),
        CheckConstraint("state IN ('queued', 'running', 'done', 'failed', 'superseded')", name="state_known"),
        CheckConstraint("attempts >= 0", name="attempts_non_negative"),
        CheckConstraint("(state IN ('done', 'failed', 'superseded')) = (finished_at IS NOT NULL)",
                        name="finished_iff_final"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(ForeignKey("weight_snapshots.version", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(Text, server_default=text("'queued'"))
    method: Mapped[str | None] = mapped_column(Text)  # snapshot | broadcast: how the weights got there
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    enqueued_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    started_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    error: Mapped[str | None] = mapped_column(Text)


class RolloutProgress(Base):
    """How many trajectories of a rollout step have finished: the live R of the borrowing gate (0005).
    Its batch size never changes and its count never goes down (trigger)."""

    __tablename__ = "rollout_progress"
    __table_args__ = (
        CheckConstraint("step >= 0", name="step_non_negative"),
        CheckConstraint("batch_size > 0", name="batch_size_positive"),
        CheckConstraint("finished >= 0 AND finished <= batch_size", name="finished_within_batch"),
        CheckConstraint("in_flight >= 0", name="in_flight_non_negative"),
    )

    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    batch_size: Mapped[int] = mapped_column(Integer)
    finished: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    began_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    updated_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    ended_at: Mapped[datetime | None] = mapped_column(TS)  # every trajectory finished
    # trajectories of every batch in flight at the latest report (0008; null: not reported)
    in_flight: Mapped[int | None] = mapped_column(Integer)


class Telemetry(Base):
    """One rollout step's telemetry as received (controlplane/core/telemetry.py validates it first)."""

    __tablename__ = "telemetry"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, index=True, unique=True)  # folded into the profile once
    received_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    body: Mapped[dict[str, Any]] = mapped_column(JSONB)


class Profile(Base):
    """Performance-model parameters for (model, gpu, tp, device); the newest row per key is current."""

    __tablename__ = "profiles"
    __table_args__ = (Index(None, "model", "gpu", "tp", "device", "created_at"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    model: Mapped[str] = mapped_column(Text)
    gpu: Mapped[str] = mapped_column(Text)
    tp: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(Text)  # the device it was measured on ("catalog" for published figures)
    provenance: Mapped[Provenance] = mapped_column(PROVENANCE)
    params: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    # fitted: the profile it was refit from and the telemetry step it folded in (0002)
    based_on: Mapped[int | None] = mapped_column(ForeignKey("profiles.id", ondelete="SET NULL"))
    telemetry_id: Mapped[int | None] = mapped_column(ForeignKey("telemetry.id", ondelete="SET NULL"))


class Decision(Base):
    """What the policy decided on one pass, and why."""

    __tablename__ = "decisions"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    state_version: Mapped[int] = mapped_column(BigInteger)  # the fleet it looked at
    inputs: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))  # summary
    target: Mapped[dict[str, Any] | None] = mapped_column(JSONB)  # NULL: keep the current configuration
    reason: Mapped[str] = mapped_column(Text, server_default=text("''"))
    predicted_current_s: Mapped[float | None] = mapped_column(Double)  # makespan of the current config
    predicted_target_s: Mapped[float | None] = mapped_column(Double)  # makespan of the target
    policy: Mapped[str] = mapped_column(Text, server_default=text("''"))  # which policy decided (0002)


class PolicyMemory(Base):
    """What a policy remembers between passes (its memory's `to_dict()`), so any process runs the next (0002)."""

    __tablename__ = "policy_memory"

    policy: Mapped[str] = mapped_column(Text, primary_key=True)
    memory: Mapped[dict[str, Any]] = mapped_column(JSONB)
    decision_id: Mapped[int | None] = mapped_column(ForeignKey("decisions.id", ondelete="SET NULL"))
    updated_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)


class Plan(Base):
    __tablename__ = "plans"
    __table_args__ = (
        # one plan is enacted at a time
        Index("uq_plans_one_applying", "status", unique=True, postgresql_where=text("status = 'applying'")),
        CheckConstraint("d_worker >= 0 AND d_role >= 0", name="distances_non_negative"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    decision_id: Mapped[int | None] = mapped_column(ForeignKey("decisions.id"))
    base_version: Mapped[int] = mapped_column(BigInteger)  # the state_version it was computed against
    status: Mapped[PlanStatus] = mapped_column(PLAN_STATUS, server_default=text("'proposed'"))
    created_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    applied_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    d_worker: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    d_role: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    error: Mapped[str | None] = mapped_column(Text)
    # A cleanup plan: the failed plan whose transitioning workers it drains and releases (0004).
    cleans_up: Mapped[int | None] = mapped_column(ForeignKey("plans.id"))


class PlanTransition(Base):
    """An allowed plan status change; the trigger on `plans` refuses any other (0004)."""

    __tablename__ = "plan_transitions"

    from_status: Mapped[PlanStatus] = mapped_column(PLAN_STATUS, primary_key=True)
    to_status: Mapped[PlanStatus] = mapped_column(PLAN_STATUS, primary_key=True)
    comment: Mapped[str] = mapped_column(Text)


class StepTransition(Base):
    """An allowed step status change (for every action, or for one); the trigger on `plan_steps`
    refuses any other (0004)."""

    __tablename__ = "step_transitions"

    from_status: Mapped[StepStatus] = mapped_column(STEP_STATUS, primary_key=True)
    to_status: Mapped[StepStatus] = mapped_column(STEP_STATUS, primary_key=True)
    only_action: Mapped[str | None] = mapped_column(Text)  # the one action this edge is for; NULL: any
    comment: Mapped[str] = mapped_column(Text)


class Agent(Base):
    """A node agent process; alive while its heartbeat is recent."""

    __tablename__ = "agents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    heartbeat_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    stopped_at: Mapped[datetime | None] = mapped_column(TS)
    driver: Mapped[str] = mapped_column(Text, server_default=text("''"))  # sim or sglang (0004)


class PlanStep(Base):
    """One action of a plan on one worker, claimed by its node's agent under a lease and a fence."""

    __tablename__ = "plan_steps"
    __table_args__ = (
        UniqueConstraint("plan_id", "key"),
        # a step is addressed to the node its worker lives on
        ForeignKeyConstraint(["worker_id", "node_id"], ["workers.id", "workers.node_id"], ondelete="CASCADE"),
        # per-worker mutual exclusion: at most one running step per worker
        Index(
            "uq_plan_steps_one_running_per_worker",
            "worker_id",
            unique=True,
            postgresql_where=text("status = 'running'"),
        ),
        Index(None, "node_id", "status"),
        Index(None, "plan_id", "status"),
        CheckConstraint(
            "status <> 'running' OR (fence IS NOT NULL AND lease_until IS NOT NULL)", name="running_is_claimed"
        ),
        CheckConstraint("attempts >= 0", name="attempts_non_negative"),
        CheckConstraint("pending >= 0", name="pending_non_negative"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(Text)  # unique within the plan, e.g. "w7.start"
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    action: Mapped[StepAction] = mapped_column(STEP_ACTION)
    args: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    expansion_group: Mapped[str | None] = mapped_column(Text)  # admitted all-or-nothing (invariant 6)
    depends_on: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'::text[]"))  # step keys
    # How many of the steps it depends on have not succeeded yet (0004); ready at 0.
    pending: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    status: Mapped[StepStatus] = mapped_column(STEP_STATUS, server_default=text("'blocked'"))
    fence: Mapped[int | None] = mapped_column(BigInteger)  # fencing token of the current claim
    claimed_by: Mapped[int | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"))
    claimed_at: Mapped[datetime | None] = mapped_column(TS)
    lease_until: Mapped[datetime | None] = mapped_column(TS)  # the claim expires then unless renewed
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)


class PlanStepDep(Base):
    """One dependency of a step: it runs once `after_id` succeeded (0004). One row per edge, so a
    report finds its dependents by index."""

    __tablename__ = "plan_step_deps"
    __table_args__ = (Index(None, "after_id"),)

    step_id: Mapped[int] = mapped_column(ForeignKey("plan_steps.id", ondelete="CASCADE"), primary_key=True)
    after_id: Mapped[int] = mapped_column(ForeignKey("plan_steps.id", ondelete="CASCADE"), primary_key=True)


class Router(Base):
    """A front door the agents register workers with (`pearlctl router`), and the mode it serves (0004)."""

    __tablename__ = "routers"
    __table_args__ = (CheckConstraint("mode IN ('colocated', 'split')", name="mode_known"),)

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    url: Mapped[str] = mapped_column(Text)  # where clients send requests
    admin_url: Mapped[str] = mapped_column(Text)  # where agents register and deregister workers
    mode: Mapped[str | None] = mapped_column(Text)  # colocated or split; NULL before the first worker
    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    heartbeat_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    stopped_at: Mapped[datetime | None] = mapped_column(TS)


class ControlSecret(Base):
    """Named secrets (0009): `control` authenticates pearl's commands to servers and the front door."""

    __tablename__ = "control_secrets"
    __table_args__ = (CheckConstraint("length(value) >= 32", name="long_enough"),)

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)


class MetricsEndpoint(Base):
    """Where a live pearl process serves `/metrics` (0011); heartbeated by it, deleted when it stops."""

    __tablename__ = "metrics_endpoints"
    __table_args__ = (
        CheckConstraint("component IN ('agent', 'loop', 'frontdoor', 'worker')", name="known_component"),
        CheckConstraint("url ~ '^https?://[^/?#]+/metrics$'", name="metrics_url"),
        UniqueConstraint("host", "pid", "component"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    component: Mapped[str] = mapped_column(Text)
    node: Mapped[str | None] = mapped_column(Text)
    url: Mapped[str] = mapped_column(Text)
    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(TS, server_default=text("pearl_now()"))
    heartbeat_at: Mapped[datetime] = mapped_column(TS, server_default=text("pearl_now()"))


class LeaderLease(Base):
    """Leadership of a long-running loop (`pearlctl loop`): held until `expires_at` unless renewed."""

    __tablename__ = "leader_leases"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    holder: Mapped[str] = mapped_column(Text)
    acquired_at: Mapped[datetime] = mapped_column(TS)
    expires_at: Mapped[datetime] = mapped_column(TS)


class Tick(Base):
    """One policy pass; the unique key stops two crons from planning the same tick twice."""

    __tablename__ = "ticks"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    key: Mapped[str] = mapped_column(Text, unique=True)
    holder: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(TS, server_default=NOW)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    decision_id: Mapped[int | None] = mapped_column(ForeignKey("decisions.id"))
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id"))
    error: Mapped[str | None] = mapped_column(Text)


class Event(Base):
    """The append-only audit log, written by triggers in the same transaction as the change."""

    __tablename__ = "events"
    __table_args__ = (
        Index(None, "entity", "entity_id", "id"),
        CheckConstraint("op IN ('insert', 'update', 'delete')", name="op_known"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    at: Mapped[datetime] = mapped_column(TS, server_default=NOW)  # the transaction's time
    txid: Mapped[int] = mapped_column(BigInteger, server_default=text("txid_current()"))
    state_version: Mapped[int] = mapped_column(BigInteger)  # the fleet's version after the change
    entity: Mapped[str] = mapped_column(Text)  # the table
    entity_id: Mapped[str] = mapped_column(Text)
    op: Mapped[str] = mapped_column(Text)
    old: Mapped[dict[str, Any] | None] = mapped_column(JSONB)  # the row before (update, delete)
    new: Mapped[dict[str, Any] | None] = mapped_column(JSONB)  # the row after (insert, update)
    actor: Mapped[str | None] = mapped_column(Text)  # SET LOCAL pearl.actor
    reason: Mapped[str | None] = mapped_column(Text)  # SET LOCAL pearl.reason
    db_user: Mapped[str] = mapped_column(Text, server_default=text("session_user"))  # the login that wrote it (0012)
