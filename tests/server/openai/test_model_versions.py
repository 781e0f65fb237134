"""A cache key changes whenever the backend's answer can: the model's own sampling defaults
(its ``generation_config.json`` as the launch setting reads it) and the model behind a
remote server. Through the app ``create_app`` builds, against a local fake vLLM server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from litestar.testing import TestClient

from backends.config import VllmBackendConfig, VllmLaunch, VllmServer
from harness.fake_vllm import FakeVllm
from server.app import create_app
from server.config import GatewayConfig, ModelEntry


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    server = FakeVllm()
    server.start()
    yield server
    server.stop()


def checkpoint(folder: Path, generation: dict[str, Any] | None) -> Path:
    folder.mkdir()
    (folder / "config.json").write_bytes(orjson.dumps({"model_type": "llama"}))
    if generation is not None:
        (folder / "generation_config.json").write_bytes(orjson.dumps(generation))
    return folder


def config(tmp_path: Path, url: str, **backend: Any) -> GatewayConfig:
    return GatewayConfig(
        data_dir=str(tmp_path / "data"),
        models=[ModelEntry(id="chat", backend="b")],
        backends=[
            VllmBackendConfig(
                name="b",
                served_model="m",
                servers=[VllmServer(url=url)],
                scrape_metrics=False,
                **backend,
            )
        ],
    )


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "seed": 7, **extra}


@pytest.mark.parametrize(
    ("generation", "launch_args", "shared"),
    [
        ({"temperature": 0.6, "top_p": 0.9}, [], False),  # the checkpoint's defaults apply
        ({"temperature": 0.6}, ["--generation-config", "vllm"], True),  # ignored at launch
        ({"temperature": 1.0}, [], True),  # the checkpoint's default is OpenAI's
        (None, [], True),  # no generation config
        (None, ["--override-generation-config", '{"temperature": 0.2}'], False),
    ],
)
def test_omitted_temperature_and_openai_default_share_a_key_only_when_defaults_match(
    fake: FakeVllm,
    tmp_path: Path,
    generation: dict[str, Any] | None,
    launch_args: list[str],
    shared: bool,
) -> None:
    folder = checkpoint(tmp_path / "ckpt", generation)
    # a launched server; nothing is started here (the app only reads its launch settings)
    server = VllmServer(url=fake.url, launch=VllmLaunch(extra_args=launch_args))
    cfg = config(tmp_path, fake.url, model_path=str(folder))
    cfg.backends[0].servers = [server]  # type: ignore[union-attr]
    with TestClient(create_app(cfg)) as client:
        first = client.post("/v1/chat/completions", json=chat())
        again = client.post("/v1/chat/completions", json=chat())
        spelled = client.post("/v1/chat/completions", json=chat(temperature=1))
    assert first.status_code == again.status_code == spelled.status_code == 200
    assert again.headers["cf-aig-cache-status"] == "HIT"
    same_key = first.headers["x-semcache-key"] == spelled.headers["x-semcache-key"]
    assert same_key is shared
    assert (spelled.headers["cf-aig-cache-status"] == "HIT") is shared
    assert fake.calls == (1 if shared else 2)


@pytest.mark.parametrize("pinned", [None, "v1"])
def test_a_model_swapped_behind_a_remote_server_serves_no_old_answer(
    fake: FakeVllm, tmp_path: Path, pinned: str | None
) -> None:
    # no model_path: the revision is what the server reports, unless the config pins one
    cfg = config(tmp_path, fake.url, revision=pinned, health_interval_s=3600)
    with TestClient(create_app(cfg)) as client:
        before = client.post("/v1/chat/completions", json=chat())
        assert (
            client.post("/v1/chat/completions", json=chat()).headers["cf-aig-cache-status"] == "HIT"
        )
        fake.root = "/models/b"  # the server restarted on other weights, same served name
        assert client.get("/ready").status_code == 200  # a health check round, now
        after = client.post("/v1/chat/completions", json=chat())
        again = client.post("/v1/chat/completions", json=chat())
    old = before.json()["choices"][0]["message"]["content"]
    new = after.json()["choices"][0]["message"]["content"]
    if pinned is None:
        assert after.headers["cf-aig-cache-status"] == "MISS" and new != old
        assert after.headers["x-semcache-key"] != before.headers["x-semcache-key"]
        assert again.headers["cf-aig-cache-status"] == "HIT"
        assert again.json()["choices"][0]["message"]["content"] == new
        assert fake.calls == 2
    else:  # the operator's pin wins: same key, the stored answer
        assert after.headers["cf-aig-cache-status"] == "HIT" and new == old
        assert fake.calls == 1
