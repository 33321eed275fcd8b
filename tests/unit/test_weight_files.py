"""Weight snapshots on disk: written from a torch state dict (or numpy arrays) with a manifest of
dtype, shape and checksum per tensor, and checked against it, a mismatch refused naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pearl.controlplane.errors import BadInput
from pearl.controlplane.weights import check_snapshot, snapshot_path, write_snapshot
from pearl.controlplane.weights.broadcast import expected_checksum, layout
from pearl.controlplane.weights.files import load_snapshot, manifest_digest

pytestmark = pytest.mark.unit


def test_a_torch_state_dict_round_trips_with_its_manifest(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"embed": torch.randn(8, 4).to(torch.bfloat16), "w": torch.randn(3, 5), "step": torch.tensor([7]),
             "mask": torch.ones(2, dtype=torch.bool), "empty": torch.zeros(0, 3)}
    snap = write_snapshot(state, tmp_path / "v1", version=1)
    loaded = load_snapshot(str(tmp_path / "v1"))
    assert loaded.checked == loaded.tensors == 5 and loaded.manifest() == snap.manifest()
    assert loaded.manifest()["embed"]["dtype"] == "BF16" and loaded.manifest()["w"]["shape"] == [3, 5]
    raw = (tmp_path / "v1" / "model.safetensors").read_bytes()
    assert state["w"].numpy().tobytes() in raw  # the bytes as they are, little-endian
    assert check_snapshot(str(tmp_path / "v1")).checked == 5
    assert json.loads((tmp_path / "v1" / "manifest.json").read_text())["weights_version"] == 1


def _numpy_snapshot(path: Path) -> Path:
    write_snapshot({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.float16)}, path)
    return path


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["meta"]["a"].update(dtype="F16"), "tensor a: dtype F32, manifest F16"),
    (lambda m: m["meta"]["b"].update(shape=[2, 2]), r"tensor b: shape \[4\], manifest \[2, 2\]"),
    (lambda m: m["tensors"].update(b="0" * 64), "tensor b: checksum mismatch"),
    (lambda m: m["tensors"].update(c="0" * 64), "tensor c: in the manifest, missing from the snapshot"),
    (lambda m: m["tensors"].pop("a"), "tensor a: in the snapshot, missing from its manifest"),
], ids=["dtype", "shape", "checksum", "missing-tensor", "unlisted-tensor"])
def test_a_manifest_that_does_not_match_its_files_is_refused_naming_the_tensor(tmp_path: Path, edit,
                                                                                message: str) -> None:
    path = _numpy_snapshot(tmp_path / "s")
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match=f"snapshot: {message}"):
        check_snapshot(str(path))


def test_snapshot_uris(tmp_path: Path) -> None:
    path = _numpy_snapshot(tmp_path / "s")
    assert snapshot_path(f"file://{path}") == path and check_snapshot(f"file://{path}").tensors == 2
    with pytest.raises(BadInput, match="only local paths and file:// URIs"):
        check_snapshot("s3://bucket/s")
    (path / "manifest.json").unlink()
    with pytest.raises(BadInput, match="no manifest.json"):
        check_snapshot(str(path))


def test_the_broadcast_layout_packs_tensors_into_buckets_with_the_registered_checksums(tmp_path: Path) -> None:
    state = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(5)}  # 4000 bytes each
    snap = write_snapshot(state, tmp_path / "s")
    buckets = layout(state, bucket_bytes=9000)
    assert [len(b.names) for b in buckets] == [2, 2, 1] and [b.nbytes for b in buckets] == [8000, 8000, 4000]
    assert all(b.dtypes == ["float32"] * len(b.names) and b.shapes == [[1000]] * len(b.names) for b in buckets)
    sent = {n: sha for b in buckets for n, sha in zip(b.names, b.checksums, strict=True)}
    assert sent == {n: i.checksum for n, i in snap.info.items()}
    assert manifest_digest(snap.manifest()) == expected_checksum(buckets)


def test_a_snapshot_written_with_its_model_folder_is_one_sglang_loads(tmp_path: Path) -> None:
    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "tokenizer.json").write_text("{}")
    (model / "model-00001-of-00004.safetensors").write_bytes(b"old weights are not copied")
    snap = write_snapshot({"w": np.ones(4, dtype=np.float32)}, tmp_path / "v1", model_dir=model)
    names = sorted(p.name for p in Path(snap.path).iterdir())
    assert names == ["config.json", "manifest.json", "model.safetensors", "tokenizer.json"]
    assert check_snapshot(snap.path).tensors == 1
    with pytest.raises(BadInput, match="model_dir .*: no config.json"):
        write_snapshot({"w": np.ones(4, dtype=np.float32)}, tmp_path / "v2", model_dir=tmp_path / "v1" / "nothing")


def test_a_snapshot_rewritten_as_other_tensors_of_the_same_bytes_no_longer_matches_its_registration(
        tmp_path: Path) -> None:
    """An F32 [2,4] tensor rewritten as F16 [4,4] (the same 32 bytes; header and manifest both changed)
    is a consistent snapshot, and other weights: the digest the sync compares says so."""
    from pearl.controlplane.weights.files import disk_digest

    w = np.arange(8, dtype=np.float32).reshape(2, 4)
    registered = manifest_digest(write_snapshot({"w": w}, tmp_path / "s").manifest())
    assert disk_digest(tmp_path / "s") == registered
    write_snapshot({"w": np.frombuffer(w.tobytes(), dtype=np.float16).reshape(4, 4)}, tmp_path / "s")
    assert check_snapshot(str(tmp_path / "s")).tensors == 1  # self-consistent
    assert disk_digest(tmp_path / "s") != registered


def test_a_relative_snapshot_path_is_registered_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pearl.controlplane.weights import absolute_uri

    monkeypatch.chdir(tmp_path)
    assert absolute_uri("ckpt/v1") == str(tmp_path / "ckpt" / "v1")
    assert absolute_uri("file:///shared/ckpt/v1") == "file:///shared/ckpt/v1"


def test_checksums_are_blake3_and_a_flipped_byte_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    import blake3

    path = _numpy_snapshot(tmp_path / "s")
    manifest = json.loads((path / "manifest.json").read_text())
    a = np.arange(6, dtype=np.float32).tobytes()
    assert manifest["tensors"]["a"] == "blake3:" + blake3.blake3(a).hexdigest()
    data = bytearray((path / "model.safetensors").read_bytes())
    data[data.index(a) + 5] ^= 0x01  # one bit of tensor a
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(BadInput, match="snapshot: tensor a: checksum mismatch"):
        check_snapshot(str(path))


def test_a_snapshot_with_sha256_checksums_is_still_checked_and_digested_as_it_was_registered(tmp_path: Path) -> None:
    """Snapshots (and their registrations) from before BLAKE3: a bare SHA-256 hex digest per tensor."""
    import hashlib

    from pearl.controlplane.weights.files import disk_digest

    path = _numpy_snapshot(tmp_path / "s")
    tensors = {"a": np.arange(6, dtype=np.float32).tobytes(), "b": np.ones(4, dtype=np.float16).tobytes()}
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tensors"] = {n: hashlib.sha256(b).hexdigest() for n, b in tensors.items()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    snap = load_snapshot(str(path))
    assert snap.checked == 2 and snap.info["a"].checksum == manifest["tensors"]["a"]
    # the digest a registration of then holds (entries keyed `sha256`) is the one a server reports now
    then = {n: {"dtype": e["dtype"], "shape": e["shape"], "sha256": manifest["tensors"][n]}
            for n, e in manifest["meta"].items()}
    assert manifest_digest(then) == manifest_digest(snap.manifest()) == disk_digest(path)
    manifest["tensors"]["b"] = hashlib.sha256(b"other").hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match="snapshot: tensor b: checksum mismatch"):
        check_snapshot(str(path))


def test_packing_reuses_two_buffers_and_each_bucket_holds_its_own_bytes_when_sent() -> None:
    pytest.importorskip("torch")
    from pearl.controlplane.weights.broadcast import ReceiveBuffers, packed

    state = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(7)}  # buckets of 2, 2, 2, 1 tensors
    buckets = layout(state, bucket_bytes=9000)
    spare: list = []
    for _ in range(2):  # a second version packs into the same two buffers
        sent = []
        for bucket, buf in zip(buckets, packed(buckets, spare), strict=True):
            assert bytes(buf.numpy()) == b"".join(bytes(d) for d in bucket.data)  # as the collective reads it
            sent.append(buf.data_ptr() if len(bucket.data) > 1 else None)
        assert sent[0] == sent[2] != sent[1] and sent[3] is None  # in turn; one tensor goes from its memory
        assert {t.data_ptr() for t in spare} == set(sent[:2])
    pool = ReceiveBuffers(keep=1)
    a = pool.take(100)
    view = memoryview(a)
    pool.give([("t", "uint8", [100], view[:100])])
    assert pool.take(50) is a and pool.take(50) is not a  # given back once, taken once
