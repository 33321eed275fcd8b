"""where each live pearl process answers Prometheus's scrapes

- `metrics_endpoints`: one row per process that serves `/metrics` (`--metrics-port`): its component
  (agent, loop, frontdoor, worker), its node (agents and weight-sync workers; NULL for the others),
  the URL, and the host and PID that identify the process. The process heartbeats its row while it
  runs and deletes it when it stops; a row silent for long (a SIGKILL) is not listed and is pruned by
  the next registration. Not fleet state: neither audited nor counted in `state_version`.

Frozen: this file is what revision 0011 means.

Revision ID: 0011_metrics_endpoints
Revises: 0010_step_insert_audit
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_metrics_endpoints"
down_revision: str | None = "0010_step_insert_audit"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "metrics_endpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("component", sa.Text(), nullable=False),
        sa.Column("node", sa.Text(), nullable=True),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("pearl_now()"), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), server_default=sa.text("pearl_now()"), nullable=False),
        sa.CheckConstraint("component IN ('agent', 'loop', 'frontdoor', 'worker')",
                           name=op.f("ck_metrics_endpoints_known_component")),
        sa.CheckConstraint("url ~ '^https?://[^/?#]+/metrics$'", name=op.f("ck_metrics_endpoints_metrics_url")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metrics_endpoints")),
        sa.UniqueConstraint("host", "pid", "component", name=op.f("uq_metrics_endpoints_host_pid_component")),
    )


def downgrade() -> None:
    op.drop_table("metrics_endpoints")
