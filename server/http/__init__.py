"""HTTP plumbing under every route: a ``Reply`` and how it is sent (``reply.py``,
``respond.py``), conditional requests (``conditional.py``), how uvicorn runs and drains the
gateway (``uvicorn_config.py``, ``draining.py``), and every trick that reaches into
uvicorn's, Litestar's or aiohttp's internals (``internals.py``, checked versions)."""
