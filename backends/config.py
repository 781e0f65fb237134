"""Declarative description of the backends a gateway talks to (validated once at load)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec
import orjson

from backends.chat_templates import template_path
from backends.kv_settings import KvSettings, PlacementPolicy
from backends.profiles import LaunchProfile, check_profile_for_model, merge_flags
from foundation.config_types import NonNegInt, PosFloat, PosInt, Unit

ServerRole = Literal["both", "prefill", "decode"]
VllmTask = Literal["generate", "classify"]
ConnectorMode = Literal["nixl", "example"]


class VllmLaunch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How `semcache serve` / `semcache backends up` starts one vLLM server itself."""

    cpu_cores: str | None = None
    """Cores to pin the server's OpenMP threads to on CPU (``VLLM_CPU_OMP_THREADS_BIND``)."""
    kv_cache_gib: float = 1.0
    block_size: int | None = None
    max_model_len: int | None = 2048
    enforce_eager: bool = True
    extra_args: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    nixl_side_channel_port: int | None = None
    nixl_progress_delay_us: NonNegInt = 20000
    """Longest sleep of a prefill/decode server's NIXL progress thread: it wakes when UCX
    signals work, else after this long (0: nixl's default, which never sleeps and keeps a
    core busy). See ``backends/launch/nixl_progress.py``."""
    gloo_shared_device: bool = True
    """Give the server's single-rank torch.distributed gloo groups one device (one idle
    ``gloo_tcp_loop`` thread instead of one per group, each waking every 10 ms). See
    ``backends/launch/gloo_device.py``."""
    amx: bool = False
    """On a CPU with AMX: let vLLM pick its AMX kernels (and ask Linux for the tile registers
    they need). Off, vLLM runs the AVX-512 kernels: its AMX attention gave wrong answers on a
    prefill/decode pair where this was checked. See ``backends/launch/amx.py``."""


class VllmServer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One vLLM OpenAI-protocol server."""

    url: str
    role: ServerRole = "both"
    launch: VllmLaunch | None = None
    """Present when the gateway starts this server itself; absent for a server run elsewhere."""
    max_inflight: PosInt | None = None
    """This server's concurrency limit; default: the backend's ``max_inflight_per_server``."""
    kv_events: str | None = None
    """The server's KV events PUB socket, ``tcp://HOST:PORT`` (``placement = "kv"``). A
    launched server is started publishing on that port."""
    kv_events_replay: str | None = None
    """Its replay socket, ``tcp://HOST:PORT``, to fill gaps (optional)."""


