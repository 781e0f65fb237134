"""``semcache calibrate``: the semantic matcher's precision and hit rate on labelled pairs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from backends.local.classifier import load_classifier as embedded_classifier
from semcache.tuning.calibrate import TASKS, calibrate_file, format_report
from server.encoders import load_encoder


def _refused(why: str) -> int:
    print(f"semcache: cannot calibrate: {why}", file=sys.stderr)
    return 2


def _emit(args: argparse.Namespace, result: object, text: Callable[[], str]) -> int:
    """``result`` as JSON with ``--json``, else as ``text()`` renders it."""
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result)).decode() + "\n")
    else:
        print(text())
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.sources is not None:
        return _calibrate_mixed(args)
    if args.pairs is None:
        return _refused("--pairs FILE (or --stream --sources)")
    if not args.pairs.is_file():
        return _refused(f"no pairs file {args.pairs}")
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
        return _refused(str(exc))
    return _emit(args, report, lambda: format_report(report))


def _calibrate_stream(args: argparse.Namespace) -> int:
    """``calibrate --stream``: verified caching vs static thresholds on a replayed stream."""
    from semcache.semantic.verified.decisions import VerifiedParams
    from semcache.tuning.stream_eval import compare_file
    from semcache.tuning.stream_report import format_comparison

    if args.task != "chat":
        return _refused("--stream is for --task chat")
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
        return _refused(str(exc))
    return _emit(args, rows, lambda: format_comparison(rows))


def _calibrate_mixed(args: argparse.Namespace) -> int:
    """``calibrate --stream --sources a,b``: the stream evaluation on a mixed workload."""
    from backends.local.classifier import DEFAULT_EXAMPLES
    from semcache.semantic.verified.decisions import VerifiedParams
    from semcache.tuning.mixed import mixed_stream
    from semcache.tuning.pairs import PARAPHRASE_PAIRS, QQP_PAIRS
    from semcache.tuning.stream_eval import compare_stream
    from semcache.tuning.stream_report import format_comparison, format_sources

    if args.task != "chat" or not args.stream:
        return _refused("--sources is for --task chat --stream")
    files = {"qqp": QQP_PAIRS, "paraphrase": PARAPHRASE_PAIRS, "classify": DEFAULT_EXAMPLES}
    names = [name.strip() for name in args.sources.split(",") if name.strip()]
    try:
        stream = mixed_stream(
            names,
            files,
            seed=args.seed,
            limit=args.limit,
            repeated=args.repeated,
            clusters=args.clusters,
        )
        rows = compare_stream(
            stream,
            VerifiedParams(max_error=0.05),  # the rule's defaults; each max_error is run
            encoder=load_encoder(),
            seed=args.seed,
            use_verifier=not args.no_verifier,
        )
    except (OSError, ValueError) as exc:
        return _refused(str(exc))
    return _emit(args, rows, lambda: f"{format_comparison(rows)}\n{format_sources(rows)}")


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="precision and hit rate of the semantic matcher on your labelled pairs",
        description="Precision and hit rate per cosine threshold (alone and with the "
        "verifier) on a JSONL file of labelled pairs, one a line: "
        '{"text_a": ..., "text_b": ..., "label": 0 or 1} (1: they mean the same), or '
        '{"origin": ..., "similar": ...} (read as label 1); and the policy setting with the '
        "highest hit rate that reaches the target precision.",
    )
    calibrate.add_argument(
        "--pairs",
        type=Path,
        default=None,
        help='JSONL (or .jsonl.gz) of {"text_a", "text_b", "label"} rows (unless --sources)',
    )
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
    calibrate.add_argument(
        "--sources",
        default=None,
        help="--stream: a mixed workload instead of --pairs, comma-separated from qqp, "
        "paraphrase, templates (generated with --seed), classify (the embedded classifier's "
        "labelled sentences); --limit and --repeated apply per source; reported per source",
    )
    calibrate.set_defaults(func=cmd_calibrate)
