"""Every process of a live fleet on one machine, started from the command line and stopped by PID.

`pearlctl demo` (and the end-to-end tests) run pearl as a cluster runs it, on this machine: the front
door (`pearlctl router serve`), one agent per node (`pearlctl agent --driver sim`, which launches the
simulated SGLang servers), one weight-sync Celery worker per node (`pearlctl worker`), and the policy
loop (`pearlctl loop`); the demo adds the dashboard (`pearlctl dashboard`). Each is a separate
process in a session of its own, with its log under the run directory. `check()` says which one
died, with its last log lines; `stop()` sends SIGTERM to each (the loop and the agents first, then
the workers, the front door and the dashboard), waits, kills what is left, then stops the servers
the agents launched (the drivers' records), so nothing outlives the fleet.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pearl.agents.drivers import make_driver

MODULE = {"router": "pearl.cli.router", "simworker": "pearl.cli.simworker"}  # faster to start than pearlctl


@dataclass
class Proc:
    name: str  # "agent roll-0", "front door", "loop", ...
    popen: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the fleet's

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 12) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


class LocalFleet:
    def __init__(self, run_dir: Path, env: dict[str, str], *, pearlctl: str | None = None,
                 metrics: bool = False) -> None:
        self.run_dir = run_dir
        self.metrics = ("--metrics-port", "0") if metrics else ()  # each process serves /metrics on a free port
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **env}
        self.pearlctl = pearlctl or str(Path(sys.executable).with_name("pearlctl"))
        self.procs: list[Proc] = []
        self.nodes: list[str] = []

    # -- starting ------------------------------------------------------------------------------------

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.run_dir / (name.replace(" ", "-") + ".log")
        full = {**self.env, **(env or {})}
        with log.open("ab") as out:
            popen = subprocess.Popen(argv, env=full, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.run_dir)
        proc = Proc(name, popen, log, argv, env or {})
        self.procs.append(proc)
        return proc

    def restart(self, proc: Proc) -> Proc:
        """Start `proc` again with the same command line and environment (as a supervisor would once it
        exited); the new process takes its place."""
        self.procs.remove(proc)
        return self._start(proc.name, proc.argv, proc.env)

    def named(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def start_front_door(self, port: int, mode: str = "colocated") -> Proc:
        return self._start("front door", [sys.executable, "-m", MODULE["router"], "serve", "--port", str(port),
                                          "--mode", mode, "--run-dir", str(self.run_dir / "frontdoor"),
                                          "--register", *self.metrics])

    def start_agent(self, node: str, *, speed: float, sim_args: Iterable[str] = (), lease_s: float = 10.0,
                    poll_s: float = 0.2, crash_after_s: float = 10.0, env: dict[str, str] | None = None) -> Proc:
        self.nodes.append(node)
        return self._start(f"agent {node}", [self.pearlctl, "agent", "--node", node, "--driver", "sim",
                                            "--speed", repr(speed), "--sim-args", " ".join(sim_args),
                                            "--run-dir", str(self.run_dir / "servers" / node),
                                            "--lease-s", repr(lease_s), "--poll-s", repr(poll_s),
                                            "--crash-after-s", repr(crash_after_s), *self.metrics], env)

    def start_dashboard(self, port: int) -> Proc:
        return self._start("dashboard", [self.pearlctl, "dashboard", "--port", str(port)])

    def start_worker(self, node: str) -> Proc:
        return self._start(f"worker {node}", [self.pearlctl, "worker", "--node", node, *self.metrics])

    def start_loop(self, interval_s: float, lease_s: float) -> Proc:
        return self._start("loop", [self.pearlctl, "loop", "--interval", repr(interval_s), "--lease-s", repr(lease_s),
                                    *self.metrics])

    # -- watching ------------------------------------------------------------------------------------

    def check(self) -> Proc | None:
        """The first process that died, or None."""
        return next((p for p in self.procs if not p.alive()), None)

    # -- stopping ------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 15.0) -> list[str]:
        """Stop everything (module docstring); the names of the processes that had to be killed."""
        order = sorted(self.procs, key=lambda p: (0 if p.name == "loop" else 1 if p.name.startswith("agent")
                                                  else 2 if p.name.startswith("worker") else 3))
        killed: list[str] = []
        for group in (("loop",), ("agent",), ("worker", "front door", "dashboard")):
            procs = [p for p in order if p.name.startswith(group) and p.alive()]
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in procs:
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed.append(p.name)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait(5)
            for p in procs:  # anything a process left in its session (it should have stopped it)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
        self.stop_servers()
        return killed

    def stop_servers(self) -> int:
        """Stop every server the agents launched (each node's driver records); how many ran."""
        stopped = 0
        for node in self.nodes:
            driver = make_driver("sim", self.run_dir / "servers" / node)
            for server in driver.servers():
                stopped += driver.stop(server.worker_id, grace_s=5.0)
        return stopped
