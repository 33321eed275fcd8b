"""least privilege: a database role per component, an owner that is not a superuser, node-scoped agents

- Roles (cluster-wide, created when missing; `controlplane/store/roles.py` names them):
  `pearl_owner` (NOLOGIN) owns every table, view, sequence, type and function from here on;
  `pearl_policy` (the loop, tick, plan, apply, events, the weight-sync worker, the trainer) reads and
  writes the state but cannot alter it; `pearl_agent` (NOLOGIN) is the group of the per-node login
  roles (`node_roles` maps each to its node), which change their own node's rows only;
  `pearl_frontdoor` writes the routers' rows; `pearl_audit` only reads (not the control token).
- Nobody but the owner writes `events` or `fleet`: the triggers that do are SECURITY DEFINER, the
  fleet row is locked through `pearl_take_fleet()`, and `events.db_user` records the login role of
  every change (the `pearl.actor` setting is the caller's word; `db_user` is the database's).
- GPUs change only through `pearl_hold_slot`, `pearl_drain_held`, `pearl_free_held` and
  `pearl_start_training_if_returned` (SECURITY DEFINER): a role that may update `gpus` (policy) or an
  agent for the workers of its own node. An agent has no direct write on `gpus`.
- Triggers refuse an agent's change to another node's workers, agents or leases, its claim, renewal
  or report of another node's step (progression, the pending count, readiness, a cancellation after
  the plan stopped, stays allowed: the last report of a plan settles every node's steps), a plan it
  inserts that is not the cleanup of a failed one, and any change to a leader lease but giving up one
  its node's dead predecessor held. Only the owner may disable a trigger.

Frozen: this file is what revision 0012 means.

Revision ID: 0012_least_privilege
Revises: 0011_metrics_endpoints
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_least_privilege"
down_revision: str | None = "0011_metrics_endpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLES = r"""
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM (VALUES ('pearl_owner', false), ('pearl_policy', true), ('pearl_agent', false),
                                   ('pearl_frontdoor', true), ('pearl_audit', true)) AS v(name, login) LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r.name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I %s', r.name, CASE WHEN r.login THEN 'LOGIN' ELSE 'NOLOGIN' END);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database's migration created it at the same moment
            END;
        END IF;
    END LOOP;
    -- a migration runner that is not a superuser must be the owner to hand it the objects
    IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        EXECUTE format('GRANT pearl_owner TO %I', current_user);
    END IF;
END $$;
"""

# every object of this schema that pearl created goes to pearl_owner (so SECURITY DEFINER runs as it)
OWNERSHIP = r"""
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT c.relname, c.relkind FROM pg_class c
             WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'v', 'm', 'S', 'p')
               AND NOT (c.relkind = 'S' AND EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = c.oid
                                                     AND d.deptype IN ('a', 'i'))) LOOP
        EXECUTE format('ALTER %s %I OWNER TO %I',
                       CASE r.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                                      WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, r.relname, %(owner)L);
    END LOOP;
    FOR r IN SELECT t.typname FROM pg_type t WHERE t.typnamespace = current_schema()::regnamespace
                                               AND t.typtype = 'e' LOOP
        EXECUTE format('ALTER TYPE %I OWNER TO %I', r.typname, %(owner)L);
    END LOOP;
    FOR r IN SELECT p.oid::regprocedure AS f FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'pearl\_%' LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO %I', r.f, %(owner)L);
    END LOOP;
END $$;
"""

FUNCTIONS = r"""
-- the writers of events and of the fleet row run as the owner
ALTER FUNCTION pearl_lock_fleet() SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION pearl_record_event() SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION pearl_record_step_inserts() SECURITY DEFINER SET search_path FROM CURRENT;

CREATE FUNCTION pearl_take_fleet() RETURNS bigint LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
    -- the fleet row for the rest of the caller's transaction: every state writer queues here first
    SELECT state_version FROM fleet WHERE id = 1 FOR UPDATE
$$;

CREATE FUNCTION pearl_caller_node() RETURNS integer LANGUAGE sql STABLE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
    -- the node whose agent this login is (NULL for every other role)
    SELECT node_id FROM node_roles WHERE role_name = session_user
$$;

CREATE FUNCTION pearl_agent_scope(node integer, what text) RETURNS void LANGUAGE plpgsql STABLE AS $$
DECLARE
    caller integer := pearl_caller_node();
