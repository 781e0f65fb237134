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
prior is the partition's: the observations of all its entries, tempered to weigh as
``prior_weight`` observations (a power prior), so a new entry starts from what its
partition has learned and its own observations take over as they come.

The decision bounds the share of wrong answers among the answers served: with ``alpha`` a
lower bound on the posterior probability that the entry's answer is right at this
similarity, the entry is served when ``alpha >= 1 - max_error`` and the request is explored
otherwise. ``alpha`` is vCache's bound: the largest ``(1 - eps) * q_eps`` over levels
``eps``, with ``q_eps`` the posterior's ``eps``-quantile of ``p``; it never exceeds the
posterior mean. The paper bounds the error over all requests instead, exploring with
probability ``1 - delta / (1 - alpha)``: that serves even a surely wrong answer with
probability delta, a hit that helps no one, so here ``max_error`` is a bound on what is
served. A served request is still explored with probability ``audit_rate``, so an entry
whose curve was learned from its partition alone keeps being checked.

Everything here is pure (numpy): randomness comes from the caller's ``uniform`` draw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum

import msgspec
import numpy as np

T_GRID = np.linspace(0.3, 1.0, 141)
"""Candidate thresholds (the similarity at which the entry's answer is right half the time)."""
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
    """``alpha``: the conservative bound the exploration probability was chosen from."""


class VerifiedParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the decision needs (taken from the policy rule)."""

    max_error: float
    """delta: the bound on the probability that a request is served a wrong answer."""
    min_observations: int = 10
    """A partition serves nothing before it holds this many judged observations."""
    prior_weight: float = 5.0
    """How many observations the partition's prior weighs in an entry's curve."""
    audit_rate: float = 0.02
    """The share of servable requests explored anyway."""


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


class PartitionPrior:
    """The pooled observations of one partition, as a log-likelihood on the grid.

    Not thread-safe on its own: its partition calls it under the partition's lock.
    """

    def __init__(self) -> None:
        self.loglik = np.zeros(_T_FLAT.shape)
        self.count = 0

    def add(self, observations: Sequence[Observation]) -> None:
        if observations:
            self.loglik += log_likelihood(observations)
            self.count += len(observations)

    def remove(self, observations: Sequence[Observation]) -> None:
        if observations:
            self.loglik -= log_likelihood(observations)
            self.count = max(0, self.count - len(observations))
            if self.count == 0:
                self.loglik[:] = 0.0  # no drift left behind

    def log_prior(
        self, weight: float, own: np.ndarray | None = None, own_count: int = 0
    ) -> np.ndarray:
        """The prior of an entry: the partition's observations but its own, tempered to
        weigh as ``weight`` observations at most."""
        pooled = self.loglik - own if own is not None else self.loglik
        n = self.count - own_count
        if n <= 0 or weight <= 0:
            return np.zeros(_T_FLAT.shape)
        return pooled * min(1.0, weight / n)


def posterior(
    observations: Sequence[Observation], prior: PartitionPrior, prior_weight: float
) -> np.ndarray:
    """The normalised posterior of an entry over the flattened ``(t, gamma)`` grid.

    ``prior`` holds the entry's own observations too (its partition adds every one); they
    are taken out of it, so that they count once, at full weight.
    """
    own = log_likelihood(observations)
    log_post = own + prior.log_prior(prior_weight, own, len(observations))
    log_post -= log_post.max()
    weights = np.exp(log_post)
    return weights / weights.sum()


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
    weights = posterior(observations, prior, params.prior_weight)
    mean, lower = correctness(similarity, weights)
    servable = prior.count >= params.min_observations and mean >= 1.0 - params.max_error
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
