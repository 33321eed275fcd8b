"""`pearlctl dashboard`: a read-only web page over the database.

One page (`dashboard.html`, no script or style from elsewhere) that fetches `/api/state` every
`REFRESH_S` and draws it: the GPU grid by node and zone coloured by state, the workers, the applying
plan as a timeline of its steps, the policy's decisions with predicted against measured makespans,
the borrow cycles with their deadlines and lateness, and the preemptible GPUs' grants. `/api/state`
is `store.dashboard.dashboard_state`: the rows and SQL views, no second source of truth; the page
writes nothing.

It binds localhost unless told otherwise; bound anywhere else it needs the control token on every
request (`Authorization: Bearer TOKEN`, or `?token=TOKEN` on the page's URL, which the page passes on
to its own requests), else 401.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from importlib.resources import files
from typing import Any

from aiohttp import web

REFRESH_S = 2.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def page() -> str:
    return files("pearl.agents").joinpath("dashboard.html").read_text(encoding="utf-8")


def build_app(read_state: Callable[[], dict[str, Any]], token: str | Callable[[str], bool] | None) -> web.Application:
    """The dashboard's routes over `read_state` (a blocking read, run in a thread); with `token`, every
    request must bear it (`token` is the token, or a blocking check of what a request offers: the audit
    role reads no token, it asks the database whether one matches)."""
    html = page().replace("__REFRESH_MS__", str(int(REFRESH_S * 1000)))

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if token is not None:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip() \
                or request.query.get("token", "")
            if callable(token):
                ok = bool(given) and await asyncio.to_thread(token, given)
            else:
                ok = hmac.compare_digest(given.encode(), token.encode())
            if not ok:
                return web.json_response({"error": "the control token is required"}, status=401)
        return await handler(request)

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def state(request: web.Request) -> web.Response:
        try:
            body = await asyncio.to_thread(read_state)
        except Exception as exc:  # the database away: the page says so and tries again
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=503)
        return web.Response(text=json.dumps(body, default=str), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    app = web.Application(middlewares=[auth])
    app.router.add_get("/", index)
    app.router.add_get("/api/state", state)
    return app


async def serve(app: web.Application, host: str, port: int, stop: asyncio.Event,
                bound: Callable[[int], None]) -> None:
    """Serve until `stop` is set; `bound(port)` once listening (the port chosen when `port` is 0)."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await stop.wait()
    finally:
        await runner.cleanup()
