"""The micro-batching encoder over the real all-MiniLM-L6-v2."""

from __future__ import annotations

import asyncio

import numpy as np

from semcache.semantic.encoder import Encoder

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


async def test_concurrent_requests_are_batched_with_the_same_vectors(encoder: Encoder) -> None:
    one_by_one = [await encoder.encode([text]) for text in TEXTS]
    calls = encoder.stats.model_calls
    together = await asyncio.gather(*(encoder.encode([text]) for text in TEXTS))
    used = encoder.stats.model_calls - calls
    # The first request starts alone; the others queue up behind it and share batches.
    assert used < len(TEXTS) // 2
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
