"""Verified semantic caching: each entry learns when its answer is right for a new request.

The idea is vCache's (Schroeder et al., "vCache: Verified Semantic Prompt Caching",
arXiv 2502.03771): instead of one static threshold, each cached entry has its own curve
``P(correct | similarity) = sigmoid(gamma * (similarity - t))``, learned online from judged
observations. When the entry is a request's nearest neighbour, the cache either serves its
answer (exploit) or sends the request to the backend anyway (explore), and the explored
request's fresh answer, judged against the cached one, adds an observation to the entry.

Here the curve is a Bayesian posterior over a fixed grid of ``(t, gamma)`` rather than a
logistic-regression fit with a delta-method variance: it is exact for the model, needs no
special case when the observations separate perfectly, and takes a prior naturally. The
prior is the neighbourhood's: the observations of the entry's ``prior_neighbours`` nearest
entries in its partition near the request's score (a Gaussian kernel), tempered to weigh as
``prior_weight`` observations (a power prior), so a new entry starts from what entries like
it have learned about such scores, and its own observations take over as they come. Pooled
over the whole partition instead, a prior learned on one workload (paraphrased questions,
right at cosine 0.97) vouches for another's entries at the same cosine (templated prompts
that differ in one number, wrong there).

The decision bounds the share of wrong answers among the answers served: the entry is
served when the posterior probability that its answer is right at this similarity reaches
``1 - max_error`` and enough judged requests at about this similarity (the entry's own and
its partition's) back it; the request is explored otherwise. The paper bounds the error over
all requests instead, exploring with probability ``1 - delta / (1 - alpha)`` (``alpha`` a
lower bound on that probability): that serves even a surely wrong answer with probability
delta, a hit that helps no one, so here ``max_error`` is a bound on what is served. Serving
only when vCache's ``alpha`` (the largest ``(1 - eps) * q_eps``, ``q_eps`` the posterior's
``eps``-quantile) reached ``1 - max_error`` proved far stricter than needed (it asks the
``max_error``-quantile itself to be nearly 1), so ``alpha`` is only reported. A servable
request is still explored with probability ``audit_rate``, so an entry whose curve was
learned from its partition alone keeps being checked.

Everything here is pure (numpy): randomness comes from the caller's ``uniform`` draw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum

import msgspec
import numpy as np

T_GRID = np.linspace(0.3, 1.3, 201)
"""Candidate thresholds (the similarity at which the entry's answer is right half the time).
Those above 1 stand for entries that are not right even for an identical text: without them
the flat prior over the grid would expect answers near similarity 1 to be right before any
observation says so."""
GAMMA_GRID = np.geomspace(5.0, 500.0, 9)
"""Candidate steepnesses of the curve (1/gamma is the width of its transition)."""
_T, _GAMMA = np.meshgrid(T_GRID, GAMMA_GRID, indexing="ij")
_T_FLAT = _T.ravel()
_GAMMA_FLAT = _GAMMA.ravel()
_EPS_GRID = np.linspace(0.0, 0.5, 51)[1:]
"""Levels at which the lower bound ``(1 - eps) * q_eps`` is taken."""

MAX_OBSERVATIONS = 64
"""Observations kept per entry (the oldest are dropped; the partition prior forgets them too)."""


class Observation(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One judged explore: the similarity of the request to the entry, and whether the
    entry's answer was right for it."""

    similarity: float
    correct: bool
    at: float
    """When it was judged (Unix time); with the other fields, tells copies apart (feeds)."""


class Action(Enum):
    EXPLOIT = "exploit"
    EXPLORE = "explore"


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    action: Action
    explore_probability: float
    p_correct: float
    """The posterior mean probability that the entry's answer is right for this request."""
    lower_bound: float
    """vCache's conservative bound on ``p_correct`` (reported, not used to decide)."""


class VerifiedParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the decision needs (taken from the policy rule)."""

    max_error: float
    """delta: the bound on the share of wrong answers among those served."""
    min_observations: int = 10
    """Judged observations needed at about the request's score (the entry's own plus its
    partition's within the prior's kernel) before the entry is served."""
    prior_weight: float = 20.0
    """How many observations the partition's prior weighs in an entry's curve."""
    prior_bandwidth: float | None = 0.01
    """The prior weighs the partition's observations by a Gaussian kernel of this width
    around the request's score (None: all alike): the partition's curve need not be one
    sigmoid over the whole range."""
    audit_rate: float = 0.02
    """The share of servable requests explored anyway."""
    prior_neighbours: int = 64
    """The prior pools the observations of the matched entry and its nearest entries, this
    many (0: every entry of the partition). A partition that mixes workloads learns one
    curve per region of entry space: near-duplicates that are right to share in one
    workload do not vouch for the same cosine in another."""


def log_likelihood(observations: Iterable[Observation]) -> np.ndarray:
    """Sum over observations of log P(observation | t, gamma), on the flattened grid."""
    rows = list(observations)
    if not rows:
        return np.zeros(_T_FLAT.shape)
    similarity = np.asarray([o.similarity for o in rows])[:, None]
    sign = np.asarray([1.0 if o.correct else -1.0 for o in rows])[:, None]
    z = _GAMMA_FLAT[None, :] * (similarity - _T_FLAT[None, :])
    # log sigmoid(z) for a right answer, log sigmoid(-z) for a wrong one
    return -np.logaddexp(0.0, -sign * z).sum(axis=0)


_BINS = 201
_BIN_CENTRES = np.linspace(0.0, 1.0, _BINS)
_Z_BINS = _GAMMA_FLAT[None, :] * (_BIN_CENTRES[:, None] - _T_FLAT[None, :])
_LL_RIGHT = -np.logaddexp(0.0, -_Z_BINS)
_LL_WRONG = -np.logaddexp(0.0, _Z_BINS)
"""log P(right) and log P(wrong) of an observation at each bin centre, on the grid."""


def _bin(similarity: float) -> int:
    return round(min(1.0, max(0.0, similarity)) * (_BINS - 1))


class PartitionPrior:
    """The pooled observations of one partition, counted per score bin (0.005 wide).

    Not thread-safe on its own: its partition calls it under the partition's lock.
    """

    def __init__(self) -> None:
        self.right = np.zeros(_BINS)
        self.wrong = np.zeros(_BINS)

    @property
    def count(self) -> int:
        return round(float(self.right.sum() + self.wrong.sum()))

    def add(self, observations: Sequence[Observation], sign: float = 1.0) -> None:
        for obs in observations:
            counts = self.right if obs.correct else self.wrong
            counts[_bin(obs.similarity)] += sign
        np.maximum(self.right, 0.0, out=self.right)
        np.maximum(self.wrong, 0.0, out=self.wrong)

    def remove(self, observations: Sequence[Observation]) -> None:
        self.add(observations, -1.0)

    def log_prior(
        self,
        similarity: float,
        weight: float,
        bandwidth: float | None,
        own: Sequence[Observation] = (),
    ) -> tuple[np.ndarray, float]:
        """The prior of an entry asked at ``similarity``: the partition's observations but
        its own, each weighed by a Gaussian kernel of ``bandwidth`` around ``similarity``
        (None: all alike), tempered to weigh as ``weight`` observations at most; and how
        many observations the kernel holds (the evidence about such scores)."""
        right, wrong = self.right.copy(), self.wrong.copy()
        for obs in own:
            counts = right if obs.correct else wrong
            counts[_bin(obs.similarity)] -= 1.0
        np.maximum(right, 0.0, out=right)
        np.maximum(wrong, 0.0, out=wrong)
        if bandwidth is not None:
            kernel = np.exp(-0.5 * ((_BIN_CENTRES - similarity) / bandwidth) ** 2)
            right *= kernel
            wrong *= kernel
        n = float(right.sum() + wrong.sum())
        if n <= 1e-9 or weight <= 0:
            return np.zeros(_T_FLAT.shape), n
        return min(1.0, weight / n) * (right @ _LL_RIGHT + wrong @ _LL_WRONG), n


def pooled_prior(observation_lists: Iterable[Sequence[Observation]]) -> PartitionPrior:
    """A prior of the given entries' observations (a neighbourhood of the partition)."""
    similarities: list[float] = []
    correct: list[bool] = []
    for observations in observation_lists:
        for obs in observations:
            similarities.append(obs.similarity)
            correct.append(obs.correct)
    prior = PartitionPrior()
    if similarities:  # counted at once: a neighbourhood holds up to 64 x 64 observations
        bins = np.rint(np.clip(similarities, 0.0, 1.0) * (_BINS - 1)).astype(np.intp)
        right = np.asarray(correct, dtype=bool)
        prior.right = np.bincount(bins[right], minlength=_BINS).astype(np.float64)
        prior.wrong = np.bincount(bins[~right], minlength=_BINS).astype(np.float64)
    return prior


