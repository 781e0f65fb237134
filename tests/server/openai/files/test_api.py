"""``POST /v1/files``: the upload's own size limit replaces the gateway's body limit."""

from __future__ import annotations

from pathlib import Path

from litestar.testing import TestClient

from backends.registry import ModelRegistry
from server.app import create_app
from server.batch.settings import BatchSettings, FilesSettings
from server.config import GatewayConfig, ServerSettings

AUTH = {"authorization": "Bearer key"}


def test_uploads_are_limited_by_the_files_limit_not_the_body_limit(tmp_path: Path) -> None:
    config = GatewayConfig(
        data_dir=str(tmp_path),
        server=ServerSettings(max_body_bytes=64 * 1024),
        batch=BatchSettings(files=FilesSettings(max_bytes=1_000_000)),
    )
    with TestClient(create_app(config, registry=ModelRegistry())) as http:
        form = {"purpose": "batch"}
        r = http.post(
            "/v1/files", files={"file": ("a.jsonl", b"x" * 900_000)}, data=form, headers=AUTH
        )
        assert r.status_code == 200 and r.json()["bytes"] == 900_000
        r = http.post(
            "/v1/files", files={"file": ("a.jsonl", b"x" * 1_200_000)}, data=form, headers=AUTH
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
        r = http.post("/v1/chat/completions", content=b"x" * 100_000, headers=AUTH)
        assert r.status_code == 413  # the other routes keep the gateway's limit
        r = http.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data=form)
        assert r.status_code == 401
