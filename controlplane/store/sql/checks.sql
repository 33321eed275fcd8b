-- pearl's invariant checks (docs/state-machine.md), read by `pearlctl check`: each query returns one
-- row per violation it finds, with the columns entity, entity_id and detail. Every one is read-only
-- and can be run by hand in psql. The database's constraints and triggers already refuse most of
-- these; the checks find what got past them (a trigger disabled, a constraint dropped, a superuser's
-- write, a bug in a path the constraints do not cover) and what only the history shows.
-- Each starts with "-- name: <name>" and "-- invariant: <n>" (5: the audit log).

-- name: gpu_held_by_another_slot
-- invariant: 1
-- A GPU belongs to one worker slot for its lifetime and is held by that slot's worker or by none.
SELECT 'gpus' AS entity, g.id::text AS entity_id,
       format('GPU %s of slot %s is held by worker %s', g.id, g.slot_id, g.worker_id) AS detail
FROM gpus g
WHERE g.worker_id IS NOT NULL AND g.worker_id <> g.slot_id;

-- name: gpu_held_iff_in_use
-- invariant: 1
-- A GPU is held exactly while it is bound, borrowed or draining.
SELECT 'gpus' AS entity, g.id::text AS entity_id,
       format('GPU %s is %s and %s', g.id, g.state,
              CASE WHEN g.worker_id IS NULL THEN 'held by no worker' ELSE 'held by worker ' || g.worker_id END) AS detail
FROM gpus g
WHERE (g.worker_id IS NOT NULL) <> (g.state IN ('bound', 'borrowed', 'draining'));

-- name: serving_worker_holds_its_gpus
-- invariant: 1
-- An active worker holds every GPU of its slot, bound (dedicated) or borrowed (overlap); an inactive
-- one holds none.
SELECT 'workers' AS entity, w.id::text AS entity_id,
       format('worker %s is %s holding %s of its %s GPU(s) in use (%s)', w.id, w.activity,
              count(g.id) FILTER (WHERE g.worker_id = w.id AND g.state IN ('bound', 'borrowed')), count(g.id),
              string_agg(g.id || ':' || g.state, ', ' ORDER BY g.device_index)) AS detail
FROM workers w
JOIN gpus g ON g.slot_id = w.id
GROUP BY w.id, w.activity
HAVING (w.activity = 'active'
        AND count(g.id) FILTER (WHERE g.worker_id = w.id AND g.state IN ('bound', 'borrowed')) <> count(g.id))
    OR (w.activity = 'inactive' AND count(g.id) FILTER (WHERE g.worker_id = w.id) > 0);

-- name: training_beside_a_loan
-- invariant: 1
-- An overlap GPU runs training or a borrowed worker, never both: no borrow lease is open while an
-- optimizer step runs (over the whole history: the lease's interval against every step's).
SELECT 'leases' AS entity, l.id::text AS entity_id,
       format('GPU %s was borrowed from %s to %s while training step %s ran from %s to %s', l.gpu_id,
              l.granted_at, coalesce(l.returned_at::text, 'now'), t.step, t.started_at,
              coalesce(t.ended_at::text, 'now')) AS detail
FROM leases l
JOIN training_steps t ON t.started_at IS NOT NULL
    AND t.started_at < coalesce(l.returned_at, 'infinity')
    AND l.granted_at < coalesce(t.ended_at, 'infinity')
WHERE l.kind = 'borrowed';

-- name: training_began_before_its_gpus_were_back
-- invariant: 2
-- A training step starts only once every GPU borrowed for it is back.
SELECT 'training_steps' AS entity, t.step::text AS entity_id,
       format('training step %s started at %s but GPU %s (lease %s) came back %s', t.step, t.started_at,
              l.gpu_id, l.id, coalesce('at ' || l.returned_at, 'never')) AS detail
FROM training_steps t
JOIN leases l ON l.kind = 'borrowed' AND l.training_step = t.step
WHERE t.started_at IS NOT NULL AND (l.returned_at IS NULL OR l.returned_at > t.started_at);

-- name: lateness_recorded
-- invariant: 2
-- A borrowed GPU given back after the trainer asked for it records how late it was.
SELECT 'leases' AS entity, l.id::text AS entity_id,
       format('lease %s (GPU %s) came back %s s after its deadline but records late_s %s', l.id, l.gpu_id,
              round(extract(epoch FROM l.returned_at - l.deadline)::numeric, 3), coalesce(l.late_s::text, 'null'))
           AS detail
