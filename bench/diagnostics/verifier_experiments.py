"""Experiments toward issue 4's chat target: other verifiers on the same QQP splits.

    .venv/bin/python -m bench.diagnostics.verifier_experiments [--only NAME ...]

Every method is trained on the train split only; its operating point (cosine threshold,
min_prob) is chosen on validation with ``train_verifier.choose_setting`` (the shipped
procedure); the test split is only reported. Scores of each method are saved under
``.data/verifier_experiments`` so ensembles can reuse them.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from bench.support import bootstrap_interval
from semcache.tuning.calibrate import point
from semcache.tuning.pairs import QQP_PAIRS, Pair, load_pairs, split_pairs
from semcache.tuning.train_verifier import choose_setting

OUT = Path(".data/verifier_experiments")
SPLITS = ("train", "val", "test")


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    # average ranks for ties
    s = scores[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        if j > i:
            ranks[order[i : j + 1]] = (i + j + 2) / 2
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def top_k_precision(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    order = np.argsort(-scores, kind="mergesort")[:k]
    return float((labels[order] == 1).mean())


def bootstrap_ci(hits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """90 % percentile interval of the precision over test pairs resampled with replacement."""

    def precision(rng: np.random.Generator) -> float:
        idx = rng.integers(0, len(labels), len(labels))
        h = hits[idx]
        return float((labels[idx][h] == 1).mean()) if h.sum() else float("nan")

    return bootstrap_interval(precision, level=0.90)


def evaluate(name: str, scores: dict[str, np.ndarray], cos: dict[str, np.ndarray], y) -> dict:
    try:
        setting, val_point = choose_setting(cos["val"], scores["val"], y["val"].astype(int), 0.95)
    except RuntimeError:
        print(
            f"{name:34s} no setting reaches 0.95 on validation; "
            f"AUC {auc(scores['test'], y['test']):.3f} (val {auc(scores['val'], y['val']):.3f}) "
            f"top300/400/500 "
            + "/".join(
                f"{top_k_precision(scores['test'], y['test'], k):.3f}" for k in (300, 400, 500)
            )
            + " (val "
            + "/".join(
                f"{top_k_precision(scores['val'], y['val'], k):.3f}" for k in (300, 400, 500)
            )
            + ")",
            flush=True,
        )
        return {}
    hits = (cos["test"] >= setting.threshold) & (scores["test"] >= setting.min_prob)
    test_point = point(hits, y["test"] == 1, setting.threshold, setting.min_prob)
    lo, hi = bootstrap_ci(hits, y["test"])
    row = {
        "method": name,
        "threshold": setting.threshold,
        "min_prob": setting.min_prob,
        "val_p": val_point.precision,
        "val_r": val_point.recall,
        "val_hits": val_point.hits,
        "test_p": test_point.precision,
        "test_r": test_point.recall,
        "test_hits": test_point.hits,
        "test_ci": (lo, hi),
        "test_auc": auc(scores["test"], y["test"]),
        "val_auc": auc(scores["val"], y["val"]),
        **{f"top{k}": top_k_precision(scores["test"], y["test"], k) for k in (300, 400, 500)},
        **{f"vtop{k}": top_k_precision(scores["val"], y["val"], k) for k in (300, 400, 500)},
    }
    print(
        f"{name:34s} t={row['threshold']:.2f} p>={row['min_prob']:.3f} "
        f"val {row['val_p']:.3f}/{row['val_r']:.3f} ({row['val_hits']}) "
        f"test {row['test_p']:.3f}/{row['test_r']:.3f} ({row['test_hits']}) "
        f"CI90 [{lo:.3f},{hi:.3f}] AUC {row['test_auc']:.3f} (val {row['val_auc']:.3f}) "
        f"top300/400/500 {row['top300']:.3f}/{row['top400']:.3f}/{row['top500']:.3f} "
        f"(val {row['vtop300']:.3f}/{row['vtop400']:.3f}/{row['vtop500']:.3f})",
        flush=True,
    )
    return row


def load_base() -> tuple[dict[str, list[Pair]], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Splits, shipped pair features (cached) and labels."""
    parts = split_pairs(load_pairs(QQP_PAIRS))
    cache = OUT / "features.npz"
    if cache.is_file():
        with np.load(cache) as f:
            x = {s: f[f"x_{s}"] for s in SPLITS}
            y = {s: f[f"y_{s}"] for s in SPLITS}
        return parts, x, y
    from semcache.tuning.pairs import embed_texts, unique_texts
    from semcache.tuning.train_verifier import features_of
    from server.encoders import load_encoder

    encoder = load_encoder(threads=1)
    pairs = [p for s in SPLITS for p in parts[s]]
    embedded = embed_texts(encoder, unique_texts(pairs))
    x, y = {}, {}
    for s in SPLITS:
        x[s], y[s] = features_of(parts[s], embedded)
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **{f"x_{s}": x[s] for s in SPLITS}, **{f"y_{s}": y[s] for s in SPLITS})
    return parts, x, y


