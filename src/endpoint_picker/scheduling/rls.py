"""Recursive least squares with exponential forgetting, and the spread of its log residuals: the
small online linear model the latency predictor (``predictor.py``) keeps per endpoint."""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import mul

PRIOR_VARIANCE = 1.0  # how far (in seconds per unit) a coefficient may plausibly be from its prior
SMOOTHING = 0.05  # weight of a new sample in the residual and error averages (~20 samples)
MIN_PREDICTION = 1e-3  # seconds: a prediction is never below this (nor negative)


class OnlineLinear:
    """Recursive least squares with a forgetting factor, and the spread of its log residuals.

    ``theta`` starts at a prior and moves to the data; ``p`` is the parameters' covariance (in
    units of the noise variance), capped in trace so it cannot blow up while a feature stays
    constant (forgetting with no new information grows it geometrically: "windup").
    """

    __slots__ = ("_forgetting", "_max_trace", "_p0", "log_mean", "log_var", "p", "samples", "theta")

    def __init__(
        self, prior: Sequence[float], forgetting: float, prior_variance: float = PRIOR_VARIANCE
    ) -> None:
        d = len(prior)
        self.theta = list(prior)
        self._p0 = prior_variance
        self.p = [[prior_variance if i == j else 0.0 for j in range(d)] for i in range(d)]
        self._forgetting = forgetting
        self._max_trace = prior_variance * d
        self.samples = 0
        self.log_mean = 0.0
        self.log_var = 0.0

    def copy_from(self, other: OnlineLinear) -> None:
        """Start from ``other``'s coefficients and spread, with the prior's uncertainty (so
        this endpoint's own samples soon outweigh what was borrowed)."""
        d = len(self.theta)
        self.theta = list(other.theta)
        self.p = [[self._p0 if i == j else 0.0 for j in range(d)] for i in range(d)]
        self.log_mean, self.log_var = other.log_mean, other.log_var

    def mean(self, x: Sequence[float]) -> float:
        total: float = sum(map(mul, self.theta, x))
        return total if total > MIN_PREDICTION else MIN_PREDICTION

    def quantile_factor(self, z: float) -> float:
        """Multiply a mean prediction by this for its quantile at ``z`` standard deviations."""
        return math.exp(self.log_mean + z * math.sqrt(self.log_var))

    def update(self, x: Sequence[float], y: float) -> float:
        """Learn one sample; return the prediction it was compared with (before the update)."""
        theta = self.theta
        raw: float = sum(map(mul, theta, x))
        predicted = raw if raw > MIN_PREDICTION else MIN_PREDICTION
        delta = math.log(max(y, MIN_PREDICTION) / predicted) - self.log_mean
        self.log_mean += SMOOTHING * delta
        self.log_var = (1.0 - SMOOTHING) * (self.log_var + SMOOTHING * delta * delta)
        p = self.p
        px = [sum(map(mul, row, x)) for row in p]  # P x (P is symmetric)
        lam = self._forgetting
        scale = 1.0 / (lam + sum(map(mul, x, px)))
        error = (y - raw) * scale
        self.theta = [t + v * error for t, v in zip(theta, px, strict=True)]
        inv = 1.0 / lam
        # P <- (P - g (P x)^T) / lambda, with g = P x / (lambda + x^T P x)
        self.p = p = [
            [(a - gi * b) * inv for a, b in zip(row, px, strict=True)]
            for row, gi in zip(p, [v * scale for v in px], strict=True)
        ]
        trace = sum(p[i][i] for i in range(len(p)))
        if trace > self._max_trace:
            shrink = self._max_trace / trace
            self.p = [[a * shrink for a in row] for row in p]
        self.samples += 1
        return predicted
