"""What tests and benchmarks start real servers with: the gateway in a thread or a child
process, tiny models, vLLM processes, free ports, nginx and Chromium in front, the
namespaced cluster, and an in-process fake backend.

Not part of the product: the wheel leaves it out, and nothing in server/, semcache/ or
backends/ imports it. It sits beside them so that ``bench/`` never imports ``tests/``.
"""
