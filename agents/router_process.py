"""One `sglang-router` child of the front door (agents/router.py): `python -m pearl.agents.router_process
ARGS`, where ARGS are those of `python -m sglang_router.launch_router`.

It starts the same Rust router from the same arguments, through the package's `RouterArgs` and
`Router`. What it leaves out is the launcher module's import of the Python mini load balancer (a
debugging aid that pearl never uses, with FastAPI and aiohttp behind it): about 0.4 s of CPU per
start, paid again whenever the front door restarts a child that died, while that child's requests
are held.
"""

from __future__ import annotations

import argparse
import sys

from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def parse(argv: list[str]) -> RouterArgs:
    parser = argparse.ArgumentParser(prog="pearl.agents.router_process",
                                     description="The SGLang router (sglang_router.launch_router's arguments).")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    if args.mini_lb:
        parser.error("--mini-lb: the Python mini load balancer is not started here (the Rust router is)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    args._validate_router_args()  # as sglang_router.launch_router does before it starts the router
    Router.from_args(args).start()  # serves until the process is signalled


if __name__ == "__main__":
    main()
