"""CPU time of benchmarked processes, from /proc (Linux): what a noisy shared box reproduces
where wall-clock figures do not."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # stat(5) fields 14 and 15, counted after "pid (comm)"


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def tree(root: int) -> list[int]:
    """``root`` and every descendant still alive."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children(pid)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def find(root: int, prefix: str) -> int | None:
    """The first process under ``root`` whose command line starts with ``prefix`` (Ray names
    an actor's process ``ray::ClassName``)."""
    return next((p for p in tree(root) if cmdline(p).startswith(prefix)), None)
