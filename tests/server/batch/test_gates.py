"""Capacity gates: batch work starts only on idle backend capacity."""

from __future__ import annotations

from server.batch.gates import BackendGate
from server.batch.settings import BatchSettings


class Probe:
    """A backend's load as the gates see it (VllmClient reports the same two numbers)."""

    def __init__(self) -> None:
        self.n = 0
        self.limit_hit = False

    def inflight(self) -> int:
        return self.n

    def has_capacity(self, per_server_limit: int | None = None) -> bool:
        return self.n < (per_server_limit or 64)


def test_gate_runs_batch_only_on_idle_capacity() -> None:
    probe, now = Probe(), [100.0]
    settings = BatchSettings(per_server_limit=3, max_inflight=2, sync_idle_s=0.5)
    gate = BackendGate(probe, settings, clock=lambda: now[0])
    assert gate.free()
    gate.running, probe.n = 1, 1  # one batch item on the backend, no live request
    assert gate.sync_inflight() == 0 and gate.free()
    probe.n = 2  # a live request arrives: batch waits
    assert gate.sync_inflight() == 1 and not gate.free()
    probe.n = 1  # it has gone, but live traffic comes in bursts: wait a little longer
    assert not gate.free()
    now[0] += 0.6
    assert gate.free()
    gate.running = probe.n = 2  # the gateway's own batch limit
    assert not gate.free()
    relaxed = BackendGate(probe, BatchSettings(per_server_limit=3, yield_to_sync=False))
    probe.n = 2
    assert relaxed.free()  # live traffic present, but the server is under its limit
    probe.n = 3
    assert not relaxed.free()  # the server is full
