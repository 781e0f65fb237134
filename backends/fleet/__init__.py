"""Where a request goes: a backend's servers in pools, their health, admission and fair
queueing, and placement (prefix hash or the KV blocks each server holds, ``kv/``).

Knows servers and their load, never the vLLM API or the P/D flow (``backends.vllm``)."""
