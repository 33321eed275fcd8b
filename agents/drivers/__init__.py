"""Drivers: how a node agent launches, adopts and stops the server processes of its worker slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Driver, DriverError

DRIVERS = ("sim", "sglang")


def make_driver(name: str, run_dir: Path | str, **options: Any) -> Driver:
    """The driver called `name` (sim or sglang) keeping its records in `run_dir`."""
    if name == "sim":
        from .sim import SimDriver

        return SimDriver(run_dir, **options)
    if name == "sglang":
        from .sglang import SglangDriver

        return SglangDriver(run_dir, **options)
    raise DriverError(f"driver: one of {', '.join(DRIVERS)}, not {name!r}")
