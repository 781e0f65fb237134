"""Issue 4 experiment: a FULL fine-tune of all-MiniLM-L6-v2 as a bi-encoder on the train split.

    .venv/bin/python -m bench.diagnostics.bi_encoder_full --minutes 15

Mean-pooled, normalised vectors; loss = BCE on a learnt affine map of the pair's cosine
(logit = scale * (cos - bias)), each batch of 32 train pairs. Time-boxed like
``bench.diagnostics.cross_encoder_full``. Then every text of the three splits is encoded with
the tuned model and the verifier features are rebuilt from those vectors: scores of an MLP
(``train_verifier.train_mlp``, shipped recipe) and of HGB over the tuned cosine + the
shipped lexical features + the extra ones + the shipped MiniLM cosine go to
``.data/verifier_experiments/scores-bi_{mlp,hgb}.npz`` and are evaluated as the others.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from backends.sentence_model import package_model_dir
from bench.diagnostics.verifier_experiments import (
    COS,
    SPLITS,
    _hgb,
    evaluate,
    extra_features,
    load_base,
    save_scores,
)


def embed(model, tokenizer, texts, grad=False):
    enc = tokenizer(texts, truncation=True, max_length=64, padding=True, return_tensors="pt")
    with torch.set_grad_enabled(grad):
        out = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=15)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    parts, x, y = load_base()
    if args.smoke:
        parts = {s: parts[s][:400] for s in SPLITS}
        x = {s: x[s][:400] for s in SPLITS}
        y = {s: y[s][:400] for s in SPLITS}
    train = parts["train"]
    model_dir = package_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir)
    scale = torch.nn.Parameter(torch.tensor(20.0))
    bias = torch.nn.Parameter(torch.tensor(0.8))
    steps = int(len(train) / args.batch * args.epochs)
    optimiser = torch.optim.AdamW(
        [{"params": model.parameters(), "lr": args.lr}, {"params": [scale, bias], "lr": 1e-2}],
        weight_decay=0.01,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min((s + 1) / 50, max(0.0, (steps - s) / steps))
    )
    loss_fn = torch.nn.BCEWithLogitsLoss()
    started = time.time()
    order = rng.permutation(len(train))
    model.train()
    step = 0
    for step in range(steps):
        idx = order[(step * args.batch) % len(order) :][: args.batch]
        a = embed(model, tokenizer, [train[i].text_a for i in idx], grad=True)
        b = embed(model, tokenizer, [train[i].text_b for i in idx], grad=True)
        labels = torch.tensor([float(train[i].label) for i in idx])
        loss = loss_fn(scale * ((a * b).sum(-1) - bias), labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        if (step + 1) % 50 == 0:
            print(
                f"step {step + 1}/{steps} loss {loss.item():.4f} {time.time() - started:.0f} s",
                flush=True,
            )
        if time.time() - started > args.minutes * 60:
            break
    print(f"trained {step + 1} steps in {time.time() - started:.0f} s", flush=True)
    model.eval()
    texts = sorted({t for s in SPLITS for p in parts[s] for t in (p.text_a, p.text_b)})
    row = {t: i for i, t in enumerate(texts)}
    vectors = np.zeros((len(texts), 384), dtype=np.float32)
    by_len = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    t0 = time.time()
    for start in range(0, len(by_len), 128):
        idx = by_len[start : start + 128]
        vectors[idx] = embed(model, tokenizer, [texts[i] for i in idx]).numpy()
    print(f"encoded {len(texts)} texts in {time.time() - t0:.0f} s", flush=True)
    from semcache.semantic.pair_verifier import PairVerifier
    from semcache.tuning.train_verifier import train_mlp

    feats, tuned_cos = {}, {}
    for s in SPLITS:
        u = vectors[[row[p.text_a] for p in parts[s]]]
        v = vectors[[row[p.text_b] for p in parts[s]]]
        lexical = x[s][:, COS + 1 :]
        tuned_cos[s] = (u * v).sum(1)
        feats[s] = np.hstack([u * v, np.abs(u - v), tuned_cos[s][:, None], lexical])
    w = train_mlp(
        feats["train"], y["train"], feats["val"], y["val"], hidden=256, seed=0, epochs=40, log=False
    )
    mlp = PairVerifier(w)
    scores = {s: mlp.probabilities_of_features(feats[s]) for s in SPLITS}
    if args.smoke:
        print("smoke ok", {s: v.shape for s, v in scores.items()})
        return 0
    save_scores("bi_mlp", scores)
    cos = {s: x[s][:, COS] for s in SPLITS}  # candidates still come from the shipped index
    evaluate("bi_mlp", scores, cos, y)
    xe = {
        s: np.hstack([tuned_cos[s][:, None], x[s][:, COS:], extra_features(parts[s])])
        for s in SPLITS
    }
    scores = _hgb(xe, y, random_state=1)
    save_scores("bi_hgb", scores)
    evaluate("bi_hgb", scores, cos, y)
    evaluate("bi_cosine_alone", {s: (tuned_cos[s] + 1) / 2 for s in SPLITS}, cos, y)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
