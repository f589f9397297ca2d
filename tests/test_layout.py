"""The layout rules the README and docs/architecture.md promise, checked on the tree itself:
every module named in its package's map (the package docstring) and in docs/architecture.md,
imports flowing one way between and inside the top-level packages (type-only imports
included), no import cycle, no production file over 450 lines, no module of 25 lines or fewer
that is not a package's face, `encoder_service` importing only the wire protocol and the
connector's config from `ec_connectors`, no running machinery in the protocol, no measured
figure in a production comment, and the test support (`epd_testkit/`, `benchmarks/`, `tests/`)
out of the product: imported by no production module and left out of the wheel."""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("encoder_service", "ec_connectors", "scheduler_hooks", "epd_common")  # top to bottom
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
MAX_LINES = 450


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
    allowed = ("ec_connectors.protocol", "ec_connectors.log", "epd_common")
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


LONG_EXCEPTIONS: dict[str, int] = {}  # none: every production file is within the limit


def test_no_production_file_over_450_lines():
    long = {m: n for m, p in MODULES.items()
            if (n := len(p.read_text().splitlines())) > LONG_EXCEPTIONS.get(m, MAX_LINES)}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_readme_stays_a_front_page():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 200, f"README.md has {lines} lines: caveats belong in docs/"


# What encoder_service may take from ec_connectors beyond the wire protocol and the
# connector's config, each with the reason it is the connector's own code and not a copy.
SERVICE_EXCEPTIONS = {
    # the encoder pool is a producer: it stores items through the connector's transports and
    # publishes vLLM's placeholder metadata as a vLLM producer's connector does
    "encoder_service.encoder_pool.publish": ("ec_connectors.transports",
                                             "ec_connectors.placeholders"),
    "encoder_service.encoder_pool.server": ("ec_connectors.transports",),
    "encoder_service.encoder_pool.models": ("ec_connectors.placeholders",),
    # the gateway follows a Mooncake TE producer's announcements with the consumers' catalog
    # (and names its places with the transports' `Placement`)
    "encoder_service.gateway.upstreams.availability": (
        "ec_connectors.transports.mooncake_te.catalog", "ec_connectors.transports.base"),
    # epd up names the vLLM middleware by its stable path and checks that it imports
    "encoder_service.local.processes": ("ec_connectors.server_guard",),
}
SERVICE_ALLOWED = ("ec_connectors.protocol", "ec_connectors.config")


def test_encoder_service_takes_only_the_protocol_and_config_from_ec_connectors():
    bad = [f"{m} -> {i}" for m, p in MODULES.items() if m.startswith("encoder_service")
           for i in _imports(p) if i.startswith("ec_connectors")
           and not i.startswith(SERVICE_ALLOWED + SERVICE_EXCEPTIONS.get(m, ()))]
    assert not bad, "encoder_service reaching into the connector:\n" + "\n".join(bad)


def _top_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_the_protocol_holds_no_running_machinery():
    """Formats only: no thread, event loop, child process or ZMQ context (it may set a
    socket's CURVE options, which runs nothing), no torch."""
    machinery = {"threading", "asyncio", "subprocess", "multiprocessing", "torch"}
    bad = {}
    for m, p in MODULES.items():
        if m.startswith("ec_connectors.protocol"):
            found = sorted(_top_imports(p) & machinery)
            found += [s for s in ("zmq.Context", "Thread(") if s in p.read_text()]
            if found:
                bad[m] = found
    assert not bad, f"the wire protocol runs nothing: {bad}"


# Small modules that stay on their own, and why.
SMALL_EXCEPTIONS = {
    "ec_connectors.server_guard": "the stable `--middleware` path users pass to vLLM",
    "ec_connectors.log": "the logger every connector module imports; merged anywhere it "
                         "would make that module everyone's dependency",
    "ec_connectors.transports.nixl_pull.catalog": "the scheduler's view of the nixl "
                                                  "transport, importable without torch or NIXL",
    "ec_connectors.transports.mooncake_te.catalog": "the scheduler's and gateway's view of "
                                                    "the mooncake transport, importable "
                                                    "without torch",
}


