"""initial control-plane schema

The unified GPU-worker-role state, leases, training steps, telemetry, profiles, decisions, plans and
steps, agents, leadership and ticks, the append-only audit log, and the triggers and views around them.

Frozen: this file is what revision 0001 means. Enum values, transition edges and the SQL of the
triggers and views are embedded here, not read from the live modules or controlplane/store/sql/.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENUMS = {
    "node_zone": ("training", "rollout", "preemptible"),
    "worker_zone": ("dedicated", "overlap"),
    "gpu_state": ("unavailable", "free", "bound", "training", "borrowed", "draining", "revoked", "lost"),
    "worker_role": ("colocated", "prefill", "decode", "training"),
    "worker_activity": ("active", "inactive", "transitioning"),
    "lease_kind": ("borrowed", "preemptible"),
    "profile_provenance": ("catalog", "measured", "fitted"),
    "plan_status": ("proposed", "applying", "succeeded", "failed", "stale", "superseded"),
    "step_status": ("blocked", "ready", "running", "succeeded", "failed", "cancelled"),
    "step_action": ("drain", "interrupt", "release", "start", "load_weights", "admit", "flip_role", "router_sync"),
}


def _enum(name: str) -> postgresql.ENUM:
    return postgresql.ENUM(*ENUMS[name], name=name, create_type=False)


def _ts(name: str, *, now: bool = False, nullable: bool = True) -> sa.Column:
    default = sa.text("now()") if now else None
    return sa.Column(name, sa.DateTime(timezone=True), server_default=default, nullable=nullable and not now)


def _json(name: str, *, default: str | None = None, nullable: bool = False) -> sa.Column:
    server_default = sa.text(default) if default else None
    return sa.Column(name, postgresql.JSONB(astext_type=sa.Text()), server_default=server_default, nullable=nullable)


# GPU state machine per zone: (from, to, why). Every other change is refused by gpus_guard.
GPU_EDGES = {
    "training": [
        ("free", "training", "an optimizer step starts on the trainer's GPU"),
        ("training", "free", "the optimizer step ended; the GPU may be lent until the next one"),
        ("free", "borrowed", "an overlap worker borrows the idle GPU between optimizer steps"),
        ("borrowed", "draining", "the trainer needs the GPU back: the overlap worker drains and releases memory"),
        ("draining", "free", "returned to the trainer"),
    ],
    "rollout": [
        ("free", "bound", "a dedicated worker starts on the GPU"),
        ("bound", "draining", "its worker is stopped or reconfigured"),
        ("draining", "free", "its worker released the GPU"),
    ],
    "preemptible": [
        ("unavailable", "free", "the provider granted the GPU"),
        ("free", "bound", "a dedicated worker starts on the granted GPU"),
        ("bound", "draining", "its worker is stopped, or a revocation notice arrived"),
        ("draining", "free", "its worker released the GPU"),
        ("free", "revoked", "the provider took the idle GPU back"),
        ("bound", "revoked", "the provider took the GPU back before its worker drained"),
        ("draining", "revoked", "the notice ran out while the worker was draining"),
        ("revoked", "unavailable", "the revocation is complete; the GPU is not ours"),
        ("revoked", "free", "the provider granted the GPU again"),
    ],
}
_LOSABLE = {"training": ("free", "training", "borrowed", "draining"), "rollout": ("free", "bound", "draining"),
            "preemptible": ("free", "bound", "draining", "revoked")}
for _zone, _states in _LOSABLE.items():
    GPU_EDGES[_zone] += [(s, "lost", "the GPU failed or stopped answering") for s in _states]
    GPU_EDGES[_zone].append(("lost", "free", "an operator returned the repaired GPU"))

WORKER_EDGES = [
    ("inactive", "transitioning", "starting: its GPUs are bound or borrowed, the server starts or resumes"),
    ("transitioning", "active", "admitted: the router sends it requests"),
    ("active", "transitioning", "draining, switching role or loading weights"),
    ("transitioning", "inactive", "released: its GPUs are free again (or the start failed)"),
    ("active", "inactive", "crashed, or its GPUs were lost or revoked (they change in the same transaction)"),
]

FUNCTIONS = r"""
CREATE FUNCTION pearl_lock_fleet() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Take the fleet row before any row of the statement, so every state-changing transaction
    -- queues on it first and two writers of different rows cannot deadlock on the version bump.
    PERFORM 1 FROM fleet WHERE id = 1 FOR UPDATE;
    RETURN NULL;
