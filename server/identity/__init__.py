"""Who sends a request: bearer tokens from the config and API keys made while serving,
resolved to a principal (tenant, roles, limits, models) by ``auth.TokenAuth``; the keys'
records, stores and admin logic in ``api_keys/``. The envelope applies it to every request;
the admin routes of keys are in ``server/admin/api_keys.py``."""
