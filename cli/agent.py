"""`pearlctl agent --node NAME [--driver sim|sglang]`: the node agent (agents/agent.py) until SIGTERM."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from pearl.controlplane.errors import BadInput

from .common import handle_errors, setup_logging
from .metrics import MetricsPort, start_metrics

# SGLang's --disaggregation-transfer-backend choices (0.5.23); a runtime role switch needs mooncake or mori
TRANSFER_BACKENDS = ("mooncake", "mori", "nixl", "ascend", "mooncake_tcp", "fake")


def register(app: typer.Typer) -> None:
    app.command("agent")(agent)


@handle_errors
def agent(
    node: Annotated[str, typer.Option("--node", help="The node this agent runs (its name in the inventory).")],
    driver: Annotated[str, typer.Option("--driver", help="sim (simulated SGLang servers) or sglang.")] = "sim",
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="Where the node's server records and logs live (default $PEARL_HOME/run/NODE).")] = None,
    speed: Annotated[float | None, typer.Option(
        "--speed", min=0.001, help="sim: simulated seconds per wall second (default: the inventory's time_scale).")]
    = None,
    sim_args: Annotated[str, typer.Option(
        "--sim-args", help="sim: extra `pearlctl simworker` options for every server, e.g. '--startup-s 60'.")] = "",
    model_path: Annotated[str | None, typer.Option(
        "--model-path", help="sglang: what a server loads before the trainer registered a snapshot (a Hugging Face "
                             "model folder or hub id).")] = None,
    transfer_backend: Annotated[str, typer.Option(
        "--transfer-backend", help="sglang: the KV transfer backend of split servers (role switch needs mooncake "
                                   "or mori).")] = "mooncake",
    ib_device: Annotated[str | None, typer.Option(
        "--ib-device", help="sglang: the RDMA devices of the KV transfer, e.g. 'mlx5_0,mlx5_1'.")] = None,
    sglang_python: Annotated[str | None, typer.Option(
        "--sglang-python", help="sglang: the Python that has SGLang installed (default: this one).")] = None,
    sglang_args: Annotated[str, typer.Option(
        "--sglang-args", help="sglang: extra `sglang.launch_server` options for every server, e.g. "
                              "'--mem-fraction-static 0.8'.")] = "",
    lease: Annotated[float, typer.Option("--lease-s", min=0.5, help="Lease of a step claim (seconds).")] = 20.0,
    poll: Annotated[float, typer.Option("--poll-s", min=0.01, help="Claim at least this often (seconds).")] = 1.0,
    max_steps: Annotated[int, typer.Option("--max-steps", min=1, help="Steps enacted at once.")] = 8,
    crash_after: Annotated[float, typer.Option(
        "--crash-after-s", min=0.5, help="An active worker's server gone (no process, no answer) this long has "
                                         "crashed: out of service, its GPUs free.")] = 10.0,
    json_logs: Annotated[bool, typer.Option("--json-logs", help="One JSON object per log line.")] = False,
    metrics_port: MetricsPort = None,
    reap: Annotated[bool, typer.Option(
        "--reap/--no-reap", help="Run the reaper's passes while this agent leads them (under per-component "
                                 "database roles they connect as the policy role; --no-reap keeps this agent "
                                 "to its node's role, and `pearlctl reap` from cron does it).")] = True,
) -> None:
    """Claim this node's plan steps and enact them through the driver; stops cleanly on SIGTERM (the
    steps in hand finish or are handed back) and loses nothing on SIGKILL (their leases expire and the
    reaper hands them to the next agent)."""
    from pearl.agents.agent import Agent, AgentConfig
    from pearl.agents.drivers import DRIVERS, make_driver
    from pearl.controlplane.core.inventory import check_node_name
    from pearl.controlplane.services.settings import get_settings
    from pearl.controlplane.store.db import require_schema
    from pearl.controlplane.store.secrets import control_token

    check_node_name("--node", node)
    if driver not in DRIVERS:
        raise BadInput(f"--driver: one of {', '.join(DRIVERS)}, not {driver!r}")
    if transfer_backend not in TRANSFER_BACKENDS:
        raise BadInput(f"--transfer-backend: one of {', '.join(TRANSFER_BACKENDS)}, not {transfer_backend!r}")
    setup_logging(json_logs)
    engine, reaper_engine = _engines(node, reap)
    stop_metrics = lambda: None  # noqa: E731
    try:
        require_schema(engine)
        stop_metrics = start_metrics(engine, "agent", metrics_port, node=node)
        token = control_token(engine)
        options: dict[str, Any] = {"admin_api_key": token}
        if driver == "sim":
            options["speed"] = speed or _time_scale(engine)
            options["extra_args"] = tuple(sim_args.split())
        else:
            options.update(model_path=model_path, transfer_backend=transfer_backend, ib_device=ib_device,
                           extra_args=tuple(shlex.split(sglang_args)))
            if sglang_python:
                options["python"] = sglang_python
        where = run_dir or Path(get_settings().home) / "run" / node
        the_driver = make_driver(driver, where, **options)
        the_agent = Agent(engine, AgentConfig(node=node, driver=driver, lease_s=lease, poll_s=poll,
                                              max_steps=max_steps, crash_after_s=crash_after),
                          the_driver, client=lambda endpoint, fence: _client(endpoint, fence, token),
                          front_door=lambda: _front_door(engine, token), reaper_engine=reaper_engine)
        handlers = {sig: signal.signal(sig, lambda *_: the_agent.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            the_agent.run()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    finally:
        stop_metrics()
        engine.dispose()
        if reaper_engine is not None and reaper_engine is not engine:
            reaper_engine.dispose()


def _engines(node: str, reap: bool) -> tuple[Any, Any]:
    """The agent's engine, as its node's role under per-component roles (created first on the embedded
    server, whose superuser may), and the reaper's: the policy role's, the same engine, or none."""
    from pearl.controlplane.services.settings import get_settings
    from pearl.controlplane.store import roles
    from pearl.controlplane.store.db import make_engine

    if roles.mode() == "url":
        engine = make_engine()
        return engine, engine if reap else None
    if not get_settings().database_url:
        owner = make_engine()
        try:
            roles.ensure_node_role(owner, node)
        finally:
            owner.dispose()
    engine = make_engine(component="agent", node=node)
    return engine, make_engine(component="policy") if reap else None


def _client(endpoint: str, fence: int, token: str) -> Any:
    from pearl.agents.server_client import ServerClient

    return ServerClient(endpoint, fence=fence, token=token)


def _front_door(engine: Any, token: str) -> Any:
    from pearl.agents.router_client import FleetFrontDoor

    return FleetFrontDoor(engine, token=token)


def _time_scale(engine: Any) -> float:
    from pearl.controlplane.store.db import transaction
    from pearl.controlplane.store.profile_store import fleet_inventory

    with transaction(engine) as session:
        return fleet_inventory(session).time_scale or 1.0
