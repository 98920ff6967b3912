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

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkit import legs
from simkit._memory import check_samples
from simkit._validation import check_seed, int_at_least
from simkit.estimators import as_estimators
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
    "best_scale",
    "bias",
    "bias_dir",
    "cosine",
    "effective_sample_size",
    "exact_metrics",
    "exact_moments",
    "has_exact_path",
    "khat_of_weights",
    "monte_carlo_metrics",
    "oracle_baseline",
    "plan",
    "run",
    "sample_gradients",
    "snr",
    "tie",
    "why_not_exact",
]

#: a progress bar is shown (``progress=None``) when the Monte Carlo work, counted in drawn
#: tokens times estimators, exceeds this
PROGRESS_THRESHOLD = 2_000_000


def run(
    env,
    behaviour,
    estimators,
    n: int,
    reps: int = 1000,
    seed: int = 0,
    exact="auto",
    setting: dict | None = None,
    level: float = 0.95,
    n_boot: int = 1000,
    progress: bool | None = None,
    params: str = "untied",
    old=None,
) -> pd.DataFrame:
    """Bias / variance table of ``estimators`` for n-sample batches drawn from ``behaviour``.

    Parameters
    ----------
    env : environment (e.g. :class:`simkit.envs.Bandit`) with the target π and oracle ∇J.
    behaviour : (K,) probabilities, the behaviour policy μ (validated).
    estimators : list of :class:`~simkit.estimators.Estimator`, mappings or mapping names
        (a single one is accepted); their names must be distinct.
    n : batch size of the estimator (samples per gradient estimate).
    reps : Monte Carlo repetitions (independent batches, >= 2). Always drawn once: ``khat`` of
        exact rows is computed from these draws too.
    seed : seed of the ``SeedSequence`` (module docstring: common random numbers).
    exact : ``"auto"`` (exact for per-sample estimators, Monte Carlo for the others),
        ``True`` (exact for all; error naming those that cannot be), ``False`` (Monte Carlo).
    setting : dict of extra constant columns, e.g. ``{"divergence": "chi2", "target": 0.5}``.
    level : confidence level of the Monte Carlo bounds; ``n_boot``: bootstrap resamples.
    progress : show a tqdm bar over estimators (``None``: only when the work is long).
    params : ``"untied"`` (default: the gradient w.r.t. per-position parameters θ[t, …], the
        environment's D) or ``"tied"`` (w.r.t. one table shared by every position: every
        gradient — ĝ_r, E ĝ, ∇J — is the sum of its per-position blocks, :func:`tie`). The
        bandit has T = 1, where both are the same. Recorded in the ``params`` column.
    old : π_old's distribution (the shape of ``behaviour``), optional. Default None: π_old = π
        (no staleness; every table as without this argument). Composed estimators (an
        ``Estimator`` with a ``correction``) then see both legs, exactly wherever the path is
        exact; estimators without a correction ignore it. Adds the columns
        :data:`simkit.legs.LEG_COLUMNS` (χ²/KL of π‖π_old and π_old‖μ).

    Returns
    -------
    A tidy DataFrame, one row per estimator: ``estimator``, ``mapping``, ``aggregation``,
    ``advantage``, ``group_size``, ``adv_eps`` (grpo only), ``max_length`` (NaN where they do
    not apply), one column per mapping hyperparameter (NaN for mappings without it; prefixed
    ``hp_`` if the name clashes with a column), the ``setting`` columns, ``T``, ``params``,
    ``n``, ``reps``,
    ``chi2_tok`` … ``tv_seq``, the metrics (module docstring) with ``*_lo``/``*_hi`` bounds (NaN
    on exact rows), the scale-free error ``mse_zero``, ``alpha_star``, ``mse_scaled``,
    ``rel_mse_scaled`` and the kept fractions ``kept``, ``kept_seq`` (module docstring),
    ``khat``, ``exact``, ``method`` and ``why_mc`` (the planner's answer,
    :mod:`simkit.experiment.plan`), ``reliable`` (False when a Monte Carlo row's intervals
    cannot be trusted — heavy or unseen tails; always True on exact rows; the rule and its
    references are in :mod:`simkit.reliability`) and ``tail_draws`` (that rule's exact ν, the
    expected number of draws in the tail carrying E c̄²; NaN on exact rows and where it cannot
    be computed).
    """
    ests = as_estimators(estimators)
    mu = env.check_policy(behaviour, "behaviour")
    n = int_at_least(n, "n", 1)
    reps = int_at_least(reps, "reps", 2)
    n_boot = int_at_least(n_boot, "n_boot", 10)
    if not (isinstance(level, float | int) and 0 < level < 1):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if exact not in ("auto", True, False):
        raise ValueError(f"exact must be 'auto', True or False, got {exact!r}")
    params = check_params(params)
    setting = dict(setting or {})
    clash = sorted(set(setting) & set(RESERVED))
    if clash:
        raise ValueError(f"setting keys {clash} clash with result columns; rename them")
    hp_names = {k for e in ests for k in e.mapping.hyperparameters}
    clash = sorted(set(setting) & hp_names)
    if clash:
        raise ValueError(f"setting keys {clash} clash with mapping hyperparameter columns")
    for est in ests:
        est.check_batch_size(n)
    plans = [plan(e, env, params, exact) for e in ests]  # how each row is computed, once
    if exact is True:
        bad = [f"{e.name!r} ({p.why_mc})" for e, p in zip(ests, plans) if not p.exact]
        if bad:
            raise ValueError(
                "exact=True but these estimators have no exact path: "
                + "; ".join(bad)
                + ". Use exact='auto' to run them by Monte Carlo."
            )
    use_exact = [p.exact for p in plans]

    check_samples(reps, n, env.T)  # the batches are drawn at once: refuse what cannot fit
    old_p = None if old is None else legs.check_old(env, old)
    # a third child for stochastic mappings (children 0 and 1 are those of spawn(2))
    draw_ss, boot_ss, coef_ss = np.random.SeedSequence(check_seed(seed)).spawn(3)
    batch = env.sample(mu, n, np.random.default_rng(draw_ss), reps=reps)
    old_lr = old_log_ratio_of(env, old_p, mu, batch)
    leg_columns = {} if old_p is None else legs.leg_divergences(env, old_p, mu)
    boot_weights = None
    if not all(use_exact):
        boot_weights = bootstrap_weights(reps, n_boot, np.random.default_rng(boot_ss))
    grad_J = env.grad_J()
    if params == "tied":
        grad_J = tie(grad_J, env.T)
    divergences = env.divergences(mu)

    if progress is None:
        work = reps * n * env.T * sum(not x for x in use_exact)
        progress = len(ests) > 1 and work > PROGRESS_THRESHOLD
    from tqdm.auto import tqdm

    rows = []
    for est, how in tqdm(list(zip(ests, plans)), desc="estimators", disable=not progress):
        is_exact = how.exact
        draws = sample_gradients(env, batch, est, old_lr, np.random.default_rng(coef_ss))
        if params == "tied":
            draws = MonteCarloDraws(tie(draws.gradients, env.T), draws.coefficients, draws.mask)
        if is_exact:
            metrics = exact_metrics(exact_moments(env, mu, est, n, params, old=old_p), grad_J)
            trusted, nu = True, math.nan
        else:
            metrics = monte_carlo_metrics(draws, grad_J, n, boot_weights, level)
            trusted, nu = row_reliability(env, mu, est, draws.gradients, grad_J, n, old_p)
        coeff = np.abs(draws.coefficients[draws.mask])
        rows.append(
            {
                **describe(est),
                **setting,
                "T": env.T,
                "params": params,
                "n": n,
                "reps": reps,
                **divergences,
                **leg_columns,
                **metrics,
                "khat": khat_of_weights(coeff),
                "exact": is_exact,
                "method": how.method,
                "why_mc": how.why_mc,
                "reliable": trusted,
                "tail_draws": nu,
            }
        )
    return tidy(rows, ests, list(setting))


#: the old private name (simkit.lm.exact uses it)
_coerce_estimators = as_estimators
