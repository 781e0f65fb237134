"""Which KV blocks each vLLM server holds: its KV events, an index per pool, the request's
block hashes, and the scoring that places a request where its prefix is cached."""
