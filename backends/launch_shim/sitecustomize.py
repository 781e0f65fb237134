"""Run at the start of each vLLM server the gateway launches (``backends.launch``): each shim
below is a no-op unless its environment variable is set (``backends.nixl_progress``,
``backends.gloo_device``, ``backends.cpu_pinning``)."""

from backends import cpu_pinning, gloo_device, nixl_progress

nixl_progress.install_from_env()
gloo_device.install_from_env()
cpu_pinning.install_from_env()
