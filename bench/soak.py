"""Soak: the embedded default (`semcache serve`) under mixed traffic for N minutes.

Starts `semcache serve` with the shipped default config (SmolLM2 on a prefill and a decode
vLLM server, MiniLM embeddings, the sentiment classifier), on other ports and a data dir of
its own, then sends a fixed rate of mixed requests, on loopback only: chat hits (a small set
of prompts asked again and again), chat misses (new prompts), streams, embeddings,
classification, Workers-AI batches (``queueRequest``, polled to the end) and purges. Every
10 s it samples the gateway process's RSS and open file descriptors. At the end it prints:
requests by kind, server errors (5xx), transport errors, latency p50/p99 per minute (the
p99 drift), RSS growth after the first minute, the fd count's range, and the semantic index
size against the entries stored.

    .venv/bin/python bench/soak.py [--minutes 10] [--rate 4] [--port 8280]

Targets: 0 server errors; RSS growth <= 5 % after the first minute; fds flat (<= +10).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.support import GATEWAY_ENV, REPO, gateway_ready, pct_ms, stderr_printer, stop_gateway
from harness.gateway import GatewayProcess
from harness.metrics import parse_metric
from server.config import DEFAULT_CONFIG

say = stderr_printer("soak")

CHAT = "SmolLM2-135M-Instruct"
ADMIN = "soak-admin"
HOT_PROMPTS = 12
"""Prompts asked again and again: exact-cache hits after their first answer."""
MIX = (
    ("hit", 30),
    ("miss", 15),
    ("stream", 15),
    ("embeddings", 20),
    ("classify", 12),
    ("batch", 5),
    ("purge", 3),
)
"""Kinds of request and their weights."""


def config_text(port: int, base_port: int, data_dir: Path) -> str:
    """The shipped default config on other ports, with its own data dir and an admin token
    (purges are part of the mix)."""
    text = DEFAULT_CONFIG.read_text()
    text = text.replace("port = 8080", f"port = {port}")
    for old, new in (("8100", base_port), ("8101", base_port + 1)):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    for old, new in (("5600", base_port + 2), ("5601", base_port + 3)):
        text = text.replace(f"nixl_side_channel_port = {old}", f"nixl_side_channel_port = {new}")
    for events in range(5610, 5614):  # the servers' KV events and replay sockets
        text = text.replace(f"127.0.0.1:{events}", f"127.0.0.1:{base_port + events - 5606}")
    text = text.replace('data_dir = ".data"', f'data_dir = "{data_dir}"')
    return text + f'\n[auth.admin]\ntoken = "{ADMIN}"\n'


def policy_text() -> str:
    """The shipped default policy."""
    return (REPO / "policies" / "default.toml").read_text()


@dataclass
class Tally:
    started: float = field(default_factory=time.monotonic)
    kinds: Counter[str] = field(default_factory=Counter)
    server_errors: Counter[str] = field(default_factory=Counter)
    other_status: Counter[str] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    latencies: list[tuple[float, str, float]] = field(default_factory=list)
    """(seconds since start, kind, latency in seconds)."""
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds since start, RSS bytes, open fds) of the gateway process."""

    def record(self, kind: str, status: int, latency_s: float) -> None:
        self.kinds[kind] += 1
        if status >= 500:
            self.server_errors[f"{kind} {status}"] += 1
        elif status >= 400:
            self.other_status[f"{kind} {status}"] += 1
        self.latencies.append((time.monotonic() - self.started, kind, latency_s))


