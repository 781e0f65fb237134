"""Following one Redis pub/sub channel for as long as a gateway runs, reconnecting after an
outage: the loop the stores that tell every gateway of a change share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from foundation.redis_client import open_redis, ready_for_pubsub

Message = Callable[[bytes], Awaitable[None]]
Subscribed = Callable[[], Awaitable[None]]


async def follow_channel(
    url: str,
    channel: str,
    on_message: Message,
    *,
    on_subscribed: Subscribed,
    log: logging.Logger,
    timeout_s: float = 2.0,
    max_delay_s: float = 5.0,
) -> None:
    """Call ``on_message`` with each message on ``channel`` until cancelled.

    ``on_subscribed`` runs after every (re)subscription: messages sent while no connection
    was subscribed are lost, so the follower reads the whole state again there. A lost
    connection is retried after 0.1 s, doubling up to ``max_delay_s``.
    """
    delay = 0.1
    while True:
        client = open_redis(url, socket_connect_timeout=timeout_s, socket_timeout=None)
        try:
            await ready_for_pubsub(client)
            async with client.pubsub() as ps:
                await ps.subscribe(channel)
                await on_subscribed()
                delay = 0.1
                while True:
                    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=5.0)
                    if msg is None:
                        await ps.ping()
                        continue
                    data: Any = msg.get("data")
                    if isinstance(data, bytes):
                        await on_message(data)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("pub/sub on %s lost (%s); retrying in %.1fs", channel, exc, delay)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)
