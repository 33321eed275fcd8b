"""weight snapshots and weight syncs

- `weight_snapshots`: each weights version the trainer produced, with where its files are and its
  manifest (tensor names, dtypes, shapes, sha256); the payload stays outside the database.
- `weight_syncs`: bringing one worker to one version, one row per (worker, version): its state
  (queued, running, done, failed, superseded), attempts, times and error. Audited in `events`
  (the snapshots are not: a manifest can be large, and a snapshot row never changes).

Frozen: this file is what revision 0007 means.

Revision ID: 0007_weight_sync
Revises: 0006_cold_borrows
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007_weight_sync"
down_revision: str | None = "0006_cold_borrows"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "weight_snapshots",
        sa.Column("version", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("manifest", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("tensors", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.Text(), nullable=False),
        sa.Column("registered_at", TS, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("version > 0", name=op.f("ck_weight_snapshots_version_positive")),
        sa.CheckConstraint("tensors >= 0 AND bytes >= 0", name=op.f("ck_weight_snapshots_sizes_non_negative")),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_weight_snapshots")),
    )
    op.create_table(
        "weight_syncs",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("worker_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.Text(), server_default=sa.text("'queued'"), nullable=False),
        sa.Column("method", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("enqueued_at", TS, server_default=sa.text("now()"), nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint("state IN ('queued', 'running', 'done', 'failed', 'superseded')",
                           name=op.f("ck_weight_syncs_state_known")),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_weight_syncs_attempts_non_negative")),
        sa.CheckConstraint("(state IN ('done', 'failed', 'superseded')) = (finished_at IS NOT NULL)",
                           name=op.f("ck_weight_syncs_finished_iff_final")),
        sa.ForeignKeyConstraint(["version"], ["weight_snapshots.version"], ondelete="CASCADE",
                                name=op.f("fk_weight_syncs_version_weight_snapshots")),
        sa.ForeignKeyConstraint(["worker_id"], ["workers.id"], ondelete="CASCADE",
                                name=op.f("fk_weight_syncs_worker_id_workers")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_weight_syncs")),
        sa.UniqueConstraint("worker_id", "version", name=op.f("uq_weight_syncs_worker_id_version")),
    )
    op.execute("CREATE TRIGGER weight_syncs_events AFTER INSERT OR UPDATE OR DELETE ON weight_syncs "
               "FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited')")


def downgrade() -> None:
    op.drop_table("weight_syncs")
    op.drop_table("weight_snapshots")
