"""API keys an operator manages while the gateway serves: records, hashing, stores, the
in-memory view the one authentication reads, and the admin operations."""
