"""The docs stay short and true: ARCHITECTURE.md and PERFORMANCE.md within their line budgets
(they grew into work logs once; the logs live in docs/history/), every module the architecture's
module map names exists, its layers table is the import test's, README's links into docs/ land
on a heading, and CI builds the site with the `docs` extra's pins. Read from the files, no import
of the package (the site itself is checked by `mkdocs build --strict` in .ci/run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "lightning_fp8state"
BUDGETS = {"ARCHITECTURE.md": 400, "PERFORMANCE.md": 300}


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown text (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"no '## {title}' section"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the markdown tables in ``text`` (header and rule skipped)."""
    rows = []
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.fullmatch(r"\|[-:| ]+\|", line):
            continue
        if i + 1 < len(lines) and re.fullmatch(r"\|[-:| ]+\|", lines[i + 1]):
            continue  # a header row
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and Python-Markdown's toc make it (for our headings, alike)."""
    text = re.sub(r"`", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"\s+", "-", text)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_the_current_pages_stay_within_their_line_budget(name):
    lines = len((DOCS / name).read_text().splitlines())
    assert lines <= BUDGETS[name], (
        f"docs/{name} has {lines} lines, its budget is {BUDGETS[name]}: keep the current picture "
        "there and move dated detail to docs/history/"
    )


def test_every_module_in_the_module_map_exists():
    rows = table_rows(section((DOCS / "ARCHITECTURE.md").read_text(), "Module map"))
    paths = [path for row in rows for path in code_spans(row[0])]
    assert len(paths) > 40, f"the module map lists only {len(paths)} modules"
    bad = [path for path in paths if not path.endswith((".py", "/"))]
    assert not bad, f"module map entries that are not a module path under lightning_fp8state/: {bad}"
    missing = [path for path in paths if not (PACKAGE / path).exists()]
    assert not missing, f"docs/ARCHITECTURE.md's module map names modules that do not exist: {missing}"


def test_the_layers_table_is_the_import_tests():
    tree = ast.parse((ROOT / "tests/unit/test_layers.py").read_text())
    (layers,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAYERS" for t in node.targets)
    ]
    rows = table_rows(section((DOCS / "ARCHITECTURE.md").read_text(), "Layers"))
    documented = [(row[0].removesuffix(" (lowest first)"), set(code_spans(row[1]))) for row in rows]
    assert documented == [(name, set(tops)) for name, tops in layers], (
        "docs/ARCHITECTURE.md's layers table differs from tests/unit/test_layers.py's LAYERS"
    )


def test_readme_links_into_docs_land_on_a_heading():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert links
    for target, anchor in links:
        path = ROOT / target
        assert path.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}
            assert anchor in headings, f"README links to {target}#{anchor}: no such heading there"


def test_the_history_pages_say_where_the_current_picture_is():
    for name in BUDGETS:
        log = DOCS / "history" / f"{Path(name).stem}-log-2026-12.md"
        first = log.read_text().splitlines()[0]
        assert f"({'../' + name})" in first, f"{log.name}'s first line should point at docs/{name}"


def test_ci_builds_the_site_with_the_docs_extras_pins():
    tomllib = pytest.importorskip("tomllib")
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    ci = (ROOT / ".ci/run").read_text()
    for pin in pins:
        assert pin in ci.replace("'", ""), f".ci/run does not install {pin} (pyproject's docs extra)"
    assert "mkdocs build --strict" in ci
    assert (ROOT / "mkdocs.yml").is_file()
