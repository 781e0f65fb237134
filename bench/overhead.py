"""Gateway overhead: one chat workload sent straight to vLLM and through the gateway.

Claim checked (issue 2): the gateway adds at most 2 ms to TTFT p50 and loses no throughput.

A real vLLM server (the tiny test Llama by default) and the real gateway (``python -m
server.cli serve --no-launch``: uvicorn in its own process, so the client's load does not
share its GIL) are started here. Four cells are measured (non-stream and stream, 1 and 8
concurrent requests), each for both targets; batches alternate direct/gateway, and the
order flips every round, so drift on this shared machine hits both alike. Two sustained
cells follow (non-stream and stream, 64 requests kept in flight for 10 s windows, vLLM's
batch capped at 32 so it always has a full batch and a queue): there tok/s is vLLM's
capacity as each target delivers it, and that is where "loses no throughput" is judged.
They sample vLLM's running and waiting requests during every window (the gateway must never
leave vLLM's queue empty), and with ``--control`` add a third target: direct traffic while
``lib/cpu_burn.py`` burns, on the client's core, the CPU share the gateway used (does the
gateway's CPU alone, on the core next to vLLM's, cost vLLM throughput?).
With 1 or 8 requests sent together and awaited, tok/s is tokens over latency: those ratios
restate the added latency and are shown, not judged. Every prompt is
unique (no prefix-cache help for whichever target comes second) and has the same length;
``max_tokens`` is fixed with ``ignore_eos`` and temperature 0, so every answer has the same
number of tokens.

TTFT: time to the first SSE event carrying content (stream) or the whole answer
(non-stream). tokens/s: completion tokens (from ``usage``) / wall time of the batches.
CPU ms/req: CPU time of this client, and of the gateway process net of what it burns idle
(a figure that, unlike latency, does not depend much on what else the machine is doing).

vLLM (all its processes) is pinned to core 1 by default; the gateway and this client share
the other core(s). The client is aiohttp by default: it shares a core with the gateway, so its
own CPU delays the gateway (a gateway can forward a request only once it gets the core), and
httpx (``--client httpx``, what the openai SDK uses) costs about 3x more per request and 4x
more per streamed chunk; with it, 8 concurrent requests measured a few ms worse for any proxy.
Exit status: 0 when every target is met, 1 when not, 130 on Ctrl-C.

    .venv/bin/python bench/overhead.py --quick              # smoke check, < 2 min + vLLM start
    .venv/bin/python bench/overhead.py [--requests 64] [--max-tokens 64]
    .venv/bin/python bench/overhead.py --model-path prepared:smollm2-135m-instruct
    .venv/bin/python bench/overhead.py --vllm-url http://127.0.0.1:8100   # a running vLLM
    .venv/bin/python bench/overhead.py --client httpx          # the openai SDK's client, heavier
    .venv/bin/python bench/overhead.py --minimal-proxy         # the floor: a bare aiohttp proxy
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.overhead.batches import CPU_BURN
from bench.lib.overhead.cells import CONTROL, SUSTAINED_IN_FLIGHT
from bench.lib.overhead.session import run
from bench.lib.support import REPO, exit_status, parse_cores, stderr_printer
from harness.vllm_process import test_data_dir

say = stderr_printer("overhead")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--requests", type=int, default=64, help="requests per cell and target")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per answer")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up rounds (not measured)")
    ap.add_argument("--quick", action="store_true", help="a small run for a smoke check")
    ap.add_argument("--vllm-url", help="use this running vLLM server instead of starting one")
    ap.add_argument(
        "--model-path",
        help="model to serve (folder, or prepared:NAME, e.g. prepared:smollm2-135m-instruct); "
        "default: the tiny random-weight test Llama",
    )
    ap.add_argument("--served-model", help="vLLM's model name (default: the folder's name)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--data-dir",
        default=str(test_data_dir()),
        help="where models are built/prepared and vLLM logs go (default: the tests' data dir)",
    )
    ap.add_argument(
        "--vllm-cores",
        help="cores vLLM runs on (the one started here is pinned to them); the gateway and "
        "the client get the others. 'none': no pinning. Default: 1, or none with --vllm-url",
    )
    ap.add_argument(
        "--no-cache",
        dest="cache",
        action="store_false",
        help="turn the gateway's answer cache off (default: on, as configured by default; "
        "every prompt is unique, so each request pays a cache miss)",
    )
    ap.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the load client's HTTP library (default aiohttp: ~5x less CPU per request than "
        "httpx, which shares a core with the gateway)",
    )
    ap.add_argument(
        "--minimal-proxy",
        action="store_true",
        help="measure bench/lib/minimal_proxy.py (aiohttp in and out, nothing else) in the "
        "gateway's place: the floor of any Python proxy in this layout",
    )
    ap.add_argument("--throughput-tolerance", type=float, default=0.01)
    ap.add_argument(
        "--sustained-rounds",
        type=int,
        default=None,
        help=f"rounds of the sustained cells ({SUSTAINED_IN_FLIGHT} requests kept in flight), "
        "where throughput is judged; 0 skips them (default 6, 1 with --quick)",
    )
    ap.add_argument(
        "--sustained-seconds",
        type=float,
        default=None,
        help="length of one sustained window per target (default 10 s, 3 s with --quick)",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help=f"add a control target to the sustained cells ({CONTROL!r}: direct traffic while "
        f"{CPU_BURN.relative_to(REPO)} burns, on the client's core, the CPU share the gateway "
        "used)",
    )
    return ap


def pinning(args: argparse.Namespace) -> set[int] | None:
    """vLLM's cores, or None when nothing is pinned; pins this process to the rest."""
    if args.vllm_cores is None:
        args.vllm_cores = "none" if args.vllm_url else "1"
    if args.vllm_cores.lower() == "none":
        return None
    available = os.sched_getaffinity(0)
    cores = parse_cores(args.vllm_cores)
    rest = available - cores
    if not cores <= available or not rest:
        say(f"not pinning: cores {args.vllm_cores} leave nothing else of {sorted(available)}")
        return None
    os.sched_setaffinity(0, rest)  # before any thread exists, so all of them inherit it
    return cores


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.data_dir = Path(args.data_dir).resolve()
    if args.quick:
        args.requests, args.max_tokens, args.warmup = 16, 16, 1
    if args.sustained_rounds is None:
        args.sustained_rounds = 1 if args.quick else 6
    if args.sustained_seconds is None:
        args.sustained_seconds = 3.0 if args.quick else 10.0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vllm_cores = pinning(args)
    return exit_status(run(args, vllm_cores), say)


if __name__ == "__main__":
    raise SystemExit(main())
