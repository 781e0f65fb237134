"""Stored entries: sealed to their key, rejected when damaged; only complete streams recorded."""

from __future__ import annotations

import pytest

from foundation.sse import MEDIA_TYPE, SSEReader
from semcache.entry import (
    CHECKSUM_BYTES,
    CachedAnswer,
    IntegrityError,
    ResponsesRecorder,
    StreamRecorder,
    Usage,
    decode_entry,
    encode_entry,
)
from tests.semcache import payloads

DIGEST = "ab" * 32
OTHER = "cd" * 32


def sample() -> CachedAnswer:
    answer = CachedAnswer.from_json(payloads.chat_json(), model_id="qwen3-0.6b")
    answer.created_at, answer.ttl_s, answer.swr_s = 1_700_000_000.5, 60, 10
    answer.tags, answer.epochs = ("faq",), {"tag:faq": 2}
    return answer


def test_from_json_reads_usage() -> None:
    answer = CachedAnswer.from_json(payloads.chat_json(prompt_tokens=14, completion_tokens=8))
    assert answer.usage == Usage(14, 8)
    assert CachedAnswer.from_json(payloads.embeddings_json()).usage == Usage(4, 0)
    assert CachedAnswer.from_json(b"not json").usage == Usage()


def test_from_json_reads_the_responses_api_usage_names() -> None:
    body = b'{"object":"response","usage":{"input_tokens":5,"output_tokens":2,"total_tokens":7}}'
    assert CachedAnswer.from_json(body).usage == Usage(5, 2)


def test_round_trip() -> None:
    entry = sample()
    assert decode_entry(encode_entry(entry, DIGEST), DIGEST) == entry


def test_every_flipped_byte_is_detected() -> None:
    blob = bytearray(encode_entry(sample(), DIGEST))
    for i in range(0, len(blob), max(1, len(blob) // 40)):
        damaged = bytearray(blob)
        damaged[i] ^= 0x01
        with pytest.raises(IntegrityError):
            decode_entry(bytes(damaged), DIGEST)


def test_entry_is_bound_to_its_key() -> None:
    with pytest.raises(IntegrityError):
        decode_entry(encode_entry(sample(), DIGEST), OTHER)


def test_truncated_entry_is_rejected() -> None:
    blob = encode_entry(sample(), DIGEST)
    for cut in (0, CHECKSUM_BYTES, len(blob) - 1):
        with pytest.raises(IntegrityError):
            decode_entry(blob[:cut], DIGEST)


def test_complete_stream_is_recorded_with_usage() -> None:
    rec = StreamRecorder("qwen3-0.6b")
    rec.feed_many([*payloads.chat_stream(), b"[DONE]"])
    answer = rec.answer()
    assert answer is not None and answer.content_type == MEDIA_TYPE
    assert answer.chunks == payloads.chat_stream()
    assert answer.usage == Usage(14, 8)


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(payloads.chat_stream()[:-2], id="cut before finish"),
        pytest.param([*payloads.chat_stream()[:-2], b"[DONE]"], id="done without finish"),
        pytest.param(payloads.chat_stream(), id="no [DONE]"),
        pytest.param(
            [*payloads.chat_stream()[:2], b'{"error": {"message": "engine dead"}}', b"[DONE]"],
            id="error chunk",
        ),
        pytest.param([*payloads.chat_stream()[:2], b"{not json", b"[DONE]"], id="garbage"),
        pytest.param([b"[DONE]"], id="empty"),
        pytest.param(
            [*payloads.chat_stream(), b"[DONE]", payloads.chat_stream()[1]], id="data after [DONE]"
        ),
    ],
)
def test_incomplete_streams_are_not_recorded(stream: list[bytes]) -> None:
    rec = StreamRecorder()
    rec.feed_many(stream)
    assert not rec.complete
    assert rec.answer() is None


def blocks_of(events: list[bytes]) -> list[bytes]:
    return SSEReader().feed_events(b"".join(events))


