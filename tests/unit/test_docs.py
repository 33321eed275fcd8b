"""The documentation in docs/ is what the code refers to, and says what the code does.

- every `docs/<page>.md` that a file of the repository names exists, and every section such a
  reference names (`docs/formats.md, "Inventory"`, `docs/method.md, orchestration`) and every
  "invariant N" is a heading of that page; a backticked key after a reference appears in the page;
- no file refers to a document outside the repository (the project's background pages are not
  shipped): every `*.md` a file names resolves to a file of the repository;
- the links, anchors, file paths and test names the pages cite exist;
- what the pages reproduce matches its source: the transition tables (migration 0001), the
  performance model's constants, and the example inventory, scenario and telemetry parse.
"""

from __future__ import annotations

import importlib
import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".sql", ".md", ".toml", ".ini", ".cfg", ".mako", ".sh", ".txt"}
SKIP_DIRS = {"__pycache__", "build", "dist", "out", "node_modules", "venv"}
# the project's background material lives outside the repository; nothing may point there
OUTSIDE = ("../" + "shared", "/work/" + "shared")

DOC_REF = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)")
MD_NAME = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-][\w.-]*\.md)\b")
QUOTED = re.compile(r'^,?\s*"([^"]+)"')
PHRASE = re.compile(r"^,?\s*([A-Za-z][A-Za-z0-9 -]*?)\s*\)")
BACKTICKED = re.compile(r"^,?\s*(?:scenario\s+)?`([^`]+)`")
INVARIANT = re.compile(r"\binvariant (\d+)\b", re.IGNORECASE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:controlplane|policies|agents|cli|sim|migrations|bench|tests|docs|\.ci)/[^`\s]+)`")


def _files() -> list[Path]:
    out = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if any(p in SKIP_DIRS or p.endswith(".egg-info") or (p.startswith(".") and p != ".ci") for p in parts[:-1]):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or parts[0] == ".ci"):
            out.append(path)
    return sorted(out)


FILES = _files()
SOURCES = [p for p in FILES if p.parent != DOCS and p != Path(__file__).resolve()]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _flat(path: Path) -> str:
    """The file with line breaks and comment markers folded into spaces, so that a reference wrapped
    over two lines of a comment or docstring reads as one phrase."""
    return re.sub(r"\s*\n\s*(?:#+\s*|--\s*)?", " ", _text(path))


@cache
def _headings(page: str) -> tuple[str, ...]:
    return tuple(h.replace("`", "").strip() for h in HEADING.findall(FENCE.sub("", _text(DOCS / page))))


def _has_heading(page: str, section: str) -> bool:
    s = section.strip().lower()
    return any(h.lower() == s or h.lower().startswith(s + ":") for h in _headings(page))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def _references() -> list[tuple[str, str, str]]:
    """(file, page, what follows the reference) for every `docs/<page>.md` in the repository."""
    refs = []
    for path in SOURCES:
        text = _flat(path)
        for m in DOC_REF.finditer(text):
            refs.append((_rel(path), m.group(1), text[m.end():m.end() + 120]))
    return refs


REFERENCES = _references()


def test_the_code_refers_to_docs_pages() -> None:
    pages = {page for _, page, _ in REFERENCES}
    assert {"architecture.md", "state-machine.md", "method.md", "calibration.md", "simulator.md",
            "formats.md"} <= pages, pages


@pytest.mark.parametrize("page", sorted({page for _, page, _ in REFERENCES}))
def test_every_referenced_page_exists(page: str) -> None:
    where = sorted({f for f, p, _ in REFERENCES if p == page})
    assert (DOCS / page).is_file(), f"docs/{page} is referred to by {where} but does not exist"


def test_every_section_a_reference_names_is_a_heading_of_its_page() -> None:
    missing = []
    for where, page, after in REFERENCES:
        if not (DOCS / page).is_file():
            continue  # reported by test_every_referenced_page_exists
        for pattern in (QUOTED, PHRASE):
            m = pattern.match(after)
            if m and not _has_heading(page, m.group(1)):
                missing.append(f"{where}: docs/{page}, {m.group(1)!r}")
        m = BACKTICKED.match(after)
        if m and m.group(1) not in _text(DOCS / page):
            missing.append(f"{where}: docs/{page}, `{m.group(1)}` does not appear in the page")
    assert not missing, "references to sections that do not exist:\n" + "\n".join(missing)