BEGIN
    IF caller IS NOT NULL AND node IS DISTINCT FROM caller THEN
        RAISE EXCEPTION 'the agent of node % (role %) cannot change % of node %', caller, session_user, what, node
            USING ERRCODE = '42501';
    END IF;
END $$;

CREATE FUNCTION pearl_may_change_gpus(w integer) RETURNS void LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
BEGIN
    IF pearl_caller_node() IS NULL THEN
        IF NOT has_table_privilege(session_user, 'gpus', 'UPDATE') THEN
            RAISE EXCEPTION 'role % cannot change GPUs', session_user USING ERRCODE = '42501';
        END IF;
    ELSE
        PERFORM pearl_agent_scope((SELECT node_id FROM workers WHERE id = w), format('the GPUs of worker %s', w));
    END IF;
END $$;

CREATE FUNCTION pearl_hold_slot(w integer, hold gpu_state) RETURNS integer LANGUAGE plpgsql VOLATILE
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    n integer;
BEGIN
    -- a start: the free GPUs of the worker's slot become held by it (bound, or borrowed if overlap)
    PERFORM pearl_may_change_gpus(w);
    IF hold NOT IN ('bound', 'borrowed') THEN
        RAISE EXCEPTION 'a worker holds its GPUs bound or borrowed, not %', hold USING ERRCODE = '22023';
    END IF;
    UPDATE gpus SET state = hold, worker_id = w WHERE slot_id = w AND state = 'free' AND worker_id IS NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

CREATE FUNCTION pearl_drain_held(w integer) RETURNS integer LANGUAGE plpgsql VOLATILE
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    n integer;
BEGIN
    PERFORM pearl_may_change_gpus(w);
    UPDATE gpus SET state = 'draining' WHERE worker_id = w AND state IN ('bound', 'borrowed');
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

CREATE FUNCTION pearl_free_held(w integer) RETURNS integer LANGUAGE plpgsql VOLATILE
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    n integer;
BEGIN
    PERFORM pearl_may_change_gpus(w);
    IF EXISTS (SELECT 1 FROM gpus WHERE worker_id = w AND state <> 'draining') THEN
        RAISE EXCEPTION 'worker %: its GPUs are not all draining', w USING ERRCODE = '22023';
    END IF;
    UPDATE gpus SET state = 'free', worker_id = NULL WHERE worker_id = w;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

CREATE FUNCTION pearl_start_training_if_returned() RETURNS integer LANGUAGE plpgsql VOLATILE
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
    PERFORM pearl_take_fleet();
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

CREATE FUNCTION pearl_control_token_matches(offered text) RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path FROM CURRENT AS $$
    -- for readers that check the token without being able to read it (the audit role's dashboard)
    SELECT coalesce((SELECT value = offered FROM control_secrets WHERE name = 'control'), false)
$$;

-- node scope of an agent's writes
CREATE FUNCTION pearl_guard_node_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pearl_agent_scope(OLD.node_id, format('%s %s', TG_TABLE_NAME, OLD.id));
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pearl_agent_scope(NEW.node_id, format('%s %s', TG_TABLE_NAME, NEW.id));
        RETURN NEW;
    END IF;
    RETURN OLD;
END $$;

CREATE FUNCTION pearl_guard_lease_rows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r leases%ROWTYPE;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    PERFORM pearl_agent_scope((SELECT node_id FROM gpus WHERE id = r.gpu_id), format('the lease of GPU %s', r.gpu_id));
    IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_guard_agent_step() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    caller integer := pearl_caller_node();
BEGIN
    -- an agent claims, renews, reports and fails its own node's steps only; the progression of
    -- another node's steps (pending, ready, a barrier's success, cancelled once the plan stopped) is the
    -- protocol's and stays allowed
    IF caller IS NULL OR OLD.node_id = caller THEN
        RETURN NEW;
    END IF;
    IF NEW.fence IS DISTINCT FROM OLD.fence OR NEW.claimed_by IS DISTINCT FROM OLD.claimed_by
       OR NEW.lease_until IS DISTINCT FROM OLD.lease_until OR NEW.attempts IS DISTINCT FROM OLD.attempts
       OR NEW.node_id IS DISTINCT FROM OLD.node_id OR NEW.worker_id IS DISTINCT FROM OLD.worker_id
       OR NEW.args IS DISTINCT FROM OLD.args OR NEW.action IS DISTINCT FROM OLD.action
       OR (NEW.status IS DISTINCT FROM OLD.status AND NOT (
             (OLD.status = 'blocked' AND NEW.status = 'ready')
             OR (OLD.status = 'blocked' AND NEW.status = 'succeeded' AND OLD.action = 'barrier')
             OR (NEW.status = 'cancelled' AND (SELECT status FROM plans WHERE id = OLD.plan_id) <> 'applying')))
    THEN
        RAISE EXCEPTION 'the agent of node % (role %) cannot claim, renew or report step % of node %',
            caller, session_user, OLD.key, OLD.node_id USING ERRCODE = '42501';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_guard_agent_plan() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF pearl_caller_node() IS NOT NULL AND NEW.cleans_up IS NULL THEN
        RAISE EXCEPTION 'an agent (role %) writes only the cleanup plan of a failed plan', session_user
            USING ERRCODE = '42501';
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION pearl_guard_agent_step_inserts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF pearl_caller_node() IS NOT NULL AND EXISTS (
        SELECT 1 FROM new_rows n JOIN plans p ON p.id = n.plan_id WHERE p.cleans_up IS NULL) THEN
        RAISE EXCEPTION 'an agent (role %) adds steps only to the cleanup plan of a failed plan', session_user
            USING ERRCODE = '42501';
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION pearl_guard_agent_leadership() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- an agent gives up the reaper's leadership a predecessor on its node held, known gone (agents'
    -- holders are named host:pid:node), and takes none
    IF OLD.name <> 'reaper' OR NEW.name IS DISTINCT FROM OLD.name OR NEW.holder IS DISTINCT FROM OLD.holder
       OR NEW.expires_at > OLD.expires_at
       OR OLD.holder NOT LIKE '%:' || (SELECT name FROM nodes WHERE id = pearl_caller_node()) THEN
        RAISE EXCEPTION 'the agent of node % (role %) may only give up leadership its node held',
            pearl_caller_node(), session_user USING ERRCODE = '42501';
    END IF;
    RETURN NEW;
