"""What a real vLLM (the CPU build) publishes as KV events: start a tiny server with KV events
on, send a few requests, receive the ZMQ batches, decode them with vLLM's own msgspec types,
ask the replay socket for everything from sequence 0, and print it all.

``--record DIR`` also writes each received message (its three frames) to DIR as the fixtures
``tests/backends/data/kv_events/`` holds (real-format events for the fast tests).

    flock /tmp/semcache-heavy.lock .venv/bin/python -m bench.diagnostics.kv_events_probe \
        [--record tests/backends/data/kv_events]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.ports import free_port
from harness.vllm_process import TINY_MODEL_NAME, start_tiny_vllm, test_data_dir

SYSTEM = " ".join(f"rule {i}: answer briefly and kindly." for i in range(40))


async def receive(sub: zmq.asyncio.Socket, wait_s: float) -> list[list[bytes]]:
    """Every message that arrives until ``wait_s`` passes without one."""
    got: list[list[bytes]] = []
    while await sub.poll(int(wait_s * 1000)):
        got.append(await sub.recv_multipart())
    return got


def describe(frames: list[bytes]) -> dict[str, Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    topic, seq, payload = frames
    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
    raw = msgspec.msgpack.decode(payload)
    return {
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big", signed=True),
        "raw_head": repr(raw)[:600],
        "events": [repr(e)[:900] for e in batch.events],
        "dp_rank": batch.data_parallel_rank,
    }


def record(out: Path, messages: list[list[bytes]], chat: dict[str, Any]) -> None:
    """Each message's sequence number and payload, and the chat request whose blocks they are."""
    out.mkdir(parents=True, exist_ok=True)
    for i, frames in enumerate(messages):
        (out / f"{i:03d}.msgpack").write_bytes(frames[2])
        (out / f"{i:03d}.seq").write_bytes(frames[1])
    (out / "chat.json").write_bytes(orjson.dumps(chat, option=orjson.OPT_INDENT_2))


async def run(args: argparse.Namespace) -> None:
    data_dir = test_data_dir()
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    extra = ["--kv-events-config", orjson.dumps(events_config).decode()]
    extra += ["--prefix-caching-hash-algo", args.hash_algo]
    process = await start_tiny_vllm(
        data_dir,
        port,
        block_size=32,
        kv_cache_gib=args.kv_tokens / (1 << 20),  # 1 KiB of KV per token of the tiny Llama
        extra_args=extra,
        env={"VLLM_SERVER_DEV_MODE": "1"},
        progress=None,
    )
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    messages: list[list[bytes]] = []
    try:
        await asyncio.sleep(0.5)  # the SUB's connection (a slow joiner misses what precedes)
        async with httpx.AsyncClient(base_url=process.url, timeout=60) as client:
            chat = {
                "model": TINY_MODEL_NAME,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "hello there"},
                ],
                "max_tokens": 4,
                "temperature": 0,
            }
            others = [
                {**chat, "messages": [{"role": "system", "content": f"{i} {SYSTEM}"}]}
                for i in range(args.pressure)
            ]  # more blocks than the KV cache holds: vLLM evicts (BlockRemoved)
            for body in (chat, chat, {**chat, "cache_salt": "tenant-a"}, *others):
                answer = (await client.post("/v1/chat/completions", json=body)).json()
                print("usage", answer.get("usage"))
                messages += await receive(sub, 1.0)
            tok = await client.post(
                "/tokenize", json={"model": TINY_MODEL_NAME, "messages": chat["messages"]}
            )
            print("tokenize", tok.json().get("count"), tok.json().get("tokens", [])[:40])
            reset = await client.post("/reset_prefix_cache")
            print("reset_prefix_cache", reset.status_code)
            messages += await receive(sub, 1.0)
            print("after the reset, before a request:", len(messages), "messages")
            await client.post("/v1/chat/completions", json=chat)  # a step publishes the reset
            messages += await receive(sub, 1.0)
        for frames in messages:
            print(orjson.dumps(describe(frames), option=orjson.OPT_INDENT_2).decode())
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        await replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = 0
        while await replay.poll(3000):
            frames = await replay.recv_multipart()
            print("replay frames", len(frames), [f[:12] for f in frames[:3]])
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
            replayed += 1
        print("received", len(messages), "replayed", replayed)
        replay.close(0)
        if args.record:
            await asyncio.to_thread(record, Path(args.record), messages, chat)
    finally:
        sub.close(0)
        ctx.term()
        await process.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", default=None)
    parser.add_argument("--hash-algo", default="sha256_cbor")
    parser.add_argument("--kv-tokens", type=int, default=4096, help="the server's KV capacity")
    parser.add_argument("--pressure", type=int, default=8, help="distinct long prompts sent")
    asyncio.run(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
