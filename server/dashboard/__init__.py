"""The operator dashboard: pages served by the gateway over the same figures as ``/metrics``."""
