"""The micro-batching encoder over the real all-MiniLM-L6-v2."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np

from semcache.semantic.encoder import Encoder, TextModel

TEXTS = [
    f"How do I cook {food} for {n} people?"
    for n in range(4)
    for food in (
        "rice",
        "pasta",
        "lentils",
        "chicken",
        "fish",
        "beans",
        "tofu",
        "potatoes",
        "eggs",
        "soup",
    )
]


async def test_vectors_are_normalised_float32(encoder: Encoder) -> None:
    vectors = await encoder.encode(["hello world", "a second, longer sentence to encode"])
    assert vectors.dtype == np.float32
    assert vectors.shape == (2, encoder.dimensions)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert (await encoder.encode([])).shape == (0, encoder.dimensions)


async def test_a_lone_request_is_one_model_call(encoder: Encoder) -> None:
    calls = encoder.stats.model_calls
    await encoder.encode(["just me"])
    assert encoder.stats.model_calls == calls + 1


class HeldModel:
    """The real model, whose first call waits until the test lets it run."""

    def __init__(self, model: TextModel) -> None:
        self.model = model
        self.calls = 0
        self.running = threading.Event()
        self.release = threading.Event()

    def encode(self, sentences: list[str], **kwargs: Any) -> Any:
        self.calls += 1
        self.running.set()
        assert self.release.wait(timeout=60)
        return self.model.encode(sentences, **kwargs)


async def test_concurrent_requests_are_batched_with_the_same_vectors(encoder: Encoder) -> None:
    one_by_one = [await encoder.encode([text]) for text in TEXTS]
    held = HeldModel(encoder.model)
    enc = Encoder(held, dimensions=encoder.dimensions, version="held")
    try:
        first = asyncio.ensure_future(enc.encode([TEXTS[0]]))
        assert await asyncio.to_thread(held.running.wait, 60)  # the worker runs it alone
        rest = [asyncio.ensure_future(enc.encode([text])) for text in TEXTS[1:]]
        await asyncio.sleep(0)  # each of the others queues up behind the running call
        held.release.set()
        together = await asyncio.gather(first, *rest)
    finally:
        held.release.set()
        await enc.aclose()
    assert held.calls == 2 and enc.stats.batch_sizes == [1, len(TEXTS) - 1]
    for alone, batched in zip(one_by_one, together, strict=True):
        np.testing.assert_allclose(alone, batched, atol=2e-5)


async def test_multi_text_requests_keep_their_rows(encoder: Encoder) -> None:
    groups = [TEXTS[i : i + 3] for i in range(0, 15, 3)]
    results = await asyncio.gather(*(encoder.encode(g) for g in groups))
    reference = encoder.encode_sync([t for g in groups for t in g])
    np.testing.assert_allclose(np.vstack(results), reference, atol=2e-5)


async def test_a_failing_model_fails_every_waiting_request() -> None:
    class Broken:
        def encode(self, sentences: list[str], **kwargs: object) -> np.ndarray:
            raise RuntimeError("model exploded")

    enc = Encoder(Broken(), dimensions=4, version="broken")
    try:
        results = await asyncio.gather(
            *(enc.encode(["x"]) for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, RuntimeError) for r in results)
    finally:
        await enc.aclose()
