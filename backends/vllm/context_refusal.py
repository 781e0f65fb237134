"""vLLM's 400 for a request its model's context cannot hold, read into numbers.

vLLM 0.32 words two such refusals (``vllm/renderers/params.py``):

- the prompt: "This model's maximum context length is 2048 tokens. However, your prompt
  contains [at least ]3000 input tokens, …" (its tokenizer stops one token past the context,
  so "at least"), or "… your prompt contains 90000 characters (more than …)" (too long to
  tokenize: no count);
- the output: "max_tokens=32000 cannot be greater than max_model_len=2048. …" (the request's
  own field name: ``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``).

Earlier versions' sentences are read too: "However, you requested 5000 tokens (4900 in the
messages, 100 in the completion)" and "'max_tokens' or 'max_completion_tokens' is too large:
3000. This model's maximum context length is 2048 tokens and your request has 100 input
tokens (3000 > 2048 - 100)".
"""

from __future__ import annotations

import re
from typing import Final, Literal, NamedTuple

import orjson

Kind = Literal["prompt", "output"]


class ContextRefusal(NamedTuple):
    """A request past the model's context: its ``prompt`` alone, or the ``output`` it asked
    for (``asked`` tokens, more than the context leaves)."""

    kind: Kind
    context: int
    """The model's context length (``max_model_len``)."""
    prompt: int | None = None
    """The prompt's tokens; ``None``: not counted (or not all of them, see ``exact``)."""
    asked: int | None = None
    """The output tokens the request asked for, when they were the refusal's cause."""
    exact: bool = True
    """``prompt`` is the whole count (vLLM stops counting one token past the context)."""


_CONTEXT = r"maximum context length is (?P<context>\d+) tokens"
_PROMPT: Final = re.compile(
    _CONTEXT + r"\. However, your prompt contains (?P<least>at least )?(?P<prompt>\d+) input tok"
)
_CHARACTERS: Final = re.compile(_CONTEXT + r"\. However, your prompt contains \d+ characters")
_REQUESTED: Final = re.compile(
    _CONTEXT + r"\. However, you requested \d+ tokens \((?P<prompt>\d+) in the \w+, "
    r"(?P<asked>\d+) in the completion\)"
)
_TOO_LARGE: Final = re.compile(
    r"is too large: (?P<asked>\d+)\. This model's " + _CONTEXT + r" and your request has "
    r"(?P<prompt>\d+) input tokens"
)
_GREATER: Final = re.compile(
    r"(?P<field>max_tokens|max_completion_tokens|max_output_tokens)=(?P<asked>\d+) cannot be "
    r"greater than max_model_len=(?P<context>\d+)"
)


def read_message(message: str) -> ContextRefusal | None:
    """The refusal a vLLM error message says, or ``None`` when it says another."""
    if m := _PROMPT.search(message):
        least = m.group("least") is not None
        return ContextRefusal("prompt", int(m["context"]), int(m["prompt"]), exact=not least)
    if m := _CHARACTERS.search(message):
        return ContextRefusal("prompt", int(m["context"]), exact=False)
    if m := _REQUESTED.search(message) or _TOO_LARGE.search(message):
        context, prompt, asked = int(m["context"]), int(m["prompt"]), int(m["asked"])
        if prompt > context:
            return ContextRefusal("prompt", context, prompt)
        return ContextRefusal("output", context, prompt, asked)
    if m := _GREATER.search(message):
        return ContextRefusal("output", int(m["context"]), asked=int(m["asked"]))
    return None


def context_refusal(status: int, body: bytes) -> ContextRefusal | None:
    """The refusal a vLLM error answer (a 400 in OpenAI's error shape) says, if it is one."""
    if status != 400 or b"max" not in body:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return read_message(message) if isinstance(message, str) else None
