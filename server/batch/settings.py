"""The ``[batch]`` section of the gateway config: the queue, its limits and the capacity rules."""

from __future__ import annotations

from typing import Literal

import msgspec

from foundation.config_types import NonEmptyStr, NonNegFloat, NonNegInt, PosFloat, PosInt


class QueueSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the batch queue lives and how long its leases and results last."""

    kind: Literal["disk", "redis"] = "disk"
    """``disk``: SQLite on local disk (one machine); ``redis``: Redis Streams (several gateways)."""
    path: str | None = None
    """SQLite file of the disk queue; default ``<data_dir>/queue/batch.sqlite3``."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: NonEmptyStr = "semcache:batch"
    """Key prefix of the Redis queue: gateways sharing one prefix share one queue."""
    replicas: NonNegInt = 0
    """A submit to the Redis queue (and an upload to the Redis files store) is acknowledged
    only once this many replicas hold it (``WAIT``), so a failover cannot lose it; ``0``:
    at once (replication stays asynchronous)."""
    replica_timeout_s: PosFloat = 1.0
    """Longest wait for those replicas; past it the request is refused with a 503
    (``not_replicated``) and what it wrote is removed: the client retries."""
    lease_s: PosFloat = 30.0
    """A claimed item returns to the queue when its worker has not renewed it for this long."""
    results_ttl_s: PosFloat = 86400.0
    """A finished batch (and its results) is removed this long after its last item completed."""
    max_age_s: PosFloat = 7 * 86400.0
    """An unfinished batch is dropped after this long (a safety net against leaks)."""


class FilesSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The OpenAI Files API's store (``/v1/files``): batch input and output files, and the
    OpenAI batch records."""

    storage: Literal["auto", "disk", "redis"] = "auto"
    """``disk``: under ``dir`` (one gateway, or several sharing a mount); ``redis``: in the
    queue's Redis (``queue.redis_url``, keys under ``<queue.prefix>:openai``), so that any
    gateway on it answers for any file and batch; ``auto``: ``redis`` when the queue is."""
    dir: str | None = None
    """Folder of the stored files (``files/``) and OpenAI batch records (``batches/``) on
    disk; default ``<data_dir>/openai``."""
    max_bytes: PosInt = 200 * 1024 * 1024
    """Largest file one upload may hold (a larger one is refused with a 413)."""
    retention_s: PosFloat = 30 * 86400.0
    """Files (uploads and batch outputs) and batch records are removed this long after
    they were created."""


class BatchSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[batch]`` section of the gateway config."""

    enabled: bool = True
    queue: QueueSettings = msgspec.field(default_factory=QueueSettings)
    files: FilesSettings = msgspec.field(default_factory=FilesSettings)
    max_items: PosInt = 1000
    """Most items one batch may hold (a larger one is refused with a 400 naming this limit;
    an OpenAI batch input file with more lines fails validation)."""
    per_server_limit: PosInt | None = 8
    """Batch work starts only while some server of the backend runs fewer requests than this
    (and than the backend's own per-server limit, where it has one)."""
    max_inflight: PosInt = 16
    """Most batch items one gateway runs at once (on idle capacity only)."""
    yield_to_sync: bool = True
    """Start batch items only while no synchronous request is in flight on their backend."""
    sync_idle_s: NonNegFloat = 0.5
    """...and none has been seen for this long (live traffic often comes in bursts). Batch
    items resumed between live requests share the backend's steps with the next one and
    delay its first token (``bench/batch_queue.py`` measures it); a shorter wait gives
    batches more throughput under steady live traffic."""
    preempt: bool = True
    """A synchronous request arriving on a backend stops the batch items running there; they
    go back to the queue and run again on the next idle capacity."""
    max_preemptions: NonNegInt = 3
    """An item stopped this many times runs to its end (batch work must not starve)."""
    max_attempts: PosInt = 5
    """Tries of an item whose backend failed (unreachable, timeout, overloaded) before it is
    answered with the error."""
    retry_delay_s: NonNegFloat = 2.0
    unserved_delay_s: NonNegFloat = 5.0
    """An item for a model this gateway does not serve is given back for this long, so that
    a gateway that serves it takes it."""
    capacity_poll_s: PosFloat = 0.01
    """How often the gates look at the backends' load while batch work waits for capacity or
    runs (the backends' counters have no event). Idle workers never poll: they block on the
    queue until an item is submitted."""
    idle_wait_s: PosFloat = 5.0
    """Longest single wait of an idle worker on the queue (a blocking read, woken at once by a
    submission); leases of dead workers are looked for at least this often."""
