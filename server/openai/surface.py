"""The OpenAI surface: ``/v1``, its endpoint families and their serving objects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Final

from server.openai.batches import api_router as batches
from server.openai.batches.protocol import PAYLOAD_KEY
from server.openai.batches.serving import BatchesServing
from server.openai.chat_completion import api_router as chat_completion
from server.openai.completion import api_router as completion
from server.openai.families import build_openai
from server.openai.files import api_router as files
from server.openai.models import api_router as models
from server.openai.pooling import api_router as pooling
from server.openai.responses import api_router as responses
from server.openai.scoring import api_router as scoring
from server.openai.stores import OpenAIStores, build_stores, openai_site
from server.openai.tokenization import api_router as tokenization
from server.surface import Services, Surface, Watched, running

log = logging.getLogger("semcache.server")


STORES: Final = "openai_stores"


def build(services: Services) -> Mapping[str, Any]:
    """One serving object per family, over the stores of files, batches and response owners
    (Redis when the batch queue is shared); the batch workers run the lines of OpenAI
    batches."""
    config = services.config
    files_settings = config.batch.files
    directory = Path(files_settings.dir) if files_settings.dir else config.data_path() / "openai"
    directory = directory.expanduser()
    stores = build_stores(config.batch, openai_site(config.batch, directory))
    families = build_openai(
        services.core,
        services.generation,
        services.pooling,
        stores,
        services.batch_system,
        services.tokens,
        max_file_bytes=files_settings.max_bytes,
    )
    services.batch_system.register(families.item_runner(), key=PAYLOAD_KEY)
    return {**families.state(), STORES: stores}


async def close(state: Mapping[str, Any]) -> None:
    stores: OpenAIStores = state[STORES]
    await stores.aclose()


async def sweep_batches(batches: BatchesServing, every_s: float = 60.0) -> None:
    """Finalize finished OpenAI batches and remove expired files, now and then."""
    while True:
        try:
            await batches.sweep()
        except Exception:
            log.exception("could not sweep the OpenAI batches")
        await asyncio.sleep(every_s)


def sweeping(state: Mapping[str, Any]) -> AbstractAsyncContextManager[None]:
    return running(sweep_batches(state["batches"]), "openai-batch-sweep")


SURFACE: Final = Surface(
    name="OpenAI",
    prefixes=("/v1",),
    routes=(
        *models.ROUTES,
        *chat_completion.ROUTES,
        *completion.ROUTES,
        *responses.ROUTES,
        *pooling.ROUTES,
        *tokenization.ROUTES,
        *scoring.ROUTES,
        *files.ROUTES,
        *batches.ROUTES,
    ),
    early_hits={
        "/v1/chat/completions": Watched("chat", "chat"),
        "/v1/completions": Watched("completions", "chat"),
        "/v1/embeddings": Watched("embeddings", "embeddings"),
    },
    build=build,
    lifespan=sweeping,
    close=close,
)
