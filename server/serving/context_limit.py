"""A request past its model's context, as each API says it.

The gateway learns it before vLLM (a request's own ``max_tokens`` above the model's
``max_model_len``) or from vLLM's 400 (``backends.vllm.context_refusal``); either way the answer
is a 400 in the route's own words, never cached:

- OpenAI: a prompt past the context is ``invalid_request_error`` with ``code``
  ``context_length_exceeded`` and ``param`` the prompt's field (``messages``, ``prompt``,
  ``input``), in OpenAI's sentence ("Input tokens exceed the configured limit of …"):
  LangChain's ``ContextOverflowError`` reads the code, or that sentence where the SDK's
  exception text carries only the message (openai 3); an output past the context is
  OpenAI's "max_tokens is too large" (``invalid_value``, ``param`` the field), the model's
  output ceiling being its context here.
- Anthropic: "prompt is too long: N tokens > M maximum", and for an output past the context
  "input length and `max_tokens` exceed context limit: N + K > M, …", the sentences Claude
  Code and LangChain read (the first to compact the conversation, the second to retry with a
  smaller ``max_tokens``).
- Workers AI: its envelope, with a sentence naming both numbers.
"""

from __future__ import annotations

from typing import Final

from backends.vllm.context_refusal import ContextRefusal
from server.errors import ANTHROPIC, WORKERS_AI, ApiError

PROMPT_FIELDS: Final = {"chat": "messages", "completions": "prompt", "responses": "input"}
"""Per route, the field that holds the prompt (OpenAI's ``param`` of a prompt too long)."""


def limit_error(route: str, field: str, model: str, refusal: ContextRefusal) -> ApiError:
    """The 400 for ``refusal`` on ``route``: ``field`` is the request's output bound
    (``max_tokens``, …), ``model`` the model as the gateway names it."""
    context, prompt, asked = refusal.context, refusal.prompt, refusal.asked
    if refusal.kind == "prompt" or asked is None:
        return _prompt_error(route, context, prompt, refusal.exact)
    return ApiError(
        400,
        f"{field} is too large: {asked}. This model supports at most {context} completion "
        f"tokens, whereas you provided {asked}.",
        param=field,
        code="invalid_value",
        type="invalid_request_error",
        wording={
            ANTHROPIC: (
                f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > "
                f"{context}, decrease input length or `max_tokens` and try again"
                if prompt is not None
                else f"max_tokens: {asked} > {context}, which is the maximum allowed number "
                f"of output tokens for {model}"
            ),
            WORKERS_AI: (
                f"max_tokens ({asked}) exceeds this model's context window limit "
                f"({context} tokens); ask for fewer."
            ),
        },
    )


def _prompt_error(route: str, context: int, prompt: int | None, exact: bool) -> ApiError:
    noun = PROMPT_FIELDS.get(route, "prompt")
    if prompt is None:
        tokens = f"more than {context}"
    else:
        tokens = str(prompt) if exact else f"at least {prompt}"
    # Anthropic's sentence always carries a number: the smallest it may be when uncounted.
    counted = prompt if prompt is not None else context + 1
    return ApiError(
        400,
        f"Input tokens exceed the configured limit of {context} tokens. Your {noun} "
        f"resulted in {tokens} tokens. Please reduce the length of the {noun}.",
        param=noun,
        code="context_length_exceeded",
        type="invalid_request_error",
        wording={
            ANTHROPIC: f"prompt is too long: {counted} tokens > {context} maximum",
            WORKERS_AI: (
                f"The input ({tokens} tokens) exceeds this model's context window limit "
                f"({context} tokens); shorten the prompt."
            ),
        },
    )
