"""Prometheus collectors over the database: the fleet as its rows have it, read at each scrape.

`FleetCollector` is what the policy loop exports besides its own series: GPUs by zone and state,
workers by role and activity, plans by status and how long finished ones applied, steps of applying
plans by status, borrow returns and their lateness, the weight syncs and how far workers lag the
trainer, and the last decision's predicted makespan beside the last rollout step's measured one. Read
in one REPEATABLE READ transaction (one state), so the series of a scrape agree with each other and
with `pearlctl status`. Every process that serves metrics also exports the database errors it met
(`DatabaseErrorsCollector`, from `db.DATABASE_ERRORS`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from pearl.controlplane.core.domain import Activity, PlanStatus, Role, StepStatus
from pearl.controlplane.store import db
from pearl.controlplane.store.db import transaction
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, text

log = logging.getLogger("pearl.metrics")
PLAN_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
SYNC_STATES = ("queued", "running", "done", "failed", "superseded")
# the states a GPU of each zone may be in (the gpus table's `state_fits_zone` check): each is a series,
# 0 when no GPU is in it
GPU_STATES = {
    "training": ("free", "training", "borrowed", "draining", "lost"),
    "rollout": ("free", "bound", "draining", "lost"),
    "preemptible": ("unavailable", "free", "bound", "draining", "revoked", "lost"),
}

_COUNTS = {
    "gpus": "SELECT zone::text AS a, state::text AS b, count(*) AS n FROM gpus GROUP BY 1, 2",
    "workers": "SELECT role::text AS a, activity::text AS b, count(*) AS n FROM workers GROUP BY 1, 2",
    "plans": "SELECT status::text AS a, '' AS b, count(*) AS n FROM plans GROUP BY 1",
    "steps": "SELECT s.status::text AS a, '' AS b, count(*) AS n FROM plan_steps s JOIN plans p ON p.id = s.plan_id "
             "WHERE p.status = 'applying' GROUP BY 1",
    "syncs": "SELECT state AS a, '' AS b, count(*) AS n FROM weight_syncs GROUP BY 1",
}
_PLAN_DURATIONS = ("SELECT status::text AS status, extract(epoch FROM finished_at - applied_at) AS d FROM plans "
                   "WHERE status IN ('succeeded', 'failed') AND applied_at IS NOT NULL AND finished_at IS NOT NULL")
_SCALARS = """
SELECT
  (SELECT count(*) FROM leases WHERE kind = 'borrowed' AND returned_at IS NOT NULL AND coalesce(late_s, 0) <= 0)
      AS borrow_on_time,
  (SELECT count(*) FROM leases WHERE kind = 'borrowed' AND returned_at IS NOT NULL AND late_s > 0) AS borrow_late,
  (SELECT coalesce(sum(late_s), 0) FROM leases WHERE kind = 'borrowed' AND returned_at IS NOT NULL) AS borrow_late_s,
  (SELECT count(*) FROM leases WHERE kind = 'borrowed' AND returned_at IS NULL) AS borrowed_now,
  (SELECT count(*) FROM leases WHERE kind = 'preemptible' AND returned_at IS NULL) AS preemptible_now,
  (SELECT max(weights_version) FROM training_steps) AS trainer_version,
  (SELECT max((SELECT max(weights_version) FROM training_steps) - weights_version) FROM workers
     WHERE activity = 'active' AND weights_version IS NOT NULL) AS lag_max,
  (SELECT predicted_current_s FROM decisions WHERE predicted_current_s IS NOT NULL ORDER BY id DESC LIMIT 1)
      AS predicted_current_s,
  (SELECT predicted_target_s FROM decisions WHERE predicted_target_s IS NOT NULL ORDER BY id DESC LIMIT 1)
      AS predicted_target_s,
  (SELECT extract(epoch FROM ended_at - began_at)
           * coalesce((SELECT (inventory ->> 'time_scale')::double precision FROM fleet WHERE id = 1), 1)
   FROM rollout_progress WHERE ended_at IS NOT NULL ORDER BY step DESC LIMIT 1) AS measured_s
