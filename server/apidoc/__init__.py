"""The OpenAPI document (``/openapi.json``) and its docs UI (``/docs``), built from the msgspec
types the routes validate and answer with."""
