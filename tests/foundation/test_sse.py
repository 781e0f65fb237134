"""The SSE reader on both kinds of OpenAI streams: bare ``data:`` chunks ending in
``[DONE]``, and the Responses API's named events ending in a terminal event."""

from __future__ import annotations

from foundation.sse import SSEReader, parse_block
from tests.semcache import payloads


def test_named_events_are_read_in_any_chunking() -> None:
    raw = b"".join(payloads.responses_stream())
    whole = SSEReader()
    blocks = whole.feed_events(raw)
    assert [block + b"\n\n" for block in blocks] == payloads.responses_stream()
    assert whole.done
    assert whole.usage() == {"input_tokens": 25, "output_tokens": 2, "total_tokens": 27}
    split = SSEReader()
    assert [p for i in range(0, len(raw), 7) for p in split.feed(raw[i : i + 7])] == [
        parse_block(b)[1] for b in blocks
    ]
    assert split.done and split.payloads == whole.payloads


def test_a_responses_stream_is_done_only_on_its_terminal_event() -> None:
    cut = SSEReader()
    cut.feed(b"".join(payloads.responses_stream()[:-1]))
    assert not cut.done
    chat = SSEReader()
    chat.feed(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')
    assert chat.done


def test_parse_block() -> None:
    assert parse_block(b"event: x\ndata: {}") == (b"x", b"{}")
    assert parse_block(b"data: a\ndata: b") == (None, b"a\nb")
    assert parse_block(b": comment") == (None, None)
