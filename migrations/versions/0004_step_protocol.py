"""the step protocol: guarded plan and step lifecycles, an O(steps) plan graph, fences, the front door

- `plan_transitions` / `step_transitions`: the allowed status changes of plans and steps, as data; a
  trigger refuses any other change (SQLSTATE PX001), raw SQL included. A step's plan, key, worker,
  node and action never change (PX002).
- The plan graph stays O(steps): an expansion group joins through one `barrier` step (it succeeds in
  the database the moment every step it waits for has; no agent runs it), `plan_step_deps` holds one
  row per dependency, and `plan_steps.pending` counts a step's unfinished dependencies, so a report
  touches only its dependents.
- `plans.cleans_up`: a cleanup plan, written and applied in the transaction that fails a plan, that
  drains and releases every worker the failed plan left transitioning (an abandoned expansion group
  gives its GPUs back).
- `pearl_now()`: the database's clock (`clock_timestamp()`) for every lease and deadline, never a
  caller's; a session may set `pearl.now` to pin it (tests move time without sleeping).
- `workers.last_fence`: the fencing token of the step whose effect last changed the worker; it never
  goes down (PX004), so an effect from an older claim cannot land after a newer one's.
  `workers.unreachable_since`: set by the reaper while the worker's node has no live agent.
- `agents.driver`; `routers`: the front door(s) the agents register workers with, and its mode.
- NOTIFY `pearl_plans` (payload "<plan id>:<status>") when a plan's status changes.

PostgreSQL cannot drop an enum value: the downgrade leaves `barrier` in `step_action`, unused.

Frozen: this file is what revision 0004 means; the SQL is embedded here.

Revision ID: 0004_step_protocol
Revises: 0003_step_node_training_audit
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004_step_protocol"
down_revision: str | None = "0003_step_node_training_audit"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PLAN_EDGES = [
    ("proposed", "applying", "applied against the state_version it was computed at"),
    ("proposed", "stale", "refused at apply: the fleet moved on since it was computed"),
    ("proposed", "superseded", "a newer plan was written before this one was applied"),
    ("applying", "succeeded", "every step succeeded"),
    ("applying", "failed", "a step failed, or an operator aborted it"),
]

# (from, to, only for this action or NULL for any, why)
STEP_EDGES = [
    ("blocked", "ready", None, "every step it waits for succeeded"),
    ("blocked", "succeeded", "barrier", "a barrier: every step it waits for succeeded (no agent runs it)"),
    ("blocked", "cancelled", None, "its plan failed or was aborted before it could run"),
    ("ready", "running", None, "an agent of its node claimed it under a lease and a fencing token"),
    ("ready", "cancelled", None, "its plan failed or was aborted before it was claimed"),
    ("running", "succeeded", None, "its effect is in the rows; reported under its claim's fence"),
    ("running", "failed", None, "its agent reported a failure, or its last claim expired"),
    ("running", "ready", None, "its claim expired (another attempt follows) or its agent handed it back"),
    ("running", "cancelled", None, "its plan stopped applying while it ran: its agent stopped it"),
]

FUNCTIONS = r"""
CREATE FUNCTION pearl_now() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(nullif(current_setting('pearl.now', true), '')::timestamptz, clock_timestamp())
$$;

