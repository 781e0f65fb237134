"""The admin API (``/admin/...``, the admin role): cache purges, policy reload and the request
log (``api_router.py``), API keys and their audit (``api_keys.py``), pool membership
(``pools.py``), the debug clock (``debug_clock.py``)."""