def test_no_tiny_module_outside_a_package_face():
    tiny = sorted(m for m, p in MODULES.items()
                  if p.name not in ("__init__.py", "__main__.py")
                  and len(p.read_text().splitlines()) <= 25 and m not in SMALL_EXCEPTIONS)
    assert not tiny, f"modules of 25 lines or fewer (merge them into their idea): {tiny}"


_FIGURE = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|us|µs|ns|s|KiB|MiB|GiB|KB|MB|GB|kB|%)\b")


def _comments(path: Path) -> list[tuple[int, str]]:
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in toks if t.type == tokenize.COMMENT]


def test_no_measured_figure_in_a_production_comment():
    """Figures belong in docs/benchmarks.md: a comment with a number and a unit goes stale."""
    bad = [f"{p.relative_to(ROOT)}:{n}: {c}" for m, p in MODULES.items()
           for n, c in _comments(p) if _FIGURE.search(c)]
    assert not bad, "measured figures in comments:\n" + "\n".join(bad)


def _help_texts(path: Path) -> list[tuple[int, str]]:
    """The literal help texts of `path`: a pydantic Field's `description=`, argparse's
    `help=` (what `--help` and the config docs print)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("description", "help"):
                    try:
                        text = ast.literal_eval(kw.value)
                    except ValueError:
                        continue
                    if isinstance(text, str):
                        out.append((kw.value.lineno, text))
    return out


def test_no_measured_figure_in_a_production_help_text():
    """A help text states what a setting does; what it was measured to cost is in
    docs/benchmarks.md (a figure with a unit in a help text goes stale as a comment's does)."""
    bad = [f"{p.relative_to(ROOT)}:{n}: {t[:120]}" for m, p in MODULES.items()
           for n, t in _help_texts(p) if _FIGURE.search(t)]
    assert not bad, "measured figures in help texts:\n" + "\n".join(bad)


def test_help_text_rule_reads_fields_and_arguments(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("x = Field(8, description='calls share: 5.0 ms per image alone')\n"
                 "p.add_argument('--n', help='how many')\n")
    texts = _help_texts(f)
    assert [n for n, _ in texts] == [1, 2] and _FIGURE.search(texts[0][1])


def test_figure_rule_sees_a_figure():
    assert _FIGURE.search("# took 12.5 ms per call") and _FIGURE.search("# 125 MiB")
    assert not _FIGURE.search("# two calls, then the next") and not _FIGURE.search("# x2")


# What tests and benchmarks run beside the product: never imported by it, never in the wheel.
TEST_SUPPORT = ("epd_testkit", "benchmarks", "tests")
# a test-support module named in a string (to run it: `-m epd_testkit.peer_process`); not a
# path (`docs/benchmarks.md`) nor the doc's name (`benchmarks.md`)
_RUN_NAME = re.compile(r"(?<![\w/.-])((?:epd_testkit|benchmarks)\.(?!md\b)\w+)")


def _test_support_uses(path: Path) -> list[str]:
    """Where `path` imports the test support, or names one of its modules to run (a string
    such as `-m epd_testkit.peer_process`'s): `line: what`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = re.findall(_RUN_NAME, node.value)
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in TEST_SUPPORT]
    return found


def test_no_production_module_uses_the_test_support():
    bad = [f"{p.relative_to(ROOT)}:{use}" for p in MODULES.values()
           for use in _test_support_uses(p)]
    assert not bad, ("the product must not need what tests and benchmarks run (epd_testkit/, "
                     "benchmarks/ are not in the wheel):\n" + "\n".join(bad))


def test_the_test_support_rule_sees_an_import_and_a_module_named_to_run(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import json\nfrom epd_testkit.peer_process import PeerClient\n"
                 "CMD = ['python', '-m', 'benchmarks.harness.processes']\n"
                 "DOC = 'see docs/benchmarks.md, benchmarks.md and epd_testkit/'\n")
    assert _test_support_uses(f) == ["2: epd_testkit.peer_process",
                                     "3: benchmarks.harness"]


def _wheel_packages(find: dict) -> list[str]:
    """The packages setuptools puts in the wheel under pyproject's `packages.find`."""
    from setuptools import find_packages

    return find_packages(where=str(ROOT / find.get("where", ["."])[0]),
                         include=find.get("include", ["*"]), exclude=find.get("exclude", ()))


def test_the_wheel_holds_the_product_and_none_of_the_test_support():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    packages = _wheel_packages(find)
    assert set(PACKAGES) <= set(packages), f"the wheel lacks product packages: {packages}"
    leaked = [p for p in packages if p.split(".")[0] in TEST_SUPPORT]
    assert not leaked, f"test support in the wheel: {leaked}"
    # the check itself: without the package list, the test support would be found
    assert "epd_testkit" in _wheel_packages({})


TRANSPORTS = ROOT / "ec_connectors" / "transports"


# The peer-pull core: the base classes and Protocols its data path packages implement.
CORE_PACKAGES = ("peer_pull",)


def _transport_package(module: str) -> str | None:
    """The transport package (`mooncake_te`, `nixl_pull`, ...) a module belongs to; None for
    the shared modules directly under transports/ (base.py and the cores)."""
    parts = module.split(".")
    if parts[:2] != ["ec_connectors", "transports"] or len(parts) < 4:
        return None
    return parts[2] if (TRANSPORTS / parts[2]).is_dir() else None


def _foreign_bases(sources: dict[str, str] | None = None) -> list[str]:
    """Classes under transports/ whose base class comes from another transport package (the
    core's excepted). `sources`: module name -> source text (default: the tree's modules)."""
    if sources is None:
        sources = {m: p.read_text() for m, p in MODULES.items()}
    bad = []
    for module, source in sources.items():
        own = _transport_package(module)
        if not module.startswith("ec_connectors.transports."):
            continue
        tree = ast.parse(source)
        origin = {a.asname or a.name: node.module for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module for a in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else None
                pkg = _transport_package(origin.get(name, "")) if name else None
                if pkg is not None and pkg != own and pkg not in CORE_PACKAGES:
                    bad.append(f"{module}.{node.name}({name}, from {pkg})")
    return bad


def test_no_transport_subclasses_another_transport_packages_class():
    bad = _foreign_bases()
    assert not bad, "transports extending another transport's classes:\n" + "\n".join(bad)


def test_the_foreign_base_check_sees_one():
    """The check itself: a class extending another transport package's class is reported;
    one extending the core's base class is not."""
    source = ("from ec_connectors.transports.mooncake_te.transport import MooncakeTransport\n"
              "from ec_connectors.transports.peer_pull.transport import PeerPullTransport\n"
              "class Borrowed(MooncakeTransport):\n    pass\n"
              "class Own(PeerPullTransport):\n    pass\n")
    assert _foreign_bases({"ec_connectors.transports.nixl_pull.transport": source}) == [
        "ec_connectors.transports.nixl_pull.transport.Borrowed(MooncakeTransport, "
        "from mooncake_te)"]


def test_the_core_imports_no_data_path_package():
    """Imports flow one way: data path packages import the peer-pull core, never the reverse."""
    bad = [f"{m} -> {i}" for m, p in MODULES.items() if _transport_package(m) in CORE_PACKAGES
           for i in _imports(p) if _transport_package(i) not in (None, *CORE_PACKAGES)]
    assert not bad, "the core importing a data path:\n" + "\n".join(bad)


def test_nixl_messages_and_catalog_live_in_the_nixl_package():
    outside = [f"{m}.{node.name}" for m, p in MODULES.items()
               if m.startswith("ec_connectors.") and _transport_package(m) != "nixl_pull"
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ClassDef) and node.name.startswith("Nixl")]
    assert not outside, f"NIXL classes outside ec_connectors/transports/nixl_pull/: {outside}"
