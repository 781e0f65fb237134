"""Fair share under overload: the gateway's fair queue on vs off, side by side in one run.

Claims checked (issue 37), against a real vLLM (the tiny test model, pinned to its own core)
behind two real gateways (``python -m server.cli serve --no-launch``), one with ``[queue]``
on, one with it off (one first-come-first-served line per pool), both with two slots on the
server (``max_inflight_per_server = 2``):

- noisy neighbour: tenant A keeps ten requests in flight (ten times its fair share, one of
  the two slots), retrying 0.1 s after each 429; tenant B sends a stream every ``--gap``
  seconds. B's TTFT p50 and p99 within 1.3x of B alone; A's 429s counted, and no 5xx.
- priority: a Workers-AI batch (``queueRequest``) run by greedy workers (16 at once, no
  yielding to live traffic, no preemption: the queue's bands alone) keeps the pool's queue
  full of batch items; live streams' TTFT p50 within 1.2x of idle.
- idle cost: ``wrk`` on one cache hit, and on one miss at a time (``Cache-Control:
  no-cache``, one token) with the queue empty, queue on vs off, the two gateways
  alternating; the miss may add at most 0.2 ms. Beside it, the admission path alone in this
  process (a ticket, acquire, release on an empty pool), which the wrk figure's noise hides.

    .venv/bin/python bench/fair_share.py [--phase-s 8] [--gap 0.3] [--wrk-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.config import VllmServer
from backends.fleet.pool import Pool
from backends.fleet.server_state import ServerState
from bench.lib.support import pct, toml_value
from bench.lib.wrk import run_wrk
from foundation.request import QueueTicket
from harness.gateway import GatewayProcess
from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir
from server.envelope.queue_tickets import QueueSettings, Tickets

MODEL = "@cf/test/tiny"
TOKENS = {"a": "tok-a", "b": "tok-b"}
CHAT = "/v1/chat/completions"
NOISY_TARGET, PRIORITY_TARGET, IDLE_TARGET_MS = 1.3, 1.2, 0.2
MODES = {
    "queue on": "[queue]\nmax_queued_per_tenant = 4\nmax_wait_s = 10\n",
    "fair order only": "[queue]\nmax_queued_per_tenant = 4\nmax_wait_s = 10\nshare_window_s = 0\n",
    "queue off": "[queue]\nenabled = false\n",
}
"""``queue on``: bands, fair order and each active flow held to its share of the slots (the
default ``share_window_s``); ``fair order only``: no share cap, a free slot goes to the
first in fair order; ``queue off``: one first-come-first-served line."""


def write_config(work: Path, data_dir: Path, vllm_url: str, queue: str) -> Path:
    tokens = [{"token": t, "tenant": n} for n, t in TOKENS.items()]
    lines = [
        f"data_dir = {toml_value(str(work))}",
        "[[models]]",
        'id = "tiny-chat"',
        'backend = "tiny"',
        f"aliases = {toml_value([MODEL])}",
        "[[backends]]",
        'kind = "vllm"',
        'name = "tiny"',
        f"served_model = {toml_value(TINY_MODEL_NAME)}",
        f"model_path = {toml_value(str(data_dir / 'models' / TINY_MODEL_NAME))}",
        "max_inflight_per_server = 2",
        "max_queue = 64",
        "[[backends.servers]]",
        f"url = {toml_value(vllm_url)}",
        "[auth]",
        f"tokens = {toml_value(tokens)}",
        "[batch]",
        "yield_to_sync = false",
        "preempt = false",
        "max_inflight = 16",
        "per_server_limit = 16",
    ]
    path = work / "gateway.toml"
    path.write_text("\n".join(lines) + "\n" + queue)
    return path


def start_gateway(
    tmp: Path, name: str, data_dir: Path, vllm_url: str, queue: str
) -> GatewayProcess:
    """A gateway of this mode in a new folder, on core 0 (beside this process and wrk)."""
    work = Path(tempfile.mkdtemp(prefix=name.replace(" ", "-"), dir=tmp))
    return GatewayProcess(write_config(work, data_dir, vllm_url, queue), cores="0").start()


def headers(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[tenant]}", "cf-aig-skip-cache": "true"}


async def ttft(client: httpx.AsyncClient, base: str, tenant: str, max_tokens: int) -> float:
    """Seconds to the first streamed text of one chat stream (never cached)."""
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} question"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", base + CHAT, headers=headers(tenant), json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():  # to the end: the slot is held until then
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("stream without text")
    return first


async def trickle(client: httpx.AsyncClient, base: str, seconds: float, gap: float) -> list[float]:
    """Tenant B: one stream every ``gap`` seconds for ``seconds``."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(await ttft(client, base, "b", 8))
        await asyncio.sleep(gap)
    return out


