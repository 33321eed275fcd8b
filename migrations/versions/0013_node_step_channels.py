"""a step channel per node: `pearl_steps_<node id>` instead of the one `pearl_steps`

A ready step wakes the agent of its node only. On one channel every listening agent received every
node's notifications (a 4,096-GPU switch: 256 agents x 12,290 wake-ups a plan, each read, compared
with the agent's own node and dropped); on a channel of its own each agent hears its own steps. The
payload stays the node id. Barriers still wake nobody.

Frozen: this file is what revision 0013 means.

Revision ID: 0013_node_step_channels
Revises: 0012_least_privilege
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0013_node_step_channels"
down_revision: str | None = "0012_least_privilege"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NOTIFY = r"""
CREATE OR REPLACE FUNCTION pearl_notify_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.action <> 'barrier' THEN
        PERFORM pg_notify('{channel}', NEW.node_id::text);
    END IF;
    RETURN NULL;
END $$;
"""


def upgrade() -> None:
    op.execute(NOTIFY.format(channel="pearl_steps_' || NEW.node_id::text || '"))


def downgrade() -> None:
    op.execute(NOTIFY.format(channel="pearl_steps"))
