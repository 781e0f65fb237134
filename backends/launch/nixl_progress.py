"""An idle NIXL progress thread that sleeps: a launch shim for the vLLM servers of a P/D pair.

nixl's Python agent (``nixl_agent.__init__``) starts its progress thread with
``pthrDelay = 0``: between two progress calls the thread only yields, so an idle prefill or
decode server keeps a core busy. vLLM's NixlConnector passes ``num_threads`` and the backends
to nixl, never this delay, and nixl's Python API offers no setting for it. So the servers the
gateway launches import this module at start (``backends/launch/shim/sitecustomize.py``, put on
their ``PYTHONPATH`` by ``backends.launch.command``), and it makes the agent's config take
``SEMCACHE_NIXL_PROGRESS_DELAY_US`` instead of 0. nixl's UCX progress thread polls its
workers' event fds with that delay as the timeout (``nixlUcxSharedThread::run``): it still
wakes as soon as UCX signals work, and otherwise sleeps that long; the timeout is nixl's guard
against a missed wake-up. Transfers themselves are unchanged (UCX moves the bytes).

Checked against nixl 1.5.1 (``nixl_cu12._api`` / ``nixl_cu13._api``): the agent builds a
``nixlBind.nixlAgentConfig()``, then sets ``pthrDelay = 0`` on it. ``patch`` swaps the
module's ``nixlBind`` for a view whose ``nixlAgentConfig`` is a subclass that turns that 0 into
the configured delay. ``tests/backends/launch/test_nixl_progress.py`` fails when this stops
applying.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

from backends.launch.import_patch import patch_when_imported

DELAY_ENV = "SEMCACHE_NIXL_PROGRESS_DELAY_US"
CHECKED_VERSIONS = ("1.5",)
"""nixl releases (major.minor) whose ``nixl_agent.__init__`` this was checked against."""
AGENT_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")
"""The backend modules that define ``nixl_agent`` (``nixl`` re-exports one of them)."""


def patch(module: types.ModuleType, delay_us: int) -> None:
    """Make ``module``'s agents start their progress thread with ``delay_us`` between calls."""
    real = module.nixlBind
    if isinstance(real, _BindView):
        real = real.real

    class AgentConfig(real.nixlAgentConfig):  # type: ignore[name-defined]
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay" and value == 0:
                value = delay_us
            super().__setattr__(name, value)

    module.nixlBind = _BindView(real, AgentConfig)  # type: ignore[attr-defined]


class _BindView(types.ModuleType):
    """nixl's binding module, but for its agent config class."""

    def __init__(self, real: types.ModuleType, config: type) -> None:
        super().__init__(real.__name__)
        self.real = real
        self.nixlAgentConfig = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def install_from_env() -> None:
    """Called at interpreter start in a launched vLLM server; a no-op unless the delay is set."""
    raw = os.environ.get(DELAY_ENV, "")
    if not raw.isdigit() or int(raw) == 0:
        return
    patch_when_imported(AGENT_MODULES, functools.partial(patch, delay_us=int(raw)))