async def flood(
    client: httpx.AsyncClient, base: str, stop: asyncio.Event, seen: Counter[int]
) -> None:
    """One of tenant A's ten closed-loop senders."""
    while not stop.is_set():
        body = {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} flood"}],
            "max_tokens": 16,
        }
        r = await client.post(base + CHAT, headers=headers("a"), json=body)
        seen[r.status_code] += 1
        if r.status_code == 429:
            await asyncio.sleep(0.1)


async def noisy(
    client: httpx.AsyncClient, base: str, args: argparse.Namespace
) -> tuple[list[float], Counter[int]]:
    stop, seen = asyncio.Event(), Counter[int]()
    senders = [asyncio.create_task(flood(client, base, stop, seen)) for _ in range(10)]
    await asyncio.sleep(1.0)  # the flood is on before B measures
    b = await trickle(client, base, args.phase_s, args.gap)
    stop.set()
    await asyncio.gather(*senders)
    return b, seen


async def live_during_batch(
    client: httpx.AsyncClient, base: str, args: argparse.Namespace
) -> list[float]:
    run = f"{base}/client/v4/accounts/bench/ai/run/{MODEL}"
    items = [{"prompt": f"{uuid.uuid4().hex} item {i}", "max_tokens": 32} for i in range(200)]
    r = await client.post(
        run + "?queueRequest=true", json={"requests": items}, headers=headers("a")
    )
    r.raise_for_status()
    await asyncio.sleep(1.0)  # the workers fill the pool's queue
    live = []
    end = time.monotonic() + args.phase_s
    while time.monotonic() < end:
        live.append(await ttft(client, base, "b", 8))
        await asyncio.sleep(args.gap)
    return live


def wrk(url: str, body: str, extra: dict[str, str], seconds: int, conns: int, lua: Path) -> float:
    lines = ['wrk.method = "POST"', f"wrk.body = [==[{body}]==]"]
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKENS['b']}", **extra}
    lines += [f'wrk.headers["{k}"] = "{v}"' for k, v in hdrs.items()]
    lua.write_text("\n".join(lines) + "\n")
    done = run_wrk(url + CHAT, lua, connections=conns, seconds=seconds, core="0", timeout=None)
    if done.report.non_2xx or done.report.socket_errors:
        raise RuntimeError(f"wrk saw errors:\n{done.output}")
    return done.report.p50_ms


async def admission_cost_us(n: int) -> dict[str, float]:
    """Microseconds of a ticket, acquire and release on an empty pool, queue on vs off."""
    tickets = Tickets(QueueSettings())
    out: dict[str, float] = {}
    for name, on in (("queue on", True), ("queue off", False)):
        server = ServerState(VllmServer(url="http://127.0.0.1:9"), limit=64)
        pool = Pool(
            "b",
            "both",
            [server],
            max_queue=64,
            queue_timeout_s=5.0,
            retry_after_s=1,
            unavailable_retry_after_s=5,
        )
        start = time.perf_counter()
        for _ in range(n):
            ticket: QueueTicket | None = tickets.ticket("b") if on else None
            lease = await pool.admission.acquire(pool.healthy, ticket)
            lease.release()
        out[name] = (time.perf_counter() - start) / n * 1e6
    return out


