"""``semcache backends scale`` without vLLM: which pool, which launch settings, the records,
and a ``-1`` with nothing to stop. Starting a real server under load:
``test_live_pools_vllm.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.config import VllmBackendConfig, VllmLaunch, VllmServer
from backends.launch.scale import Scaled, ScaleRecords, new_server, pool_of
from backends.profiles import LaunchProfile
from server.cli import main


def backend(name: str = "tiny", **settings: object) -> VllmBackendConfig:
    return VllmBackendConfig(
        name=name,
        served_model="m",
        servers=[
            VllmServer(
                url="http://127.0.0.1:8001",
                role="prefill",
                launch=VllmLaunch(cpu_cores="0", kv_cache_gib=0.5, nixl_side_channel_port=5601),
            ),
            VllmServer(url="http://127.0.0.2:8002", role="decode"),
        ],
        **settings,  # type: ignore[arg-type]
    )


def test_the_pool_is_named_backend_slash_role_or_role_alone_with_one_backend() -> None:
    one, two = backend("a"), backend("b")
    assert pool_of([one], "prefill") == (one, "prefill")
    assert pool_of([one, two], "b/decode") == (two, "decode")
    with pytest.raises(ValueError, match="BACKEND/prefill"):
        pool_of([one, two], "prefill")
    with pytest.raises(ValueError, match="no vLLM backend 'c'"):
        pool_of([one, two], "c/prefill")
    with pytest.raises(ValueError, match="the role"):
        pool_of([one], "a/gpu")


def test_a_new_server_copies_the_pools_launch_on_fresh_ports_of_its_host() -> None:
    b = backend()
    template = b.servers[0]
    made = new_server(b, "prefill")
    assert made.url.startswith("http://127.0.0.1:")  # the host of the pool's launched server
    assert made.url != template.url and made.role == "prefill"
    assert made.launch is not None and template.launch is not None
    assert (made.launch.cpu_cores, made.launch.kv_cache_gib) == ("0", 0.5)
    assert made.launch.nixl_side_channel_port not in (None, 5601)


def test_a_pool_without_a_launched_server_gets_the_defaults_and_its_profile() -> None:
    b = backend(profiles={"decode": LaunchProfile(tensor_parallel_size=2)})
    made = new_server(b, "decode")
    assert made.url.startswith("http://127.0.0.1:")  # none launched here: this host
    assert made.launch is not None
    assert "--tensor-parallel-size" in made.launch.extra_args
    assert made.launch.nixl_side_channel_port is not None


def test_records_keep_the_order_of_the_servers_started(tmp_path: Path) -> None:
    records = ScaleRecords(tmp_path, "tiny", "prefill")
    assert records.read() == []
    first = Scaled("http://127.0.0.1:1", 11, 1.0, "a.log")
    second = Scaled("http://127.0.0.1:2", 12, 2.0, "b.log")
    records.add(first)
    records.add(second)
    assert records.read() == [first, second]
    records.remove(first.url)
    assert records.read() == [second]


def test_scale_down_with_nothing_started_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'data_dir = "{tmp_path}"\n'
        '[[models]]\nid = "m"\nbackend = "tiny"\n'
        '[[backends]]\nkind = "vllm"\nname = "tiny"\nserved_model = "m"\n'
        '[[backends.servers]]\nurl = "http://127.0.0.1:9"\nrole = "decode"\n'
    )
    argv = ["backends", "scale", "tiny/decode", "-1", "--config", str(config), "--token", "t"]
    assert main([*argv, "--url", "http://127.0.0.1:9"]) == 1
    assert "no server of tiny/decode was started by `scale +1`" in capsys.readouterr().err
    argv = ["backends", "scale", "tiny/gpu", "+1", "--config", str(config), "--token", "t"]
    assert main(argv) == 1
    assert "the role is both, prefill or decode" in capsys.readouterr().err
