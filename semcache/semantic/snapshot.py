"""Snapshots of the semantic index: every partition's FAISS index and entries in one folder.

A snapshot folder holds ``manifest.json`` (the format, the index's ``version``, the partition
of each subfolder) and one subfolder per partition with ``index.faiss`` and ``entries.json``.
It is written beside the target and swapped in atomically. Reading reports a snapshot that
cannot be used as is (missing, other format or version, an unreadable partition) so that the
caller rebuilds those partitions from its durable records.

All functions are blocking (file I/O, FAISS).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import faiss as _faiss
import msgspec

from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import IndexKind, IndexSettings, Limits, PartitionState
from semcache.semantic.records import IndexEntry, PartitionKey

# FAISS's SWIG classes are typed loosely (and differ between CPU and GPU builds).
faiss: Any = _faiss

SNAPSHOT_FORMAT = 1


class StaleSnapshot(Exception):
    """A snapshot that cannot be used as is; the caller rebuilds from its records."""


class _Sidecar(msgspec.Struct, kw_only=True):
    format: int
    key: PartitionKey
    kind: IndexKind
    dimensions: int
    vectors: int
    next_id: int
    hidden: list[int]
    entries: list[IndexEntry]


class _Manifest(msgspec.Struct, kw_only=True):
    format: int
    version: str
    partitions: dict[str, PartitionKey]
    written_at: float


def write_partition(part: PartitionIndex, folder: Path) -> None:
    """Write ``index.faiss`` and ``entries.json`` into folder (which must exist)."""

    def save(index: Any, state: PartitionState) -> None:
        faiss.write_index(index, str(folder / "index.faiss"))
        sidecar = _Sidecar(
            format=SNAPSHOT_FORMAT,
            key=state.key,
            kind=state.kind,
            dimensions=part.dim,
            vectors=int(index.ntotal),
            next_id=state.next_id,
            hidden=state.hidden,
            entries=state.entries,
        )
        (folder / "entries.json").write_bytes(msgspec.json.encode(sidecar))

    part.export(save)


def read_partition(
    folder: Path, settings: IndexSettings, limits: Limits, now: float
) -> PartitionIndex:
    """Load a partition written by ``write_partition``; raises ``StaleSnapshot`` if unusable."""
    try:
        sidecar = msgspec.json.decode((folder / "entries.json").read_bytes(), type=_Sidecar)
    except (OSError, msgspec.DecodeError) as exc:
        raise StaleSnapshot(f"{folder}: {exc}") from exc
    if sidecar.format != SNAPSHOT_FORMAT or sidecar.dimensions != settings.dimensions:
        raise StaleSnapshot(f"{folder}: format or dimensions differ")
    try:
        index = faiss.read_index(str(folder / "index.faiss"))
    except RuntimeError as exc:
        raise StaleSnapshot(f"{folder}: {exc}") from exc
    if index.ntotal != sidecar.vectors or index.d != settings.dimensions:
        raise StaleSnapshot(f"{folder}: index and entries disagree")
    if not isinstance(index, faiss.IndexIDMap2):
        raise StaleSnapshot(f"{folder}: not an id-mapped index")
    state = PartitionState(
        key=sidecar.key,
        kind=sidecar.kind,
        next_id=sidecar.next_id,
        hidden=sidecar.hidden,
        entries=sidecar.entries,
    )
    return PartitionIndex.restore(index, state, settings, limits, now)


def write_snapshot(folder: Path | str, partitions: Iterable[PartitionIndex], version: str) -> None:
    """Write the partitions and a manifest to folder, replacing it atomically."""
    target = Path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".snapshot-", dir=target.parent))
    try:
        names: dict[str, PartitionKey] = {}
        for part in partitions:
            name = part.key.digest()
            (tmp / name).mkdir()
            write_partition(part, tmp / name)
            names[name] = part.key
        manifest = _Manifest(
            format=SNAPSHOT_FORMAT, version=version, partitions=names, written_at=time.time()
        )
        (tmp / "manifest.json").write_bytes(msgspec.json.encode(manifest))
        old = target.with_name(target.name + ".old")
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_snapshot(
    folder: Path | str,
    version: str,
    settings: IndexSettings,
    limits_for: Callable[[PartitionKey], Limits],
    now: float,
) -> tuple[dict[PartitionKey, PartitionIndex], str | None]:
    """The usable partitions of the snapshot in folder, and why (part of) it was not usable.

    A missing snapshot, or one of another format or ``version``, has no usable partitions;
    an unreadable partition is skipped (the reason names the last one skipped).
    """
    folder = Path(folder)
    stale_reason: str | None = None
    manifest: _Manifest | None = None
    try:
        manifest = msgspec.json.decode((folder / "manifest.json").read_bytes(), type=_Manifest)
    except FileNotFoundError:
        stale_reason = "no snapshot"
    except msgspec.DecodeError as exc:
        stale_reason = f"unreadable manifest: {exc}"
    if manifest is not None and (manifest.format != SNAPSHOT_FORMAT or manifest.version != version):
        stale_reason = (
            f"snapshot version {manifest.version!r}/{manifest.format} "
            f"!= {version!r}/{SNAPSHOT_FORMAT}"
        )
        manifest = None
    loaded: dict[PartitionKey, PartitionIndex] = {}
    if manifest is not None:
        for name, key in manifest.partitions.items():
            try:
                loaded[key] = read_partition(folder / name, settings, limits_for(key), now)
            except StaleSnapshot as exc:
                stale_reason = str(exc)
    return loaded, stale_reason
