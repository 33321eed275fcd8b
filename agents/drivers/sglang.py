"""The `sglang` driver: each worker's server is `python -m sglang.launch_server` on the worker's GPUs.

Command lines, per role (flags as SGLang's `ServerArgs` defines them):

- every server: `--model-path` (the weight snapshot, else the model), `--served-model-name` (the
  catalog model, so every server of the model answers under one name whatever its snapshot),
  `--tp-size`, `--host`, `--port`, `--nccl-port` and `--engine-info-bootstrap-port` (distinct per
  server on a node: several servers share a node), `--weight-version`;
- prefill and decode: `--disaggregation-mode`, `--disaggregation-bootstrap-port` (distinct per server;
  decode servers get one too, for a flip to prefill), `--disaggregation-transfer-backend` (mooncake:
  role switch needs mooncake or mori) and `--enable-pd-role-switch`;
- a server on borrowed training GPUs (`spec.overlap`): `--enable-memory-saver`, so that
  release/resume_memory_occupation can hand the memory back between loans;
- `CUDA_VISIBLE_DEVICES` from the worker's devices (exactly `tp` of them).

Prefill <-> decode is `/pd_role_switch` on the running server after a drain; colocated <-> split is a
restart (SGLang cannot flip to or from colocated).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pearl.controlplane.core.domain import Role

from .base import DriverError, ServerSpec
from .process import ProcessDriver, free_port


class SglangDriver(ProcessDriver):
    name = "sglang"

    def __init__(self, run_dir: Path | str, python: str = sys.executable, transfer_backend: str = "mooncake",
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        super().__init__(run_dir, env)
        self.python = python
        self.transfer_backend = transfer_backend
        self.extra_args = tuple(extra_args)  # e.g. ("--disaggregation-ib-device", "mlx5_0", "--load-format", "dummy")

    def command(self, spec: ServerSpec, port: int, bootstrap_port: int | None) -> tuple[list[str], dict[str, str]]:
        if len(spec.devices) != spec.tp:
            raise DriverError(f"worker {spec.worker_id}: tp {spec.tp} needs as many devices, got {list(spec.devices)}")
        model_path = spec.weights.uri if spec.weights is not None else spec.model
        version = str(spec.weights.version) if spec.weights is not None else "default"
        argv = [self.python, "-m", "sglang.launch_server", "--model-path", model_path,
                "--served-model-name", spec.model, "--tp-size", str(spec.tp), "--host", spec.host,
                "--port", str(port), "--nccl-port", str(free_port()),
                "--engine-info-bootstrap-port", str(free_port()), "--weight-version", version]
        if spec.role in (Role.PREFILL, Role.DECODE):
            argv += ["--disaggregation-mode", spec.role.value, "--disaggregation-bootstrap-port", str(bootstrap_port),
                     "--disaggregation-transfer-backend", self.transfer_backend, "--enable-pd-role-switch"]
        elif spec.role is not Role.COLOCATED:
            raise DriverError(f"worker {spec.worker_id}: no server for role {spec.role.value}")
        if spec.overlap:
            argv.append("--enable-memory-saver")
        argv += list(self.extra_args)
        return argv, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.devices))}
