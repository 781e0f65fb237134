"""``/v1/batches``: the OpenAI Batch API on the durable batch queue."""
