"""Run at the start of each vLLM server the gateway launches (``backends.launch.command`` puts
this folder on its ``PYTHONPATH``): each shim below is a no-op unless its environment variable
is set (``backends.launch.nixl_progress``, ``backends.launch.gloo_device``,
``backends.launch.cpu_pinning``, ``backends.launch.amx``)."""

from backends.launch import amx, cpu_pinning, gloo_device, nixl_progress

amx.install_from_env()

nixl_progress.install_from_env()
gloo_device.install_from_env()
cpu_pinning.install_from_env()
