"""Bias / variance / MSE / cosine / ESS / k̂ tables of gradient estimators, exact or Monte Carlo.

:func:`run` measures, for each estimator, the n-sample gradient estimate ĝ against the exact
policy gradient ∇J of an environment (DESIGN.md, "Metrics"):

- ``bias`` = ‖E ĝ − ∇J‖;
- ``bias_dir`` = ‖E ĝ − α*∇J‖ with α* = ⟨E ĝ, ∇J⟩/‖∇J‖² (:func:`best_scale`): the distance
  from E ĝ to the *line* spanned by ∇J, i.e. the bias left after the best rescaling (a pure
  rescaling is only a step size). α* is unconstrained and may be negative (an estimator that
  points backwards has a small ``bias_dir`` but a negative ``cosine``);
- ``cosine`` = cos(E ĝ, ∇J) (NaN when either is 0);
- ``variance`` = E‖ĝ − E ĝ‖² (trace of the covariance of the n-sample estimator);
- ``mse`` = E‖ĝ − ∇J‖² = bias² + variance;
- ``snr`` = ‖E ĝ‖² / variance;
- ``ess`` = n·(E|c|)² / E[c²] over the effective coefficients c of the drawn tokens
  (:func:`effective_sample_size`; n/(1+χ²) for sequence IS, n for naive);
- ``khat`` = the PSIS Pareto k̂ of the coefficient magnitudes |c| (:func:`khat_of_weights`).

**Scale-free error** (:func:`~simkit.experiment.metrics.scale_free`). ĝ ≡ 0 has
MSE = ‖∇J‖², so a mapping that shrinks or drops most samples can "win" on MSE while carrying no
signal; rank by the error after the best step size instead:

- ``mse_zero`` = ‖∇J‖², the MSE of ĝ ≡ 0 (draw it as a reference line on MSE figures);
- ``alpha_star`` = ⟨E ĝ, ∇J⟩ / E‖ĝ‖² with E‖ĝ‖² = ‖E ĝ‖² + variance: the step a
  learning-rate sweep would find;
- ``mse_scaled`` = min_α E‖αĝ − ∇J‖² = ‖∇J‖² − ⟨E ĝ, ∇J⟩² / E‖ĝ‖²;
- ``rel_mse_scaled`` = mse_scaled / mse_zero = 1 − cos²(E ĝ, ∇J)·snr/(1 + snr) ∈ [0, 1]:
  invariant to rescaling ĝ, 1 for an estimator no better than doing nothing. Rankings use it.

**Kept fractions** (:func:`~simkit.experiment.metrics.kept_fractions`): ``kept`` =
E_μ[#valid tokens with c ≠ 0] / E_μ[#valid tokens] and ``kept_seq`` = P_μ(some valid c ≠ 0),
what a mask or a rejection sampler leaves (1 for mappings that never zero a coefficient).

**How a row is computed** is decided once, by the planner :func:`~simkit.experiment.plan.plan`,
and recorded: ``method`` ∈ {``enumeration``, ``dp``, ``monte_carlo``} and, on Monte Carlo rows,
``why_mc`` (the obstacle in words: a batch-dependent mapping, a group advantage, a random Z,
more sequences than the enumeration budget without a moment DP, or ``exact=False``).

Two paths compute them.

**Exact** (estimators whose ĝ is a sum of independent per-sample terms,
``Estimator.per_sample``): ĝ = (1/Z) Σ_i g_i with g_i = c(y_i, sign A_i)·A_i·∇log π(y_i)
i.i.d. The coefficient c depends on the sample only through its log-ratio (a function of y)
and the sign of A (mapping contract), so E g and E‖g‖² are *finite sums* over the atoms
(y, sign A) of the environment's support (``env.support``), weighted by the exact partial
moments E[A·1{atom}] and E[A²·1{atom}] (closed forms for Bernoulli and Gaussian rewards). With
κ = 1/Z (every aggregation has a deterministic Z on fixed-length batches; Z = n on the bandit),
E ĝ = n·κ·E g and Var ĝ = n·κ²·(E‖g‖² − ‖E g‖²): no sampling error at all. On the token MDP
(T > 1) an atom is a whole sequence (its reward is deterministic) and Z may be per sequence
(seq-mean-token-mean: Z_i = n·|y_i|); only ``token-mean`` with varying lengths (EOS) has a
random Z shared by the batch and goes to Monte Carlo. Beyond the enumeration budget a token
MDP keeps an exact path for untied parameters by dynamic programming
(:mod:`simkit.envs.token_moments`: mean and variance of every token-level mapping and of the
product-form sequence mappings ``is_seq`` and ``power``, W²-weighted forward/backward sweeps,
any T); other estimators there go to Monte Carlo (:func:`has_exact_path`). ``ess`` is exact
too; ``khat`` has no closed form and is always estimated from draws.

**Monte Carlo** (everything else, or ``exact=False``): ``reps`` independent batches of n draws
(drawn at once), ĝ_r per batch; E ĝ ≈ ḡ, variance = trace of the sample covariance (ddof 1).
``bias``, ``bias_dir`` and ``snr``'s numerator are debiased for the noise of ḡ
(E‖ḡ − v‖² = ‖E ĝ − v‖² + variance/reps, so variance/reps is subtracted, clipped at 0): that
makes ``mse`` = bias² + variance equal to the unbiased mean of ‖ĝ_r − ∇J‖² (unless clipped),
and stops an unbiased estimator from showing a spurious bias of order √(variance/reps).
Confidence bounds (``*_lo``/``*_hi``, at ``level``) come from a seeded bootstrap over the reps:

- ``bias``, ``bias_dir``, ``cosine``: from one confidence *ball* for E ĝ, centred at ḡ with
  radius ρ = the ``level`` quantile of ‖ḡ* − ḡ‖ over bootstrap replicates ḡ*. For every point
  of the ball the three quantities lie in the reported intervals (triangle inequality and the
  angle subtended by the ball), so the bounds hold simultaneously and do not fail at the
  boundary (an unbiased estimator's bias interval starts at 0, its cosine interval reaches 1);
- ``variance``, ``mse``: studentized bootstrap (bootstrap-t, second-order accurate for these
  means of skewed per-rep values ‖ĝ_r − ḡ‖² and ‖ĝ_r − ∇J‖²; they cover slightly less than
  ``level`` when reps is small, e.g. ≈ 0.87–0.90 at level 0.9);
- ``ess``, ``kept``, ``kept_seq``: percentile bootstrap;
- ``mse_scaled``, ``rel_mse_scaled``: the point estimate uses the unbiased E‖ĝ‖² ≈ mean‖ĝ_r‖²
  and ⟨E ĝ, ∇J⟩² ≈ ⟨ḡ, ∇J⟩² − s²/reps (s² the sample variance of ⟨ĝ_r, ∇J⟩); bounds are the
  percentile bootstrap interval of the plug-in value, shifted by that debiasing, clipped to
  [0, ‖∇J‖²];
- ``snr``: [‖·‖²-bounds of the ball] / [variance bounds] (conservative).

``khat`` has no bounds; it is computed from the coefficients of all reps·n drawn samples, on
exact rows too (NaN where no Pareto tail can be fitted, :func:`khat_of_weights`). Exact rows
have NaN bounds.

**Reliability.** These intervals assume that the reps have seen the distribution's tail. With
heavy-tailed weights they can under-cover badly and silently, so every Monte Carlo row carries
``reliable`` (and the exact ``tail_draws`` ν behind it): False when the per-batch squared errors
have a Pareto k̂ > 0.7, when one batch carries more than half of their sum, or when the exact
moments of the coefficients say that reps·n draws expect fewer than 10 draws in the tail that
carries the second moment (:mod:`simkit.reliability`, with the references). Exact rows are
always reliable.

Randomness: one ``SeedSequence(seed)`` spawns a stream for the batches and a stream for the
bootstrap. Every estimator is evaluated on the *same* batches (common random numbers) with the
same bootstrap resamples, so adding or removing an estimator never changes another's numbers,
differences between estimators are measured with less noise, and the same seed gives the same
table.

The package holds one module per idea: :mod:`~simkit.experiment.metrics` (the metric functions),
:mod:`~simkit.experiment.exact` (the exact path), :mod:`~simkit.experiment.monte_carlo` (the
Monte Carlo path, its bounds and reliability), :mod:`~simkit.experiment.table` (the columns);
this module runs them (:func:`run`) and re-exports their public names.
"""

