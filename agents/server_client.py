"""A small synchronous client of one server's SGLang HTTP API: what the agent's steps call.

Every call has a timeout; a command may carry the step's fencing token (`X-Pearl-Fence`). A server
that does not answer, answers 5xx or refuses (4xx, or `success: false`) raises `DriverError` with the
server's own message, so the step fails saying why. Works the same against a real SGLang server and
the simulated one.
"""

from __future__ import annotations

import functools
import ssl
import time
from typing import Any, Self

import httpx
from pearl.controlplane.services.token import bearer

from .drivers.base import FENCE_HEADER, DriverError

MEMORY_TAGS = ("weights", "kv_cache")


@functools.cache
def _tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def http_client(timeout_s: float) -> httpx.Client:
    """An HTTP client that shares one TLS context: building one per client (httpx's default) loads
    the CA bundle every time, tens of milliseconds of CPU for each step's client."""
    return httpx.Client(timeout=timeout_s, verify=_tls())


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


class HTTPClient:
    """An HTTP client's lifetime: closed by `close()`, by `with`, or when collected."""

    def __init__(self, timeout_s: float) -> None:
        self._http = http_client(timeout_s)

    def close(self) -> None:
        self._http.close()

    def __del__(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServerClient(HTTPClient):
    def __init__(self, endpoint: str, timeout_s: float = 30.0, fence: int | None = None,
                 token: str | None = None) -> None:
        super().__init__(timeout_s)
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self.fence = fence
        self.token = token  # the control token: SGLang's admin API key, sent as a bearer token

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None,
              command: bool = False, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        headers = bearer(self.token)
        if command and self.fence is not None:
            headers[FENCE_HEADER] = str(self.fence)
        try:
            resp = self._http.request(method, self.endpoint + path, json=body, headers=headers,
                                      timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as exc:
            raise DriverError(f"{self.endpoint}{path}: no answer ({type(exc).__name__}: {exc})") from None
        if resp.status_code not in ok:
            raise DriverError(f"{self.endpoint}{path}: {resp.status_code}: {_message(resp)}", status=resp.status_code)
        return resp

    def _json(self, resp: httpx.Response) -> dict[str, Any]:
        try:
            body = resp.json()
        except ValueError:
            return {"message": resp.text}
        if isinstance(body, dict) and body.get("success") is False:
            raise DriverError(f"{resp.request.url}: {body.get('message') or 'refused'}")
        return body if isinstance(body, dict) else {"result": body}

    # -- reading ---------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when `/health` answers 200 (a server that does not answer is not healthy, not an error)."""
        try:
            return self._http.get(self.endpoint + "/health", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def ready(self) -> bool:
        try:
            return self._http.get(self.endpoint + "/ready", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def server_info(self) -> dict[str, Any]:
        return self._json(self._call("GET", "/server_info"))

    def model_info(self) -> dict[str, Any]:
        return self._json(self._call("GET", "/model_info"))

    def loads(self) -> list[dict[str, Any]]:
        return self._json(self._call("GET", "/v1/loads?include=core,disagg,queues")).get("loads", [])

    def graph_memory_gb(self) -> float:
        """The memory its CUDA graphs take, the most over its DP ranks (`/v1/loads` `memory.graph_gb`):
        what a decode server reports is what a flip to decode must leave free to capture its own."""
        loads = self._json(self._call("GET", "/v1/loads?include=memory")).get("loads", [])
        return max([float((load.get("memory") or {}).get("graph_gb") or 0.0) for load in loads] or [0.0])

    def is_idle(self) -> bool:
        """No running, waiting or in-transfer request on any DP rank."""
        for load in self.loads():
            disagg = load.get("disaggregation") or {}
            busy = load.get("num_running_reqs", 0) + load.get("num_waiting_reqs", 0)
            busy += sum(disagg.get(k, 0) for k in ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
                                                   "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs"))
            if busy:
                return False
        return True

    def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> None:
        """Return once the server holds no request; DriverError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.is_idle():
            if time.monotonic() > deadline:
                raise DriverError(f"{self.endpoint}: still busy after {timeout_s:.0f} s")
            time.sleep(poll_s)

    # -- commands (fenced) -----------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return self._json(self._call("POST", "/pause_generation", {"mode": mode}, command=True))

    def continue_generation(self) -> dict[str, Any]:
        return self._json(self._call("POST", "/continue_generation", {}, command=True))

    def release_memory_occupation(self, tags: tuple[str, ...] = MEMORY_TAGS) -> dict[str, Any]:
        return self._json(self._call("POST", "/release_memory_occupation", {"tags": list(tags)}, command=True))

    def resume_memory_occupation(self, tags: tuple[str, ...] = MEMORY_TAGS) -> dict[str, Any]:
        return self._json(self._call("POST", "/resume_memory_occupation", {"tags": list(tags)}, command=True))

    def pd_role_switch(self, new_role: str, decode_cuda_graph_memory_gb: float | None = None,
                       decode_cuda_graph_bs: list[int] | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
        body: dict[str, Any] = {"new_role": new_role}
        if decode_cuda_graph_memory_gb is not None:
            body["decode_cuda_graph_memory_gb"] = decode_cuda_graph_memory_gb
        if decode_cuda_graph_bs is not None:
            body["decode_cuda_graph_bs"] = decode_cuda_graph_bs
        return self._json(self._call("POST", "/pd_role_switch", body, timeout_s=timeout_s, command=True))

    def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None,
                                 flush_cache: bool = True, abort_all_requests: bool = False,
                                 timeout_s: float = 600.0) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._json(self._call("POST", "/update_weights_from_disk", body, timeout_s=timeout_s, command=True))

    def flush_cache(self) -> str:
        return self._call("POST", "/flush_cache", {}, command=True).text.strip()
