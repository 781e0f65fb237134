"""A stream through the exact cache: replay a stored answer, or relay a live one while
recording it, and end the cache's flight with what was recorded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from backends.interfaces import BackendError, UpstreamStream
from foundation import tracing as spans
from foundation.sse import MEDIA_TYPE, SSEReader
from semcache import replay
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheResult, CacheStatus, Flight
from server.errors import ApiError
from server.guard.stream import StreamGuard
from server.http.reply import SSE_HEADERS, ClosingStream, Reply
from server.serving.cache_headers import result_headers, status_headers
from server.serving.call import GenerationCall
from server.serving.core import ServingCore
from server.serving.output_limit import noted_item
from server.serving.semantic_chat import Remember
from server.serving.stream_format import StreamFormat, stream_format
from server.serving.stream_relay import answer_stream, broken_stream_event, guard_event, replayed
from server.serving.usage_notes import note_result, note_uncached


async def refusal(up: UpstreamStream) -> CachedAnswer | None:
    """vLLM's answer when it refused to stream (any status but 200), else ``None``."""
    if up.status == 200:
        return None
    return CachedAnswer.from_json(await up.read_all(), status=up.status)


class LiveAnswer:
    """A leader's open backend stream and the future its relay settles with the recorded
    answer (``None``: incomplete, or the client left), which the cache's fill returns."""

    __slots__ = ("recorded", "upstream")

    def __init__(
        self, upstream: UpstreamStream, recorded: asyncio.Future[CachedAnswer | None]
    ) -> None:
        self.upstream = upstream
        self.recorded = recorded

    def settle(self, answer: CachedAnswer | None) -> None:
        if not self.recorded.done():
            self.recorded.set_result(answer)

    async def abandon(self) -> None:
        """The response is over: store nothing unless settled, release the backend's stream."""
        self.settle(None)
        await self.upstream.aclose()


