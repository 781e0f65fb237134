"""The `semcache` command line: every user command, in one parser.

Serve the gateway, start its backends, check config and policy files, purge a running
gateway's cache, print its usage ledger, calibrate the semantic matcher, retrain the shipped
verifier and classifier head.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import msgspec

from backends.classifier import DEFAULT_EXAMPLES, DEFAULT_HEAD, build_head, save_head
from backends.classifier import load_classifier as embedded_classifier
from backends.config import VllmBackend
from backends.launch import Launcher, VllmStartError
from backends.scale import ScaleRecords, pool_of, start_server, stop_server
from semcache.policy import DEFAULT_POLICY, PolicyError, load_policy
from semcache.semantic.verifier import DEFAULT_VERIFIER_DIR
from semcache.tuning.calibrate import TASKS, calibrate_file, format_report
from semcache.tuning.pairs import QQP_PAIRS
from semcache.tuning.train_verifier import COSINE_ONLY_THRESHOLDS, train_verifier
from server.app import create_app, registry_from_config
from server.auth import describe, exposure_problem
from server.config import DEFAULT_CONFIG, ConfigError, GatewayConfig, load_config
from server.draining import DrainingServer
from server.encoders import load_encoder
from server.uvicorn_config import uvicorn_config


def say(message: str) -> None:
    print(f"[semcache] {message}", flush=True)


def _load(path: str | None) -> GatewayConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"semcache: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _launcher(config: GatewayConfig) -> Launcher:
    vllm = [b for b in config.backends if isinstance(b, VllmBackend)]
    return Launcher(
        vllm, config.data_path(), progress=say, ready_timeout_s=config.server.ready_timeout_s
    )


async def _serve(config: GatewayConfig, launch: bool) -> None:
    host, port = config.server.host, config.server.port
    launcher = _launcher(config) if launch else None
    async with launcher if launcher is not None else contextlib.nullcontext():
        say("loading models and computing revisions")
        registry = await asyncio.to_thread(registry_from_config, config)
        app = create_app(config, registry)
        server = DrainingServer(
            uvicorn_config(app, host, port), app.state.drain, config.server.drain_timeout_s
        )
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn has no event)
            await asyncio.sleep(0.05)
        if server.started:
            settle_gc()
            say(f"ready: OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops everything)")
            say(f"authentication: {describe(config.auth)}")
        await task
        say("stopping")


GC_THRESHOLD0 = 10_000
"""Container objects allocated, net, between two young collections (CPython's default: 700).
A request leaves a few hundred objects in reference cycles (tasks, futures, exceptions), so
the default collects every few requests; each collection walks the requests in flight."""


def settle_gc() -> None:
    """Tune the cyclic garbage collector once the gateway has started.

    Everything allocated while starting (modules, models, the app) lives as long as the
    process: ``gc.freeze`` takes it out of the collector's sight, so a full collection,
    which would otherwise walk all of it (a pause for every request in flight), walks only
    what came after. Young collections run less often (``GC_THRESHOLD0``); cycles still go.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, gen1, gen2)


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where installed (uvicorn[standard] brings it): less CPU per request."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def cmd_serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if args.policy:
        config.policy = args.policy
    try:
        load_policy(config.policy)  # refuse to start (and to launch vLLM) on an invalid policy
    except PolicyError as exc:
        print(f"semcache: invalid policy, not starting: {exc}", file=sys.stderr)
        return 2
    if args.host:
        config.server.host = args.host
    if args.port:
        config.server.port = args.port
    problem = exposure_problem(config.auth, config.server.host)
    if problem is not None:
        print(f"semcache: not starting: {problem}", file=sys.stderr)
        return 2
    try:
        run_loop(_serve(config, launch=not args.no_launch))
    except VllmStartError as exc:
        print(f"semcache: a backend failed to start: {exc}", file=sys.stderr)
        return 1
    except PolicyError as exc:
        print(f"semcache: invalid policy, not starting: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted; backends stopped")
    return 0


