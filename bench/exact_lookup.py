"""In-process exact-cache lookup: p50/p99 of an L1 hit, an L2 hit, and the checksum's share.

Claims checked (issue 3): an in-process L1 hit lookup has p50 <= 0.2 ms; verifying an entry's
checksum costs < 1 % of a hit. Operations are interleaved in one loop so machine noise hits
all of them alike. L1 holds entries already verified when they entered it, so an L1 hit pays
no checksum; a read from disk or Redis verifies the bytes, so the share is shown for both.

    .venv/bin/python bench/exact_lookup.py [--iterations 20000] [--answer-bytes 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import semcache.entry as entry_module
from bench.lib.support import pct
from semcache.entry import CachedAnswer, checksum, decode_entry, encode_entry
from semcache.exact import CacheStatus, ExactCache
from semcache.exact.purge import LocalEpochs
from semcache.metrics import CacheMetrics
from semcache.policy import CacheRule, Prices
from semcache.tiers import DiskStore, MemoryStore

RULE = CacheRule(ttl_s=3600, max_ttl_s=3600, prices=Prices(input_per_m=0.045, output_per_m=0.384))


def answer_body(n: int) -> bytes:
    text = ("The capital of France is Paris. " * (n // 32 + 1))[:n]
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1718000000,
            "model": "qwen3-0.6b",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 40,
                "completion_tokens": n // 4,
                "total_tokens": 40 + n // 4,
            },
        }
    )


BODY: dict[str, Any] = {
    "model": "qwen3-0.6b",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "temperature": 0,
    "max_tokens": 256,
}


async def main(iterations: int, answer_bytes: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="semcache-bench-"))
    l1 = ExactCache(
        memory=MemoryStore[CachedAnswer](256 << 20, sizeof=CachedAnswer.memory_size),
        lower=[DiskStore(tmp / "l2a")],
        epochs=LocalEpochs(tmp / "l2a" / "epochs"),
        metrics=CacheMetrics(CollectorRegistry()),
    )
    l2 = ExactCache(  # no memory tier: every hit reads and verifies bytes from disk
        lower=[DiskStore(tmp / "l2b")],
        epochs=LocalEpochs(tmp / "l2b" / "epochs"),
        metrics=CacheMetrics(CollectorRegistry()),
    )
    answer = CachedAnswer.from_json(answer_body(answer_bytes), model_id="qwen3-0.6b")

    async def fill() -> CachedAnswer:
        return answer

    def prepare(cache: ExactCache) -> Awaitable[Any]:
        return cache.prepare(
            route="chat",
            body=BODY,
            model_id="qwen3-0.6b",
            revision="r1",
            rule=RULE,
            tenant="acme",
            chat_template_fp="tmpl",
        )

    req1 = await prepare(l1)
    req2 = await prepare(l2)
    await l1.get_or_fill(req1, fill)
    await l2.get_or_fill(req2, fill)
    assert (await l1.lookup(req1)).tier == "memory"
    assert (await l2.lookup(req2)).tier == "disk"

    blob = encode_entry((await l1.lookup(req1)).entry or answer, req1.key.digest)
    payload = memoryview(blob)[16:]
    digest = req1.key.digest

    async def op_l1_lookup() -> None:
        r = await l1.lookup(req1)
        assert r.status is CacheStatus.HIT

    async def op_l1_prepare_and_hit() -> None:
        r = await l1.get_or_fill(await prepare(l1), fill)
        assert r.status is CacheStatus.HIT

    async def op_l2_lookup() -> None:
        r = await l2.lookup(req2)
        assert r.tier == "disk"

    async def op_checksum() -> None:
        checksum(payload, digest)

    async def op_decode_verified() -> None:
        decode_entry(blob, digest)

    ops: dict[str, Callable[[], Awaitable[None]]] = {
        "L1 hit: lookup": op_l1_lookup,
        "L1 hit: prepare (key) + get_or_fill": op_l1_prepare_and_hit,
        "L2 hit: lookup (disk, verify, decode)": op_l2_lookup,
        "checksum verify (blake2b)": op_checksum,
        "decode_entry (verify + msgpack)": op_decode_verified,
    }
    n_l2 = max(200, iterations // 20)  # disk reads go through a thread: fewer of them
    times: dict[str, list[float]] = {k: [] for k in ops}
    for i in range(iterations):
        for name, op in ops.items():
            if name.startswith("L2") and i % (iterations // n_l2 or 1):
                continue
            t0 = time.perf_counter_ns()
            await op()
            times[name].append((time.perf_counter_ns() - t0) / 1000)

    l1_checks = await checksums_per_call(op_l1_lookup, iterations)
    n_disk = len(times["L2 hit: lookup (disk, verify, decode)"])
    print(
        f"entry: {len(blob)} bytes stored, answer {answer.payload_bytes} bytes; "
        f"{iterations} interleaved iterations ({n_disk} of them with an L2 hit)"
    )
    print(f"{'operation':42} {'p50 µs':>9} {'p99 µs':>9} {'mean µs':>9}")
    for name, xs in times.items():
        print(f"{name:42} {pct(xs, 50):9.1f} {pct(xs, 99):9.1f} {statistics.fmean(xs):9.1f}")
    ck = pct(times["checksum verify (blake2b)"], 50)
    l1_hit = pct(times["L1 hit: lookup"], 50)
    l2_hit = pct(times["L2 hit: lookup (disk, verify, decode)"], 50)
    print()
    print(
        f"L1 hit p50 {l1_hit / 1000:.3f} ms (target <= 0.2 ms): "
        f"{'OK' if l1_hit <= 200 else 'MISSED'}"
    )
    print("checksum share of a hit (p50 ratios, target < 1 %):")
    l1_share = l1_checks * ck / l1_hit
    print(
        f"  L1 hit: {100 * l1_share:.2f} % {'OK' if l1_share < 0.01 else 'MISSED'} "
        f"({l1_checks:.2f} checksums counted per hit; "
        f"one per hit would be {100 * ck / l1_hit:.1f} %)"
    )
    print(f"  L2 hit: {100 * ck / l2_hit:.2f} % {'OK' if ck / l2_hit < 0.01 else 'MISSED'}")
    await l1.aclose()
    await l2.aclose()


async def checksums_per_call(op: Callable[[], Awaitable[None]], calls: int) -> float:
    """How many times ``op`` computes an entry checksum, on average over ``calls`` calls."""
    counted = 0
    real = entry_module.checksum

    def counting(payload: bytes | memoryview, digest: str) -> bytes:
        nonlocal counted
        counted += 1
        return real(payload, digest)

    entry_module.checksum = counting  # decode_entry and entry_tag look it up at each call
    try:
        for _ in range(calls):
            await op()
    finally:
        entry_module.checksum = real
    return counted / calls


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--answer-bytes", type=int, default=1500)
    args = ap.parse_args()
    asyncio.run(main(args.iterations, args.answer_bytes))
