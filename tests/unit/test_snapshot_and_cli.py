"""Weight snapshots as the simulated server checks them, and the bad input of `pearlctl simworker`
and `pearlctl router serve` (exit 2, the option named, nothing started)."""

from __future__ import annotations

import struct

import pytest
from pearl.cli.app import app
from pearl.controlplane.weights.files import SnapshotError, load_snapshot, write_snapshot
from typer.testing import CliRunner

pytestmark = pytest.mark.unit


def test_a_good_snapshot_loads_with_its_checksums(tmp_path):
    path = write_snapshot(tmp_path / "s", {"a": b"\x01" * 16, "b": b"\x02" * 8})
    snap = load_snapshot(str(path))
    assert (snap.tensors, snap.bytes, snap.checked) == (2, 24, 2)
    assert load_snapshot(str(path / "model.safetensors")).tensors == 2


@pytest.mark.parametrize(("damage", "message"), [
    (lambda data: data[:-4], "tensor b .*truncated"),
    (lambda data: data[:-1] + b"\xff", "tensor b: checksum mismatch"),
    (lambda data: struct.pack("<Q", 5) + b"{nope", "header is not JSON"),
    (lambda data: b"\x00", "not a safetensors file"),
])
def test_a_corrupt_snapshot_is_refused_naming_what_is_wrong(tmp_path, damage, message):
    path = write_snapshot(tmp_path / "s", {"a": b"\x01" * 16, "b": b"\x02" * 8})
    file = path / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(SnapshotError, match=message):
        load_snapshot(str(path))


def test_a_manifest_naming_a_missing_tensor_and_a_missing_snapshot(tmp_path):
    path = write_snapshot(tmp_path / "s", {"a": b"\x01" * 16})
    (path / "manifest.json").write_text('{"tensors": {"a": "00", "lm_head": "11"}}')
    with pytest.raises(SnapshotError, match="tensor a: checksum mismatch"):
        load_snapshot(str(path))
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SnapshotError, match="no \\*.safetensors"):
        load_snapshot(str(tmp_path / "empty"))


@pytest.mark.parametrize(("args", "named"), [
    (["simworker", "--port", "1", "--role", "training"], "--role"),
    (["simworker", "--port", "1", "--role", "prefill"], "--bootstrap-port"),
    (["simworker", "--port", "1", "--speed", "0"], "--speed"),
    (["simworker", "--port", "1", "--model", "gpt-9"], "model"),
    (["simworker", "--port", "70000"], "--port"),
    (["router", "serve", "--mode", "both"], "--mode"),
])
def test_bad_input_names_the_option_and_exits_2(args, named):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert named in result.output
