"""Cloudflare Workers AI's REST surface (``/client/v4/accounts/{id}/ai/run/{model}``).

Translates Workers-AI inputs into the serving core's requests (so the same caches and
backends answer both APIs) and its answers back into Cloudflare's shapes:

- text generation: ``prompt`` or ``messages`` → ``{"response", "usage"}``; with
  ``stream: true`` the events ``data: {"response": "<piece>"}`` and a final ``data: [DONE]``;
- text embeddings: ``text`` (a string or a list) → ``{"shape": [n, dim], "data", "pooling"}``;
- text classification: ``text`` → ``[{"label", "score"}, ...]`` (best first);
- asynchronous batches: ``{"requests": [...]}`` with ``queueRequest`` → ``{"status":
  "queued", "request_id", "model"}``; ``{"request_id"}`` polls (see ``server.batch``).

Every JSON answer is wrapped in the envelope ``{"result", "success", "errors", "messages"}``;
errors are raised as ``ApiError`` and wrapped by ``server.errors`` for ``/client/v4`` paths.
"""