FROM leases l
WHERE l.kind = 'borrowed' AND l.returned_at IS NOT NULL AND l.deadline IS NOT NULL AND l.returned_at > l.deadline
  AND (l.late_s IS NULL OR l.late_s < extract(epoch FROM l.returned_at - l.deadline) - 0.001);

-- name: plan_applied_against_a_moved_state
-- invariant: 3
-- A plan starts applying only at the state_version it was computed against (the audit log holds the
-- fleet's version at the moment it did).
SELECT 'plans' AS entity, e.entity_id,
       format('plan %s was computed at state_version %s and began applying at %s (event %s)', e.entity_id,
              e.new ->> 'base_version', e.state_version, e.id) AS detail
FROM events e
WHERE e.entity = 'plans' AND e.new ->> 'status' = 'applying'
  AND (e.old IS NULL OR e.old ->> 'status' IS DISTINCT FROM 'applying')
  AND e.state_version <> (e.new ->> 'base_version')::bigint;

-- name: step_took_effect_twice
-- invariant: 4
-- A step succeeds at most once.
SELECT 'plan_steps' AS entity, e.entity_id,
       format('step %s (%s) succeeded %s times (events %s)', e.entity_id, min(e.new ->> 'key'), count(*),
              string_agg(e.id::text, ', ' ORDER BY e.id)) AS detail
FROM events e
WHERE e.entity = 'plan_steps' AND e.new ->> 'status' = 'succeeded'
  AND (e.old IS NULL OR e.old ->> 'status' IS DISTINCT FROM 'succeeded')
GROUP BY e.entity_id
HAVING count(*) > 1;

-- name: fence_went_down
-- invariant: 4
-- A worker is changed only under a fence at least as new as the last one that changed it.
SELECT 'workers' AS entity, e.entity_id,
       format('worker %s was changed under fence %s after fence %s (event %s)', e.entity_id,
              coalesce(e.new ->> 'last_fence', 'none'), e.old ->> 'last_fence', e.id) AS detail
FROM events e
WHERE e.entity = 'workers' AND e.op = 'update' AND e.old ->> 'last_fence' IS NOT NULL
  AND (e.new ->> 'last_fence' IS NULL OR (e.new ->> 'last_fence')::bigint < (e.old ->> 'last_fence')::bigint);

-- name: one_running_step_per_worker
-- invariant: 4
-- At most one step runs on a worker at a time, and a running step is claimed (fence and lease).
SELECT 'workers' AS entity, s.worker_id::text AS entity_id,
       format('worker %s has %s running step(s) (%s), %s of them unclaimed', s.worker_id, count(*),
              string_agg(s.key, ', ' ORDER BY s.id),
              count(*) FILTER (WHERE s.fence IS NULL OR s.lease_until IS NULL)) AS detail
FROM plan_steps s
WHERE s.status = 'running'
GROUP BY s.worker_id
HAVING count(*) > 1 OR count(*) FILTER (WHERE s.fence IS NULL OR s.lease_until IS NULL) > 0;

-- name: change_without_audit
-- invariant: 5
-- Every row of the state is as its latest audit event says (a write with the triggers disabled
-- leaves the row and the log apart; a row with no event was never audited). Only the columns the
-- log records are compared: those of the event (a column added later is not in older events), and
-- for steps and front doors the audited ones (lease renewals and heartbeats are not logged).
WITH audited(entity, entity_id, body, keys) AS (
    SELECT 'gpus', t.id::text, to_jsonb(t), NULL::text[] FROM gpus t
    UNION ALL SELECT 'workers', t.id::text, to_jsonb(t), NULL FROM workers t
    UNION ALL SELECT 'leases', t.id::text, to_jsonb(t), NULL FROM leases t
    UNION ALL SELECT 'nodes', t.id::text, to_jsonb(t), NULL FROM nodes t
    UNION ALL SELECT 'plans', t.id::text, to_jsonb(t), NULL FROM plans t
    UNION ALL SELECT 'training_steps', t.step::text, to_jsonb(t), NULL FROM training_steps t
    UNION ALL SELECT 'rollout_progress', t.step::text, to_jsonb(t), NULL FROM rollout_progress t
    UNION ALL SELECT 'weight_syncs', t.id::text, to_jsonb(t), NULL FROM weight_syncs t
    UNION ALL SELECT 'plan_steps', t.id::text, to_jsonb(t), ARRAY['status', 'fence', 'claimed_by', 'attempts', 'error']
    FROM plan_steps t
    UNION ALL SELECT 'routers', t.name, to_jsonb(t), ARRAY['url', 'admin_url', 'mode', 'stopped_at'] FROM routers t
)
SELECT a.entity, a.entity_id,
       CASE WHEN ev.id IS NULL THEN format('%s %s has no audit event', a.entity, a.entity_id)
            ELSE format('%s %s differs from its latest audit event %s in %s', a.entity, a.entity_id, ev.id,
                        (SELECT string_agg(k, ', ' ORDER BY k) FROM jsonb_object_keys(ev.new) AS k
                         WHERE (a.keys IS NULL OR k = ANY(a.keys)) AND ev.new -> k IS DISTINCT FROM a.body -> k))
       END AS detail
FROM audited a
LEFT JOIN LATERAL (
    SELECT e.id, e.new FROM events e
    WHERE e.entity = a.entity AND e.entity_id = a.entity_id
    ORDER BY e.id DESC LIMIT 1
) ev ON true
WHERE ev.id IS NULL OR ev.new IS NULL
   OR EXISTS (SELECT 1 FROM jsonb_object_keys(ev.new) AS k
              WHERE (a.keys IS NULL OR k = ANY(a.keys)) AND ev.new -> k IS DISTINCT FROM a.body -> k);

-- name: state_version_behind_the_log
-- invariant: 5
-- The fleet's state_version counts every change: never behind a version the log recorded.
SELECT 'fleet' AS entity, '1' AS entity_id,
       format('state_version is %s but event %s recorded %s', v.version, e.id, e.state_version) AS detail
FROM (SELECT pearl_state_version() AS version) v
JOIN LATERAL (SELECT id, state_version FROM events ORDER BY id DESC LIMIT 1) e ON true
WHERE v.version < e.state_version;

-- name: group_admitted_despite_a_failure
-- invariant: 6
-- An expansion group is admitted all-or-nothing: once a member's start or weight load (or the group's
-- barrier) failed, no member is admitted. The members are the workers whose admit is in the group.
SELECT 'plans' AS entity, g.plan_id::text AS entity_id,
       format('plan %s group %s: %s failed but %s admitted', g.plan_id, g.expansion_group, f.failed, a.admitted)
           AS detail
