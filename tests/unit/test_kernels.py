"""The kernel measurement's shapes and options (pure: no torch needed)."""

from __future__ import annotations

import pytest
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.errors import BadInput
from pearl.controlplane.measure.kernels import MeasureSpec, ffn_width, layer_shape

pytestmark = pytest.mark.unit


def test_ffn_width_carries_the_linear_flops_of_a_layer() -> None:
    m = default_catalog().model("qwen3-8b")
    ffn = ffn_width(m)
    attention = m.hidden * m.head_dim * (2 * m.q_heads + 2 * m.kv_heads)
    # the layer's weights times 2 FLOPs, times the layers, give back the catalog's linear FLOPs
    assert 2 * m.layers * (attention + 3 * m.hidden * ffn) == pytest.approx(m.linear_flops_per_token, rel=1e-3)
    # the published FFN (12288) plus the LM head's share spread over the layers
    assert 12288 < ffn < 12288 * 1.15


def test_a_tp_rank_and_a_scaled_shape() -> None:
    m = default_catalog().model("qwen3-8b")
    full = layer_shape(m, tp=2, scale=1.0, dtype="bfloat16")
    assert (full.hidden, full.q_heads, full.kv_heads, full.head_dim) == (4096, 16, 4, 128)
    assert full.ffn == round(ffn_width(m) / 2) and full.layers == 36
    assert full.kv_bytes_per_token * 2 == m.kv_bytes_per_token  # both ranks together hold the model's KV
    small = layer_shape(m, tp=1, scale=1 / 8, dtype="float32")
    assert (small.hidden, small.q_heads, small.kv_heads, small.head_dim) == (512, 4, 1, 128)
    with pytest.raises(BadInput, match="--tp: 3 does not divide the heads of qwen3-8b"):
        layer_shape(m, tp=3, scale=1.0, dtype="bfloat16")


@pytest.mark.parametrize(("changes", "field"), [
    ({"device": "tpu"}, "--device"), ({"scale": 0.0}, "--scale"), ({"scale": 2.0}, "--scale"),
    ({"max_batch": 1}, "--max-batch"), ({"repeats": 0}, "--repeats"), ({"context_tokens": 8}, "--context"),
    ({"chunk_tokens": 0}, "--chunk:"),
])
def test_measure_options_are_checked_naming_the_option(changes: dict, field: str) -> None:
    with pytest.raises(BadInput, match=field):
        MeasureSpec(**{"device": "cpu", "scale": 0.5, **changes})


def test_a_stack_of_layers_is_chained_with_one_sync_per_sample() -> None:
    """The method: the layers run back to back, each feeding the next, and the clock stops after one
    synchronisation per sample, never one per layer (which would time kernel launches)."""
    from pearl.controlplane.measure.kernels import time_stack

    calls: list[str] = []
    seconds, how = time_stack(lambda x: calls.append("layer") or x + 1, 0, chain=36, repeats=5,
                              sync=lambda: calls.append("sync"))
    assert how == "chained" and seconds >= 0
    samples = "".join("L" if c == "layer" else "S" for c in calls).split("S")[:-1]
    assert len(samples) == 6 and all(s == "L" * 36 for s in samples)  # a warm-up, then 5 samples


def test_a_captured_graph_is_replayed_and_a_failed_capture_runs_eagerly() -> None:
    from pearl.controlplane.measure.kernels import time_stack

    replays: list[int] = []

    def capture(stack):
        stack()  # captured once
        return lambda: replays.append(1)

    _, how = time_stack(lambda x: x, 0, chain=4, repeats=3, sync=lambda: None, graph=capture)
    assert how == "cuda-graph" and len(replays) == 4

    def failing(stack):
        raise RuntimeError("capture failed")

    layers: list[int] = []
    _, how = time_stack(lambda x: layers.append(1) or x, 0, chain=4, repeats=3, sync=lambda: None, graph=failing)
    assert how == "chained" and len(layers) == 16


def test_a_mixture_of_experts_layer_has_every_expert_at_its_own_width() -> None:
    m = default_catalog().model("qwen3-30b-a3b")
    full = layer_shape(m, tp=1, scale=1.0, dtype="bfloat16")
    assert (full.experts, full.experts_active, full.ffn) == (128, 8, 768)
    assert layer_shape(m, tp=2, scale=1.0, dtype="bfloat16").ffn == 384  # TP splits each expert
    assert layer_shape(default_catalog().model("qwen3-8b"), 1, 1.0, "bfloat16").experts == 0


@pytest.mark.parametrize("tokens", [1, 8, 32, 64])
def test_routing_sends_each_token_to_k_experts_and_touches_the_formulas_count(tokens: int) -> None:
    from pearl.controlplane.measure.kernels import routing

    touched = []
    for seed in range(20):
        routes = routing(tokens, 128, 8, seed)
        per_token = [sum(t in r for r in routes) for t in range(tokens)]
        assert per_token == [8] * tokens
        touched.append(sum(1 for r in routes if r))
    expected = 128 * (1 - (1 - 8 / 128) ** tokens)  # docs/calibration.md, MoE decode
    assert sum(touched) / len(touched) == pytest.approx(expected, rel=0.1)


def test_the_moe_layer_runs_its_routed_experts_and_chains_on_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    from pearl.controlplane.measure.kernels import _Layer, routing

    m = default_catalog().model("qwen3-30b-a3b")
    shape = layer_shape(m, tp=1, scale=1 / 16, dtype="float32")
    layer = _Layer(torch, shape, torch.device("cpu"), torch.float32)
    step, x = layer.decode(8, 32)
    with torch.inference_mode():
        y = step(step(x))  # layers chain: hidden states in, hidden states out
    assert y.shape == x.shape
    assert [e for e, _ in layer.touched(8)] == [e for e, r in enumerate(routing(8, 128, 8)) if r]


@pytest.mark.slow
def test_a_cpu_measurement_of_a_mixture_of_experts_times_the_chained_stack() -> None:
    pytest.importorskip("torch")
    from pearl.controlplane.measure.kernels import MeasureSpec, measure

    m = default_catalog().model("qwen3-30b-a3b")
    spec = MeasureSpec(device="cpu", scale=1 / 16, max_batch=4, context_tokens=64, chunk_tokens=32, repeats=1)
    result = measure(m, spec)
    assert result.timing == "chained" and result.shape.experts == 128
    assert result.decode_s[4][0] > 0 and result.as_dict()["timing"] == "chained"
