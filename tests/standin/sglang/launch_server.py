"""Stand-in for `python -m sglang.launch_server`: parse the flags the sglang driver passes, as SGLang
names them (an unknown flag is an error, as in SGLang), and become `pearlctl simworker` (exec: the same
pid) with the equivalent settings. Timing: the served model if the catalog knows it, on
$PEARL_STANDIN_GPU (default h100), $PEARL_STANDIN_SPEED times faster than real time (default 25).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

parser = argparse.ArgumentParser(prog="sglang.launch_server (pearl test stand-in)")
parser.add_argument("--model-path", required=True)
parser.add_argument("--served-model-name")
parser.add_argument("--tp-size", type=int, default=1)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=30000)
parser.add_argument("--nccl-port", type=int)
parser.add_argument("--engine-info-bootstrap-port", type=int, default=6789)
parser.add_argument("--weight-version", default="default")
parser.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
parser.add_argument("--disaggregation-transfer-backend", default="mooncake",
                    choices=["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"])
parser.add_argument("--disaggregation-ib-device")
parser.add_argument("--enable-pd-role-switch", action="store_true")
parser.add_argument("--enable-memory-saver", action="store_true")
parser.add_argument("--enable-weights-cpu-backup", action="store_true")
parser.add_argument("--load-format", default="auto")
parser.add_argument("--skip-tokenizer-init", action="store_true")
parser.add_argument("--admin-api-key")
parser.add_argument("--config")  # SGLang's YAML of further options; the driver puts the admin API key there
args = parser.parse_args()
if args.config:
    import yaml

    options = yaml.safe_load(Path(args.config).read_text()) or {}
    unknown = sorted(set(options) - {"admin-api-key", "admin_api_key"})
    if unknown:
        sys.exit(f"--config {args.config}: options this stand-in does not take: {unknown}")
    args.admin_api_key = options.get("admin-api-key") or options.get("admin_api_key") or args.admin_api_key

devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
if len([d for d in devices.split(",") if d]) != args.tp_size:
    sys.exit(f"CUDA_VISIBLE_DEVICES={devices!r} does not give --tp-size {args.tp_size} devices")
role = {"null": "colocated"}.get(args.disaggregation_mode, args.disaggregation_mode)
model = args.served_model_name or "qwen3-8b"
argv = [sys.executable, "-m", "pearl.cli.simworker", "--host", args.host, "--port", str(args.port), "--role", role,
        "--model", model, "--gpu", os.environ.get("PEARL_STANDIN_GPU", "h100"), "--tp", str(args.tp_size),
        "--speed", os.environ.get("PEARL_STANDIN_SPEED", "25"), "--weight-version", args.weight_version]
if role != "colocated":
    argv += ["--bootstrap-port", str(args.disaggregation_bootstrap_port)]
if args.enable_pd_role_switch:
    argv.append("--enable-pd-role-switch")
if args.enable_memory_saver:
    argv.append("--enable-memory-saver")
if args.admin_api_key:
    argv += ["--admin-api-key", args.admin_api_key]
if args.enable_weights_cpu_backup:
    argv.append("--enable-weights-cpu-backup")
path = Path(args.model_path)
if path.exists() and (path.is_file() or any(path.glob("*.safetensors"))):
    argv += ["--model-path", str(path)]
os.execv(sys.executable, argv)