END $$;

CREATE FUNCTION pearl_record_event() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    version bigint;
    row_id text;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW IS NOT DISTINCT FROM OLD THEN
        RETURN NULL;
    END IF;
    IF TG_ARGV[0] = 'versioned' THEN
        UPDATE fleet SET state_version = state_version + 1 WHERE id = 1 RETURNING state_version INTO version;
    ELSE
        SELECT state_version INTO version FROM fleet WHERE id = 1;
    END IF;
    IF TG_OP = 'DELETE' THEN
        row_id := OLD.id::text;
    ELSE
        row_id := NEW.id::text;
    END IF;
    INSERT INTO events (state_version, entity, entity_id, op, old, new, actor, reason)
    VALUES (coalesce(version, 0), TG_TABLE_NAME, row_id, lower(TG_OP),
            CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD) END,
            CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW) END,
            nullif(current_setting('pearl.actor', true), ''),
            nullif(current_setting('pearl.reason', true), ''));
    RETURN NULL;
END $$;

CREATE FUNCTION pearl_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP USING ERRCODE = 'PX003';
END $$;

CREATE FUNCTION pearl_guard_gpu() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    node_name text;
BEGIN
    SELECT name INTO node_name FROM nodes WHERE id = OLD.node_id;
    IF (NEW.node_id, NEW.zone, NEW.slot_id, NEW.device_index)
       IS DISTINCT FROM (OLD.node_id, OLD.zone, OLD.slot_id, OLD.device_index) THEN
        RAISE EXCEPTION 'gpu % (%:%): node, zone, slot and device index never change',
            OLD.id, node_name, OLD.device_index USING ERRCODE = 'PX002';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT EXISTS (
        SELECT 1 FROM gpu_transitions t
        WHERE t.zone = OLD.zone AND t.from_state = OLD.state AND t.to_state = NEW.state) THEN
        RAISE EXCEPTION 'illegal GPU transition: gpu % (%:%, % zone) % -> %',
            OLD.id, node_name, OLD.device_index, OLD.zone, OLD.state, NEW.state
            USING ERRCODE = 'PX001', HINT = 'the allowed edges are the rows of gpu_transitions';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_guard_worker() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.node_id, NEW.slot, NEW.zone) IS DISTINCT FROM (OLD.node_id, OLD.slot, OLD.zone) THEN
        RAISE EXCEPTION 'worker %: node, slot and zone never change', OLD.id USING ERRCODE = 'PX002';
    END IF;
    IF NEW.activity IS DISTINCT FROM OLD.activity AND NOT EXISTS (
        SELECT 1 FROM worker_transitions t
        WHERE t.from_activity = OLD.activity AND t.to_activity = NEW.activity) THEN
        RAISE EXCEPTION 'illegal worker transition: worker % % -> %', OLD.id, OLD.activity, NEW.activity
            USING ERRCODE = 'PX001', HINT = 'the allowed edges are the rows of worker_transitions';
    END IF;
    IF NEW.role IS DISTINCT FROM OLD.role AND OLD.activity = 'active' AND NEW.activity = 'active' THEN
        RAISE EXCEPTION 'illegal worker transition: worker % changes role % -> % while active',
            OLD.id, OLD.role, NEW.role
            USING ERRCODE = 'PX001', HINT = 'a role changes only while the worker is transitioning or inactive';
    END IF;
    RETURN NEW;
END $$;

