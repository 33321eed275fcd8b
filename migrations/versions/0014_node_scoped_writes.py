"""writers of different nodes no longer wait for each other: the version from a sequence, the fleet
lock a table lock that node-scoped writers share and whole-fleet ones take alone

Before, every state writer queued on the one `fleet` row (`pearl_take_fleet()`, and each versioned
change bumped `fleet.state_version` under that row's lock), so 256 agents reporting steps of
different nodes ran one at a time. Now:

- `state_version` is the sequence `fleet_versions`: every change of a GPU, worker, lease or training
  step takes the next value for its event (the column `fleet.state_version` is gone; read
  `pearl_state_version()`, the last value taken). Aborted writers leave gaps.
- The fleet lock is the table lock of `fleet_lock` (a table that holds no row). Whole-fleet writers
  (applies, aborts, the reaper, signals, imports) and a decision's snapshot take it EXCLUSIVE: no
  writer is in flight then, so every version up to `pearl_state_version()` is committed, and a plan
  computed at that version is stale exactly when a later one was taken. A table lock, not an advisory
  one, because LOCK TABLE takes no snapshot: taken first in a REPEATABLE READ transaction, the
  snapshot follows it. `pearl_take_node(n)` takes it ROW EXCLUSIVE plus node n's advisory lock
  (7502, n): the writes an agent makes for its node's steps (effects, reports, hand-backs) wait for
  whole-fleet writers and for the writers of the same node only. The statement triggers on gpus,
  workers and leases take ROW EXCLUSIVE, so no writer runs beside a whole-fleet one. `pearl_take_fleet()`
  is gone.
- Training starts once no training GPU is borrowed or draining: a check across nodes, made under its
  own lock (7501, 1) taken after the caller's writes, so of two releases on different nodes the second
  sees the first's GPUs free.

Frozen: this file is what revision 0014 means.

Revision ID: 0014_node_scoped_writes
Revises: 0013_node_step_channels
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0014_node_scoped_writes"
down_revision: str | None = "0013_node_step_channels"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the event of a change: versioned tables take the next version, the others record the last one
RECORD_EVENT = r"""
CREATE OR REPLACE FUNCTION pearl_record_event() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
DECLARE
    version bigint;
    row_id text;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW IS NOT DISTINCT FROM OLD THEN
        RETURN NULL;
    END IF;
    IF TG_ARGV[0] = 'versioned' THEN
        {next_version};
    ELSE
        version := {last_version};
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

CREATE OR REPLACE FUNCTION pearl_record_step_inserts() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO events (state_version, entity, entity_id, op, old, new, actor, reason)
    SELECT coalesce({last_version}, 0), TG_TABLE_NAME, n.id::text, 'insert',
           NULL, to_jsonb(n), nullif(current_setting('pearl.actor', true), ''),
           nullif(current_setting('pearl.reason', true), '')
    FROM new_rows n ORDER BY n.id;
    RETURN NULL;
END $$;
"""

LOCK_FLEET_TRIGGER = r"""
CREATE OR REPLACE FUNCTION pearl_lock_fleet() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
BEGIN
    {lock};
    RETURN NULL;
END $$;
"""

TRAINING_START = r"""
CREATE OR REPLACE FUNCTION pearl_start_training_if_returned() RETURNS integer LANGUAGE plpgsql VOLATILE
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    waiting training_steps%ROWTYPE;
    now_ timestamptz := pearl_now();
    late double precision;
BEGIN
    -- the requested training step starts once no training GPU is borrowed or draining; its number
    IF pearl_caller_node() IS NULL AND NOT has_table_privilege(session_user, 'gpus', 'UPDATE') THEN
        RAISE EXCEPTION 'role % cannot start training', session_user USING ERRCODE = '42501';
    END IF;
    {training_lock};
    SELECT * INTO waiting FROM training_steps
    WHERE requested_at IS NOT NULL AND started_at IS NULL AND ended_at IS NULL ORDER BY step DESC LIMIT 1;
    IF NOT FOUND OR EXISTS (SELECT 1 FROM gpus WHERE zone = 'training' AND state IN ('borrowed', 'draining')) THEN
        RETURN NULL;
    END IF;
    SELECT coalesce(max(late_s), 0) INTO late FROM leases WHERE training_step = waiting.step;
    UPDATE training_steps SET started_at = now_,
           late_s = CASE WHEN late > 0 THEN extract(epoch FROM now_ - waiting.requested_at) ELSE 0 END
    WHERE step = waiting.step;
    UPDATE gpus SET state = 'training' WHERE zone = 'training' AND state = 'free' AND worker_id IS NULL;
    RETURN waiting.step;
