"""Chat templates a vLLM backend's config names (``chat_template``): a file, or one shipped
with the gateway (``builtin:NAME``, ``backends/data/chat_templates/NAME.jinja``).

A model's own template may not render tools: SmolLM2's (from its GGUF) renders each message
as ``<|im_start|>role\\ncontent<|im_end|>`` and nothing else, so a tool-calling request would
reach the model without its tools. A shipped template renders them in the format the model
was trained on and matches the tool-call parser the backend names (``tool_call_parser``).
Launched servers get it as ``--chat-template``; the cache keys' template fingerprint and KV
placement's rendering read the same text.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

from foundation.package_files import package_file

BUILTIN_PREFIX: Final = "builtin:"


def builtin_names() -> list[str]:
    """The templates shipped with the gateway."""
    folder = package_file("backends", "data", "chat_templates")
    return sorted(p.stem for p in folder.glob("*.jinja"))


def template_path(spec: str) -> Path:
    """The file a ``chat_template`` setting names; ValueError when there is none."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        path = package_file("backends", "data", "chat_templates", f"{name}.jinja")
        if not path.is_file():
            known = ", ".join(builtin_names())
            raise ValueError(f"no shipped chat template {name!r} (shipped: {known})")
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"chat template {spec!r}: no such file")
    return path


def template_fingerprint(text: str) -> str:
    """16 hex characters of a template's text (what ``backends.models`` reports for a
    model folder's own template)."""
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
