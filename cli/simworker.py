"""`pearlctl simworker`: run one simulated SGLang server (agents/simworker.py) until SIGTERM."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer
from pearl.controlplane.errors import BadInput

from .common import handle_errors


def register(app: typer.Typer) -> None:
    app.command("simworker")(simworker)


@handle_errors
def simworker(
    port: Annotated[int, typer.Option(help="HTTP port of the server.")],
    host: Annotated[str, typer.Option(help="Address to bind and to be reached at.")] = "127.0.0.1",
    role: Annotated[str, typer.Option(help="colocated, prefill or decode.")] = "colocated",
    model: Annotated[str, typer.Option(help="Catalog model (timing and served name).")] = "qwen3-8b",
    gpu: Annotated[str, typer.Option(help="Catalog GPU (timing).")] = "h100",
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    worker_id: Annotated[int, typer.Option(help="The worker slot it serves.")] = 0,
    generation: Annotated[int, typer.Option(help="The worker's generation.")] = 1,
    fence: Annotated[int, typer.Option(help="Fencing token of the launching step; older commands get 409.")] = 0,
    speed: Annotated[float, typer.Option(help="Time compression: simulated seconds per wall second.")] = 1.0,
    bootstrap_port: Annotated[int | None, typer.Option(help="KV bootstrap port (split roles).")] = None,
    model_path: Annotated[str | None, typer.Option(help="Weight snapshot to check and load at start.")] = None,
    weight_version: Annotated[str, typer.Option(help="Weight version reported by /model_info.")] = "default",
    enable_memory_saver: Annotated[bool, typer.Option(help="Allow release/resume of memory.")] = False,
    enable_weights_cpu_backup: Annotated[bool, typer.Option(
        help="Keep a CPU copy of the weights across release/resume (else they come back uninitialised).")] = False,
    enable_pd_role_switch: Annotated[bool, typer.Option(help="Allow prefill <-> decode in place.")] = False,
    startup_s: Annotated[float, typer.Option(help="Simulated start-up time, from the launch (--launched-at), "
                                                  "before /health answers 200.")] = 0.0,
    launched_at: Annotated[float | None, typer.Option(help="When the launcher started it (epoch seconds); "
                                                     "the start-up runs from then. Default: now.")] = None,
    weight_load_s: Annotated[float, typer.Option(help="Simulated time of a snapshot load.")] = 2.0,
    role_switch_s: Annotated[float, typer.Option(help="Simulated time of a role switch.")] = 1.0,
    admin_api_key: Annotated[str | None, typer.Option(
        help="As SGLang's: commands need it as a bearer token (default: from $PEARL_ADMIN_API_KEY_FILE, a file "
             "holding it, else none).")] = None,
    decode_graph_gb: Annotated[float, typer.Option(help="Memory of its decode CUDA graphs (GB).")] = 2.0,
    graph_headroom_gb: Annotated[float, typer.Option(help="Memory a graph capture on a flip to decode may "
                                                          "take (GB).")] = 8.0,
    capacity: Annotated[int | None, typer.Option(help="KV cache tokens (default: the performance model's).")]
    = None,
    run_dir: Annotated[str | None, typer.Option(help="Local directory reported as model_path without a snapshot.")]
    = None,
) -> None:
    """Serve SGLang's HTTP API with generation timed by the performance model."""
    from pearl.agents.simworker import SimConfig, serve
    from pearl.controlplane.core.catalog import default_catalog
    from pearl.controlplane.core.domain import ROLLOUT_ROLES, Role

    try:
        the_role = Role(role)
    except ValueError:
        raise BadInput(f"--role: one of colocated, prefill, decode, not {role!r}") from None
    if the_role not in ROLLOUT_ROLES:
        raise BadInput(f"--role: one of colocated, prefill, decode, not {role!r}")
    catalog = default_catalog()
    catalog.model(model)
    catalog.gpu(gpu)
    for name, value in (("--port", port), ("--bootstrap-port", bootstrap_port)):
        if value is not None and not 0 < value < 65536:
            raise BadInput(f"{name}: a TCP port (1-65535), not {value}")
    if the_role is Role.PREFILL and bootstrap_port is None:
        raise BadInput("--bootstrap-port: a prefill server needs one (decode servers pull the KV there)")
    if speed <= 0:
        raise BadInput(f"--speed: must be positive, not {speed}")
    if tp < 1:
        raise BadInput(f"--tp: at least 1, not {tp}")
    if launched_at is not None and not 0 < launched_at <= time.time() + 60:
        raise BadInput(f"--launched-at: epoch seconds no later than now, not {launched_at}")
    for name, value in (("--decode-graph-gb", decode_graph_gb), ("--graph-headroom-gb", graph_headroom_gb)):
        if value < 0:
            raise BadInput(f"{name}: at least 0, not {value}")
    if capacity is not None and capacity < 1:
        raise BadInput(f"--capacity: at least 1 token, not {capacity}")
    cfg = SimConfig(port=port, host=host, role=the_role, model=model, gpu=gpu, tp=tp, worker_id=worker_id,
                    generation=generation, fence=fence, speed=speed, bootstrap_port=bootstrap_port,
                    model_path=model_path, weight_version=weight_version, enable_memory_saver=enable_memory_saver,
                    enable_weights_cpu_backup=enable_weights_cpu_backup, enable_pd_role_switch=enable_pd_role_switch,
                    startup_s=startup_s, launched_at=launched_at,
                    weight_load_s=weight_load_s, role_switch_s=role_switch_s, decode_graph_gb=decode_graph_gb,
                    graph_headroom_gb=graph_headroom_gb, capacity=capacity, run_dir=run_dir,
                    admin_api_key=admin_api_key or _key_from_file())
    import asyncio

    asyncio.run(serve(cfg))


def _key_from_file() -> str | None:
    """The admin API key a launcher left in a file (`PEARL_ADMIN_API_KEY_FILE`), so that it is not on the
    command line for every user of the node to read."""
    path = os.environ.get("PEARL_ADMIN_API_KEY_FILE", "").strip()
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as exc:
        raise BadInput(f"PEARL_ADMIN_API_KEY_FILE: {path}: {exc.strerror or exc}") from None


if __name__ == "__main__":  # `python -m pearl.cli.simworker ...` is `pearlctl simworker ...` without the other commands
    typer.run(simworker)

