"""Exact-cache hits: the gateway against a bare Litestar endpoint and LiteLLM's proxy cache.

Claims checked (issues 3 and 16): an exact-cache hit through the gateway serves >= 0.8x the
requests/s of (b) a bare Litestar endpoint returning the same bytes (the ceiling of this stack:
uvicorn + Litestar, same settings), and >= 5x the requests/s of (c) LiteLLM's proxy serving a
hit from its own cache (``cache: true``, in-memory ``local`` cache) for the same request.

Issue 17 adds (a2): the gateway with tenancy on (a listed token, limits, the usage ledger and
the request log), which must also serve >= 0.7x the bare endpoint's requests/s; (a) runs with
all of that off. Issue 16 asks the same of an embeddings hit: the gateways also serve the
embedded all-MiniLM-L6-v2 (in their own process), and the bare app sends back their
embeddings hit too; LiteLLM has no embeddings model behind it here, so (c) measures chat only.

Each server runs in its own process, all of them pinned to core 0: a tiny vLLM (on core 1;
only the first request of each cache reaches it), (a) the gateway (``python -m server.cli
serve --no-launch``), (b) the bare app (this script with ``--serve-bare``, run exactly as the
gateway runs: uvicorn's ``Server.serve`` under ``asyncio.run``, log level warning) and (c)
LiteLLM's proxy, installed in a bench-only virtualenv outside the project's (``--setup``).
The load generator is ``wrk`` (Debian package), one thread pinned to core 1, POSTing from a
Lua script one fixed request of each kind: a temperature-0 chat request, non-stream (JSON)
and stream (SSE replay), and an embeddings request (one input, float vectors), at 1, 16 and
64 connections (``--kinds`` picks the kinds). Each round runs one wrk run per cell and target,
the targets' order reversed every other round, so drift on this shared machine hits all of
them. Before measuring, each target is primed and checked with one request of each kind it
serves (200, complete, a hit: ``cf-aig-cache-status: HIT`` / LiteLLM's
``x-litellm-cache-key``); while measuring, wrk must see no non-2xx answer nor socket error,
vLLM's prompt-token counter must not move (a chat miss would reach it), nor the gateways'
exact-cache misses (and expired, bypassed lookups) of the embeddings model, which runs in the
gateway and would encode on a miss. wrk's own CPU share of its core is printed beside each
figure: near 100 % the figure would be wrk's, not the server's.

    .venv/bin/python bench/exact_hit.py --setup    # once: LiteLLM into .data/bench-venv-litellm
    .venv/bin/python bench/exact_hit.py --quick    # 2 s runs, 3 rounds: a few minutes
    .venv/bin/python bench/exact_hit.py [--seconds 5] [--rounds 6] [--connections 1 16 64]
    .venv/bin/python bench/exact_hit.py --vllm-url http://127.0.0.1:8100   # a running vLLM
    .venv/bin/python bench/exact_hit.py --profile-gateway /tmp/gw.txt   # + py-spy on the gateway
    .venv/bin/python bench/exact_hit.py --no-tenancy --no-litellm    # (a) and (b) only
    .venv/bin/python bench/exact_hit.py --kinds embeddings    # the embeddings cells only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where a module could shadow the standard library:
# move bench/ behind everything else (a stable sort), then import from the repository root.
sys.path.sort(key=lambda entry: Path(entry or ".").resolve() == Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.exact_hit.bare_app import serve_bare
from bench.lib.exact_hit.litellm_proxy import LITELLM_SPEC, LITELLM_VENV, setup_litellm
from bench.lib.exact_hit.measure import measure
from bench.lib.exact_hit.report import report
from bench.lib.exact_hit.workload import CHAT_KINDS, KINDS
from bench.lib.support import exit_status, stderr_printer
from harness.vllm_process import test_data_dir

say = stderr_printer("exact_hit")


async def run(args: argparse.Namespace, litellm_missing: str | None) -> bool:
    """Measure, print the setting and the report; True when every target is met."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    measured = await measure(args, litellm_missing)
    print()
    print("\n".join(measured.notes))
    print()
    met = report(measured.results, measured.cells, measured.names, measured.idle_cpu)
    if measured.vllm_tokens:
        print("ERROR: vLLM served requests while measuring: not every answer was a cache hit")
        met = False
    if measured.embeddings_misses:
        print("ERROR: embeddings lookups missed while measuring: not every answer was a cache hit")
        met = False
    return met


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5, help="one wrk run per cell and target")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--warmup-s", type=int, default=2, help="unmeasured wrk run per target and kind (0: none)"
    )
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle-load window, seconds")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="requests measured: json (chat, non-stream), sse (chat, stream), embeddings",
    )
    ap.add_argument("--quick", action="store_true", help="2 s runs, 3 rounds")
    ap.add_argument("--server-core", default="0", help="cores for every server ('none')")
    ap.add_argument("--wrk-core", default="1", help="core for wrk and this script ('none')")
    ap.add_argument("--vllm-url", help="use this running vLLM server instead of starting one")
    ap.add_argument(
        "--vllm-cores",
        default="1",
        help="cores for the vLLM started here ('none'); it serves "
        "only the first request of each cache, so it may share wrk's core",
    )
    ap.add_argument("--data-dir", default=str(test_data_dir()), help="models and vLLM logs")
    ap.add_argument("--litellm-venv", default=str(LITELLM_VENV), help="LiteLLM's own virtualenv")
    ap.add_argument("--no-litellm", action="store_true", help="do not measure (c)")
    ap.add_argument("--no-tenancy", action="store_true", help="do not measure (a2)")
    ap.add_argument("--setup", action="store_true", help=f"install {LITELLM_SPEC} and exit")
    ap.add_argument("--profile-gateway", metavar="FILE", help="py-spy collapsed stacks to FILE")
    ap.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--replies", help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_bare:
        serve_bare(args.serve_bare, Path(args.replies))
        return 0
    args.data_dir = Path(args.data_dir).resolve()
    args.litellm_venv = Path(args.litellm_venv).resolve()
    if args.setup:
        problem = setup_litellm(args.litellm_venv)
        print(problem or f"{LITELLM_SPEC} is installed in {args.litellm_venv}")
        return 1 if problem else 0
    if args.quick:
        args.seconds, args.rounds, args.warmup_s, args.idle_s = 2, 3, 1, 5.0
    if shutil.which("wrk") is None:
        say("wrk is missing: bash scripts/wrk.sh install")
        return 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.no_litellm:
        litellm_missing: str | None = "--no-litellm"
    elif not set(args.kinds) & set(CHAT_KINDS):
        litellm_missing = "no chat cell (--kinds): it has no embeddings model here"
    else:
        litellm_missing = setup_litellm(args.litellm_venv)
    if litellm_missing:
        say(f"(c) LiteLLM will not be measured: {litellm_missing}")
    return exit_status(run(args, litellm_missing), say)


if __name__ == "__main__":
    raise SystemExit(main())
