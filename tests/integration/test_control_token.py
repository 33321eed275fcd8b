"""The control token: made by the migration, read by every process that commands servers, or given
in a file instead."""

from __future__ import annotations

from pathlib import Path

import pytest
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store.secrets import control_token
from sqlalchemy import Engine, text

pytestmark = pytest.mark.integration


def test_the_database_holds_a_strong_token_and_a_file_overrides_it(db_engine: Engine, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    token = control_token(db_engine)
    assert len(token) == 64 and all(c in "0123456789abcdef" for c in token)
    with db_engine.begin() as conn, pytest.raises(Exception, match="long_enough"):
        conn.execute(text("UPDATE control_secrets SET value = 'short' WHERE name = 'control'"))
    given = tmp_path / "token"
    given.write_text("f" * 40 + "\n")
    monkeypatch.setenv("PEARL_TOKEN_FILE", str(given))
    assert control_token(db_engine) == "f" * 40
    given.write_text("too short")
    with pytest.raises(BadInput, match="PEARL_TOKEN_FILE: .*at least 32"):
        control_token(db_engine)
    monkeypatch.setenv("PEARL_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(BadInput, match="PEARL_TOKEN_FILE: .*absent"):
        control_token(db_engine)
