"""One gloo device for a launched vLLM server's single-rank groups: a launch shim.

vLLM builds a torch.distributed group pair (device and CPU) for each of its parallel
dimensions, with the gloo backend on a CPU, even when every dimension has one rank: 13
``ProcessGroupGloo`` objects in the worker of a one-process server. torch gives each its own
gloo TCP device, and each device runs a ``gloo_tcp_loop`` thread whose ``epoll_wait`` times
out every 10 ms (gloo's ``Loop::run``, not a setting of gloo, torch or vLLM): 1,300 wake-ups a
second in an idle server. A single-rank group has no peer to connect to, so its device never
carries a byte; this shim gives all of a process's single-rank groups one device, hence one
loop thread. Groups of more ranks (tensor parallelism over several processes) keep torch's
own device each.

The vLLM servers the gateway launches import this module at start (the
``backends/launch/shim/sitecustomize.py`` on their ``PYTHONPATH``) when
``SEMCACHE_GLOO_SHARED_DEVICE=1`` (``backends.launch.command``). Checked against torch 2.13
(``torch.distributed.distributed_c10d._new_process_group_helper`` constructs
``ProcessGroupGloo(store, rank, size, timeout=timeout)``). ``patch`` swaps that module's
``ProcessGroupGloo`` for a subclass that builds the same options with the shared device;
``tests/backends/launch/test_gloo_device.py`` fails when this stops applying.
"""

from __future__ import annotations

import os
import types
from typing import Any

from backends.launch.import_patch import patch_when_imported

ENV = "SEMCACHE_GLOO_SHARED_DEVICE"
CHECKED_VERSIONS = ("2.13",)
"""torch releases (major.minor) whose process-group helper this was checked against."""
C10D_MODULE = "torch.distributed.distributed_c10d"
THREADS_PER_DEVICE = 2
"""What torch's ``timeout`` constructor gives a group: two work threads per device."""


def patch(module: types.ModuleType) -> None:
    """Make ``module``'s single-rank gloo groups share one device (idempotent; a torch built
    without gloo is left alone)."""
    real: Any = getattr(module, "ProcessGroupGloo", None)
    if real is None or getattr(real, "semcache_shared_device", False):
        return
    devices: list[Any] = []

    class SharedDeviceGloo(real):
        semcache_shared_device = True

        def __init__(self, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> None:
            if size != 1 or args or not set(kwargs) <= {"timeout"}:
                super().__init__(store, rank, size, *args, **kwargs)
                return
            if not devices:
                devices.append(real.create_default_device())
            options = real._Options()
            if "timeout" in kwargs:
                options._timeout = kwargs["timeout"]
            options._devices = devices
            options._threads = THREADS_PER_DEVICE
            super().__init__(store, rank, size, options)

    SharedDeviceGloo.__name__ = SharedDeviceGloo.__qualname__ = real.__name__
    module.ProcessGroupGloo = SharedDeviceGloo  # type: ignore[attr-defined]


def install_from_env() -> None:
    """Called at interpreter start in a launched vLLM server; a no-op unless enabled."""
    if os.environ.get(ENV) != "1":
        return
    patch_when_imported([C10D_MODULE], patch)
