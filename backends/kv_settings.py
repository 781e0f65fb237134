"""A vLLM backend's ``[backends.kv]`` table: how KV placement reads its servers' KV events."""

from __future__ import annotations

from typing import Literal

import msgspec
import orjson

from foundation.config_types import NonNegFloat, PosInt

HashAlgo = Literal["sha256_cbor", "sha256"]
"""The block hash functions vLLM offers (``--prefix-caching-hash-algo``) that the gateway
recomputes (``backends.fleet.kv.hashing``)."""

PlacementPolicy = Literal["prefix-hash", "kv", "least-loaded", "round-robin"]
"""How a pool picks a server when no session pins the request (``backends.fleet.placement``)."""


class KvSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """KV placement (``placement = "kv"``): what the gateway needs to match a request's
    blocks with those its servers publish."""

    topic: str = "kv"
    """The servers' KV events topic."""
    hash_algo: HashAlgo = "sha256_cbor"
    """The servers' ``--prefix-caching-hash-algo`` (launched servers get this one)."""
    hash_seed: str | None = None
    """The servers' ``PYTHONHASHSEED``; default: a launched server's (its ``launch.env``,
    else the gateway's own environment, which it inherits), else vLLM's own seed."""
    block_size: PosInt | None = None
    """The servers' KV block size; default: the launched servers' (32 on a CPU), else the
    first ``BlockStored`` event's."""
    tokenizer: str | None = None
    """The folder of the model's tokenizer files; default: the backend's ``model_path``."""
    request_cost_tokens: NonNegFloat = 64.0
    """What one open request (or one waiting in vLLM's queue) costs a server, in prompt tokens
    to compute: the weight of load against the tokens a server holds
    (``backends.fleet.kv.scoring``)."""
    occupancy_weight: NonNegFloat = 0.05
    """How much holding the most cached blocks of the pool costs a server, as a fraction of
    the prompt: a prompt no server holds goes where it evicts the least."""
    max_blocks_per_server: PosInt = 1_000_000
    """Index entries kept per server; past it the oldest are forgotten (counted)."""

    def launch_flags(self, endpoint: str, replay: str | None) -> list[tuple[str, str | None]]:
        """The vLLM flags that make a launched server publish its KV events on the port of
        ``endpoint`` (and ``replay``), hashed as the gateway hashes."""
        events: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{_port(endpoint)}",  # a '*' endpoint is bound by vLLM
            "topic": self.topic,
        }
        if replay:
            events["replay_endpoint"] = f"tcp://*:{_port(replay)}"
        return [
            ("--kv-events-config", orjson.dumps(events).decode()),
            ("--prefix-caching-hash-algo", self.hash_algo),
        ]


def _port(endpoint: str) -> int:
    head, _, port = endpoint.rpartition(":")
    if not head.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"a KV events endpoint is tcp://HOST:PORT, not {endpoint!r}")
    return int(port)
