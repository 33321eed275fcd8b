"""borrow cycles that began with a cold start

`leases.cold_start`: the borrowed GPU's worker had no sleeping server to wake and launched one (its
first loan, or a colocated <-> split change). `borrow_cycles` says so per cycle: the policy's T_toggle
is the cost of a toggle (wake, load weights, return), so it folds in warm cycles only.

Frozen: this file is what revision 0006 means; the SQL is embedded here.

Revision ID: 0006_cold_borrows
Revises: 0005_live_signals
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_cold_borrows"
down_revision: str | None = "0005_live_signals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEW = r"""
CREATE VIEW borrow_cycles AS
SELECT g.slot_id AS worker_id, min(l.granted_at) AS granted_at, max(l.active_at) AS active_at,
       min(l.return_began_at) AS return_began_at, max(l.returned_at) AS returned_at,
       max(l.training_step) AS training_step, max(l.late_s) AS late_s, bool_or(l.cold_start) AS cold_start,
       extract(epoch FROM max(l.active_at) - min(l.granted_at))::double precision AS activation_s,
       extract(epoch FROM max(l.returned_at) - min(l.return_began_at))::double precision AS return_s
FROM leases l
JOIN gpus g ON g.id = l.gpu_id
WHERE l.kind = 'borrowed'
GROUP BY g.slot_id, l.granted_at;
"""

VIEW_0005 = r"""
CREATE VIEW borrow_cycles AS
SELECT g.slot_id AS worker_id, min(l.granted_at) AS granted_at, max(l.active_at) AS active_at,
       min(l.return_began_at) AS return_began_at, max(l.returned_at) AS returned_at,
       max(l.training_step) AS training_step, max(l.late_s) AS late_s,
       extract(epoch FROM max(l.active_at) - min(l.granted_at))::double precision AS activation_s,
       extract(epoch FROM max(l.returned_at) - min(l.return_began_at))::double precision AS return_s
FROM leases l
JOIN gpus g ON g.id = l.gpu_id
WHERE l.kind = 'borrowed'
GROUP BY g.slot_id, l.granted_at;
"""


def upgrade() -> None:
    op.add_column("leases", sa.Column("cold_start", sa.Boolean(), server_default=sa.text("false"), nullable=False))
    op.execute("DROP VIEW borrow_cycles")
    op.execute(VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW borrow_cycles")
    op.execute(VIEW_0005)
    op.drop_column("leases", "cold_start")
