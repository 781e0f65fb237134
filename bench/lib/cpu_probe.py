"""The setting of the CPU probes (``diagnostics/gateway_cpu.py``, ``upstream_arrivals.py``):
the fake vLLM, in a process of its own, and the real gateway in front of it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

from bench.lib.support import GATEWAY_ENV, gateway_ready, gateway_toml, stop_gateway
from harness.fake_vllm import FakeVllm
from harness.gateway import GatewayProcess
from harness.ports import free_port

SERVED = "fake-llama"
TOKENS = 16
PACE_S = 0.001
"""The fake's gap between two tokens (``--burst``: none)."""


def fake_vllm(
    pace_s: float = PACE_S, on_chat: Callable[[bytes], None] | None = None, port: int | None = None
) -> FakeVllm:
    """The fake vLLM: ``TOKENS`` words ``pace_s`` apart, finished by length, as a real one
    asked for ``TOKENS`` tokens with ``ignore_eos``; ``on_chat`` sees each request body as
    soon as it is read."""
    return FakeVllm(
        SERVED,
        text=" word" * TOKENS,
        usage=(40, TOKENS),
        finish_reason="length",
        pace_s=pace_s,
        on_chat=on_chat,
        port=port,
    )


@contextlib.asynccontextmanager
async def gateway_before(fake_url: str, *, cache: bool = True) -> AsyncIterator[GatewayProcess]:
    """The real gateway (its own process, a throw-away data dir) in front of ``fake_url``."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="semcache-gwbench-") as tmp_name:
        tmp = Path(tmp_name)
        config = tmp / "gateway.toml"
        config.write_text(
            gateway_toml(
                data_dir=tmp, port=port, vllm_url=fake_url, served=SERVED, model=None, cache=cache
            )
        )
        gateway = GatewayProcess(config, port, GATEWAY_ENV, log=tmp / "gateway.log")
        try:
            await gateway_ready(gateway)
            yield gateway
        finally:
            await stop_gateway(gateway)


@contextlib.contextmanager
def fake_process(
    module: str, cores: set[int] | None = None, extra: Sequence[str] = ()
) -> Iterator[str]:
    """``python -m module --serve-fake PORT [extra]`` in a child process (on ``cores``) while
    the block runs; yields its URL once it accepts connections."""
    port = free_port()
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    command = [sys.executable, "-m", module, "--serve-fake", str(port), *extra]
    fake = subprocess.Popen(command, preexec_fn=pin)
    try:
        deadline = time.monotonic() + 30.0
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if fake.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the fake vLLM of {module} did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        fake.terminate()
        fake.wait()
