"""Which cores each thread of a process tree may run on, read from /proc."""

from __future__ import annotations

from pathlib import Path

import psutil

from backends.launch import cpu_pinning


def thread_affinities(pid: int) -> dict[str, frozenset[int]]:
    """``"pid process/tid thread" -> allowed cores`` for every thread of ``pid`` and its
    descendants."""
    found: dict[str, frozenset[int]] = {}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        tasks = Path(f"/proc/{proc.pid}/task")
        try:
            tids = [entry.name for entry in tasks.iterdir()]
            process = f"{proc.pid} {proc.name()}"
        except (OSError, psutil.Error):
            continue  # the process ended meanwhile
        for tid in tids:
            try:
                status = (tasks / tid / "status").read_text()
                name = (tasks / tid / "comm").read_text().strip()
            except OSError:
                continue
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
            found[f"{process}/{tid} {name}"] = cpu_pinning.parse_cores(line.split()[1])
    return found
