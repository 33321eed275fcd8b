"""What `pearlctl dashboard` shows, read from the rows and the SQL views in one REPEATABLE READ
transaction (one state of the fleet), as one JSON-ready dict:

- `state_version`, `read_at` (the database's clock), `cluster` (model, gpu, tp) and `mode` (the front
  door's, null without one);
- `nodes` [{`name`, `zone`, `gpus` [{`id`, `device`, `state`, `worker`, `lease`}]}]: the GPU grid
  (`gpu_detail`), by node name and device index; `gpu_states` (state -> count);
- `workers` [{`id`, `node`, `slot`, `zone`, `role`, `activity`, `weights_version`, `endpoint`}]: the
  first `WORKERS` not inactive; `worker_counts` (role -> activity -> count) and `workers_total` cover all;
- `plan`: the applying plan, else the newest one, with up to `STEPS` of its steps (`plan_timeline`;
  those running, then the latest to finish, then the rest, shown in the order they started): key,
  action, worker, node, status, attempts, the agent that holds or last held its claim, when it started,
  how long it ran (`seconds`; null while it runs), error; `plan.steps_by_status` and
  `plan.steps_total` count them all;
- `decisions`: the newest `DECISIONS` with their predicted makespans (current and target) and the
  measured makespan of the rollout step they were made in (`rollout_progress`), in model seconds as
  the predictions are (wall seconds times the inventory's `time_scale`, 1 on a real cluster);
- `borrow_cycles`: the newest `CYCLES` loans of training GPUs (`borrow_cycles`) with the deadline
  they had to be back by and their lateness;
- `preemptible`: the newest `GRANTS` grants of preemptible GPUs, with their notice deadline and when
  each came back.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pearl.controlplane.store.db import transaction
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

WORKERS = 300
STEPS = 400
DECISIONS = 20
CYCLES = 20
GRANTS = 40

_GPUS = """
SELECT d.node, n.zone::text AS zone, d.gpu_id AS id, d.device_index AS device, d.state::text AS state,
       d.worker_id AS worker, d.lease_kind::text AS lease
FROM gpu_detail d JOIN nodes n ON n.name = d.node
ORDER BY d.node, d.device_index
"""
_WORKERS = """
SELECT w.id, n.name AS node, w.slot, w.zone::text AS zone, w.role::text AS role, w.activity::text AS activity,
       w.weights_version, w.endpoint
FROM workers w JOIN nodes n ON n.id = w.node_id
WHERE w.activity <> 'inactive'
ORDER BY w.id LIMIT :n
"""
_WORKER_COUNTS = "SELECT role::text AS role, activity::text AS activity, count(*) AS n FROM workers GROUP BY 1, 2"
_STEP_COUNTS = "SELECT status::text AS status, count(*) AS n FROM plan_steps WHERE plan_id = :plan GROUP BY 1"
_PLAN = """
SELECT id FROM plans ORDER BY (status = 'applying') DESC, id DESC LIMIT 1
"""
_STEPS = """
SELECT t.plan_id, t.plan_status::text AS plan_status, t.created_at, t.applied_at, t.plan_finished_at,
       t.step_id, t.key, t.action::text AS action, t.worker_id, t.node, t.status::text AS status, t.attempts,
       t.started_at, t.finished_at, t.seconds, t.error, a.host AS agent_host, a.pid AS agent_pid
FROM plan_timeline t
LEFT JOIN plan_steps s ON s.id = t.step_id
LEFT JOIN agents a ON a.id = s.claimed_by
WHERE t.plan_id = :plan
ORDER BY (t.status = 'running') DESC, t.finished_at DESC NULLS LAST, t.step_id
LIMIT :n
"""
_DECISIONS = """
SELECT d.id, d.created_at, d.policy, d.target ->> 'mode' AS mode, d.reason,
       d.predicted_current_s, d.predicted_target_s, r.step AS rollout_step,
       extract(epoch FROM r.ended_at - r.began_at)::double precision
           * coalesce((SELECT (inventory ->> 'time_scale')::double precision FROM fleet WHERE id = 1), 1) AS measured_s
FROM decisions d
LEFT JOIN LATERAL (SELECT step, began_at, ended_at FROM rollout_progress
                   WHERE began_at <= d.created_at ORDER BY step DESC LIMIT 1) r ON true