"""


def _pairs(rows: list[Any]) -> dict[tuple[str, str], int]:
    return {(r.a, r.b): int(r.n) for r in rows}


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    """A gauge with its one sample, or none while the value is unknown (the family is always there)."""
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], float(value))
    return family


def _histogram(name: str, doc: str, by_label: dict[str, list[float]], label: str,
               buckets: tuple[float, ...]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=[label])
    for value, durations in sorted(by_label.items()):
        cumulative = [(str(float(b)), sum(1 for d in durations if d <= b)) for b in buckets]
        cumulative.append(("+Inf", len(durations)))
        family.add_metric([value], cumulative, sum_value=sum(durations))
    return family


class FleetCollector(Collector):
    """The fleet's series, read from the database at each scrape (module docstring). A scrape while the
    database is away yields only `pearl_fleet_scrape_ok 0`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            with transaction(self.engine, isolation_level="REPEATABLE READ") as session:
                counts = {k: _pairs(list(session.execute(text(q)))) for k, q in _COUNTS.items()}
                durations: dict[str, list[float]] = {}
                for r in session.execute(text(_PLAN_DURATIONS)):
                    durations.setdefault(r.status, []).append(float(r.d))
                scalars = session.execute(text(_SCALARS)).mappings().one()
        except Exception as exc:  # the database away: say so, and nothing else from it
            log.warning("fleet metrics: %s", exc)
            yield GaugeMetricFamily("pearl_fleet_scrape_ok", "1 when the fleet's rows were read for this scrape.", 0)
            return
        yield GaugeMetricFamily("pearl_fleet_scrape_ok", "1 when the fleet's rows were read for this scrape.", 1)
        yield from self._fleet(counts)
        yield _histogram("pearl_plan_duration_seconds", "Finished plans from apply to finish, by outcome.",
                         durations, "outcome", PLAN_BUCKETS)
        yield from self._borrowing(scalars)
        yield from self._weights(counts, scalars)
        yield from self._makespan(scalars)

    @staticmethod
    def _fleet(counts: dict[str, dict[tuple[str, str], int]]) -> Iterator[Metric]:
        gpus = GaugeMetricFamily("pearl_gpus", "GPUs by zone and state.", labels=["zone", "state"])
        for zone, states in GPU_STATES.items():
            for state in states:
                gpus.add_metric([zone, state], counts["gpus"].get((zone, state), 0))
        yield gpus
        workers = GaugeMetricFamily("pearl_workers", "Worker slots by role and activity.", labels=["role", "activity"])
        for role in Role:
            for activity in Activity:
                workers.add_metric([role.value, activity.value], counts["workers"].get((role.value, activity.value), 0))
        yield workers
        plans = GaugeMetricFamily("pearl_plans", "Plans by status.", labels=["status"])
        for status in PlanStatus:
            plans.add_metric([status.value], counts["plans"].get((status.value, ""), 0))
        yield plans
        steps = GaugeMetricFamily("pearl_applying_plan_steps", "Steps of the applying plans by status.",
                                  labels=["status"])
        for status in StepStatus:
            steps.add_metric([status.value], counts["steps"].get((status.value, ""), 0))
        yield steps

    @staticmethod
    def _borrowing(s: Any) -> Iterator[Metric]:
        returns = CounterMetricFamily("pearl_borrow_returns", "Borrowed training GPUs given back, by timeliness "
                                      "(on_time: by the deadline).", labels=["timeliness"])
        returns.add_metric(["on_time"], int(s["borrow_on_time"]))
        returns.add_metric(["late"], int(s["borrow_late"]))
        yield returns
        yield CounterMetricFamily("pearl_borrow_return_lateness_seconds", "Seconds past their deadlines that "
                                  "borrowed GPUs came back, summed.", float(s["borrow_late_s"]))
        leases = GaugeMetricFamily("pearl_leases", "Leases held now, by kind.", labels=["kind"])
        leases.add_metric(["borrowed"], int(s["borrowed_now"]))
        leases.add_metric(["preemptible"], int(s["preemptible_now"]))
        yield leases

    @staticmethod
    def _weights(counts: dict[str, dict[tuple[str, str], int]], s: Any) -> Iterator[Metric]:
        syncs = GaugeMetricFamily("pearl_weight_sync_rows", "Weight syncs by state (rows of weight_syncs).",
                                  labels=["state"])
        for state in SYNC_STATES:
            syncs.add_metric([state], counts["syncs"].get((state, ""), 0))
        yield syncs
        yield _gauge("pearl_trainer_weights_version", "The newest weights version the trainer produced.",
                     s["trainer_version"])
        yield _gauge("pearl_weights_lag_versions_max", "Versions the furthest-behind active worker lags the trainer.",
                     s["lag_max"])

    @staticmethod
    def _makespan(s: Any) -> Iterator[Metric]:
        predicted = GaugeMetricFamily("pearl_predicted_makespan_seconds", "The newest decision's predicted rollout "
                                      "makespan, of the configuration it found and of its target.",
                                      labels=["configuration"])
        for key, name in (("predicted_current_s", "current"), ("predicted_target_s", "target")):
            if s[key] is not None:
                predicted.add_metric([name], float(s[key]))
        yield predicted
        yield _gauge("pearl_measured_makespan_seconds", "The last finished rollout step's measured makespan (first "
                     "report to last trajectory; model seconds, as the predictions: wall seconds times the "
                     "inventory's time_scale).", s["measured_s"])


class DatabaseErrorsCollector(Collector):
    """`pearl_database_errors_total{kind}`: the database errors this process met (`db.error_kind`)."""

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("pearl_database_errors", "Database errors this process met, by kind.",
                                     labels=["kind"])
        counts = db.database_errors()
        for kind in db.ERROR_KINDS:
            family.add_metric([kind], counts.get(kind, 0))
        yield family
