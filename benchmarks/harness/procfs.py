"""Process trees and per-thread CPU ticks read from /proc (Linux): what a deployment's
processes spend, idle or under load, down to the hottest thread."""

from __future__ import annotations

import os
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> tuple[str, list[str]]:
    """(comm, the fields after it) of a /proc stat file."""
    text = path.read_text()
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def children_map() -> dict[int, list[int]]:
    """{parent pid: its children's pids} of every process now."""
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out.setdefault(int(_stat(d / "stat")[1][1]), []).append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def tree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    """`pid` and all its descendants in `kids` (children_map)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def thread_ticks(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """{(pid, tid): (thread name, utime + stime ticks)} of every thread of `pids`."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                name, f = _stat(Path(f"/proc/{pid}/task/{tid}/stat"))
                out[(pid, int(tid))] = (name, int(f[11]) + int(f[12]))
            except (OSError, ValueError, IndexError):
                continue
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds so far of every thread of `pid`'s process tree."""
    return sum(ticks for _, ticks in thread_ticks(tree(pid, children_map())).values()) / HZ
