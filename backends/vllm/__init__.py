"""The vLLM client: the P/D flow (prefill hop, then decode hop), the streams it relays, and
the vLLM sequence classifier. Sits on the fleet (``backends.fleet``), which says where each
hop goes."""
