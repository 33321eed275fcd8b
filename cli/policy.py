"""`pearlctl tick` (one policy pass, safe from cron) and `pearlctl loop` (the long-running leader)."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from .common import emit_json, handle_errors, out, setup_logging
from .metrics import MetricsPort, start_metrics

Manual = Annotated[bool, typer.Option("--manual", help="Borrowing and PD changes wait for `pearlctl apply`; "
                                                       "returns and drains before a deadline still apply.")]


def register(app: typer.Typer) -> None:
    app.command("tick")(tick_command)
    app.command("loop")(loop_command)


@handle_errors
def tick_command(
    manual: Manual = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """One policy pass: observe, decide, plan, apply what the policy allows. Safe under cron at any
    rate and with several copies at once."""
    from pearl.controlplane.store.db import make_engine, require_schema
    from pearl.policies.live.tick import tick

    engine = make_engine(component="policy")
    try:
        require_schema(engine)
        result = tick(engine, manual=manual)
    finally:
        engine.dispose()
    if as_json:
        emit_json(result.as_dict())
    else:
        out.print(result.note, highlight=False, markup=False)


@handle_errors
def loop_command(
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="A pass at least this often (seconds).")]
    = 10.0,
    lease: Annotated[float, typer.Option("--lease-s", min=0.3,
                                         help="Leadership lapses this long after the leader's last renewal.")] = 15.0,
    manual: Manual = False,
    json_logs: Annotated[bool, typer.Option("--json-logs", help="One JSON object per log line.")] = False,
    metrics_port: MetricsPort = None,
) -> None:
    """Lead the policy loop: a pass on every report from the trainer, the rollout or the provider, and
    at least every --interval seconds. Another copy takes over when this one dies."""
    from pearl.policies.live.loop import LoopConfig, PolicyLoop

    if lease <= interval / 3 and lease < 1:
        raise typer.BadParameter("must be longer than a third of --interval", param_hint="--lease-s")
    setup_logging(json_logs)
    from pearl.controlplane.store.db import make_engine, require_schema

    engine = make_engine(component="policy")
    stop_metrics = lambda: None  # noqa: E731
    try:
        require_schema(engine)
        from pearl.controlplane.store.fleet_metrics import FleetCollector

        stop_metrics = start_metrics(engine, "loop", metrics_port, extra=(FleetCollector(engine),))
        loop = PolicyLoop(engine, LoopConfig(interval_s=interval, lease_s=lease, manual=manual))
        signal.signal(signal.SIGTERM, lambda *_: loop.stop())
        signal.signal(signal.SIGINT, lambda *_: loop.stop())
        loop.run()
    finally:
        stop_metrics()
        engine.dispose()
