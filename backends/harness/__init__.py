"""What tests and benchmarks start real servers with: tiny models, vLLM processes, free ports.

Not used by the gateway itself; it lives in the package so ``bench/`` never imports ``tests/``.
"""