class VllmBackendConfig(
    msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="kind", tag="vllm"
):
    """A pool of vLLM servers serving one model."""

    name: str
    served_model: str
    """The model name vLLM answers to (``--served-model-name``)."""
    task: VllmTask = "generate"
    """``generate``: chat/completions (and vLLM's own embeddings); ``classify``: a
    sequence-classification model served at vLLM's ``/classify`` (launched servers get
    ``--runner pooling``); it backs models with ``task = "classification"``.
    A classify backend is monolithic (``role = "both"`` servers only)."""
    model_path: str | None = None
    """HF folder of the weights; ``prepared:NAME`` names a model the gateway prepares itself."""
    revision: str | None = None
    """A pinned revision (part of every cache key of the backend's models). By default a hash
    of the files under ``model_path``; without a ``model_path``, what the servers report of
    the model (``backends.fleet.remote_revision``, re-read by every health check)."""
    tool_call_parser: str | None = None
    """vLLM's tool-call parser for the model (``hermes``, ``xlam``, ``llama3_json``, …: one that
    reads the tool-call format its chat template teaches): launched servers get
    ``--enable-auto-tool-choice --tool-call-parser NAME``, so ``tools`` with ``tool_choice``
    ``auto``, ``required`` or a named function work. Servers run elsewhere need the same flags."""
    chat_template: str | None = None
    """A chat template to use instead of the model's own (``--chat-template`` for launched
    servers): a ``.jinja`` file, or ``builtin:NAME`` for one shipped with the gateway
    (``backends.chat_templates``). The cache keys' template fingerprint is this file's."""
    servers: list[VllmServer] = msgspec.field(default_factory=list)
    """``role = "both"`` servers form a monolithic pool; ``prefill`` + ``decode`` servers a
    disaggregated one (any number of each). A backend is one or the other."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    """Longest wait for the next bytes of an answer (the first included)."""
    max_connections: int = 256

    # -- disaggregated prefill/decode
    connector: ConnectorMode = "nixl"
    """How prefill hands its KV to decode: ``nixl`` (vLLM's NixlConnector: the decode server
    pulls the blocks the prefill answer names) or ``example`` (vLLM's ExampleConnector: KV files
    under ``shared_storage_path``; a debugging connector that ignores ``cache_salt``)."""
    shared_storage_path: str | None = None
    """ExampleConnector's folder; default ``$TMPDIR/semcache-kv-<name>``."""
    prefill_threshold_tokens: NonNegInt = 256
    """The prefill hop runs only for prompts with at least this many tokens to compute: with
    KV placement, the tokens the chosen decode server does not hold (its KV events say which);
    without it, the prompt's estimated length. 256: the break-even measured on a CPU with
    SmolLM2 (``bench/pd_selective.py``): the most uncached tokens a decode server prefills
    itself while its streams keep inter-token gaps under 250 ms."""
    prefill_timeout_s: PosFloat = 120.0
    """A prefill hop slower than this is given up; decode then computes the prompt alone."""
    decode_attempts: PosInt = 2
    """Decode servers tried for one request when one fails before the first byte."""
    kv_lease_s: PosInt = 30
    """NixlConnector's KV lease (vLLM's ``kv_lease_duration``): a prefill server frees a
    request's KV blocks when no decode server has read them within it, and a later read gets
    whatever the blocks hold by then. Written into every launched prefill/decode server's
    ``--kv-transfer-config``; servers run elsewhere must be started with the same value."""
    handoff_bound_s: PosFloat | None = None
    """Longest KV hand-off: from the prefill answer to the decode server's first byte (for a
    JSON answer: the whole answer). Past it the decode attempt is abandoned and decode computes
    the prompt alone, so no answer is built from blocks whose lease may have run out. At most
    half of ``kv_lease_s`` (the default), leaving the rest for the prefill answer's way back."""

    # -- placement
    chars_per_token: PosFloat = 4.0
    """Prompt-size estimate without a tokenizer: rendered characters per token."""
    prefix_tokens: PosInt = 256
    """Prefix-aware placement hashes about this many leading prompt tokens (rendered text)."""
    prefix_load_slack: NonNegInt = 2
    """A prefix's preferred server is skipped when it runs this many more requests than the
    least busy one (bounded-load placement)."""
    placement: PlacementPolicy | None = None
    """``kv`` (the blocks each server reports holding, weighed against load; see ``kv``),
    ``prefix-hash`` (a hash of the estimated prompt prefix), ``least-loaded``,
    ``round-robin``. Default: ``kv`` when every server publishes its KV events (``kv_events``;
    the shipped config's launched servers do), else ``prefix-hash``."""
    kv: KvSettings = msgspec.field(default_factory=KvSettings)

    # -- admission and health
    max_inflight_per_server: PosInt = 64
    """Requests one server runs at once (per-server ``max_inflight`` overrides it)."""
    max_queue: NonNegInt = 256
    """Requests that may wait for a free server per pool; past it the gateway answers 429."""
    queue_timeout_s: PosFloat = 30.0
    """Longest wait in that queue before a 429."""
    retry_after_s: PosInt = 1
    """``Retry-After`` of a 429 (overloaded)."""
    hold_above_waiting: NonNegInt | None = None
    """Dispatch gate: a server whose vLLM reports more waiting requests than this
    (``vllm:num_requests_waiting``; 0: any) takes no new request, which waits in the
    gateway's fair queue instead (``backends.fleet.dispatch_gate``; needs ``scrape_metrics``, and
    reacts within one ``health_interval_s``). Default: off."""
    hold_above_kv_usage: Unit | None = None
    """Dispatch gate: a server whose KV cache usage (``vllm:kv_cache_usage_perc``, 0..1) is
    above this takes no new request. Default: off."""
    health_interval_s: PosFloat = 5.0
    """Period of the ``/health`` checks that eject and re-admit servers (also the 503
    ``Retry-After`` when every server is down). A server is ejected when it refuses a
    connection, or fails three checks in a row without answering a request in between."""
    health_timeout_s: PosFloat = 5.0
    scrape_metrics: bool = True
    """Copy the servers' own ``vllm:`` prefix-cache/KV counters into the gateway's /metrics."""
    scrape_idle_interval_s: PosFloat = 60.0
    """A server whose scraped page stood still over its last scrape, and that the gateway has
    sent nothing since, is scraped again only this often (a health check still runs every
    ``health_interval_s``). Set it to ``health_interval_s`` for servers that other clients
    also use."""

    # -- tenant isolation inside vLLM
    cache_salt: bool = True
    """Send vLLM a ``cache_salt`` derived from the request's salt scope (tenant or shared)."""
    cache_salt_secret: str | None = None
    """Key of the salt hash. ``cache_salt_secret_env`` wins; with neither, a random key per
    process (salts then change on restart and differ between gateways)."""
    cache_salt_secret_env: str | None = "SEMCACHE_CACHE_SALT_SECRET"

    # -- launch profiles (GPU)
    profiles: dict[ServerRole, LaunchProfile] = msgspec.field(default_factory=dict)
    """Per pool (``prefill``, ``decode``, ``both``): flags added to the launched servers."""

    def __post_init__(self) -> None:
        roles = {s.role for s in self.servers}
        if "both" in roles and roles & {"prefill", "decode"}:
            raise ValueError(
                f"backend {self.name!r}: mixes role 'both' with prefill/decode servers; "
                "a backend is either monolithic or disaggregated"
            )
        if self.task == "classify" and roles - {"both"}:
            raise ValueError(
                f"backend {self.name!r}: a classify backend has no prefill/decode servers"
            )
        if "prefill" in roles and "decode" not in roles:
            raise ValueError(f"backend {self.name!r}: prefill servers need decode servers")
        urls = [s.url.rstrip("/") for s in self.servers]
        if len(set(urls)) != len(urls):
            raise ValueError(f"backend {self.name!r}: a server url appears twice")
        if self.chat_template is not None:
            template_path(self.chat_template)  # a ValueError naming the missing file
        model_dir = Path(self.model_path) if self.model_path else None
        for role, profile in self.profiles.items():
            if model_dir is not None and model_dir.is_dir():
                check_profile_for_model(profile, model_dir)
            if role not in roles and self.servers:
                raise ValueError(f"backend {self.name!r}: profile for absent pool {role!r}")
        if self.handoff_bound_s is not None and self.handoff_bound_s > self.kv_lease_s / 2:
            raise ValueError(
                f"backend {self.name!r}: handoff_bound_s={self.handoff_bound_s:g} must be at "
                f"most half of kv_lease_s={self.kv_lease_s} (a hand-off must end well inside "
                "the prefill's KV lease)"
            )
        prefill, decode = self.profiles.get("prefill"), self.profiles.get("decode")
        if (prefill.kv_cache_dtype if prefill else "auto") != (
            decode.kv_cache_dtype if decode else "auto"
        ):
            raise ValueError(
                f"backend {self.name!r}: prefill and decode need the same kv_cache_dtype "
                "(KV blocks move between them as they are)"
            )
        if self.placement is None:
            events = bool(self.servers) and all(s.kv_events for s in self.servers)
            self.placement = "kv" if events else "prefix-hash"
        if self.placement == "kv" and not any(s.kv_events for s in self.servers):
            raise ValueError(
                f"backend {self.name!r}: placement 'kv' needs its servers' kv_events endpoints"
            )
        for server in self.servers:
            if server.launch is not None:
                self._check_gpus(server)
                self._check_lease(server.launch.extra_args)
                server.launch = self.launch_with_profile(server)

    @property
    def handoff_deadline_s(self) -> float:
        """``handoff_bound_s``, or half the KV lease."""
        return self.handoff_bound_s if self.handoff_bound_s is not None else self.kv_lease_s / 2

    def _check_lease(self, extra_args: list[str]) -> None:
        """A NixlConnector ``--kv-transfer-config`` in ``extra_args`` must name our lease."""
        transfer = kv_transfer_config(extra_args)
        if transfer is None or transfer.get("kv_connector") != "NixlConnector":
            return
        extra = transfer.get("kv_connector_extra_config") or {}
        lease = extra.get("kv_lease_duration") if isinstance(extra, dict) else None
        if lease != self.kv_lease_s:
            raise ValueError(
                f"backend {self.name!r}: the --kv-transfer-config in extra_args sets "
                f"kv_lease_duration={lease!r}; it must be kv_lease_s={self.kv_lease_s} "
                "(the hand-off bound is derived from it)"
            )

    def _check_gpus(self, server: VllmServer) -> None:
        profile = self.profiles.get(server.role)
        visible = (server.launch.env if server.launch else {}).get("CUDA_VISIBLE_DEVICES")
        if profile is None or not visible:
            return
        count = len([gpu for gpu in visible.split(",") if gpu.strip()])
        if count != profile.gpus_per_server:
            raise ValueError(
                f"backend {self.name!r}: server {server.url} sees {count} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={visible}) but its {server.role} profile uses "
                f"{profile.gpus_per_server} (tensor x pipeline x data parallel)"
            )

    def storage_path(self) -> str:
        """ExampleConnector's shared folder (config or a per-backend temp folder)."""
        if self.shared_storage_path:
            return os.path.expanduser(self.shared_storage_path)
        return str(Path(tempfile.gettempdir()) / f"semcache-kv-{self.name}")

    def launch_with_profile(self, server: VllmServer) -> VllmLaunch:
        """The server's launch options plus its pool's profile and connector flags."""
        assert server.launch is not None
        flags: list[tuple[str, str | None]] = []
        profile = self.profiles.get(server.role)
        if profile is not None:
            flags += profile.flags()
        if self.task == "classify":
            # vLLM resolves ``--convert auto`` to classify for *ForSequenceClassification
            # checkpoints; a causal LM to be converted needs ``--convert classify`` in extra_args.
            flags.append(("--runner", "pooling"))
        if self.connector == "example" and server.role != "both":
            transfer = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": self.storage_path()},
            }
            flags.append(("--kv-transfer-config", orjson.dumps(transfer).decode()))
        if server.kv_events:
            flags += self.kv.launch_flags(server.kv_events, server.kv_events_replay)
        if self.tool_call_parser is not None:
            flags += [
                ("--enable-auto-tool-choice", None),
                ("--tool-call-parser", self.tool_call_parser),
            ]
        if self.chat_template is not None:
            flags.append(("--chat-template", str(template_path(self.chat_template))))
        extra = merge_flags(server.launch.extra_args, flags)
        return msgspec.structs.replace(server.launch, extra_args=extra)


