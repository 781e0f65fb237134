"""One chat request to a target (vLLM or the gateway), timed to its first content and its
end, over aiohttp or httpx."""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson

JSON_HEADERS = {"content-type": "application/json"}
PROMPT = (
    "Write a short story about a cat who finds a map near the old tree, follows the river "
    "to a small house, and reads a letter from a friend in Paris. Keep it simple."
)
FIRST_CONTENT = re.compile(rb'"content":"[^"]')
"""An SSE event whose delta carries text (vLLM's first, role-only event has ``""``)."""


@dataclass(frozen=True)
class Target:
    """One place the workload goes: vLLM itself, or the gateway in front of it."""

    name: str
    url: str
    model: str
    client: httpx.AsyncClient | aiohttp.ClientSession
    server_pid: int | None = None
    """The gateway's process, whose CPU time per request is measured (None for vLLM)."""
    server_idle_cpu: float = 0.0
    """CPU seconds per second the server burns with no traffic (background tasks)."""


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    total_s: float
    completion_tokens: int


class RequestFailed(Exception):
    """A request got no complete, well-formed answer."""


def chat_body(model: str, uid: int, max_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        # The number first, zero-padded: unique prompts of one length, no shared prefix.
        "messages": [{"role": "user", "content": f"{uid:07d}. {PROMPT}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def stream_usage(raw: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of the last SSE event carrying one."""
    for event in reversed(raw.split(b"\n\n")):
        payload = event.strip().removeprefix(b"data:").strip()
        if b'"usage"' not in payload:
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            usage = orjson.loads(payload).get("usage")
            if isinstance(usage, dict):
                return usage
    return None


async def one_request(target: Target, body: bytes, stream: bool) -> Sample:
    if isinstance(target.client, aiohttp.ClientSession):
        return await _one_request_aiohttp(target.client, target.url, body, stream)
    return await _one_request_httpx(target.client, target.url, body, stream)


class _StreamScan:
    """A streamed answer as it arrives: its bytes, and when the first content event came."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.raw = bytearray()
        self.ttft: float | None = None

    def feed(self, chunk: bytes) -> None:
        now = time.perf_counter()
        scan_from = max(0, len(self.raw) - 16)
        self.raw += chunk
        if self.ttft is None and FIRST_CONTENT.search(self.raw, scan_from):
            self.ttft = now - self.started

    def sample(self) -> Sample:
        raw = self.raw
        if not raw.rstrip().endswith(b"data: [DONE]"):
            raise RequestFailed(f"stream ended without [DONE]: ...{bytes(raw[-200:])!r}")
        usage = stream_usage(bytes(raw))
        if self.ttft is None or usage is None:
            raise RequestFailed("stream without content or without usage")
        total = time.perf_counter() - self.started
        return Sample(self.ttft, total, int(usage.get("completion_tokens", 0)))


def _json_sample(content: bytes, started: float) -> Sample:
    """A whole JSON answer: its time to the last byte counts as TTFT too."""
    total = time.perf_counter() - started
    usage = orjson.loads(content).get("usage") or {}
    return Sample(total, total, int(usage.get("completion_tokens", 0)))


async def _one_request_aiohttp(
    client: aiohttp.ClientSession, base: str, body: bytes, stream: bool
) -> Sample:
    started = time.perf_counter()
    async with client.post(f"{base}/v1/chat/completions", data=body, headers=JSON_HEADERS) as r:
        content = await r.read() if not stream or r.status != 200 else b""
        if r.status != 200:
            raise RequestFailed(f"HTTP {r.status}: {content[:200]!r}")
        if not stream:
            return _json_sample(content, started)
        scan = _StreamScan(started)
        async for chunk in r.content.iter_any():
            scan.feed(chunk)
    return scan.sample()


async def _one_request_httpx(
    client: httpx.AsyncClient, base: str, body: bytes, stream: bool
) -> Sample:
    url = f"{base}/v1/chat/completions"
    started = time.perf_counter()
    if not stream:
        response = await client.post(url, content=body, headers=JSON_HEADERS)
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {response.text[:200]}")
        return _json_sample(response.content, started)
    scan = _StreamScan(started)
    async with client.stream("POST", url, content=body, headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            await response.aread()
            raise RequestFailed(f"HTTP {response.status_code}: {response.text[:200]}")
        async for chunk in response.aiter_raw():
            scan.feed(chunk)
    return scan.sample()


def load_client(kind: str) -> httpx.AsyncClient | aiohttp.ClientSession:
    """The load client's HTTP client: aiohttp (light) or httpx (what the openai SDK uses)."""
    if kind == "httpx":
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=10.0))
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=600.0, sock_connect=10.0),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
