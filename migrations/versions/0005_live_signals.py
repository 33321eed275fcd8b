"""live signals: rollout progress, training steps validated, borrow cycles measured, wake-ups

- `rollout_progress`: how many trajectories of each rollout step have finished (the live R of the
  borrowing gate). A step's batch size never changes and its count never goes down (PX005).
- `training_steps`: checked like any event, raw SQL included: the step and its weights version are
  >= 0, its times are in order, and a new step starts only after every earlier one ended, numbered
  above them (PX005).
- `leases.active_at` / `leases.return_began_at`: when a borrowed GPU's worker was admitted and when
  its return (drain) began, so each borrow cycle's activation and return are measured (`borrow_cycles`).
- NOTIFY `pearl_signals` (payload: the table) when the trainer, the rollout or the provider reports
  something: the policy loop wakes on it.

Frozen: this file is what revision 0005 means; the SQL is embedded here.

Revision ID: 0005_live_signals
Revises: 0004_step_protocol
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_live_signals"
down_revision: str | None = "0004_step_protocol"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTIONS = r"""
CREATE FUNCTION pearl_guard_progress() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.batch_size IS DISTINCT FROM OLD.batch_size THEN
        RAISE EXCEPTION 'batch_size: rollout step % has % trajectories, not %', OLD.step, OLD.batch_size,
            NEW.batch_size USING ERRCODE = 'PX005';
    END IF;
    IF NEW.finished < OLD.finished THEN
        RAISE EXCEPTION 'finished: rollout step % had % trajectories finished; the count never goes down (got %)',
            OLD.step, OLD.finished, NEW.finished USING ERRCODE = 'PX005';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_guard_training_step() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    open_step bigint;
    last_step bigint;
BEGIN
    SELECT max(step) INTO last_step FROM training_steps;
    IF last_step IS NOT NULL AND NEW.step <= last_step THEN
        RAISE EXCEPTION 'step: training step % is not after step %, the latest', NEW.step, last_step
            USING ERRCODE = 'PX005';
    END IF;
    SELECT step INTO open_step FROM training_steps WHERE ended_at IS NULL ORDER BY step LIMIT 1;
    IF open_step IS NOT NULL THEN
        RAISE EXCEPTION 'step: training step % cannot begin while step % has not ended', NEW.step, open_step
            USING ERRCODE = 'PX005';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_notify_signal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pearl_signals', TG_TABLE_NAME);
    RETURN NULL;
END $$;
"""

TRIGGERS = r"""
CREATE TRIGGER rollout_progress_guard BEFORE UPDATE ON rollout_progress
    FOR EACH ROW EXECUTE FUNCTION pearl_guard_progress();
CREATE TRIGGER training_steps_guard BEFORE INSERT ON training_steps
    FOR EACH ROW EXECUTE FUNCTION pearl_guard_training_step();
CREATE TRIGGER rollout_progress_events AFTER INSERT OR UPDATE OR DELETE ON rollout_progress
    FOR EACH ROW EXECUTE FUNCTION pearl_record_event('audited', 'step');
CREATE TRIGGER rollout_progress_notify AFTER INSERT OR UPDATE ON rollout_progress
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_notify_signal();
CREATE TRIGGER training_steps_notify AFTER INSERT OR UPDATE ON training_steps
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_notify_signal();
CREATE TRIGGER telemetry_notify AFTER INSERT ON telemetry
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_notify_signal();
CREATE TRIGGER leases_notify AFTER INSERT OR UPDATE OF deadline ON leases
    FOR EACH STATEMENT EXECUTE FUNCTION pearl_notify_signal();
"""

VIEWS = r"""
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
    op.create_table(
        "rollout_progress",
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("finished", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("began_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("step >= 0", name=op.f("ck_rollout_progress_step_non_negative")),
        sa.CheckConstraint("batch_size > 0", name=op.f("ck_rollout_progress_batch_size_positive")),
        sa.CheckConstraint("finished >= 0 AND finished <= batch_size",
                           name=op.f("ck_rollout_progress_finished_within_batch")),
        sa.PrimaryKeyConstraint("step", name=op.f("pk_rollout_progress")),
    )
    op.add_column("leases", sa.Column("active_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("leases", sa.Column("return_began_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(op.f("ck_training_steps_step_non_negative"), "training_steps", "step >= 0")
    op.create_check_constraint(op.f("ck_training_steps_weights_version_non_negative"), "training_steps",
                               "weights_version IS NULL OR weights_version >= 0")
    op.create_check_constraint(op.f("ck_training_steps_times_in_order"), "training_steps",
                               "(started_at IS NULL OR requested_at IS NULL OR started_at >= requested_at) "
                               "AND (ended_at IS NULL OR started_at IS NULL OR ended_at >= started_at)")
    op.execute(FUNCTIONS)
    op.execute(TRIGGERS)
    op.execute(VIEWS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS borrow_cycles")
    for trigger, table in (("leases_notify", "leases"), ("telemetry_notify", "telemetry"),
                           ("training_steps_notify", "training_steps"), ("rollout_progress_notify", "rollout_progress"),
                           ("rollout_progress_events", "rollout_progress"), ("training_steps_guard", "training_steps"),
                           ("rollout_progress_guard", "rollout_progress")):
        op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {table}")
    for function in ("pearl_notify_signal()", "pearl_guard_training_step()", "pearl_guard_progress()"):
        op.execute(f"DROP FUNCTION IF EXISTS {function}")
    for name in ("ck_training_steps_times_in_order", "ck_training_steps_weights_version_non_negative",
                 "ck_training_steps_step_non_negative"):
        op.drop_constraint(op.f(name), "training_steps", type_="check")
    op.drop_column("leases", "return_began_at")
    op.drop_column("leases", "active_at")
    op.drop_table("rollout_progress")