class Traffic:
    """One request of a kind from the mix, against the gateway at ``url``."""

    def __init__(self, client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
        self.client, self.tally, self.rng = client, tally, rng
        self.hot = [f"Name a colour, please ({i})." for i in range(HOT_PROMPTS)]

    def _chat(self, content: str, **extra: object) -> dict[str, object]:
        return {
            "model": CHAT,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 16,
            "temperature": 0,
            **extra,
        }

    async def one(self, kind: str) -> None:
        t0 = time.monotonic()
        try:
            status = await getattr(self, kind)()
        except httpx.HTTPError as exc:
            self.tally.transport_errors[f"{kind} {type(exc).__name__}"] += 1
            return
        self.tally.record(kind, status, time.monotonic() - t0)

    async def hit(self) -> int:
        body = self._chat(self.rng.choice(self.hot))
        return (await self.client.post("/v1/chat/completions", json=body)).status_code

    async def miss(self) -> int:
        body = self._chat(f"Say something about {uuid.uuid4().hex[:8]}.")
        return (await self.client.post("/v1/chat/completions", json=body)).status_code

    async def stream(self) -> int:
        body = self._chat(f"Count to five ({uuid.uuid4().hex[:6]}).", stream=True)
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.status_code

    async def embeddings(self) -> int:
        words = [f"item {self.rng.randrange(400)}" for _ in range(self.rng.randint(1, 4))]
        body = {"model": "all-MiniLM-L6-v2", "input": words}
        return (await self.client.post("/v1/embeddings", json=body)).status_code

    async def classify(self) -> int:
        text = self.rng.choice(["great film", "awful service", "it was fine", "loved it"])
        body = {"model": "sentiment-minilm", "input": [f"{text} {self.rng.randrange(300)}"]}
        return (await self.client.post("/v1/classify", json=body)).status_code

    async def batch(self) -> int:
        run = f"/client/v4/accounts/soak/ai/run/{CHAT}"
        auth = {"authorization": "Bearer soak"}
        requests = [
            {"prompt": f"batch {uuid.uuid4().hex[:6]} {i}", "max_tokens": 8} for i in range(3)
        ]
        r = await self.client.post(
            f"{run}?queueRequest=true", json={"requests": requests}, headers=auth
        )
        if r.status_code != 200:
            return r.status_code
        request_id = r.json()["result"]["request_id"]
        for _ in range(600):  # bounded: 5 min at most
            await asyncio.sleep(0.5)
            poll = await self.client.post(run, json={"request_id": request_id}, headers=auth)
            if poll.status_code != 200:
                return poll.status_code
            if poll.json()["result"].get("status") not in ("queued", "running"):
                return 200
        return 504

    async def purge(self) -> int:
        body = {"kind": "key", "target": uuid.uuid4().hex[:12]}  # a purge that hits nothing
        if self.rng.random() < 0.3:  # now and then a real one: a hot prompt is refilled
            r = await self.client.post("/v1/chat/completions", json=self._chat(self.hot[0]))
            body["target"] = r.headers.get("x-semcache-key", body["target"])
        headers = {"authorization": f"Bearer {ADMIN}"}
        return (
            await self.client.post("/admin/cache/purge", json=body, headers=headers)
        ).status_code


async def sample(proc: psutil.Process, tally: Tally, every_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            tally.samples.append(
                (time.monotonic() - tally.started, proc.memory_info().rss, proc.num_fds())
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def drive(url: str, pid: int, args: argparse.Namespace) -> tuple[Tally, str]:
    """The traffic, and the gateway's /metrics page at the end."""
    tally = Tally()
    rng = random.Random(args.seed)
    kinds, weights = zip(*MIX, strict=True)
    stop = asyncio.Event()
    # Idle connections are dropped before uvicorn's 5 s keep-alive closes them: reusing one
    # as the server closes it is a client-side race (an httpx ReadError), not a lost answer.
    limits = httpx.Limits(max_connections=64, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        traffic = Traffic(client, tally, rng)
        sampler = asyncio.create_task(sample(psutil.Process(pid), tally, args.sample_s, stop))
        tasks: set[asyncio.Task[None]] = set()
        interval = 1.0 / args.rate
        end = tally.started + args.minutes * 60
        next_at = time.monotonic()
        sent = 0
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            task = asyncio.create_task(traffic.one(kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
            if sent % (args.rate * 60) == 0:
                say(f"{sent} requests sent, {len(tasks)} in flight")
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await asyncio.gather(*tasks, return_exceptions=True)
        metrics = (await client.get("/metrics")).text
        stop.set()
        await sampler
    return tally, metrics


def report(tally: Tally, metrics: str, args: argparse.Namespace, records: int | None) -> bool:
    total = sum(tally.kinds.values())
    errors = sum(tally.server_errors.values())
    transport = sum(tally.transport_errors.values())
    print(f"\nsoak: {args.minutes:g} min at {args.rate} req/s, {total} requests")
    print("  by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.kinds.items()) if v))
    print(f"  server errors (5xx): {errors} {dict(tally.server_errors) or ''}")
    print(f"  transport errors: {transport} {dict(tally.transport_errors) or ''}")
    print(f"  other 4xx: {dict(tally.other_status) or 0}")
    minutes = int(args.minutes) or 1
    print("  latency by minute, all kinds but batch (p50 / p99 ms):")
    p99s = []
    for m in range(minutes):
        window = [
            lat
            for t, kind, lat in tally.latencies
            if m * 60 <= t < (m + 1) * 60 and kind != "batch"
        ]
        if window:
            p99s.append(pct_ms(window, 99))
            print(
                f"    minute {m + 1}: {pct_ms(window, 50):7.1f} / {p99s[-1]:7.1f}"
                f"  (n={len(window)})"
            )
    drift = p99s[-1] / p99s[0] if len(p99s) > 1 and p99s[0] > 0 else float("nan")
    print(f"  p99 drift, last minute / first: {drift:.2f}x")
    after = [(t, rss, fds) for t, rss, fds in tally.samples if t >= 60]
    base = after[0] if after else (tally.samples[0] if tally.samples else None)
    growth = float("nan")
    if base is not None and tally.samples:
        last = tally.samples[-1]
        growth = (last[1] - base[1]) / base[1]
        fds = [s[2] for s in tally.samples]
        print(
            f"  RSS: {tally.samples[0][1] / 2**20:.0f} MiB at start, {base[1] / 2**20:.0f} MiB "
            f"after the first minute, {last[1] / 2**20:.0f} MiB at the end: "
            f"growth {growth:+.1%} after the first minute"
        )
        print(f"  open fds: min {min(fds)}, max {max(fds)}, first {fds[0]}, last {fds[-1]}")
        fds_flat = max(fds) - (after[0][2] if after else fds[0]) <= 10
    else:
        fds_flat = False
    stored = parse_metric(metrics, "semcache_exact_stores_total")
    failures = parse_metric(metrics, "semcache_semantic_record_write_failures_total")
    print(
        f"  exact entries stored: {stored:.0f}; semantic records on disk: {records}; "
        f"semantic record write failures: {failures:.0f}"
    )
    return errors == 0 and transport == 0 and growth <= 0.05 and fds_flat


def records_on_disk(data_dir: Path) -> int | None:
    import diskcache

    folder = data_dir / "cache" / "semantic" / "records"
    if not folder.is_dir():
        return None
    with diskcache.Cache(str(folder)) as cache:
        return sum(1 for k in cache.iterkeys() if isinstance(k, str) and k.startswith("r/"))


async def run(args: argparse.Namespace) -> bool:
    folder = Path(tempfile.mkdtemp(prefix="semcache-soak-"))
    data_dir = folder / "data"
    # the prepared model is reused from the checkout's .data (the encoder graphs from the
    # folder GatewayProcess gives every gateway)
    data_dir.mkdir()
    if (REPO / ".data" / "models").exists():
        (data_dir / "models").symlink_to(REPO / ".data" / "models")
    config = folder / "config.toml"
    config.write_text(config_text(args.port, args.base_port, data_dir))
    policy = folder / "policy.toml"
    policy.write_text(policy_text())
    log = folder / "serve.log"
    server = GatewayProcess(
        config, args.port, GATEWAY_ENV, launch=True, args=["--policy", str(policy)], log=log
    )
    try:
        say(f"starting semcache serve (log {log})")
        await gateway_ready(server, args.ready_timeout_s)
        gateway = psutil.Process(server.pid)
        say(f"ready; {args.minutes:g} min of traffic at {args.rate} req/s")
        tally, metrics = await drive(server.url, gateway.pid, args)
    finally:
        await stop_gateway(server, 60)
    return report(tally, metrics, args, records_on_disk(data_dir))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=4, help="requests started per second")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8280)
    parser.add_argument("--base-port", type=int, default=8290)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    met = asyncio.run(run(args))
    print("targets met" if met else "targets not met")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
