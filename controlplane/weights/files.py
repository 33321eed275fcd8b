"""Weight snapshots on disk: safetensors file(s) and a checksum manifest, read, checked and written.

A snapshot is a directory of `*.safetensors` files (or one such file). When the directory holds a
`manifest.json` of the form `{"tensors": {"<name>": "<checksum of the tensor's bytes>", ...},
"meta": {"<name>": {"dtype": "BF16", "shape": [...]}, ...}}` ("meta" optional), every tensor it
names must be present with that checksum (and that dtype and shape). A checksum is
`blake3:<hex>` (BLAKE3, what pearl writes: cryptographic like SHA-256 and about five times faster
here, so a receiver's check keeps up with a broadcast) or a bare SHA-256 hex digest (snapshots
written before; still read and checked). The control plane registers a
snapshot's manifest as rows (`controlplane.store.weights`) only once its files match it. The simulated
server checks a snapshot this way before it takes it (`update_weights_from_disk`, or `--model-path` at
start), so a torn or corrupt snapshot is refused with the name of the tensor at fault and the old
weights stay in place.

The safetensors layout is read directly (8-byte little-endian header length, a JSON header of
`name -> {dtype, shape, data_offsets}`, then the data): checking every tensor's extent and bytes
needs no framework (numpy has no bfloat16, the usual dtype of a checkpoint) and names the tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
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
    info: dict[str, TensorInfo] = field(default_factory=dict, compare=False, repr=False)

    def manifest(self) -> dict[str, dict[str, Any]]:
        """name -> {dtype, shape, checksum}: what the control plane registers."""
        return {n: {"dtype": t.dtype, "shape": list(t.shape), "checksum": t.checksum}
                for n, t in sorted(self.info.items())}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    checksum: str  # `tensor_checksum`'s form


BLAKE3 = "blake3:"
_CHUNK = 16 * 1024 * 1024


def _hasher(like: str | None = None) -> tuple[Any, str]:
    """The hash of a checksum in `like`'s form and its prefix: BLAKE3, or SHA-256 when `like` is a bare
    SHA-256 hex digest (a snapshot written before BLAKE3). Both release the GIL while they hash."""
    if like is not None and not like.startswith(BLAKE3):
        return hashlib.sha256(), ""
    return blake3.blake3(), BLAKE3


def tensor_checksum(data: Any) -> str:
    """A tensor's bytes' checksum: `blake3:<hex>`."""
    return BLAKE3 + blake3.blake3(data).hexdigest()


def entry_checksum(entry: dict[str, Any]) -> str:
    """The checksum of a registered manifest entry (`checksum`; `sha256` in manifests registered before)."""
    return str(entry["checksum"] if "checksum" in entry else entry["sha256"])


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise SnapshotError(f"model_path {path}: no such file or directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SnapshotError(f"model_path {path}: no *.safetensors file")
    return files


def _header(f: Any, file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header (without `__metadata__`) and its length, read from `f`."""
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
    return header, n


def disk_digest(model_path: str | Path) -> str:
    """The snapshot's `manifest_digest` as its files say now, without reading the tensors' data: each
    tensor's checksum from the manifest, its dtype and shape from the safetensors headers. A snapshot
    rewritten since it was registered (a tensor's bytes, or its dtype or shape, in the header and the
    manifest alike) gives another digest. SnapshotError without a manifest."""
    path = Path(model_path)
    raw = read_manifest(path)
    if raw is None:
        raise SnapshotError(f"{manifest_path(path)}: no manifest")
    shapes: dict[str, tuple[str, list[int]]] = {}
    for file in _files(path):
        with file.open("rb") as f:
            header, _ = _header(f, file)
        for name, info in header.items():
            if isinstance(info, dict):
                shapes[name] = (str(info.get("dtype")), list(info.get("shape") or []))
    entries = {}
    for name, checksum in raw["tensors"].items():
        dtype, shape = shapes.get(name, ("missing", []))
        entries[name] = {"dtype": dtype, "shape": shape, "checksum": checksum}
    return manifest_digest(entries)


def _read(file: Path, digests: dict[str, TensorInfo], like: dict[str, Any]) -> tuple[int, int]:
    """Check one file's tensors; record each tensor's dtype, shape and checksum in `digests` (of the
    kind the manifest's entry `like[name]` is)."""
    with file.open("rb") as f:
        header, n = _header(f, file)
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
            if name in digests:
                raise SnapshotError(f"tensor {name} ({file.name}): also in another file of the snapshot")
            want = like.get(name)
            digests[name] = TensorInfo(dtype, tuple(shape), _checksum(f, end - begin, want if isinstance(want, str)
                                                                      else None))
            total += expected
        return len(header), total


def _checksum(f: Any, n: int, like: str | None) -> str:
    """The checksum of the next n bytes of `f` in `like`'s form (`_hasher`), read in chunks."""
    h, prefix = _hasher(like)
    while n > 0:
        block = f.read(min(_CHUNK, n))
        if not block:
            break
        h.update(block)
        n -= len(block)
    return prefix + h.hexdigest()


def manifest_path(model_path: str | Path) -> Path:
    path = Path(model_path)
    return (path if path.is_dir() else path.parent) / MANIFEST


def read_manifest(model_path: str | Path) -> dict[str, Any] | None:
    """The snapshot's manifest.json as written (None without one); SnapshotError when unreadable."""
    manifest = manifest_path(model_path)
    if not manifest.exists():
        return None
    try:
        raw = json.loads(manifest.read_text())
        if not isinstance(raw["tensors"], dict):
            raise TypeError("'tensors' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{manifest}: not a manifest with a 'tensors' object ({exc})") from None
    return raw


