"""The `sim` driver: each worker's server is `pearlctl simworker`, a simulated SGLang server.

`python -m pearl.cli.simworker` is `pearlctl simworker` without loading the other command groups (a
faster start). Same processes, records, readiness and stop as the `sglang` driver (`process.ProcessDriver`); the
server's timing comes from the catalog model and GPU of the spec, `speed` times faster than real time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pearl.controlplane.core.domain import Role

from .base import ServerSpec
from .process import ProcessDriver


class SimDriver(ProcessDriver):
    name = "sim"

    def __init__(self, run_dir: Path | str, speed: float = 1.0, extra_args: tuple[str, ...] = (),
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 admin_api_key: str | None = None) -> None:
        super().__init__(run_dir, env)
        if admin_api_key:  # as SGLang's --admin-api-key, from a file only this user reads
            self.env["PEARL_ADMIN_API_KEY_FILE"] = str(self.secret_file("admin-api-key", admin_api_key))
        self.speed = speed
        self.extra_args = tuple(extra_args)  # e.g. ("--startup-s", "5", "--capacity", "20000")
        self.python = python

    def command(self, spec: ServerSpec, port: int, bootstrap_port: int | None) -> tuple[list[str], dict[str, str]]:
        argv = [self.python, "-m", "pearl.cli.simworker", "--host", spec.host, "--port", str(port),
                "--role", spec.role.value, "--model", spec.model, "--gpu", spec.gpu, "--tp", str(spec.tp),
                "--worker-id", str(spec.worker_id), "--generation", str(spec.generation), "--fence", str(spec.fence),
                "--speed", repr(self.speed), "--run-dir", str(self.run_dir), "--launched-at", repr(time.time())]
        if bootstrap_port is not None:
            argv += ["--bootstrap-port", str(bootstrap_port)]
        if spec.role in (Role.PREFILL, Role.DECODE):
            argv.append("--enable-pd-role-switch")
        if spec.overlap:
            argv += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
        if spec.weights is not None:
            argv += ["--model-path", spec.weights.uri, "--weight-version", str(spec.weights.version)]
        argv += list(self.extra_args)
        return argv, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.devices))}
