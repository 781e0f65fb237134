"""The image's and the compose file's configs load as the gateway loads them, and name the
services, paths and models the image and ``deploy/compose.yaml`` provide. (The image and the
compose topology themselves run in ``tests/deploy/test_image.py``, opt-in.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from backends.config import VllmBackendConfig
from semcache.policy import load_policy
from server.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
PREPARED = "/opt/semcache/models/smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMCACHE_API_TOKEN", "test")


@pytest.mark.parametrize(
    "path",
    [DEPLOY / "config" / "serve.toml", DEPLOY / "compose" / "config.toml"],
    ids=lambda p: p.parent.name,
)
def test_the_configs_load_and_serve_the_model_the_image_prepared(path: Path) -> None:
    config = load_config(path)
    assert config.data_path() == Path("/var/lib/semcache")
    assert config.server.host == "0.0.0.0"
    (vllm,) = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
    assert vllm.model_path == PREPARED
    assert {s.role for s in vllm.servers} == {"prefill", "decode"}
    assert [t.token_env for t in config.auth.tokens] == ["SEMCACHE_API_TOKEN"]


def test_the_image_prepares_what_its_configs_name() -> None:
    prepare = load_config(DEPLOY / "image" / "prepare.toml")
    assert prepare.data_path() / "models" / "smollm2-135m-instruct" == Path(PREPARED)
    containerfile = (DEPLOY / "Containerfile").read_text()
    assert "SEMCACHE_ENCODER_DIR=/opt/semcache/encoders" in containerfile
    assert str(prepare.encoder_path()) == "/opt/semcache/encoders"
    assert "COPY deploy/config/serve.toml /etc/semcache/config.toml" in containerfile


def test_the_compose_services_are_the_ones_the_configs_name() -> None:
    services = COMPOSE["services"]
    config = load_config(DEPLOY / "compose" / "config.toml")
    (vllm,) = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
    for server in vllm.servers:
        host = re.match(r"http://([^:]+):8000$", server.url)
        assert host and services[host.group(1)]["command"] == [server.role]
    policy = load_policy(DEPLOY / "compose" / "policy.toml")
    assert policy.tiers.redis.url is not None
    for url in (policy.tiers.redis.url, config.batch.queue.redis_url):
        for node in re.findall(r"(redis-\d+):6379", url):
            assert node in services
    redis = [name for name in services if re.fullmatch(r"redis-\d+", name)]
    assert len(redis) == 6  # three primaries, a replica each
    haproxy = (DEPLOY / "compose" / "haproxy.cfg").read_text()
    gateways = re.findall(r"server (\S+) \1:8080 check", haproxy)
    assert gateways == ["gateway-1", "gateway-2"]
    assert all(services[g]["command"] == ["gateway"] for g in gateways)
    for name in ("prefill", "decode", *gateways):
        mounts = services[name]["volumes"]
        assert "./compose/config.toml:/etc/semcache/config.toml:ro" in mounts
        assert services[name]["environment"]["SEMCACHE_API_TOKEN"] == "${SEMCACHE_API_TOKEN}"


def test_the_mounted_files_exist() -> None:
    for service in COMPOSE["services"].values():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert (DEPLOY / source).is_file(), source


def test_the_entrypoint_knows_every_role_it_documents() -> None:
    entrypoint = DEPLOY / "image" / "entrypoint.sh"
    assert subprocess.run(["bash", "-n", str(entrypoint)]).returncode == 0
    text = entrypoint.read_text()
    for role in ("serve", "gateway", "prefill", "decode", "health"):
        assert re.search(rf"^\s+{role}\b.*\)$|^\s+(\w+ \| )*{role}( \| \w+)*\)$", text, re.M), role
