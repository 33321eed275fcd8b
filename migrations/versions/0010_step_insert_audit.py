"""the audit of new plan steps, one statement per plan: a plan's steps are written in bulk (COPY), and
their `insert` events with them by one statement-level trigger over the inserted rows, instead of one
trigger call per step (a 4,096-GPU switch is 12,290 steps). The events are those the row trigger
wrote (the fleet's state_version, the table, the step id, `insert`, the row, the actor and reason),
in the order of the step ids. Updates and deletes are audited row by row as before.

Frozen: this file is what revision 0010 means.

Revision ID: 0010_step_insert_audit
Revises: 0009_control_token
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010_step_insert_audit"
down_revision: str | None = "0009_control_token"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = r"""
CREATE FUNCTION pearl_record_step_inserts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (state_version, entity, entity_id, op, old, new, actor, reason)
    SELECT coalesce((SELECT state_version FROM fleet WHERE id = 1), 0), TG_TABLE_NAME, n.id::text, 'insert',
           NULL, to_jsonb(n), nullif(current_setting('pearl.actor', true), ''),
           nullif(current_setting('pearl.reason', true), '')
    FROM new_rows n ORDER BY n.id;
    RETURN NULL;
END $$;
DROP TRIGGER plan_steps_events ON plan_steps;
CREATE TRIGGER plan_steps_events AFTER DELETE OR UPDATE OF status, fence, claimed_by, attempts, error
    ON plan_steps FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited');
CREATE TRIGGER plan_steps_insert_events AFTER INSERT ON plan_steps REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_record_step_inserts();
"""

DOWNGRADE = r"""
DROP TRIGGER plan_steps_insert_events ON plan_steps;
DROP TRIGGER plan_steps_events ON plan_steps;
CREATE TRIGGER plan_steps_events AFTER INSERT OR DELETE OR UPDATE OF status, fence, claimed_by, attempts, error
    ON plan_steps FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited');
DROP FUNCTION pearl_record_step_inserts();
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
