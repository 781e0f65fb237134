"""Asynchronous batches (Workers AI ``queueRequest``): a durable queue, submit and poll, and
workers that run items only on idle backend capacity (sync first, batch on what is left)."""
