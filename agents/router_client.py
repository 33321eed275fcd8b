"""A synchronous client of the front door's admin API (agents/router.py): what the agent's steps call.

`register` and `deregister` return once the child router lists (or no longer lists) the worker;
`sync` makes the routers list exactly the given workers (after a restart of the front door);
failures raise `DriverError` with the front door's message.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from pearl.controlplane.core.domain import Role

from .drivers.base import DriverError
from .server_client import HTTPClient


class FrontDoorClient(HTTPClient):
    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        super().__init__(timeout_s)
        self.url = url.rstrip("/")

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            resp = self._http.request(method, self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise DriverError(f"front door {self.url}: no answer ({type(exc).__name__}: {exc})") from None
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text.strip()
            raise DriverError(f"front door {self.url}{path}: {resp.status_code}: {message}")
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


def front_door_for(engine: Any, wait_s: float = 30.0, poll_s: float = 0.5) -> Any:
    """The client of the fleet's live front door. A fleet that never had one gets `NoFrontDoor`
    (clients reach the servers some other way); one whose front door is stopped (restarting) is
    waited for up to `wait_s`, then a `DriverError`: a worker admitted or drained around a stopped
    front door would be missing from, or left in, its routers once it is back."""
    from pearl.controlplane.store.routers import front_door_registered, front_door_url

    from .steps import NoFrontDoor

    deadline = time.monotonic() + wait_s
    while True:
        url = front_door_url(engine)
        if url:
            return FrontDoorClient(url)
        if not front_door_registered(engine):
            return NoFrontDoor()
        if time.monotonic() >= deadline:
            raise DriverError(f"the front door is stopped (restarting?) and did not come back within {wait_s:g} s")
        time.sleep(poll_s)
