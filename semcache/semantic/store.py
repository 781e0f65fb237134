"""The durable copy of the semantic entries: one ``diskcache`` directory per gateway.

Every entry the index gains (an insert, or a record from another gateway's feed) is written
here before the insert returns, with the entry's TTL as diskcache's ``expire`` and the
directory bounded by ``max_bytes`` (diskcache culls the least recently stored past it). Every
entry the index loses for good (eviction, a purge, an answer gone from the exact tiers) is
deleted here too. On start the index loads its last snapshot and reconciles it with these
records: entries without a record are dropped, records without an entry are added. So a
crash (``kill -9``) loses nothing an insert had returned for, and expired, evicted or purged
entries are never resurrected.

Keys: ``r/<partition digest>/<payload ref>`` → a msgpack ``SemanticRecord``;
``p/<partition digest>`` → its ``PartitionKey`` (purges select partitions by key without
decoding every record); ``o/<partition digest>/<payload ref>`` → a marker that the record
holds observations (verified partitions), so a restore merges them into the snapshot's
entry; ``feed/cursor`` → the last Redis stream id this gateway applied.

All methods block (SQLite); async callers run them in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import diskcache
import msgspec

from semcache.semantic.records import PartitionKey, SemanticRecord

log = logging.getLogger(__name__)

_CURSOR = "feed/cursor"


class RecordStore:
    """Semantic records on disk (see module docstring)."""

    def __init__(
        self, directory: Path | str, *, max_bytes: int = 2 * 1024**3, timeout_s: float = 10.0
    ) -> None:
        self.directory = Path(directory)
        self._cache = diskcache.Cache(
            str(self.directory),
            size_limit=max_bytes,
            eviction_policy="least-recently-stored",
            timeout=timeout_s,
        )
        self._encode = msgspec.msgpack.Encoder().encode
        self._record = msgspec.msgpack.Decoder(SemanticRecord)
        self._partition = msgspec.msgpack.Decoder(PartitionKey)
        self._known: set[str] = set()
        """Partition digests whose ``p/`` key this process has written."""

    def put(self, records: Sequence[SemanticRecord], *, now: float) -> int:
        """Store records (one transaction); already expired ones are skipped."""
        written = 0
        with self._cache.transact():
            for record in records:
                ttl = record.expires_at - now
                if ttl <= 0:
                    continue
                digest = record.partition.digest()
                if digest not in self._known:
                    self._cache.set(f"p/{digest}", self._encode(record.partition))
                    self._known.add(digest)
                self._cache.set(
                    f"r/{digest}/{record.payload_ref}", self._encode(record), expire=ttl
                )
                if record.observations:
                    self._cache.set(f"o/{digest}/{record.payload_ref}", b"", expire=ttl)
                written += 1
        return written

    def delete(self, partition: PartitionKey, payload_refs: Iterable[str]) -> None:
        digest = partition.digest()
        with self._cache.transact():
            for ref in payload_refs:
                self._cache.delete(f"r/{digest}/{ref}")
                self._cache.delete(f"o/{digest}/{ref}")

    def delete_partitions(self, predicate: Callable[[PartitionKey], bool]) -> int:
        """Delete every record of the partitions the predicate selects; returns how many."""
        doomed = {digest for digest, key in self.partitions().items() if predicate(key)}
        if not doomed:
            return 0
        keys = [k for k in self._record_keys() if k[0] in doomed]
        observed = [k for k in self._record_keys("o/") if k[0] in doomed]
        with self._cache.transact():
            for digest, ref in keys:
                self._cache.delete(f"r/{digest}/{ref}")
            for digest, ref in observed:
                self._cache.delete(f"o/{digest}/{ref}")
            for digest in doomed:
                self._cache.delete(f"p/{digest}")
                self._known.discard(digest)
        return len(keys)

    def partitions(self) -> dict[str, PartitionKey]:
        found: dict[str, PartitionKey] = {}
        for key in self._cache.iterkeys():
            if isinstance(key, str) and key.startswith("p/"):
                raw = self._cache.get(key)
                if isinstance(raw, bytes):
                    found[key[2:]] = self._partition.decode(raw)
        return found

    def refs(self) -> dict[str, set[str]]:
        """Payload refs of the stored records by partition digest (keys only; may include
        records that expired but were not culled yet, which ``get`` then misses)."""
        out: dict[str, set[str]] = {}
        for digest, ref in self._record_keys():
            out.setdefault(digest, set()).add(ref)
        return out

    def observed(self) -> list[tuple[str, str]]:
        """(partition digest, payload ref) of the records that hold observations."""
        return list(self._record_keys("o/"))

    def get_many(self, keys: Iterable[tuple[str, str]]) -> Iterator[SemanticRecord]:
        """The live records of (partition digest, payload ref) keys; missing ones skipped."""
        for digest, ref in keys:
            raw = self._cache.get(f"r/{digest}/{ref}")
            if not isinstance(raw, bytes):
                continue
            try:
                yield self._record.decode(raw)
            except msgspec.DecodeError:
                log.warning("semantic record %s/%s is unreadable; dropped", digest, ref)
                self._cache.delete(f"r/{digest}/{ref}")

    def cursor(self) -> str | None:
        value = self._cache.get(_CURSOR)
        return value if isinstance(value, str) else None

    def set_cursor(self, stream_id: str) -> None:
        self._cache.set(_CURSOR, stream_id)

    def __len__(self) -> int:
        return sum(1 for _ in self._record_keys())

    def close(self) -> None:
        self._cache.close()

    def _record_keys(self, prefix: str = "r/") -> Iterator[tuple[str, str]]:
        for key in self._cache.iterkeys():
            if isinstance(key, str) and key.startswith(prefix):
                digest, _, ref = key[len(prefix) :].partition("/")
                yield digest, ref
