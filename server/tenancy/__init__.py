"""Who is calling and what they may do: authentication on every route, limits, the usage
ledger and the request log, applied once per request by ``middleware.TenancyMiddleware``."""