END $$;

-- the guards fire for agents' logins only (every node role is named pearl_agent_...): other writers pay nothing
CREATE TRIGGER workers_node_scope BEFORE INSERT OR UPDATE OR DELETE ON workers
    FOR EACH ROW WHEN (session_user::text LIKE 'pearl\_agent\_%') EXECUTE FUNCTION pearl_guard_node_rows();
CREATE TRIGGER agents_node_scope BEFORE INSERT OR UPDATE OR DELETE ON agents
    FOR EACH ROW WHEN (session_user::text LIKE 'pearl\_agent\_%') EXECUTE FUNCTION pearl_guard_node_rows();
CREATE TRIGGER leases_node_scope BEFORE INSERT OR UPDATE OR DELETE ON leases
    FOR EACH ROW WHEN (session_user::text LIKE 'pearl\_agent\_%') EXECUTE FUNCTION pearl_guard_lease_rows();
CREATE TRIGGER plan_steps_node_scope BEFORE UPDATE ON plan_steps
    FOR EACH ROW WHEN (session_user::text LIKE 'pearl\_agent\_%') EXECUTE FUNCTION pearl_guard_agent_step();
CREATE TRIGGER leader_leases_agent_scope BEFORE UPDATE ON leader_leases
    FOR EACH ROW WHEN (session_user::text LIKE 'pearl\_agent\_%') EXECUTE FUNCTION pearl_guard_agent_leadership();
CREATE TRIGGER plans_agent_inserts BEFORE INSERT ON plans
    FOR EACH ROW WHEN (session_user::text LIKE 'pearl\_agent\_%') EXECUTE FUNCTION pearl_guard_agent_plan();
CREATE TRIGGER plan_steps_agent_inserts AFTER INSERT ON plan_steps REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT WHEN (session_user::text LIKE 'pearl\_agent\_%')
    EXECUTE FUNCTION pearl_guard_agent_step_inserts();
