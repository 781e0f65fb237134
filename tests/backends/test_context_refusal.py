"""vLLM's refusals of a request past its model's context, read into numbers: its own
sentences (the installed vLLM's, where it raises them), earlier versions', and others left."""

from __future__ import annotations

import orjson
import pytest

from backends.vllm.context_refusal import ContextRefusal, context_refusal, read_message


def answer(message: str, status: int = 400) -> tuple[int, bytes]:
    """vLLM's error answer carrying ``message``."""
    error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    return status, orjson.dumps({"error": error})


@pytest.mark.parametrize(
    ("message", "read"),
    [
        (
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "3000 input tokens, which exceeds this limit even without any output tokens.",
            ContextRefusal("prompt", 2048, 3000),
        ),
        (
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "at least 2049 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            ContextRefusal("prompt", 2048, 2049, exact=False),
        ),
        (
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "90000 characters (more than 81920 characters, which is the upper bound for 2048 "
            "input tokens). Please reduce the length of the input prompt.",
            ContextRefusal("prompt", 2048, exact=False),
        ),
        (
            "max_tokens=32000 cannot be greater than max_model_len=2048. Please request fewer "
            "output tokens. (parameter=max_tokens, value=32000)",
            ContextRefusal("output", 2048, asked=32000),
        ),
        (
            "max_completion_tokens=5000 cannot be greater than max_model_len=4096.",
            ContextRefusal("output", 4096, asked=5000),
        ),
        (  # vLLM before 0.10
            "This model's maximum context length is 4096 tokens. However, you requested 5000 "
            "tokens (4900 in the messages, 100 in the completion). Please reduce the length of "
            "the messages or completion.",
            ContextRefusal("prompt", 4096, 4900),
        ),
        (
            "This model's maximum context length is 4096 tokens. However, you requested 5000 "
            "tokens (3000 in the messages, 2000 in the completion).",
            ContextRefusal("output", 4096, 3000, 2000),
        ),
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 3000. This model's maximum "
            "context length is 2048 tokens and your request has 100 input tokens "
            "(3000 > 2048 - 100).",
            ContextRefusal("output", 2048, 100, 3000),
        ),
    ],
)
def test_each_sentence_is_read(message: str, read: ContextRefusal) -> None:
    assert read_message(message) == read
    assert context_refusal(*answer(message)) == read


@pytest.mark.parametrize(
    "message",
    [
        "truncate_prompt_tokens=5000 cannot be greater than max_model_len = 2048. Please ...",
        "temperature must be non-negative, got -1.",
        "The model `x` does not exist.",
    ],
)
def test_other_refusals_are_not_limits(message: str) -> None:
    assert read_message(message) is None
    assert context_refusal(*answer(message)) is None


def test_only_a_400_in_openai_shape_is_read() -> None:
    message = "max_tokens=32000 cannot be greater than max_model_len=2048."
    assert context_refusal(*answer(message, status=500)) is None
    assert context_refusal(400, b"max_tokens: not json") is None
    assert context_refusal(400, orjson.dumps({"message": message})) is None
    assert context_refusal(400, orjson.dumps(["max"])) is None


def test_the_installed_vllms_own_sentences_are_read() -> None:
    params = pytest.importorskip("vllm.renderers.params")
    errors = pytest.importorskip("vllm.exceptions")
    with pytest.raises(errors.VLLMValidationError) as output:
        params.TokenizeParams(
            max_total_tokens=2048,
            max_output_tokens=32000,
            max_output_tokens_param="max_tokens",
            max_total_tokens_param="max_model_len",
        )
    assert read_message(str(output.value)) == ContextRefusal("output", 2048, asked=32000)
    limits = params.TokenizeParams(max_total_tokens=2048, max_output_tokens=16)
    with pytest.raises(errors.VLLMValidationError) as prompt:
        limits._token_len_check(None, list(range(2049)))
    assert read_message(str(prompt.value)) == ContextRefusal("prompt", 2048, 2049, exact=False)
    with pytest.raises(errors.VLLMValidationError) as exact:
        limits._token_len_check(None, list(range(3000)))
    assert read_message(str(exact.value)) == ContextRefusal("prompt", 2048, 3000)
