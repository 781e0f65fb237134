"""Launched vLLM servers stay on their configured cores (``backends/launch/cpu_pinning.py``).

The fast tests fail when vLLM stops calling the code the shim patches. The default config's
prefill/decode pair, launched by the real ``semcache serve``, has every thread's affinity read
from /proc in ``tests/server/test_serve_cli.py``.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.config import VllmLaunch, VllmServer
from backends.launch import cpu_pinning
from backends.launch.command import build_command
from backends.launch.process import VllmProcess

MODEL = Path("/models/m")
TWO_CORES = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")


def test_parse_cores_reads_vllm_bind_lists() -> None:
    assert cpu_pinning.parse_cores("1") == {1}
    assert cpu_pinning.parse_cores("0-2,5") == {0, 1, 2, 5}
    assert cpu_pinning.parse_cores("0-1|3") == {0, 1, 3}
    for bad in ("", "auto", "1-", "a-2"):
        with pytest.raises(ValueError, match="not a list of CPU cores"):
            cpu_pinning.parse_cores(bad)


def test_within_keeps_only_allowed_cores_and_drops_empty_groups() -> None:
    assert cpu_pinning.within([[0, 1], [2, 3]], {1, 3}) == [[1], [3]]
    assert cpu_pinning.within([[0, 1], [2, 3]], {0}) == [[0]]
    assert cpu_pinning.within([[0, 1]], {5}) == []


def test_vllm_nixl_still_pins_its_thread_to_the_discovered_topology() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    source = inspect.getsource(NixlBaseConnectorWorker.__init__)
    assert "current_platform.discover_numa_topology()" in source, (
        "vLLM changed how NixlConnector picks its cores: re-check backends/launch/cpu_pinning.py"
    )
    assert "os.sched_setaffinity(0, rsv_cores_for_kv)" in source


@pytest.mark.parametrize(
    ("role", "cores", "device", "shimmed"),
    [
        ("prefill", "0", "cpu", True),
        ("decode", "1", "cpu", True),
        ("both", "0", "cpu", False),  # no NixlConnector
        ("decode", None, "cpu", False),
        ("decode", "1", "cuda", False),
    ],
)
def test_cpu_pd_servers_with_cores_get_the_shim(
    role: str, cores: str | None, device: str, shimmed: bool
) -> None:
    launch = VllmLaunch(cpu_cores=cores, nixl_progress_delay_us=0, gloo_shared_device=False)
    server = VllmServer(url="http://127.0.0.1:8000", role=role, launch=launch)  # type: ignore[arg-type]
    _, env = build_command(
        model=MODEL,
        served_model="m",
        server=server,
        device=device,  # type: ignore[arg-type]
        python="p",
    )
    assert (env.get(cpu_pinning.ENV) == "1") is shimmed
    assert ("PYTHONPATH" in env) is (device == "cpu")  # every CPU server: the AMX shim


@TWO_CORES
def test_the_shim_keeps_the_nixl_core_within_the_process_affinity() -> None:
    server = VllmServer(
        url="http://127.0.0.1:8000", role="prefill", launch=VllmLaunch(cpu_cores="0")
    )
    _, env = build_command(model=MODEL, served_model="m", server=server, device="cpu", python="p")
    code = (
        "from vllm.platforms.cpu import CpuPlatform\n"
        "print(sorted(c for g in CpuPlatform.discover_numa_topology() for c in g))"
    )
    runs = {}
    for shim in ("1", "0"):
        runs[shim] = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **env, cpu_pinning.ENV: shim},
            preexec_fn=cpu_pinning.pin_hook({0}),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout.split("\n")[-2]
    assert runs["1"] == "[0]"
    assert runs["0"] != "[0]"  # unpatched: vLLM reads /sys and offers a core outside {0}


@TWO_CORES
def test_a_process_started_pinned_runs_on_its_cores_only(tmp_path: Path) -> None:
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    for cores in ({0}, {1}, {0, 1}):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            preexec_fn=cpu_pinning.pin_hook(cores),
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == str(sorted(cores))


def test_vllm_own_binding_words_leave_the_server_unpinned(tmp_path: Path) -> None:
    for word in cpu_pinning.VLLM_WORDS:
        server = VllmServer(url="http://127.0.0.1:8000", launch=VllmLaunch(cpu_cores=word))
        process = VllmProcess(
            model=MODEL, served_model="m", server=server, data_dir=tmp_path, device="cpu"
        )
        assert process.cores is None
        assert process.extra_env["VLLM_CPU_OMP_THREADS_BIND"] == word


def test_a_core_the_machine_lacks_is_refused(tmp_path: Path) -> None:
    core = str(os.cpu_count() or 1)
    server = VllmServer(url="http://127.0.0.1:8000", launch=VllmLaunch(cpu_cores=core))
    with pytest.raises(ValueError, match=f"no CPU core \\[{core}\\]"):
        VllmProcess(model=MODEL, served_model="m", server=server, data_dir=tmp_path, device="cpu")


# -- the default config's pair, launched --------------------------------------------------------
