"""The stored answer: what replay needs and nothing more, sealed with a checksum.

Wire format of a stored entry (lower tiers, which hold bytes)::

    checksum (16 bytes) || msgpack(CachedAnswer)

where ``checksum = blake2b(payload, key=key digest, digest_size=16)``. The checksum covers
every byte of the payload (answer bytes and metadata) and binds it to the key it is stored
under: a corrupted value, or a value copied under another key, fails the check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Final

import msgspec
import orjson

from foundation import sse
from semcache.cache_keys import CacheKey

CHECKSUM_BYTES: Final = 16
JSON: Final = "application/json"


class IntegrityError(Exception):
    """A stored entry does not match its checksum or cannot be decoded."""


class Usage(msgspec.Struct, frozen=True, array_like=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class CachedAnswer(msgspec.Struct, kw_only=True, dict=True):
    """One complete backend answer, either a JSON body or the SSE ``data:`` payloads of a stream.

    The cache fills ``created_at``, ``ttl_s``, ``swr_s``, ``tags`` and ``epochs`` when it
    stores the answer; a fill function only sets the answer fields. An entry is not changed
    once stored (the cache makes a new one); ``dict=True`` lets :func:`entry_tag` keep its
    validator beside it, never encoded.
    """

    status: int = 200
    content_type: str = JSON
    body: bytes | None = None
    """The JSON body of a non-stream answer."""
    chunks: list[bytes] | None = None
    """The ``data:`` payloads of a stream, in order, usage chunk included, ``[DONE]`` excluded;
    for a Responses API stream, its whole event blocks (``event:`` and ``data:`` lines)."""
    usage: Usage = Usage()
    model_id: str = ""
    created_at: float = 0.0
    ttl_s: int = 0
    swr_s: int = 0
    tags: tuple[str, ...] = ()
    epochs: dict[str, int] = msgspec.field(default_factory=dict)
    """Purge epochs of the entry's tag and key fields when it was filled (non-zero ones)."""
    key: CacheKey | None = None
    """The key it is stored under: its scope, model, revision and purge epochs, so an entry
    found by its digest alone can be checked (``ExactCache.lookup_digest``)."""
    route: str = ""
    """The route that stored it (``chat``, ``embeddings``...), to replay it by digest."""

    @property
    def is_stream(self) -> bool:
        return self.chunks is not None

    @property
    def payload_bytes(self) -> int:
        """Size of the answer bytes (body or chunks)."""
        if self.chunks is not None:
            return sum(len(c) for c in self.chunks)
        return len(self.body or b"")

    def memory_size(self) -> int:
        """Rough in-memory footprint, used by the memory tier's byte bound."""
        n = 200 + self.payload_bytes + len(self.model_id) + sum(len(t) + 50 for t in self.tags)
        if self.key is not None:
            n += 400
        if self.chunks is not None:
            n += 40 * len(self.chunks)
        return n

    @classmethod
    def from_json(
        cls, body: bytes, *, model_id: str = "", status: int = 200, content_type: str = JSON
    ) -> CachedAnswer:
        """An answer from a non-stream JSON body; usage is read from its ``usage`` object."""
        usage = Usage()
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict):
            usage = usage_of(doc.get("usage"))
        return cls(
            status=status, content_type=content_type, body=body, usage=usage, model_id=model_id
        )


def usage_of(u: Any) -> Usage:
    """``Usage`` from an OpenAI usage object (embeddings have no completion tokens; the
    Responses API names them ``input_tokens`` and ``output_tokens``)."""
    if not isinstance(u, dict):
        return Usage()
    p = u.get("prompt_tokens", u.get("input_tokens"))
    c = u.get("completion_tokens", u.get("output_tokens"))
    return Usage(
        prompt_tokens=p if isinstance(p, int) else 0,
        completion_tokens=c if isinstance(c, int) else 0,
    )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CachedAnswer)


def checksum(payload: bytes | memoryview, digest: str) -> bytes:
    """blake2b of ``payload`` keyed with the key digest."""
    return hashlib.blake2b(
        payload, key=bytes.fromhex(digest)[:64], digest_size=CHECKSUM_BYTES
    ).digest()


def entry_tag(answer: CachedAnswer, digest: str) -> str:
    """The checksum an entry is sealed with (hex): a validator of the stored answer.

    Any change to the answer or its metadata (a refill, a purge epoch it records) or to its
    key (purge epochs, revision) gives another tag. Computed once per entry object and key
    (the memory tier hands out the same object for every hit).
    """
    kept = answer.__dict__.get(_TAG)
    if kept is not None and kept[0] == digest:
        return kept[1]
    tag = checksum(_encoder.encode(answer), digest).hex()
    answer.__dict__[_TAG] = (digest, tag)
    return tag


_TAG: Final = "_semcache_tag"


def encode_entry(answer: CachedAnswer, digest: str) -> bytes:
    """Serialise an entry for a byte tier, sealed to ``digest``."""
    payload = _encoder.encode(answer)
    return checksum(payload, digest) + payload


