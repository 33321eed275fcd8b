"""policy memory, profile provenance links, one telemetry row per step

- `policy_memory`: what a policy remembers between passes (its memory's `to_dict()`), one row per
  policy, so that any process can run the next pass.
- `profiles.based_on` / `profiles.telemetry_id`: a fitted profile names the profile it was refit
  from and the telemetry step it folded in (the history of a key is a chain of rows).
- `telemetry.step` unique: a step is folded into the profile once (a re-sent identical step is a
  no-op; a different body for a step already ingested is refused).
- `decisions.policy`: which policy decided.

Frozen: this file is what revision 0002 means.

Revision ID: 0002_policy_memory
Revises: 0001_initial
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002_policy_memory"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policy_memory",
        sa.Column("policy", sa.Text(), nullable=False),
        sa.Column("memory", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("decision_id", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["decision_id"], ["decisions.id"], name=op.f("fk_policy_memory_decision_id_decisions"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("policy", name=op.f("pk_policy_memory")),
    )
    op.add_column("profiles", sa.Column("based_on", sa.BigInteger(), nullable=True))
    op.add_column("profiles", sa.Column("telemetry_id", sa.BigInteger(), nullable=True))
    op.create_foreign_key(op.f("fk_profiles_based_on_profiles"), "profiles", "profiles", ["based_on"], ["id"],
                          ondelete="SET NULL")
    op.create_foreign_key(op.f("fk_profiles_telemetry_id_telemetry"), "profiles", "telemetry", ["telemetry_id"],
                          ["id"], ondelete="SET NULL")
    op.drop_index(op.f("ix_telemetry_step"), table_name="telemetry")
    op.create_index(op.f("ix_telemetry_step"), "telemetry", ["step"], unique=True)
    op.add_column("decisions", sa.Column("policy", sa.Text(), server_default=sa.text("''"), nullable=False))


def downgrade() -> None:
    op.drop_column("decisions", "policy")
    op.drop_index(op.f("ix_telemetry_step"), table_name="telemetry")
    op.create_index(op.f("ix_telemetry_step"), "telemetry", ["step"], unique=False)
    op.drop_constraint(op.f("fk_profiles_telemetry_id_telemetry"), "profiles", type_="foreignkey")
    op.drop_constraint(op.f("fk_profiles_based_on_profiles"), "profiles", type_="foreignkey")
    op.drop_column("profiles", "telemetry_id")
    op.drop_column("profiles", "based_on")
    op.drop_table("policy_memory")