"""

MUTATORS = ("pearl_take_fleet()", "pearl_hold_slot(integer, gpu_state)", "pearl_drain_held(integer)",
            "pearl_free_held(integer)", "pearl_start_training_if_returned()")

# the policy role writes every table but these (the fleet row and the inventory are the importer's)
ALL_TABLES_BUT = ("fleet events control_secrets alembic_version node_roles gpu_transitions worker_transitions "
                  "plan_transitions step_transitions").split()

GRANTS = r"""
REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM PUBLIC;
GRANT USAGE ON SCHEMA {schema} TO pearl_policy, pearl_agent, pearl_frontdoor, pearl_audit;
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO pearl_policy, pearl_agent, pearl_frontdoor, pearl_audit;
REVOKE SELECT ON control_secrets FROM pearl_audit;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO pearl_policy, pearl_agent, pearl_frontdoor;
{revoke_mutators}
{grant_mutators}
-- the policy side: the state, not its shape, its audit or its version
GRANT INSERT, UPDATE, DELETE ON {policy_tables} TO pearl_policy;
-- an agent: its node's rows (the triggers above), the protocol's progression, a cleanup plan
GRANT UPDATE ON workers, plan_steps, plans TO pearl_agent;
GRANT INSERT, UPDATE ON leases, agents, weight_syncs TO pearl_agent;
GRANT INSERT ON plans, plan_steps, plan_step_deps TO pearl_agent;
GRANT UPDATE (mode) ON routers TO pearl_agent;
GRANT UPDATE (expires_at) ON leader_leases TO pearl_agent;
GRANT INSERT, UPDATE, DELETE ON metrics_endpoints TO pearl_agent, pearl_frontdoor, pearl_policy;
-- the front door: its own rows
GRANT INSERT, UPDATE, DELETE ON routers TO pearl_frontdoor;
"""


def _schema() -> str:
    return op.get_bind().scalar(sa.text("SELECT current_schema()"))


def upgrade() -> None:
    op.create_table(
        "node_roles",
        sa.Column("role_name", sa.Text(), primary_key=True),
        sa.Column("node_id", sa.Integer(), sa.ForeignKey("nodes.id", ondelete="CASCADE"), nullable=False,
                  unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
    )
    op.add_column("events", sa.Column("db_user", sa.Text(), server_default=sa.text("session_user"), nullable=False))
    op.execute(ROLES)
    op.execute(FUNCTIONS)
    op.execute(OWNERSHIP.replace("%(owner)L", "'pearl_owner'"))
    bind = op.get_bind()
    tables = bind.scalars(sa.text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")).all()
    policy_tables = ", ".join(sorted(t for t in tables if t not in ALL_TABLES_BUT))
    op.execute(GRANTS.format(
        schema=_schema(), policy_tables=policy_tables,
        revoke_mutators="\n".join(f"REVOKE EXECUTE ON FUNCTION {f} FROM PUBLIC;" for f in MUTATORS),
        grant_mutators="\n".join(f"GRANT EXECUTE ON FUNCTION {f} TO pearl_policy, pearl_agent;" for f in MUTATORS)))


def downgrade() -> None:
    bind = op.get_bind()
    me = bind.scalar(sa.text("SELECT current_user"))
    op.execute(f"""
        REVOKE ALL ON ALL TABLES IN SCHEMA {_schema()} FROM pearl_policy, pearl_agent, pearl_frontdoor, pearl_audit;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA {_schema()} FROM pearl_policy, pearl_agent, pearl_frontdoor;
        REVOKE ALL ON SCHEMA {_schema()} FROM pearl_policy, pearl_agent, pearl_frontdoor, pearl_audit;
    """)
    op.execute(OWNERSHIP.replace("%(owner)L", "'" + me.replace("'", "''") + "'"))
    for trigger, table in (("workers_node_scope", "workers"), ("agents_node_scope", "agents"),
                           ("leases_node_scope", "leases"), ("plan_steps_node_scope", "plan_steps"),
                           ("plans_agent_inserts", "plans"), ("plan_steps_agent_inserts", "plan_steps"),
                           ("leader_leases_agent_scope", "leader_leases")):
        op.execute(f"DROP TRIGGER {trigger} ON {table}")
    for fn in ("pearl_guard_agent_leadership()", "pearl_guard_agent_step_inserts()", "pearl_guard_agent_plan()",
               "pearl_guard_agent_step()",
               "pearl_guard_lease_rows()", "pearl_guard_node_rows()", "pearl_control_token_matches(text)",
               "pearl_start_training_if_returned()", "pearl_free_held(integer)", "pearl_drain_held(integer)",
               "pearl_hold_slot(integer, gpu_state)", "pearl_may_change_gpus(integer)",
               "pearl_agent_scope(integer, text)", "pearl_caller_node()", "pearl_take_fleet()"):
        op.execute(f"DROP FUNCTION {fn}")
    for fn in ("pearl_lock_fleet()", "pearl_record_event()", "pearl_record_step_inserts()"):
        op.execute(f"ALTER FUNCTION {fn} SECURITY INVOKER RESET search_path")
    op.drop_column("events", "db_user")
    op.drop_table("node_roles")
