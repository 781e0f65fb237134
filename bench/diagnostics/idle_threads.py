"""Which threads of an idle `make serve` use CPU: a per-thread look at ``bench/idle_cpu.py``.

Starts the embedded default as ``bench/idle_cpu.py`` does (its config, traffic and settle),
then reads ``/proc/<pid>/task/<tid>/stat`` (utime + stime) of every thread of the process
tree at the start and the end of an idle window and prints the threads by CPU share of one
core, each with its process's command line (shortened). ``--hold`` keeps the servers up
after the report until Ctrl-C (to look further with strace, perf or gdb).

    .venv/bin/python -m bench.diagnostics.idle_threads [--idle-s 30] [--port 8380] [--hold]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.idle_cpu import report_threads, serve_default, thread_snapshot, traffic
from bench.lib.support import stderr_printer

say = stderr_printer("idle_threads")


async def run(args: argparse.Namespace) -> None:
    async with serve_default("idle threads", args.delay_us, args) as (url, server):
        if not args.no_traffic:
            await traffic(url)
        await asyncio.sleep(args.settle_s)
        root = psutil.Process(server.pid)
        before, _ = thread_snapshot(root)
        t0 = time.monotonic()
        await asyncio.sleep(args.idle_s)
        after, names = thread_snapshot(root)
        report_threads(before, after, names, time.monotonic() - t0, args.top)
        if args.hold:
            say(f"holding; gateway pid {server.pid}; Ctrl-C or SIGTERM to stop")
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await stop.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--port", type=int, default=8380)
    parser.add_argument("--base-port", type=int, default=8390)
    parser.add_argument("--delay-us", type=int, default=None, help="nixl_progress_delay_us")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-traffic", action="store_true")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
