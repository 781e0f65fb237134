"""Lose one host at a time under a steady mixed load: what each fault costs.

The cluster of ``harness/cluster/`` with the replicated shared tier (``cache_cluster``: a
Redis Cluster of three primaries and three replicas on hosts c1-c3, the gateways waiting for
a replica before acknowledging a batch submit, an upload or a ledger flush). For each fault,
``harness.fleet_load.FleetLoad`` sends hits, misses, streams, Workers-AI batch submits, file
uploads and purges through HAProxy (a request refused for now is sent again after its
``Retry-After``, as a client would), the fault is injected after ``--steady`` seconds, the
load goes on for ``--after`` seconds, and then every batch is polled to its end and every
acknowledged file read back. The faults, one at a time, each undone before the next:

- ``cache-primary``: kill -9 of the Redis primary that holds the batch queue's slot (its
  replica on another host is promoted);
- ``gateway``: kill -9 of gw1 (HAProxy routes around it; its batch items go back to the
  queue when their lease ends);
- ``prefill``: kill -9 of the prefill server (decode computes prompts alone);
- ``decode``: a second decode server (d2) joins through the admin API, then kill -9 of d1
  (only its requests in flight may fail);
- ``partition``: gw1 cut off from every cache host (silent drops both ways), then healed;
- ``slow-link``: the links between gw1 and every cache host delayed 200 ms and losing 5 % of
  packets, both ways (``Cluster.impair``: what ``tc netem delay 200ms loss 5%`` on each end
  does, in user space, on a kernel without netem), then restored.

Per fault it prints: recovery (seconds from the fault to the end of the last request that
needed a retry or failed), the slowest request, requests, retried, failed in the end, batch
items lost, files lost, hits answered wrong. The target is 0 lost and 0 wrong everywhere.

    .venv/bin/python bench/failover.py [--steady 3] [--after 15] [--workers 3]
        [--faults cache-primary,gateway,prefill,decode,partition,slow-link]

Needs what the cluster needs (root, ``ip netns``, haproxy, redis-server); not while the
cluster tests run (they use the same hosts).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.support import exit_status, stderr_printer
from harness.cluster import (
    TOKEN,
    Cluster,
    missing_requirements,
)
from harness.fleet_load import Check, FleetLoad

say = stderr_printer("failover")
FAULTS = ("cache-primary", "gateway", "prefill", "decode", "partition", "slow-link")
QUEUE_KEY = "{semcache:batch}:items"


@dataclass
class Row:
    fault: str
    target: str
    recovery_s: float
    slowest_s: float
    requests: int
    retried: int
    failed: int
    check: Check


def inject(cluster: Cluster, fault: str) -> str:
    """Cause ``fault``; what was hit."""
    if fault == "cache-primary":
        victim = cluster.cache_primary(QUEUE_KEY)
        cluster.kill(victim)
        say(
            f"a replica took over from {victim} in {cluster.wait_failover(QUEUE_KEY, victim):.1f} s"
        )
        return victim
    if fault == "gateway":
        cluster.kill("gw1")
        return "gw1"
    if fault == "prefill":
        cluster.kill("p1")
        return "p1"
    if fault == "decode":
        cluster.kill("d1")
        return "d1"
    if fault == "slow-link":
        cluster.impair("gw1", cluster.cache_hosts, delay_ms=200.0, loss=0.05)
        return "gw1 to " + ",".join(cluster.cache_hosts)
    for host in cluster.cache_hosts:
        cluster.partition("gw1", host)
    return "gw1 from " + ",".join(cluster.cache_hosts)


def undo(cluster: Cluster, fault: str, target: str) -> None:
    if fault == "cache-primary":
        cluster.start(target)  # rejoins as a replica
        cluster.wait_cache_ok()
    elif fault in ("gateway", "prefill", "decode"):
        cluster.start(target)
        cluster.wait_lb(2)
    elif fault == "slow-link":
        cluster.repair("gw1", cluster.cache_hosts)
    else:
        for host in cluster.cache_hosts:
            cluster.heal("gw1", host)


async def run_fault(cluster: Cluster, fault: str, args: argparse.Namespace) -> Row:
    load = FleetLoad.through_lb(cluster, workers=args.workers)
    async with httpx.AsyncClient(timeout=120) as client:
        if fault == "decode":  # a second decode server, so that losing one is survivable
            await asyncio.to_thread(cluster.start, "d2")
            await pool_change(client, cluster, "post", json={"url": cluster.vllm_url("d2")})
        await load.prepare(client)
        stop = asyncio.Event()
        running = asyncio.create_task(load.run(stop))
        try:
            await asyncio.sleep(args.steady)
            at = time.monotonic()
            target = await asyncio.to_thread(inject, cluster, fault)
            say(f"{fault}: {target} hit")
            await asyncio.sleep(args.after)
        finally:
            stop.set()
            await running
        await asyncio.to_thread(undo, cluster, fault, target)
        found = await load.check(client)
        if fault == "decode":
            await pool_change(client, cluster, "delete", params={"url": cluster.vllm_url("d2")})
            await asyncio.to_thread(cluster.stop, "d2")
    disturbed = [o.ended for o in load.outcomes if o.tries > 1 or o.status != 200]
    for o in load.failed():
        say(
            f"{fault}: {o.kind} failed: {o.status} after {o.tries} tries, {o.ended - o.began:.1f} s"
        )
    slow = sorted(load.outcomes, key=lambda o: o.ended - o.began)[-3:]
    say(f"{fault}: slowest " + ", ".join(f"{o.kind} {o.ended - o.began:.1f} s" for o in slow))
    return Row(
        fault,
        target,
        max(disturbed) - at if disturbed else 0.0,
        max((o.ended - o.began for o in load.outcomes), default=0.0),
        len(load.outcomes),
        len(load.retried()),
        len(load.failed()),
        found,
    )


async def pool_change(
    client: httpx.AsyncClient, cluster: Cluster, method: str, **request: Any
) -> None:
    """Add (``post``) or drain (``delete``) a decode server through gw1; the pool membership
    store carries the change to gw2."""
    url = f"{cluster.gateway_url('gw1')}/admin/backends/tiny/decode/servers"
    r = await client.request(method, url, headers={"Authorization": f"Bearer {TOKEN}"}, **request)
    r.raise_for_status()
    await asyncio.sleep(2.0)  # the pub/sub message, and a health check of the new server


def table(rows: list[Row]) -> str:
    head = (
        "| fault | hit | recovery | slowest | requests | retried | failed | items lost "
        "| files lost | wrong |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r.fault} | {r.target} | {r.recovery_s:.1f} s | {r.slowest_s:.1f} s "
        f"| {r.requests} | {r.retried} "
        f"| {r.failed} | {r.check.items_lost} / {r.check.items} "
        f"| {r.check.files_lost} / {r.check.files} | {r.check.wrong} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


async def main() -> bool:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steady", type=float, default=3.0, help="seconds of load before a fault")
    ap.add_argument("--after", type=float, default=15.0, help="seconds of load after it")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--faults", default=",".join(FAULTS))
    args = ap.parse_args()
    missing = missing_requirements()
    if missing:
        say("no cluster here, missing: " + ", ".join(missing))
        return False
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        ap.error(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
    cluster = Cluster(cache_cluster=True)
    began = time.monotonic()
    await asyncio.to_thread(cluster.up)
    say(f"cluster up in {time.monotonic() - began:.0f} s")
    rows = []
    try:
        for fault in faults:
            rows.append(await run_fault(cluster, fault, args))
            say(table(rows[-1:]).splitlines()[-1])
    finally:
        await asyncio.to_thread(cluster.down)
    print(table(rows))
    met = all(r.check.items_lost == r.check.files_lost == r.check.wrong == 0 for r in rows)
    met = met and all(r.failed == 0 for r in rows)
    print(f"\n0 lost, 0 wrong, 0 failed in every row: {'met' if met else 'NOT met'}")
    for r in rows:
        for note in r.check.notes[:5]:
            print(f"  {r.fault}: {note}")
    return met


if __name__ == "__main__":
    raise SystemExit(exit_status(main(), say))
