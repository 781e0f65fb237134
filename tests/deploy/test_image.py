"""The image (``make image``) run as operators run it, with podman: opt-in
(``SEMCACHE_IMAGE_TESTS=1``), as building the image takes longer than CI's whole budget.

- ``podman run`` of the image's default role on a read-only root answers the openai SDK
  (models, chat, a stream, embeddings), a repeat is a HIT, the health check passes, and
  SIGTERM (``podman stop``) drains and stops it, launched vLLM included, well inside its
  grace period, with exit code 0;
- ``deploy/compose.yaml`` comes up (two gateways behind HAProxy, a Redis Cluster, prefill
  and decode over NIXL) and an answer stored through one gateway is a hit through the other.

Run ``make image`` (and ``scripts/image.sh services`` for the compose test) first.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.ports import free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("SEMCACHE_IMAGE", "localhost/semcache") + ":latest"
SERVICES = "localhost/semcache-services:bookworm"
TOKEN = "image-test-token"
CHAT = "SmolLM2-135M-Instruct"
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SEMCACHE_IMAGE_TESTS") != "1",
        reason="opt-in: SEMCACHE_IMAGE_TESTS=1 after `make image` (podman, minutes)",
    ),
]


def podman_env(image: str) -> dict[str, str]:
    """The environment podman runs in here (scripts/podman.sh says what this machine needs)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/podman.sh install)")
    if subprocess.run(["podman", "image", "exists", image]).returncode != 0:
        pytest.skip(f"no image {image} (make image)")
    env = dict(os.environ)
    done = subprocess.run(
        ["bash", "scripts/podman.sh", "env", image], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for word in shlex.split(done.stdout):
        if "=" in word and word != "export":
            name, _, value = word.partition("=")
            env[name] = value
    return env


def podman(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        ["podman", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout.strip()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def cache_status(url: str, headers: dict[str, str] | None = None) -> tuple[str, httpx.Response]:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"authorization": f"Bearer {TOKEN}", **(headers or {})},
        json={"model": CHAT, "messages": QUESTION, "temperature": 0, "max_tokens": 16},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.headers["cf-aig-cache-status"], r


@pytest.fixture
def container() -> Iterator[tuple[dict[str, str], str, str]]:
    env = podman_env(IMAGE)
    name = f"semcache-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    podman(
        env,
        "run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:8080",
        "--env", f"SEMCACHE_API_TOKEN={TOKEN}", "--shm-size", "1g",
        "--read-only", "--tmpfs", "/var/lib/semcache:rw,U,size=2g",
        IMAGE,
    )  # fmt: skip
    try:
        yield env, name, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["podman", "logs", "--tail", "60", name], env=env)
        subprocess.run(["podman", "rm", "--force", "--time", "0", name], env=env)


def test_the_image_serves_the_sdk_caches_and_stops_on_sigterm(
    container: tuple[dict[str, str], str, str],
) -> None:
    env, name, url = container

    def ready() -> bool:
        running = podman(env, "inspect", "--format", "{{.State.Running}}", name) == "true"
        return running and httpx.get(f"{url}/ready", timeout=5).status_code == 200

    began = time.monotonic()
    wait_until(lambda: _quietly(ready), 600, 1.0)
    print(f"image: ready {time.monotonic() - began:.0f} s after podman run")
    assert podman(env, "exec", name, "id", "-u") == "10001"  # not root
    podman(env, "healthcheck", "run", name)  # the image's HEALTHCHECK passes

    sdk = client(url)
    assert CHAT in [m.id for m in sdk.models.list()]
    answer = sdk.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    stream = sdk.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, stream=True)
    chunks = list(stream)
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    vectors = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=["a string", "another"])
    assert [len(v.embedding) for v in vectors.data] == [384, 384]
    assert cache_status(url)[0] in ("MISS", "HIT")
    assert cache_status(url)[0] == "HIT"

    began = time.monotonic()
    podman(env, "stop", "--time", "60", name, timeout=90)
    stopped_s = time.monotonic() - began
    assert podman(env, "inspect", "--format", "{{.State.ExitCode}}", name) == "0"
    assert stopped_s < 40, f"SIGTERM took {stopped_s:.1f} s (grace: 60 s)"
    print(f"image: SIGTERM to exit 0 in {stopped_s:.1f} s, launched vLLM included")
    logs = subprocess.run(["podman", "logs", name], env=env, capture_output=True, text=True)
    assert "[semcache] stopping" in logs.stdout + logs.stderr


