"""The control token: what authenticates pearl's commands to the servers (SGLang's `--admin-api-key`,
sent as `Authorization: Bearer ...`) and to the front door's admin API.

It comes from `PEARL_TOKEN_FILE` when that is set (a file holding the token; for processes that are
not to read it from the database), else from the database (`control_secrets`, made by migration 0009;
`controlplane/store/secrets.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

from pearl.controlplane.errors import BadInput

MIN_LENGTH = 32


def token_from_file() -> str | None:
    """The token of `PEARL_TOKEN_FILE`, or None when it is not set; BadInput naming it when unusable."""
    raw = os.environ.get("PEARL_TOKEN_FILE", "").strip()
    if not raw:
        return None
    try:
        token = Path(raw).expanduser().read_text().strip()
    except OSError as exc:
        raise BadInput(f"PEARL_TOKEN_FILE: {raw}: {exc.strerror or exc}") from None
    if len(token) < MIN_LENGTH or any(c.isspace() for c in token):
        raise BadInput(f"PEARL_TOKEN_FILE: {raw}: a token of at least {MIN_LENGTH} characters, no whitespace")
    return token


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
