"""A multi-host topology on one Linux machine, for the tests that prove it and the benches
that measure it: each host a network namespace on a private bridge, HAProxy in front of two
gateways, the shared tier (one redis-server, or a Redis Cluster on three hosts), a prefill
and a decode vLLM of the tiny Llama (``topology.py`` has the table).

A developer tool, not a deployment: ``scripts/cluster.sh`` and ``python -m harness.cluster``
run it; docs/deploy.md says what users deploy.

- ``topology.py``: hosts, addresses, ports, tokens and model ids;
- ``network.py``: the namespaces, the bridge and the machine's link to it;
- ``processes.py``: a process per service, in its host's namespace, with pid files and logs;
- ``redis.py``, ``vllm.py``, ``gateways.py``, ``haproxy.py``: the services and their configs;
- ``faults.py``: a host unplugged, two hosts partitioned, a slow and lossy link;
- ``control.py``: ``Cluster``, all of it as one object (``up``, ``down``, the faults).
"""

from harness.cluster.control import Cluster
from harness.cluster.network import missing_requirements
from harness.cluster.topology import (
    GATEWAYS,
    HOST_HEADER,
    METERED_RPM,
    METERED_TOKEN,
    MODEL_ID,
    SEMANTIC_MODEL_ID,
    TOKEN,
    WORKERS_AI_MODEL,
    ClusterError,
    KvTransport,
)

__all__ = [
    "GATEWAYS",
    "HOST_HEADER",
    "METERED_RPM",
    "METERED_TOKEN",
    "MODEL_ID",
    "SEMANTIC_MODEL_ID",
    "TOKEN",
    "WORKERS_AI_MODEL",
    "Cluster",
    "ClusterError",
    "KvTransport",
    "missing_requirements",
]
