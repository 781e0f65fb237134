"""Key-value stores of the features whose records fit Litestar's ``Store`` (get, set with a
TTL, delete, exists, namespaces): one site per group of features, a local directory or a
Redis under a prefix, hands each feature its namespace. ``docs/architecture.md`` (Stores)
lists every store of the gateway and why the others keep their own shape."""
