"""The OpenAI-compatible ``/v1`` surface, one subpackage per endpoint family (as vLLM's
``entrypoints/openai``): each has ``api_router.py`` (thin routes), ``protocol.py`` (request
schemas) and ``serving.py`` (logic). Shared pieces sit next to them, one idea per module."""
