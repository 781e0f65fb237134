"""The request log: one JSON line per request, to a rotating file and/or stdout.

Lines are gathered for at most ``FLUSH_S`` and handed, a batch of dicts at a time, to a
``logging.handlers.QueueListener`` thread that encodes and writes them, so the request path
never waits for the disk or the JSON encoder, and the writer wakes (and writes) once per
batch, not once per request; the last ``keep`` lines also stay in memory for
``GET /admin/logs`` at once.
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import queue
import sys
from collections import deque
from pathlib import Path
from typing import Any, Final

import msgspec
import orjson

from foundation.config_types import NonNegInt, PosInt

log = logging.getLogger("semcache.request_log")

FLUSH_S: Final = 0.05
"""A line waits at most this long for the writer thread."""
FLUSH_LINES: Final = 1024
"""A batch this long goes to the writer at once."""


class RequestLogSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[request_log]`` section of the gateway config."""

    enabled: bool = True
    file: str | None = "logs/requests.jsonl"
    """Relative to the data dir; ``""`` or none: no file."""
    stdout: bool = False
    max_bytes: PosInt = 64 * 1024 * 1024
    """A file this large is rotated."""
    backups: NonNegInt = 5
    """Rotated files kept (``requests.jsonl.1`` …)."""
    keep: NonNegInt = 10_000
    """Lines kept in memory for ``GET /admin/logs``."""
    max_body_bytes: NonNegInt = 65_536
    """Of each body a ``log_bodies`` rule keeps (the line says when it was truncated)."""
    tenant_metrics: bool = False
    """Label ``semcache_requests`` with the tenant too (unbounded if tenants are)."""


class RequestLog:
    def __init__(self, settings: RequestLogSettings, data_dir: Path) -> None:
        self.settings = settings
        self.recent: deque[dict[str, Any]] = deque(maxlen=settings.keep)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        handlers: list[logging.Handler] = []
        self.path: Path | None = None
        if settings.file:
            self.path = (data_dir / settings.file).expanduser()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handlers.append(
                _LogFile(self.path, maxBytes=settings.max_bytes, backupCount=settings.backups)
            )
        if settings.stdout:
            handlers.append(logging.StreamHandler(sys.stdout))
        for handler in handlers:
            handler.setFormatter(logging.Formatter("%(message)s"))
        self._listener = _LineWriter(self._queue, *handlers)
        self._writes = bool(handlers)
        self._started = False
        self._pending: list[dict[str, Any]] = []
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self._writes and not self._started:
            self._listener.start()
            self._started = True

    def write(self, line: dict[str, Any]) -> None:
        self.recent.append(line)
        if not self._started:
            return
        self._pending.append(line)
        if len(self._pending) >= FLUSH_LINES:
            self._flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop: nothing would flush later
                self._flush()
                return
            self._timer = loop.call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            batch, self._pending = self._pending, []
            self._queue.put(batch)

    def stop(self) -> None:
        """Writes every queued line, then stops the writer thread."""
        if self._started:
            self._flush()
            self._listener.stop()
            self._started = False

    def query(
        self,
        *,
        tenant: str | None = None,
        status: int | None = None,
        model: str | None = None,
        since: float | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """The newest lines first, filtered."""
        out: list[dict[str, Any]] = []
        for line in reversed(self.recent):
            if since is not None and line["time"] < since:
                break
            if tenant is not None and line["tenant"] != tenant:
                continue
            if status is not None and line["status"] != status:
                continue
            if model is not None and line["model"] != model:
                continue
            out.append(line)
            if len(out) >= limit:
                break
        return out


class _LineWriter(logging.handlers.QueueListener):
    """Writes queued batches of lines (dicts) as JSON, one line each, in its own thread."""

    def prepare(self, record: Any) -> logging.LogRecord:
        text = b"\n".join(map(orjson.dumps, record)).decode()
        return logging.makeLogRecord({"msg": text, "levelno": logging.INFO})


class _LogFile(logging.handlers.RotatingFileHandler):
    """The log file; a failed write (a full disk) is reported once, not with a traceback
    per line."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            log.warning(
                "cannot write the request log %s (%s); lines are lost until it can",
                self.baseFilename,
                sys.exc_info()[1],
            )