def posterior(
    similarity: float,
    observations: Sequence[Observation],
    prior: PartitionPrior,
    prior_weight: float,
    bandwidth: float | None = None,
) -> tuple[np.ndarray, float]:
    """The normalised posterior of an entry asked at ``similarity``, over the flattened
    ``(t, gamma)`` grid, and the partition's evidence near ``similarity``.

    ``prior`` holds the entry's own observations too (its partition adds every one); they
    are taken out of it, so that they count once, at full weight.
    """
    log_prior, evidence = prior.log_prior(similarity, prior_weight, bandwidth, observations)
    log_post = log_likelihood(observations) + log_prior
    log_post -= log_post.max()
    weights = np.exp(log_post)
    return weights / weights.sum(), evidence


def correctness(similarity: float, weights: np.ndarray) -> tuple[float, float]:
    """(posterior mean, conservative lower bound) of P(correct) at ``similarity``."""
    p = 1.0 / (1.0 + np.exp(-_GAMMA_FLAT * (similarity - _T_FLAT)))
    mean = float(weights @ p)
    order = np.argsort(p)
    cdf = np.cumsum(weights[order])
    quantiles = p[order][np.minimum(np.searchsorted(cdf, _EPS_GRID), len(p) - 1)]
    lower = float(np.max((1.0 - _EPS_GRID) * quantiles))
    return mean, min(lower, mean)


