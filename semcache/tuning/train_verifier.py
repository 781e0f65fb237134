"""Train the pair verifier on the checkout's QQP pairs, reproducibly.

    semcache train-verifier [--pairs FILE] [--out FOLDER] [--target-precision 0.95]

Steps: split the pairs by connected component (60 % train, 20 % validation, 20 % test,
see ``semcache.tuning.pairs``); encode every text with the cache's encoder (cached under
``.data/embeddings``); train a small MLP on the train part with early stopping on the
validation loss; choose the operating point (cosine threshold, verifier probability) on
the validation part; report the held-out test part, which no choice ever looked at. Seeds
and thread counts are fixed, so a rerun on the same machine gives the same weights and
version.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from semcache.semantic.encoder import Encoder
from semcache.semantic.pair_verifier import (
    DEFAULT_VERIFIER_DIR,
    FEATURE_SPEC,
    PairVerifier,
    Setting,
    SplitMetrics,
    VerifierMeta,
    pair_features,
)
from semcache.tuning.calibrate import THRESHOLDS, CurvePoint, best_verified_point, point
from semcache.tuning.pairs import (
    QQP_PAIRS,
    EmbeddedTexts,
    Pair,
    embed_texts,
    load_pairs,
    split_pairs,
    unique_texts,
)

COSINE_ONLY_THRESHOLDS = (0.8, 0.9, 0.95, 0.99)
"""Thresholds whose cosine-alone test metrics the verifier's metadata records."""


def features_of(pairs: Sequence[Pair], embedded: EmbeddedTexts) -> tuple[np.ndarray, np.ndarray]:
    u, v = embedded.pair_vectors(pairs)
    x = pair_features(u, v, [p.text_a for p in pairs], [p.text_b for p in pairs])
    y = np.asarray([p.label for p in pairs], dtype=np.float32)
    return x, y


def split_metrics(point: CurvePoint, pairs: int, positives: int) -> SplitMetrics:
    return SplitMetrics(
        pairs=pairs,
        positives=positives,
        precision=point.precision,
        recall=point.recall,
        hit_rate=point.hit_rate,
    )


def choose_setting(
    cosine: np.ndarray,
    probs: np.ndarray,
    labels: np.ndarray,
    target_precision: float,
    min_hits: int = 100,
    min_threshold: float = 0.5,
) -> tuple[Setting, CurvePoint]:
    """The verified operating point with the highest validation recall whose validation
    precision (measured on at least ``min_hits`` hits) reaches the target.

    Cosine thresholds start at ``min_threshold``: with the verifier deciding, the cosine
    threshold only bounds which neighbours are worth asking it about.
    """
    correct = labels == 1
    options = [
        found
        for threshold in THRESHOLDS
        if threshold >= min_threshold
        and (
            found := best_verified_point(
                cosine, probs, correct, threshold, target_precision, min_hits, lower_bound=False
            )
        )
    ]
    if not options:
        raise RuntimeError(f"no setting reaches precision {target_precision} on validation")
    best = max(options, key=lambda p: (p.recall, -p.threshold))
    assert best.min_prob is not None
    return Setting(threshold=best.threshold, min_prob=best.min_prob), best


