"""Launching vLLM servers: their command line, their processes, and the shims they load.

Kept free of imports: every launched server imports its shims from here at start
(``shim/sitecustomize.py``), so importers name the module they use.
"""
