"""The default suite runs in parallel (`-n auto` in pyproject.toml): what keeps its workers apart and fast."""

from __future__ import annotations

import os

import conftest
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool


@pytest.mark.unit
def test_each_xdist_worker_has_a_redis_database_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    assert conftest._own_redis_database("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/3"
    assert conftest._own_redis_database("redis://:secret@broker:6380") == "redis://:secret@broker:6380/3"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw15")
    assert conftest._own_redis_database("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/1"  # 16 databases
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert conftest._own_redis_database("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.mark.unit
def test_auto_starts_one_worker_more_than_the_cores_and_at_most_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, workers in ((1, 2), (2, 3), (7, 8), (64, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert conftest.pytest_xdist_auto_num_workers(None) == workers


@pytest.mark.integration
def test_the_embedded_test_server_does_not_flush_to_disk(pg_server_url: str) -> None:
    if os.environ.get("PEARL_TEST_DATABASE_URL"):
        pytest.skip("the configured server is left as it is")
    engine = create_engine(pg_server_url, poolclass=NullPool)
    with engine.connect() as conn:
        assert {s: conn.execute(text(f"SHOW {s}")).scalar() for s in ("fsync", "synchronous_commit")} == \
            {"fsync": "off", "synchronous_commit": "off"}
    engine.dispose()


@pytest.mark.unit
def test_a_command_that_sets_up_logging_in_process_leaves_the_logger_as_it_found_it() -> None:
    """`setup_logging` (what `agent`, `worker` and `loop` call) aims the `pearl` logger at the stderr
    of the moment; the autouse fixture puts back what the test found, for every test after it."""
    import logging

    from pearl.cli.common import setup_logging

    logger = logging.getLogger("pearl")
    before = logger.handlers[:], logger.level, logger.propagate
    fixture = conftest._pearl_logging_restored.__wrapped__()  # the fixture's generator, run by hand
    next(fixture)
    setup_logging()
    assert (logger.handlers[:], logger.propagate) != (before[0], before[2])
    with pytest.raises(StopIteration):
        next(fixture)
    assert (logger.handlers[:], logger.level, logger.propagate) == before