-- Invariant 1 at commit: a serving (active or transitioning) worker holds every GPU of its slot,
-- an inactive one holds none, and overlap workers live on training nodes only.
CREATE FUNCTION pearl_check_worker_gpus(w integer) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    wk record;
    n_slot integer;
    n_held integer;
BEGIN
    SELECT k.id, k.activity, k.zone, n.zone AS node_zone, n.name AS node INTO wk
    FROM workers k JOIN nodes n ON n.id = k.node_id WHERE k.id = w;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF (wk.zone = 'overlap') <> (wk.node_zone = 'training') THEN
        RAISE EXCEPTION 'worker % (%): a % worker cannot live on a % node', w, wk.node, wk.zone, wk.node_zone
            USING ERRCODE = 'PX002';
    END IF;
    SELECT count(*), count(*) FILTER (WHERE worker_id = w) INTO n_slot, n_held FROM gpus WHERE slot_id = w;
    IF wk.activity = 'inactive' AND n_held > 0 THEN
        RAISE EXCEPTION 'worker % (%) is inactive but holds % GPU(s)', w, wk.node, n_held USING ERRCODE = 'PX002';
    END IF;
    IF wk.activity <> 'inactive' AND (n_slot = 0 OR n_held < n_slot) THEN
        RAISE EXCEPTION 'worker % (%) is % but holds % of its % GPU(s)', w, wk.node, wk.activity, n_held, n_slot
            USING ERRCODE = 'PX002';
    END IF;
END $$;

CREATE FUNCTION pearl_check_holding() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'workers' THEN
        PERFORM pearl_check_worker_gpus(NEW.id);
    ELSE
        IF TG_OP <> 'INSERT' THEN
            PERFORM pearl_check_worker_gpus(OLD.slot_id);
        END IF;
        IF TG_OP <> 'DELETE' THEN
            PERFORM pearl_check_worker_gpus(NEW.slot_id);
        END IF;
    END IF;
    RETURN NULL;
END $$;

-- A wake-up hint for the agent of the step's node; polling stays the truth.
CREATE FUNCTION pearl_notify_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pearl_steps', NEW.node_id::text);
    RETURN NULL;
END $$;
"""

TRIGGERS = r"""
CREATE TRIGGER gpus_guard BEFORE UPDATE ON gpus FOR EACH ROW EXECUTE FUNCTION pearl_guard_gpu();
CREATE TRIGGER workers_guard BEFORE UPDATE ON workers FOR EACH ROW EXECUTE FUNCTION pearl_guard_worker();

CREATE CONSTRAINT TRIGGER workers_hold_their_gpus AFTER INSERT OR UPDATE ON workers
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pearl_check_holding();
CREATE CONSTRAINT TRIGGER gpus_held_by_serving_workers AFTER INSERT OR UPDATE OR DELETE ON gpus
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pearl_check_holding();

CREATE TRIGGER gpus_lock_fleet BEFORE INSERT OR UPDATE OR DELETE ON gpus
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_lock_fleet();
CREATE TRIGGER workers_lock_fleet BEFORE INSERT OR UPDATE OR DELETE ON workers
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_lock_fleet();
CREATE TRIGGER leases_lock_fleet BEFORE INSERT OR UPDATE OR DELETE ON leases
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_lock_fleet();

CREATE TRIGGER gpus_events AFTER INSERT OR UPDATE OR DELETE ON gpus
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('versioned');
CREATE TRIGGER workers_events AFTER INSERT OR UPDATE OR DELETE ON workers
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('versioned');
CREATE TRIGGER leases_events AFTER INSERT OR UPDATE OR DELETE ON leases
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('versioned');
CREATE TRIGGER nodes_events AFTER INSERT OR UPDATE OR DELETE ON nodes
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited');
CREATE TRIGGER plans_events AFTER INSERT OR UPDATE OR DELETE ON plans
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited');
CREATE TRIGGER plan_steps_events AFTER INSERT OR UPDATE OR DELETE ON plan_steps
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited');

CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION pearl_refuse_change();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_refuse_change();

CREATE TRIGGER plan_steps_notify_ready AFTER INSERT OR UPDATE OF status ON plan_steps
    FOR EACH ROW WHEN (NEW.status = 'ready') EXECUTE FUNCTION pearl_notify_step();
"""

VIEWS = r"""
CREATE VIEW gpu_state_by_zone AS
SELECT g.zone, g.state, count(*)::integer AS gpus
FROM gpus g
GROUP BY g.zone, g.state;

CREATE VIEW gpu_detail AS
SELECT g.id AS gpu_id, n.name AS node, g.device_index, g.zone, g.state, g.slot_id, g.worker_id,
       l.id AS lease_id, l.kind AS lease_kind, l.granted_at, l.deadline
FROM gpus g
JOIN nodes n ON n.id = g.node_id
LEFT JOIN leases l ON l.gpu_id = g.id AND l.returned_at IS NULL;

CREATE VIEW worker_roles_history AS
SELECT e.id AS event_id, e.at, e.state_version, e.entity_id::integer AS worker_id,
       (e.new ->> 'node_id')::integer AS node_id, e.new ->> 'zone' AS zone,
       e.old ->> 'role' AS old_role, e.new ->> 'role' AS role,
       e.old ->> 'activity' AS old_activity, e.new ->> 'activity' AS activity,
       (e.new ->> 'weights_version')::bigint AS weights_version, e.actor, e.reason
FROM events e
WHERE e.entity = 'workers'
  AND (e.op = 'insert'
       OR (e.op = 'update' AND (e.old ->> 'role' IS DISTINCT FROM e.new ->> 'role'
                                OR e.old ->> 'activity' IS DISTINCT FROM e.new ->> 'activity')));

CREATE VIEW plan_timeline AS
SELECT p.id AS plan_id, p.status AS plan_status, p.base_version, p.d_worker, p.d_role,
       p.created_at, p.applied_at, p.finished_at AS plan_finished_at,
       s.id AS step_id, s.key, s.action, s.worker_id, n.name AS node, s.expansion_group, s.depends_on,
       s.status, s.attempts, s.started_at, s.finished_at,
       extract(epoch FROM s.finished_at - s.started_at)::double precision AS seconds, s.error
FROM plans p
LEFT JOIN plan_steps s ON s.plan_id = p.id
LEFT JOIN nodes n ON n.id = s.node_id;

CREATE VIEW transitions AS
SELECT e.id AS event_id, e.at, e.state_version, e.entity, e.entity_id, e.op,
       f.key AS field, e.old ->> f.key AS old_value, f.value #>> '{}' AS new_value, e.actor, e.reason
