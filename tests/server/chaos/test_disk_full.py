"""A full disk under the data dir: answers keep coming, the failure is logged once and
counted, and nothing half written is ever served (a size-limited tmpfs made by the test)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from backends.launch.process import VllmProcess
from harness.gateway import GatewayProcess
from harness.vllm_process import TINY_MODEL_NAME
from server.config import GatewayConfig
from tests.conftest import gateway_config
from tests.server.chaos.common import chat, every_tier_policy, metric
from tests.support.configs import write_policy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TMPFS_MIB = 24
N_CHAT = 20
N_EMBED = 10  # requests of 3 new texts each
ANIMALS = ["cat", "horse", "eagle", "shark", "beetle", "wolf", "parrot", "camel", "frog", "bee"]
VERBS = [
    "sleeps",
    "gallops",
    "circles",
    "hunts",
    "crawls",
    "howls",
    "sings",
    "rests",
    "jumps",
    "buzzes",
]
BATCH_LINE = (
    b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}]}}\n'
)
PLACES = ["old mill", "frozen lake", "busy market"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A TMPFS_MIB tmpfs mounted on a fresh folder (root only), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "data"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Write a file until the file system is full; the file is returned to free it later."""
    filler = folder / "filler"
    block = b"\0" * (256 * 1024)
    with filler.open("wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
                f.flush()
    with pytest.raises(OSError) as full:
        (folder / "probe").write_bytes(block)
    assert full.value.errno == errno.ENOSPC
    return filler


def embed(gw: GatewayProcess, texts: list[str]) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts}, timeout=60
    )


LAST_LINES = ("[semcache] interrupted", "[semcache] stopping")
"""How ``semcache serve`` ends its output: on SIGINT (``stop``), or on its own."""


def stopped_log(gw: GatewayProcess) -> list[str]:
    """``gw`` stopped, and every line it printed (read up to its last)."""
    gw.stop()
    wait_until(lambda: gw.lines and gw.lines[-1].startswith(LAST_LINES), timeout_s=30)
    return list(gw.lines)


def test_disk_full_keeps_answering_counts_once_and_serves_nothing_corrupt(
    small_disk: Path,
    tmp_path: Path,
    data_dir: Path,
    tiny_vllm: VllmProcess,
    start_gateway: Callable[[GatewayConfig], GatewayProcess],
) -> None:
    # The exported encoder graph is shared with the other tests (and made on first use).
    policy = write_policy(tmp_path, every_tier_policy())
    config = gateway_config(
        small_disk,
        tiny_vllm.url,
        data_dir / "models" / TINY_MODEL_NAME,
        policy=str(policy),
        encoder_dir=str(data_dir / "encoders"),
    )
    run = uuid.uuid4().hex[:8]
    chats = [chat(f"disk full {run} {i}") for i in range(N_CHAT)]
    texts = [
        [f"The {a} {v} near the {p}." for p in PLACES] for a, v in zip(ANIMALS, VERBS, strict=True)
    ]
    gw = start_gateway(config)
    assert embed(gw, [f"warm {run}"]).status_code == 200  # the semantic cache is loaded
    filler = fill(small_disk)
    first = [httpx.post(f"{gw.url}/v1/chat/completions", json=c, timeout=60) for c in chats]
    vectors = [embed(gw, t) for t in texts]
    assert [r.status_code for r in first + vectors] == [200] * (N_CHAT + N_EMBED)
    # What must be stored to be accepted is refused plainly, in the route's format
    batch = httpx.post(
        f"{gw.url}/client/v4/accounts/a/ai/run/tiny-chat?queueRequest=true",
        json={"requests": [{"prompt": "x", "max_tokens": 4}]},
        headers={"authorization": "Bearer t"},
    )
    assert batch.status_code == 507 and batch.json()["success"] is False
    upload = httpx.post(
        f"{gw.url}/v1/files",
        files={"file": ("in.jsonl", BATCH_LINE)},
        data={"purpose": "batch"},
        headers={"authorization": "Bearer t"},
    )
    assert upload.status_code == 507
    assert upload.json()["error"]["code"] == "insufficient_storage"
    again = [httpx.post(f"{gw.url}/v1/chat/completions", json=c, timeout=60) for c in chats]
    assert all(r.headers["cf-aig-cache-status"] == "HIT" for r in again)  # from memory
    assert [r.content for r in again] == [r.content for r in first]
    lost = metric(gw.url, "semcache_exact_tier_errors_total", tier="disk", op="set")
    records_lost = metric(gw.url, "semcache_semantic_record_write_failures_total")
    filler.unlink()
    after = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(f"after {run}"), timeout=60)
    assert after.status_code == 200
    log = stopped_log(gw)
    disk_failed = [line for line in log if "cache tier disk failed on set" in line]
    semantic_failed = [line for line in log if "semantic records cannot be written" in line]
    assert len(disk_failed) == 1 and len(semantic_failed) == 1  # logged once each
    assert any("cache tier disk works again on set" in line for line in log)
    assert lost >= N_CHAT  # every chat answer, and the embedding items
    assert records_lost >= 3 * N_EMBED

    # After a restart on the same disk: every answer is the right one or a miss, never junk.
    gw = start_gateway(config)
    replay = [httpx.post(f"{gw.url}/v1/chat/completions", json=c, timeout=60) for c in chats]
    assert [r.status_code for r in replay] == [200] * N_CHAT
    for old, new in zip(first, replay, strict=True):
        content = new.json()["choices"][0]["message"]["content"]
        assert content == old.json()["choices"][0]["message"]["content"]
    for t, old in zip(texts, vectors, strict=True):
        new_vectors = embed(gw, t)
        assert new_vectors.status_code == 200
        for a, b in zip(old.json()["data"], new_vectors.json()["data"], strict=True):
            assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-4)
    served = sum(r.headers["cf-aig-cache-status"] == "HIT" for r in replay)
    corrupt = metric(gw.url, "semcache_exact_integrity_failures_total")
    assert corrupt == 0
    print(
        f"\nFIGURE disk full: {N_CHAT + N_EMBED} of {N_CHAT + N_EMBED} requests answered on a "
        f"full {TMPFS_MIB} MiB tmpfs (a batch and a file upload: 507); {lost:.0f} L2 writes "
        f"and {records_lost:.0f} semantic records lost, counted, logged once each; "
        f"after restart {served} L2 hits, {N_CHAT - served} misses, 0 corrupt"
    )
