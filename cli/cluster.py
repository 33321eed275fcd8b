"""`pearlctl cluster import FILE.yaml`: load an inventory (docs/formats.md), all or nothing."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from .common import emit_json, handle_errors, out, plural

cluster_app = typer.Typer(help="The cluster inventory: nodes, GPUs and worker slots.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")


@cluster_app.command("import")
@handle_errors
def import_(
    file: Annotated[Path, typer.Argument(help="Inventory YAML (model, gpu, tp, nodes[, workload]).")],
    replace: Annotated[bool, typer.Option("--replace", help="Replace a different inventory already imported.")]
    = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Import an inventory; the same file again changes nothing."""
    from pearl.controlplane.core.inventory import load_inventory
    from pearl.controlplane.store.db import make_engine, require_schema, transaction
    from pearl.controlplane.store.inventory_import import import_inventory

    inventory = load_inventory(file)  # bad input is refused before the database is touched
    engine = make_engine()
    try:
        require_schema(engine)
        with transaction(engine, actor="pearlctl cluster import", reason=str(file)) as session:
            result = import_inventory(session, inventory, replace=replace)
    finally:
        engine.dispose()
    if as_json:
        emit_json(asdict(result))
    elif result.outcome == "unchanged":
        out.print(f"{file}: already imported; nothing changed (state_version {result.state_version})", highlight=False)
    else:
        out.print(f"{file}: {result.outcome} {plural(result.nodes, 'node')}, {plural(result.gpus, 'GPU')}, "
                  f"{plural(result.workers, 'worker slot')} (state_version {result.state_version})", highlight=False)
