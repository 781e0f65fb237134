"""The templated hard-negative generator (semcache.tuning.templates): labels by construction."""

from __future__ import annotations

from semcache.tuning.stream_build import build_stream
from semcache.tuning.templates import FAMILIES, generate_template_pairs


def test_a_label_is_one_exactly_when_family_and_fill_are_the_same() -> None:
    made = generate_template_pairs(seed=7, groups=6, variants=3)
    labels = {p.label for p in made.pairs}
    assert labels == {0, 1}
    for pair in made.pairs:
        same = made.meaning[pair.text_a] == made.meaning[pair.text_b]
        assert pair.label == int(same)
    # A negative differs from its base in one slot only, in the same phrasing.
    for pair in (p for p in made.pairs if p.label == 0):
        a, b = made.meaning[pair.text_a].split("|"), made.meaning[pair.text_b].split("|")
        assert a[0] == b[0] and sum(x != y for x, y in zip(a, b, strict=True)) == 1


def test_the_stream_clusters_are_the_meanings() -> None:
    made = generate_template_pairs(seed=1, groups=4, variants=2)
    stream = build_stream(made.pairs, limit=None, seed=0)
    for text, cluster in zip(stream.texts, stream.cluster, strict=True):
        for other, other_cluster in zip(stream.texts, stream.cluster, strict=True):
            assert (cluster == other_cluster) == (made.meaning[text] == made.meaning[other])
    # Every fill is asked in all its phrasings: label-1 repeats exist.
    assert len(set(stream.cluster)) < len(stream.texts)


def test_a_seed_gives_the_same_pairs_and_another_seed_others() -> None:
    first = generate_template_pairs(seed=3)
    assert generate_template_pairs(seed=3) == first
    assert generate_template_pairs(seed=4).pairs != first.pairs
    assert {m.split("|")[0] for m in first.meaning.values()} == {f.name for f in FAMILIES}
