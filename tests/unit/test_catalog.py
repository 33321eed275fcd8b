"""The catalog: the shipped models and GPUs, and YAML files that extend or override them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from pearl.controlplane.core.catalog import default_catalog, load_catalog
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.errors import BadInput

pytestmark = pytest.mark.unit

QWEN3_14B = {  # the published config.json shape
    "hidden": 5120, "layers": 40, "q_heads": 40, "kv_heads": 8, "head_dim": 128, "params": 14.8e9,
    "active_params": 14.8e9, "weight_bytes": 29.5e9, "kv_bytes_per_token": 163840,
    "linear_flops_per_token": 28.0e9, "attention_flops_per_token_per_ctx": 0.82e6,
}  # fmt: skip


def write(path: Path, raw: object) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_shipped_catalog_has_the_four_qwen3_models_and_four_gpus():
    cat = load_catalog()
    assert {"qwen3-4b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"} <= set(cat.models)
    assert {"h100", "h200", "h800", "a100"} <= set(cat.gpus)
    moe = cat.model("qwen3-30b-a3b")
    assert moe.is_moe and (moe.experts, moe.experts_active) == (128, 8)
    assert not cat.model("qwen3-8b").is_moe
    # KV bytes per token = 2 x layers x KV heads x head_dim x 2 bytes (docs/calibration.md)
    for m in (cat.model(n) for n in ("qwen3-4b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b")):
        assert m.kv_bytes_per_token == 2 * m.layers * m.kv_heads * m.head_dim * 2


def test_a_yaml_file_adds_a_model_and_overrides_a_gpu(tmp_path):
    extra = write(tmp_path / "site.yaml", {
        "models": {"qwen3-14b": QWEN3_14B},
        "gpus": {"h800": {"bf16_tflops": 989, "hbm_gb": 80, "hbm_tbps": 3.35, "nvlink_gbps": 300, "nic_gbps": 50}},
    })  # fmt: skip
    cat = load_catalog((extra,))
    assert cat.model("qwen3-14b").layers == 40 and cat.model("qwen3-8b").layers == 36  # added, shipped kept
    assert (cat.gpu("h800").nic_gbps, load_catalog().gpu("h800").nic_gbps) == (50, 40)  # overridden here only
    # the performance model reads the added entry like a shipped one
    shipped = PerfModel(cat.model("qwen3-8b"), cat.gpu("h800"), 2)
    added = PerfModel(cat.model("qwen3-14b"), cat.gpu("h800"), 2)
    assert added.decode_step_time(32, 2048) > shipped.decode_step_time(32, 2048)
    assert 0 < added.kv_capacity_tokens < shipped.kv_capacity_tokens


def test_pearl_catalog_names_the_extra_files(tmp_path, monkeypatch):
    first = write(tmp_path / "a.yaml", {"models": {"qwen3-14b": QWEN3_14B}})
    second = write(tmp_path / "b.yaml", {"models": {"qwen3-14b": {**QWEN3_14B, "layers": 41}}})
    monkeypatch.setenv("PEARL_CATALOG", f"{first}{os.pathsep}{second}")
    default_catalog.cache_clear()
    try:
        assert default_catalog().model("qwen3-14b").layers == 41  # later files win
    finally:
        default_catalog.cache_clear()


@pytest.mark.parametrize(("raw", "message"), [
    ({"model": {}}, "unknown catalog keys ['model']"),
    ({"models": {"tiny": {**QWEN3_14B, "layers": 0}}}, "models.tiny"),
    ({"models": {"tiny": {**QWEN3_14B, "colour": "red"}}}, "models.tiny"),
    ({"gpus": {"b200": {"bf16_tflops": 2250}}}, "gpus.b200"),
])  # fmt: skip
def test_bad_catalog_files_are_refused_naming_the_entry(tmp_path, raw, message):
    path = write(tmp_path / "bad.yaml", raw)
    with pytest.raises(BadInput, match="bad.yaml") as refused:
        load_catalog((path,))
    assert message in str(refused.value)


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(BadInput, match=r"model: unknown model 'gpt-9' \(known: .*qwen3-8b"):
        load_catalog().model("gpt-9")
    with pytest.raises(BadInput, match=r"gpu: unknown GPU 'b300' \(known: a100, h100, h200, h800"):
        load_catalog().gpu("b300")
