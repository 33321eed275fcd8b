-- pearl's named queries: the SQL the agents and the plan store run, readable and runnable by hand.
-- Each starts with "-- name: <name>"; parameters are :name (in psql: \set node_id 3, and so on).

-- name: claim_steps
-- Claim up to :limit ready steps of one node for one agent, in one statement: each gets a lease
-- until pearl_now() + :lease_s seconds (the database's clock) and a fresh fencing token. SKIP LOCKED
-- lets claimers pass each other; at most one step per worker is taken (and the unique index keeps one
-- running step per worker). Only steps of the applying plan, whose row is read under a key-share
-- lock: a plan being failed or aborted at this moment (its row locked FOR UPDATE) is skipped, and its
-- steps are cancelled, never run; a report in progress (FOR NO KEY UPDATE) is passed, not skipped.
-- Barriers are never claimed (they succeed in the database). Nor are the steps of :busy workers, those
-- the agent is still at work on (a thread of a lapsed claim, the server watch): they wait their turn
-- without holding back the other workers' steps. An agent that a newer agent of its node replaced
-- (it was silent that long) claims nothing: it stops at its next heartbeat.
WITH clock AS (SELECT pearl_now() AS now),
ready AS (
    SELECT s.id, row_number() OVER (PARTITION BY s.worker_id ORDER BY s.plan_id, s.id) AS nth
    FROM plan_steps s
    JOIN plans p ON p.id = s.plan_id AND p.status = 'applying'  -- a step left ready elsewhere blocks nothing
    WHERE s.node_id = :node_id AND s.status = 'ready' AND s.action <> 'barrier'
      AND NOT EXISTS (SELECT 1 FROM plan_steps r WHERE r.worker_id = s.worker_id AND r.status = 'running')
      AND NOT (s.worker_id = ANY(CAST(:busy AS bigint[])))
      AND NOT EXISTS (SELECT 1 FROM agents b WHERE b.node_id = :node_id AND b.id > :agent_id AND b.stopped_at IS NULL)
), c AS (
    SELECT s.id
    FROM plan_steps s
    JOIN ready ON ready.id = s.id AND ready.nth = 1
    JOIN plans p ON p.id = s.plan_id
    WHERE s.status = 'ready' AND p.status = 'applying'  -- re-checked on the latest row versions once locked
    ORDER BY s.plan_id, s.id
    LIMIT :limit
    FOR UPDATE OF s SKIP LOCKED
    FOR KEY SHARE OF p SKIP LOCKED
)
UPDATE plan_steps s
SET status = 'running',
    fence = nextval('plan_step_fence'),
    claimed_by = :agent_id,
    claimed_at = clock.now,
    lease_until = clock.now + make_interval(secs => :lease_s),
    attempts = s.attempts + 1,
    started_at = coalesce(s.started_at, clock.now),
    error = NULL
FROM c, clock
WHERE s.id = c.id
RETURNING s.*;

-- name: renew_step_lease
-- Extend the claim of a running step; nothing happens unless the caller still holds that claim.
-- Returns the plan's status: an agent whose plan stopped applying (failed, aborted) stops the step
-- and reports it cancelled.
UPDATE plan_steps s
SET lease_until = pearl_now() + make_interval(secs => :lease_s)
FROM plans p
WHERE s.id = :step_id AND s.fence = :fence AND s.status = 'running' AND p.id = s.plan_id
RETURNING s.id, s.lease_until, p.status AS plan_status;

-- name: claimed_step
-- The step an effect is written for, locked, only while the caller's claim holds (running under
-- :fence), with its plan's status. Run it holding the step's node (`transitions.lock_node`) or the
-- whole fleet: a plan fails only under the whole fleet, so not between this check and the commit.
-- The plan row is not locked: the reports of one plan lock it only to finish it.
SELECT s.id, s.plan_id, s.key, s.worker_id, s.node_id, s.action, s.args, s.expansion_group, s.fence,
       p.status AS plan_status
FROM plan_steps s
JOIN plans p ON p.id = s.plan_id
WHERE s.id = :step_id AND s.fence = :fence AND s.status = 'running'
FOR UPDATE OF s;

-- name: claim_state
-- What a command to a server is checked against (agents/steps.py, `StepContext.guard`): whether the
-- caller's claim still holds (the step runs under :fence, its lease not expired, no newer claim
-- changed the worker) and whether its plan still applies. No lock: a check, not a write.
SELECT (s.fence = :fence AND s.status = 'running' AND s.lease_until > pearl_now()
        AND COALESCE(w.last_fence, 0) <= :fence) AS claim_holds,
       p.status = 'applying' AS plan_applies
FROM plan_steps s
JOIN plans p ON p.id = s.plan_id
JOIN workers w ON w.id = s.worker_id
WHERE s.id = :step_id;

-- name: finish_step
-- The fenced compare-and-set an agent reports with: succeeded, failed or cancelled, only under its
-- own claim.
UPDATE plan_steps
SET status = CAST(:status AS step_status), error = :error, finished_at = pearl_now(), lease_until = NULL
WHERE id = :step_id AND fence = :fence AND status = 'running'
RETURNING id, plan_id, status;

