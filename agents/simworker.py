"""The simulated SGLang server: one HTTP process per worker, timed by the performance model.

It answers what the router and pearl's agents call on a real SGLang server (same paths, bodies and
status codes for what pearl relies on): `/health`, `/ready`, `/server_info`, `/model_info`,
`/v1/models`, `/v1/loads`, `/generate` (colocated, or one half of a split request, the halves meeting
by the router's `bootstrap_room`), `/pd_role_switch`, `/release_memory_occupation`,
`/resume_memory_occupation`, `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk`, `/flush_cache`. Generation is `agents.simengine.RealtimeEngine`: the
simulator's continuous-batching engine driven by the wall clock, `speed` times faster.

A simulated request generates exactly `max_new_tokens` tokens (as with `ignore_eos`), so clients
decide the length of each turn. Text prompts are split on whitespace, one token per word.

Fencing: a command (any POST but `/generate`) may carry `X-Pearl-Fence: <int>`; one older than the
newest seen is refused with 409 and changes nothing. SIGTERM: in-flight requests are answered as
aborted (with the tokens generated so far), then the process exits 0. Nothing it holds outlives it
that the control plane needs: a SIGKILL loses only in-flight requests, which the front door resubmits.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import AGENTIC_LOAD, PerfModel
from pearl.controlplane.weights.broadcast import DEFAULT_GROUP, LOAD_FORMAT
from pearl.controlplane.weights.files import SnapshotError, load_snapshot, manifest_digest

from .drivers.base import FENCE_HEADER
from .simengine import VOCAB, RealtimeEngine

VERSION = "0.5.23-pearl-sim"
MEMORY_TAGS = ("weights", "kv_cache")


@dataclass
class SimConfig:
    """How one simulated server is launched (`pearlctl simworker --help`)."""

    port: int
    host: str = "127.0.0.1"
    role: Role = Role.COLOCATED
    model: str = "qwen3-8b"  # catalog model: the timing, and the name served
    gpu: str = "h100"
    tp: int = 1
    worker_id: int = 0
    generation: int = 1
    fence: int = 0
    speed: float = 1.0  # simulated seconds per wall second
    bootstrap_port: int | None = None  # prefill (and flippable decode) servers
    model_path: str | None = None  # a weight snapshot to check and load at start
    weight_version: str = "default"
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False  # without it, weights released and resumed come back uninitialised
    enable_pd_role_switch: bool = False
    startup_s: float = 0.0  # simulated start-up (weights, CUDA graphs): /health answers 503 until then
    launched_at: float | None = None  # when its launcher started it (epoch s): the start-up runs from then
    weight_load_s: float = 2.0  # simulated time a snapshot load pauses the engine
    role_switch_s: float = 1.0  # simulated time of a prefill <-> decode flip
    memory_s: float = 0.5  # simulated time to release or resume memory
    admin_api_key: str | None = None  # SGLang's: commands need `Authorization: Bearer <it>`
    decode_graph_gb: float = 2.0  # memory its decode CUDA graphs take (reported under /v1/loads `memory`)
    graph_headroom_gb: float = 8.0  # memory free beside weights and KV: what a capture on a flip may take
    capacity: int | None = None  # KV tokens; default: the performance model's
    run_dir: str | None = None  # where model_path points when no snapshot is given (a local directory)


@dataclass
class SimState:
    cfg: SimConfig
    rt: RealtimeEngine
    model_path: str
    weight_version: str
    fence: int
    released: set[str] = field(default_factory=set)
    paused: str | None = None
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    switching: bool = False
    stopping: bool = False
    ready_at: float = 0.0  # simulated time (of its engine's clock) it finishes starting
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    weights_checksum: str | None = None  # manifest_digest of `tensors` (None: the initial weights)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # the weights: name -> dtype, shape, checksum
    weight_loads: int = 0  # snapshots (or broadcasts) taken since the start
    groups: dict[str, Any] = field(default_factory=dict)  # weight-update groups joined (name -> process group)
    hashing: list[Any] = field(default_factory=list)  # the received buckets' digests, being computed
    receive_buffers: Any = None  # broadcast.ReceiveBuffers, made with the first bucket
    decode_graphs: bool = False  # decode CUDA graphs captured (launched as decode, or flipped to decode once)

    def flushable(self, after_update: bool = False) -> bool:
        """SGLang flushes only a fully idle scheduler; while generation is paused the requests waiting
        (the retracted ones) do not count, the running ones (paused in place) do. A weight update on a
        server not paused first waits for the requests in flight (under its update lock), so its
        flush finds the scheduler idle."""
        if after_update and self.paused is None:
            return True
        return self.rt.idle or self.paused == "retract"

    def serving_problem(self) -> str | None:
        if self.stopping:
            return "the server is shutting down"
        if self.rt.now() < self.ready_at:
            return "the server is starting"
        if self.released:
            return f"memory released ({', '.join(sorted(self.released))}): not serving until resumed"
        if self.switching:
            return "a role switch is in progress"
        return None


UNINITIALISED = "uninitialised"  # the weights checksum of weights resumed without a CPU backup
FLUSH_REFUSED = "Flush cache failed: there are running or waiting requests.\n"
FLUSH_AFTER_UPDATE_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running "
                              "or queued. Retract or finish them, then call /flush_cache.")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}, "message": message}, status=status)


async def _body(request: web.Request, required: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        if required:
            raise web.HTTPBadRequest(text=json.dumps({"message": "a JSON body is required"}),
                                     content_type="application/json")
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=json.dumps({"message": f"body is not JSON: {exc}"}),
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"message": "body must be a JSON object"}),
                                 content_type="application/json")
    return body


# SGLang's ADMIN_OPTIONAL endpoints among the ones served here (`@auth_level` in its http_server.py;
# tests/conformance holds this list to SGLang's): with an admin API key they need it as a bearer token.
ADMIN_PATHS = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache", "/pd_role_switch", "/release_memory_occupation",
    "/resume_memory_occupation", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group",
})


def _admin_auth(key: str | None) -> Any:
    """SGLang's API-key middleware for its admin endpoints: 401 `{"error": "Unauthorized"}` without
    the key (compared in constant time)."""
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if key and request.path in ADMIN_PATHS:
            scheme, _, given = (request.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), key.encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)
    return check


def _unprocessable(message: str, field_name: str | None = None) -> web.Response:
    """FastAPI's answer to a body that does not validate against the request type: 422, `detail`."""
    loc = ["body", field_name] if field_name else ["body"]
    return web.json_response({"detail": [{"type": "missing" if field_name else "value_error", "loc": loc,
                                          "msg": message}]}, status=422)