def kv_transfer_config(args: list[str]) -> dict[str, Any] | None:
    """The JSON of a ``--kv-transfer-config`` flag in ``args`` (None when absent)."""
    for i, arg in enumerate(args):
        if arg.startswith("--kv-transfer-config="):
            raw = arg.partition("=")[2]
        elif arg == "--kv-transfer-config" and i + 1 < len(args):
            raw = args[i + 1]
        else:
            continue
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {raw!r}") from exc
        return parsed if isinstance(parsed, dict) else None
    return None


class LocalEmbeddingConfig(
    msgspec.Struct,
    forbid_unknown_fields=True,
    kw_only=True,
    tag_field="kind",
    tag="local-embeddings",
):
    """A sentence-transformers model run in the gateway's own process."""

    name: str
    model_path: str
    """A folder, or ``package:NAME`` for a model shipped inside a Python package."""
    revision: str | None = None
    max_batch_size: int = 64
    normalize: bool = True
    runtime: Literal["auto", "torch", "onnx"] | None = None
    """What runs the model: ``onnx`` (ONNX Runtime, same vectors, faster on a CPU),
    ``torch``, or ``auto`` (ONNX when its graph reproduces torch's vectors). Unset:
    ``SEMCACHE_ENCODER_RUNTIME``, else ``auto``."""


class EmbeddedClassifierConfig(
    msgspec.Struct,
    forbid_unknown_fields=True,
    kw_only=True,
    tag_field="kind",
    tag="embedded-classifier",
):
    """The embedded text classifier (a linear head over the semantic cache's encoder)."""

    name: str
    head_path: str | None = None
    """The head's JSON file; default: the shipped sentiment head
    (``backends/local/data/classifier``)."""
    revision: str | None = None
    """Explicit revision; by default the head's and the encoder's versions."""


BackendConfig = VllmBackendConfig | LocalEmbeddingConfig | EmbeddedClassifierConfig
