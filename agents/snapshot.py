"""Reading and checking a weight snapshot: safetensors file(s) and an optional checksum manifest.

A snapshot is a directory of `*.safetensors` files (or one such file). When the directory holds a
`manifest.json` of the form `{"tensors": {"<name>": "<sha256 of the tensor's bytes>", ...}}`, every
tensor it names must be present with that checksum. The simulated server checks a snapshot this way
before it takes it (`update_weights_from_disk`, or `--model-path` at start), so a torn or corrupt
snapshot is refused with the name of the tensor at fault and the old weights stay in place.

The safetensors layout is read directly (8-byte little-endian header length, a JSON header of
`name -> {dtype, shape, data_offsets}`, then the data): checking every tensor's extent and bytes
needs no framework (numpy has no bfloat16, the usual dtype of a checkpoint) and names the tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from pearl.controlplane.errors import PearlError

MANIFEST = "manifest.json"
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SnapshotError(PearlError):
    """The snapshot cannot be loaded (missing, unreadable, corrupt); the message names the file or tensor."""


@dataclass(frozen=True)
class Snapshot:
    path: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    checked: int  # tensors whose checksum the manifest gave and matched


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise SnapshotError(f"model_path {path}: no such file or directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SnapshotError(f"model_path {path}: no *.safetensors file")
    return files


def _read(file: Path, digests: dict[str, str]) -> tuple[int, int]:
    """Check one file's tensors; record each tensor's sha256 in `digests`. (tensors, data bytes)."""
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SnapshotError(f"{file.name}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise SnapshotError(f"{file.name}: header length {n} is not plausible")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SnapshotError(f"{file.name}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise SnapshotError(f"{file.name}: header is not a JSON object")
        header.pop("__metadata__", None)
        base = 8 + n
        size = file.stat().st_size - base
        total = 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]
                                 if isinstance(kv[1], dict) else 0):
            if not isinstance(info, dict):
                raise SnapshotError(f"tensor {name} ({file.name}): header entry is not an object")
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if dtype not in DTYPE_BYTES:
                raise SnapshotError(f"tensor {name} ({file.name}): unknown dtype {dtype!r}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise SnapshotError(f"tensor {name} ({file.name}): bad shape {shape!r}")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
                raise SnapshotError(f"tensor {name} ({file.name}): bad data_offsets {offsets!r}")
            begin, end = offsets
            expected = math.prod(shape) * DTYPE_BYTES[dtype]
            if end - begin != expected or begin < 0:
                raise SnapshotError(f"tensor {name} ({file.name}): {end - begin} bytes for shape {shape} {dtype}")
            if end > size:
                raise SnapshotError(f"tensor {name} ({file.name}): data ends at {end}, file holds {size} (truncated)")
            f.seek(base + begin)
            digests[name] = hashlib.sha256(f.read(end - begin)).hexdigest()
            total += expected
        return len(header), total


def load_snapshot(model_path: str) -> Snapshot:
    """Read every tensor of the snapshot at `model_path` and check it against its manifest, if any."""
    path = Path(model_path)
    files = _files(path)
    digests: dict[str, str] = {}
    tensors = nbytes = 0
    for file in files:
        t, b = _read(file, digests)
        tensors, nbytes = tensors + t, nbytes + b
    manifest = (path if path.is_dir() else path.parent) / MANIFEST
    checked = 0
    if manifest.exists():
        try:
            expected = json.loads(manifest.read_text())["tensors"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SnapshotError(f"{manifest}: not a manifest with a 'tensors' object ({exc})") from None
        for name, digest in sorted(expected.items()):
            if name not in digests:
                raise SnapshotError(f"tensor {name}: in the manifest, missing from the snapshot")
            if digests[name] != digest:
                raise SnapshotError(f"tensor {name}: checksum mismatch (sha256 {digests[name][:12]}..., "
                                    f"manifest {str(digest)[:12]}...)")
            checked += 1
    return Snapshot(str(path), tuple(f.name for f in files), tensors, nbytes, checked)


def write_snapshot(directory: str | Path, tensors: dict[str, bytes], dtype: str = "U8",
                   manifest: bool = True) -> Path:
    """Write a small snapshot (one safetensors file of 1-D tensors, and its manifest): tests and demos."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    width = DTYPE_BYTES[dtype]
    for name, data in tensors.items():
        header[name] = {"dtype": dtype, "shape": [len(data) // width], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with (out / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(tensors.values()))
    if manifest:
        sums = {name: hashlib.sha256(data).hexdigest() for name, data in tensors.items()}
        (out / MANIFEST).write_text(json.dumps({"tensors": sums}, indent=1))
    return out
