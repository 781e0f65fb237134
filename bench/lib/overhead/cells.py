"""What is measured: the cells (stream or not, at a number of requests in flight), vLLM's
batch cap for the sustained cells, and the control target's name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    stream: bool
    concurrency: int

    @property
    def label(self) -> str:
        return f"{'stream' if self.stream else 'non-stream'} c={self.concurrency}"


CELLS = (Cell(False, 1), Cell(True, 1), Cell(False, 8), Cell(True, 8))
VLLM_MAX_NUM_SEQS = 32
"""vLLM's batch limit here (``--max-num-seqs``, when vLLM is started by this script)."""
SUSTAINED_IN_FLIGHT = 64
"""Requests kept in flight by the sustained cells: twice vLLM's batch, so vLLM always has a
full batch and a queue, and tok/s is its capacity as each target delivers it (below that,
tok/s at a fixed number in flight is still tokens over latency). 64 is also the gateway's
default per-server limit (``max_inflight_per_server``), so the gateway queues nothing."""
SUSTAINED = (Cell(False, SUSTAINED_IN_FLIGHT), Cell(True, SUSTAINED_IN_FLIGHT))


CONTROL = "direct+gw CPU"
"""The sustained cells' control: direct traffic while ``lib/cpu_burn.py`` burns, on
the client's core, the share of it the gateway used in its last window of the cell."""
