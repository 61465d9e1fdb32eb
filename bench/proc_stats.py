"""What Linux's /proc says about a process: alive or not, resident memory, CPU seconds.

Benchmarks read these to report a process's CPU share and memory growth without instrumenting
it. Each function answers for a process that is gone (False, 0, None) instead of raising.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["child_pids", "is_running", "rss_bytes", "process_cpu_seconds", "tree_cpu_seconds"]


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, in seconds (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """process_cpu_seconds of `pid` and, recursively, its live children (0 when gone)."""
    return (process_cpu_seconds(pid) or 0.0) + sum(tree_cpu_seconds(child)
                                                   for child in child_pids(pid))


def child_pids(pid: int) -> list[int]:
    """The pids of `pid`'s live children, over all its threads ([] when it is gone)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    children = []
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return children

