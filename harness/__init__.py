"""What tests and benchmarks start real servers with: the gateway as a child process (the one
way, ``GatewayProcess``) or in a thread, tiny models, vLLM processes, free ports, nginx and
Chromium in front, the namespaced cluster the multi-host tests prove, and the one fake vLLM
(fast unit tests).

Not part of the product: the wheel leaves it out, and nothing in server/, semcache/ or
backends/ imports it. It sits beside them so that ``bench/`` never imports ``tests/``.
"""