def decide(
    similarity: float,
    observations: Sequence[Observation],
    prior: PartitionPrior,
    params: VerifiedParams,
    uniform: float,
) -> Decision:
    """Serve the entry's answer or explore, for a request at ``similarity`` to it.

    ``uniform`` is a draw from U[0, 1) (the caller's RNG): the request is explored when it
    falls below the exploration probability.
    """
    weights, evidence = posterior(
        similarity, observations, prior, params.prior_weight, params.prior_bandwidth
    )
    mean, lower = correctness(similarity, weights)
    # Enough judged requests at about this score, the entry's own or its partition's.
    known = evidence + len(observations) >= params.min_observations
    servable = known and mean >= 1.0 - params.max_error
    tau = params.audit_rate if servable else 1.0
    action = Action.EXPLORE if uniform < tau else Action.EXPLOIT
    return Decision(action=action, explore_probability=tau, p_correct=mean, lower_bound=lower)


def observed(
    observations: Sequence[Observation], new: Observation
) -> tuple[list[Observation], list[Observation]]:
    """The entry's observations with ``new`` added (unless already there), and those dropped
    past ``MAX_OBSERVATIONS`` (oldest first)."""
    if new in observations:
        return list(observations), []
    kept = sorted([*observations, new], key=lambda o: o.at)
    excess = max(0, len(kept) - MAX_OBSERVATIONS)
    return kept[excess:], kept[:excess]
