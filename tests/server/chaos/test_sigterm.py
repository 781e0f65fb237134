"""SIGTERM of `semcache serve`: what is in flight finishes, new work gets 503, exit status 0."""

from __future__ import annotations

import re
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.launch import VllmProcess
from server.harness import GatewayProcess
from tests.server.chaos.common import write_gateway_toml
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# sampled (never cached), 4 choices of 1800 tokens: seconds of work, even for the tiny model
LONG = {"max_tokens": 1800, "n": 4, "temperature": 1.0, "ignore_eos": True}


def _long_chat(stream: bool) -> dict[str, Any]:
    text = f"Tell a long story {uuid.uuid4().hex}."
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        **LONG,
        "stream": stream,
    }


def _stream(url: str, started: threading.Event, out: dict[str, Any]) -> None:
    """One streamed answer, read to its end: its events, and whether it ended with [DONE]."""
    events: list[bytes] = []
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=_long_chat(True), timeout=120
    ) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:].encode())
                started.set()
    out["done"] = bool(events) and events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    out["finished"] = {
        choice["index"] for c in chunks for choice in c["choices"] if choice["finish_reason"]
    } == {0, 1, 2, 3}
    out["error"] = any("error" in c for c in chunks)


def _plain(url: str, out: dict[str, Any]) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json=_long_chat(False), timeout=120)
    out["status"] = r.status_code
    out["finished"] = (
        r.status_code == 200 and [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 4
    )


def test_sigterm_drains_in_flight_refuses_new_work_and_exits_0(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess
) -> None:
    config = write_gateway_toml(
        tmp_path / "gateway.toml", tmp_path, data_dir / "models", tiny_vllm.url
    )
    gw = GatewayProcess(config).start()
    assert gw.proc is not None
    results: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=_plain, args=(gw.url, results[0]))]
    streams_started = [threading.Event(), threading.Event()]
    threads += [
        threading.Thread(target=_stream, args=(gw.url, streams_started[i], results[1 + i]))
        for i in range(2)
    ]
    try:
        threads[0].start()
        time.sleep(0.2)  # the plain request is sent first
        for t in threads[1:]:
            t.start()

        # The plain request went first: once both streams have begun, it is in flight too.
        wait_until(lambda: all(e.is_set() for e in streams_started), 60)
        assert all(t.is_alive() for t in threads)
        sent = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)

        # While draining: new requests are refused in their route's format, 503 + Retry-After
        quick = {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        }

        def refused() -> bool:
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=quick, timeout=30)
            return r.status_code == 503

        wait_until(refused, 10, interval_s=0.05)
        cf = httpx.post(f"{gw.url}/client/v4/accounts/a/ai/run/tiny-chat", json={"prompt": "x"})
        assert cf.status_code == 503 and cf.json()["success"] is False
        assert httpx.get(f"{gw.url}/ready").status_code == 503
        assert httpx.get(f"{gw.url}/health").status_code == 200
        refusals = 2  # the first chat refused, and the Workers-AI one
        for _ in range(20):  # more, until the drain is over (then: connection refused)
            try:
                r = httpx.post(f"{gw.url}/v1/chat/completions", json=quick, timeout=30)
            except httpx.ConnectError:
                wait_until(lambda: any("drained; stopping" in line for line in gw.lines), 5)
                break
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "2"
            assert r.headers["connection"] == "close"
            assert r.json()["error"]["code"] == "shutting_down"
            refusals += 1

        for t in threads:
            t.join(120)
        code = gw.proc.wait(60)
        drained_s = time.monotonic() - sent
    finally:
        gw.kill()
    assert code == 0, "".join(gw.lines[-30:])
    assert [r["status"] for r in results] == [200, 200, 200]
    assert all(r["finished"] for r in results), results  # every in-flight answer complete
    assert all(r["done"] and not r["error"] for r in results[1:])
    with pytest.raises(httpx.ConnectError):  # once stopped, the socket is closed
        httpx.get(f"{gw.url}/health")
    out = "".join(gw.lines)
    draining = re.search(r"SIGTERM: draining, (\d+) request\(s\) in flight", out)
    assert draining is not None and int(draining.group(1)) >= 3, out[-3000:]
    print(
        f"\nFIGURE sigterm: 3 of 3 in-flight requests (2 streams) finished, "
        f"{refusals} of {refusals} new requests refused 503 + Retry-After, "
        f"exit 0 after {drained_s:.1f} s"
    )
