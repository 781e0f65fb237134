"""The bottom layer: what server, semcache and backends all use, importing none of them.

The SSE codec, the constrained config types, the files shipped in the packages and atomic
file writes.
"""
