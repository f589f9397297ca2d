"""The layout rules the README and docs/architecture.md promise, checked on the tree itself:
every module named in its package's map (the package docstring) and in docs/architecture.md,
imports flowing one way between and inside the top-level packages (type-only imports
included), no import cycle, no production file over 500 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("encoder_service", "ec_connectors", "scheduler_hooks")  # top to bottom
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every project module `path` imports, anywhere in it (functions and TYPE_CHECKING
    blocks included): `from a.b import c` names a.b.c when that is a module, else a.b."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and name in MODULES:
                found.add(name)
    return found


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _doc(package: str) -> str:
    return ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""


def _unmapped(doc: str, stems: list[str]) -> list[str]:
    """The `stems` a package map (its __init__ docstring) has no entry for: an entry names
    the file, `stem.py`, on its own (not inside another path, `a/stem.py`, nor as part of a
    longer name); the stem merely appearing in the prose is no entry."""
    entries = set(re.findall(r"(?<![\w./])(\w+)\.py\b", doc))
    return [s for s in stems if s not in entries]


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items()
                                          if p.name not in ("__init__.py", "__main__.py")))
def test_every_module_is_on_its_package_map_and_in_architecture_md(module):
    package = _package_of(module)
    stem = module.rpartition(".")[2]
    assert not _unmapped(_doc(package), [stem]), \
        f"{module}: no `{stem}.py` entry in {package}'s map (its __init__ docstring)"
    assert f"{stem}.py" in ARCHITECTURE or f"`{stem}`" in ARCHITECTURE, \
        f"{module}: not in docs/architecture.md"


def test_a_map_entry_deleted_is_reported_though_the_name_stays_in_the_prose():
    """The map check itself: with `scheduler.py`'s entry cut from ec_connectors.sched's map,
    "scheduler" still appears in its prose (the check once passed on that), and the
    module is reported; the untouched map has it."""
    doc = _doc("ec_connectors.sched")
    entry = next(line for line in doc.splitlines() if line.startswith("- `scheduler.py`"))
    cut = doc.replace(entry, "- ")
    assert "scheduler" in cut  # what `stem in doc` looked for
    assert _unmapped(cut, ["scheduler", "hints"]) == ["scheduler"]
    assert _unmapped(doc, ["scheduler", "hints"]) == []


def test_every_test_file_named_in_the_tree_exists():
    """A test file named in a docstring, comment or doc (`tests/.../test_x.py`) exists: one
    that moved is renamed where it is named (tests/hostile.py once named a moved one)."""
    texts = [*ROOT.glob("tests/**/*.py"), *MODULES.values(), *ROOT.glob("docs/*.md"),
             ROOT / "README.md"]
    missing = {(str(p.relative_to(ROOT)), name) for p in texts
               for name in re.findall(r"(?<![\w./])(tests/[\w/]+\.py)\b", p.read_text())
               if not (ROOT / name).exists()}
    assert not missing, sorted(missing)


def test_imports_flow_down_between_top_level_packages():
    rank = {top: i for i, top in enumerate(PACKAGES)}
    back = [f"{m} -> {i}" for m, p in MODULES.items() for i in _imports(p)
            if rank[i.split(".")[0]] < rank[m.split(".")[0]]]
    assert not back, "imports going up a layer:\n" + "\n".join(back)


def test_protocol_imports_nothing_of_the_project_above_it():
    allowed = ("ec_connectors.protocol", "ec_connectors.log", "ec_connectors.config_files")
    bad = [f"{m} -> {i}" for m, p in MODULES.items() if m.startswith("ec_connectors.protocol")
           for i in _imports(p) if not i.startswith(allowed)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {i for i in _imports(p) if i != m} for m, p in MODULES.items()}
    # a package's __init__ importing its own modules is how a package exports: not a cycle
    for m in graph:
        if MODULES[m].name == "__init__.py":
            graph[m] = {i for i in graph[m] if not i.startswith(m + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_production_file_over_500_lines():
    long = {m: n for m, p in MODULES.items()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_readme_stays_a_front_page():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 200, f"README.md has {lines} lines: caveats belong in docs/"
