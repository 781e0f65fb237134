"""A verified partition's observations are part of its entries (real tiny vLLM, HTTP):
``semcache serve`` killed with SIGKILL and restarted keeps them, a purge forgets them, and
two gateways on one real redis-server share them.

As in ``test_semantic_verified``, the ``embedding`` judge with a bound of 0 accepts every
answer, so three judged explores teach the partition that its entries are right.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig, ModelEntry
from tests.conftest import gateway_config
from tests.semcache.conftest import RedisServer
from tests.server.test_semantic_verified import (
    ADMIN,
    PARAPHRASES,
    QUESTION,
    counter,
    decision,
    metric,
)
from tests.support.configs import admin_auth, verified_rule, write_config, write_policy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-learns"
RULE = verified_rule(MODEL)


def chat(base: str, user: str, gw: GatewayProcess | None = None) -> httpx.Response:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": user},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    try:
        # The first semantic request of a gateway loads the encoder and restores the index.
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    except httpx.TimeoutException as exc:
        log = "".join(gw.lines[-40:]) if gw is not None else ""
        raise AssertionError(f"no answer from {base}:\n{log}") from exc
    assert r.status_code == 200, r.text
    return r


def verified_config(tmp: Path, data_dir: Path, vllm_url: str) -> Path:
    policy = write_policy(tmp, f'version = 1\n[tiers.disk]\ndir = "cache/exact"\n{RULE}')
    return write_config(
        tmp,
        f"""
[auth.admin]
token = "{ADMIN}"
[[models]]
id = "{MODEL}"
backend = "tiny"
task = "chat"
[[backends]]
kind = "vllm"
name = "tiny"
served_model = "{TINY_MODEL_NAME}"
model_path = "{data_dir / "models" / TINY_MODEL_NAME}"
[[backends.servers]]
url = "{vllm_url}"
""",
        data_dir=tmp,
        policy=policy,
    )


@pytest.mark.timeout(1500)  # three gateway starts (and perhaps the session's vLLM)
def test_kill_9_keeps_the_observations_and_a_purge_forgets_them(
    tmp_path: Path, data_dir: Path, tiny_vllm: VllmProcess
) -> None:
    config = verified_config(tmp_path, data_dir, tiny_vllm.url)
    started: list[GatewayProcess] = []

    def start() -> GatewayProcess:
        gw = GatewayProcess(config).start(timeout_s=300.0)
        started.append(gw)
        return gw

    try:
        one = start()
        first = chat(one.url, QUESTION, one)
        seen = [decision(chat(one.url, text, one)) for text in PARAPHRASES[:3]]
        assert seen == ["explore"] * 3, "".join(one.lines[-20:])
        one.kill()

        # The three observations came back with the entry: a new paraphrase is served.
        two = start()
        hit = chat(two.url, PARAPHRASES[3], two)
        assert decision(hit) == "hit", "".join(two.lines[-20:])
        assert hit.json()["id"] == first.json()["id"]
        r = httpx.post(
            f"{two.url}/admin/cache/purge",
            json={"kind": "model", "target": MODEL},
            headers={"authorization": f"Bearer {ADMIN}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        two.kill()

        # The purge outlived the kill: the entry and its observations are gone; a new
        # entry starts a partition that knows nothing.
        three = start()
        assert decision(chat(three.url, PARAPHRASES[4], three)) is None  # no candidate at all
        assert decision(chat(three.url, PARAPHRASES[5], three)) == "explore"
    finally:
        for gw in started:
            gw.stop()


def feed_records(gw: GatewayProcess, direction: str) -> float:
    """Semantic records ``gw`` published to the shared feed or received from it."""
    return metric(gw, f'semcache_semantic_feed_records_total{{direction="{direction}"}}')


def test_observations_made_on_one_gateway_decide_on_the_other(
    tmp_path: Path,
    data_dir: Path,
    tiny_vllm: VllmProcess,
    redis_server: RedisServer,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    prefix = f"t{os.urandom(5).hex()}"
    model = data_dir / "models" / TINY_MODEL_NAME

    def gateway(name: str) -> GatewayProcess:
        tmp = tmp_path / name
        tmp.mkdir()
        policy = tmp / "policy.toml"
        policy.write_text(
            'version = 1\n[tiers.disk]\ndir = "cache/exact"\n'
            f'[tiers.redis]\nurl = "{redis_server.url}"\nprefix = "{prefix}"\n{RULE}'
        )
        cfg = gateway_config(tmp, tiny_vllm.url, model, policy=str(policy), auth=admin_auth(ADMIN))
        cfg.models += [ModelEntry(id=MODEL, backend="tiny", task="chat")]
        return start_gateway(cfg)

    a, b = gateway("a"), gateway("b")
    first = chat(a.url, QUESTION, a)
    seen = [decision(chat(a.url, text, a)) for text in PARAPHRASES[:3]]
    assert seen == ["explore"] * 3

    def b_has_what_a_published() -> bool:
        """A's entry and its three observations, read off the feed by B."""
        published = feed_records(a, "published")
        return published >= 4 and feed_records(b, "received") >= published

    # B loads its encoder and catches up on the feed in the background at start.
    wait_until(b_has_what_a_published, timeout_s=120.0, interval_s=0.1)

    # B judged nothing itself: A's observations, through Redis, make it serve.
    hit = chat(b.url, PARAPHRASES[3], b)
    assert decision(hit) == "hit"
    assert hit.json()["id"] == first.json()["id"]  # A's answer, via the Redis tier
    assert counter(b, MODEL, "explore") == 0
    assert counter(b, MODEL, "exploit") == 1
