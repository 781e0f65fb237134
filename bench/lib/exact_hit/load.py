"""The load: wrk runs (one thread, a Lua script POSTing one request) per cell and target, in
rounds whose order of targets flips."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.lib import wrk
from bench.lib.exact_hit.targets import Target
from bench.lib.exact_hit.workload import BODIES, PATHS, REQUEST_HEADERS, Cell, Kind
from bench.lib.support import stderr_printer

say = stderr_printer("exact_hit")


def wrk_script(kind: Kind) -> str:
    """A wrk Lua script sending the one request (every target gets the same headers)."""
    lines = ['wrk.method = "POST"', f"wrk.body = [==[{BODIES[kind].decode()}]==]"]
    lines += [f'wrk.headers["{k.title()}"] = "{v}"' for k, v in REQUEST_HEADERS.items()]
    return "\n".join(lines) + "\n"


@dataclass
class WrkRun:
    """One wrk run against one target."""

    requests: int
    wall_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    wrk_cpu: float
    """Share of one core wrk used (its own rusage over the run's wall time)."""
    server_cpu_s: float

    @property
    def errors(self) -> int:
        return self.non_2xx + self.socket_errors


def load_target(
    target: Target, script: Path, path: str, connections: int, seconds: int, core: str | None
) -> WrkRun:
    """wrk (``bench/lib/wrk.py``), one thread, ``connections`` connections for ``seconds``,
    pinned to ``core``, and the CPU the target spent meanwhile."""
    server_before = target.cpu_s()
    run = wrk.run_wrk(
        target.url + path, script, connections=connections, seconds=seconds, core=core
    )
    server_cpu = target.cpu_s() - server_before
    report = run.report
    return WrkRun(
        requests=report.requests,
        wall_s=run.wall_s,
        rps=report.rps,
        p50_ms=report.p50_ms,
        p99_ms=report.p99_ms,
        non_2xx=report.non_2xx,
        socket_errors=report.socket_errors,
        wrk_cpu=run.wrk_cpu,
        server_cpu_s=server_cpu,
    )


Results = dict[tuple[Cell, str], list[WrkRun]]


async def run_rounds(
    targets: list[Target], cells: Sequence[Cell], args: argparse.Namespace, tmp: Path
) -> Results:
    """``args.rounds`` rounds; in each, one wrk run per cell and target that serves its kind,
    the targets' order reversed every other round. Before them, a short unmeasured run per
    target and kind."""
    kinds = list(dict.fromkeys(cell.kind for cell in cells))
    scripts = {}
    for kind in kinds:
        scripts[kind] = tmp / f"{kind}.lua"
        scripts[kind].write_text(wrk_script(kind))
    core = None if args.wrk_core == "none" else args.wrk_core

    async def one(target: Target, cell: Cell, seconds: int) -> WrkRun:
        run = await asyncio.to_thread(
            load_target,
            target,
            scripts[cell.kind],
            PATHS[cell.kind],
            cell.connections,
            seconds,
            core,
        )
        await asyncio.sleep(0.2)  # let the answers wrk left in flight finish
        return run

    if args.warmup_s > 0:
        for target in targets:
            for kind in kinds:
                if kind not in target.kinds:
                    continue
                warm = await one(target, Cell(kind, max(args.connections)), args.warmup_s)
                if warm.errors:
                    raise RuntimeError(
                        f"warm-up of {target.name}: {warm.non_2xx} non-2xx answers, "
                        f"{warm.socket_errors} socket errors"
                    )
    results: Results = {
        (cell, t.name): [] for cell in cells for t in targets if cell.kind in t.kinds
    }
    for rnd in range(args.rounds):
        order = targets if rnd % 2 == 0 else targets[::-1]
        for cell in cells:
            for target in order:
                if cell.kind not in target.kinds:
                    continue
                run = await one(target, cell, args.seconds)
                results[cell, target.name].append(run)
        say(f"round {rnd + 1}/{args.rounds} done")
    return results
