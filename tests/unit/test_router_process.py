"""The front door's child router launcher (agents/router_process.py): it reads the arguments exactly as
`sglang_router.launch_router` does, refuses the mini load balancer, and starts without FastAPI or
aiohttp. That the router it starts serves, fails over and restarts is tested end to end in
tests/e2e/test_frontdoor.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pearl.agents.router import FrontDoorConfig
from pearl.agents.router_process import parse

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("split", [False, True])
def test_the_front_doors_arguments_read_as_the_package_launcher_reads_them(split: bool) -> None:
    from sglang_router.launch_router import parse_router_args

    argv = ["--host", "127.0.0.1", "--port", "30111", "--prometheus-port", "30112",
            *FrontDoorConfig(port=30110).router_args, *(["--pd-disaggregation"] if split else [])]
    ours, theirs = parse(argv), parse_router_args(argv)
    assert ours == theirs
    assert ours.port == 30111 and ours.prometheus_port == 30112 and ours.pd_disaggregation is split
    assert ours.log_level == "warn" and not ours.mini_lb


def test_the_mini_load_balancer_is_refused_by_name(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["--mini-lb"])
    assert exit_.value.code == 2
    assert "--mini-lb" in capsys.readouterr().err


def test_it_starts_without_the_mini_load_balancers_imports() -> None:
    probe = ("import sys, pearl.agents.router_process; "
             "print(sorted(m for m in ('fastapi', 'aiohttp', 'sglang_router.mini_lb') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
