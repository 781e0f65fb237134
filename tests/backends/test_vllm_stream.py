"""The look at a stream's first event that decides whether the decode hop is retried."""

from __future__ import annotations

import pytest

from backends.vllm.stream import is_server_error_event


@pytest.mark.parametrize(
    ("head", "failed"),
    [
        (b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n', False),
        (b'data: {"error":{"message":"KV pull failed","code":500}}\n\n', True),
        (b'data: {"error":{"message":"odd","code":"x"}}\n\n', True),  # no status: a failure
        (b'data: {"error":{"message":"too long","code":400}}\n\n', False),  # relayed as is
        (b"data: not json\n\n", False),
        (b": keep-alive\n\n", False),
        (b'data: {"error":{"message":"cut","code":503}}', True),  # the stream ended there
    ],
)
def test_only_a_server_error_event_fails_the_hop(head: bytes, failed: bool) -> None:
    assert is_server_error_event(head) is failed