def train_mlp(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    *,
    hidden: int,
    seed: int,
    epochs: int,
    patience: int = 4,
    log: bool = True,
) -> dict[str, np.ndarray]:
    """Train features -> hidden ReLU -> 1 with Adam and early stopping on validation loss."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a fixed reduction order: the same weights on every rerun
    torch.use_deterministic_algorithms(True)
    mean = x_train.mean(axis=0)
    scale = x_train.std(axis=0) + 1e-6
    xt = torch.from_numpy((x_train - mean) / scale)
    yt = torch.from_numpy(y_train)
    xv = torch.from_numpy((x_val - mean) / scale)
    yv = torch.from_numpy(y_val)
    model = torch.nn.Sequential(
        torch.nn.Dropout(0.1),
        torch.nn.Linear(xt.shape[1], hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(hidden, 1),
    )
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(seed)
    best_loss, best_state, stale = float("inf"), None, 0
    bar = tqdm(range(epochs), desc="train verifier", unit="epoch", disable=None if log else True)
    for _ in bar:
        model.train()
        order = torch.randperm(len(xt), generator=generator)
        for start in range(0, len(xt), 256):
            batch = order[start : start + 256]
            optimiser.zero_grad()
            loss = loss_fn(model(xt[batch]).squeeze(1), yt[batch])
            loss.backward()
            optimiser.step()
        model.eval()
        with torch.no_grad():
            val_loss = float(loss_fn(model(xv).squeeze(1), yv))
        bar.set_postfix(validation_loss=f"{val_loss:.4f}")
        if val_loss < best_loss - 1e-4:
            best_loss, stale = val_loss, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            stale += 1
            if stale >= patience:
                break
    bar.close()
    assert best_state is not None
    return {
        "mean": mean.astype(np.float32),
        "scale": scale.astype(np.float32),
        "w1": best_state["1.weight"].numpy().T.copy(),
        "b1": best_state["1.bias"].numpy().copy(),
        "w2": best_state["4.weight"].numpy().T.copy(),
        "b2": best_state["4.bias"].numpy().copy(),
    }


def train_verifier(
    pairs_path: Path = QQP_PAIRS,
    out: Path = DEFAULT_VERIFIER_DIR,
    *,
    encoder: Encoder,
    target_precision: float = 0.95,
    hidden: int = 256,
    epochs: int = 40,
    seed: int = 0,
    min_threshold: float = 0.5,
) -> VerifierMeta:
    """Train, choose the operating point, save to ``out``; returns what was saved.

    The default ``out`` is the shipped verifier (package data): retraining replaces it.
    """
    pairs = load_pairs(pairs_path)
    parts = split_pairs(pairs)
    embedded = embed_texts(encoder, unique_texts(pairs))
    x_train, y_train = features_of(parts["train"], embedded)
    x_val, y_val = features_of(parts["val"], embedded)
    x_test, y_test = features_of(parts["test"], embedded)
    weights = train_mlp(x_train, y_train, x_val, y_val, hidden=hidden, seed=seed, epochs=epochs)
    verifier = PairVerifier(weights)
    cos_index = 2 * encoder.dimensions  # the cosine column of pair_features
    val_probs = verifier.probabilities_of_features(x_val)
    setting, val_point = choose_setting(
        x_val[:, cos_index],
        val_probs,
        y_val.astype(int),
        target_precision,
        min_threshold=min_threshold,
    )
    test_probs = verifier.probabilities_of_features(x_test)
    test_cos = x_test[:, cos_index]
    positive = y_test == 1
    n_test, n_pos = len(y_test), int(positive.sum())
    test_point = point(
        (test_cos >= setting.threshold) & (test_probs >= setting.min_prob),
        positive,
        setting.threshold,
        setting.min_prob,
    )
    val_metrics = split_metrics(val_point, len(y_val), int((y_val == 1).sum()))
    test_metrics = split_metrics(test_point, n_test, n_pos)
    cosine_only = [
        split_metrics(point(test_cos >= t, positive, t), n_test, n_pos)
        for t in COSINE_ONLY_THRESHOLDS
    ]
    meta = VerifierMeta(
        version=verifier.version,
        feature_spec=FEATURE_SPEC,
        encoder_version=encoder.version,
        hidden=hidden,
        recommended=setting,
        target_precision=target_precision,
        validation=val_metrics,
        test=test_metrics,
        test_cosine_only=cosine_only,
        training={
            "pairs": pairs_path.name,
            "split": "connected components of texts, sha256 buckets 60/20/20",
            "train_pairs": len(parts["train"]),
            "seed": seed,
            "epochs_max": epochs,
            "min_threshold": min_threshold,
        },
    )
    verifier.save(out, meta)
    return meta
