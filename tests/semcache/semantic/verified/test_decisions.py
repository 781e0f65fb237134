"""The verified-caching decision (semcache.semantic.verified.decisions), with a seeded RNG and
explicit judgement times."""

from __future__ import annotations

import random

import numpy as np
import pytest

from semcache.semantic.verified.decisions import (
    MAX_OBSERVATIONS,
    Action,
    Observation,
    PartitionPrior,
    VerifiedParams,
    decide,
    observed,
    pooled_prior,
)

PARAMS = VerifiedParams(max_error=0.05, min_observations=10, prior_weight=5.0, audit_rate=0.02)


def curve(t: float, gamma: float, similarity: float) -> float:
    return float(1.0 / (1.0 + np.exp(-gamma * (similarity - t))))


def judged(
    rng: random.Random, n: int, t: float, gamma: float, start: float = 0.0
) -> list[Observation]:
    """n observations drawn from a true curve, similarities uniform in [0.6, 1]."""
    out = []
    for i in range(n):
        s = rng.uniform(0.6, 1.0)
        out.append(
            Observation(similarity=s, correct=rng.random() < curve(t, gamma, s), at=start + i)
        )
    return out


def prior_of(observations: list[Observation]) -> PartitionPrior:
    prior = PartitionPrior()
    prior.add(observations)
    return prior


def test_a_partition_without_enough_observations_always_explores() -> None:
    own = [Observation(similarity=0.99, correct=True, at=float(i)) for i in range(9)]
    decision = decide(0.99, own, prior_of(own), PARAMS, uniform=0.999)
    assert decision.action is Action.EXPLORE
    assert decision.explore_probability == 1.0


def test_a_learned_curve_serves_above_its_threshold_and_explores_below() -> None:
    rng = random.Random(7)
    own = judged(rng, 60, t=0.8, gamma=80)
    prior = prior_of(own)
    high = decide(0.97, own, prior, PARAMS, uniform=0.5)
    assert high.action is Action.EXPLOIT and high.explore_probability == PARAMS.audit_rate
    assert high.lower_bound >= 0.95
    audited = decide(0.97, own, prior, PARAMS, uniform=0.01)
    assert audited.action is Action.EXPLORE  # the audit draw
    low = decide(0.65, own, prior, PARAMS, uniform=0.99)
    assert low.action is Action.EXPLORE and low.explore_probability == 1.0
    assert low.p_correct < 0.1


def test_the_lower_bound_never_exceeds_the_posterior_mean() -> None:
    rng = random.Random(3)
    own = judged(rng, 12, t=0.85, gamma=30)
    prior = prior_of(own)
    for s in np.linspace(0.6, 1.0, 21):
        d = decide(float(s), own, prior, PARAMS, uniform=0.5)
        assert d.lower_bound <= d.p_correct + 1e-12


def test_a_new_entry_starts_from_its_partitions_prior() -> None:
    rng = random.Random(11)
    others = judged(rng, 600, t=0.8, gamma=80)
    prior = prior_of(others)
    leaning = VerifiedParams(max_error=0.05, prior_weight=50.0)
    fresh = decide(0.97, [], prior, leaning, uniform=0.5)
    assert fresh.action is Action.EXPLOIT
    # The same entry with no prior to lean on explores.
    params = VerifiedParams(max_error=0.05, prior_weight=0.0)
    alone = decide(0.97, [], prior, params, uniform=0.5)
    assert alone.action is Action.EXPLORE


def test_an_entrys_own_observations_override_a_misleading_prior() -> None:
    rng = random.Random(5)
    others = judged(rng, 600, t=0.8, gamma=80)
    own = [Observation(similarity=0.95 + i * 0.004, correct=False, at=1000.0 + i) for i in range(8)]
    prior = prior_of(others + own)
    leaning = VerifiedParams(max_error=0.05, prior_weight=50.0)
    assert decide(0.96, [], prior_of(others), leaning, uniform=0.5).action is Action.EXPLOIT
    d = decide(0.96, own, prior, leaning, uniform=0.5)
    assert d.action is Action.EXPLORE
    assert d.p_correct < 0.9  # from above 0.99 with the prior alone


@pytest.mark.parametrize("delta", [0.02, 0.1])
def test_a_simulated_stream_serves_at_most_delta_wrong_answers(delta: float) -> None:
    """Entries with their own true curves; requests explore, get judged, and are served."""
    rng = random.Random(42)
    params = VerifiedParams(max_error=delta, min_observations=10, prior_weight=5.0)
    truths = [(rng.uniform(0.75, 0.9), rng.uniform(20, 200)) for _ in range(20)]
    entries: list[list[Observation]] = [[] for _ in truths]
    prior = PartitionPrior()
    wrong = served = 0
    requests = 1500
    for clock in range(requests):
        i = rng.randrange(len(truths))
        t, gamma = truths[i]
        s = rng.uniform(0.7, 1.0)
        correct = rng.random() < curve(t, gamma, s)
        d = decide(s, entries[i], prior, params, uniform=rng.random())
        if d.action is Action.EXPLOIT:
            served += 1
            wrong += not correct
            continue
        entries[i], dropped = observed(entries[i], Observation(s, correct, float(clock)))
        prior.add([entries[i][-1]])
        prior.remove(dropped)
    assert served > requests * 0.1  # it does serve
    assert wrong / served <= delta


def test_observed_deduplicates_and_keeps_the_newest() -> None:
    first = Observation(similarity=0.9, correct=True, at=1.0)
    kept, dropped = observed([first], first)
    assert kept == [first] and dropped == []
    many = [Observation(similarity=0.9, correct=True, at=float(i)) for i in range(MAX_OBSERVATIONS)]
    kept, dropped = observed(many, Observation(similarity=0.5, correct=False, at=1e9))
    assert len(kept) == MAX_OBSERVATIONS and dropped == [many[0]]
    assert kept[-1].at == 1e9


def test_removing_every_observation_empties_the_prior() -> None:
    obs = judged(random.Random(1), 30, t=0.8, gamma=50)
    prior = prior_of(obs)
    prior.remove(obs)
    assert prior.count == 0 and not prior.right.any() and not prior.wrong.any()


def test_a_pooled_neighbourhood_counts_as_the_partition_prior_counts() -> None:
    rng = random.Random(2)
    lists = [judged(rng, n, t=0.85, gamma=40, start=100 * n) for n in (0, 3, 17, 64)]
    lists.append([Observation(similarity=s, correct=True, at=0.0) for s in (-0.1, 0.0025, 1.2)])
    pooled = pooled_prior(lists)
    one_by_one = prior_of([obs for observations in lists for obs in observations])
    assert np.array_equal(pooled.right, one_by_one.right)
    assert np.array_equal(pooled.wrong, one_by_one.wrong)
    assert pooled_prior([]).count == 0