def ms(values: list[float], p: float) -> float:
    return pct(values, p) * 1000.0


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--gap", type=float, default=0.3)
    parser.add_argument("--wrk-s", type=int, default=5)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        parser.error("wrk is missing: scripts/wrk.sh install")
    data_dir = test_data_dir()
    print("starting the tiny vLLM on core 1 ...", file=sys.stderr)
    vllm = await start_tiny_vllm(data_dir, free_port(), cpu_cores="1", progress=None)
    results: dict[str, dict[str, Any]] = {m: {} for m in MODES}
    with tempfile.TemporaryDirectory(prefix="semcache-bench-fair-") as tmp:
        gateways = {}
        os.sched_setaffinity(0, {0})  # this process, wrk and the gateways; vLLM keeps core 1
        try:
            for name, queue in MODES.items():
                gateways[name] = start_gateway(Path(tmp), name, data_dir, vllm.url, queue)
            async with httpx.AsyncClient(timeout=120) as client:
                for gw in gateways.values():
                    await trickle(client, gw.url, 2.0, 0.1)  # warm up
                for name, gw in gateways.items():
                    print(f"{name}: B alone ...", file=sys.stderr)
                    results[name]["alone"] = await trickle(client, gw.url, args.phase_s, args.gap)
                for name, gw in gateways.items():
                    print(f"{name}: noisy neighbour ...", file=sys.stderr)
                    b, seen = await noisy(client, gw.url, args)
                    results[name]["noisy"], results[name]["a_statuses"] = b, seen
                for name, gw in gateways.items():
                    print(f"{name}: idle, then a batch backlog ...", file=sys.stderr)
                    results[name]["idle"] = await trickle(client, gw.url, args.phase_s, args.gap)
                    results[name]["backlog"] = await live_during_batch(client, gw.url, args)
            # the backlogs are killed with the gateways: restart them for the idle cost
            for gw in gateways.values():
                gw.kill()
            for name, queue in MODES.items():  # a fresh data dir: no backlog left
                gateways[name] = start_gateway(Path(tmp), name, data_dir, vllm.url, queue)
            hit = (
                '{"model":"tiny-chat","messages":[{"role":"user","content":"hit"}],'
                '"max_tokens":4,"temperature":0}'
            )
            miss = (
                '{"model":"tiny-chat","messages":[{"role":"user","content":"miss"}],"max_tokens":1}'
            )
            lua = Path(tmp) / "req.lua"
            async with httpx.AsyncClient(timeout=60) as client:
                for gw in gateways.values():
                    primed = await client.post(
                        gw.url + CHAT,
                        content=hit,
                        headers={
                            "content-type": "application/json",
                            "authorization": f"Bearer {TOKENS['b']}",
                        },
                    )
                    primed.raise_for_status()
            for name in gateways:
                results[name]["hit"], results[name]["miss"] = [], []
            for _ in range(2):  # alternate, so drift hits both alike
                for name, gw in gateways.items():
                    results[name]["hit"].append(wrk(gw.url, hit, {}, args.wrk_s, 8, lua))
                    results[name]["miss"].append(
                        wrk(gw.url, miss, {"Cache-Control": "no-cache"}, args.wrk_s, 1, lua)
                    )
        finally:
            for gw in gateways.values():
                gw.kill()
            await vllm.stop()
    path_us = await admission_cost_us(200_000)

    on, off = results["queue on"], results["queue off"]
    verdicts = []
    print(
        f"\ntiny model on vLLM (core 1), two gateways (core 0), 2 slots; phases of "
        f"{args.phase_s:g} s, B every {args.gap:g} s; TTFT in ms"
    )
    print(
        f"{'':<16} {'B alone p50':>11} {'p99':>7} {'noisy p50':>10} {'p99':>7} "
        f"{'x p50':>6} {'x p99':>6} {'A 200':>6} {'A 429':>6} {'A 5xx':>6}"
    )
    for name, r in results.items():
        alone, loud, seen = r["alone"], r["noisy"], r["a_statuses"]
        x50 = ms(loud, 50) / ms(alone, 50)
        x99 = ms(loud, 99) / ms(alone, 99)
        fivexx = sum(v for k, v in seen.items() if k >= 500)
        print(
            f"{name:<16} {ms(alone, 50):>11.1f} {ms(alone, 99):>7.1f} "
            f"{ms(loud, 50):>10.1f} {ms(loud, 99):>7.1f} {x50:>6.2f} {x99:>6.2f} "
            f"{seen[200]:>6} {seen[429]:>6} {fivexx:>6}"
        )
        if name == "queue on":
            verdicts.append(
                (
                    "noisy neighbour: B within 1.3x of alone (p50, p99), A no 5xx",
                    x50 <= NOISY_TARGET and x99 <= NOISY_TARGET and fivexx == 0,
                )
            )
    print(
        f"\n{'':<16} {'live idle p50':>13} {'backlog p50':>11} {'x':>6} {'idle p99':>9} "
        f"{'backlog p99':>11}"
    )
    for name, r in results.items():
        idle, backlog = r["idle"], r["backlog"]
        x = ms(backlog, 50) / ms(idle, 50)
        print(
            f"{name:<16} {ms(idle, 50):>13.1f} {ms(backlog, 50):>11.1f} {x:>6.2f} "
            f"{ms(idle, 99):>9.1f} {ms(backlog, 99):>11.1f}"
        )
        if name == "queue on":
            verdicts.append(("priority: live TTFT p50 within 1.2x of idle", x <= PRIORITY_TARGET))
    hit_on, hit_off = statistics.median(on["hit"]), statistics.median(off["hit"])
    miss_on, miss_off = statistics.median(on["miss"]), statistics.median(off["miss"])
    print(
        f"\nwrk p50 (median of 2 runs of {args.wrk_s} s each): hit on {hit_on:.3f} ms, off "
        f"{hit_off:.3f} ms (x{hit_on / hit_off:.2f}); miss on {miss_on:.3f} ms, off "
        f"{miss_off:.3f} ms (added {miss_on - miss_off:+.3f} ms)"
    )
    print(
        f"admission path alone: queue on {path_us['queue on']:.2f} us, off "
        f"{path_us['queue off']:.2f} us per request"
    )
    verdicts.append(
        ("idle cost: a miss adds at most 0.2 ms (wrk p50)", miss_on - miss_off <= IDLE_TARGET_MS)
    )
    print()
    for claim, ok in verdicts:
        print(f"claim: {claim}: {'PASS' if ok else 'FAIL'}")
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