COS = 2 * 384


def save_scores(name: str, scores: dict[str, np.ndarray]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(OUT / f"scores-{name}.npz", **scores)


def load_scores(name: str) -> dict[str, np.ndarray] | None:
    path = OUT / f"scores-{name}.npz"
    if not path.is_file():
        return None
    with np.load(path) as f:
        return {s: f[s] for s in f.files}


# ---- methods --------------------------------------------------------------------------


def m_shipped(parts, x, y) -> dict[str, np.ndarray]:
    from semcache.semantic.pair_verifier import load_verifier

    v = load_verifier()
    return {s: v.probabilities_of_features(x[s]) for s in SPLITS}


def m_mlp_retrained(parts, x, y) -> dict[str, np.ndarray]:
    from semcache.semantic.pair_verifier import PairVerifier
    from semcache.tuning.train_verifier import train_mlp

    w = train_mlp(x["train"], y["train"], x["val"], y["val"], hidden=256, seed=0, epochs=40)
    v = PairVerifier(w)
    return {s: v.probabilities_of_features(x[s]) for s in SPLITS}


HGB_PARAMS: dict[str, Any] = dict(
    max_iter=600,
    learning_rate=0.05,
    max_leaf_nodes=31,
    min_samples_leaf=40,
    l2_regularization=1.0,
    early_stopping=True,
    validation_fraction=0.1,
    n_iter_no_change=30,
    random_state=0,
)


def _hgb(x, y, **kw) -> dict[str, np.ndarray]:
    from sklearn.ensemble import HistGradientBoostingClassifier

    params = {**HGB_PARAMS, **kw}
    clf = HistGradientBoostingClassifier(**params)
    started = time.time()
    clf.fit(x["train"], y["train"])
    print(f"  hgb fit {time.time() - started:.0f} s, {clf.n_iter_} iterations", flush=True)
    return {s: clf.predict_proba(x[s])[:, 1].astype(np.float32) for s in SPLITS}


def m_hgb(parts, x, y):
    return _hgb(x, y)


def m_hgb_lex(parts, x, y):
    """HGB over cos + lexical + extra lexical features only (no u*v / |u-v|)."""
    xe = {s: np.hstack([x[s][:, COS:], extra_features(parts[s])]) for s in SPLITS}
    return _hgb(xe, y)


def m_hgb_lex_seed(seed: int) -> Callable:
    def run(parts, x, y):
        xe = {s: np.hstack([x[s][:, COS:], extra_features(parts[s])]) for s in SPLITS}
        return _hgb(xe, y, random_state=seed)

    return run


def m_hgb_lex_stack(parts, x, y):
    """HGB over cos + lexical + extra + the MLP's out-of-fold probability (5 folds on train)."""
    from semcache.semantic.pair_verifier import PairVerifier
    from semcache.tuning.train_verifier import train_mlp

    n = len(y["train"])
    fold = np.random.default_rng(0).integers(0, 5, n)
    oof = np.zeros(n, dtype=np.float32)
    for k in range(5):
        tr, te = fold != k, fold == k
        w = train_mlp(
            x["train"][tr],
            y["train"][tr],
            x["train"][te],
            y["train"][te],
            hidden=256,
            seed=0,
            epochs=40,
            log=False,
        )
        oof[te] = PairVerifier(w).probabilities_of_features(x["train"][te])
    w = train_mlp(
        x["train"], y["train"], x["val"], y["val"], hidden=256, seed=0, epochs=40, log=False
    )
    full = PairVerifier(w)
    mlp = {"train": oof, **{s: full.probabilities_of_features(x[s]) for s in ("val", "test")}}
    xe = {s: np.hstack([x[s][:, COS:], extra_features(parts[s]), mlp[s][:, None]]) for s in SPLITS}
    return _hgb(xe, y)


def m_hgb_all(parts, x, y):
    xe = {s: np.hstack([x[s], extra_features(parts[s])]) for s in SPLITS}
    return _hgb(xe, y)


def m_mlp_extra(parts, x, y):
    from semcache.semantic.pair_verifier import PairVerifier
    from semcache.tuning.train_verifier import train_mlp

    xe = {s: np.hstack([x[s], extra_features(parts[s])]) for s in SPLITS}
    w = train_mlp(xe["train"], y["train"], xe["val"], y["val"], hidden=256, seed=0, epochs=40)
    v = PairVerifier(w)
    return {s: v.probabilities_of_features(xe[s]) for s in SPLITS}


def m_logreg(parts, x, y):
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    xe = {s: np.hstack([x[s], extra_features(parts[s])]) for s in SPLITS}
    sc = StandardScaler().fit(xe["train"])
    clf = LogisticRegression(C=0.05, max_iter=2000).fit(sc.transform(xe["train"]), y["train"])
    return {s: clf.predict_proba(sc.transform(xe[s]))[:, 1].astype(np.float32) for s in SPLITS}


_EXTRA_CACHE: dict[int, np.ndarray] = {}


def extra_features(pairs: list[Pair]) -> np.ndarray:
    key = id(pairs)
    if key not in _EXTRA_CACHE:
        _EXTRA_CACHE[key] = np.asarray([_extra(p.text_a, p.text_b) for p in pairs], np.float32)
    return _EXTRA_CACHE[key]


def _extra(a: str, b: str) -> list[float]:
    import difflib
    import re

    from semcache.semantic.pair_verifier import _STOP

    wa = re.findall(r"[a-z0-9]+", a.lower())
    wb = re.findall(r"[a-z0-9]+", b.lower())
    ca = [w for w in wa if w not in _STOP]
    cb = [w for w in wb if w not in _STOP]
    sa, sb = set(ca), set(cb)
    # light stemming: first 5 letters
    sta, stb = {w[:5] for w in ca}, {w[:5] for w in cb}
    char_ratio = difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()
    word_ratio = difflib.SequenceMatcher(None, wa, wb).ratio()
    content_ratio = difflib.SequenceMatcher(None, ca, cb).ratio()
    # character trigram jaccard
    ga = {a.lower()[i : i + 3] for i in range(max(0, len(a) - 2))}
    gb = {b.lower()[i : i + 3] for i in range(max(0, len(b) - 2))}
    tri = len(ga & gb) / max(1, len(ga | gb))
    stem_j = len(sta & stb) / max(1, len(sta | stb))
    only_a, only_b = sta - stb, stb - sta
    long_only = sum(1 for w in (sa - sb) | (sb - sa) if len(w) >= 6)
    digits_a = {w for w in wa if any(c.isdigit() for c in w)}
    digits_b = {w for w in wb if any(c.isdigit() for c in w)}
    caps_a = set(re.findall(r"\b[A-Z][A-Za-z]+", a[1:]))
    caps_b = set(re.findall(r"\b[A-Z][A-Za-z]+", b[1:]))
    caps_lower_a = {c.lower() for c in caps_a}
    caps_lower_b = {c.lower() for c in caps_b}
    caps_missing = len(caps_lower_a - set(wb)) + len(caps_lower_b - set(wa))
    first_a = wa[0] if wa else ""
    first_b = wb[0] if wb else ""
    first2 = float(wa[:2] == wb[:2])
    last_same = float(bool(ca) and bool(cb) and ca[-1] == cb[-1])
    return [
        char_ratio,
        word_ratio,
        content_ratio,
        tri,
        stem_j,
        float(min(len(only_a), len(only_b))),
        float(max(len(only_a), len(only_b))),
        float(min(long_only, 10)),
        float(digits_a != digits_b),
        float(min(caps_missing, 5)),
        float(first_a == first_b),
        first2,
        last_same,
        float(len(wa) + len(wb)),
        float(min(len(ca), len(cb)) / max(1, len(ca), len(cb))),
        float(a.count("?") != b.count("?")),
        float(("or" in wa) != ("or" in wb)),
        float(("vs" in wa or "versus" in wa) != ("vs" in wb or "versus" in wb)),
        float(bool({"best", "worst"} & set(wa)) != bool({"best", "worst"} & set(wb))),
    ]


def measure_cost(parts, x, y) -> None:
    """Per lookup with 4 candidates: the shipped MLP vs HGB over cos + lexical + extra."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    from semcache.semantic.pair_verifier import lexical_features, load_verifier

    xe = np.hstack([x["train"][:, COS:], extra_features(parts["train"])])
    clf = HistGradientBoostingClassifier(**{**HGB_PARAMS, "random_state": 1}).fit(xe, y["train"])
    mlp = load_verifier()
    test = parts["test"]
    for name in ("mlp", "hgb_lex"):
        times = []
        for i in range(0, 800, 4):
            group = test[i : i + 4]
            a, b = [p.text_a for p in group], [p.text_b for p in group]
            feats = x["test"][i : i + 4]
            t0 = time.perf_counter()
            if name == "mlp":
                mlp.probabilities_of_features(
                    np.hstack([feats[:, : COS + 1], lexical_features(a, b)])
                )
            else:
                row = np.hstack(
                    [
                        feats[:, COS : COS + 1],
                        lexical_features(a, b),
                        np.asarray([_extra(p, q) for p, q in zip(a, b, strict=True)], np.float32),
                    ]
                )
                clf.predict_proba(row)
            times.append(time.perf_counter() - t0)
        print(
            f"{name}: per lookup (4 candidates) p50 {np.median(times) * 1e3:.2f} ms "
            f"p99 {np.percentile(times, 99) * 1e3:.2f} ms"
        )


METHODS: dict[str, Callable] = {
    "shipped_mlp": m_shipped,
    "hgb": m_hgb,
    "hgb_lex": m_hgb_lex,
    "hgb_all": m_hgb_all,
    "hgb_lex_stack": m_hgb_lex_stack,
    **{f"hgb_lex_seed{k}": m_hgb_lex_seed(k) for k in (1, 2, 3)},
    "mlp_extra": m_mlp_extra,
    "logreg_all": m_logreg,
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--ensemble", nargs="*", default=None, help="mean of saved scores")
    parser.add_argument("--rank-ensemble", action="store_true")
    parser.add_argument("--cost", action="store_true", help="time hgb_lex per lookup")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    parts, x, y = load_base()
    print({s: len(parts[s]) for s in SPLITS}, flush=True)
    cos = {s: x[s][:, COS] for s in SPLITS}
    if args.cost:
        measure_cost(parts, x, y)
        return 0
    if args.ensemble:
        loaded = [load_scores(n) for n in args.ensemble]
        assert all(s is not None for s in loaded)
        scores = {s: np.mean([d[s] for d in loaded], axis=0) for s in SPLITS}  # type: ignore[index]
        evaluate("mean(" + "+".join(args.ensemble) + ")", scores, cos, y)
        return 0
    for name in args.only or list(METHODS):
        started = time.time()
        scores = load_scores(name)
        if scores is None:
            scores = METHODS[name](parts, x, y)
            save_scores(name, scores)
        print(f"  {name}: {time.time() - started:.0f} s", flush=True)
        evaluate(name, scores, cos, y)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
