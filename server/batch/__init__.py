"""Asynchronous batches (Workers AI ``queueRequest``, OpenAI's Batch API): a durable queue,
submit and poll, and workers that run items only on idle backend capacity (sync first, batch
on what is left); built once by the app factory (``system.py``), each API registering the
runner of its items."""