CREATE FUNCTION pearl_guard_plan() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IS DISTINCT FROM OLD.status AND NOT EXISTS (
        SELECT 1 FROM plan_transitions t WHERE t.from_status = OLD.status AND t.to_status = NEW.status) THEN
        RAISE EXCEPTION 'illegal plan transition: plan % % -> %', OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'PX001', HINT = 'the allowed edges are the rows of plan_transitions';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_guard_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.plan_id, NEW.key, NEW.worker_id, NEW.node_id, NEW.action)
       IS DISTINCT FROM (OLD.plan_id, OLD.key, OLD.worker_id, OLD.node_id, OLD.action) THEN
        RAISE EXCEPTION 'step % (%): plan, key, worker, node and action never change', OLD.id, OLD.key
            USING ERRCODE = 'PX002';
    END IF;
    IF NEW.status IS DISTINCT FROM OLD.status AND NOT EXISTS (
        SELECT 1 FROM step_transitions t
        WHERE t.from_status = OLD.status AND t.to_status = NEW.status
          AND (t.only_action IS NULL OR t.only_action = OLD.action::text)) THEN
        RAISE EXCEPTION 'illegal step transition: step % (%, %) % -> %', OLD.id, OLD.key, OLD.action,
            OLD.status, NEW.status
            USING ERRCODE = 'PX001', HINT = 'the allowed edges are the rows of step_transitions';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_guard_fence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.last_fence IS DISTINCT FROM OLD.last_fence AND OLD.last_fence IS NOT NULL
       AND (NEW.last_fence IS NULL OR NEW.last_fence < OLD.last_fence) THEN
        RAISE EXCEPTION 'stale fence: worker % was last changed under fence %, not %', OLD.id, OLD.last_fence,
            NEW.last_fence USING ERRCODE = 'PX004';
    END IF;
    RETURN NEW;
END $$;

-- A wake-up hint for the agent of the step's node; polling stays the truth. Barriers wake nobody.
CREATE OR REPLACE FUNCTION pearl_notify_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.action <> 'barrier' THEN
        PERFORM pg_notify('pearl_steps', NEW.node_id::text);
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION pearl_notify_plan() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pearl_plans', NEW.id::text || ':' || NEW.status::text);
    RETURN NULL;
END $$;
"""

NOTIFY_STEP_0001 = r"""
CREATE OR REPLACE FUNCTION pearl_notify_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pearl_steps', NEW.node_id::text);
    RETURN NULL;
END $$;
"""

TRIGGERS = r"""
CREATE TRIGGER plans_guard BEFORE UPDATE ON plans FOR EACH ROW EXECUTE FUNCTION pearl_guard_plan();
CREATE TRIGGER plan_steps_guard BEFORE UPDATE ON plan_steps FOR EACH ROW EXECUTE FUNCTION pearl_guard_step();
CREATE TRIGGER workers_fence BEFORE UPDATE OF last_fence ON workers
    FOR EACH ROW EXECUTE FUNCTION pearl_guard_fence();
CREATE TRIGGER plans_notify AFTER UPDATE OF status ON plans
    FOR EACH ROW WHEN (NEW.status IS DISTINCT FROM OLD.status) EXECUTE FUNCTION pearl_notify_plan();
CREATE TRIGGER routers_events AFTER INSERT OR DELETE OR UPDATE OF url, admin_url, mode, stopped_at ON routers
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited', 'name');
-- lease renewals and pending counts are not audited: only what a step is and who holds it
DROP TRIGGER plan_steps_events ON plan_steps;
CREATE TRIGGER plan_steps_events AFTER INSERT OR DELETE OR UPDATE OF status, fence, claimed_by, attempts, error
    ON plan_steps FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited');
"""

STEP_EVENTS_0001 = r"""
DROP TRIGGER plan_steps_events ON plan_steps;
CREATE TRIGGER plan_steps_events AFTER INSERT OR UPDATE OR DELETE ON plan_steps
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited');
"""

# Dependencies and pending counts of plans written before this revision.
BACKFILL = r"""
INSERT INTO plan_step_deps (step_id, after_id)
SELECT s.id, d.id FROM plan_steps s JOIN plan_steps d ON d.plan_id = s.plan_id AND d.key = ANY (s.depends_on);
UPDATE plan_steps s SET pending = (
    SELECT count(*) FROM plan_step_deps e JOIN plan_steps d ON d.id = e.after_id
    WHERE e.step_id = s.id AND d.status <> 'succeeded');
