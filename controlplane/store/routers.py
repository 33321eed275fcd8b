"""The front door as a row of `routers`: where clients send requests, where agents register workers,
and which mode it serves (the router_sync step records it). `pearlctl router serve` registers itself
here when it starts, heartbeats every `HEARTBEAT_S` and says so when it stops; agents find it by
`front_door`. One whose heartbeat is older than `SILENT_S` counts as stopped: it was killed (SIGKILL,
its machine lost) before it could say so."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import NamedTuple

from pearl.controlplane.core.domain import Activity, Role
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import Router, Worker
from sqlalchemy import Engine, func, select, update
from sqlalchemy.dialects.postgresql import insert

DEFAULT = "default"
HEARTBEAT_S = 2.0
SILENT_S = 10.0


def register_router(engine: Engine, *, url: str, admin_url: str, host: str, pid: int, mode: str | None,
                    name: str = DEFAULT) -> None:
    values = {"url": url, "admin_url": admin_url, "host": host, "pid": pid, "mode": mode,
              "started_at": func.pearl_now(), "heartbeat_at": func.pearl_now(), "stopped_at": None}
    with transaction(engine, actor=f"router {name}", reason="front door started") as session:
        session.execute(insert(Router).values(name=name, **values)
                        .on_conflict_do_update(index_elements=[Router.name], set_=values))


def router_stopped(engine: Engine, *, pid: int, name: str = DEFAULT) -> None:
    with transaction(engine, actor=f"router {name}", reason="front door stopped") as session:
        session.execute(update(Router).where(Router.name == name, Router.pid == pid)
                        .values(stopped_at=func.pearl_now()))


class FrontDoorRow(NamedTuple):
    admin_url: str
    running: bool  # a stopped one is restarting, or gone on purpose
    started_at: datetime  # which start of it: a restarted front door has a new one


def heartbeat(engine: Engine, *, pid: int, name: str = DEFAULT) -> bool:
    """The front door `pid` is alive; False when its row was taken over or marked stopped."""
    with transaction(engine) as session:
        return session.execute(update(Router).where(Router.name == name, Router.pid == pid,
                                                    Router.stopped_at.is_(None))
                               .values(heartbeat_at=func.pearl_now())).rowcount == 1


def running() -> object:
    """SQL: the row's front door runs (not stopped, heard from within `SILENT_S`)."""
    return Router.stopped_at.is_(None) & (Router.heartbeat_at > func.pearl_now() - timedelta(seconds=SILENT_S))


def front_door(engine: Engine, name: str = DEFAULT) -> FrontDoorRow | None:
    """The fleet's front door as its row has it; None when the fleet never registered one."""
    with transaction(engine) as session:
        row = session.execute(select(Router.admin_url, running(), Router.started_at)
                              .where(Router.name == name)).first()
    return FrontDoorRow(row[0], bool(row[1]), row[2]) if row is not None else None


def recorded_mode(engine: Engine, name: str = DEFAULT) -> str | None:
    """The mode recorded for the front door (the last router_sync, or what it served); None if none."""
    with transaction(engine) as session:
        return session.scalar(select(Router.mode).where(Router.name == name))


def serving_workers(engine: Engine) -> list[tuple[int, str, Role]]:
    """The workers the routers should list: active, with a server, as (id, endpoint, role)."""
    with transaction(engine) as session:
        rows = session.execute(select(Worker.id, Worker.endpoint, Worker.role)
                               .where(Worker.activity == Activity.ACTIVE, Worker.endpoint.is_not(None))
                               .order_by(Worker.id))
        return [(int(i), str(e), Role(r)) for i, e, r in rows]
