"""Redis stopped and started under load, between two ``semcache serve`` processes: no 5xx,
hits go on from the local tiers, L3 comes back by itself, and a purge made while it was down
is applied at once where it was made and reaches the other gateway once Redis is back (not
lost, not refused)."""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess, write_config_toml
from harness.vllm_process import TINY_MODEL_NAME
from tests.conftest import gateway_config
from tests.server.chaos.common import ADMIN, chat, every_tier_policy, metric
from tests.support.configs import admin_auth, write_policy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

K = 20  # answers cached before the outage


class Load:
    """Two client threads replaying cached requests (and a few new ones) on both gateways."""

    def __init__(self, urls: list[str], bodies: list[dict[str, Any]], run: str) -> None:
        self.urls, self.bodies, self.run = urls, bodies, run
        self.stop = threading.Event()
        self.outcomes: Counter[tuple[int, str]] = Counter()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(n,)) for n in range(2)]

    def _loop(self, n: int) -> None:
        with httpx.Client(timeout=60) as http:
            for i in itertools.count():
                if self.stop.is_set() or i >= 5000:
                    return
                url = self.urls[(i + n) % len(self.urls)]
                body = self.bodies[i % len(self.bodies)] if i % 5 else chat(f"{self.run} {n} {i}")
                r = http.post(f"{url}/v1/chat/completions", json=body)
                with self._lock:
                    self.outcomes[(r.status_code, r.headers.get("cf-aig-cache-status", ""))] += 1

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def count(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    def finish(self) -> Counter[tuple[int, str]]:
        self.stop.set()
        for t in self._threads:
            t.join(120)
        return self.outcomes


def test_redis_stopped_and_started_under_load(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess, redis_factory: Any
) -> None:
    server = redis_factory()
    policy = write_policy(tmp_path, every_tier_policy(server.url))
    model = data_dir / "models" / TINY_MODEL_NAME
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = (
        GatewayProcess(
            write_config_toml(
                gateway_config(
                    tmp_path / name,
                    tiny_vllm.url,
                    model,
                    embeddings=False,
                    policy=str(policy),
                    auth=admin_auth(ADMIN),
                ),
                tmp_path / f"{name}.toml",
            )
        )
        for name in ("a", "b")
    )
    a.start()
    b.start()
    run = uuid.uuid4().hex[:8]
    bodies = [chat(f"outage {run} {i}") for i in range(K)]
    admin = {"authorization": f"Bearer {ADMIN}"}
    http = httpx.Client(timeout=60)

    def status(gw: GatewayProcess, body: dict[str, Any]) -> str:
        r = http.post(f"{gw.url}/v1/chat/completions", json=body)
        assert r.status_code == 200
        return str(r.headers["cf-aig-cache-status"])

    load: Load | None = None
    try:
        assert [status(a, x) for x in bodies] == ["MISS"] * K
        assert [status(b, x) for x in bodies] == ["HIT"] * K  # from L3; now in b's L1/L2 too
        load = Load([a.url, b.url], bodies, run).start()
        wait_until(lambda: load.count() >= 20, 60)

        server.stop()
        at_stop = load.count()
        wait_until(lambda: load.count() >= at_stop + 40, 60)  # under load, Redis down
        assert status(b, bodies[1]) == "HIT"  # local tiers
        # A purge while Redis is down: applied here at once, reported as not propagated
        short = http.post(f"{a.url}/v1/chat/completions", json=bodies[0]).headers["x-semcache-key"]
        purge = http.post(
            f"{a.url}/admin/cache/purge", json={"kind": "key", "target": short}, headers=admin
        )
        assert purge.status_code == 200 and purge.json()["propagated"] is False
        assert status(a, bodies[0]) == "MISS"
        assert status(b, bodies[0]) == "HIT"  # b cannot know yet

        server.start()  # empty: no persistence
        at_start = load.count()

        def l3_back() -> bool:  # a new answer filled through a is found by b in Redis
            fresh = chat(f"{run} back {uuid.uuid4().hex}")
            status(a, fresh)
            return status(b, fresh) == "HIT"

        wait_until(l3_back, 30, interval_s=0.2)
        wait_until(lambda: status(b, bodies[0]) == "MISS", 30, interval_s=0.2)  # purge arrived
        wait_until(lambda: load.count() >= at_start + 40, 60)
        outcomes = load.finish()
        redis_hits = metric(b.url, "semcache_exact_hits_total", tier="redis")
    finally:
        if load is not None:
            load.finish()
        http.close()
        a.stop()
        b.stop()
    errors = sum(n for (code, _), n in outcomes.items() if code >= 500)
    total = sum(outcomes.values())
    hits = sum(n for (code, cache), n in outcomes.items() if cache == "HIT")
    assert errors == 0, outcomes
    assert redis_hits > K  # the warm-up's K, then the ones after the restart
    print(
        f"\nFIGURE redis outage: {total} requests under load across a Redis stop/start "
        f"({at_start - at_stop} while it was down), 0 server errors, {hits} hits; L3 back by "
        "itself; the purge made while down reached the other gateway after the restart"
    )