def _missing(body: dict[str, Any], *required: str) -> web.Response | None:
    """422 naming the first required field of SGLang's request type that the body lacks."""
    for name in required:
        if name not in body:
            return _unprocessable("Field required", name)
    return None


MAX_FENCE = 2**53  # fences come from a database sequence; one beyond this is no step's


def _fenced(state: SimState, request: web.Request, required: bool = True) -> web.Response | None:
    """400 for a command without a fence (where one is `required`: every command but the trainer's
    broadcast, which no claim sends) or with one out of range; 409 for one older than the newest seen;
    records a newer one."""
    raw = request.headers.get(FENCE_HEADER)
    if raw is None:
        return _error(400, f"{FENCE_HEADER}: required (the fencing token of the step or sync that sends the "
                           "command)") if required else None
    try:
        fence = int(raw)
    except ValueError:
        return _error(400, f"{FENCE_HEADER}: not an integer: {raw!r}")
    if not 0 <= fence < MAX_FENCE:
        return _error(400, f"{FENCE_HEADER}: between 0 and 2^53, not {fence}")
    if fence < state.fence:
        return _error(409, f"fence {fence} is older than {state.fence}: a newer claim drives this server")
    state.fence = fence
    return None


def build_app(state: SimState) -> web.Application:
    cfg, rt = state.cfg, state.rt
    routes = web.RouteTableDef()
    served = cfg.model

    def info() -> dict[str, Any]:
        return {"model_path": state.model_path, "served_model_name": served, "tokenizer_path": None,
                "is_generation": True, "weight_version": state.weight_version, "load_format": "auto",
                "weights_checksum": state.weights_checksum,
                "disaggregation_mode": rt.role.value if rt.role is not Role.COLOCATED else "null",
                "model_type": cfg.model, "architectures": None}

    @routes.get("/health")
    @routes.get("/health_generate")
    @routes.get("/ready")
    async def health(request: web.Request) -> web.Response:
        problem = state.serving_problem()
        return web.Response(status=503, text=problem) if problem else web.Response(status=200)

    @routes.get("/model_info")
    @routes.get("/get_model_info")
    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(info())

    @routes.get("/server_info")
    @routes.get("/get_server_info")
    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({
            **info(), "host": cfg.host, "port": cfg.port, "tp_size": cfg.tp, "dp_size": 1,
            "disaggregation_bootstrap_port": cfg.bootstrap_port, "enable_memory_saver": cfg.enable_memory_saver,
            "enable_pd_role_switch": cfg.enable_pd_role_switch, "max_total_num_tokens": rt.capacity,
            "version": VERSION, "internal_states": [],
            "pearl": {"worker_id": cfg.worker_id, "generation": cfg.generation, "gpu": cfg.gpu, "speed": cfg.speed},
        })

    @routes.get("/v1/models")
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": served, "object": "model", "owned_by": "sglang", "root": state.model_path,
             "max_model_len": rt.capacity}]})

    @routes.get("/v1/loads")
    async def loads(request: web.Request) -> web.Response:
        load = rt.load(state.held)
        load["memory"] = {"graph_gb": cfg.decode_graph_gb if state.decode_graphs else 0.0,
                          "token_capacity": load["max_total_num_tokens"]}
        return web.json_response({"version": VERSION, "accelerator": cfg.gpu, "num_accelerators": cfg.tp,
                                  "loads": [load]})

    @routes.get("/pearl/state")
    async def pearl_state(request: web.Request) -> web.Response:
        return web.json_response({
            "worker_id": cfg.worker_id, "generation": cfg.generation, "fence": state.fence, "role": rt.role.value,
            "released": sorted(state.released), "paused": state.paused, "idle": rt.idle and not state.held,
            "finished": rt.finished, "aborted": rt.aborted, "tokens_out": rt.tokens_out,
            "weight_version": state.weight_version, "weight_loads": state.weight_loads, "sim_time": rt.now(),
        })

    @routes.post("/generate")
    async def generate(request: web.Request) -> web.Response:
        body = await _body(request)
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str):
            ids = [hash(w) % VOCAB for w in body["text"].split()] or [0]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            return _error(400, "input_ids: a non-empty list of token ids (or text) is required; "
                               "batched requests are not supported by the simulated server")
        params = body.get("sampling_params") or {}
        max_new = params.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            return _error(400, f"sampling_params.max_new_tokens: a non-negative integer, not {max_new!r}")
        if len(ids) + max_new > rt.capacity:
            return _error(400, f"input_ids: {len(ids)} tokens + max_new_tokens {max_new} exceed the "
                               f"server's {rt.capacity} tokens of KV cache")
        while state.paused and not state.stopping:
            state.held += 1
            try:
                await state.unpaused.wait()
            finally:
                state.held -= 1
        problem = state.serving_problem()
        if problem:
            return _error(503, problem)
        p = rt.new_request(ids, max_new, str(body.get("rid") or uuid.uuid4().hex))
        if rt.role is not Role.COLOCATED:
            room, host, port = body.get("bootstrap_room"), body.get("bootstrap_host"), body.get("bootstrap_port")
            if room is None or not host or not port:
                return _error(400, f"a {rt.role.value} server needs bootstrap_host, bootstrap_port and "
                                   "bootstrap_room (send the request through a PD router)")
            p.room, p.bootstrap = int(room), (str(host), int(port))
        if max_new == 0:
            answer = rt.result(p, "length")
        else:
            rt.submit(p)
            answer = await p.done
        answer["meta_info"]["weight_version"] = state.weight_version
        return web.json_response(answer)

    @routes.post("/pearl/kv/{room}")
    async def kv_pull(request: web.Request) -> web.Response:
        if rt.role is not Role.PREFILL:
            return web.json_response({"ok": False, "message": f"not a prefill server ({rt.role.value})"}, status=409)
        return web.json_response(await rt.serve_pull(int(request.match_info["room"])))

    @routes.post("/pause_generation")
    async def pause_generation(request: web.Request) -> web.Response:
        if (refused := _fenced(state, request)) is not None:
            return refused
        mode = (await _body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"mode: one of abort, retract, in_place, not {mode!r}")
        state.paused = mode
        state.unpaused.clear()
        aborted = 0
        if mode == "abort":
            aborted = rt.interrupt()
        else:
            rt.pause(math.inf)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok", "aborted": aborted})

    @routes.post("/continue_generation")
    async def continue_generation(request: web.Request) -> web.Response:
        if (refused := _fenced(state, request)) is not None:
            return refused
        state.paused = None
        state.unpaused.set()
        rt.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @routes.route("*", "/flush_cache")
    async def flush_cache(request: web.Request) -> web.Response:
        if request.method == "POST" and (refused := _fenced(state, request)) is not None:
            return refused
        if not state.flushable():
            return web.Response(status=400, text=FLUSH_REFUSED)
        rt.flush_cache()
        return web.Response(text="Cache flushed.\n")

    @routes.post("/pd_role_switch")
    async def pd_role_switch(request: web.Request) -> web.Response:
        if (refused := _fenced(state, request)) is not None:
            return refused
        body = await _body(request)
        old, new = rt.role.value, str(body.get("new_role") or "").lower()

        def fail(message: str) -> web.Response:
            return web.json_response({"success": False, "message": message, "old_role": old, "new_role": new,
                                      "safe_to_restore": True}, status=400)

        if not cfg.enable_pd_role_switch:
            return fail("--enable-pd-role-switch is not set on this server")
        if state.switching:
            return fail("another role switch is already in progress")
        if new not in ("prefill", "decode"):
            return fail(f"invalid new_role={new!r}")
        if rt.role is Role.COLOCATED:
            return fail("instance is not running in PD disaggregation mode")
        if new == old:
            return web.json_response({"success": True, "message": "already in target role", "old_role": old,
                                      "new_role": new, "safe_to_restore": False})
        if not rt.idle or state.held:
            return fail("instance is not idle; drain all requests before switching")
        graph_gb = body.get("decode_cuda_graph_memory_gb")
        if new == "decode" and not state.decode_graphs:  # SGLang captures the decode graphs on this flip
            if graph_gb is None:
                return fail("decode_cuda_graph_memory_gb is required before capturing decode graphs")
            if float(graph_gb) < 0:
                return fail("decode_cuda_graph_memory_gb must be non-negative")
            if float(graph_gb) > cfg.graph_headroom_gb:
                return fail(f"insufficient decode CUDA graph headroom: required={float(graph_gb):.3f} GB, "
                            f"available={cfg.graph_headroom_gb:.3f} GB")
        if body.get("prepare_only"):
            return web.json_response({"success": True, "message": "ready", "old_role": old, "new_role": new,
                                      "safe_to_restore": True})
        state.switching = True
        try:
            rt.set_role(Role(new))
            await rt.sleep_sim(cfg.role_switch_s)
            state.decode_graphs |= new == "decode"
        finally:
            state.switching = False
        return web.json_response({"success": True, "message": "ok", "old_role": old, "new_role": new,
                                  "safe_to_restore": False})

    def tags_of(body: dict[str, Any]) -> set[str] | web.Response:
        tags = body.get("tags") or list(MEMORY_TAGS)
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            return _error(400, f"tags: unknown {sorted(unknown)}; known: {list(MEMORY_TAGS)}")
        return set(tags)

    @routes.post("/release_memory_occupation")
    async def release_memory(request: web.Request) -> web.Response:
        if (refused := _fenced(state, request)) is not None:
            return refused
        tags = tags_of(await _body(request, required=False))
        if isinstance(tags, web.Response):
            return tags
        if not cfg.enable_memory_saver:
            return _error(400, "release_memory_occupation needs --enable-memory-saver")
        if not rt.idle or state.held:
            return _error(400, "the server has running or waiting requests: drain it before releasing memory")
        if "kv_cache" in tags:
            rt.flush_cache()
        state.released |= tags
        await rt.sleep_sim(cfg.memory_s)
        return web.json_response({"success": True, "released": sorted(state.released)})

    @routes.post("/resume_memory_occupation")
    async def resume_memory(request: web.Request) -> web.Response:
        if (refused := _fenced(state, request)) is not None:
            return refused
        tags = tags_of(await _body(request, required=False))
        if isinstance(tags, web.Response):
            return tags
        await rt.sleep_sim(cfg.memory_s)
        if "weights" in tags & state.released and not cfg.enable_weights_cpu_backup:
            # as SGLang's memory saver: the weights' memory comes back, their values do not
            state.tensors = {}
            state.weights_checksum = UNINITIALISED
        state.released -= tags
        return web.json_response({"success": True, "released": sorted(state.released)})

    @routes.post("/update_weights_from_disk")
    async def update_weights(request: web.Request) -> web.Response:
        if (refused := _fenced(state, request)) is not None:
            return refused
        body = await _body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return web.json_response({"success": False, "message": "model_path: required",
                                      "num_paused_requests": 0}, status=400)
        async with state.weights_lock:
            if body.get("abort_all_requests"):
                rt.interrupt("Aborted by update_weights_from_disk")
            try:
                snap = await asyncio.to_thread(load_snapshot, path)
            except SnapshotError as exc:
                return web.json_response({"success": False, "num_paused_requests": 0,
                                          "message": f"Failed to update weights: {exc}; kept version "
                                                     f"{state.weight_version}"}, status=400)
            rt.pause(rt.now() + cfg.weight_load_s)
            await rt.sleep_sim(cfg.weight_load_s)
            state.model_path = path
            state.tensors = snap.manifest()
            state.weights_checksum = manifest_digest(state.tensors) if snap.info else None
            state.weight_loads += 1
            if body.get("weight_version") is not None:
                state.weight_version = str(body["weight_version"])
            if body.get("flush_cache", True):
                if not state.flushable(after_update=True):
                    return web.json_response({"success": False, "num_paused_requests": 0,
                                              "message": FLUSH_AFTER_UPDATE_REFUSED}, status=400)
                rt.flush_cache()
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": f"Succeeded to update model weights ({snap.tensors} tensors, "
                                             f"{snap.checked} checksums verified)."})

    @routes.post("/init_weights_update_group")
    async def init_group(request: web.Request) -> web.Response:
        if (refused := _fenced(state, request, required=False)) is not None:
            return refused
        body = await _body(request)
        if (missing := _missing(body, "master_address", "master_port", "rank_offset", "world_size")) is not None:
            return missing
        try:
            name = str(body.get("group_name", DEFAULT_GROUP))
            host, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])  # tp 1: its one rank is rank_offset
        except (TypeError, ValueError) as exc:
            return _unprocessable(f"bad group: {exc}")
        if not name:
            return web.json_response({"success": False, "message": "Group name cannot be empty"}, status=400)
        from pearl.controlplane.weights.broadcast import join_group

        try:
            state.groups[name] = await asyncio.to_thread(join_group, host, port, rank, world,
                                                         str(body.get("backend") or "nccl"), 120.0, name)
        except Exception as exc:  # torch's errors (a store that does not answer, a timeout, no NCCL on a CPU)
            return web.json_response({"success": False, "message": f"Failed to initialize custom process group: "
                                                                   f"{exc}."}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    @routes.post("/update_weights_from_distributed")
    async def update_distributed(request: web.Request) -> web.Response:
        """One bucket, as SGLang takes it: names, dtypes and shapes, then the broadcast of the flattened
        bucket; the tensors replace the ones of those names (the weights are partly new until the
        last bucket, which carries the version)."""
        if (refused := _fenced(state, request, required=False)) is not None:
            return refused
        body = await _body(request)
        if (missing := _missing(body, "names", "dtypes", "shapes")) is not None:
            return missing
        name = str(body.get("group_name", DEFAULT_GROUP))
        pg = state.groups.get(name)
        if pg is None:
            return web.json_response({"success": False, "message": f"Group {name} not in {sorted(state.groups)}. "
                                      "Please call `init_weights_update_group` first."}, status=400)
        if body.get("load_format") != LOAD_FORMAT:
            return web.json_response({"success": False, "message": f"load_format {body.get('load_format')!r}: "
                                      f"this server receives only {LOAD_FORMAT!r} buckets"}, status=400)
        from pearl.controlplane.weights.broadcast import ReceiveBuffers, receive_bucket, tensor_digests

        async with state.weights_lock:
            if body.get("abort_all_requests"):
                rt.interrupt("Aborted by update_weights_from_distributed")
            try:
                state.receive_buffers = state.receive_buffers or ReceiveBuffers()
                tensors = await asyncio.to_thread(receive_bucket, pg, list(body["names"]), list(body["dtypes"]),
                                                  [list(s) for s in body["shapes"]], state.receive_buffers)
            except (SnapshotError, TypeError, ValueError) as exc:
                return web.json_response({"success": False, "message": f"Failed to update parameter online: {exc}. "
                                          f"Kept version {state.weight_version}."}, status=400)
            # hashed beside the next bucket's transfer; folded in, in order, before a version is taken
            state.hashing.append(asyncio.get_running_loop().run_in_executor(None, tensor_digests, tensors,
                                                                            state.receive_buffers))
            message = f"Succeeded to update parameter online ({len(tensors)} tensors)."
            if body.get("weight_version") is not None:
                for pending in state.hashing:
                    state.tensors.update(await pending)
                state.hashing.clear()
                state.weights_checksum = manifest_digest(state.tensors)
                state.weight_version = str(body["weight_version"])
                state.weight_loads += 1
                message += f" Weight version updated to {state.weight_version}."
            if body.get("flush_cache", True):
                if not state.flushable(after_update=True):
                    return web.json_response({"success": False, "message": FLUSH_AFTER_UPDATE_REFUSED}, status=400)
                rt.flush_cache()
        return web.json_response({"success": True, "message": message})

    @routes.post("/destroy_weights_update_group")
    async def destroy_group(request: web.Request) -> web.Response:
        body = await _body(request, required=False)
        pg = state.groups.pop(str(body.get("group_name", DEFAULT_GROUP)), None)
        if pg is None:
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        from pearl.controlplane.weights.broadcast import leave_group

        await asyncio.to_thread(leave_group, pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_admin_auth(cfg.admin_api_key)])
    app.add_routes(routes)
    return app


