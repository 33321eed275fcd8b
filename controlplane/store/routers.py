"""The front door as a row of `routers`: where clients send requests, where agents register workers,
and which mode it serves (the router_sync step records it). `pearlctl router serve` registers itself
here when it starts and says so when it stops; agents find it by `front_door_url`."""

from __future__ import annotations

from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import Router
from sqlalchemy import Engine, func, select, update
from sqlalchemy.dialects.postgresql import insert

DEFAULT = "default"


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


def front_door_registered(engine: Engine, name: str = DEFAULT) -> bool:
    """Whether the fleet has a front door at all, running or not (a stopped one is restarting, or gone
    on purpose: either way workers are not to be admitted around it)."""
    with transaction(engine) as session:
        return session.scalar(select(func.count()).select_from(Router).where(Router.name == name)) > 0


def front_door_url(engine: Engine, name: str = DEFAULT) -> str | None:
    """The admin URL of the live front door (None: the fleet has none)."""
    with transaction(engine) as session:
        return session.scalar(select(Router.admin_url).where(Router.name == name, Router.stopped_at.is_(None)))