def test_every_invariant_the_code_names_has_its_section() -> None:
    named = {(int(n), _rel(p)) for p in SOURCES for n in INVARIANT.findall(_flat(p))}
    assert named, "the code names no invariant"
    missing = sorted(f"{where}: invariant {n}" for n, where in named if not _has_heading("state-machine.md",
                                                                                       f"invariant {n}"))
    assert not missing, "invariants without a heading in docs/state-machine.md:\n" + "\n".join(missing)
    assert all(_has_heading("state-machine.md", f"invariant {n}") for n in range(1, 9))


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_no_file_refers_to_a_document_outside_the_repository(path: Path) -> None:
    if path == Path(__file__).resolve():
        return
    text = _text(path)
    for outside in OUTSIDE:
        assert outside not in text, f"{_rel(path)} refers to {outside}"
    for name in MD_NAME.findall(text):
        if name.startswith("docs/"):
            continue  # the page checks above
        base = DOCS if path.parent == DOCS else REPO
        candidates = {base / name, path.parent / name}
        assert any(c.is_file() for c in candidates), (
            f"{_rel(path)} names {name}, which is not a file of the repository (docs/ has the project's pages)")


# -- what the pages cite ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [*PAGES, REPO / "README.md"], ids=_rel)
def test_links_and_anchors_resolve(path: Path) -> None:
    broken = []
    for target in LINK.findall(_text(path)):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        page = (path.parent / file).resolve() if file else path
        if not page.is_file():
            broken.append(target)
        elif anchor and page.suffix == ".md":
            if anchor not in {_slug(h) for h in HEADING.findall(FENCE.sub("", _text(page)))}:
                broken.append(target)
    assert not broken, f"{_rel(path)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_files_and_tests_exist(page: Path) -> None:
    missing = []
    for cited in REPO_PATH.findall(FENCE.sub("", _text(page))):
        file, _, test = cited.partition("::")
        file = file.rstrip("/")
        matches = list(REPO.glob(file)) if "*" in file else [REPO / file]
        if not all(m.exists() for m in matches) or not matches:
            missing.append(cited)
        elif test and not re.search(rf"^(?:async )?def {re.escape(test)}\(", _text(REPO / file), re.MULTILINE):
            missing.append(cited)
    assert not missing, f"{page.name} cites what does not exist: {missing}"


def _section(page: str, heading: str) -> str:
    text = _text(DOCS / page)
    start = re.search(rf"^#+ {re.escape(heading)}\s*$", text, re.MULTILINE)
    assert start, f"docs/{page} has no section {heading!r}"
    level = text[start.start():].index(" ")
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, start.end())
    return text[start.end(): end.start() if end else len(text)]


def _blocks(page: str, heading: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", _section(page, heading), re.MULTILINE | re.DOTALL)


def test_the_transition_tables_are_the_migrations_edges() -> None:
    initial = importlib.import_module("pearl.migrations.versions.0001_initial")
    documented: set[tuple[str, str, str, str]] = set()
    zone = None
    rows = _section("state-machine.md", "GPU transitions per zone").splitlines()
    for line in rows:
        m = re.match(r"^(Training|Rollout|Preemptible) zone", line)
        if m:
            zone = m.group(1).lower()
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if cells:
            for source in re.findall(r"`(\w+)`", cells[0]):
                documented.add((zone, source, cells[1].strip("`"), cells[2]))
    expected = {(z, a, b, c) for z, edges in initial.GPU_EDGES.items() for a, b, c in edges}
    assert documented == expected
    workers = set()
    for line in _section("state-machine.md", "Worker activity transitions").splitlines():
        if line.startswith("| `"):
            a, b, c = (x.strip().strip("`") for x in line.strip().strip("|").split("|"))
            workers.add((a, b, c))
    assert workers == set(initial.WORKER_EDGES)


def test_the_constants_table_is_the_performance_models() -> None:
    perfmodel = importlib.import_module("pearl.controlplane.core.perfmodel")
    table = _section("calibration.md", "Constants of the performance model")
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", table, re.MULTILINE)
    documented = {name: float(value) for name, value in rows}
    constants = {name: float(v) for name, v in vars(perfmodel).items()
                 if re.fullmatch(r"[A-Z][A-Z_]+", name) and isinstance(v, int | float)}
    assert documented == constants


def test_the_example_inventory_scenario_and_telemetry_are_valid() -> None:
    from pearl.controlplane.core.inventory import parse_inventory
    from pearl.controlplane.core.telemetry import parse_telemetry
    from pearl.sim.scenario import parse_scenario

    (inventory,) = _blocks("formats.md", "Inventory", "yaml")
    parse_inventory(yaml.safe_load(inventory))
    (scenario,) = _blocks("formats.md", "Scenario", "yaml")
    shipped = REPO / "sim" / "scenarios" / "paper-qwen3-8b-seg2.yaml"
    assert yaml.safe_load(scenario) == yaml.safe_load(shipped.read_text())
    parse_scenario(yaml.safe_load(scenario), shipped)
    (telemetry,) = _blocks("formats.md", "Telemetry", "json")
    parse_telemetry(json.loads(telemetry))
