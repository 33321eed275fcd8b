"""The database role each pearl component connects as (migration 0012).

  component   role                  may
  owner       the URL's user        migrate, import the inventory, create node roles (`pearlctl db roles`)
  policy      pearl_policy          read and write the state (loop, tick, plan, apply, events, weight sync)
  agent       pearl_agent_<node>    change its own node's rows and steps; GPUs only through the functions
  frontdoor   pearl_frontdoor       write the routers' rows
  audit       pearl_audit           read (status, check, dashboard), not the control token

`PEARL_DATABASE_ROLES` says whether a command connects as its component's role (`component`, the
default on the embedded server) or as the URL's user (`url`, the default with `PEARL_DATABASE_URL`:
create the roles on the server with `pearlctl db roles`, give each a password and put it in the
process's `~/.pgpass`, then set `component`). Every role but the owner is refused what it may not do
with SQLSTATE 42501 (`NotPermitted`).
"""

from __future__ import annotations

import hashlib
import os

from pearl.controlplane.errors import BadInput
from pearl.controlplane.services.settings import get_settings
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

OWNER = "pearl_owner"
AGENT_GROUP = "pearl_agent"
COMPONENT_ROLES = {"policy": "pearl_policy", "frontdoor": "pearl_frontdoor", "audit": "pearl_audit"}
COMPONENTS = ("owner", "agent", *COMPONENT_ROLES)
MODES = ("component", "url")
_MAX_NAME = 63  # PostgreSQL's identifier length


def node_role(node: str) -> str:
    """The login role of `node`'s agent: `pearl_agent_<node>`, shortened with a digest past 63 bytes."""
    name = f"pearl_agent_{node}"
    if len(name.encode()) <= _MAX_NAME:
        return name
    return f"pearl_agent_{node[:34]}_{hashlib.sha256(node.encode()).hexdigest()[:16]}"


def mode() -> str:
    """`component` or `url` (module docstring)."""
    raw = os.environ.get("PEARL_DATABASE_ROLES", "").strip().lower()
    if not raw:
        return "url" if get_settings().database_url else "component"
    if raw not in MODES:
        raise BadInput(f"PEARL_DATABASE_ROLES: {' or '.join(MODES)}, not {raw!r}", field="PEARL_DATABASE_ROLES")
    return raw


def role_for(component: str, node: str | None = None) -> str | None:
    """The role `component` connects as under `component` mode; None: the URL's user (the owner)."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}")
    if component == "owner":
        return None
    if component == "agent":
        if not node:
            raise ValueError("an agent's role needs its node")
        return node_role(node)
    return COMPONENT_ROLES[component]


def login_url(url: str, component: str | None, node: str | None = None) -> str:
    """`url` as `component` connects to it: the same server and database, as its role when the mode
    is `component`, else unchanged."""
    if component is None or mode() == "url":
        return url
    role = role_for(component, node)
    if role is None:
        return url
    return make_url(url).set(username=role, password=None).render_as_string(hide_password=False)


def ensure_node_role(engine: Engine, node: str) -> str:
    """Create `node`'s agent role (a login in `pearl_agent`) if missing and map it to the node; run as
    a role that may create roles (the owner's URL). Returns the role's name."""
    role = node_role(node)
    with engine.begin() as conn:
        node_id = conn.scalar(text("SELECT id FROM nodes WHERE name = :n"), {"n": node})
        if node_id is None:
            raise BadInput(f"node: no node named {node!r} in the inventory", field="node")
        conn.execute(text("""
            DO $$ BEGIN
                IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') THEN
                    CREATE ROLE :"role" LOGIN;
                END IF;
            EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
            END $$""".replace(":'role'", _literal(role)).replace(':"role"', _ident(role))))
        conn.execute(text(f"GRANT {AGENT_GROUP} TO {_ident(role)}"))
        conn.execute(text("INSERT INTO node_roles (role_name, node_id) VALUES (:r, :n) "
                          "ON CONFLICT (node_id) DO UPDATE SET role_name = excluded.role_name"),
                     {"r": role, "n": node_id})
    return role


def node_names(engine: Engine) -> list[str]:
    """The inventory's nodes, in id order."""
    with engine.connect() as conn:
        return list(conn.scalars(text("SELECT name FROM nodes ORDER BY id")))


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
