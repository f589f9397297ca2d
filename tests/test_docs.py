"""The docs hold up against the tree: every repository path README.md and docs/*.md name
exists (backticked paths and relative links, a link's `#anchor` among its target's headings),
and their prose speaks of the project, not of how it was developed (rounds of work, issue
numbers, which machine was available to whom)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {".git", ".venv", ".work", "__pycache__", "node_modules"}


@cache
def _tree() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(every file and directory path relative to the root, every file and directory name,
    every directory name) of the repository, build and work directories left out."""
    paths, names, dirs = set(), set(), set()
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts) or any(part.endswith(".egg-info") for part in rel.parts):
            continue
        paths.add(rel.as_posix())
        names.add(p.name)
        if p.is_dir():
            dirs.add(p.name)
    return frozenset(paths), frozenset(names), frozenset(dirs)


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks (commands, not claims)."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_PLACEHOLDER = re.compile(r"[*?<>{}$\[\]|]|\.\.\.")
_REPO_FILE = re.compile(r"\.(py|md|toml|yml|yaml)$")


def _candidate(span: str) -> str | None:
    """The repository path a backticked span names, or None when it names none: a path holds
    a "/" or ends in .py/.md/.toml/.yml; commands (spaces), URLs, absolute, home and hidden
    paths (the work dir; `.toml` alone), globs and placeholders (`tests/.../x.py`, `<name>`,
    `$DIR`) and another project's paths (its first part is nothing of this tree) are not."""
    span = span.strip().removeprefix("./")
    if (" " in span or "://" in span or span.startswith(("/", "~", ".", "-"))
            or _PLACEHOLDER.search(span) or ":" in span or "=" in span):
        return None
    if "/" not in span and not _REPO_FILE.search(span):
        return None
    first = span.split("/")[0]
    paths, names, dirs = _tree()
    if "/" in span and first not in names and first not in dirs:
        return None  # vLLM's, NIXL's, a URL path: not this repository's
    return span


def _exists(path: str, doc: Path) -> bool:
    """`path` is a file or directory of the tree: from the root, from the doc's directory,
    or as the tail of a longer path (`gateway/wire.py` in a table of encoder_service/'s
    modules); a bare file name anywhere."""
    path = path.rstrip("/")
    paths, names, _ = _tree()
    if "/" not in path:
        return path in names
    if path in paths or (doc.parent / path).resolve().exists():
        return True
    if any(p.endswith("/" + path) for p in paths):
        return True
    module, dot, symbol = path.rpartition(".")  # `protocol/keys.item_key`: a module's name
    return (bool(dot) and "/" not in symbol and not _REPO_FILE.search(path)
            and _exists(module + ".py", doc))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def _anchors(doc: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(doc.read_text()):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(out)


def _broken(doc: Path) -> list[str]:
    bad = []
    rel = doc.relative_to(ROOT)
    for n, line in _prose(doc.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if path and (not dest.exists() or not dest.is_relative_to(ROOT)):
                bad.append(f"{rel}:{n}: link to {target}: no {path} in the tree from "
                           f"{rel.parent}/")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{rel}:{n}: link to {target}: no heading #{anchor} in "
                           f"{dest.relative_to(ROOT)}")
        for span in _SPAN.findall(_LINK.sub("", line)):
            path = _candidate(span)
            if path is not None and not _exists(path, doc):
                bad.append(f"{rel}:{n}: `{span}` names no file or directory of the tree")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc):
    bad = _broken(doc)
    assert not bad, "paths and links that lead nowhere:\n" + "\n".join(bad)


def test_the_path_check_sees_what_it_should_and_no_more(tmp_path):
    assert _candidate("scheduler_hooks/items.py") == "scheduler_hooks/items.py"
    assert not _exists("scheduler_hooks/items.py", ROOT / "README.md")
    assert _exists("gateway/wire.py", ROOT / "docs" / "benchmarks.md")  # a module's tail
    assert _exists("ec_connectors/transports/nixl_pull/", ROOT / "README.md")
    for not_a_path in ("vllm/distributed/ec_transfer/", "epd up --config up.toml",
                       "/dev/shm", "tests/.../test_x.py", "benchmarks/<group>/<name>.py",
                       "$EPD_WORK_DIR/bench/", "https://example.com/a.py",
                       "ec_connectors.server_guard.ServerGuard", ".work/models/tiny"):
        assert _candidate(not_a_path) is None, not_a_path
    doc = tmp_path / "x.md"
    doc.write_text("# A heading: its (own) `words`\n[ok](#a-heading-its-own-words) [no](#nope)"
                   "\n```\n`not/checked.py`\n```\n")
    assert _anchors(doc) == {"a-heading-its-own-words"}


# How the project was developed is not the project's to tell: no rounds of work or sessions,
# no issue numbers, no talk of which machine was available (the hardware a figure was measured
# on is the project's: "no GPU" stays). Process sessions (`setsid`, a server's session),
# transfer-engine sessions and pytest's session scope are the project's own words.
_PROCESS_WORDS = re.compile(
    r"\bissues?\s*#?\d+|\bissue\s*\[|\bthe issue\b|\bthis issue\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh"
    r"|twelfth|\d+(?:st|nd|rd|th)|this|that|the next|the last|an earlier|a later|earlier"
    r"|previous|other|another)\s+sessions?\b"
    r"|\bsessions'|\blent\b|\bwas available to\b|\bthis round\b|\brounds? of work\b"
    r"|\bwave\b|\bengineers?\b|\bhelpers?'s? (?:unit )?tests\b", re.IGNORECASE)


def _process_words(text: str) -> list[tuple[int, str]]:
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1)
            for m in _PROCESS_WORDS.finditer(line)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_speak_of_the_project_not_of_its_development(doc):
    found = _process_words(doc.read_text())
    assert not found, "\n".join(f"{doc.relative_to(ROOT)}:{n}: {w!r}" for n, w in found)


def test_the_wording_rule_tells_the_two_senses_apart():
    for bad in ("measured in the eleventh session", "issue 40 asks", "the issue's targets",
                "no GPU was lent to this task", "this session's machine", "this round",
                "after the one-owner wave", "other engineers' runs", "a helper's unit tests"):
        assert _process_words(bad), bad
    for good in ("stopped with its process session", "every process session", "setsid",
                 "a session-scoped fixture", "the transfer engine session it names",
                 "a server's own session", "no GPU: measured on CPU", "its wavelength"):
        assert not _process_words(good), good


BENCHMARKS_MAX_LINES = 600  # current figures per claim, not a history of runs (git keeps those)
_DATED = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")  # a hash, not a number
# figures recorded row by row, each with its date and commit, from several benchmarks
_NO_SINGLE_COMMAND = {"## Figures behind the code's choices"}


def test_the_benchmarks_page_is_current_figures_each_dated_with_its_command():
    """docs/benchmarks.md stays a page of current tables: short, and every table's section
    names the date and commit it was measured at, and the command behind it."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= BENCHMARKS_MAX_LINES
    for section in re.split(r"\n(?=##+ )", text):
        if not re.search(r"^\|---", section, re.M):
            continue
        title = section.splitlines()[0]
        assert _DATED.search(section) and _COMMIT.search(section), \
            f"{title}: a table without the date and commit it was measured at"
        if title not in _NO_SINGLE_COMMAND:
            assert "```" in section, f"{title}: a table without the command behind it"