"""


def upgrade() -> None:
    # Inside the migration's transaction (PostgreSQL >= 12): the new value is only used by later
    # transactions (the trigger bodies below are not run here, and `only_action` is text).
    op.execute("ALTER TYPE step_action ADD VALUE IF NOT EXISTS 'barrier'")

    op.create_table(
        "plan_transitions",
        sa.Column("from_status", postgresql.ENUM(name="plan_status", create_type=False), nullable=False),
        sa.Column("to_status", postgresql.ENUM(name="plan_status", create_type=False), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("from_status", "to_status", name=op.f("pk_plan_transitions")),
    )
    op.create_table(
        "step_transitions",
        sa.Column("from_status", postgresql.ENUM(name="step_status", create_type=False), nullable=False),
        sa.Column("to_status", postgresql.ENUM(name="step_status", create_type=False), nullable=False),
        sa.Column("only_action", sa.Text(), nullable=True),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("from_status", "to_status", name=op.f("pk_step_transitions")),
    )
    op.bulk_insert(
        sa.table("plan_transitions", sa.column("from_status"), sa.column("to_status"), sa.column("comment")),
        [{"from_status": a, "to_status": b, "comment": c} for a, b, c in PLAN_EDGES],
    )
    op.bulk_insert(
        sa.table("step_transitions", sa.column("from_status"), sa.column("to_status"), sa.column("only_action"),
                 sa.column("comment")),
        [{"from_status": a, "to_status": b, "only_action": o, "comment": c} for a, b, o, c in STEP_EDGES],
    )

    op.add_column("plan_steps", sa.Column("pending", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.create_check_constraint(op.f("ck_plan_steps_pending_non_negative"), "plan_steps", "pending >= 0")
    op.create_index(op.f("ix_plan_steps_plan_id_status"), "plan_steps", ["plan_id", "status"], unique=False)
    op.create_table(
        "plan_step_deps",
        sa.Column("step_id", sa.BigInteger(), nullable=False),
        sa.Column("after_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["step_id"], ["plan_steps.id"], name=op.f("fk_plan_step_deps_step_id_plan_steps"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["after_id"], ["plan_steps.id"], name=op.f("fk_plan_step_deps_after_id_plan_steps"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("step_id", "after_id", name=op.f("pk_plan_step_deps")),
    )
    op.create_index(op.f("ix_plan_step_deps_after_id"), "plan_step_deps", ["after_id"], unique=False)

    op.add_column("plans", sa.Column("cleans_up", sa.BigInteger(), nullable=True))
    op.create_foreign_key(op.f("fk_plans_cleans_up_plans"), "plans", "plans", ["cleans_up"], ["id"])

    op.add_column("workers", sa.Column("last_fence", sa.BigInteger(), nullable=True))
    op.add_column("workers", sa.Column("unreachable_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("agents", sa.Column("driver", sa.Text(), server_default=sa.text("''"), nullable=False))

    op.create_table(
        "routers",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("admin_url", sa.Text(), nullable=False),
        sa.Column("mode", sa.Text(), nullable=True),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("mode IN ('colocated', 'split')", name=op.f("ck_routers_mode_known")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_routers")),
    )

    op.execute(FUNCTIONS)
    op.execute(TRIGGERS)
    op.execute(BACKFILL)


def downgrade() -> None:
    for trigger, table in (("routers_events", "routers"), ("plans_notify", "plans"), ("workers_fence", "workers"),
                           ("plan_steps_guard", "plan_steps"), ("plans_guard", "plans")):
        op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {table}")
    op.execute(NOTIFY_STEP_0001)
    op.execute(STEP_EVENTS_0001)
    for function in ("pearl_notify_plan()", "pearl_guard_fence()", "pearl_guard_step()", "pearl_guard_plan()",
                     "pearl_now()"):
        op.execute(f"DROP FUNCTION IF EXISTS {function}")
    op.drop_table("routers")
    op.drop_column("agents", "driver")
    op.drop_column("workers", "unreachable_since")
    op.drop_column("workers", "last_fence")
    op.drop_constraint(op.f("fk_plans_cleans_up_plans"), "plans", type_="foreignkey")
    op.drop_column("plans", "cleans_up")
    op.drop_index(op.f("ix_plan_step_deps_after_id"), table_name="plan_step_deps")
    op.drop_table("plan_step_deps")
    op.drop_index(op.f("ix_plan_steps_plan_id_status"), table_name="plan_steps")
    op.drop_constraint(op.f("ck_plan_steps_pending_non_negative"), "plan_steps", type_="check")
    op.drop_column("plan_steps", "pending")
    op.drop_table("step_transitions")
    op.drop_table("plan_transitions")
    op.execute("DELETE FROM plan_steps WHERE action = 'barrier'")