async def _backends_up(config: GatewayConfig) -> None:
    async with _launcher(config):
        say("backends are up (Ctrl-C stops them)")
        await asyncio.Event().wait()


def cmd_backends_up(args: argparse.Namespace) -> int:
    config = _load(args.config)
    try:
        asyncio.run(_backends_up(config))
    except VllmStartError as exc:
        print(f"semcache: a backend failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("backends stopped")
    return 0


def _gateways(args: argparse.Namespace) -> list[str]:
    return [u.strip().rstrip("/") for u in args.url.split(",") if u.strip()]


def _admin(args: argparse.Namespace) -> dict[str, str]:
    return {"authorization": f"Bearer {args.token or ''}"}


async def _scale_up(args: argparse.Namespace, config: GatewayConfig) -> int:
    """Start one more server of the pool, then add it to every gateway named."""
    vllm = [b for b in config.backends if isinstance(b, VllmBackend)]
    backend, role = pool_of(vllm, args.pool)
    server, record = await start_server(
        backend,
        role,
        config.data_path(),
        ready_timeout_s=config.server.ready_timeout_s,
        progress=say,
    )
    path = f"/admin/backends/{backend.name}/{role}/servers"
    async with httpx.AsyncClient(timeout=60) as client:
        for gateway in _gateways(args):
            try:
                r = await client.post(
                    gateway + path, json={"url": server.url}, headers=_admin(args)
                )
            except httpx.HTTPError as exc:
                r = None
                problem = str(exc)
            if r is None or r.status_code != 200:
                problem = f"{r.status_code}: {r.text}" if r is not None else problem
                print(f"semcache: {gateway} refused {server.url}: {problem}", file=sys.stderr)
                await _scale_down_one(args, backend.name, role, config, record.url, stop=True)
                return 1
            say(f"{gateway}: {backend.name}/{role} + {server.url} ({r.json()['state']})")
    say(f"{server.url} serves (log {record.log}); `scale {args.pool} -1` stops it")
    return 0


async def _scale_down_one(
    args: argparse.Namespace,
    backend: str,
    role: str,
    config: GatewayConfig,
    url: str,
    *,
    stop: bool,
) -> bool:
    """Drain ``url`` out of every gateway (waiting for its requests), then stop it."""
    path = f"/admin/backends/{backend}/{role}/servers"
    drained = True
    async with httpx.AsyncClient(timeout=args.drain_timeout + 30) as client:
        for gateway in _gateways(args):
            params = {"url": url, "timeout_s": str(args.drain_timeout)}
            try:
                r = await client.delete(gateway + path, params=params, headers=_admin(args))
            except httpx.HTTPError as exc:
                print(f"semcache: cannot reach {gateway}: {exc}", file=sys.stderr)
                drained = False
                continue
            if r.status_code == 404:
                continue  # this gateway does not send it anything
            if r.status_code != 200 or not r.json()["drained"]:
                print(f"semcache: {gateway} did not drain {url}: {r.text}", file=sys.stderr)
                drained = False
            else:
                say(f"{gateway}: {backend}/{role} - {url} (drained)")
    if not drained and not stop:
        return False
    records = ScaleRecords(config.data_path(), backend, role)
    for record in records.read():
        if record.url == url:
            await stop_server(record)
            records.remove(url)
            say(f"stopped vLLM at {url}")
    return drained


async def _scale_down(args: argparse.Namespace, config: GatewayConfig) -> int:
    vllm = [b for b in config.backends if isinstance(b, VllmBackend)]
    backend, role = pool_of(vllm, args.pool)
    started = ScaleRecords(config.data_path(), backend.name, role).read()
    if not started:
        print(
            f"semcache: no server of {backend.name}/{role} was started by `scale +1` "
            "(servers of the config stop with `serve` / `backends up`)",
            file=sys.stderr,
        )
        return 1
    url = started[-1].url
    if not await _scale_down_one(args, backend.name, role, config, url, stop=False):
        print(f"semcache: {url} still runs requests; it keeps running", file=sys.stderr)
        return 1
    return 0


def cmd_backends_scale(args: argparse.Namespace) -> int:
    config = _load(args.config)
    scale = _scale_up if args.delta == "+1" else _scale_down
    try:
        return asyncio.run(scale(args, config))
    except (ValueError, VllmStartError) as exc:
        print(f"semcache: cannot scale {args.pool}: {exc}", file=sys.stderr)
        return 1


def cmd_policy_check(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        print(f"semcache: invalid policy: {exc}", file=sys.stderr)
        return 2
    models = sorted(policy.model_ids)
    print(
        f"{args.file or DEFAULT_POLICY}: OK (rules for {len(models)} model(s)"
        f"{': ' if models else ''}{', '.join(models)})"
    )
    return 0


def cmd_cache_purge(args: argparse.Namespace) -> int:
    token = args.token or ""
    body = {"kind": args.kind, "target": args.target or ""}
    try:
        r = httpx.post(
            f"{args.url.rstrip('/')}/admin/cache/purge",
            json=body,
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )
    except httpx.HTTPError as exc:
        print(f"semcache: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(r.text)
    return 0 if r.status_code == 200 else 1


USAGE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("requests", "requests"),
    ("prompt_tokens", "prompt"),
    ("completion_tokens", "completion"),
    ("exact_hits", "exact"),
    ("semantic_hits", "semantic"),
    ("tokens_saved", "tok saved"),
    ("cost_usd", "cost $"),
    ("saved_usd", "saved $"),
)
USAGE_KEYS = ("tenant", "model", "route", "day")


def format_usage(rows: Sequence[dict[str, Any]]) -> str:
    """``/v1/usage`` rows as a text table, with a total line when there are several."""
    keys = [k for k in USAGE_KEYS if rows and k in rows[0]]
    lines: list[list[str]] = [[*keys, *(title for _, title in USAGE_COLUMNS)]]

    def cells(row: dict[str, Any]) -> list[str]:
        return [
            f"{row.get(f, 0):.6f}" if f.endswith("_usd") else f"{row.get(f, 0):,}"
            for f, _ in USAGE_COLUMNS
        ]

    for row in rows:
        lines.append([str(row[k]) for k in keys] + cells(row))
    if len(rows) > 1:
        total = {f: sum(r.get(f, 0) for r in rows) for f, _ in USAGE_COLUMNS}
        lines.append(["total" if i == 0 else "" for i in range(len(keys))] + cells(total))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < len(keys) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )


def cmd_usage(args: argparse.Namespace) -> int:
    today = time.strftime("%Y-%m-%d", time.gmtime())
    params = {
        "start": args.start or today[:8] + "01",
        "end": args.end or today,
        "group_by": args.group_by,
    }
    if args.tenant:
        params["tenant"] = args.tenant
    try:
        r = httpx.get(
            f"{args.url.rstrip('/')}/v1/usage",
            params=params,
            headers={"authorization": f"Bearer {args.token or ''}"},
            timeout=30,
        )
    except httpx.HTTPError as exc:
        print(f"semcache: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"semcache: {r.status_code}: {r.text}", file=sys.stderr)
        return 1
    rows = r.json()["data"]
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(rows)).decode() + "\n")
    elif rows:
        print(format_usage(rows))
    else:
        print(f"no usage from {params['start']} to {params['end']}")
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    config = _load(args.file)
    print(
        f"{args.file or DEFAULT_CONFIG}: OK ({len(config.models)} models, "
        f"{len(config.backends)} backends)"
    )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    if not args.pairs.is_file():
        print(f"semcache: cannot calibrate: no pairs file {args.pairs}", file=sys.stderr)
        return 2
    if args.stream:
        return _calibrate_stream(args)
    try:
        report = calibrate_file(
            args.pairs,
            args.task,
            encoder=load_encoder(),
            target_precision=args.target_precision,
            use_verifier=not args.no_verifier,
            classifier_factory=embedded_classifier,
        )
    except (OSError, ValueError) as exc:
        print(f"semcache: cannot calibrate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report)).decode() + "\n")
    else:
        print(format_report(report))
    return 0


def _calibrate_stream(args: argparse.Namespace) -> int:
    """``calibrate --stream``: verified caching vs static thresholds on a replayed stream."""
    from semcache.semantic.verified import VerifiedParams
    from semcache.tuning.stream_eval import compare_file
    from semcache.tuning.stream_report import format_comparison

    if args.task != "chat":
        print("semcache: cannot calibrate: --stream is for --task chat", file=sys.stderr)
        return 2
    params = VerifiedParams(max_error=0.05)  # the rule's defaults; each max_error is run
    try:
        rows = compare_file(
            args.pairs,
            params,
            encoder=load_encoder(),
            limit=args.limit,
            seed=args.seed,
            use_verifier=not args.no_verifier,
            repeated=args.repeated,
            clusters=args.clusters,
        )
    except (OSError, ValueError) as exc:
        print(f"semcache: cannot calibrate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(rows)).decode() + "\n")
    else:
        print(format_comparison(rows))
    return 0


def cmd_train_verifier(args: argparse.Namespace) -> int:
    if not args.pairs.is_file():
        print(
            f"semcache: no pairs file {args.pairs} (the QQP pairs stay in the source "
            "checkout, they are not shipped; pass --pairs)",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    meta = train_verifier(
        args.pairs,
        args.out,
        encoder=load_encoder(),
        target_precision=args.target_precision,
        hidden=args.hidden,
        epochs=args.epochs,
        seed=args.seed,
        min_threshold=args.min_threshold,
    )
    setting, val, test = meta.recommended, meta.validation, meta.test
    print(f"verifier {meta.version} -> {args.out} ({time.monotonic() - started:.0f} s)")
    print(f"recommended: threshold {setting.threshold}, min_prob {setting.min_prob}")
    print(
        f"validation: precision {val.precision:.3f} recall {val.recall:.3f}; "
        f"test (held out): precision {test.precision:.3f} "
        f"recall {test.recall:.3f} hit rate {test.hit_rate:.3f}"
    )
    for threshold, m in zip(COSINE_ONLY_THRESHOLDS, meta.test_cosine_only, strict=True):
        print(f"  cosine only >= {threshold}: precision {m.precision:.3f} recall {m.recall:.3f}")
    return 0


def cmd_train_classifier(args: argparse.Namespace) -> int:
    head = build_head(load_encoder(), args.examples)
    save_head(head, args.out)
    print(f"classifier head {head.version} ({head.examples} examples) -> {args.out}")
    return 0


class EnvDefault(NamedTuple):
    variable: str
    option: str
    what: str


ENVIRONMENT: tuple[EnvDefault, ...] = (
    EnvDefault("SEMCACHE_CONFIG", "--config", "gateway config TOML (default: the shipped one)"),
    EnvDefault("SEMCACHE_HOST", "--host", "address the gateway listens on"),
    EnvDefault("SEMCACHE_PORT", "--port", "port the gateway listens on"),
    EnvDefault("SEMCACHE_POLICY", "--policy", "cache policy TOML (default: the shipped one)"),
    EnvDefault("SEMCACHE_URL", "--url", "a running gateway (default: http://127.0.0.1:8080)"),
    EnvDefault("SEMCACHE_ADMIN_TOKEN", "--token", "bearer token of the admin API"),
)
"""Every option whose default an environment variable sets: declared here only."""

OTHER_ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("SEMCACHE_CACHE_SALT_SECRET", "vLLM cache_salt key (a backend's cache_salt_secret_env)"),
    ("SEMCACHE_ENCODER_RUNTIME", "the cache encoder's runtime: auto, onnx or torch"),
    ("SEMCACHE_VLLM_DEVICE", "device of launched vLLM servers: cpu or cuda"),
)
"""Variables read below the command line (config, encoder, launcher), listed in --help."""


def _environment_help() -> str:
    rows = [f"  {e.variable:<28}{e.option:<10}{e.what}" for e in ENVIRONMENT]
    rows += [f"  {name:<38}{what}" for name, what in OTHER_ENVIRONMENT]
    return "environment (variable, option it sets the default of):\n" + "\n".join(rows)


def _env(option: str) -> EnvDefault:
    (env,) = [e for e in ENVIRONMENT if e.option == option]
    return env


def _env_option(parser: argparse.ArgumentParser, option: str, **kwargs: Any) -> None:
    """Add ``option`` with its default from its variable in :data:`ENVIRONMENT`."""
    env = _env(option)
    default = os.environ.get(env.variable, kwargs.pop("default", None))
    help_text = kwargs.pop("help", env.what)
    parser.add_argument(option, default=default, help=f"{help_text} (${env.variable})", **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="semcache",
        description=__doc__,
        epilog=_environment_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="start the backends the config launches, then the gateway")
    _env_option(serve, "--config")
    _env_option(serve, "--host")
    _env_option(serve, "--port", type=int)
    _env_option(serve, "--policy")
    serve.add_argument("--no-launch", action="store_true", help="use running backends only")
    serve.set_defaults(func=cmd_serve)

    backends = sub.add_parser("backends", help="manage vLLM backends").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    up = backends.add_parser("up", help="start the vLLM servers the config names and wait")
    _env_option(up, "--config")
    up.set_defaults(func=cmd_backends_up)
    scale = backends.add_parser(
        "scale",
        help="start one more vLLM server of a pool and add it to running gateways, or drain "
        "and stop the last one started so",
        description="+1: start a vLLM server with the pool's launch settings on a free port "
        "and add it to each gateway (admin API); -1: drain the last server +1 started out of "
        "each gateway (its requests finish), then stop it.",
    )
    scale.add_argument("pool", help="BACKEND/ROLE (ROLE: both, prefill, decode)")
    scale.add_argument("delta", choices=["+1", "-1"])
    _env_option(scale, "--config")
    _env_option(
        scale,
        "--url",
        default="http://127.0.0.1:8080",
        help="the gateways, comma-separated",
    )
    _env_option(scale, "--token")
    scale.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        help="-1: longest wait for the requests of the server (seconds, default 600)",
    )
    scale.set_defaults(func=cmd_backends_scale)

    config = sub.add_parser("config", help="gateway config files").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    check = config.add_parser("check", help="validate a gateway config file")
    check.add_argument(
        "file",
        nargs="?",
        default=os.environ.get(_env("--config").variable),
        help=f"config TOML (default: ${_env('--config').variable}, else the shipped one)",
    )
    check.set_defaults(func=cmd_config_check)

    policy = sub.add_parser("policy", help="cache policy files").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    pcheck = policy.add_parser("check", help="validate a policy file (as the server does)")
    pcheck.add_argument(
        "file",
        nargs="?",
        default=os.environ.get(_env("--policy").variable),
        help=f"policy TOML (default: ${_env('--policy').variable}, else the shipped one)",
    )
    pcheck.set_defaults(func=cmd_policy_check)

    cache = sub.add_parser("cache", help="the cache of a running gateway").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    purge = cache.add_parser("purge", help="purge entries through the admin API")
    purge.add_argument("kind", choices=["key", "model", "tenant", "scope", "tag", "all"])
    purge.add_argument("target", nargs="?", default="")
    _env_option(purge, "--url", default="http://127.0.0.1:8080")
    _env_option(purge, "--token")
    purge.set_defaults(func=cmd_cache_purge)

    usage = sub.add_parser(
        "usage",
        help="requests, tokens and USD used and saved, from a running gateway's ledger",
        description="A table of the usage ledger (GET /v1/usage): a tenant's token sees "
        "its own usage, an admin's every tenant's. Days are UTC.",
    )
    usage.add_argument("--start", help="first day, YYYY-MM-DD (default: the 1st of this month)")
    usage.add_argument("--end", help="last day, YYYY-MM-DD (default: today)")
    usage.add_argument(
        "--group-by",
        default="tenant,model,day",
        help="comma-separated: any of tenant, model, route, day; empty: one total "
        "(default: tenant,model,day)",
    )
    usage.add_argument("--tenant", help="only this tenant (an admin's token)")
    usage.add_argument("--json", action="store_true", help="print the rows as JSON")
    _env_option(usage, "--url", default="http://127.0.0.1:8080")
    _env_option(usage, "--token", help="bearer token: a tenant's API token or an admin's")
    usage.set_defaults(func=cmd_usage)

    calibrate = sub.add_parser(
        "calibrate",
        help="precision and hit rate of the semantic matcher on your labelled pairs",
        description="Precision and hit rate per cosine threshold (alone and with the "
        "verifier) on a JSONL file of {text_a, text_b, label} pairs, and the policy "
        "setting with the highest hit rate that reaches the target precision.",
    )
    calibrate.add_argument("--pairs", type=Path, required=True, help="JSONL (or .jsonl.gz) pairs")
    calibrate.add_argument(
        "--task",
        choices=TASKS,
        default="chat",
        help="what a hit serves: a chat answer, a classification (the embedded classifier's "
        "labels) or an embedding (default: chat)",
    )
    calibrate.add_argument("--target-precision", type=float, default=0.95)
    calibrate.add_argument("--no-verifier", action="store_true", help="cosine alone")
    calibrate.add_argument("--json", action="store_true", help="print the full report as JSON")
    calibrate.add_argument(
        "--stream",
        action="store_true",
        help="chat: replay the pairs' questions as a stream (duplicate clusters from the pairs "
        'labelled 1) and compare mode = "verified" with the best static thresholds',
    )
    calibrate.add_argument("--limit", type=int, default=None, help="--stream: questions at most")
    calibrate.add_argument("--seed", type=int, default=0, help="--stream: order of the stream")
    calibrate.add_argument(
        "--repeated",
        type=int,
        default=0,
        help="--stream: this many requests whose questions repeat (Zipf-like popularity over "
        "--clusters duplicate clusters, surface variants of their questions); 0: each once",
    )
    calibrate.add_argument("--clusters", type=int, default=500, help="--repeated: clusters")
    calibrate.set_defaults(func=cmd_calibrate)

    verifier = sub.add_parser(
        "train-verifier",
        help="retrain the semantic cache's pair verifier (reproducibly)",
        description="Split the pairs by connected component (60/20/20), train the MLP with "
        "early stopping on validation, choose the operating point on validation and report "
        "the held-out test part. Changing the verifier invalidates semantic entries.",
    )
    verifier.add_argument(
        "--pairs",
        type=Path,
        default=QQP_PAIRS,
        help="labelled pairs (default: the checkout's data/qqp/qqp_pairs_dev.jsonl.gz)",
    )
    verifier.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_VERIFIER_DIR,
        help="folder to write (default: the shipped verifier, replaced)",
    )
    verifier.add_argument("--target-precision", type=float, default=0.95)
    verifier.add_argument("--hidden", type=int, default=256, help="hidden units of the MLP")
    verifier.add_argument("--epochs", type=int, default=40, help="most epochs")
    verifier.add_argument("--seed", type=int, default=0)
    verifier.add_argument(
        "--min-threshold", type=float, default=0.5, help="lowest cosine threshold to consider"
    )
    verifier.set_defaults(func=cmd_train_verifier)

    classifier = sub.add_parser(
        "train-classifier",
        help="retrain the embedded classifier's head (sentiment over the cache encoder)",
        description="Train the embedded classifier's linear head on labelled sentences "
        "(JSONL of {text, label}, labels POSITIVE / NEGATIVE) over the cache's encoder.",
    )
    classifier.add_argument(
        "--examples", type=Path, default=DEFAULT_EXAMPLES, help="default: the shipped examples"
    )
    classifier.add_argument(
        "--out", type=Path, default=DEFAULT_HEAD, help="default: the shipped head, replaced"
    )
    classifier.set_defaults(func=cmd_train_classifier)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
