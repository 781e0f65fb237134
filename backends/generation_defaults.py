"""The sampling defaults a vLLM server applies to the fields a request leaves out.

vLLM (``ModelConfig.get_diff_sampling_param``) fills an omitted temperature, top_p, top_k,
min_p, the three penalties and the chat default ``max_tokens`` from the model's
``generation_config.json`` (``max_new_tokens``), according to its ``--generation-config``
launch setting: ``auto`` (the default) reads the checkpoint's file, ``vllm`` ignores it, a
folder reads that folder's file; ``--override-generation-config`` (JSON) is applied on top
in every case. Without a ``generation_config.json`` the same fields of ``config.json`` count
(transformers' ``GenerationConfig.from_model_config``).

The file's values are taken as written (transformers 5 keeps every value a file sets; older
versions dropped those equal to their own defaults, such as ``top_k: 50``).

Everything here reads small files: call it where blocking is allowed (start-up).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import orjson

SAMPLING_FIELDS: Final = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
"""The generation-config fields vLLM turns into request defaults (``max_new_tokens`` becomes
``max_tokens``)."""


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = orjson.loads(path.read_bytes())
    return data if isinstance(data, dict) else {}


def generation_config(folder: Path) -> dict[str, Any]:
    """A checkpoint's generation config: ``generation_config.json``, else ``config.json``'s
    generation fields (top level first, then the decoder's text config)."""
    if (folder / "generation_config.json").is_file():
        return _json(folder / "generation_config.json")
    config = _json(folder / "config.json")
    found = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
    for name in ("decoder", "generator", "text_config"):
        sub = config.get(name)
        if isinstance(sub, dict):
            for k in SAMPLING_FIELDS:
                if k not in found and sub.get(k) is not None:
                    found[k] = sub[k]
            break
    return found


def sampling_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """The request defaults a generation config gives (vLLM's ``get_diff_sampling_param``)."""
    out = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def _flag(args: Sequence[str], name: str) -> str | None:
    """The last value of ``--name`` (dashes or underscores, ``--f v`` or ``--f=v``)."""
    spellings = {f"--{name}", f"--{name.replace('-', '_')}"}
    value: str | None = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in spellings:
            if eq:
                value = inline
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def launch_defaults(model_dir: Path | None, launch_args: Sequence[str] = ()) -> dict[str, Any]:
    """The defaults a server launched with ``launch_args`` for the checkpoint ``model_dir``
    applies (``model_dir`` ``None``: a checkpoint the gateway cannot read; only overrides)."""
    source = _flag(launch_args, "generation-config") or "auto"
    if source == "vllm":
        config: dict[str, Any] = {}
    elif source == "auto":
        config = generation_config(model_dir) if model_dir is not None else {}
    else:
        config = generation_config(Path(source).expanduser())
    override = _flag(launch_args, "override-generation-config")
    if override:
        extra = orjson.loads(override)
        if not isinstance(extra, dict):
            raise ValueError(f"--override-generation-config is not a JSON object: {override}")
        config.update(extra)
    return sampling_defaults(config)
