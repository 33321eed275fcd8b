"""plan steps on their worker's node; training steps versioned and audited

- `plan_steps (worker_id, node_id) -> workers (id, node_id)`: a step is addressed to the node its
  worker lives on (a step sent to another node's agent could never be enacted).
- `training_steps` gets the triggers the state tables have (0001): the fleet lock, the
  `state_version` bump and the audit event. A training step beginning or ending changes what the
  overlap zone may do, so a plan computed before it is stale. `pearl_record_event` takes the name
  of the row's key column as an optional second argument (`training_steps` is keyed by `step`).

Frozen: this file is what revision 0003 means; the SQL is embedded here.

Revision ID: 0003_step_node_training_audit
Revises: 0002_policy_memory
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003_step_node_training_audit"
down_revision: str | None = "0002_policy_memory"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STEP_WORKER_NODE_FK = "fk_plan_steps_worker_id_node_id_workers"

# 0001's function with the key column as TG_ARGV[1] (default "id").
RECORD_EVENT = r"""
CREATE OR REPLACE FUNCTION pearl_record_event() RETURNS trigger LANGUAGE plpgsql AS $$
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
        row_id := to_jsonb(OLD) ->> coalesce(TG_ARGV[1], 'id');
    ELSE
        row_id := to_jsonb(NEW) ->> coalesce(TG_ARGV[1], 'id');
    END IF;
    INSERT INTO events (state_version, entity, entity_id, op, old, new, actor, reason)
    VALUES (coalesce(version, 0), TG_TABLE_NAME, row_id, lower(TG_OP),
            CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD) END,
            CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW) END,
            nullif(current_setting('pearl.actor', true), ''),
            nullif(current_setting('pearl.reason', true), ''));
    RETURN NULL;
END $$;
"""

# 0001's function as it was, for the downgrade.
RECORD_EVENT_0001 = r"""
CREATE OR REPLACE FUNCTION pearl_record_event() RETURNS trigger LANGUAGE plpgsql AS $$
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
"""

TRIGGERS = r"""
CREATE TRIGGER training_steps_lock_fleet BEFORE INSERT OR UPDATE OR DELETE ON training_steps
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_lock_fleet();
CREATE TRIGGER training_steps_events AFTER INSERT OR UPDATE OR DELETE ON training_steps
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('versioned', 'step');
"""


def upgrade() -> None:
    op.create_foreign_key(STEP_WORKER_NODE_FK, "plan_steps", "workers", ["worker_id", "node_id"], ["id", "node_id"],
                          ondelete="CASCADE")
    op.execute(RECORD_EVENT)
    op.execute(TRIGGERS)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS training_steps_events ON training_steps")
    op.execute("DROP TRIGGER IF EXISTS training_steps_lock_fleet ON training_steps")
    op.execute(RECORD_EVENT_0001)
    op.drop_constraint(STEP_WORKER_NODE_FK, "plan_steps", type_="foreignkey")
