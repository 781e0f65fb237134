"""The OpenAI-compatible ``/v1`` surface, one subpackage per endpoint family (as vLLM's
``entrypoints/openai``): each has ``api_router.py`` (thin routes) and ``protocol.py`` (request
schemas), and where its logic is its own, ``serving.py``; chat and completions share
``text_generation.py``. ``families.py`` builds them over the serving core."""
