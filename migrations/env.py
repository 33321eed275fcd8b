"""Alembic environment for pearl.

The URL is the one `pearlctl` uses (`PEARL_DATABASE_URL`, else the embedded server), or the one
`pearl.controlplane.store.db.upgrade` passes in. Upgrades take a transaction-scoped advisory lock first, so
concurrent `pearlctl init` / `alembic upgrade` runs apply each migration once.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from pearl.controlplane.services.embedded import database_url
from pearl.controlplane.store.schema import Base
from sqlalchemy import create_engine, pool, text

MIGRATION_LOCK = 0x7065_6172_6C  # "pearl": the advisory lock key that serialises migrations

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata
_COMPARE = {"compare_type": True, "compare_server_default": True}


def _url() -> str:
    return config.attributes.get("database_url") or database_url()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, **_COMPARE)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata, **_COMPARE)
            with context.begin_transaction():
                # Held until this transaction ends; a second upgrader waits here, then finds the
                # version table already at head.
                connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