def external_hits(url: str) -> float:
    """The decode servers' ``vllm:external_prefix_cache_hits``, as a gateway last scraped them:
    prompt tokens whose KV came from elsewhere (the prefill server, over NIXL)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "semcache_upstream_vllm_external_prefix_cache_hits_total"
        and s.labels.get("role") == "decode"
    )


def prefill_healthy(text: str) -> bool:
    """A gateway's ``/metrics`` says its prefill server is admitted."""
    return any(
        s.value == 1
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "semcache_backend_server_healthy" and s.labels.get("role") == "prefill"
    )


def _quietly(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except (httpx.HTTPError, AssertionError):
        return False


@pytest.mark.timeout(1500)
def test_the_compose_topology_shares_a_hit_between_its_gateways() -> None:
    env = podman_env(IMAGE)
    if subprocess.run(["podman", "image", "exists", SERVICES], env=env).returncode != 0:
        pytest.skip(f"no image {SERVICES} (scripts/image.sh services)")
    port = free_port()
    project = f"semcache-test-{uuid.uuid4().hex[:6]}"
    env.update(
        SEMCACHE_API_TOKEN=TOKEN,
        SEMCACHE_CACHE_SALT_SECRET="image-test-salt",
        SEMCACHE_LB_PORT=str(port),
        REDIS_IMAGE=SERVICES,
        HAPROXY_IMAGE=SERVICES,
    )
    compose = ["podman-compose", "--project-name", project, "--file", "deploy/compose.yaml"]
    log = (ROOT / ".data" / f"{project}.log").open("w")
    try:
        up = [*compose, "up", "--detach"]
        subprocess.run(up, cwd=ROOT, env=env, check=True, stdout=log, stderr=log, timeout=600)
        url = f"http://127.0.0.1:{port}"
        ready: set[str] = set()

        def both_ready() -> bool:  # the LB has sent a /ready to each gateway and got a 200
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200:
                ready.add(r.headers["x-semcache-gateway"])
            return len(ready) == 2

        wait_until(lambda: _quietly(both_ready), 900, 1.0)
        first, r1 = cache_status(url)
        second, r2 = cache_status(url)  # round robin: the other gateway
        served = r1.headers["x-semcache-gateway"], r2.headers["x-semcache-gateway"]
        assert served[0] != served[1], served
        assert (first, second) == ("MISS", "HIT"), (first, second, served)
        print(f"compose: MISS through {served[0]}, then HIT through {served[1]}")

        # /ready needs a decode server only: a gateway that started before vLLM admits the
        # prefill server a health round or more later, and until then sends prompts to decode
        # alone (prefill_down). Wait until both gateways have admitted it.
        admitted: set[str] = set()

        def prefill_admitted() -> bool:
            r = httpx.get(f"{url}/metrics", timeout=10)
            if prefill_healthy(r.text):
                admitted.add(r.headers["x-semcache-gateway"])
            return len(admitted) == 2

        wait_until(lambda: _quietly(prefill_admitted), 300, 1.0)
        # a prompt over the prefill threshold: prefilled in one container, its KV pulled into
        # the other over NIXL (the decode server counts the prompt as external cache hits)
        long_prompt = " ".join(f"word{i}" for i in range(400))
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"authorization": f"Bearer {TOKEN}", "cf-aig-skip-cache": "true"},
            json={"model": CHAT, "messages": [{"role": "user", "content": long_prompt}],
                  "max_tokens": 4},
            timeout=300,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        seen = [0.0]  # the LB alternates gateways: print the value that passed

        def decode_hit_externally() -> bool:
            seen[0] = external_hits(url)
            return seen[0] > 0

        wait_until(decode_hit_externally, 30, 1.0)
        print(f"compose: decode's external prefix-cache hits {seen[0]:.0f} (NIXL)")
    finally:
        down = [*compose, "down", "--timeout", "30"]
        subprocess.run(down, cwd=ROOT, env=env, stdout=log, stderr=log, timeout=600)
        log.close()
