"""`pearlctl`: the root Typer app. Each command group lives in its own module and registers here."""

from __future__ import annotations

import os

# One BLAS thread, in this process and the ones it starts, unless the caller chose: the decision core's
# matrix products are small, one thread computes them as fast, and idle OpenBLAS threads spin on the
# cores the agents, servers and PostgreSQL need (a simulation took twice the CPU for the same wall time).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import typer  # noqa: E402

app = typer.Typer(
    name="pearlctl",
    help="pearl: a control plane for agentic RL rollout on GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # One line per command module; each module exposes `register(app)`.
    from pearl.cli import sim

    sim.register(app)
    from pearl.cli import cluster, db, init, status

    db.register(app)
    init.register(app)
    cluster.register(app)
    status.register(app)
    from pearl.cli import apply, check, dashboard, event, plan, policy, profile, reap

    plan.register(app)
    policy.register(app)
    apply.register(app)
    event.register(app)
    profile.register(app)
    reap.register(app)
    check.register(app)
    dashboard.register(app)
    from pearl.cli import agent, demo, router, simworker, worker

    agent.register(app)
    demo.register(app)
    simworker.register(app)
    router.register(app)
    worker.register(app)


_register()


def main() -> None:
    """The console script: under `--json`, a usage error is a JSON object on stdout too; no command
    ends in a traceback (PEARL_DEBUG=1 shows one for an internal error)."""
    import os
    import sys

    from .common import fail, is_usage_error, usage_field

    as_json = "--json" in sys.argv[1:]
    try:
        code = app(standalone_mode=False) if as_json else app()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:
        if as_json and is_usage_error(exc):
            raise SystemExit(fail(exc.format_message(), exc.exit_code, True, usage_field(exc)).exit_code) from None
        if os.environ.get("PEARL_DEBUG"):
            raise
        message = f"internal error: {type(exc).__name__}: {exc} (PEARL_DEBUG=1 shows the traceback)"
        raise SystemExit(fail(message, 1, as_json).exit_code) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
