"""`pearlctl sim run | compare | ratio`: the simulator from the command line."""

from __future__ import annotations

import typer

sim_app = typer.Typer(help="Simulate a scenario: one system, all systems, or the PD-ratio table.",
                      no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(sim_app, name="sim")
