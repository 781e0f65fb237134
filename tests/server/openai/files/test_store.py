"""The file store with an injected clock: tenant scoping and the retention period."""

from __future__ import annotations

from pathlib import Path

from server.openai.files.store import FileStore


async def test_files_are_scoped_by_tenant_and_expire_after_the_retention_period(
    tmp_path: Path,
) -> None:
    now = [1_000_000.0]
    files = FileStore(tmp_path, retention_s=3600.0, clock=lambda: now[0])
    upload = await files.create("t", "in.jsonl", "batch", b"{}\n")
    assert upload.expires_at == int(now[0] + 3600)
    assert await files.content("t", upload.id) == b"{}\n"
    assert await files.get("other", upload.id) is None
    assert await files.get("t", "../" + upload.id) is None
    now[0] += 3601
    assert await files.get("t", upload.id) is None
    assert await files.purge_expired() == 1
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # noqa: ASYNC240
