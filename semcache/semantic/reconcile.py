"""A semantic index restored from its snapshot and reconciled with the durable records.

The records are the truth: a snapshot entry without a record (evicted, purged or removed
after the snapshot was written) is dropped, a record the snapshot lacks (written after it,
or no usable snapshot at all) is added, oldest first, so ``max_entries`` evicts the same
entries it would have. Partitions and records of another matcher version (a retrained
verifier) are dropped for good.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from semcache.semantic.index import LoadReport, SemanticIndex
from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import Limits
from semcache.semantic.records import PartitionKey
from semcache.semantic.store import RecordStore


def reconcile(
    index: SemanticIndex,
    store: RecordStore,
    folder: Path,
    limits_for: Callable[[PartitionKey], Limits],
    now: float,
    matcher: str,
) -> LoadReport:
    """Load ``folder``'s snapshot into ``index``, then make it match ``store`` (blocking)."""
    report = index.load(folder, (), limits_for=limits_for, now=now)
    store.delete_partitions(lambda key: key.matcher != matcher)
    index.remove_partitions(lambda key: key.matcher != matcher)
    durable = store.refs()
    by_digest = {key.digest(): key for key in index.keys()}
    for digest, key in by_digest.items():
        part = index.get(key)
        if part is None:
            continue
        keep = durable.get(digest, set())
        doomed = [ref for ref in part.payload_refs() if ref not in keep]
        if doomed:
            report.dropped += part.remove_refs(doomed, now=now)
    missing: list[tuple[str, str]] = []
    for digest, stored in durable.items():
        known = by_digest.get(digest)
        found = index.get(known) if known is not None else None
        missing.extend((digest, ref) for ref in stored if found is None or not found.has_ref(ref))
    # Observations judged after the snapshot was written: merged into its entries.
    observed = [
        (digest, ref)
        for digest, ref in store.observed()
        if (holder := _holder(index, by_digest.get(digest))) is not None and holder.has_ref(ref)
    ]
    if observed:
        index.add_records(store.get_many(observed), now=now)
    records = [r for r in store.get_many(missing) if r.partition.matcher == matcher]
    records.sort(key=lambda r: r.created_at)
    rebuilt = {r.partition for r in records} - set(by_digest.values())
    for key in {r.partition for r in records}:
        index.partition(key, limits_for(key))
    report.records_added = index.add_records(records, now=now, progress="semantic cache: restoring")
    report.rebuilt = len(rebuilt)
    for key, evicted in index.drain_evicted().items():
        store.delete(key, evicted)
    index.remove_partitions(lambda key: (p := index.get(key)) is None or not len(p))
    return report


def _holder(index: SemanticIndex, key: PartitionKey | None) -> PartitionIndex | None:
    return index.get(key) if key is not None else None
