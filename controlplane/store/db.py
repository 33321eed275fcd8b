"""The one way to reach the database: engine, transactions, schema upgrades, and the mapping of
database errors to pearl's errors (by SQLSTATE and constraint name, once, here).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pearl.migrations
from pearl.controlplane.errors import (
    BadInput,
    ClaimLost,
    DatabaseBusy,
    DatabaseUnavailable,
    IllegalTransition,
    NotPermitted,
    PearlError,
)
from pearl.controlplane.services.embedded import database_url
from pearl.controlplane.services.settings import redact_url
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:  # Alembic is imported when a migration runs, not by every command that checks the schema
    from alembic.config import Config

MIGRATIONS_DIR = Path(pearl.migrations.__file__).resolve().parent
# SQLSTATEs raised by the triggers of migration 0001 (class PX: pearl)
ILLEGAL_TRANSITION = "PX001"
INVARIANT_VIOLATION = "PX002"
APPEND_ONLY = "PX003"
STALE_FENCE = "PX004"  # 0004: an effect under an older claim's fence than the worker's last
BAD_EVENT = "PX005"  # 0005: an event the trainer, the rollout or the provider reported is refused
# character_not_in_repertoire (a NUL in text), untranslatable_character (\u0000 in JSON), invalid_escape_sequence
TEXT_REFUSED = frozenset({"22021", "22P05", "22025"})
# CHECK constraints of what the trainer and the rollout report: bad input naming the field.
EVENT_CONSTRAINTS = {
    "ck_rollout_progress_step_non_negative": "step: must be >= 0",
    "ck_rollout_progress_batch_size_positive": "batch_size: must be > 0",
    "ck_rollout_progress_finished_within_batch": "finished: must be between 0 and the step's batch size",
    "ck_rollout_progress_in_flight_non_negative": "in_flight: must be >= 0",
    "ck_training_steps_step_non_negative": "step: must be >= 0",
    "ck_training_steps_weights_version_non_negative": "weights_version: must be >= 0",
    "ck_training_steps_times_in_order": "step: its begin, start and end times must be in order",
}
# Statements the database cancelled or rolled back that succeed when tried again: query_canceled (a
# statement_timeout, pg_cancel_backend), deadlock_detected, serialization_failure, lock_not_available,
# idle_in_transaction_session_timeout.
RETRYABLE_STATES = frozenset({"57014", "40P01", "40001", "55P03", "25P03"})
_CONNECT_TIMEOUT_S = 5
# The CHECK constraints that spell the state machine out: violating one is an illegal transition.
# Any other CHECK (a count, an index, a distance) is plain invalid data.
STATE_CONSTRAINTS = frozenset({
    "ck_gpus_held_iff_in_use",
    "ck_gpus_held_by_its_slot",
    "ck_gpus_state_fits_zone",
    "ck_workers_training_role_is_inactive",
    "ck_workers_training_role_is_overlap",
    "ck_plan_steps_running_is_claimed",
    "ck_plan_steps_pending_non_negative",
})


# Database errors this process met in transactions, by kind (`error_kind`): exported as
# `pearl_database_errors_total` by the processes that serve metrics (store/fleet_metrics.py).
DATABASE_ERRORS: Counter[str] = Counter()
_ERRORS_LOCK = threading.Lock()
_KINDS = {"57014": "statement_cancelled", "40P01": "deadlock", "40001": "serialization_failure",
          "55P03": "lock_not_available", "25P03": "idle_in_transaction_timeout", "42501": "not_permitted",
          ILLEGAL_TRANSITION: "illegal_transition", INVARIANT_VIOLATION: "illegal_transition",
          STALE_FENCE: "stale_fence", BAD_EVENT: "bad_input", APPEND_ONLY: "append_only", "23514": "check_violation"}
ERROR_KINDS = (*sorted(set(_KINDS.values())), "connection", "other")


def error_kind(exc: BaseException) -> str:
    """A bounded name for a database error (SQLAlchemy's, or the driver's own): its SQLSTATE's
    meaning, `connection`, or `other`."""
    orig = getattr(exc, "orig", exc)
    state = getattr(orig, "sqlstate", None)
    if state in _KINDS:
        return _KINDS[state]
    lost = type(orig).__name__ == "OperationalError" and (state is None or state.startswith(("08", "57P", "53")))
    return "connection" if lost else "other"


def count_error(exc: BaseException) -> None:
    with _ERRORS_LOCK:
        DATABASE_ERRORS[error_kind(exc)] += 1


def database_errors() -> dict[str, int]:
    """What `count_error` counted so far, by kind."""
    with _ERRORS_LOCK:
        return dict(DATABASE_ERRORS)


class SchemaMissing(PearlError):
    """The database has no pearl schema: run `pearlctl init`."""


# A connection that stops answering is found out: TCP keepalives (a peer gone quiet), a bound on
# unacknowledged data (`tcp_user_timeout`: a partition while a statement is sent), and a statement the
# server runs or waits on for longer than PEARL_STATEMENT_TIMEOUT_S (default 60; 0: none) is cancelled
# (SQLSTATE 57014: DatabaseBusy, tried again). libpq ignores the TCP settings on a Unix socket.
TCP_ARGS = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
            "tcp_user_timeout": 30_000}
DEFAULT_STATEMENT_TIMEOUT_S = 60.0


def statement_timeout_s() -> float:
    raw = os.environ.get("PEARL_STATEMENT_TIMEOUT_S", "").strip()
    if not raw:
        return DEFAULT_STATEMENT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"PEARL_STATEMENT_TIMEOUT_S: seconds (0: none), not {raw!r}") from None
    if value < 0:
        raise BadInput(f"PEARL_STATEMENT_TIMEOUT_S: seconds (0: none), not {raw!r}")
    return value


def connect_args(url: str) -> dict[str, Any]:
    """libpq settings of every pearl connection: the connect timeout, TCP keepalives and
    `tcp_user_timeout`, and the statement timeout (added to the URL's own `options`)."""
    args: dict[str, Any] = {"connect_timeout": _CONNECT_TIMEOUT_S, **TCP_ARGS}
    timeout = statement_timeout_s()
    if timeout > 0:
        own = make_url(url).query.get("options")
        own = " ".join(own) if isinstance(own, tuple) else (own or "")
        args["options"] = f"{own} -c statement_timeout={int(timeout * 1000)}".strip()
    return args


def make_engine(url: str | None = None, *, component: str | None = None, node: str | None = None,
                **kwargs) -> Engine:
    """An engine on `url` (default: the configured or embedded database), psycopg 3 driver, with
    `connect_args` (timeouts and keepalives), logged in as `component`'s role (`roles.login_url`;
    None: the URL's user)."""
    from pearl.controlplane.store.roles import login_url

    url = login_url(url or database_url(), component, node)
    args = {**connect_args(str(url)), **kwargs.pop("connect_args", {})}
    return create_engine(url, pool_pre_ping=True, connect_args=args, **kwargs)


def _unavailable(engine_or_url: Engine | str, exc: BaseException) -> DatabaseUnavailable:
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else make_url(engine_or_url)
    orig = getattr(exc, "orig", exc)
    reason = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    return DatabaseUnavailable(f"cannot connect to {redact_url(url)}: {reason}")


def _is_connection_failure(exc: DBAPIError) -> bool:
    state = getattr(exc.orig, "sqlstate", None)
    return isinstance(exc, OperationalError) and (state is None or state.startswith(("08", "57P", "53")))


def translate(exc: DBAPIError, engine: Engine | None = None) -> PearlError | None:
    """The pearl error a database error means, or None when it is not one of ours."""
    orig = exc.orig
    state = getattr(orig, "sqlstate", None)
    diag = getattr(orig, "diag", None)
    if state in (ILLEGAL_TRANSITION, INVARIANT_VIOLATION):
        return IllegalTransition(diag.message_primary if diag else str(orig))
    if state == STALE_FENCE:
        return ClaimLost(diag.message_primary if diag else str(orig))
    if state == BAD_EVENT:
        return BadInput(diag.message_primary if diag else str(orig))
    if state == "22003":  # numeric_value_out_of_range: a number larger than its column holds
        return BadInput(f"a number out of the database's range: {(str(orig).strip().splitlines() or ['?'])[0]}")
    if state in TEXT_REFUSED or (state is None and isinstance(exc, DataError)):
        # a NUL or a bad escape in text or JSON, refused by psycopg before sending or by the server
        return BadInput(f"text the database cannot store: {(str(orig).strip().splitlines() or ['?'])[0]}")
    if state == "23514":  # check_violation
        name = diag.constraint_name if diag else None
        if name in EVENT_CONSTRAINTS:
            return BadInput(f"{EVENT_CONSTRAINTS[name]} (refused by {name})")
        message = f"refused by constraint {name}: {diag.message_primary if diag else orig}"
        return IllegalTransition(message) if name in STATE_CONSTRAINTS else PearlError(message)
    if state == "42501":  # insufficient_privilege: this component's role (roles.py) may not do it
        return NotPermitted(diag.message_primary if diag else str(orig).strip())
    if state in RETRYABLE_STATES:
        return DatabaseBusy(f"the database gave up on the statement ({state}): "
                            f"{diag.message_primary if diag else str(orig).strip()}")
    if engine is not None and _is_connection_failure(exc):
        return _unavailable(engine, exc)
    return None


def check_connection(engine: Engine) -> None:
    """Raise DatabaseUnavailable (URL without password, and why) unless the database answers."""
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except DBAPIError as exc:
        raise _unavailable(engine, exc) from None


@contextlib.contextmanager
def transaction(
    engine: Engine, actor: str | None = None, reason: str | None = None, *, isolation_level: str | None = None,
    whole_fleet: bool = False,
) -> Iterator[Session]:
    """A session in one transaction: committed on success, rolled back on error, errors translated.

    `actor` and `reason` go to every event the transaction writes (`SET LOCAL pearl.actor`);
    `isolation_level="REPEATABLE READ"` gives reads one consistent snapshot. `whole_fleet` takes the
    fleet first (`transitions.lock_fleet`), before the snapshot: with REPEATABLE READ, the rows read are
    exactly the fleet at its `state_version` (what a decision plans against).
    """
    bind = engine.execution_options(isolation_level=isolation_level) if isolation_level else engine
    session = Session(bind, expire_on_commit=False)
    try:
        with session.begin():
            if whole_fleet:
                from pearl.controlplane.store.transitions import lock_fleet  # it imports the schema

                lock_fleet(session)
            set_actor(session, actor, reason)
            yield session
        hooks = session.info.pop(AFTER_COMMIT, ())
    except DBAPIError as exc:
        count_error(exc)
        mapped = translate(exc, engine)
        if mapped is None:
            raise
        raise mapped from exc
    finally:
        session.close()
    for hook in hooks:
        hook(engine)


AFTER_COMMIT = "pearl_after_commit"


def after_commit(session: Session, hook: Callable[[Engine], None]) -> None:
    """Run `hook(engine)` once the transaction `session` belongs to (one of `transaction`'s) has
    committed, outside it; never if it rolls back."""
    session.info.setdefault(AFTER_COMMIT, []).append(hook)


def set_actor(session: Session, actor: str | None, reason: str | None = None) -> None:
    """Name who changes the state, and why, for the rest of this transaction's events."""
    if actor is None and reason is None:
        return
    session.execute(
        text("SELECT set_config('pearl.actor', :a, true), set_config('pearl.reason', :r, true)"),
        {"a": actor or "", "r": reason or ""},
    )


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


# --- schema (Alembic) ---------------------------------------------------------------------------


def alembic_config(url: str) -> Config:
    """Alembic's configuration for `url`, independent of the working directory."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = url
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("postgresql+psycopg://")).get_current_head() or ""


_REVISION = re.compile(r"^revision(?:: *str)? *= *['\"]([^'\"]+)['\"]", re.MULTILINE)
_DOWN_REVISION = re.compile(r"^down_revision(?:: *[\w |]+)? *= *(?:['\"]([^'\"]+)['\"]|None)", re.MULTILINE)


@functools.cache
def head_revision_fast() -> str:
    """The head revision read from the migration files without importing Alembic (a linear history);
    Alembic's answer when the files do not form one chain."""
    revisions, parents = set(), set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        source = path.read_text(encoding="utf-8")
        rev, down = _REVISION.search(source), _DOWN_REVISION.search(source)
        if rev is None or down is None:
            continue
        revisions.add(rev.group(1))
        if down.group(1):
            parents.add(down.group(1))
    heads = revisions - parents
    return next(iter(heads)) if len(heads) == 1 else head_revision()


def current_revision(engine: Engine) -> str | None:
    """The schema revision stored in the database (None before `pearlctl init`), read with one query."""
    try:
        with engine.connect() as conn:
            if conn.execute(text("SELECT to_regclass('alembic_version')")).scalar() is None:
                return None
            rows = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    except DBAPIError as exc:
        raise _unavailable(engine, exc) from None
    if len(rows) > 1:
        raise PearlError(f"{redact_url(engine.url)} has several schema heads ({', '.join(sorted(rows))}); "
                         "run `alembic heads`")
    return rows[0] if rows else None


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Create or upgrade the schema (concurrent callers serialise on env.py's advisory lock)."""
    check_connection(engine)
    from alembic import command

    command.upgrade(alembic_config(engine.url.render_as_string(hide_password=False)), revision)
    return current_revision(engine)


def require_schema(engine: Engine) -> None:
    """Refuse to work on a database that `pearlctl init` has not brought to the head revision."""
    current = current_revision(engine)
    if current is None:
        raise SchemaMissing(f"{redact_url(engine.url)} has no pearl schema: run `pearlctl init`")
    head = head_revision_fast()
    if current != head:
        raise SchemaMissing(f"{redact_url(engine.url)} is at schema {current}, not {head}: run `pearlctl init`")


def recreate_database(url: str, name: str) -> str:
    """Drop (forcing its connections out) and create database `name` on `url`'s server; its URL."""
    if not name.replace("_", "").isalnum():
        raise BadInput(f"database name: letters, digits and underscores only, not {name!r}")
    admin = create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT",
                          connect_args={"connect_timeout": _CONNECT_TIMEOUT_S})
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except DBAPIError as exc:
        raise _unavailable(admin, exc) from None
    finally:
        admin.dispose()
    return make_url(url).set(database=name).render_as_string(hide_password=False)
