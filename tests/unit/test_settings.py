"""Settings and URLs: psycopg 3 for SQLAlchemy whatever the scheme, and never a password in a message."""

from __future__ import annotations

from pathlib import Path

import pytest
from pearl.controlplane.errors import BadInput
from pearl.controlplane.settings import get_settings, normalise_database_url, redact_url

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("url", ["postgresql://u:p@h:5433/db", "postgres://u:p@h:5433/db",
                                 "postgresql+psycopg2://u:p@h:5433/db"])
def test_database_urls_are_normalised_to_psycopg3(url: str) -> None:
    assert normalise_database_url(url) == "postgresql+psycopg://u:p@h:5433/db"


def test_non_postgres_url_is_bad_input() -> None:
    with pytest.raises(BadInput, match="PEARL_DATABASE_URL: expected a postgresql:// URL, got mysql://"):
        normalise_database_url("mysql://u:secret@h/db")


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql+psycopg://bob:s3cret@db.example:5433/pearl", "postgresql://bob@db.example:5433/pearl"),
    ("postgresql://postgres@/pearl?host=/tmp/pg", "postgresql://postgres@/pearl?host=/tmp/pg"),
    ("redis://:s3cret@localhost:6379/0", "redis://localhost:6379/0"),
    ("amqp://guest:s3cret@127.0.0.1:5672//", "amqp://guest@127.0.0.1:5672//"),
    ("redis+socket:///tmp/pearl/redis.sock", "redis+socket:///tmp/pearl/redis.sock"),
])
def test_redacted_urls_drop_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PEARL_HOME", str(tmp_path))
    monkeypatch.setenv("PEARL_DATABASE_URL", " ")
    monkeypatch.delenv("PEARL_BROKER_URL", raising=False)
    settings = get_settings()
    assert settings.home == tmp_path and settings.database_url is None and settings.broker_url is None
    monkeypatch.delenv("PEARL_HOME")
    assert get_settings().home == Path("~/.local/share/pearl").expanduser()
