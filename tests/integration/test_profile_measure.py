"""`pearlctl profile`: torch kernels shaped like the model's layers, timed and stored as a measured
profile. The CPU run uses a tiny shape (skipped without torch); the full shape runs where CUDA exists."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from pearl.controlplane.core.profile import DECODE_BATCHES, ProfileKey
from pearl.controlplane.store import profile_store
from pearl.controlplane.store.schema import Profile as ProfileRow
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

pytestmark = pytest.mark.integration

TINY = ("--scale", "0.03", "--max-batch", "4", "--context", "64", "--chunk", "32", "--repeats", "2")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def stored(database_url: str, key: ProfileKey) -> ProfileRow | None:
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with Session(engine) as session:
            return profile_store.current_row(session, key)
    finally:
        engine.dispose()


def test_a_cpu_measurement_is_stored_under_its_own_key(pearlctl: Callable, database_url: str) -> None:
    pytest.importorskip("torch")
    done = pearlctl("profile", "--model", "qwen3-8b", "--device", "cpu", *TINY, "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["key"] == {"model": "qwen3-8b", "gpu": "cpu", "tp": 1, "device": "cpu"} and out["scaled"] is True
    assert "scaled-down shape" in out["note"] and out["shape"]["hidden"] == 123
    assert "kept as history and never planned with" in out["note"]
    assert out["timing"] == "chained"  # on the CPU the layers run chained, one sync per sample
    # a decode step costs something; how it splits between A and b is timing noise at this scale on a
    # loaded CPU (the fit may put it all in b)
    A, b = out["symbols"]["A"], out["symbols"]["b"]  # noqa: N806
    assert A >= 0 and b >= 0 and A + b > 0 and out["symbols"]["t_p"] > 0
    assert all(t > 0 for times in out["decode_s"].values() for t in times)
    assert sorted(int(n) for n in out["decode_s"]) == [1, 2, 4] and out["extrapolated"][0] == 8
    row = stored(database_url, ProfileKey("qwen3-8b", "cpu", 1, "cpu"))
    assert row is not None and row.id == out["profile_id"] and row.provenance.value == "measured"
    engine = profile_store.measured_engine(row)
    assert engine.decode_batches == DECODE_BATCHES and engine.decode_s_per_ctx_token >= 0
    assert list(engine.decode_base_s) == sorted(engine.decode_base_s)
    assert engine.kv_capacity_tokens > 0 and engine.kv_bandwidth_bps > 0
    # the fleet's GPUs never see a CPU measurement
    assert stored(database_url, ProfileKey("qwen3-8b", "h800", 1, "cuda")) is None
    text_run = pearlctl("profile", "--model", "qwen3-8b", "--device", "cpu", *TINY, timeout=300)
    assert text_run.returncode == 0, text_run.stderr
    assert "scaled-down shape" in text_run.stdout and "A = " in text_run.stdout and "t_p = " in text_run.stdout
    assert stored(database_url, ProfileKey("qwen3-8b", "cpu", 1, "cpu")).id > row.id  # history: a new row


def test_without_torch_the_command_says_how_to_install_it(pearlctl_process: Callable, tmp_path: Path) -> None:
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed here')\n")
    done = pearlctl_process("profile", "--model", "qwen3-8b", "--device", "cpu",  # a process of its own: no torch
                            extra_env={"PYTHONPATH": str(blocker.parent)})
    assert done.returncode == 1
    assert "pip install torch==2.13.0" in done.stderr


@pytest.mark.parametrize(("args", "field"), [
    (("--model", "gpt-9"), "model: unknown model 'gpt-9'"),
    (("--model", "qwen3-8b", "--device", "tpu"), "--device: must be cpu or cuda"),
    (("--model", "qwen3-8b", "--device", "cpu", "--gpu", "h800"), "--gpu: a CPU measurement is keyed gpu 'cpu'"),
    (("--model", "qwen3-8b", "--device", "cpu", "--scale", "1.5"), "--scale: must be in (0, 1]"),
])
def test_bad_options_are_refused_naming_them(pearlctl: Callable, database_url: str, args: tuple, field: str) -> None:
    pytest.importorskip("torch")
    done = pearlctl("profile", *args)
    assert done.returncode == 2 and field in done.stderr, done.stderr


@pytest.mark.skipif(_cuda(), reason="this machine has CUDA")
def test_cuda_where_there_is_none_is_refused(pearlctl: Callable) -> None:
    pytest.importorskip("torch")
    done = pearlctl("profile", "--model", "qwen3-8b", "--device", "cuda", "--gpu", "h800")
    assert done.returncode == 1 and "torch sees no CUDA device" in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_the_full_shape_on_a_gpu(pearlctl: Callable, database_url: str) -> None:
    from pearl.controlplane.core.catalog import default_catalog
    from pearl.controlplane.core.perfmodel import PerfModel

    done = pearlctl("profile", "--model", "qwen3-8b", "--gpu", "h800", "--device", "cuda", "--repeats", "5", "--json",
                    timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["scaled"] is False and out["shape"]["hidden"] == 4096 and out["shape"]["dtype"] == "bfloat16"
    assert out["timing"] == "cuda-graph"  # the layer stack replayed as SGLang decodes, not synced per layer
    row = stored(database_url, ProfileKey("qwen3-8b", "h800", 1, "cuda"))
    assert row is not None and row.id == out["profile_id"]
    engine = profile_store.measured_engine(row)
    catalog = default_catalog()
    perf = PerfModel(catalog.model("qwen3-8b"), catalog.gpu("h800"), 1)
    # a real GPU lands within a few x of the calibrated model (the device may not be an H800)
    assert 0.2 < engine.decode_base_s[0] / perf.decode_step_time(1, 0.0) < 5
    assert engine.kv_capacity_tokens == perf.kv_capacity_tokens  # KV figures from the catalog on a catalog GPU


def test_past_the_kv_heads_a_rank_times_its_own_query_heads_and_one_kv_head() -> None:
    from pearl.controlplane.core.catalog import default_catalog
    from pearl.controlplane.measure.kernels import layer_shape

    moe = default_catalog().model("qwen3-30b-a3b")  # 32 query heads, 4 KV heads
    shapes = {tp: layer_shape(moe, tp, 1.0, "bfloat16") for tp in (2, 4, 8)}
    assert {tp: (s.q_heads, s.kv_heads) for tp, s in shapes.items()} == {2: (16, 2), 4: (8, 1), 8: (4, 1)}
    assert all(s.q_heads * tp == moe.q_heads for tp, s in shapes.items())  # the ranks together: the model's


def test_a_cpu_measurement_counts_replicated_kv_heads_once() -> None:
    pytest.importorskip("torch")
    from pearl.controlplane.core.catalog import default_catalog
    from pearl.controlplane.measure.kernels import MeasureSpec, measure

    moe = default_catalog().model("qwen3-30b-a3b")
    # a tenth of the width: the heads are kept at any scale
    spec = MeasureSpec(device="cpu", scale=0.1, tp=8, max_batch=2, context_tokens=32, chunk_tokens=16, repeats=1)
    result = measure(moe, spec)
    assert (result.shape.q_heads, result.shape.kv_heads) == (4, 1)
    # 8 ranks hold 4 distinct KV heads (each twice): K and V of a token are the model's 4 heads' bytes
    assert result.engine.kv_bytes_per_token == 4 * result.shape.kv_bytes_per_token
    assert result.engine.kv_bytes_per_token == 2 * moe.kv_bytes_per_token  # float32 on the CPU: twice bf16
