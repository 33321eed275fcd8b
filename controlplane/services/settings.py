"""pearl's configuration: one settings object read from the environment.

`PEARL_HOME` holds the embedded servers; `PEARL_DATABASE_URL` and `PEARL_BROKER_URL` point at real
ones (then nothing embedded starts). URLs are shown to people only through `redact_url`, which drops
the password.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pearl.controlplane.errors import BadInput
from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

DEFAULT_HOME = Path("~/.local/share/pearl")
_POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2")
_BROKER_SCHEMES = ("redis", "rediss", "redis+socket", "amqp", "amqps", "pyamqp")


class Settings(BaseSettings):
    """The environment pearl runs in."""

    model_config = SettingsConfigDict(env_prefix="PEARL_", extra="ignore")

    home: Path = DEFAULT_HOME  # embedded servers' data, sockets and logs
    database_url: str | None = None  # a real PostgreSQL; unset = the embedded one under `home`
    broker_url: str | None = None  # a real Redis or RabbitMQ; unset = the embedded Redis under `home`

    @field_validator("home")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("database_url", "broker_url")
    @classmethod
    def _blank_is_unset(cls, v: str | None) -> str | None:
        return (v.strip() or None) if v is not None else None


def get_settings() -> Settings:
    """Read the environment now (cheap; not cached, so tests and subprocesses see their own)."""
    return Settings()


def normalise_database_url(url: str) -> str:
    """The SQLAlchemy URL for psycopg 3, whatever PostgreSQL scheme the user wrote."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise BadInput(f"PEARL_DATABASE_URL: not a database URL: {redact_url(url)!r}") from None
    if parsed.drivername not in _POSTGRES_SCHEMES:
        raise BadInput(f"PEARL_DATABASE_URL: expected a postgresql:// URL, got {parsed.drivername}://")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise BadInput(f"PEARL_DATABASE_URL: port {parsed.port} is not between 1 and 65535")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def check_broker_url(url: str) -> str:
    """`url` unchanged if it is a Redis or AMQP URL with a valid port; else BadInput naming PEARL_BROKER_URL."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in _BROKER_SCHEMES:
            raise BadInput(f"PEARL_BROKER_URL: expected a redis:// or amqp:// URL, got {redact_url(url)!r}")
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:  # an unparsable host or port
        raise BadInput(f"PEARL_BROKER_URL: {exc} in {redact_url(url)!r}") from None
    return url


def redact_url(url: str | URL) -> str:
    """`scheme://user@host:port/db` without the password; a driver suffix (`+psycopg`) is dropped."""
    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else str(url)
    if not text.startswith(_POSTGRES_SCHEMES):
        # a broker URL (redis://, redis+socket://, amqp://): drop the password by hand
        try:
            parts = urlsplit(text)
        except ValueError:
            return text.split("://", 1)[0] + "://<unparsable>"
        if "@" not in parts.netloc:
            return text
        user, _, host = parts.netloc.rpartition("@")
        user = user.split(":", 1)[0]
        return parts._replace(netloc=f"{user}@{host}" if user else host).geturl()
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError):
        return text.split("://", 1)[0] + "://<unparsable>"
    scheme = parsed.drivername.split("+", 1)[0]
    user = f"{parsed.username}@" if parsed.username else ""
    host = parsed.host or ""
    port = f":{parsed.port}" if parsed.port else ""
    db = f"/{parsed.database}" if parsed.database else "/"
    query = "&".join(f"{k}={v}" for k, v in parsed.query.items() if k != "password")
    return f"{scheme}://{user}{host}{port}{db}" + (f"?{query}" if query else "")