class CachedStreams:
    """Answers ``stream: true`` generation requests through the exact cache."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self._background: set[asyncio.Task[None]] = set()

    async def reply(
        self,
        call: GenerationCall,
        creq: CacheRequest,
        body: dict[str, Any],
        remember: Remember | None = None,
    ) -> Reply:
        """A stream through the cache: replay a stored answer, or relay and record a live one.

        The route's stream format says how events are read, recorded and framed. The backend
        is always asked for the usage (so the stored answer knows its tokens); a client that
        did not ask for it does not get it. A miss is led from the request's own task: it
        opens the backend's stream at once (no hop through another task, so concurrent
        requests reach vLLM as each is handled), its response relays the stream, recording
        it, and the recorded answer ends the cache's flight.
        """
        assert self.core.cache is not None
        include_usage = replay.wants_usage(call.upstream)
        form = stream_format(call.route)
        live_body = form.live_body(call.upstream)

        async def refresh() -> CachedAnswer | None:
            # stale-while-revalidate, in the background: no response relays it
            up = await self._open_stream(call, live_body)
            refused = await refusal(up)
            if refused is not None:
                return refused
            return await self._record(call, up, form, await answer_stream(call))

        got = await self.core.cache.claim(creq, refresh)
        if isinstance(got, CacheResult):
            self.core.answered(call.ctx, creq, got, call.info, body)
            return self._replayed_reply(call, creq, got, include_usage, form)
        flight = got
        try:
            up = await self._open_stream(call, live_body)
            refused = await refusal(up)
        except BaseException as exc:
            flight.fail(exc)
            raise
        if refused is not None:  # handed to coalesced waiters, never stored
            await flight.finish(refused)
            return Reply(refused.status, refused.body or b"")
        try:
            inspected = await answer_stream(call)
        except BaseException as exc:
            await up.aclose()
            flight.fail(exc)
            raise
        live = LiveAnswer(up, asyncio.get_running_loop().create_future())
        self._land_when_recorded(flight, live, remember)
        status = CacheStatus.BYPASS if creq.control.bypass_read else CacheStatus.MISS
        note_uncached(call.ctx.usage, bypass=status is CacheStatus.BYPASS)
        headers = {**SSE_HEADERS, **status_headers(status, creq.key.short_id)}
        relay = ClosingStream(self._live(call, live, include_usage, form, inspected), live.abandon)
        return Reply(200, stream=relay, media_type=MEDIA_TYPE, headers=headers)

    async def _open_stream(self, call: GenerationCall, body: dict[str, Any]) -> UpstreamStream:
        self.core.announce(call.backend.name, call.ctx)
        try:
            return await call.backend.open_stream(call.path, body, call.ctx)
        except BackendError as exc:
            call.backend_failed(exc.kind)
            raise

    def _replayed_reply(
        self,
        call: GenerationCall,
        creq: CacheRequest,
        res: CacheResult,
        include_usage: bool,
        form: StreamFormat,
    ) -> Reply:
        """A stream answered by the cache: a hit, or another request's (coalesced) answer."""
        entry = res.entry
        if entry is None:
            raise BackendError("broken", "the backend gave no complete answer")
        if entry.status != 200:
            return Reply(entry.status, entry.body or b"")
        note_result(call.ctx.usage, res)
        return replayed_reply(entry, res, creq, include_usage, form)

    def _land_when_recorded(
        self, flight: Flight, live: LiveAnswer, remember: Remember | None
    ) -> None:
        """End the flight with what the relay recorded (``None``: nothing is stored), in the
        background; then index a stored answer in the semantic cache."""

        async def land() -> None:
            try:
                answer = await live.recorded
            except asyncio.CancelledError as exc:  # the gateway is shutting down
                flight.fail(exc)
                raise
            res = await flight.finish(answer)
            if res.stored and remember is not None:
                await remember()

        self._keep(asyncio.create_task(land()))

    async def _record(
        self,
        call: GenerationCall,
        up: UpstreamStream,
        form: StreamFormat,
        inspected: StreamGuard | None = None,
    ) -> CachedAnswer | None:
        """Read and record a whole stream that no response relays (a background refresh)."""
        reader, recorder = SSEReader(), form.recorder(call.info.id)
        try:
            async for chunk in up.chunks():
                for item in form.read(reader, chunk):
                    if inspected is not None:
                        item = await _inspected(inspected, item, form)
                    recorder.feed(noted_item(item, call.output_limit))
        except BackendError as exc:
            call.backend_failed(exc.kind)
            return None
        except ApiError:  # the rules block the new answer: nothing is stored
            return None
        finally:
            await up.aclose()
        call.count_usage(reader.usage())
        return recorder.answer()  # None unless complete: nothing partial is stored

    async def _live(
        self,
        call: GenerationCall,
        live: LiveAnswer,
        include_usage: bool,
        form: StreamFormat,
        inspected: StreamGuard | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """Relay the leader's live answer as it arrives, recording it for the cache.

        The events of one backend chunk go out together. The recorded answer (``None`` unless
        complete) goes to the cache's fill once the backend's stream has ended, before the
        last events are relayed; a client gone earlier leaves it ``None`` (nothing stored).
        """
        up = live.upstream
        reader, recorder = SSEReader(), form.recorder(call.info.id)
        first = True
        done = False
        held = b""  # the events from the last ([DONE]) on, sent once the backend's stream ends
        span = spans.start_span("stream")
        try:
            try:
                async for chunk in up.chunks():
                    out: list[bytes] = []
                    for item in form.read(reader, chunk):
                        if inspected is not None:
                            try:
                                item = await _inspected(inspected, item, form)
                            except ApiError as err:  # blocked: nothing is stored
                                live.settle(None)
                                yield b"".join(out) + guard_event(err)
                                return
                        item = noted_item(item, call.output_limit)
                        recorder.feed(item)
                        if first:
                            call.observe_ttft()
                            first = False
                        if form.is_last(item):
                            done = True
                        elif form.hidden(item, include_usage):
                            continue
                        out.append(form.frame(item))
                    if not out:
                        continue
                    if done:
                        held += b"".join(out)
                    else:
                        yield out[0] if len(out) == 1 else b"".join(out)
            except BackendError as exc:
                call.backend_failed(exc.kind)
                live.settle(None)
                if held:
                    yield held
                yield broken_stream_event(exc.message)
                return
            call.count_usage(reader.usage())
            live.settle(recorder.answer())  # None unless complete: nothing partial is stored
            if held:
                yield held
            if not done:
                yield broken_stream_event(None)
                return
            call.observe_latency(stream=True)
        finally:
            # The client has gone unless settled: store nothing; abort an unfinished backend.
            await live.abandon()
            if span is not None:
                span.set_attribute("semcache.complete", done)
                span.end()

    def _keep(self, task: asyncio.Task[None]) -> None:
        """Hold a background task until it is done (the loop keeps only weak references)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _inspected(inspected: StreamGuard, item: bytes, form: StreamFormat) -> bytes:
    """``item`` as the content rules leave it (the whole answer is scored before its end)."""
    if form.is_last(item):
        await inspected.finish()
    return inspected.feed(item)


def replayed_reply(
    entry: CachedAnswer,
    res: CacheResult,
    creq: CacheRequest,
    include_usage: bool,
    form: StreamFormat,
) -> Reply:
    """A stored 200 answer sent as the stream its request asked for (``res``: how the cache
    answered; the usage chunk only when ``include_usage``)."""
    payloads = replay.as_stream(entry, creq.route, include_usage=include_usage)
    headers = {**SSE_HEADERS, **result_headers(res, creq, stream=True)}
    return Reply(200, stream=replayed(payloads, form), media_type=MEDIA_TYPE, headers=headers)
