"""``semcache train-verifier`` and ``train-classifier``: retrain the shipped models."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from backends.local.classifier import DEFAULT_EXAMPLES, DEFAULT_HEAD, build_head, save_head
from semcache.semantic.pair_verifier import DEFAULT_VERIFIER_DIR
from semcache.tuning.pairs import QQP_PAIRS
from semcache.tuning.train_verifier import COSINE_ONLY_THRESHOLDS, train_verifier
from server.encoders import load_encoder


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


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verifier = commands.add_parser(
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

    classifier = commands.add_parser(
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