ORDER BY d.id DESC LIMIT :n
"""
_CYCLES = """
SELECT c.worker_id, c.training_step, c.granted_at, c.active_at, c.return_began_at, c.returned_at, c.late_s,
       c.cold_start, (SELECT max(l.deadline) FROM leases l JOIN gpus g ON g.id = l.gpu_id
                      WHERE l.kind = 'borrowed' AND g.slot_id = c.worker_id AND l.granted_at = c.granted_at)
           AS deadline
FROM borrow_cycles c
ORDER BY c.granted_at DESC LIMIT :n
"""
_GRANTS = """
SELECT n.name AS node, g.device_index AS device, l.granted_at, l.deadline, l.returned_at, l.late_s
FROM leases l JOIN gpus g ON g.id = l.gpu_id JOIN nodes n ON n.id = g.node_id
WHERE l.kind = 'preemptible'
ORDER BY l.granted_at DESC, n.name, g.device_index LIMIT :n
"""


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _rows(session: Session, sql: str, **params: Any) -> list[dict[str, Any]]:
    return [{k: _iso(v) for k, v in r.items()} for r in session.execute(text(sql), params).mappings()]


def _plan(session: Session) -> dict[str, Any] | None:
    plan_id = session.scalar(text(_PLAN))
    if plan_id is None:
        return None
    head = session.execute(text(
        "SELECT status::text AS plan_status, created_at, applied_at, finished_at AS plan_finished_at FROM plans "
        "WHERE id = :plan"), {"plan": plan_id}).mappings().one()
    rows = sorted(_rows(session, _STEPS, plan=plan_id, n=STEPS),
                  key=lambda r: (r["started_at"] is None, r["started_at"] or "", r["step_id"] or 0))
    counts = {r.status: int(r.n) for r in session.execute(text(_STEP_COUNTS), {"plan": plan_id})}
    steps = [{"id": r["step_id"], "key": r["key"], "action": r["action"], "worker": r["worker_id"], "node": r["node"],
              "status": r["status"], "attempts": r["attempts"],
              "agent": f"{r['agent_host']}:{r['agent_pid']}" if r["agent_pid"] is not None else None,
              "started_at": r["started_at"], "finished_at": r["finished_at"], "seconds": r["seconds"],
              "error": r["error"]} for r in rows if r["step_id"] is not None]
    return {"id": plan_id, "status": head["plan_status"], "created_at": _iso(head["created_at"]),
            "applied_at": _iso(head["applied_at"]), "finished_at": _iso(head["plan_finished_at"]), "steps": steps,
            "steps_total": sum(counts.values()), "steps_by_status": dict(sorted(counts.items()))}


def dashboard_state(session: Session) -> dict[str, Any]:
    head = session.execute(text(
        "SELECT pearl_state_version() AS state_version, f.model, f.gpu, f.tp, pearl_now() AS read_at, "
        "(SELECT mode FROM routers WHERE name = 'default') AS mode FROM fleet f WHERE f.id = 1")).mappings().first()
    nodes: dict[str, dict[str, Any]] = {}
    for g in _rows(session, _GPUS):
        node = nodes.setdefault(g["node"], {"name": g["node"], "zone": g["zone"], "gpus": []})
        node["gpus"].append({k: g[k] for k in ("id", "device", "state", "worker", "lease")})
    states = Counter(g["state"] for n in nodes.values() for g in n["gpus"])
    worker_counts: dict[str, dict[str, int]] = {}
    for r in session.execute(text(_WORKER_COUNTS)):
        worker_counts.setdefault(r.role, {})[r.activity] = int(r.n)
    return {
        "state_version": head["state_version"] if head else 0,
        "read_at": _iso(head["read_at"]) if head else None,
        "cluster": {"model": head["model"], "gpu": head["gpu"], "tp": head["tp"]} if head else None,
        "mode": head["mode"] if head else None,
        "nodes": list(nodes.values()),
        "gpu_states": dict(sorted(states.items())),
        "workers": _rows(session, _WORKERS, n=WORKERS),
        "worker_counts": worker_counts,
        "workers_total": sum(n for by in worker_counts.values() for n in by.values()),
        "plan": _plan(session),
        "decisions": _rows(session, _DECISIONS, n=DECISIONS),
        "borrow_cycles": _rows(session, _CYCLES, n=CYCLES),
        "preemptible": _rows(session, _GRANTS, n=GRANTS),
    }


def read_dashboard_state(engine: Engine) -> dict[str, Any]:
    with transaction(engine, isolation_level="REPEATABLE READ") as session:
        return dashboard_state(session)
