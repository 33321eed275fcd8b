"""The control token as the database holds it (`control_secrets`, migration 0009), unless
`PEARL_TOKEN_FILE` gives it (`controlplane/services/token.py`)."""

from __future__ import annotations

import hmac

from pearl.controlplane.errors import BadInput
from pearl.controlplane.services.token import token_from_file
from pearl.controlplane.store.db import transaction
from sqlalchemy import Engine, text


def control_token(engine: Engine) -> str:
    """The token every command to a server carries: `PEARL_TOKEN_FILE`'s, else the database's."""
    token = token_from_file()
    if token is not None:
        return token
    with transaction(engine) as session:
        token = session.scalar(text("SELECT value FROM control_secrets WHERE name = 'control'"))
    if not token:
        raise BadInput("the database holds no control token: run `pearlctl init`")
    return str(token)


def token_matches(engine: Engine, offered: str) -> bool:
    """Whether `offered` is the control token, asked of the database without reading the token
    (`pearl_control_token_matches`, 0012: the audit role may not read it); `PEARL_TOKEN_FILE`'s when set."""
    token = token_from_file()
    if token is not None:
        return hmac.compare_digest(offered.encode(), token.encode())
    with transaction(engine) as session:
        return bool(session.scalar(text("SELECT pearl_control_token_matches(:t)"), {"t": offered}))
