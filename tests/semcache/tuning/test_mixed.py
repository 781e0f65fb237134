"""The mixed workload (semcache.tuning.mixed, build_mixed_stream) and its per-source report."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from semcache.semantic.verified.decisions import VerifiedParams
from semcache.tuning.mixed import classification_pairs, mixed_stream
from semcache.tuning.stream_build import Stream, build_mixed_stream, source_stream
from semcache.tuning.stream_eval import compare
from semcache.tuning.stream_policies import run_static
from semcache.tuning.stream_report import format_sources


def _stream(prefix: str, clusters: list[int]) -> Stream:
    return Stream(texts=[f"{prefix}{i}" for i in range(len(clusters))], cluster=clusters)


def test_sources_are_interleaved_in_their_own_order_with_clusters_apart() -> None:
    parts = {"a": _stream("a", [0, 0, 1, 1]), "b": _stream("b", [0, 1, 0])}
    mixed = build_mixed_stream(parts, seed=5)
    assert sorted(mixed.texts) == sorted(parts["a"].texts + parts["b"].texts)
    assert build_mixed_stream(parts, seed=5) == mixed
    assert any(build_mixed_stream(parts, seed=s).source != mixed.source for s in range(6))
    for name, part in parts.items():
        alone = source_stream(mixed, name)
        assert alone.texts == part.texts  # each source keeps its order
        assert [t[0] for t in alone.texts] == alone.source == [name] * len(part.texts)
    by_text = dict(zip(mixed.texts, mixed.cluster, strict=True))
    assert by_text["a0"] == by_text["a1"] != by_text["b0"]  # cluster 0 of a is not b's
    assert by_text["b0"] == by_text["b2"]


def test_a_text_in_two_sources_is_asked_once() -> None:
    mixed = build_mixed_stream({"a": _stream("x", [0, 1]), "b": _stream("x", [0, 0])}, seed=0)
    assert sorted(mixed.texts) == ["x0", "x1"]


def test_runs_and_the_report_count_each_source_apart() -> None:
    # Source "near": its duplicates at 0.95 and its non-duplicates at 0.93 (hard negatives);
    # source "far": duplicates at 0.90, others at 0.5. One threshold cannot serve both.
    parts = {"near": _stream("n", [0, 0, 1, 1, 2, 2, 3]), "far": _stream("f", [0, 0, 1, 1, 1])}
    stream = build_mixed_stream(parts, seed=1)
    n = len(stream.texts)
    sims = np.full((n, n), 0.5)
    for i in range(n):
        for j in range(n):
            if stream.source[i] == stream.source[j] == "near":
                sims[i, j] = 0.95 if stream.cluster[i] == stream.cluster[j] else 0.93
            elif stream.cluster[i] == stream.cluster[j]:
                sims[i, j] = 0.90
    np.fill_diagonal(sims, 1.0)

    def score(i: int, j: int) -> float:
        return float(sims[i, j])

    loose = run_static(stream, sims, score, 0.85)
    assert set(loose.by_source) == {"near", "far"}
    assert sum(o.hits for o in loose.by_source.values()) == loose.hits
    assert sum(o.wrong for o in loose.by_source.values()) == loose.wrong
    assert loose.by_source["far"].wrong == 0 and loose.by_source["near"].wrong > 0
    assert run_static(stream, sims, score, 0.94).by_source["near"].wrong == 0
    vectors = np.linalg.cholesky(sims + 1e-6 * np.eye(n))
    params = VerifiedParams(max_error=0.05)
    (row,) = compare(stream, vectors, params, verifier=None, floor=0.5, seed=0, deltas=(0.05,))
    best = row.static_cosine_every_source
    assert best is not None and all(o.error_rate <= 0.05 for o in best.by_source.values())
    assert set(row.ceiling_by_source) == {"near", "far"}
    assert row.ceiling_by_source["far"] == 3 and row.ceiling_by_source["near"] == 3
    assert set(row.verified_cosine.by_source) == {"near", "far"}
    text = format_sources([row])
    assert "static, every source" in text and "verified / static every source" in text
    assert len(re.findall(r"overall +\d+ +\d+ ", text)) == 3  # a total row per policy


def test_classification_prompts_are_one_cluster_per_label(tmp_path: Path) -> None:
    path = tmp_path / "labelled.jsonl"
    rows = [("good film", "POSITIVE"), ("great film", "POSITIVE"), ("bad film", "NEGATIVE")]
    path.write_text("".join(f'{{"text": "{t}", "label": "{lab}"}}\n' for t, lab in rows))
    pairs = classification_pairs(path)
    assert sum(p.label == 1 for p in pairs) == 1 and sum(p.label == 0 for p in pairs) == 1
    assert len(classification_pairs(path, limit=2, seed=0)) <= 2
    labelled = tmp_path / "pairs.jsonl"
    labelled.write_text('{"text_a": "q1", "text_b": "q2", "label": 1}\n')
    stream = mixed_stream(
        ["classify", "templates", "qqp"], {"classify": path, "qqp": labelled}, seed=0, limit=4
    )
    assert set(stream.source) == {"classify", "templates", "qqp"}
    by_text = dict(zip(stream.texts, stream.cluster, strict=True))
    good, great = (t for t in stream.texts if "good" in t or "great" in t)
    assert by_text[good] == by_text[great] and by_text["q1"] == by_text["q2"]
    # the sentences as the classification route caches them: the same clusters, no prompt
    sentences = mixed_stream(["sentences"], {"classify": path}, seed=0)
    assert sorted(sentences.texts) == ["bad film", "good film", "great film"]
    same = dict(zip(sentences.texts, sentences.cluster, strict=True))
    assert same["good film"] == same["great film"] != same["bad film"]


def test_an_unknown_source_or_a_missing_file_is_refused() -> None:
    with pytest.raises(ValueError, match="nope"):
        mixed_stream(["nope"], {}, seed=0)
    with pytest.raises(ValueError, match="no file for source 'qqp'"):
        mixed_stream(["qqp"], {}, seed=0)
