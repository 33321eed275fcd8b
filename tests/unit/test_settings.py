"""Settings and URLs: psycopg 3 for SQLAlchemy whatever the scheme, and never a password in a message."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pearl.controlplane.errors import BadInput
from pearl.controlplane.services.settings import check_broker_url, get_settings, normalise_database_url, redact_url

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


@pytest.mark.parametrize(("url", "message"), [
    ("postgresql://u:s3cret@h:notaport/db", "PEARL_DATABASE_URL: not a database URL: 'postgresql://<unparsable>'"),
    ("postgresql://u:s3cret@[::1/db", "PEARL_DATABASE_URL: not a database URL"),
    ("postgresql://u:s3cret@h:70000/db", "PEARL_DATABASE_URL: port 70000 is not between 1 and 65535"),
])
def test_unparsable_database_url_is_bad_input_without_its_password(url: str, message: str) -> None:
    with pytest.raises(BadInput, match=re.escape(message)) as refused:
        normalise_database_url(url)
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("url", ["redis://:p@h:6379/0", "rediss://h/0", "redis+socket:///tmp/r.sock",
                                 "amqp://guest:p@h:5672//", "pyamqp://h//"])
def test_broker_urls_pearl_accepts(url: str) -> None:
    assert check_broker_url(url) == url


@pytest.mark.parametrize(("url", "message"), [
    ("redis://:s3cret@h:bad/0", "PEARL_BROKER_URL: Port could not be cast to integer value as 'bad' in "
                                "'redis://h:bad/0'"),
    ("sqla+postgresql://u:s3cret@h/db", "PEARL_BROKER_URL: expected a redis:// or amqp:// URL"),
    ("amqp://guest:s3cret@[::1", "PEARL_BROKER_URL: Invalid IPv6 URL in 'amqp://<unparsable>'"),
])
def test_bad_broker_url_is_bad_input_without_its_password(url: str, message: str) -> None:
    with pytest.raises(BadInput, match=re.escape(message)) as refused:
        check_broker_url(url)
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize(("variable", "url", "args"), [
    ("PEARL_DATABASE_URL", "postgresql://u:s3cret@127.0.0.1:notaport/db", ["status", "--json"]),
    ("PEARL_BROKER_URL", "redis://:s3cret@127.0.0.1:bad/0", ["db", "url", "--broker"]),
])
def test_a_malformed_url_exits_2_naming_the_variable(tmp_path: Path, variable: str, url: str, args: list[str]) -> None:
    from pearl.cli.app import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, args, env={"PEARL_HOME": str(tmp_path), variable: url})
    assert result.exit_code == 2, result.output
    assert f"{variable}:" in result.stderr and "s3cret" not in result.output
    assert result.stdout == "" if "--json" not in args else json.loads(result.stdout)["field"] == variable
    assert not (tmp_path / "pg").exists() and not (tmp_path / "redis").exists()  # nothing embedded started
