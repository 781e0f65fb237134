"""What a request costs on the real servers, for the fleet simulator: measured by
``kv_shapes.py --calibrate`` on this machine's vLLM (SmolLM2-135M-Instruct, one core each)
and kept as JSON; the simulator prints the one it uses.

- a prefill of ``n`` uncached tokens (one server, nothing else running) takes
  ``base_ms + per_token_ms * n + quadratic_ms * n**2`` to its first token (fitted to cold
  prompts of several lengths; a prompt whose blocks are all cached is the ``n ≈ 0`` case);
- ``step_ms``: one decode step of one stream (the inter-token latency alone);
- ``hop_ms``: what the prefill → decode hop adds to the first token, beyond the prefill
  itself (the prefill answer's way back, the KV pull, the decode server's first step).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Calibration:
    base_ms: float
    per_token_ms: float
    quadratic_ms: float
    step_ms: float
    hop_ms: float
    source: str
    """Where the figures come from (the command, the date)."""

    def prefill_ms(self, tokens: float) -> float:
        return self.base_ms + self.per_token_ms * tokens + self.quadratic_ms * tokens * tokens

    def break_even(self, itl_slo_ms: float) -> int:
        """The most uncached tokens (whole blocks) a decode server can prefill itself while
        its streams stay within the ITL SLO (one step plus that prefill): past it the prefill
        hop pays."""
        n = 0
        while self.step_ms + self.prefill_ms(n + 32) <= itl_slo_ms:
            n += 32
        return n

    def line(self) -> str:
        return (
            f"prefill(n) = {self.base_ms:.0f} ms + {self.per_token_ms:.3f} ms * n"
            f" + {self.quadratic_ms * 1e6:.2f}e-6 ms * n^2 (1,000 tokens: "
            f"{self.prefill_ms(1000):.0f} ms; cached: {self.prefill_ms(32):.0f} ms),"
            f" decode step {self.step_ms:.1f} ms, P/D hop +{self.hop_ms:.0f} ms  [{self.source}]"
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))


def fit(points: list[tuple[int, float]], step_ms: float, hop_ms: float, source: str) -> Calibration:
    """A calibration from ``(uncached tokens, TTFT ms)`` points, least squares with
    non-negative coefficients (a linear fit when the quadratic one would go negative)."""
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    coef = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], axis=1), t, rcond=None)[0]
    if min(coef) < 0:
        lin = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), t, rcond=None)[0]
        coef = np.array([max(0.0, lin[0]), max(0.0, lin[1]), 0.0])
    return Calibration(float(coef[0]), float(coef[1]), float(coef[2]), step_ms, hop_ms, source)


MEASURED = Calibration(
    base_ms=70.0,
    per_token_ms=0.75,
    quadratic_ms=0.00025,
    step_ms=35.0,
    hop_ms=110.0,
    source="probe of 2 SmolLM2 servers, 2-vCPU VM, before kv_shapes --calibrate ran",
)
"""Used when no calibration file exists."""


def load(path: Path | None) -> Calibration:
    if path is not None and path.is_file():
        return Calibration(**json.loads(path.read_text()))
    return MEASURED
