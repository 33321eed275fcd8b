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
