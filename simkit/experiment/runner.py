"""`run`: the metrics table of estimators on an environment (the :mod:`simkit.experiment`
docstring states what it computes and how)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd

from simkit import kl as kl_mod
from simkit import legs
from simkit._memory import check_samples
from simkit._validation import check_seed, int_at_least
from simkit.estimators import ORACLE_ADVANTAGES, as_estimators
from simkit.experiment.exact import (
    check_params,
    exact_metrics,
    exact_moments,
    old_log_ratio_of,
    oracle_baseline,
    tie,
)
from simkit.experiment.monte_carlo import (
    MonteCarloDraws,
    bootstrap_weights,
    monte_carlo_metrics,
    row_reliability,
    sample_gradients,
)
from simkit.experiment.plan import plan
from simkit.experiment.table import RESERVED, describe, kl_describe, tidy
from simkit.reliability import khat_of_weights

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
    ref=None,
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
    ref : π_ref's distribution (the shape of ``behaviour``), optional. Default None: no KL term
        (estimators with a ``kl`` penalty are refused). With it, a row whose estimator has a
        penalty β·KL (:class:`simkit.kl.KLPenalty`) is measured against the exact gradient of
        J(π) − β·KL_seq(π‖π_ref) (:func:`simkit.kl.kl_seq_and_grad`): ``bias`` … are of that
        total, and the columns :data:`KL_COLUMNS` are added: ``kl_estimator``, ``kl_where``,
        ``kl_correction``, ``kl_beta`` (NaN/None on rows without a penalty), ``kl_seq_ref`` =
        KL_seq(π‖π_ref), ``kl_grad_norm`` = β‖∇KL_seq‖ and ``kl_bias`` = ‖E ĝ_KL + β∇KL_seq‖,
        the bias of the KL part alone, ĝ_KL = ĝ − ĝ₀ with ĝ₀ the same estimator without the
        penalty on the same draws (exact by enumeration; Monte Carlo with bounds
        ``kl_bias_lo``/``kl_bias_hi`` otherwise).

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
    ref_p = None if ref is None else kl_mod.check_ref(env, ref)
    if ref_p is None:
        bad = [e.name for e in ests if e.kl is not None]
        if bad:
            raise ValueError(f"estimators {bad} have a KL penalty: pass ref = pi_ref to run")
    # a third child for stochastic mappings (children 0 and 1 are those of spawn(2))
    draw_ss, boot_ss, coef_ss = np.random.SeedSequence(check_seed(seed)).spawn(3)
    batch = env.sample(mu, n, np.random.default_rng(draw_ss), reps=reps)
    old_lr = old_log_ratio_of(env, old_p, mu, batch)
    ref_lr = None
    kl_grad = None
    kl_columns = {}
    if ref_p is not None:
        states = getattr(batch, "states", None)
        ref_lr = kl_mod.token_log_ratio_to_ref(
            env, ref_p, mu, batch.actions, batch.mask, batch.log_ratio, states
        )
        kl_value, kl_grad = kl_mod.kl_seq_and_grad(env, ref_p)
        if params == "tied":
            kl_grad = tie(kl_grad, env.T)
        kl_columns = {"kl_seq_ref": kl_value}
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
        truth = grad_J if est.kl is None else grad_J - est.kl.beta * kl_grad
        b = None
        if est.kl is not None and est.advantage in ORACLE_ADVANTAGES:
            b = oracle_baseline(env, mu, est, ref_p)
        draws = sample_gradients(
            env, batch, est, old_lr, np.random.default_rng(coef_ss), ref_lr, baseline=b
        )
        if params == "tied":
            draws = MonteCarloDraws(tie(draws.gradients, env.T), draws.coefficients, draws.mask)
        if is_exact:
            moments = exact_moments(env, mu, est, n, params, old=old_p, ref=ref_p)
            metrics = exact_metrics(moments, truth)
            trusted, nu = True, math.nan
        else:
            metrics = monte_carlo_metrics(draws, truth, n, boot_weights, level)
            # the reliability of the row's weights: those of the estimator without the penalty
            plain = est if est.kl is None else dataclasses.replace(est, kl=None)
            trusted, nu = row_reliability(env, mu, plain, draws.gradients, truth, n, old_p)
        kl_metrics = {}
        if ref_p is not None:
            kl_metrics = {**kl_columns, **kl_describe(est), "kl_grad_norm": math.nan}
            kl_metrics.update(kl_bias=math.nan, kl_bias_lo=math.nan, kl_bias_hi=math.nan)
        if est.kl is not None:
            kl_metrics["kl_grad_norm"] = float(np.linalg.norm(est.kl.beta * kl_grad))
            base = dataclasses.replace(est, kl=None)
            target = -est.kl.beta * kl_grad
            if is_exact:
                base_mean = exact_moments(env, mu, base, n, params, old=old_p).mean
                kl_metrics["kl_bias"] = float(np.linalg.norm(moments.mean - base_mean - target))
                kl_metrics["kl_bias_lo"] = kl_metrics["kl_bias_hi"] = math.nan
            else:
                base_draws = sample_gradients(
                    env, batch, base, old_lr, np.random.default_rng(coef_ss)
                )
                diff = draws.gradients - (
                    tie(base_draws.gradients, env.T) if params == "tied" else base_draws.gradients
                )
                kl_mc = monte_carlo_metrics(
                    MonteCarloDraws(diff, draws.coefficients, draws.mask),
                    target,
                    n,
                    boot_weights,
                    level,
                )
                for key in ("", "_lo", "_hi"):
                    kl_metrics[f"kl_bias{key}"] = kl_mc[f"bias{key}"]
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
                **kl_metrics,
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
