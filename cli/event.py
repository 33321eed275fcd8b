"""`pearlctl event ...`: what the trainer and the provider report. `event telemetry FILE.json` ingests
one rollout step's telemetry and refits the profile."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from pearl.controlplane.errors import BadInput

from .common import MAX_ID, emit_json, handle_errors, out

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
StepOption = Annotated[int, typer.Option("--step", min=0, max=MAX_ID, help="The step's number.")]
NodeOption = Annotated[str, typer.Option("--node", help="The preemptible node (its name in the inventory).")]
GpusOption = Annotated[str | None, typer.Option("--gpus", help="Device indices on the node, e.g. 0,1 (default: all).")]

event_app = typer.Typer(help="Events from the trainer, the provider and the rollout.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(event_app, name="event")


@event_app.command("telemetry")
@handle_errors
def telemetry(
    file: Annotated[Path, typer.Argument(help="One rollout step's telemetry (JSON, docs/formats.md).")],
    makespan_s: Annotated[float | None, typer.Option(
        "--makespan-s", help="The step's measured makespan: T_over is refit against the running configuration.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Store one step's telemetry and refit the fleet's profile (a step already ingested: no-op if identical)."""
    from pearl.controlplane.core.telemetry import load_telemetry
    from pearl.controlplane.store.db import make_engine, require_schema
    from pearl.controlplane.store.telemetry_store import ingest_telemetry

    step = load_telemetry(file)  # bad telemetry is refused before the database is touched
    if makespan_s is not None and not (math.isfinite(makespan_s) and makespan_s > 0):
        raise BadInput(f"--makespan-s: must be a finite number > 0, got {makespan_s}")
    engine = make_engine(component="policy")
    try:
        require_schema(engine)
        result = ingest_telemetry(engine, step, makespan_s=makespan_s, actor="pearlctl event telemetry")
    finally:
        engine.dispose()
    if as_json:
        emit_json(result.as_dict())
    elif result.outcome == "unchanged":
        out.print(f"{file}: step {result.step} was already ingested (telemetry row {result.telemetry_id}); "
                  "nothing changed")
    else:
        sym = result.symbols
        out.print(f"{file}: step {result.step} ingested (telemetry row {result.telemetry_id}); fitted profile row "
                  f"{result.profile_id} from row {result.based_on}: S={sym['S']:.1f} r={sym['r']:.0f} "
                  f"dL={sym['dL']:.0f} f={sym['f']:.2f} T_over={sym['T_over']:.3f}s", highlight=False)


def _devices(gpus: str | None) -> list[int] | None:
    if gpus is None:
        return None
    try:
        devices = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"--gpus: a comma-separated list of device indices, got {gpus!r}") from None
    if not devices or min(devices) < 0 or max(devices) >= 1024:
        raise BadInput(f"--gpus: a comma-separated list of device indices from 0 to 1023, got {gpus!r}")
    return devices


def _control_plane():
    from pearl.controlplane.api import ControlPlane

    return ControlPlane()


@event_app.command("training-begin")
@handle_errors
def training_begin(
    step: StepOption,
    wait: Annotated[float, typer.Option("--wait", min=0.0, help="Seconds to wait for borrowed GPUs to come back "
                                                                  "(exit 1 if they are not back by then).")] = 60.0,
    as_json: JsonOption = False,
) -> None:
    """The trainer wants optimizer step N to begin: borrowed GPUs come back first (the lateness is recorded)."""
    with _control_plane() as cp:
        started = cp.training_begin(step, wait_s=wait, actor="pearlctl event training-begin")
    if as_json:
        emit_json({"step": step, "started": started.started, "waited_s": round(started.waited_s, 3),
                   "late_s": started.late_s})
    else:
        late = f"; late returns delayed it {started.late_s:.2f} s" if started.late_s else ""
        out.print(f"training step {step} started after {started.waited_s:.2f} s{late}", highlight=False)


@event_app.command("training-end")
@handle_errors
def training_end(
    step: StepOption,
    weights_version: Annotated[int | None, typer.Option("--weights-version", min=0, max=MAX_ID,
                                                        help="The weights version the step produced.")] = None,
    snapshot: Annotated[str | None, typer.Option("--snapshot", help="Where its weights are: a snapshot directory "
                                                 "(safetensors and manifest.json), a path or file:// URI; checked "
                                                 "against its manifest, then every serving worker is synced.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Optimizer step N ended: its GPUs may be lent again; the new weights reach every worker."""
    with _control_plane() as cp:
        syncs = cp.training_end(step, weights_version=weights_version, snapshot=snapshot,
                                actor="pearlctl event training-end")
    if as_json:
        emit_json({"step": step, "weights_version": weights_version, "snapshot": snapshot, "syncs": len(syncs)})
    else:
        out.print(f"training step {step} ended" + (f" (weights version {weights_version})"
                                                   if weights_version is not None else ""), highlight=False)


@event_app.command("rollout-progress")
@handle_errors
def rollout_progress(
    step: StepOption,
    finished: Annotated[int, typer.Option("--finished", min=0, max=MAX_ID,
                                          help="Trajectories of the step finished so far.")],
    batch_size: Annotated[int | None, typer.Option("--batch-size", min=1, max=MAX_ID,
                                                   help="Trajectories in the step (its first report).")] = None,
    in_flight: Annotated[int | None, typer.Option(
        "--in-flight", min=0, max=MAX_ID,
        help="Trajectories of every batch being rolled out now (with asynchronous batching, the next "
             "batch's too): the fleet's load.")] = None,
    as_json: JsonOption = False,
) -> None:
    """How far rollout step N is: the live R of the borrowing gate."""
    with _control_plane() as cp:
        cp.rollout_progress(step, finished, batch_size, in_flight=in_flight, actor="pearlctl event rollout-progress")
    if as_json:
        emit_json({"step": step, "finished": finished, "batch_size": batch_size, "in_flight": in_flight})
    else:
        out.print(f"rollout step {step}: {finished} finished", highlight=False)


@event_app.command("gpus-granted")
@handle_errors
def gpus_granted(node: NodeOption, gpus: GpusOption = None, as_json: JsonOption = False) -> None:
    """The provider granted a preemptible node's GPUs."""
    devices = _devices(gpus)
    with _control_plane() as cp:
        granted = cp.gpus_granted(node, devices, actor="pearlctl event gpus-granted")
    if as_json:
        emit_json({"node": node, "granted": granted})
    else:
        out.print(f"{node}: {len(granted)} GPU(s) granted", highlight=False)


@event_app.command("gpus-revoked")
@handle_errors
def gpus_revoked(
    node: NodeOption,
    gpus: GpusOption = None,
    notice_s: Annotated[float, typer.Option("--notice-s", min=0.0,
                                            help="Seconds until the GPUs are taken (0: now).")] = 0.0,
    as_json: JsonOption = False,
) -> None:
    """The provider takes a preemptible node's GPUs back after a notice: they are drained and released first."""
    devices = _devices(gpus)
    with _control_plane() as cp:
        revoked = cp.gpus_revoked(node, devices, notice_s=notice_s, actor="pearlctl event gpus-revoked")
    if as_json:
        emit_json({"node": node, "gpus": revoked, "notice_s": notice_s})
    else:
        out.print(f"{node}: {len(revoked)} GPU(s) revoked in {notice_s:g} s", highlight=False)