def load_snapshot(model_path: str) -> Snapshot:
    """Read every tensor of the snapshot at `model_path` and check it against its manifest, if any."""
    path = Path(model_path)
    files = _files(path)
    raw = read_manifest(path)
    digests: dict[str, TensorInfo] = {}
    tensors = nbytes = 0
    for file in files:
        t, b = _read(file, digests, raw["tensors"] if raw is not None else {})
        tensors, nbytes = tensors + t, nbytes + b
    checked = 0
    if raw is not None:
        meta = raw.get("meta") if isinstance(raw.get("meta"), dict) else {}
        for name, digest in sorted(raw["tensors"].items()):
            if name not in digests:
                raise SnapshotError(f"tensor {name}: in the manifest, missing from the snapshot")
            got = digests[name]
            want = meta.get(name) or {}
            if not isinstance(want, dict):
                raise SnapshotError(f"tensor {name}: its manifest meta is {want!r}, not an object with dtype and shape")
            if want.get("dtype") not in (None, got.dtype):
                raise SnapshotError(f"tensor {name}: dtype {got.dtype}, manifest {want['dtype']}")
            if want.get("shape") not in (None, list(got.shape)):
                raise SnapshotError(f"tensor {name}: shape {list(got.shape)}, manifest {want['shape']}")
            if got.checksum != digest:
                raise SnapshotError(f"tensor {name}: checksum mismatch ({got.checksum[:19]}..., "
                                    f"manifest {str(digest)[:19]}...)")
            checked += 1
    return Snapshot(str(path), tuple(f.name for f in files), tensors, nbytes, checked, digests)


def manifest_digest(manifest: dict[str, dict[str, Any]]) -> str:
    """One sha256 over every tensor's name, dtype, shape and checksum (sorted by name): what a server
    that loaded the snapshot reports as its `weights_checksum`, and what a sync compares with the
    registered manifest. The dtype and shape count: the same bytes read as another tensor are other
    weights."""
    h = hashlib.sha256()
    for name in sorted(manifest):
        entry = manifest[name]
        shape = "x".join(str(int(d)) for d in entry["shape"])
        h.update(f"{name}={entry['dtype']}[{shape}]:{entry_checksum(entry)}\n".encode())
    return h.hexdigest()


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
        sums = {name: tensor_checksum(data) for name, data in tensors.items()}
        (out / MANIFEST).write_text(json.dumps({"tensors": sums}, indent=1))
    return out


TORCH_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "float16": "F16", "bfloat16": "BF16",
                "int32": "I32", "float32": "F32", "int64": "I64", "float64": "F64",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def tensor_bytes(tensor: Any) -> tuple[str, list[int], memoryview]:
    """(safetensors dtype, shape, the raw bytes) of a torch tensor (or a numpy array), without a copy
    when it is contiguous on the CPU."""
    if not hasattr(tensor, "detach"):  # numpy
        import numpy as np

        arr = np.ascontiguousarray(tensor)
        if arr.dtype.name not in TORCH_DTYPES:
            raise SnapshotError(f"dtype {arr.dtype}: not storable in safetensors")
        return TORCH_DTYPES[arr.dtype.name], list(arr.shape), memoryview(arr.reshape(-1).view(np.uint8))
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise SnapshotError(f"dtype {tensor.dtype}: not storable in safetensors")
    t = tensor.detach().cpu().contiguous()
    flat = t.reshape(-1).view(__import__("torch").uint8) if t.numel() else t.reshape(-1)
    return TORCH_DTYPES[name], list(t.shape), memoryview(flat.numpy()).cast("B")


MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
               "chat_template.jinja", "preprocessor_config.json")


def copy_model_files(model_dir: str | Path, directory: str | Path) -> list[str]:
    """The files beside a model's weights that a server needs to load it (its config and tokenizer),
    copied from a Hugging Face model folder into a snapshot; the ones copied. SnapshotError when the
    folder has no `config.json` (SGLang cannot load a folder without one)."""
    src, out = Path(model_dir), Path(directory)
    if not (src / "config.json").is_file():
        raise SnapshotError(f"model_dir {src}: no config.json (a Hugging Face model folder is needed)")
    copied = []
    for name in MODEL_FILES:
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
            copied.append(name)
    return copied


def write_state_dict(directory: str | Path, state_dict: dict[str, Any], *, version: int | None = None,
                     file_name: str = "model.safetensors", model_dir: str | Path | None = None) -> Snapshot:
    """Write a torch state dict (or a dict of numpy arrays) as a snapshot (one safetensors file and its
    manifest with dtypes, shapes and checksums per tensor); the manifest is written last, so a reader never
    sees it before the data. `model_dir`: a Hugging Face model folder whose config and tokenizer files
    are copied beside the weights, so that SGLang loads the snapshot as a model."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if model_dir is not None:
        copy_model_files(model_dir, out)
    header: dict[str, Any] = {}
    blobs: list[memoryview] = []
    info: dict[str, TensorInfo] = {}
    offset = 0
    for name, tensor in state_dict.items():
        dtype, shape, data = tensor_bytes(tensor)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.nbytes]}
        info[name] = TensorInfo(dtype, tuple(shape), tensor_checksum(data))
        blobs.append(data)
        offset += data.nbytes
    if version is not None:
        header["__metadata__"] = {"weights_version": str(version)}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = out / (file_name + ".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for data in blobs:
            f.write(data)
    tmp.replace(out / file_name)
    manifest = {"tensors": {n: t.checksum for n, t in info.items()},
                "meta": {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in info.items()}}
    if version is not None:
        manifest["weights_version"] = version
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return Snapshot(str(out), (file_name,), len(info), offset, len(info), info)
