"""The installed package: one `pearl` namespace, and a control plane that never imports torch or sglang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import importlib, importlib.util, json, pkgutil, sys
imported = []
for name in ("pearl.controlplane", "pearl.policies", "pearl.agents", "pearl.cli"):
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
import pearl.cli.app  # every command group registered
print(json.dumps({
    "imported": imported,
    "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "sglang")),
    "generic": [n for n in ("controlplane", "policies", "agents", "cli", "sim", "migrations")
                if importlib.util.find_spec(n) is not None],
}))
"""


def test_control_plane_imports_without_torch_or_sglang_and_installs_under_pearl(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)
    expected = {"pearl.controlplane.store.db", "pearl.controlplane.measure.kernels", "pearl.cli.status"}
    assert expected <= set(probe["imported"])
    assert probe["heavy"] == []  # torch is imported only inside `pearlctl profile`, when it runs
    assert probe["generic"] == []  # no `cli`, `sim`, ... at the top of site-packages