def test_a_complete_responses_stream_is_recorded_block_for_block() -> None:
    rec = ResponsesRecorder("qwen3-0.6b")
    blocks = blocks_of(payloads.responses_stream())
    for block in blocks:
        rec.feed(block)
    answer = rec.answer()
    assert answer is not None and answer.chunks == blocks
    assert answer.usage == Usage(25, 2)  # from the completed response's usage


ERROR = b'event: error\ndata: {"type":"error","message":"engine dead","sequence_number":2}\n\n'
FAILED = b'event: response.failed\ndata: {"type":"response.failed","response":{}}\n\n'


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(payloads.responses_stream()[:-1], id="no response.completed"),
        pytest.param([*payloads.responses_stream()[:2], ERROR], id="error event"),
        pytest.param([*payloads.responses_stream()[:2], FAILED], id="response.failed"),
        pytest.param(
            [*payloads.responses_stream()[:2], b'data: {"error": {"message": "cut"}}\n\n'],
            id="the gateway's broken-stream event",
        ),
        pytest.param(
            [*payloads.responses_stream(), payloads.responses_stream()[2]],
            id="an event after response.completed",
        ),
        pytest.param(
            [
                *payloads.responses_stream()[:-1],
                b"event: response.completed\ndata: {not json\n\n",
            ],
            id="garbage completed event",
        ),
    ],
)
def test_incomplete_responses_streams_are_not_recorded(stream: list[bytes]) -> None:
    rec = ResponsesRecorder()
    for block in blocks_of(stream):
        rec.feed(block)
    assert not rec.complete and rec.answer() is None


ODD_PAYLOADS = [
    b'{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}',
    b'{"choices":[{"index":1,"delta":{},"finish_reason":"stop"}],"usage":null}',
    b'{"choices":[{"delta":{"content":"no index"}}]}',
    b'{"choices":[{"index":null,"finish_reason":"length"}]}',
    b'{"choices":[{"index":"2","finish_reason":"stop"}]}',
    b'{"choices":[{"index":true,"finish_reason":"stop"}]}',
    b'{"choices":[{"index":1.0,"finish_reason":"stop"}]}',
    b'{"choices":["not a dict",{"index":3,"finish_reason":"stop"}]}',
    b'{"choices":{"index":0}}',
    b'{"choices":"abc"}',
    b'{"choices":0}',
    b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}',
    b'{"choices":[],"usage":{"prompt_tokens":"4","completion_tokens":true}}',
    b'{"choices":[],"usage":[1,2]}',
    b'{"choices":[],"usage":0}',
    b'{"error":null}',
    b'{"error":{"message":"boom"},"choices":[]}',
    b'[{"choices":[]}]',
    b'"text"',
    b"not json",
    b'{"choices":[{"index":0,"finish_reason":"stop"}]',
    b'  {"choices":[{"index":0,"finish_reason":"stop"}]}  ',
    b"[DONE]",
    b'{"choices":[{"index":0,"finish_reason":"stop"}]}',
]


@pytest.mark.parametrize("start", range(len(ODD_PAYLOADS)))
def test_recorder_reads_every_shape_like_the_general_reading(start: int) -> None:
    """The struct-decoding fast path records exactly what reading each chunk as a
    dict does, whatever the chunk holds."""
    sequence = ODD_PAYLOADS[start:] + ODD_PAYLOADS[:start]
    fast, general = StreamRecorder(), StreamRecorder()
    for payload in sequence:
        fast.feed(payload)
        data = payload.strip()
        if data == b"[DONE]":
            general.done = True
        elif general.done or general.failed:
            general.failed = True
        else:
            general._feed_doc(data)
        state = [
            (r.chunks, r._open, r._finished, r.usage, r.done, r.failed, r.complete)
            for r in (fast, general)
        ]
        assert state[0] == state[1], payload
    for payload in ODD_PAYLOADS[:-2]:
        one, other = StreamRecorder(), StreamRecorder()
        one.feed(payload)
        other._feed_doc(payload.strip())
        assert (one.chunks, one._open, one._finished, one.usage, one.failed) == (
            other.chunks,
            other._open,
            other._finished,
            other.usage,
            other.failed,
        ), payload
