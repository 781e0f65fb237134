"""A small in-process time series of the gateway's counters, for the dashboard's charts.

Every few seconds ``CounterSeries.sample`` reads the registry (``figures``) and keeps the
cumulative counters in one ring per window (5 minutes, an hour, a day), each ring holding a
fixed number of points: memory stays bounded however long the gateway runs. A chart is the
difference between consecutive points (rates, hit rates, latency quantiles of that step).
Restarting the gateway starts the series afresh; Prometheus keeps the long history.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from server.dashboard.figures import histogram_state, overview_totals, quantile, read_samples

log = logging.getLogger("semcache.dashboard")


@dataclass(frozen=True)
class Window:
    name: str
    step_s: float
    points: int


WINDOWS = {w.name: w for w in (Window("5m", 5, 60), Window("1h", 60, 60), Window("1d", 1200, 72))}
SAMPLE_EVERY_S = 5.0


@dataclass(frozen=True)
class Point:
    time: float
    totals: dict[str, float]
    histograms: dict[str, dict[str, float]]


def _delta(new: dict[str, float], old: dict[str, float]) -> dict[str, float]:
    return {k: v - old.get(k, 0.0) for k, v in new.items()}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


@dataclass
class CounterSeries:
    """The rings of sampled counters; ``sample`` is called by ``run`` (or a test's clock)."""

    registry: CollectorRegistry
    clock: Callable[[], float] = time.time
    rings: dict[str, deque[Point]] = field(init=False)

    def __post_init__(self) -> None:
        # one point more than the window shows: a chart is the steps between points
        self.rings = {name: deque(maxlen=w.points + 1) for name, w in WINDOWS.items()}

    def sample(self) -> None:
        """Read the registry now; keep the point in each ring whose step has passed."""
        samples = read_samples(self.registry)
        point = Point(self.clock(), overview_totals(samples), histogram_state(samples))
        for name, ring in self.rings.items():
            if not ring or point.time - ring[-1].time >= WINDOWS[name].step_s - 0.5:
                ring.append(point)

    async def run(self, every_s: float = SAMPLE_EVERY_S) -> None:
        while True:
            try:
                self.sample()
            except Exception:
                log.exception("could not sample the dashboard's series")
            await asyncio.sleep(every_s)

    def chart(self, window: str) -> dict[str, list[float | None]]:
        """Columns for uPlot: ``time`` (end of each step) and one series per figure."""
        points = list(self.rings[window])
        columns: dict[str, list[float | None]] = {
            k: []
            for k in (
                "time",
                "requests_per_s",
                "exact_hit_rate",
                "semantic_hit_rate",
                "tokens_saved",
                "usd_saved",
                "latency_p50_s",
                "latency_p99_s",
                "ttft_p50_s",
                "ttft_p99_s",
                "errors_4xx",
                "errors_5xx",
            )
        }
        for old, new in itertools.pairwise(points):
            d = _delta(new.totals, old.totals)
            seconds = new.time - old.time
            lookups = d["exact_hits"] + d["semantic_hits"] + d["misses"]
            latency = _delta(new.histograms["latency"], old.histograms["latency"])
            ttft = _delta(new.histograms["ttft"], old.histograms["ttft"])
            status = [(k.removeprefix("status_"), v) for k, v in d.items() if k[:7] == "status_"]
            row: dict[str, float | None] = {
                "time": new.time,
                "requests_per_s": d["requests"] / seconds if seconds > 0 else None,
                "exact_hit_rate": _ratio(d["exact_hits"], lookups),
                "semantic_hit_rate": _ratio(d["semantic_hits"], lookups),
                "tokens_saved": d["tokens_saved"],
                "usd_saved": d["usd_saved"],
                "latency_p50_s": quantile(latency, 0.5),
                "latency_p99_s": quantile(latency, 0.99),
                "ttft_p50_s": quantile(ttft, 0.5),
                "ttft_p99_s": quantile(ttft, 0.99),
                "errors_4xx": sum(n for s, n in status if s.startswith("4")),
                "errors_5xx": sum(n for s, n in status if s.startswith("5")),
            }
            for key, column in columns.items():
                column.append(row[key])
        return columns
