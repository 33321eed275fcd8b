"""Parse command lines with SGLang's own `prepare_server_args` (run in a subprocess by the tests).

stdin: a JSON list of argument lists (what follows `python -m sglang.launch_server`). stdout: a JSON
list, per command line either {"ok": true, "args": {...the ServerArgs fields...}} or {"ok": false,
"error": "..."}: what SGLang itself says of it, argparse's exit included.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def _plain(value):
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def main() -> None:
    import msgspec
    from sglang.srt.server_args import prepare_server_args

    out = []
    for argv in json.load(sys.stdin):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = prepare_server_args(list(argv))
        except SystemExit as exc:
            lines = err.getvalue().strip().splitlines() or [""]
            out.append({"ok": False, "error": f"exit {exc.code}: {lines[-1]}"})
        except Exception as exc:  # noqa: BLE001 - what SGLang raises is the answer
            out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        else:
            fields = {f.name: _plain(getattr(args, f.name, None)) for f in msgspec.structs.fields(type(args))}
            out.append({"ok": True, "args": fields})
    json.dump(out, sys.__stdout__)


if __name__ == "__main__":
    main()