FROM (SELECT DISTINCT plan_id, expansion_group FROM plan_steps WHERE expansion_group IS NOT NULL) g
CROSS JOIN LATERAL (
    SELECT string_agg(s.key, ', ' ORDER BY s.id) AS failed FROM plan_steps s
    WHERE s.plan_id = g.plan_id AND s.status = 'failed' AND s.action IN ('start', 'load_weights', 'barrier')
      AND (s.expansion_group = g.expansion_group
           OR s.worker_id IN (SELECT m.worker_id FROM plan_steps m WHERE m.plan_id = g.plan_id
                              AND m.expansion_group = g.expansion_group AND m.action = 'admit'))
) f
CROSS JOIN LATERAL (
    SELECT string_agg(s.key, ', ' ORDER BY s.id) AS admitted FROM plan_steps s
    WHERE s.plan_id = g.plan_id AND s.expansion_group = g.expansion_group AND s.action = 'admit'
      AND s.status = 'succeeded'
) a
WHERE f.failed IS NOT NULL AND a.admitted IS NOT NULL;

-- name: revoked_gpu_released_in_time
-- invariant: 7
-- A preemptible GPU under a revocation notice is released before the notice runs out: none was still
-- in use when the provider took it (late_s > 0), and none is held past its deadline.
SELECT 'leases' AS entity, l.id::text AS entity_id,
       CASE WHEN l.returned_at IS NOT NULL
            THEN format('GPU %s was still in use %s s after its notice ran out at %s', l.gpu_id,
                        round(l.late_s::numeric, 3), l.deadline)
            ELSE format('GPU %s is %s by worker %s past its notice (it ran out at %s)', l.gpu_id, g.state,
                        g.worker_id, l.deadline)
       END AS detail
FROM leases l
JOIN gpus g ON g.id = l.gpu_id
WHERE l.kind = 'preemptible' AND l.deadline IS NOT NULL
  AND ((l.returned_at IS NOT NULL AND l.late_s > 0)
       OR (l.returned_at IS NULL AND l.deadline < pearl_now() AND g.worker_id IS NOT NULL));

-- name: weights_the_trainer_never_made
-- invariant: 4
-- A worker serves a weights version the trainer produced (or the initial 0).
SELECT 'workers' AS entity, w.id::text AS entity_id,
       format('worker %s has weights version %s; the newest the trainer produced is %s', w.id, w.weights_version,
              v.newest) AS detail
FROM workers w
CROSS JOIN (SELECT greatest(coalesce((SELECT max(weights_version) FROM training_steps), 0),
                            coalesce((SELECT max(version) FROM weight_snapshots), 0)) AS newest) v
WHERE w.weights_version > v.newest;
