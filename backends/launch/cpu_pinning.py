"""A launched vLLM server runs on the cores its config names (``launch.cpu_cores``), all of it.

Two things put a CPU server elsewhere, and no vLLM setting changes either:

- ``VLLM_CPU_OMP_THREADS_BIND`` binds only the model's OpenMP threads; the API server, the engine
  core and their threads run on any core. So the launcher starts the server with its CPU
  affinity already set to the cores (``pin_hook``, run between fork and exec): every process
  and thread it starts inherits it.
- vLLM's NixlConnector (checked against vLLM 0.32: ``NixlBaseConnectorWorker.__init__``)
  moves the thread that builds it, the worker's main thread, which also runs the model, to
  "the last core of each NUMA node" (``CpuPlatform.discover_numa_topology``, read from ``/sys``
  and blind to the process's affinity), to keep KV loads off the model's cores. With one node
  of cores 0-1, the prefill and the decode server of a pair both ran their model on core 1. A
  launched P/D server therefore starts with a shim (``install_from_env``, from
  ``backends/launch/shim``) that makes that topology list only the cores the calling thread may
  already run on: the move stays within the server's cores (on one core it changes nothing).

``tests/backends/launch/test_cpu_pinning.py`` fails when vLLM stops calling the code patched here.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterable, Sequence

from backends.launch.import_patch import patch_when_imported

ENV = "SEMCACHE_NIXL_CORES_WITHIN_AFFINITY"
PLATFORM_MODULE = "vllm.platforms.cpu"
VLLM_WORDS = ("auto", "nobind")
"""``VLLM_CPU_OMP_THREADS_BIND`` values that name no cores: the server is not pinned."""


def parse_cores(spec: str) -> frozenset[int]:
    """The cores of a ``VLLM_CPU_OMP_THREADS_BIND`` list: ``"0"``, ``"0-3,6"``; several
    ranks' lists joined by ``|`` give their union."""
    cores: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a list of CPU cores: {spec!r}")
        cores.update(range(int(first), int(last if dash else first) + 1))
    return frozenset(cores)


def pin_hook(cores: Iterable[int]) -> Callable[[], None]:
    """A ``preexec_fn`` that sets the child's CPU affinity to ``cores``."""
    chosen = frozenset(cores)

    def hook() -> None:
        os.sched_setaffinity(0, chosen)

    return hook


def within(groups: Sequence[Sequence[int]], allowed: Iterable[int]) -> list[list[int]]:
    """Each group's cores that are in ``allowed``; groups left empty are dropped."""
    keep = set(allowed)
    kept = [[core for core in group if core in keep] for group in groups]
    return [group for group in kept if group]


def patch(module: types.ModuleType) -> None:
    """Make ``module.CpuPlatform.discover_numa_topology`` keep to the caller's affinity."""
    platform = module.CpuPlatform
    real = platform.discover_numa_topology
    if getattr(real, "semcache_within_affinity", False):
        return

    def discover_numa_topology(cls: type) -> list[list[int]]:
        return within(real(), os.sched_getaffinity(0))

    discover_numa_topology.semcache_within_affinity = True  # type: ignore[attr-defined]
    platform.discover_numa_topology = classmethod(discover_numa_topology)


def install_from_env() -> None:
    """Called at interpreter start in a launched vLLM server; a no-op unless ``ENV`` is set."""
    if os.environ.get(ENV) != "1":
        return
    patch_when_imported([PLATFORM_MODULE], patch)