def _perf(cfg: SimConfig) -> PerfModel:
    catalog = default_catalog()
    return PerfModel(catalog.model(cfg.model), catalog.gpu(cfg.gpu), cfg.tp, AGENTIC_LOAD)


async def serve(cfg: SimConfig) -> None:
    """Run one simulated server until SIGTERM or SIGINT."""
    perf = _perf(cfg)
    model_path = cfg.model_path or cfg.run_dir or str(Path.cwd())
    if cfg.model_path:
        snap = load_snapshot(cfg.model_path)  # a corrupt snapshot fails the start, naming the tensor
        print(f"weights: {snap.path} ({snap.tensors} tensors, {snap.checked} checksums verified)", file=sys.stderr)
    rt = RealtimeEngine(perf, cfg.role, cfg.speed, cfg.worker_id, cfg.capacity)
    # A real server's start-up runs from its launch, its own imports included: so does this one's.
    launched_s = max(0.0, time.time() - cfg.launched_at) * cfg.speed if cfg.launched_at is not None else 0.0
    state = SimState(cfg, rt, model_path, cfg.weight_version, cfg.fence, ready_at=cfg.startup_s - launched_s,
                     weights_checksum=manifest_digest(snap.manifest()) if cfg.model_path else None,
                     tensors=snap.manifest() if cfg.model_path else {},
                     decode_graphs=cfg.role is Role.DECODE)
    state.unpaused.set()
    runner = web.AppRunner(build_app(state), handle_signals=False, shutdown_timeout=5.0, access_log=None)
    await runner.setup()
    ports = [cfg.port] + ([cfg.bootstrap_port] if cfg.bootstrap_port else [])
    for port in ports:
        await web.TCPSite(runner, cfg.host, port, reuse_address=True).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"simworker {cfg.worker_id} ({cfg.role.value}, {cfg.model} tp{cfg.tp} on {cfg.gpu}, speed {cfg.speed}) "
          f"serving on http://{cfg.host}:{cfg.port}" + (f", bootstrap port {cfg.bootstrap_port}"
                                                         if cfg.bootstrap_port else ""), file=sys.stderr, flush=True)
    await stop.wait()
    state.stopping = True
    state.unpaused.set()
    aborted = rt.interrupt("the server is shutting down")
    print(f"simworker {cfg.worker_id}: SIGTERM, {aborted} in-flight requests answered as aborted",
          file=sys.stderr, flush=True)
    await asyncio.sleep(0.05)  # let the aborted handlers write their answers
    await runner.cleanup()
    await rt.close()


def config_dict(cfg: SimConfig) -> dict[str, Any]:
    return {**asdict(cfg), "role": cfg.role.value}
