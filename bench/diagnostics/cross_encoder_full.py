"""Issue 4 experiment: a FULL fine-tune (every weight) of all-MiniLM-L6-v2 as a cross-encoder.

    .venv/bin/python -m bench.diagnostics.cross_encoder_full --minutes 40

Trained on the train split only (each pair in a random order, linear warm-up and decay,
AdamW), time-boxed: the learning-rate schedule is laid out for ``--epochs`` and training
stops early when ``--minutes`` run out. Scores (one text order, a then b) for all three
splits go to ``.data/verifier_experiments/scores-ce_full.npz``; evaluate them with
``python -m bench.diagnostics.verifier_experiments --only ce_full``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from backends.sentence_model import package_model_dir
from bench.diagnostics.verifier_experiments import OUT, SPLITS
from semcache.tuning.pairs import QQP_PAIRS, load_pairs, split_pairs


def batches_by_length(pairs, tokenizer, batch, rng):
    """Shuffle, then sort within chunks of 50 batches by length (less padding)."""
    order = rng.permutation(len(pairs))
    chunk = batch * 50
    out = []
    for start in range(0, len(order), chunk):
        part = order[start : start + chunk]
        part = sorted(part, key=lambda i: len(pairs[i].text_a) + len(pairs[i].text_b))
        out.extend(part[i : i + batch] for i in range(0, len(part), batch))
    rng.shuffle(out)
    return out


def encode(tokenizer, a, b):
    return tokenizer(a, b, truncation=True, max_length=96, padding=True, return_tensors="pt")


@torch.no_grad()
def score(model, tokenizer, pairs, batch=64) -> np.ndarray:
    model.eval()
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].text_a) + len(pairs[i].text_b))
    out = np.zeros(len(pairs), dtype=np.float32)
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        enc = encode(tokenizer, [pairs[i].text_a for i in idx], [pairs[i].text_b for i in idx])
        out[idx] = torch.sigmoid(model(**enc).logits.squeeze(-1)).numpy()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=40)
    parser.add_argument("--epochs", type=float, default=1.5)
    parser.add_argument("--lr", type=float, default=4e-5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="ce_full")
    parser.add_argument("--smoke", action="store_true", help="tiny run to test the script")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    parts = split_pairs(load_pairs(QQP_PAIRS))
    model_dir = package_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    if args.smoke:
        parts = {s: parts[s][:64] for s in SPLITS}
    train = parts["train"]
    steps_per_epoch = (len(train) + args.batch - 1) // args.batch
    total = int(steps_per_epoch * args.epochs)
    warmup = int(0.06 * total)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": 0.01,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimiser = torch.optim.AdamW(groups, lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser,
        lambda s: (
            (s + 1) / max(1, warmup) if s < warmup else max(0.0, (total - s) / (total - warmup))
        ),
    )
    loss_fn = torch.nn.BCEWithLogitsLoss()
    started = time.time()
    step, running = 0, 0.0
    stop = False
    epoch = 0
    while step < total and not stop:
        for idx in batches_by_length(train, tokenizer, args.batch, rng):
            flip = rng.random(len(idx)) < 0.5
            a = [train[i].text_b if f else train[i].text_a for i, f in zip(idx, flip, strict=True)]
            b = [train[i].text_a if f else train[i].text_b for i, f in zip(idx, flip, strict=True)]
            labels = torch.tensor([float(train[i].label) for i in idx])
            model.train()
            enc = encode(tokenizer, a, b)
            loss = loss_fn(model(**enc).logits.squeeze(-1), labels)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            schedule.step()
            step += 1
            running = 0.98 * running + 0.02 * float(loss) if step > 1 else float(loss)
            elapsed = time.time() - started
            if step % 50 == 0:
                print(
                    f"epoch {epoch} step {step}/{total} loss {running:.4f} "
                    f"lr {schedule.get_last_lr()[0]:.2e} {elapsed:.0f} s",
                    flush=True,
                )
            if step >= total or elapsed > args.minutes * 60:
                stop = True
                break
        epoch += 1
    train_s = time.time() - started
    print(
        f"trained {step} steps ({step / steps_per_epoch:.2f} epochs) in {train_s:.0f} s", flush=True
    )
    model.save_pretrained(f"/tmp/{args.name}-model")
    tokenizer.save_pretrained(f"/tmp/{args.name}-model")
    scores = {}
    for s in ("val", "test"):
        t0 = time.time()
        scores[s] = score(model, tokenizer, parts[s])
        print(f"scored {s} in {time.time() - t0:.0f} s", flush=True)
    scores["train"] = np.zeros(len(train), dtype=np.float32)  # not scored (time)
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(OUT / f"scores-{args.name}.npz", **scores)
    # per-lookup cost: 4 candidates, one order
    q = parts["test"][:200]
    q = q[: len(q) // 4 * 4]
    times = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(q), 4):
            group = q[i : i + 4]
            t0 = time.perf_counter()
            enc = encode(tokenizer, [p.text_a for p in group], [p.text_b for p in group])
            model(**enc)
            times.append(time.perf_counter() - t0)
    print(
        f"cost per lookup (4 candidates, 1 thread): p50 {np.median(times) * 1e3:.1f} ms "
        f"p99 {np.percentile(times, 99) * 1e3:.1f} ms",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
