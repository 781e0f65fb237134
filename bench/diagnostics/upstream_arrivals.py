"""When a wave of concurrent requests reaches vLLM: sent straight to it, or through the gateway.

A fake vLLM (``harness.fake_vllm`` in its own process, pinned to core 1 when there is one) notes
the moment each chat request arrives; the gateway (``python -m server.cli serve --no-launch``)
and this load client share the other core, as in ``overhead.py``. Waves of ``--concurrency``
requests alternate between the fake itself and the gateway in front of it. For each target it
prints, over the waves: the median request's arrival after the wave was sent, and the spread
from the first arrival to the last. The gateway's extra delay is what it costs before a
request leaves; a spread near zero through the gateway means its requests leave together,
only once all of them have been handled.

    .venv/bin/python -m bench.diagnostics.upstream_arrivals [--waves 100] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from bench.lib.cpu_probe import SERVED, TOKENS, fake_process, gateway_before
from bench.lib.overhead.chat import chat_body
from bench.lib.support import GATEWAY_MODEL_ID
from harness.fake_vllm import FakeVllm

UID = re.compile(rb'"content":"(\d{7})\.')


class ArrivalsVllm(FakeVllm):
    """The fake vLLM answering at once; ``GET /arrivals`` hands over (and forgets) when each
    request arrived."""

    def __init__(self, port: int) -> None:
        super().__init__(
            SERVED, text=" word" * TOKENS, finish_reason="length", on_chat=self.note, port=port
        )
        self.arrivals: dict[str, float] = {}

    def note(self, raw: bytes) -> None:
        at = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
        found = UID.search(raw)
        if found:
            self.arrivals[found.group(1).decode()] = at

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/arrivals":
            return await super().handle(request)
        out, self.arrivals = self.arrivals, {}
        return web.Response(body=orjson.dumps(out), content_type="application/json")


async def measure(args: argparse.Namespace, fake_url: str) -> None:
    async with gateway_before(fake_url) as gateway, aiohttp.ClientSession() as client:
        await run_waves(client, fake_url, gateway.url, args.waves, args.concurrency)


async def run_waves(
    client: aiohttp.ClientSession, fake: str, gateway: str, waves: int, concurrency: int
) -> None:
    uids = iter(range(10**7))
    targets = {"direct": (fake, SERVED), "gateway": (gateway, GATEWAY_MODEL_ID)}

    async def one(base: str, model: str, stream: bool) -> int:
        uid = next(uids)
        body = chat_body(model, uid, TOKENS, stream)
        headers = {"content-type": "application/json"}
        async with client.post(f"{base}/v1/chat/completions", data=body, headers=headers) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{base} answered {r.status}")
        return uid

    print(f"arrival at the upstream of a wave of {concurrency} requests ({waves} waves, medians)")
    for stream in (False, True):
        medians: dict[str, list[float]] = {name: [] for name in targets}
        spreads: dict[str, list[float]] = {name: [] for name in targets}
        for wave in range(-3, waves):  # three warm-up waves
            order = list(targets) if wave % 2 == 0 else list(targets)[::-1]
            for name in order:
                base, model = targets[name]
                sent = time.monotonic()
                uids_sent = await asyncio.gather(
                    *(one(base, model, stream) for _ in range(concurrency))
                )
                async with client.get(f"{fake}/arrivals") as r:
                    noted = orjson.loads(await r.read())
                at = sorted(noted[f"{u:07d}"] - sent for u in uids_sent)
                if wave >= 0:
                    medians[name].append(float(np.median(at)))
                    spreads[name].append(at[-1] - at[0])
        label = "stream" if stream else "non-stream"
        for name in targets:
            print(
                f"  {label:10s} {name:8s} median arrival {1e3 * np.median(medians[name]):5.2f} ms"
                f"   first to last {1e3 * np.median(spreads[name]):5.2f} ms"
                f"   (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--waves", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.serve_fake:
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[-1]})
        ArrivalsVllm(args.serve_fake).serve_forever()
        return 0
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[:-1]))  # the gateway (started below) inherits it
    with fake_process(__spec__.name, set(cores)) as fake_url:
        asyncio.run(measure(args, fake_url))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