-- name: hand_back_step
-- An agent that stops (SIGTERM) gives back a step it holds, for another claim; the attempt is not
-- counted (every action is idempotent, so the next claim redoes what is missing). A step whose plan
-- stopped applying meanwhile (failed, aborted) is cancelled instead, as a rescue would: nothing of
-- that plan may run again, and its cleanup plan takes the worker over. Run it holding the step's
-- node (`transitions.lock_node`): a plan fails only under the whole fleet, so a plan failing at this
-- moment is waited for and then seen.
UPDATE plan_steps s
SET status = CASE WHEN p.status = 'applying' THEN CAST('ready' AS step_status)
                  ELSE CAST('cancelled' AS step_status) END,
    claimed_by = NULL, lease_until = NULL, attempts = greatest(s.attempts - 1, 0),
    finished_at = CASE WHEN p.status = 'applying' THEN NULL ELSE pearl_now() END,
    error = 'handed back by its agent'
            || CASE WHEN p.status = 'applying' THEN '' ELSE '; its plan is no longer applying' END
FROM (SELECT p.id, p.status FROM plans p JOIN plan_steps t ON t.plan_id = p.id
      WHERE t.id = :step_id) p
WHERE s.id = :step_id AND s.fence = :fence AND s.status = 'running' AND p.id = s.plan_id
RETURNING s.id, s.status;

-- name: release_dependents
-- A step succeeded: every step waiting for it has one unfinished dependency fewer. Touches only its
-- dependents (plan_step_deps is indexed by after_id).
UPDATE plan_steps s
SET pending = s.pending - 1
FROM plan_step_deps d
WHERE d.after_id = :step_id AND s.id = d.step_id AND s.status = 'blocked'
RETURNING s.id, s.key, s.action, s.pending;

-- name: rescue_expired_steps
-- Running steps whose claim lease ran out (their agent stopped heartbeating): back to ready for
-- another claim, or failed once :max_attempts claims have expired; cancelled when their plan is no
-- longer applying (it failed meanwhile: nothing of it may run again). The old fence stays, so a late
-- report from the lost claim changes nothing. The plan row is read under a share lock (skipped while
-- another transaction changes it, so a plan failing at this moment sees the rescued step and cancels it).
WITH clock AS (SELECT pearl_now() AS now),
expired AS (
    SELECT s.id, p.status = 'applying' AS live
    FROM plan_steps s
    JOIN plans p ON p.id = s.plan_id
    WHERE s.status = 'running' AND s.lease_until < (SELECT now FROM clock)
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
    finished_at = CASE WHEN NOT expired.live OR s.attempts >= :max_attempts THEN clock.now END,
    error = 'claim expired (attempt ' || s.attempts || ')'
            || CASE WHEN expired.live THEN '' ELSE '; its plan is no longer applying' END
FROM expired, clock
WHERE s.id = expired.id
RETURNING s.id, s.plan_id, s.status, s.attempts;

-- name: stop_silent_agents
-- Mark stopped the agents that have not heartbeaten for :timeout_s seconds and did not say they
-- stopped; returns them. One statement: a heartbeat committing meanwhile (it holds the row) is seen
-- when the row is re-read under its lock, and that agent is left alone.
UPDATE agents SET stopped_at = pearl_now()
WHERE stopped_at IS NULL AND heartbeat_at < pearl_now() - make_interval(secs => :timeout_s)
RETURNING id, node_id;

-- name: hold_leader_lease
-- Take or renew the leadership :name for :ttl_s seconds: granted when nobody holds it, when its
-- lease ran out, or when :holder holds it already. Returns a row only when :holder leads.
INSERT INTO leader_leases AS l (name, holder, acquired_at, expires_at)
VALUES (:name, :holder, pearl_now(), pearl_now() + make_interval(secs => :ttl_s))
ON CONFLICT (name) DO UPDATE
SET holder = EXCLUDED.holder,
    acquired_at = CASE WHEN l.holder = EXCLUDED.holder THEN l.acquired_at ELSE EXCLUDED.acquired_at END,
    expires_at = EXCLUDED.expires_at
WHERE l.holder = EXCLUDED.holder OR l.expires_at < pearl_now()
RETURNING holder, acquired_at, expires_at;

-- name: gpu_state_by_zone
SELECT zone, state, gpus FROM gpu_state_by_zone ORDER BY zone, state;

-- name: recent_transitions
-- The last :limit changes of GPU states, worker roles and activities, and plan and step statuses.
SELECT event_id, at, state_version, entity, entity_id, field, old_value, new_value, actor, reason
FROM transitions
WHERE field IN ('state', 'role', 'activity', 'status')
ORDER BY event_id DESC
LIMIT :limit;

-- name: run_summary
-- What a run of the live system did: plans applied, weight syncs (a sync task brought a serving
-- worker's server to a new version: done, and loaded, not found there already), borrowed GPUs given back and how many of those came back late, training steps and their delay.
SELECT
    (SELECT count(*) FROM plans WHERE applied_at IS NOT NULL) AS plans_applied,
    (SELECT count(*) FROM plans WHERE applied_at IS NOT NULL AND cleans_up IS NOT NULL) AS cleanup_plans,
    (SELECT count(*) FROM plans WHERE status = 'failed') AS plans_failed,
    (SELECT count(*) FROM weight_syncs WHERE state = 'done' AND method IN ('snapshot', 'broadcast')) AS weight_syncs,
    (SELECT count(*) FROM borrow_cycles WHERE returned_at IS NOT NULL) AS borrowed_returns,
    (SELECT count(*) FROM borrow_cycles WHERE returned_at IS NOT NULL AND late_s > 0) AS late_returns,
    (SELECT count(*) FROM training_steps WHERE ended_at IS NOT NULL) AS training_steps,
    (SELECT coalesce(sum(late_s), 0) FROM training_steps) AS training_delay_s,
    (SELECT count(*) FROM leases WHERE kind = 'preemptible' AND late_s > 0) AS late_revocations;
