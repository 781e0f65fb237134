"""The load generator ``wrk``: one run of it, its ``--latency`` report parsed, its version."""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

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


def parse_wrk(out: str, *, latency: bool = True) -> WrkReport:
    """The figures in wrk's ``--latency`` output; raises on output without them. Without
    ``latency`` (a run without ``--latency``) the percentiles are NaN."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"\s50%\s+(\S+)", out)
    p99 = re.search(r"\s99%\s+(\S+)", out)
    if rps is None or total is None or (latency and (p50 is None or p99 is None)):
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return WrkReport(
        requests=int(total.group(1)),
        rps=float(rps.group(1)),
        p50_ms=wrk_ms(p50.group(1)) if p50 else math.nan,
        p99_ms=wrk_ms(p99.group(1)) if p99 else math.nan,
        non_2xx=int(bad.group(1)) if bad else 0,
        socket_errors=sum(int(g) for g in sock.groups()) if sock else 0,
    )


@dataclass(frozen=True)
class WrkRun:
    """One wrk run: its report, how long it took, and what CPU wrk itself used."""

    report: WrkReport
    wall_s: float
    wrk_cpu: float
    """wrk's CPU seconds per second of the run (1.0: its core saturated)."""
    output: str
    """What wrk printed (stdout and stderr together)."""


def run_wrk(
    url: str,
    script: Path | str | None,
    *,
    connections: int,
    seconds: int,
    threads: int = 1,
    core: str | None = None,
    timeout: str | None = "10s",
    latency: bool = True,
) -> WrkRun:
    """Runs wrk against ``url`` and parses its report; raises if wrk fails.

    ``script``: a Lua file (a ``Path``), the Lua text itself (a ``str``, written to a
    temporary file) or ``None`` (plain GETs). ``core``: a ``taskset -c`` list wrk is pinned
    to (``None``: not pinned). ``timeout``: wrk's ``--timeout`` (``None``: wrk's own default,
    2 s). ``latency``: ask for the latency distribution (the report's percentiles are NaN
    without it)."""
    if isinstance(script, str):
        with tempfile.TemporaryDirectory(prefix="wrk-") as folder:
            lua = Path(folder) / "script.lua"
            lua.write_text(script)
            return run_wrk(
                url,
                lua,
                connections=connections,
                seconds=seconds,
                threads=threads,
                core=core,
                timeout=timeout,
                latency=latency,
            )
    cmd = ["taskset", "-c", core] if core is not None else []
    cmd += ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s"]
    cmd += ["--timeout", timeout] if timeout is not None else []
    cmd += ["--latency"] if latency else []
    cmd += ["-s", str(script), url] if script is not None else [url]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # wrk's own CPU time (taskset execs it)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited {proc.returncode}:\n{out}")
    cpu = (usage.ru_utime + usage.ru_stime) / wall
    return WrkRun(parse_wrk(out, latency=latency), wall, cpu, out)


def wrk_version() -> str:
    """``wrk 4.1.0`` or the like (``wrk`` when it does not say)."""
    done = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    return " ".join(done.stdout.split()[:2]) or "wrk"
