"""A synchronous client of the front door's admin API (agents/router.py): what the agent's steps call.

`register` and `deregister` return once the child router lists (or no longer lists) the worker;
`sync` makes the routers list exactly the given workers; `state` says what the routers list;
failures raise `DriverError` with the front door's message.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.routing import WORKER_TYPE
from pearl.controlplane.services.token import bearer

from .drivers.base import DriverError
from .server_client import HTTPClient


class FrontDoorClient(HTTPClient):
    """`url`: the admin API's (`routers.admin_url`); `token`: the control token it needs."""

    def __init__(self, url: str, timeout_s: float = 60.0, token: str | None = None) -> None:
        super().__init__(timeout_s)
        self.url = url.rstrip("/")
        self.token = token

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            resp = self._http.request(method, self.url + path, json=body, headers=bearer(self.token))
        except httpx.HTTPError as exc:
            raise DriverError(f"front door {self.url}: no answer ({type(exc).__name__}: {exc})") from None
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text.strip()
            raise DriverError(f"front door {self.url}{path}: {resp.status_code}: {message}", status=resp.status_code)
        return resp.json()

    def register(self, url: str, role: Role | str, bootstrap_port: int | None = None) -> dict[str, Any]:
        return self._call("POST", "/pearl/workers", {"url": url, "role": Role(role).value,
                                                      "bootstrap_port": bootstrap_port})

    def deregister(self, url: str) -> bool:
        return bool(self._call("DELETE", "/pearl/workers", {"url": url})["removed"])

    def set_mode(self, mode: str) -> None:
        self._call("PUT", "/pearl/mode", {"mode": mode})

    def sync(self, mode: str | None, workers: list[dict[str, Any]]) -> dict[str, Any]:
        """workers: [{url, role, bootstrap_port}, ...] (the active workers, as the database has them)."""
        return self._call("PUT", "/pearl/workers", {"mode": mode, "workers": workers})

    def state(self) -> dict[str, Any]:
        return self._call("GET", "/pearl/state")


ROLE_OF_TYPE = {kind: role for role, kind in WORKER_TYPE.items()}


def listed_workers(state: dict[str, Any]) -> set[tuple[str, Role]] | None:
    """The workers a front door's `GET /pearl/state` says its routers list, as (url, role); None when a
    router of it could not say (its list would look empty)."""
    listed: set[tuple[str, Role]] = set()
    for child in state.get("children", {}).values():
        if child.get("error"):
            return None
        listed.update((w["url"], ROLE_OF_TYPE[w["worker_type"]]) for w in child["workers"]
                      if w.get("worker_type") in ROLE_OF_TYPE)
    return listed


class FleetFrontDoor:
    """The fleet's front door as an agent uses it, found by its `routers` row at every call.

    A fleet that never registered one has none: every call does nothing (clients reach the servers
    some other way). A registered one that is stopped (or silent past `routers.SILENT_S`: killed) is
    restarting, or gone on purpose:
    - `register` and `set_mode` wait up to `wait_s` for it, then raise `DriverError`: a worker
      admitted around it would be missing from its routers once it is back;
    - `deregister` does not wait: the worker leaves service either way, and a restarted front door
      takes back only the servers that still answer `/health` (a stopped or sleeping one does not).
    """

    def __init__(self, engine: Any, wait_s: float = 30.0, poll_s: float = 0.5, token: str | None = None) -> None:
        self.engine, self.wait_s, self.poll_s = engine, wait_s, poll_s
        self._token = token

    def token(self) -> str:
        if self._token is None:
            from pearl.controlplane.store.secrets import control_token

            self._token = control_token(self.engine)
        return self._token

    def live(self, wait: bool, timeout_s: float = 60.0) -> FrontDoorClient | None:
        """A client of the live front door; None when the fleet has none, or (not waiting) it is stopped."""
        from pearl.controlplane.store.routers import front_door

        deadline = time.monotonic() + (self.wait_s if wait else 0.0)
        while True:
            found = front_door(self.engine)
            if found is None:
                return None
            if found.running:
                return FrontDoorClient(found.admin_url, timeout_s, token=self.token())
            if time.monotonic() >= deadline:
                if wait:
                    raise DriverError(f"the front door is stopped (restarting?) and did not come back within "
                                      f"{self.wait_s:g} s")
                return None
            time.sleep(self.poll_s)

    def _call(self, wait: bool, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        client = self.live(wait, timeout_s)
        if client is None:
            return None
        try:
            return getattr(client, method)(*args)
        finally:
            client.close()

    def register(self, url: str, role: Role | str, bootstrap_port: int | None = None) -> Any:
        return self._call(True, "register", url, role, bootstrap_port)

    def set_mode(self, mode: str) -> Any:
        return self._call(True, "set_mode", mode)

    def deregister(self, url: str) -> Any:
        return self._call(False, "deregister", url)

    def started(self) -> Any:
        """Which start of the front door runs now (a restarted one has a new one); None when none runs."""
        from pearl.controlplane.store.routers import front_door

        found = front_door(self.engine)
        return found.started_at if found is not None and found.running else None

    def listed(self, timeout_s: float = 5.0) -> set[tuple[str, Role]] | None:
        """The workers the live front door lists, as (url, role), asked once without waiting; None when
        the fleet has none, it is stopped, or it gives no clear answer within `timeout_s`."""
        try:
            state = self._call(False, "state", timeout_s=timeout_s)
        except DriverError:
            return None
        return None if state is None else listed_workers(state)
