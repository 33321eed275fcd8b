"""rollout progress: the trajectories in flight

- `rollout_progress.in_flight`: how many trajectories, of every batch, the rollout was running when
  it reported (null: not reported). With asynchronous batching the environment slots done with the
  step under way already run the next batch's trajectories; the policy reads this as the fleet's load.

Frozen: this file is what revision 0008 means.

Revision ID: 0008_in_flight
Revises: 0007_weight_sync
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_in_flight"
down_revision: str | None = "0007_weight_sync"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("rollout_progress", sa.Column("in_flight", sa.Integer(), nullable=True))
    op.create_check_constraint(op.f("ck_rollout_progress_in_flight_non_negative"), "rollout_progress",
                               "in_flight >= 0")


def downgrade() -> None:
    op.drop_constraint(op.f("ck_rollout_progress_in_flight_non_negative"), "rollout_progress", type_="check")
    op.drop_column("rollout_progress", "in_flight")
