"""Cache salts, launch profiles and the P/D parts of the backend config (no vLLM server)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import orjson
import pytest

from backends.config import VllmBackendConfig, VllmLaunch, VllmServer
from backends.fleet.salt import CacheSalter
from backends.launch.command import build_command
from backends.profiles import LaunchProfile, ProfileError, check_profile_for_model
from server.config import DEFAULT_CONFIG, load_config


def test_salts_are_keyed_stable_and_distinct() -> None:
    salter = CacheSalter(b"secret-1")
    a, b = salter.salt("key:aaaa"), salter.salt("key:bbbb")
    assert a == CacheSalter(b"secret-1").salt("key:aaaa")  # same key, same salt
    assert a != b
    assert a != CacheSalter(b"secret-2").salt("key:aaaa")  # unguessable without the key
    assert salter.salt(None) == salter.salt("anonymous")
    assert salter.salt("shared") not in (a, b)
    # vLLM accepts at most 128 characters and no '@', '/', '\\'
    assert len(a) == 32 and all(c in "0123456789abcdef" for c in a)


def test_salt_secret_from_env_then_config_else_random() -> None:
    config = VllmBackendConfig(name="m", served_model="m", cache_salt_secret="from-config")
    env = {"SEMCACHE_CACHE_SALT_SECRET": "from-env"}
    assert CacheSalter.from_config(config, env).salt("t") == CacheSalter(b"from-env").salt("t")
    assert CacheSalter.from_config(config, {}).salt("t") == CacheSalter(b"from-config").salt("t")
    bare = VllmBackendConfig(name="m", served_model="m")
    assert CacheSalter.from_config(bare, {}).salt("t") != CacheSalter.from_config(bare, {}).salt(
        "t"
    )


def pd_backend(**settings: object) -> VllmBackendConfig:
    data = {
        "name": "m",
        "served_model": "m",
        "servers": [
            {"url": "http://127.0.0.1:8100", "role": "prefill", "launch": {"cpu_cores": "0"}},
            {"url": "http://127.0.0.1:8101", "role": "decode", "launch": {"cpu_cores": "1"}},
        ],
        **settings,
    }
    return msgspec.convert(data, VllmBackendConfig)


def command(backend: VllmBackendConfig, index: int) -> list[str]:
    cmd, _ = build_command(
        model=Path("/m"),
        served_model="m",
        server=backend.servers[index],
        device="cuda",
        python="py",
    )
    return cmd


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_profiles_reach_the_launch_command_per_pool() -> None:
    backend = pd_backend(
        profiles={
            "prefill": {"kv_cache_dtype": "fp8", "tensor_parallel_size": 2},
            "decode": {"kv_cache_dtype": "fp8", "quantization": "awq_marlin", "max_num_seqs": 128},
        }
    )
    prefill, decode = command(backend, 0), command(backend, 1)
    assert flag(prefill, "--kv-cache-dtype") == "fp8"
    assert flag(prefill, "--tensor-parallel-size") == "2"
    assert "--quantization" not in prefill
    assert flag(decode, "--quantization") == "awq_marlin"
    assert flag(decode, "--max-num-seqs") == "128"
    assert "--tensor-parallel-size" not in decode
    # the role's NixlConnector config is still there
    assert orjson.loads(flag(decode, "--kv-transfer-config"))["kv_role"] == "kv_consumer"


def test_explicit_extra_args_win_over_the_profile() -> None:
    backend = VllmBackendConfig(
        name="m",
        served_model="m",
        servers=[
            VllmServer(
                url="http://127.0.0.1:8100",
                launch=VllmLaunch(extra_args=["--tensor-parallel-size", "4"]),
            )
        ],
        profiles={"both": LaunchProfile(tensor_parallel_size=2, kv_cache_dtype="fp8")},
    )
    cmd = command(backend, 0)
    assert cmd.count("--tensor-parallel-size") == 1
    assert flag(cmd, "--tensor-parallel-size") == "4"
    assert flag(cmd, "--kv-cache-dtype") == "fp8"


def test_example_connector_mode_configures_both_servers() -> None:
    backend = pd_backend(connector="example", shared_storage_path="/tmp/kv-test")
    for index in (0, 1):
        transfer = orjson.loads(flag(command(backend, index), "--kv-transfer-config"))
        assert transfer == {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv-test"},
        }


def test_the_kv_lease_is_explicit_and_bounds_the_handoff() -> None:
    backend = pd_backend(kv_lease_s=12)
    assert backend.handoff_deadline_s == 6  # half the lease by default
    assert pd_backend(kv_lease_s=12, handoff_bound_s=2.5).handoff_deadline_s == 2.5
    with pytest.raises(msgspec.ValidationError, match="at most half of kv_lease_s"):
        pd_backend(kv_lease_s=12, handoff_bound_s=6.5)
    with pytest.raises(msgspec.ValidationError, match="at most half of kv_lease_s=30"):
        pd_backend(handoff_bound_s=20)
    mine = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    decode = {"url": "http://127.0.0.1:8101", "role": "decode"}
    for extra, lease in (({}, None), ({"kv_lease_duration": 30}, 30)):
        transfer = orjson.dumps({**mine, "kv_connector_extra_config": extra}).decode()
        settings = {
            "servers": [
                {"url": "http://127.0.0.1:8100", "role": "prefill"},
                {**decode, "launch": {"extra_args": ["--kv-transfer-config", transfer]}},
            ],
            "kv_lease_s": 12,
        }
        with pytest.raises(msgspec.ValidationError, match=f"kv_lease_duration={lease}"):
            pd_backend(**settings)
    matching = orjson.dumps({**mine, "kv_connector_extra_config": {"kv_lease_duration": 12}})
    backend = pd_backend(
        servers=[
            {"url": "http://127.0.0.1:8100", "role": "prefill"},
            {**decode, "launch": {"extra_args": [f"--kv-transfer-config={matching.decode()}"]}},
        ],
        kv_lease_s=12,
    )
    assert backend.servers[1].launch is not None


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ([{"url": "http://h:1", "role": "prefill"}], "need decode servers"),
        (
            [{"url": "http://h:1", "role": "both"}, {"url": "http://h:2", "role": "decode"}],
            "monolithic or disaggregated",
        ),
        ([{"url": "http://h:1/"}, {"url": "http://h:1"}], "appears twice"),
    ],
)
def test_invalid_pools_are_refused(servers: list[dict[str, str]], message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert({"name": "m", "served_model": "m", "servers": servers}, VllmBackendConfig)


def test_invalid_profiles_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="more than one GPU"):
        msgspec.convert({"enable_expert_parallel": True}, LaunchProfile)
    with pytest.raises(msgspec.ValidationError, match="kv_cache_dtype"):
        msgspec.convert({"kv_cache_dtype": "int3"}, LaunchProfile)
    with pytest.raises(msgspec.ValidationError, match="tensor_parallel_size"):
        msgspec.convert({"tensor_parallel_size": 0}, LaunchProfile)
    with pytest.raises(msgspec.ValidationError, match="absent pool"):
        pd_backend(profiles={"both": {"kv_cache_dtype": "fp8"}})
    with pytest.raises(msgspec.ValidationError, match="same kv_cache_dtype"):
        pd_backend(profiles={"prefill": {"kv_cache_dtype": "fp8"}})
    with pytest.raises(msgspec.ValidationError, match="sees 1 GPU"):
        msgspec.convert(
            {
                "name": "m",
                "served_model": "m",
                "servers": [
                    {"url": "http://h:1", "launch": {"env": {"CUDA_VISIBLE_DEVICES": "3"}}}
                ],
                "profiles": {"both": {"tensor_parallel_size": 2}},
            },
            VllmBackendConfig,
        )


@pytest.mark.parametrize(
    "name", ["default.toml", "gpu-example.toml", "vllm-classifier-example.toml"]
)
def test_the_shipped_configs_are_valid(name: str) -> None:
    config = load_config(DEFAULT_CONFIG.parent / name)
    backends = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
    assert backends and all(b.servers for b in backends)
    for backend in backends:
        ports = [s.launch.nixl_side_channel_port for s in backend.servers if s.launch]
        assert len(set(ports)) == len(ports)


def write_checkpoint_config(folder: Path, **config: object) -> Path:
    """A model checkpoint folder holding just its Hugging Face ``config.json`` (not a gateway
    config: what launch profiles are checked against)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_profiles_are_checked_against_the_checkpoint(tmp_path: Path) -> None:
    dense = write_checkpoint_config(
        tmp_path / "dense", num_attention_heads=32, num_hidden_layers=16
    )
    awq = write_checkpoint_config(
        tmp_path / "awq", num_attention_heads=32, quantization_config={"quant_method": "awq"}
    )
    moe = write_checkpoint_config(tmp_path / "moe", num_attention_heads=32, num_local_experts=8)
    check_profile_for_model(LaunchProfile(quantization="awq_marlin"), awq)
    with pytest.raises(ProfileError, match="GPTQ checkpoint"):
        check_profile_for_model(LaunchProfile(quantization="gptq"), awq)
    with pytest.raises(ProfileError, match="not quantized"):
        check_profile_for_model(LaunchProfile(quantization="awq"), dense)
    with pytest.raises(ProfileError, match="does not divide"):
        check_profile_for_model(LaunchProfile(tensor_parallel_size=3), dense)
    with pytest.raises(ProfileError, match="exceeds"):
        check_profile_for_model(LaunchProfile(pipeline_parallel_size=32), dense)
    expert = LaunchProfile(tensor_parallel_size=2, enable_expert_parallel=True)
    check_profile_for_model(expert, moe)
    with pytest.raises(ProfileError, match="MoE"):
        check_profile_for_model(expert, dense)
    with pytest.raises(msgspec.ValidationError, match="GPTQ checkpoint"):
        pd_backend(model_path=str(awq), profiles={"decode": {"quantization": "gptq_marlin"}})


@pytest.mark.slow  # imports vLLM (~30-60 s on a loaded 2-core machine)
def test_every_profile_flag_is_accepted_by_vllms_own_parser() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    profile = LaunchProfile(
        kv_cache_dtype="fp8_e4m3",
        quantization="gptq_marlin",
        tensor_parallel_size=4,
        pipeline_parallel_size=2,
        data_parallel_size=2,
        enable_expert_parallel=True,
        gpu_memory_utilization=0.85,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
    )
    argv = ["--model", "m"]
    for name, value in profile.flags():
        argv += [name] if value is None else [name, value]
    args = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv)
    assert args.kv_cache_dtype == "fp8_e4m3"
    assert args.quantization == "gptq_marlin"
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (4, 2)
    assert args.data_parallel_size == 2 and args.enable_expert_parallel
    assert args.gpu_memory_utilization == 0.85
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (64, 8192)
