"""SIGTERM of `semcache serve`: what is in flight finishes, new work gets 503, exit status 0.

The gateway runs as a child process (`semcache serve --no-launch`) in front of a stand-in
vLLM that holds its answers until the test releases them (``harness.fake_vllm``): the requests
are provably in flight for as long as the drain is probed, on any machine.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from harness.fake_vllm import FakeVllm
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME
from tests.server.chaos.common import write_gateway_toml
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROBES = 20


def _chat(stream: bool) -> dict[str, Any]:
    text = "Tell a story."
    return {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 1.0,
        "stream": stream,
    }  # sampled: never cached


def _stream(url: str, out: dict[str, Any]) -> None:
    """One streamed answer, read to its end."""
    events: list[bytes] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_chat(True), timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:].encode())
    chunks = [orjson.loads(e) for e in events if e != b"[DONE]"]
    out["finished"] = (
        bool(events)
        and events[-1] == b"[DONE]"
        and any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    )


def _plain(url: str, out: dict[str, Any]) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(False), timeout=120)
    out["status"] = r.status_code
    out["finished"] = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_sigterm_drains_in_flight_refuses_new_work_and_exits_0(
    tmp_path: Path, data_dir: Path
) -> None:
    upstream = FakeVllm(
        TINY_MODEL_NAME, text="held answer", usage=(3, 2), finish_reason="length", hold=True
    ).start()
    config = write_gateway_toml(
        tmp_path / "gateway.toml", tmp_path, data_dir / "models", upstream.url
    )
    gw = GatewayProcess(config).start()
    assert gw.proc is not None
    results: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=_plain, args=(gw.url, results[0]))]
    threads += [threading.Thread(target=_stream, args=(gw.url, results[i])) for i in (1, 2)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: upstream.held == 3, 60)  # all three in flight, held upstream
        signalled = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)

        # While draining: new requests are refused in their route's format, 503 + Retry-After.
        # (A probe names no model: one that slipped in before the drain began is a quick 404,
        # never a request held upstream.)
        probe = {**_chat(False), "model": "no-such-model"}

        def refused() -> bool:
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=probe, timeout=30)
            return r.status_code == 503

        wait_until(refused, 10, interval_s=0.05)
        for _ in range(PROBES):
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=_chat(False), timeout=30)
            assert r.status_code == 503, r.text  # a real request: refused, not held
            assert r.headers["retry-after"] == "2"
            assert r.headers["connection"] == "close"
            assert r.json()["error"]["code"] == "shutting_down"
        cf = httpx.post(
            f"{gw.url}/client/v4/accounts/a/ai/run/tiny-chat",
            json={"prompt": "x"},
            headers={"authorization": "Bearer t"},
        )
        assert cf.status_code == 503 and cf.json()["success"] is False
        assert httpx.get(f"{gw.url}/ready").status_code == 503
        assert httpx.get(f"{gw.url}/health").status_code == 200
        assert all(t.is_alive() for t in threads) and upstream.held == 3
        assert gw.proc.poll() is None  # still draining: nothing in flight was dropped

        upstream.release()
        for t in threads:
            t.join(60)
        code = gw.proc.wait(60)
        stopped_s = time.monotonic() - signalled
    finally:
        gw.kill()
        upstream.stop()
    assert code == 0, "".join(gw.lines[-30:])
    assert results == [{"status": 200, "finished": True}] * 3  # every in-flight answer whole
    with pytest.raises(httpx.ConnectError):  # once stopped, the socket is closed
        httpx.get(f"{gw.url}/health")
    out = "".join(gw.lines)
    draining = re.search(r"SIGTERM: draining, (\d+) request\(s\) in flight", out)
    assert draining is not None and int(draining.group(1)) == 3, out[-3000:]
    print(
        f"\nFIGURE sigterm: 3 of 3 in-flight requests (2 streams) finished, "
        f"{PROBES + 2} of {PROBES + 2} new requests refused 503 + Retry-After, "
        f"exit 0 {stopped_s:.1f} s after the signal (answers held upstream until released)"
    )
