"""`pearlctl`: the root Typer app. Each command group lives in its own module and registers here."""

from __future__ import annotations

import typer

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
    from pearl.cli import apply, event, plan, policy, profile, reap

    plan.register(app)
    policy.register(app)
    apply.register(app)
    event.register(app)
    profile.register(app)
    reap.register(app)
    from pearl.cli import agent, demo, router, simworker, worker

    agent.register(app)
    demo.register(app)
    simworker.register(app)
    router.register(app)
    worker.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
