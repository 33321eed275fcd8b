"""The SQL that README invites users to paste into psql runs against the schema as it is."""

from __future__ import annotations

import re

import pytest
from pearl.controlplane.store.db import transaction
from plan_support import REPO
from sqlalchemy import Engine, text

pytestmark = pytest.mark.integration


def readme_statements() -> list[str]:
    blocks = re.findall(r"```sql\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    statements = [s.strip() for block in blocks for s in block.split(";")]
    return [s for s in statements if any(line and not line.startswith("--") for line in s.splitlines())]


def test_readme_has_example_queries_for_each_view() -> None:
    text = " ".join(readme_statements())
    for view in ("gpu_state_by_zone", "gpu_detail", "worker_roles_history", "plan_timeline", "transitions",
                 "borrow_cycles"):
        assert f"FROM {view}" in text, view


@pytest.mark.parametrize("statement", readme_statements(), ids=lambda s: s.splitlines()[0][:60])
def test_readme_query_runs(cluster_engine: Engine, statement: str) -> None:
    with transaction(cluster_engine, actor="trainer", reason="step 1") as session:  # one state change to show
        session.execute(text("UPDATE gpus SET state = 'training' WHERE zone = 'training'"))
    with cluster_engine.connect() as conn:
        rows = conn.exec_driver_sql(statement).all()
    if not any(v in statement for v in ("plan_timeline", "borrow_cycles")):
        # the small cluster has no plan and no loan yet; everything else has rows
        assert rows, statement
