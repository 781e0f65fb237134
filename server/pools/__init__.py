"""Pool membership changed at run time, kept beyond the gateway that made it."""
