"""The launch shim that gives a launched server's single-rank gloo groups one device.

These fail loudly when torch changes the code the shim relies on (see
backends/launch/gloo_device.py).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.config import ServerRole, VllmLaunch, VllmServer
from backends.launch import gloo_device
from backends.launch.command import build_command

MODEL = Path("/models/m")

# vLLM's shape on a one-process CPU server: a default group and 12 more, all single-rank.
PROBE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], world_size=1, rank=0)
groups = [None] + [dist.new_group([0], backend="gloo") for _ in range(12)]
for group in groups:
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    dist.barrier(group=group)
    objects = [None]
    dist.all_gather_object(objects, {"rank": 0}, group=group)
    assert t.tolist() == [1.0, 1.0, 1.0] and objects == [{"rank": 0}]
tasks = f"/proc/{os.getpid()}/task"
names = [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)]
print(names.count("gloo_tcp_loop"))
dist.destroy_process_group()
"""


def gloo_loops(env: dict[str, str], store: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, f"file://{store}"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_the_installed_torch_is_a_checked_version() -> None:
    version = importlib.metadata.version("torch")
    assert ".".join(version.split(".")[:2]) in gloo_device.CHECKED_VERSIONS, (
        f"torch {version}: re-check backends/launch/gloo_device.py "
        "against _new_process_group_helper"
    )


def test_torch_still_builds_gloo_groups_from_the_module_name_with_a_timeout() -> None:
    c10d = pytest.importorskip(gloo_device.C10D_MODULE)
    source = inspect.getsource(c10d._new_process_group_helper)
    assert "backend_class = ProcessGroupGloo(" in source
    assert "timeout=timeout" in source.split("backend_class = ProcessGroupGloo(", 1)[1][:300]


def test_a_launched_server_shares_one_gloo_loop_and_its_collectives_still_work(
    tmp_path: Path,
) -> None:
    server = VllmServer(url="http://127.0.0.1:8000", role="both", launch=VllmLaunch())
    _, env = build_command(model=MODEL, served_model="m", server=server, device="cpu", python="p")
    assert gloo_loops({}, tmp_path / "plain") == 13  # torch's own: one device per group
    assert gloo_loops(env, tmp_path / "shimmed") == 1


@pytest.mark.parametrize(("role", "enabled"), [("both", True), ("decode", True), ("both", False)])
def test_launched_servers_get_the_setting(role: ServerRole, enabled: bool) -> None:
    launch = VllmLaunch(gloo_shared_device=enabled)
    server = VllmServer(url="http://127.0.0.1:8000", role=role, launch=launch)
    _, env = build_command(model=MODEL, served_model="m", server=server, device="cpu", python="p")
    assert (env.get(gloo_device.ENV) == "1") is enabled
    shim = Path(env["PYTHONPATH"].split(os.pathsep)[0])  # every CPU server: the AMX shim
    assert (shim / "sitecustomize.py").is_file()


def test_a_group_of_several_ranks_keeps_torchs_own_construction() -> None:
    calls: list[tuple[Any, ...]] = []

    class Real:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append((args, orjson.dumps(kwargs, default=str)))

    module = types.ModuleType("c10d")
    module.ProcessGroupGloo = Real  # type: ignore[attr-defined]
    gloo_device.patch(module)
    gloo_device.patch(module)  # idempotent: one subclass
    assert module.ProcessGroupGloo.__mro__[1] is Real  # type: ignore[attr-defined]
    module.ProcessGroupGloo("store", 1, 2, timeout=5)  # type: ignore[attr-defined]
    assert calls == [(("store", 1, 2), b'{"timeout":5}')]