FROM events e
CROSS JOIN LATERAL jsonb_each(e.new) AS f(key, value)
WHERE e.op = 'update' AND (e.old -> f.key) IS DISTINCT FROM f.value
UNION ALL
SELECT e.id, e.at, e.state_version, e.entity, e.entity_id, e.op, NULL, NULL, NULL, e.actor, e.reason
FROM events e
WHERE e.op <> 'update';
"""

VIEW_NAMES = ("transitions", "plan_timeline", "worker_roles_history", "gpu_detail", "gpu_state_by_zone")
FUNCTION_NAMES = ("pearl_notify_step()", "pearl_check_holding()", "pearl_check_worker_gpus(integer)",
                  "pearl_guard_worker()", "pearl_guard_gpu()", "pearl_refuse_change()", "pearl_record_event()",
                  "pearl_lock_fleet()")


def upgrade() -> None:
    bind = op.get_bind()
    for name, values in ENUMS.items():
        postgresql.ENUM(*values, name=name).create(bind)
    op.execute(sa.schema.CreateSequence(sa.Sequence("plan_step_fence")))

    op.create_table(
        "fleet",
        sa.Column("id", sa.SmallInteger(), server_default=sa.text("1"), autoincrement=False, nullable=False),
        sa.Column("state_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("inventory_hash", sa.Text(), nullable=True),
        _json("inventory", nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("gpu", sa.Text(), nullable=True),
        sa.Column("tp", sa.Integer(), nullable=True),
        _ts("imported_at"),
        sa.CheckConstraint("id = 1", name=op.f("ck_fleet_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fleet")),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("zone", _enum("node_zone"), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        _ts("created_at", now=True),
        sa.CheckConstraint("gpu_count > 0", name=op.f("ck_nodes_gpu_count_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("id", "zone", name=op.f("uq_nodes_id_zone")),
        sa.UniqueConstraint("name", name=op.f("uq_nodes_name")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("slot", sa.SmallInteger(), nullable=False),
        sa.Column("zone", _enum("worker_zone"), nullable=False),
        sa.Column("role", _enum("worker_role"), nullable=False),
        sa.Column("activity", _enum("worker_activity"), server_default=sa.text("'inactive'"), nullable=False),
        sa.Column("weights_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=True),
        sa.Column("generation", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("role <> 'training' OR activity = 'inactive'",
                           name=op.f("ck_workers_training_role_is_inactive")),
        sa.CheckConstraint("zone = 'overlap' OR role <> 'training'", name=op.f("ck_workers_training_role_is_overlap")),
        sa.CheckConstraint("slot >= 0", name=op.f("ck_workers_slot_non_negative")),
        sa.CheckConstraint("weights_version >= 0 AND generation >= 0", name=op.f("ck_workers_counters_non_negative")),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_workers_node_id_nodes"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("id", "node_id", name=op.f("uq_workers_id_node_id")),
        sa.UniqueConstraint("node_id", "slot", name=op.f("uq_workers_node_id_slot")),
    )
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("zone", _enum("node_zone"), nullable=False),
        sa.Column("device_index", sa.SmallInteger(), nullable=False),
        sa.Column("slot_id", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.Integer(), nullable=True),
        sa.Column("state", _enum("gpu_state"), nullable=False),
        sa.CheckConstraint("(worker_id IS NOT NULL) = (state IN ('bound', 'borrowed', 'draining'))",
                           name=op.f("ck_gpus_held_iff_in_use")),
        sa.CheckConstraint(
            "(zone = 'training' AND state IN ('free', 'training', 'borrowed', 'draining', 'lost'))"
            " OR (zone = 'rollout' AND state IN ('free', 'bound', 'draining', 'lost'))"
            " OR (zone = 'preemptible' AND state IN ('unavailable', 'free', 'bound', 'draining', 'revoked', 'lost'))",
            name=op.f("ck_gpus_state_fits_zone"),
        ),
        sa.CheckConstraint("device_index >= 0", name=op.f("ck_gpus_device_index_non_negative")),
        sa.CheckConstraint("worker_id IS NULL OR worker_id = slot_id", name=op.f("ck_gpus_held_by_its_slot")),
        sa.ForeignKeyConstraint(["node_id", "zone"], ["nodes.id", "nodes.zone"],
                                name=op.f("fk_gpus_node_id_zone_nodes"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["slot_id", "node_id"], ["workers.id", "workers.node_id"],
                                name=op.f("fk_gpus_slot_id_node_id_workers"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_id"], ["workers.id"], name=op.f("fk_gpus_worker_id_workers")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpus")),
        sa.UniqueConstraint("node_id", "device_index", name=op.f("uq_gpus_node_id_device_index")),
    )
    op.create_index(op.f("ix_gpus_slot_id"), "gpus", ["slot_id"], unique=False)
    op.create_table(
        "gpu_transitions",
        sa.Column("zone", _enum("node_zone"), nullable=False),
        sa.Column("from_state", _enum("gpu_state"), nullable=False),
        sa.Column("to_state", _enum("gpu_state"), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("zone", "from_state", "to_state", name=op.f("pk_gpu_transitions")),
    )
    op.create_table(
        "worker_transitions",
        sa.Column("from_activity", _enum("worker_activity"), nullable=False),
        sa.Column("to_activity", _enum("worker_activity"), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("from_activity", "to_activity", name=op.f("pk_worker_transitions")),
    )
    op.create_table(
        "leases",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("kind", _enum("lease_kind"), nullable=False),
        _ts("granted_at", now=True),
        _ts("deadline"),
        sa.Column("training_step", sa.BigInteger(), nullable=True),
        _ts("returned_at"),
        sa.Column("late_s", sa.Double(), nullable=True),
        sa.CheckConstraint("late_s IS NULL OR late_s >= 0", name=op.f("ck_leases_late_s_non_negative")),
        sa.ForeignKeyConstraint(["gpu_id"], ["gpus.id"], name=op.f("fk_leases_gpu_id_gpus"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
    )
    op.create_index("uq_leases_open_gpu", "leases", ["gpu_id"], unique=True,
                    postgresql_where=sa.text("returned_at IS NULL"))
    op.create_table(
        "training_steps",
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        _ts("requested_at"),
        _ts("started_at"),
        _ts("ended_at"),
        sa.Column("weights_version", sa.BigInteger(), nullable=True),
        sa.Column("snapshot", sa.Text(), nullable=True),
        sa.Column("late_s", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("step", name=op.f("pk_training_steps")),
    )
    op.create_table(
        "telemetry",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        _ts("received_at", now=True),
        _json("body"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry")),
    )
    op.create_index(op.f("ix_telemetry_step"), "telemetry", ["step"], unique=False)
    op.create_table(
        "profiles",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("gpu", sa.Text(), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.Column("device", sa.Text(), nullable=False),
        sa.Column("provenance", _enum("profile_provenance"), nullable=False),
        _json("params"),
        _ts("created_at", now=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_profiles")),
    )
    op.create_index(op.f("ix_profiles_model_gpu_tp_device_created_at"), "profiles",
                    ["model", "gpu", "tp", "device", "created_at"], unique=False)
    op.create_table(
        "decisions",
        sa.Column("id", sa.BigInteger(), nullable=False),
        _ts("created_at", now=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        _json("inputs", default="'{}'::jsonb"),
        _json("target", nullable=True),
        sa.Column("reason", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("predicted_current_s", sa.Double(), nullable=True),
        sa.Column("predicted_target_s", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_decisions")),
    )
    op.create_table(
        "plans",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("decision_id", sa.BigInteger(), nullable=True),
        sa.Column("base_version", sa.BigInteger(), nullable=False),
        sa.Column("status", _enum("plan_status"), server_default=sa.text("'proposed'"), nullable=False),
        _ts("created_at", now=True),
        _ts("applied_at"),
        _ts("finished_at"),
        sa.Column("d_worker", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("d_role", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint("d_worker >= 0 AND d_role >= 0", name=op.f("ck_plans_distances_non_negative")),
        sa.ForeignKeyConstraint(["decision_id"], ["decisions.id"], name=op.f("fk_plans_decision_id_decisions")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plans")),
    )
    op.create_index("uq_plans_one_applying", "plans", ["status"], unique=True,
                    postgresql_where=sa.text("status = 'applying'"))
    op.create_table(
        "agents",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        _ts("started_at", now=True),
        _ts("heartbeat_at", now=True),
        _ts("stopped_at"),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_agents_node_id_nodes"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agents")),
    )
    op.create_index(op.f("ix_agents_node_id"), "agents", ["node_id"], unique=False)
    op.create_table(
        "plan_steps",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("plan_id", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("worker_id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("action", _enum("step_action"), nullable=False),
        _json("args", default="'{}'::jsonb"),
        sa.Column("expansion_group", sa.Text(), nullable=True),
        sa.Column("depends_on", postgresql.ARRAY(sa.Text()), server_default=sa.text("'{}'::text[]"), nullable=False),
        sa.Column("status", _enum("step_status"), server_default=sa.text("'blocked'"), nullable=False),
        sa.Column("fence", sa.BigInteger(), nullable=True),
        sa.Column("claimed_by", sa.Integer(), nullable=True),
        _ts("claimed_at"),
        _ts("lease_until"),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("started_at"),
        _ts("finished_at"),
        sa.CheckConstraint("status <> 'running' OR (fence IS NOT NULL AND lease_until IS NOT NULL)",
                           name=op.f("ck_plan_steps_running_is_claimed")),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_plan_steps_attempts_non_negative")),
        sa.ForeignKeyConstraint(["claimed_by"], ["agents.id"], name=op.f("fk_plan_steps_claimed_by_agents"),
                                ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_plan_steps_node_id_nodes"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], name=op.f("fk_plan_steps_plan_id_plans"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_id"], ["workers.id"], name=op.f("fk_plan_steps_worker_id_workers"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plan_steps")),
        sa.UniqueConstraint("plan_id", "key", name=op.f("uq_plan_steps_plan_id_key")),
    )
    op.create_index(op.f("ix_plan_steps_node_id_status"), "plan_steps", ["node_id", "status"], unique=False)
    op.create_index("uq_plan_steps_one_running_per_worker", "plan_steps", ["worker_id"], unique=True,
                    postgresql_where=sa.text("status = 'running'"))
    op.create_table(
        "leader_leases",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        _ts("acquired_at", nullable=False),
        _ts("expires_at", nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leader_leases")),
    )
    op.create_table(
        "ticks",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=True),
        _ts("started_at", now=True),
        _ts("finished_at"),
        sa.Column("decision_id", sa.BigInteger(), nullable=True),
        sa.Column("plan_id", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["decision_id"], ["decisions.id"], name=op.f("fk_ticks_decision_id_decisions")),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], name=op.f("fk_ticks_plan_id_plans")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ticks")),
        sa.UniqueConstraint("key", name=op.f("uq_ticks_key")),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger(), nullable=False),
        _ts("at", now=True),
        sa.Column("txid", sa.BigInteger(), server_default=sa.text("txid_current()"), nullable=False),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("entity", sa.Text(), nullable=False),
        sa.Column("entity_id", sa.Text(), nullable=False),
        sa.Column("op", sa.Text(), nullable=False),
        _json("old", nullable=True),
        _json("new", nullable=True),
        sa.Column("actor", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.CheckConstraint("op IN ('insert', 'update', 'delete')", name=op.f("ck_events_op_known")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_entity_entity_id_id"), "events", ["entity", "entity_id", "id"], unique=False)

    op.execute("INSERT INTO fleet (id, state_version) VALUES (1, 0)")
    gpu_edges = sa.table("gpu_transitions", sa.column("zone"), sa.column("from_state"), sa.column("to_state"),
                         sa.column("comment"))
    op.bulk_insert(gpu_edges, [{"zone": z, "from_state": a, "to_state": b, "comment": c}
                               for z, edges in GPU_EDGES.items() for a, b, c in edges])
    worker_edges = sa.table("worker_transitions", sa.column("from_activity"), sa.column("to_activity"),
                            sa.column("comment"))
    op.bulk_insert(worker_edges, [{"from_activity": a, "to_activity": b, "comment": c} for a, b, c in WORKER_EDGES])
    op.execute(FUNCTIONS)
    op.execute(TRIGGERS)
    op.execute(VIEWS)


def downgrade() -> None:
    for view in VIEW_NAMES:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table in ("events", "ticks", "leader_leases", "plan_steps", "agents", "plans", "decisions", "profiles",
                  "telemetry", "training_steps", "leases", "worker_transitions", "gpu_transitions", "gpus",
                  "workers", "nodes", "fleet"):
        op.drop_table(table)
    for function in FUNCTION_NAMES:
        op.execute(f"DROP FUNCTION IF EXISTS {function}")
    op.execute(sa.schema.DropSequence(sa.Sequence("plan_step_fence")))
    bind = op.get_bind()
    for name in reversed(ENUMS):
        postgresql.ENUM(name=name).drop(bind)
