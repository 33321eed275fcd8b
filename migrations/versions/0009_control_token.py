"""the control token: what authenticates pearl's commands to servers and to the front door's admin API

- `control_secrets`: named secrets, one row `control` made here (64 hex digits from two
  `gen_random_uuid()`, PostgreSQL's strong random source). Servers are launched with it as SGLang's
  `--admin-api-key`; every command pearl sends carries it as a bearer token. `PEARL_TOKEN_FILE`
  overrides it for processes that read it from a file instead.

Frozen: this file is what revision 0009 means.

Revision ID: 0009_control_token
Revises: 0008_in_flight
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_control_token"
down_revision: str | None = "0008_in_flight"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "control_secrets",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("length(value) >= 32", name=op.f("ck_control_secrets_long_enough")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_control_secrets")),
    )
    op.execute("INSERT INTO control_secrets (name, value) VALUES ('control', "
               "replace(gen_random_uuid()::text, '-', '') || replace(gen_random_uuid()::text, '-', ''))")


def downgrade() -> None:
    op.drop_table("control_secrets")
