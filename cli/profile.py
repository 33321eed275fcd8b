"""`pearlctl profile --model M [--gpu G] [--tp N] [--device cpu|cuda]`: time the model's layer kernels
on this device (torch) and store the fitted engine as a `measured` profile."""

from __future__ import annotations

from typing import Annotated

import typer
from pearl.controlplane.errors import BadInput

from .common import emit_json, err, handle_errors, out


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)


@handle_errors
def profile(
    model: Annotated[str, typer.Option("--model", help="Catalog model name (e.g. qwen3-8b).")],
    gpu: Annotated[str | None, typer.Option("--gpu", help="Catalog GPU this CUDA device is (e.g. h800); "
                                            "a CPU measurement is keyed gpu 'cpu'.")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor parallelism: one rank's shard is timed.")] = 1,
    device: Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda when torch sees "
                                               "one, else cpu).")] = None,
    scale: Annotated[float | None, typer.Option("--scale", help="Shape factor (default 1/8 on cpu, 1 on cuda).")]
    = None,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="Largest decode batch timed.")] = None,
    context: Annotated[int | None, typer.Option("--context", help="Context tokens of the timed iterations.")]
    = None,
    chunk: Annotated[int | None, typer.Option("--chunk", help="Prefill chunk tokens.")] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Timed runs per kernel (median kept).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure A, b and t_p with kernels shaped like the model's layers; store them as a measured profile."""
    from pearl.controlplane.core.catalog import default_catalog
    from pearl.controlplane.core.perfmodel import PerfModel
    from pearl.controlplane.core.profile import ProfileKey
    from pearl.controlplane.measure.kernels import CPU_SCALE, MeasureSpec, ffn_width, import_torch, measure
    from pearl.controlplane.store.db import make_engine, require_schema, transaction
    from pearl.controlplane.store.profile_store import save_measured

    # (scale, max batch, context, prefill chunk, repeats) when not given
    defaults = {"cpu": (CPU_SCALE, 64, 1024, 256, 5), "cuda": (1.0, 512, 4096, 2048, 10)}
    spec_model = default_catalog().model(model)
    torch = import_torch()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in defaults:
        raise BadInput(f"--device: must be cpu or cuda, got {device!r}")
    perf = None
    if device == "cuda":
        if gpu is None:
            raise BadInput("--gpu: name the catalog GPU this CUDA device is (e.g. --gpu h800)")
        perf = PerfModel(spec_model, default_catalog().gpu(gpu), tp)
    elif gpu not in (None, "cpu"):
        raise BadInput(f"--gpu: a CPU measurement is keyed gpu 'cpu', not {gpu!r} (use --device cuda on that GPU)")
    d_scale, d_batch, d_context, d_chunk, d_repeats = defaults[device]
    spec = MeasureSpec(device=device, scale=scale if scale is not None else d_scale, tp=tp,
                       max_batch=max_batch or d_batch, context_tokens=context or d_context,
                       chunk_tokens=chunk or d_chunk, repeats=repeats or d_repeats)
    key = ProfileKey(model, gpu or "cpu", tp, device)
    engine = make_engine(component="policy")
    try:
        require_schema(engine)  # before minutes of timing, not after
        with err.status(f"timing {model} kernels on {device}", spinner="dots") as status:
            result = measure(spec_model, spec, perf if spec.scale == 1 else None,
                             progress=lambda what: status.update(f"timing {model} on {device}: {what}"))
        with transaction(engine, actor="pearlctl profile", reason=f"{model} on {device}") as session:
            row_id = save_measured(session, key, result.engine, result.as_dict())
    finally:
        engine.dispose()
    sym = result.method_symbols()
    shape = result.shape
    scaled_note = (f"scaled-down shape (x{spec.scale:g}: hidden {shape.hidden} of {spec_model.hidden}, "
                   f"{shape.q_heads} of {spec_model.q_heads // tp} q heads, FFN {shape.ffn} of "
                   f"{ffn_width(spec_model) // tp}): these timings describe this {device} running the scaled "
                   "shape, not the model itself, so the row is kept as history and never planned with"
                   if result.scaled else "the model's full shape (one TP rank)")
    if as_json:
        emit_json({"profile_id": row_id, "key": {"model": key.model, "gpu": key.gpu, "tp": key.tp,
                                                 "device": key.device},
                   "provenance": "measured", "note": scaled_note, **result.as_dict()})
        return
    out.print(f"{model} on {result.device_name} ({device}): {scaled_note}", highlight=False)
    out.print(f"A = {sym['A'] * 1e3:.3f} ms, b = {sym['b'] * 1e3:.4f} ms per sequence (around {sym['batch_hint']:g} "
              f"sequences), t_p = {sym['t_p'] * 1e6:.2f} us per token, at {sym['context_tokens']:g} context tokens; "
              f"measured in {result.seconds:.1f} s", highlight=False)
    out.print(f"stored as measured profile row {row_id} for ({key.model}, {key.gpu}, tp {key.tp}, {key.device})",
              highlight=False)