def decode_entry(blob: bytes, digest: str) -> CachedAnswer:
    """Check and decode an entry read from a byte tier; raise :class:`IntegrityError` if bad."""
    if len(blob) <= CHECKSUM_BYTES:
        raise IntegrityError("entry too short")
    payload = memoryview(blob)[CHECKSUM_BYTES:]
    if checksum(payload, digest) != blob[:CHECKSUM_BYTES]:
        raise IntegrityError("checksum mismatch")
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # a valid checksum over bytes of an older format
        raise IntegrityError(f"undecodable entry: {exc}") from None


class _Choice(msgspec.Struct):
    index: int = 0
    finish_reason: Any = None


class _Chunk(msgspec.Struct):
    """What :class:`StreamRecorder` reads of a chunk; a chunk that does not fit these types
    is read by the general path instead."""

    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = msgspec.UNSET


_chunk_decoder = msgspec.json.Decoder(_Chunk)


class StreamRecorder:
    """Collects the ``data:`` payloads of a backend stream and says whether it is complete.

    A stream is complete when ``[DONE]`` arrived, no error chunk was seen and every choice
    got a ``finish_reason``. Only a complete stream becomes a :class:`CachedAnswer`; one that
    ends early (backend killed, client gone, error chunk) gives ``None``.
    """

    def __init__(self, model_id: str = "") -> None:
        self.model_id = model_id
        self.chunks: list[bytes] = []
        self.done = False
        self.failed = False
        self._open: set[int] = set()
        self._finished: set[int] = set()
        self.usage = Usage()

    def feed(self, payload: bytes) -> None:
        """Record one SSE ``data:`` payload (without the ``data: `` prefix)."""
        data = payload.strip()
        if data == sse.DONE:
            self.done = True
            return
        if self.done or self.failed:
            self.failed = True
            return
        try:
            # Only the fields this needs, into structs: no dicts built for the content.
            chunk = _chunk_decoder.decode(data)
        except msgspec.DecodeError:  # not JSON, or an unusual shape: the general reading
            self._feed_doc(data)
            return
        if chunk.error is not msgspec.UNSET:
            self.failed = True
            return
        for choice in chunk.choices or ():
            self._open.add(choice.index)
            if choice.finish_reason is not None:
                self._finished.add(choice.index)
        if chunk.usage:
            self.usage = usage_of(chunk.usage)
        self.chunks.append(bytes(data))

    def _feed_doc(self, data: bytes) -> None:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.failed = True
            return
        if not isinstance(doc, dict) or "error" in doc:
            self.failed = True
            return
        for choice in doc.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            idx = choice.get("index", 0)
            self._open.add(idx)
            if choice.get("finish_reason") is not None:
                self._finished.add(idx)
        if doc.get("usage"):
            self.usage = usage_of(doc["usage"])
        self.chunks.append(bytes(data))

    def feed_many(self, payloads: Iterable[bytes]) -> None:
        for p in payloads:
            self.feed(p)

    @property
    def complete(self) -> bool:
        return self.done and not self.failed and bool(self._open) and self._open <= self._finished

    def answer(self) -> CachedAnswer | None:
        """The recorded answer, or ``None`` when the stream is not complete."""
        if not self.complete:
            return None
        return CachedAnswer(
            content_type=sse.MEDIA_TYPE,
            chunks=list(self.chunks),
            usage=self.usage,
            model_id=self.model_id,
        )


class _Completed(msgspec.Struct):
    response: dict[str, Any] = msgspec.field(default_factory=dict)


_completed_decoder = msgspec.json.Decoder(_Completed)
COMPLETED: Final = b"response.completed"


class ResponsesRecorder:
    """Collects the event blocks of a Responses API stream and says whether it is complete.

    A stream is complete when its last event is ``response.completed`` and no ``error``,
    ``response.failed`` or ``response.incomplete`` event came before it. Only a complete
    stream becomes a :class:`CachedAnswer` (its blocks, replayed byte for byte).
    """

    def __init__(self, model_id: str = "") -> None:
        self.model_id = model_id
        self.blocks: list[bytes] = []
        self.completed = False
        self.failed = False
        self.usage = Usage()

    def feed(self, block: bytes) -> None:
        """Record one event block (``event:`` and ``data:`` lines)."""
        if self.completed or self.failed:
            self.failed = True  # nothing may follow the terminal event
            return
        name, data = sse.parse_block(block)
        if name == COMPLETED and data is not None:
            try:
                self.usage = usage_of(_completed_decoder.decode(data).response.get("usage"))
            except msgspec.DecodeError:
                self.failed = True
                return
            self.completed = True
        elif name is None or name == b"error" or name in sse.TERMINAL_EVENTS:
            self.failed = True
            return
        self.blocks.append(bytes(block))

    @property
    def complete(self) -> bool:
        return self.completed and not self.failed

    def answer(self) -> CachedAnswer | None:
        """The recorded answer, or ``None`` when the stream is not complete."""
        if not self.complete:
            return None
        return CachedAnswer(
            content_type=sse.MEDIA_TYPE,
            chunks=list(self.blocks),
            usage=self.usage,
            model_id=self.model_id,
        )
