"""Process groups of launched servers: finding their living members, stopping them, and a
child's death with the gateway (Linux ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable

import psutil


@functools.cache
def die_with_parent_hook(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child ``sig`` if the gateway dies without stopping it.

    libc is looked up here, in the parent: the hook itself only makes one call after fork.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, death_signal = 1, int(sig)

    def hook() -> None:
        prctl(pr_set_pdeathsig, death_signal)

    return hook


def living(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (zombies aside)."""
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def process_group_members(pgid: int) -> list[psutil.Process]:
    """Living (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
    return living(members)


async def stop_process_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM a process group another process started, wait up to ``grace_s``, then SIGKILL
    what is left (``backends.launch.scale`` stops the servers an earlier command started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not process_group_members(pgid):
                return
            await asyncio.sleep(0.2)
