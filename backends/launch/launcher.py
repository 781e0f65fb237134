"""Every launched vLLM server of a config: prepare the models, start all, wait for all, stop all."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from backends.config import VllmBackendConfig
from backends.launch.command import Device
from backends.launch.process import Progress, VllmProcess
from backends.models import prepare_model


class Launcher:
    """Starts every launchable server of some vLLM backends, waits for all, stops all on exit.

    ``async with Launcher(backends, data_dir) as launcher:`` returns once every server answers
    ``/health``; leaving the block (normally, on error or on cancel) stops them all.
    """

    def __init__(
        self,
        backends: Sequence[VllmBackendConfig],
        data_dir: Path,
        *,
        progress: Progress = print,
        device: Device | None = None,
        python: str | None = None,
        ready_timeout_s: float = 900.0,
        traces_endpoint: str | None = None,
    ) -> None:
        """``traces_endpoint``: the servers export their spans there (the gateway traces)."""
        self.backends = list(backends)
        self.traces_endpoint = traces_endpoint
        self.data_dir = data_dir
        self.progress = progress
        self.device = device
        self.python = python or sys.executable
        self.ready_timeout_s = ready_timeout_s
        self.processes: list[VllmProcess] = []
        self.model_paths: dict[str, Path] = {}
        """Backend name → the local model folder its servers run (after ``start``)."""

    async def start(self) -> None:
        """Prepare the models, start the servers and wait until all are healthy."""
        try:
            for backend in self.backends:
                if not any(server.launch is not None for server in backend.servers):
                    continue
                if backend.model_path is None:
                    raise ValueError(
                        f"backend {backend.name!r} launches vLLM but has no model_path"
                    )
                model = await asyncio.to_thread(
                    prepare_model, backend.model_path, self.data_dir, self.progress
                )
                self.model_paths[backend.name] = model
                for server in backend.servers:
                    if server.launch is None:
                        continue
                    process = VllmProcess(
                        model=model,
                        served_model=backend.served_model,
                        server=server,
                        data_dir=self.data_dir,
                        device=self.device,
                        python=self.python,
                        log_name=backend.name,
                        kv_lease_s=backend.kv_lease_s,
                        traces_endpoint=self.traces_endpoint,
                    )
                    self.progress(f"starting vLLM {backend.name} ({server.role}) at {server.url}")
                    process.start()
                    self.processes.append(process)
            await self._wait_all()
        except BaseException:
            await self.stop()
            raise
        if self.processes:
            self.progress(f"vLLM ready: {', '.join(p.url for p in self.processes)}")

    async def _wait_all(self) -> None:
        waits = [
            asyncio.create_task(p.wait_ready(self.ready_timeout_s, self.progress))
            for p in self.processes
        ]
        if not waits:
            return
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def stop(self) -> None:
        """Stop every started server (in parallel); safe to call twice."""
        for process in self.processes:
            process.terminate()  # all at once, before any waiting
        results = await asyncio.gather(
            *(process.stop() for process in self.processes), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def __aenter__(self) -> Launcher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
