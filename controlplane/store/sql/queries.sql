-- pearl's named queries: the SQL the agents and the plan store run, readable and runnable by hand.
-- Each starts with "-- name: <name>"; parameters are :name (in psql: \set node_id 3, and so on).

-- name: claim_steps
-- Claim up to :limit ready steps of one node for one agent, in one statement: each gets a lease
-- until :now + :lease_s seconds and a fresh fencing token. SKIP LOCKED lets claimers pass each other;
-- at most one step per worker is taken (and the unique index keeps one running step per worker).
-- Only steps of the applying plan: a failed, stale or superseded plan's steps never run.
WITH ready AS (
    SELECT s.id, row_number() OVER (PARTITION BY s.worker_id ORDER BY s.plan_id, s.id) AS nth
    FROM plan_steps s
    WHERE s.node_id = :node_id AND s.status = 'ready'
      AND EXISTS (SELECT 1 FROM plans p WHERE p.id = s.plan_id AND p.status = 'applying')
      AND NOT EXISTS (SELECT 1 FROM plan_steps r WHERE r.worker_id = s.worker_id AND r.status = 'running')
), c AS (
    SELECT s.id
    FROM plan_steps s
    JOIN ready ON ready.id = s.id AND ready.nth = 1
    WHERE s.status = 'ready'  -- re-checked on the latest row version once locked: a step just claimed is skipped
    ORDER BY s.plan_id, s.id
    LIMIT :limit
    FOR UPDATE OF s SKIP LOCKED
)
UPDATE plan_steps s
SET status = 'running',
    fence = nextval('plan_step_fence'),
    claimed_by = :agent_id,
    claimed_at = :now,
    lease_until = :now + make_interval(secs => :lease_s),
    attempts = s.attempts + 1,
    started_at = coalesce(s.started_at, :now),
    error = NULL
FROM c
WHERE s.id = c.id
RETURNING s.*;

-- name: renew_step_lease
-- Extend the claim of a running step; nothing happens unless the caller still holds that claim.
UPDATE plan_steps
SET lease_until = :now + make_interval(secs => :lease_s)
WHERE id = :step_id AND fence = :fence AND status = 'running'
RETURNING id, lease_until;

-- name: finish_step
-- The fenced compare-and-set an agent reports with: succeeded or failed, only under its own claim.
UPDATE plan_steps
SET status = CAST(:status AS step_status), error = :error, finished_at = :now, lease_until = NULL
WHERE id = :step_id AND fence = :fence AND status = 'running'
RETURNING id, status;

-- name: rescue_expired_steps
-- Running steps whose claim lease ran out (their agent stopped heartbeating): back to ready for
-- another claim, or failed once :max_attempts claims have expired; cancelled when their plan is no
-- longer applying (it failed meanwhile: nothing of it may run again). The old fence stays, so a late
-- report from the lost claim changes nothing. The plan row is read under a share lock (skipped while
-- another transaction changes it, so a plan failing at this moment sees the rescued step and cancels it).
WITH expired AS (
    SELECT s.id, p.status = 'applying' AS live
    FROM plan_steps s
    JOIN plans p ON p.id = s.plan_id
    WHERE s.status = 'running' AND s.lease_until < :now
    ORDER BY s.id
    FOR UPDATE OF s SKIP LOCKED
    FOR SHARE OF p SKIP LOCKED
)
UPDATE plan_steps s
SET status = CASE WHEN NOT expired.live THEN CAST('cancelled' AS step_status)
                  WHEN s.attempts >= :max_attempts THEN CAST('failed' AS step_status)
                  ELSE CAST('ready' AS step_status) END,
    claimed_by = NULL,
    lease_until = NULL,
    finished_at = CASE WHEN NOT expired.live OR s.attempts >= :max_attempts THEN :now END,
    error = 'claim expired (attempt ' || s.attempts || ')'
            || CASE WHEN expired.live THEN '' ELSE '; its plan is no longer applying' END
FROM expired
WHERE s.id = expired.id
RETURNING s.id, s.status, s.attempts;

-- name: silent_agents
-- Agents that have not heartbeaten for :timeout_s seconds and did not say they stopped.
SELECT a.id, n.name AS node, a.host, a.pid, a.heartbeat_at
FROM agents a
JOIN nodes n ON n.id = a.node_id
WHERE a.stopped_at IS NULL AND a.heartbeat_at < :now - make_interval(secs => :timeout_s)
ORDER BY a.id;

-- name: gpu_state_by_zone
SELECT zone, state, gpus FROM gpu_state_by_zone ORDER BY zone, state;

-- name: recent_transitions
-- The last :limit changes of GPU states, worker roles and activities, and plan and step statuses.
SELECT event_id, at, state_version, entity, entity_id, field, old_value, new_value, actor, reason
FROM transitions
WHERE field IN ('state', 'role', 'activity', 'status')
ORDER BY event_id DESC
LIMIT :limit;