# ruff: noqa: F401  (the package re-exports its modules' names, old imports included)
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit import legs
from simkit._memory import check_samples
from simkit._validation import check_seed, int_at_least
from simkit.estimators import as_estimators
from simkit.experiment.ensemble import Summary, ensemble, instance_seeds, summarize
from simkit.experiment.exact import (
    PARAMS,
    ExactMoments,
    check_params,
    exact_metrics,
    exact_moments,
    has_exact_path,
    old_log_ratio_of,
    oracle_baseline,
    tie,
    why_not_exact,
)
from simkit.experiment.metrics import (
    BOUNDED_METRICS,
    best_scale,
    bias,
    bias_dir,
    cosine,
    effective_sample_size,
    snr,
)
from simkit.experiment.monte_carlo import (
    MonteCarloDraws,
    bootstrap_weights,
    monte_carlo_metrics,
    row_reliability,
    sample_gradients,
)
from simkit.experiment.plan import METHODS, Plan, plan
from simkit.experiment.runner import PROGRESS_THRESHOLD, _coerce_estimators, run
from simkit.experiment.table import DIVERGENCE_COLUMNS, RESERVED, describe, tidy
from simkit.reliability import KHAT_MIN_DISTINCT, khat_of_weights

__all__ = [
    "BOUNDED_METRICS",
    "DIVERGENCE_COLUMNS",
    "KHAT_MIN_DISTINCT",
    "METHODS",
    "PARAMS",
    "PROGRESS_THRESHOLD",
    "ExactMoments",
    "MonteCarloDraws",
    "Plan",
    "Summary",
    "best_scale",
    "bias",
    "bias_dir",
    "cosine",
    "effective_sample_size",
    "ensemble",
    "exact_metrics",
    "exact_moments",
    "has_exact_path",
    "instance_seeds",
    "khat_of_weights",
    "monte_carlo_metrics",
    "oracle_baseline",
    "plan",
    "run",
    "sample_gradients",
    "snr",
    "summarize",
    "tie",
    "why_not_exact",
]