END $$;
"""

UPGRADE = r"""
CREATE SEQUENCE fleet_versions MINVALUE 0 START 0;
SELECT setval('fleet_versions', (SELECT state_version FROM fleet WHERE id = 1), true);
ALTER TABLE fleet DROP COLUMN state_version;
ALTER SEQUENCE fleet_versions OWNER TO pearl_owner;
CREATE TABLE fleet_lock (nothing boolean CHECK (false));
COMMENT ON TABLE fleet_lock IS 'never a row: its table lock is the fleet lock (EXCLUSIVE: the whole fleet; '
    'ROW EXCLUSIVE: a node-scoped writer)';
ALTER TABLE fleet_lock OWNER TO pearl_owner;
REVOKE ALL ON fleet_lock FROM PUBLIC;
-- UPDATE lets a role take any lock mode on it (an agent fails a plan under the whole fleet)
GRANT UPDATE ON fleet_lock TO pearl_policy, pearl_agent;
GRANT SELECT ON fleet_lock TO pearl_audit, pearl_frontdoor;

CREATE FUNCTION pearl_state_version() RETURNS bigint LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
    -- the last version taken (a writer still in flight may hold it: exact under the whole fleet)
    SELECT last_value FROM fleet_versions
$$;
ALTER FUNCTION pearl_state_version() OWNER TO pearl_owner;

CREATE FUNCTION pearl_take_node(node integer) RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
BEGIN
    -- a writer of node `node` only: beside the writers of other nodes, never beside a whole-fleet one
    LOCK TABLE fleet_lock IN ROW EXCLUSIVE MODE;
    PERFORM pg_advisory_xact_lock(7502, node);
END $$;
ALTER FUNCTION pearl_take_node(integer) OWNER TO pearl_owner;
REVOKE EXECUTE ON FUNCTION pearl_take_node(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pearl_take_node(integer) TO pearl_policy, pearl_agent;
DROP FUNCTION pearl_take_fleet();
"""

DOWNGRADE = r"""
DROP FUNCTION pearl_take_node(integer);
DROP FUNCTION pearl_state_version();
DROP TABLE fleet_lock;
ALTER TABLE fleet ADD COLUMN state_version bigint NOT NULL DEFAULT 0;
UPDATE fleet SET state_version = (SELECT last_value FROM fleet_versions);
DROP SEQUENCE fleet_versions;
CREATE FUNCTION pearl_take_fleet() RETURNS bigint LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
    -- the fleet row for the rest of the caller's transaction: every state writer queues here first
    SELECT state_version FROM fleet WHERE id = 1 FOR UPDATE
$$;
ALTER FUNCTION pearl_take_fleet() OWNER TO pearl_owner;
REVOKE EXECUTE ON FUNCTION pearl_take_fleet() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pearl_take_fleet() TO pearl_policy, pearl_agent;
"""


def upgrade() -> None:
    op.execute(UPGRADE)
    op.execute(RECORD_EVENT.format(next_version="version := nextval('fleet_versions')",
                                   last_version="(SELECT last_value FROM fleet_versions)"))
    op.execute(LOCK_FLEET_TRIGGER.format(lock="LOCK TABLE fleet_lock IN ROW EXCLUSIVE MODE"))
    op.execute(TRAINING_START.format(training_lock="PERFORM pg_advisory_xact_lock(7501, 1)"))


def downgrade() -> None:
    op.execute(DOWNGRADE)
    op.execute(RECORD_EVENT.format(
        next_version="UPDATE fleet SET state_version = state_version + 1 WHERE id = 1 "
                     "RETURNING state_version INTO version",
        last_version="(SELECT state_version FROM fleet WHERE id = 1)"))
    op.execute(LOCK_FLEET_TRIGGER.format(lock="PERFORM 1 FROM fleet WHERE id = 1 FOR UPDATE"))
    op.execute(TRAINING_START.format(training_lock="PERFORM pearl_take_fleet()"))
