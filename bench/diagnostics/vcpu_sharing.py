"""Do this machine's cores slow each other down? Fixed work on one core, the other idle or busy.

``overhead.py`` pins vLLM to one core and the gateway and client to the other. That isolates
them only if the cores are independent; on a VM whose vCPUs are two threads of one physical
core they are not, and CPU the gateway spends slows vLLM. This times the same work (a Python
loop and a numpy matmul chain) on core 1 while core 0 idles, runs ``cpu_burn.py`` flat out,
or runs it at a share (``--shares``), alternating, and prints the slowdown of each.

    .venv/bin/python -m bench.diagnostics.vcpu_sharing [--rounds 15] [--shares 0.1,1.0]

The machine's own noise is large (the same work on an idle pair varies by ~10 % from one
second to the next), hence many alternating rounds, medians and the quartiles beside them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.support import affinity

BURN = Path(__file__).resolve().parent / "cpu_burn.py"


def work() -> float:
    """CPU seconds of a fixed piece of work (~0.7 s on the development VM)."""
    started = time.process_time()
    total = 0
    for i in range(15_000_000):
        total += i * i
    a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
    for _ in range(1000):
        a = a @ a
        a /= np.abs(a).max()
    return time.process_time() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shares", default="0.1,1.0", help="shares of core 0 to burn")
    args = ap.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        print("needs cores 0 and 1")
        return 2
    os.sched_setaffinity(0, {1})
    shares = [0.0] + [float(s) for s in args.shares.split(",")]
    times: dict[float, list[float]] = {share: [] for share in shares}
    for _ in range(args.rounds):
        for share in shares:
            burner = None
            if share > 0:
                with affinity({0}):  # the burner inherits core 0
                    burner = subprocess.Popen([sys.executable, str(BURN), str(share)])
                time.sleep(0.5)
            times[share].append(work())
            if burner is not None:
                burner.kill()
                burner.wait()
    idle = float(np.median(times[0.0]))
    print(f"fixed work on core 1, CPU seconds (median of {args.rounds}), core 0:")
    for share, values in times.items():
        label = "idle" if share == 0 else f"busy {share:.0%} (cpu_burn.py)"
        q1, median, q3 = np.percentile(values, [25, 50, 75])
        print(
            f"  {label:<28} {median:.3f} s [quartiles {q1:.3f}, {q3:.3f}]  "
            f"slowdown {median / idle - 1:+.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
