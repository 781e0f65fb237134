"""The prefill and decode servers: the tiny Llama on p1, d1 and the spare d2, the KV moving
from prefill to decode through NIXL over UCX.

With ``kv_transport="tcp"`` (the default) UCX may use TCP on ``eth0`` only (``UCX_TLS=tcp``),
so the KV crosses the veth pair and the bridge like it would cross a network; ``"shm"``
leaves UCX free to pick shared memory (the hosts still share one kernel), the baseline the
bench compares with. UCX logs the protocols it picked (``UCX_PROTO_INFO``) in the vLLM logs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from backends.config import ServerRole, VllmServer
from backends.launch.command import build_command, detect_device
from harness.cluster.processes import Service
from harness.cluster.topology import NIXL_PORT, VLLM_PORT, KvTransport, address
from harness.vllm_process import TINY_MODEL_NAME, single_process_launch


def vllm_url(host: str) -> str:
    return f"http://{address(host)}:{VLLM_PORT}"


def kv_env(host: str, transport: KvTransport) -> dict[str, str]:
    """What points NIXL's side channel at the host's address and UCX at its transport."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": address(host),
        "UCX_PROTO_INFO": "y",  # UCX logs the protocol (and transport) each operation uses
    }
    if transport == "tcp":
        env.update(UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
    return env


def vllm_service(
    host: str, role: ServerRole, core: str, model: Path, transport: KvTransport
) -> Service:
    """The tiny Llama's server on ``host`` in ``role``, pinned to ``core``."""
    server = VllmServer(
        url=vllm_url(host),
        role=role,
        launch=single_process_launch(
            cpu_cores=core,
            kv_cache_gib=0.25,
            max_model_len=1024,
            nixl_side_channel_port=NIXL_PORT,
            env=kv_env(host, transport),
        ),
    )
    command, env = build_command(
        model=model,
        served_model=TINY_MODEL_NAME,
        server=server,
        device=detect_device(),
        python=sys.executable,
    )
    return Service(host, command, env, f"{vllm_url(host)}/health", VLLM_PORT)
