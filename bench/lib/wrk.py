"""What the load generator ``wrk`` reports: its ``--latency`` text parsed, and its version."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def wrk_ms(text: str) -> float:
    """A wrk duration (``812.00us``, ``1.20ms``, ``2.01s``, ``1.05m``) in ms; NaN if not one."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")


@dataclass(frozen=True)
class WrkReport:
    """The figures of one wrk run's report."""

    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    """Non-2xx or 3xx responses."""
    socket_errors: int
    """Connect, read, write and timeout errors together."""


def parse_wrk(out: str) -> WrkReport:
    """The figures in wrk's ``--latency`` output; raises on output without them."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"\s50%\s+(\S+)", out)
    p99 = re.search(r"\s99%\s+(\S+)", out)
    if rps is None or p50 is None or p99 is None or total is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return WrkReport(
        requests=int(total.group(1)),
        rps=float(rps.group(1)),
        p50_ms=wrk_ms(p50.group(1)),
        p99_ms=wrk_ms(p99.group(1)),
        non_2xx=int(bad.group(1)) if bad else 0,
        socket_errors=sum(int(g) for g in sock.groups()) if sock else 0,
    )


def wrk_version() -> str:
    """``wrk 4.1.0`` or the like (``wrk`` when it does not say)."""
    done = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    return " ".join(done.stdout.split()[:2]) or "wrk"
