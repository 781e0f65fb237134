"""Run at the start of each vLLM server the gateway launches (see ``backends.nixl_progress``)."""

from backends.nixl_progress import install_from_env

install_from_env()
