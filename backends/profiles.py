"""GPU launch profiles: validated vLLM flag sets for one pool (prefill, decode or monolithic).

A profile names the few engine options that decide how a pool uses its GPUs, checked before
anything starts, and turns them into ``vllm serve`` flags:

- ``kv_cache_dtype = "fp8"`` (or ``fp8_e4m3`` / ``fp8_e5m2``): the KV cache in FP8, about half
  the memory of bf16, so twice the tokens per GPU (``--kv-cache-dtype``). Prefill and decode
  of one P/D pair must use the same KV dtype: the blocks move between them as they are.
- ``quantization = "awq_marlin" | "gptq_marlin" | "awq" | "gptq"``: INT4 weights. The checkpoint
  must be an AWQ or GPTQ one (its ``config.json`` says which); the ``*_marlin`` kernels are the
  fast ones on recent NVIDIA GPUs.
- ``tensor_parallel_size``, ``pipeline_parallel_size``, ``data_parallel_size``,
  ``enable_expert_parallel``: parallelism. Expert parallelism needs an MoE model and more than
  one GPU (TP x DP > 1); TP must divide the number of attention heads, PP must not exceed the
  number of layers.
- ``gpu_memory_utilization``, ``max_num_seqs``, ``max_num_batched_tokens``: the usual knobs.

Which GPUs a server uses is its own business (``launch.env = { CUDA_VISIBLE_DEVICES = "0,1" }``).
The flag names are those of vLLM's own argument parser (a test feeds them to it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from foundation.config_types import Fraction, PosInt

KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
Int4Quantization = Literal["awq", "awq_marlin", "gptq", "gptq_marlin"]

_CHECKPOINT_FAMILY = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq"}
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class ProfileError(ValueError):
    """A launch profile that cannot work (for the model it is given, or at all)."""


class LaunchProfile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the servers of one pool use their accelerators (see the module docstring)."""

    kv_cache_dtype: KvCacheDtype = "auto"
    quantization: Int4Quantization | None = None
    tensor_parallel_size: PosInt = 1
    pipeline_parallel_size: PosInt = 1
    data_parallel_size: PosInt = 1
    enable_expert_parallel: bool = False
    gpu_memory_utilization: Fraction | None = None
    max_num_seqs: PosInt | None = None
    max_num_batched_tokens: PosInt | None = None

    def __post_init__(self) -> None:
        if self.enable_expert_parallel and self.tensor_parallel_size * self.data_parallel_size < 2:
            raise ProfileError(
                "enable_expert_parallel needs more than one GPU per pool "
                "(tensor_parallel_size x data_parallel_size > 1)"
            )

    @property
    def gpus_per_server(self) -> int:
        """GPUs one server of this profile occupies."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def flags(self) -> list[tuple[str, str | None]]:
        """``(flag, value)`` pairs for ``vllm serve`` (value None: a switch), defaults left out."""
        out: list[tuple[str, str | None]] = []
        if self.kv_cache_dtype != "auto":
            out.append(("--kv-cache-dtype", self.kv_cache_dtype))
        if self.quantization is not None:
            out.append(("--quantization", self.quantization))
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
        ):
            if value != 1:
                out.append((flag, str(value)))
        if self.enable_expert_parallel:
            out.append(("--enable-expert-parallel", None))
        if self.gpu_memory_utilization is not None:
            out.append(("--gpu-memory-utilization", str(self.gpu_memory_utilization)))
        if self.max_num_seqs is not None:
            out.append(("--max-num-seqs", str(self.max_num_seqs)))
        if self.max_num_batched_tokens is not None:
            out.append(("--max-num-batched-tokens", str(self.max_num_batched_tokens)))
        return out


def has_flag(args: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def merge_flags(args: list[str], flags: list[tuple[str, str | None]]) -> list[str]:
    """``args`` plus each flag it does not already name (explicit ``extra_args`` win)."""
    merged = list(args)
    for flag, value in flags:
        if has_flag(merged, flag):
            continue
        merged.append(flag)
        if value is not None:
            merged.append(value)
    return merged


def check_profile_for_model(profile: LaunchProfile, model_dir: Path) -> None:
    """Check a profile against a local HF checkpoint's ``config.json``; raise ProfileError.

    Done when the folder exists at config time; a model prepared later is checked by vLLM.
    """
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if profile.quantization is not None:
        quant = config.get("quantization_config") or {}
        method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
        wanted = _CHECKPOINT_FAMILY[profile.quantization]
        if method != wanted:
            raise ProfileError(
                f"quantization={profile.quantization!r} needs a {wanted.upper()} checkpoint; "
                f"{model_dir} is {method.upper() or 'not quantized'}"
            )
    heads = text.get("num_attention_heads")
    if isinstance(heads, int) and heads % profile.tensor_parallel_size:
        raise ProfileError(
            f"tensor_parallel_size={profile.tensor_parallel_size} does not divide the "
            f"{heads} attention heads of {model_dir}"
        )
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and profile.pipeline_parallel_size > layers:
        raise ProfileError(
            f"pipeline_parallel_size={profile.pipeline_parallel_size} exceeds the "
            f"{layers} layers of {model_dir}"
        )
    if profile.enable_expert_parallel and not any(text.get(key) for key in _MOE_KEYS):
        raise ProfileError(f"enable_expert_parallel needs an MoE model; {model_dir} has no experts")
