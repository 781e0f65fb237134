"""The gateway's own API beside OpenAI's, for any token: its usage (``GET /v1/usage``) and a
stored answer read again by its digest (``GET /v1/cache/{digest}``)."""
