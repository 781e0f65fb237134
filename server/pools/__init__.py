"""Pool membership changed at run time (servers added, drained), kept beyond the gateway
that made it (a local file or Redis) and applied by every gateway; its admin routes are in
``server/admin/pools.py``."""
