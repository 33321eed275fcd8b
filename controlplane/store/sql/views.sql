-- pearl's views for audit and analysis. Run any of them in psql, e.g.
--   SELECT * FROM gpu_state_by_zone;
-- Migrations create these views from their own frozen copy; this file is the current definition.

-- How many GPUs are in each state, per zone.
CREATE OR REPLACE VIEW gpu_state_by_zone AS
SELECT g.zone, g.state, count(*)::integer AS gpus
FROM gpus g
GROUP BY g.zone, g.state;

-- Every GPU with its node, slot, holder and open lease.
CREATE OR REPLACE VIEW gpu_detail AS
SELECT g.id AS gpu_id, n.name AS node, g.device_index, g.zone, g.state, g.slot_id, g.worker_id,
       l.id AS lease_id, l.kind AS lease_kind, l.granted_at, l.deadline
FROM gpus g
JOIN nodes n ON n.id = g.node_id
LEFT JOIN leases l ON l.gpu_id = g.id AND l.returned_at IS NULL;

-- Each change of a worker's role or activity (and its creation), from the audit log.
CREATE OR REPLACE VIEW worker_roles_history AS
SELECT e.id AS event_id, e.at, e.state_version, e.entity_id::integer AS worker_id,
       (e.new ->> 'node_id')::integer AS node_id, e.new ->> 'zone' AS zone,
       e.old ->> 'role' AS old_role, e.new ->> 'role' AS role,
       e.old ->> 'activity' AS old_activity, e.new ->> 'activity' AS activity,
       (e.new ->> 'weights_version')::bigint AS weights_version, e.actor, e.reason
FROM events e
WHERE e.entity = 'workers'
  AND (e.op = 'insert'
       OR (e.op = 'update' AND (e.old ->> 'role' IS DISTINCT FROM e.new ->> 'role'
                                OR e.old ->> 'activity' IS DISTINCT FROM e.new ->> 'activity')));

-- Plans and their steps, in order, with how long each step ran.
CREATE OR REPLACE VIEW plan_timeline AS
SELECT p.id AS plan_id, p.status AS plan_status, p.base_version, p.d_worker, p.d_role,
       p.created_at, p.applied_at, p.finished_at AS plan_finished_at,
       s.id AS step_id, s.key, s.action, s.worker_id, n.name AS node, s.expansion_group, s.depends_on,
       s.status, s.attempts, s.started_at, s.finished_at,
       extract(epoch FROM s.finished_at - s.started_at)::double precision AS seconds, s.error
FROM plans p
LEFT JOIN plan_steps s ON s.plan_id = p.id
LEFT JOIN nodes n ON n.id = s.node_id;

-- The audit log flattened: one row per changed field of every update, one per insert or delete.
CREATE OR REPLACE VIEW transitions AS
SELECT e.id AS event_id, e.at, e.state_version, e.entity, e.entity_id, e.op,
       f.key AS field, e.old ->> f.key AS old_value, f.value #>> '{}' AS new_value, e.actor, e.reason
FROM events e
CROSS JOIN LATERAL jsonb_each(e.new) AS f(key, value)
WHERE e.op = 'update' AND (e.old -> f.key) IS DISTINCT FROM f.value
UNION ALL
SELECT e.id, e.at, e.state_version, e.entity, e.entity_id, e.op, NULL, NULL, NULL, e.actor, e.reason
FROM events e
WHERE e.op <> 'update';
