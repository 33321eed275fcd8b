"""The database giving up on statements, for real: a trigger that raises the given SQLSTATEs, one per
matching statement, then lets the rest through. A sequence counts them (nextval is not rolled back
with the failure it causes)."""

from __future__ import annotations

from sqlalchemy import Engine, text


def refuse_first(engine: Engine, name: str, table: str, events: str, sqlstates: list[str],
                 when: str = "TRUE") -> None:
    """The first `len(sqlstates)` rows of `table` written by `events` ("INSERT", "UPDATE", "INSERT OR
    UPDATE") that match `when` (SQL over NEW and OLD) fail with those SQLSTATEs, in order."""
    branches = "\n".join(f"{'IF' if i == 0 else 'ELSIF'} n = {i + 1} THEN RAISE EXCEPTION 'injected by the test "
                         f"({state})' USING ERRCODE = '{state}';" for i, state in enumerate(sqlstates))
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SEQUENCE {name}"))
        conn.execute(text(f"""
            CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
            DECLARE n bigint;
            BEGIN
              IF {when} THEN
                n := nextval('{name}');
                {branches}
                END IF;
              END IF;
              RETURN NEW;
            END $$"""))
        conn.execute(text(f"CREATE TRIGGER {name} BEFORE {events} ON {table} FOR EACH ROW EXECUTE FUNCTION "
                          f"{name}()"))


def refused(engine: Engine, name: str) -> int:
    """How many matching statements the trigger has seen."""
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {name}")).scalar())
