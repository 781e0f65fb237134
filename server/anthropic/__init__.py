"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

A Messages request is translated into the chat completion it means (``translate.py``) and
answered by the serving core like any chat request: the same caches (one entry serves both
APIs), limits, placement and backends; the answer is translated back, a stream into
Anthropic's events (``events.py``). Errors answer in Anthropic's shape (``server.errors``).
"""
