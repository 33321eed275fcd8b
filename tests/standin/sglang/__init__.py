"""A stand-in for the `sglang` package in tests: `python -m sglang.launch_server` runs the simulated server."""
