"""The serving core every API surface stands on: the request's model, its cache key and
scope (``core.py``), generation with the exact and semantic caches in front of the backends
(``generation.py``, ``cached_stream.py``, ``semantic_chat.py``), embeddings and
classification answered item by item (``pooling.py``), and the cache's response headers
(``cache_headers.py``). Its currency is the OpenAI request body, what vLLM speaks; surfaces
translate to and from it. It never imports a surface."""
