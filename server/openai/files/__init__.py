"""``/v1/files``: the OpenAI Files API (batch input and output files)."""
