"""Exact moments of per-sample estimators under a behaviour made of several policy versions.

A :class:`~simkit.envs.versions.VersionedBehaviour` is a set of components c (a version per
position, a weight w_c); a sample of the batch comes from component c with probability w_c,
then y ~ q_c (the component's position-dependent table). For a per-sample estimator
ĝ = (1/n)Σ_i h_i with h_i i.i.d. (:func:`simkit.experiment.exact_moments` states h):

    E h    = Σ_c w_c Σ_y q_c(y)·A(y)·Σ_t c_t a_t ∇log π(y_t|s_t)
    E‖h‖²  = Σ_c w_c Σ_y q_c(y)·A(y)²·‖Σ_t c_t a_t ∇log π(y_t|s_t)‖²
    E ĝ = E h,   Var ĝ = (E‖h‖² − ‖E h‖²)/n

(the variance of a mixture is its second moment minus the squared *mixture* mean; the
per-component variances do not add up to it). The baseline b of the ``oracle`` advantage is
the batch's J(μ) = Σ_c w_c J(q_c). The coefficients c_t see the log-ratio
ℓ_t = log π(y_t) − log r_t where r is what the trainer **records** (``record``, see
:data:`simkit.envs.versions.RECORDS`): the true per-token version (per-token version ratios;
for whole-sequence components: per-version IS), the start version, one assumed age, or the
mixture's next-token law (multiple importance sampling across versions, balance heuristic:
Π_t r_t = Σ_c w_c q_c(y)). Exact by enumeration of the support; with ``record="true"`` (every
component its own table) also at any T by the token-MDP moment DP of each component, summed.

Batch-dependent estimators (group advantages, self-normalised or PSIS weights) have no exact
moments: :func:`versioned_monte_carlo` draws batches from the behaviour
(:func:`sample_versioned`) and gives the Monte Carlo metrics with bootstrap bounds.

Composed estimators (a ``correction``) take π_old = ``old``: a table (the recomputed π_old),
a :class:`simkit.legs.LogLinearOld` (one α), or ``"loglinear"``: AReaL's α per token from the
versions (:func:`simkit.envs.versions.loglinear_alpha`, the behaviour version the one
recorded): by enumeration only.

With one component of one version and ``record="true"`` every number equals
:func:`simkit.experiment.exact_moments`'s bit for bit (the same operations on the same atoms).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simkit import legs
from simkit.envs.versions import VersionedBehaviour, check_record, loglinear_alpha
from simkit.estimators import as_estimator, as_estimators
from simkit.experiment.exact import (
    ExactMoments,
    _atom_score_norms_sq,
    _atom_weights,
    check_finite_coefficients,
    check_params,
    exact_metrics,
    tie,
)
from simkit.experiment.metrics import effective_sample_size, kept_fractions
from simkit.experiment.plan import plan

__all__ = [
    "mixture_divergences",
    "sample_versioned",
    "versioned_metrics",
    "versioned_moments",
    "versioned_monte_carlo",
    "versioned_table",
]


def _baseline(env, behaviour: VersionedBehaviour, est, tables=None) -> float:
    """b of the oracle advantages; ``tables``: the components' tables when already built (the
    oracle's J(μ) = Σ_c w_c J(q_c) as :meth:`VersionedBehaviour.J` computes it)."""
    if est.advantage == "oracle":
        if tables is None:
            return behaviour.J(env)
        return float(sum(w * env.J(q) for w, q in zip(behaviour.weights, tables, strict=True)))
    if est.advantage == "oracle_pi":
        return float(env.J())
    return 0.0


def _token_log_probs(env, table, atoms) -> np.ndarray:
    """log table(y_t | t, s_t) on the atoms' tokens (M, T), 0 on padding."""
    mask = np.asarray(atoms.mask, dtype=bool)
    states = getattr(atoms, "states", None)
    if states is None:  # bandit: one token, the arm
        lp = legs._log(np.asarray(table))[np.asarray(atoms.actions)]
        return np.where(mask, lp[..., None] if lp.ndim < mask.ndim else lp, 0.0)
    return env._token_log_prob(table, atoms.actions, mask, states)


def _recorded(env, behaviour, record, c: int, atoms, tables) -> np.ndarray:
    """log r_t: the behaviour log-probabilities the trainer records on the atoms of ``c``."""
    if record == "mixture":
        w = behaviour.weights
        cum = np.stack([np.cumsum(_token_log_probs(env, q, atoms), axis=1) for q in tables])
        with np.errstate(divide="ignore"):
            log_m = np.logaddexp.reduce(np.log(w)[:, None, None] + cum, axis=0)  # (M, T)
        prev = np.concatenate([np.zeros((log_m.shape[0], 1)), log_m[:, :-1]], axis=1)
        return np.where(np.asarray(atoms.mask, dtype=bool), log_m - prev, 0.0)
    versions = behaviour.recorded_version(record, c)
    stack = np.stack(behaviour.versions)
    if stack.ndim == 2:  # bandit
        return _token_log_probs(env, stack[versions[0]], atoms)
    table = stack[versions, np.arange(versions.size)]
    return _token_log_probs(env, table, atoms)


def _old_log_ratio(env, behaviour, record, c, atoms, log_ratio, rec, old, prox):
    if old is None:
        return None
    mask = np.asarray(atoms.mask, dtype=bool)
    if isinstance(old, legs.LogLinearOld):
        return old.alpha * log_ratio
    if isinstance(old, str):
        if old != "loglinear":
            raise ValueError(f"old must be a table, LogLinearOld or 'loglinear', got {old!r}")
        versions = behaviour.recorded_version(record, c)
        if versions is None:
            raise ValueError("old='loglinear' needs a recorded version (record != 'mixture')")
        alpha = loglinear_alpha(np.asarray(behaviour.ages)[versions], *prox)  # (T,)
        return np.where(mask, alpha[None, : mask.shape[1]] * log_ratio, 0.0)
    lp_old = _token_log_probs(env, env.check_policy(old, "old"), atoms)
    with np.errstate(invalid="ignore"):
        return np.where(mask, lp_old - rec, 0.0)


def versioned_moments(
    env,
    behaviour: VersionedBehaviour,
    estimator,
    n: int,
    record="true",
    old=None,
    proximal_age: int = 0,
    theta_lead: int = 1,
    params: str = "untied",
    method: str = "auto",
) -> ExactMoments:
    """E ĝ, Var ĝ, ESS and kept fractions of an n-sample per-sample estimator under
    ``behaviour`` (module docstring), exact by enumeration.

    ``record``: what the trainer logs as the behaviour log-probabilities (one of
    :data:`~simkit.envs.versions.RECORDS` or an int age); ``old``: π_old of a composed
    estimator (a table, :class:`~simkit.legs.LogLinearOld`, or ``"loglinear"`` with α per
    token from the recorded versions, ``proximal_age`` and ``theta_lead``:
    :func:`~simkit.envs.versions.loglinear_alpha`); ``params`` as in
    :func:`~simkit.experiment.exact_moments`. ``method``: ``"enumeration"`` (every sequence),
    ``"dp"`` (each component's moments by the token-MDP moment DP of
    :mod:`simkit.envs.token_moments` — any T — summed with the weights; for ``record="true"``,
    untied parameters, an estimator the planner gives a DP, and π_old a table or None; kept
    fractions NaN) or ``"auto"`` (enumeration within the budget, else the DP).
    """
    est = as_estimator(estimator)
    params = check_params(params)
    check_record(record)
    if not isinstance(behaviour, VersionedBehaviour):
        raise ValueError(f"behaviour must be a VersionedBehaviour, got {type(behaviour).__name__}")
    how = plan(est, env, params)
    if not how.exact:
        kind = "is not per-sample" if not est.per_sample else "has no exact path"
        raise ValueError(f"estimator {est.name!r} {kind}: {how.why_mc}")
    est.check_batch_size(n)
    if method not in ("auto", "enumeration", "dp"):
        raise ValueError(f"method must be 'auto', 'enumeration' or 'dp', got {method!r}")
    enumerable = getattr(env, "enumerable", None)
    beyond = enumerable is not None and not enumerable()
    tables = [behaviour.table(c) for c in range(len(behaviour.components))]
    b = _baseline(env, behaviour, est, tables)
    if method == "dp" or (method == "auto" and beyond):
        why = _why_no_dp(env, est, record, old, params)
        if why:
            raise ValueError(
                f"estimator {est.name!r}: no versioned moment DP ({why})"
                + (f"; the environment has {env.n_sequences} sequences" if beyond else "")
            )
        return _dp_versioned(env, behaviour, est, n, b, tables, old)
    first = None
    second = 0.0
    probs, cs, masks, lengths = [], [], [], []
    for c, comp in enumerate(behaviour.components):
        atoms = env.support(tables[c], b)
        mask = np.asarray(atoms.mask, dtype=bool)
        if record == "true":
            log_ratio = atoms.log_ratio
            rec = (
                None
                if old is None or isinstance(old, legs.LogLinearOld | str)
                else (_token_log_probs(env, tables[c], atoms))
            )
        else:
            rec = _recorded(env, behaviour, record, c, atoms, tables)
            lp_pi = _token_log_probs(env, env.pi, atoms)
            with np.errstate(invalid="ignore"):
                log_ratio = np.where(mask, lp_pi - rec, 0.0)
        old_lr = _old_log_ratio(
            env, behaviour, record, c, atoms, log_ratio, rec, old, (proximal_age, theta_lead)
        )
        coef = est.coefficients(log_ratio, mask, atoms.advantage_sign, old_log_ratio=old_lr)
        check_finite_coefficients(est, coef, mask, "tokens of the support")
        per_token = coef * _atom_weights(est, _WithRatio(atoms, log_ratio), mask, old_lr)
        w = comp.weight
        part = env.accumulate(atoms.actions, per_token * (w * atoms.adv_first)[:, None])
        if params == "tied":
            part = tie(part, env.T)
        first = part if first is None else first + part
        norms = _atom_score_norms_sq(env, atoms.actions, per_token, params)
        second += w * float(np.sum(atoms.adv_second * norms))
        probs.append(w * atoms.prob)
        cs.append(coef)
        masks.append(mask)
        lengths.append(mask.sum(axis=1))
    prob = np.concatenate(probs)
    coefs = np.concatenate(cs)
    mask_all = np.concatenate(masks)
    abs_c = np.abs(coefs) * mask_all
    var_one = max(second - float(first @ first), 0.0)
    mean_length = float(prob @ np.concatenate(lengths))
    ess = effective_sample_size(
        n, float(prob @ abs_c.sum(axis=1)), float(prob @ (abs_c**2).sum(axis=1))
    )
    ess = ess / mean_length if mean_length > 0 else 0.0
    kept = kept_fractions(coefs, mask_all, prob)
    return ExactMoments(mean=first, variance=var_one / n, ess=ess, **kept)


def _why_no_dp(env, est, record, old, params) -> str:
    from simkit.envs.token_moments import composed_dp_applies, dp_applies

    if record != "true":
        return f"record={record!r} is not a per-component table (only 'true' is)"
    if isinstance(old, legs.LogLinearOld | str):
        return "the log-linear π_old has no table"
    if params != "untied":
        return "tied parameters"
    if est.correction is None:
        return dp_applies(env, est.mapping, est.aggregation)
    return composed_dp_applies(
        env, est.mapping, est.correction, est.mode, est.aggregation, est.denominator
    )


def _dp_versioned(env, behaviour, est, n, b, tables, old) -> ExactMoments:
    """Σ_c w_c of the per-component moment DPs (mean, E‖h‖², ESS sums) at the common b."""
    from simkit.envs.token_moments import composed_moments, moments

    mean, second, abs_sum, sq_sum, length = None, 0.0, 0.0, 0.0, 0.0
    for comp, q in zip(behaviour.components, tables, strict=True):
        if est.correction is None:
            m = moments(env, q, est.mapping, b, est.aggregation, est.max_length)
        else:
            m = composed_moments(
                env,
                q,
                old,
                est.mapping,
                est.correction,
                est.mode,
                b,
                est.aggregation,
                est.max_length,
            )
        w = comp.weight
        mean = w * m.mean if mean is None else mean + w * m.mean
        second += w * m.second
        abs_sum += w * m.abs_sum
        sq_sum += w * m.sq_sum
        length += w * m.mean_length
    var_one = max(second - float(mean @ mean), 0.0)
    denom = sq_sum * length
    ess = n * abs_sum**2 / denom if denom > 0 else 0.0
    return ExactMoments(mean=mean, variance=var_one / n, ess=ess, method="dp")


class _WithRatio:
    """The atoms with another log-ratio (what :func:`_atom_weights` reads)."""

    def __init__(self, atoms, log_ratio):
        self.log_ratio = log_ratio
        self.advantage_sign = atoms.advantage_sign


def versioned_metrics(env, behaviour, estimator, n: int, **kwargs) -> dict[str, float]:
    """The exact metrics (bias, variance, MSE, cosine, scale-free error, …) of
    :func:`versioned_moments` against env's ∇J (tied with ``params="tied"``)."""
    grad_J = env.grad_J()
    if kwargs.get("params") == "tied":
        grad_J = tie(grad_J, env.T)
    return exact_metrics(versioned_moments(env, behaviour, estimator, n, **kwargs), grad_J)


def mixture_divergences(env, behaviour: VersionedBehaviour) -> dict[str, float]:
    """χ²(π‖μ_mix) and KL(π‖μ_mix) of the batch's sequence law μ_mix(y) = Σ_c w_c q_c(y) (by
    enumeration: a mixture has no product form), and the per-version average
    Σ_c w_c χ²(π‖q_c) ≥ χ²(π‖μ_mix) (joint convexity) as ``chi2_seq_versions``."""
    support = env.support(env.pi, 0.0)
    log_pi = np.log(support.prob)
    log_q = np.stack(
        [
            _token_log_probs(env, behaviour.table(c), support).sum(axis=1)
            for c in range(len(behaviour.components))
        ]
    )
    w = behaviour.weights
    with np.errstate(divide="ignore"):
        log_mix = np.logaddexp.reduce(np.log(w)[:, None] + log_q, axis=0)
        per = np.exp(2 * log_pi[None, :] - log_q).sum(axis=1) - 1.0
    pi = support.prob
    return {
        "chi2_seq": float(np.sum(pi * np.exp(log_pi - log_mix)) - 1.0),
        "kl_seq": float(np.sum(pi * (log_pi - log_mix))),
        "chi2_seq_versions": float(w @ per),
    }


def versioned_table(env, behaviour, estimators, n: int, setting: dict | None = None, **kwargs):
    """One row per estimator of :func:`versioned_metrics` (a pandas DataFrame) with the
    ``estimator`` name, the constant ``setting`` columns, the batch's ``mean_age``,
    ``wasted``, ``waited`` and :func:`mixture_divergences`."""
    rows = []
    div = mixture_divergences(env, behaviour)
    for est in as_estimators(estimators):
        row = {"estimator": est.name, **(setting or {})}
        row.update(versioned_metrics(env, behaviour, est, n, **kwargs))
        row.update(
            mean_age=behaviour.mean_age(),
            wasted=behaviour.wasted,
            waited=behaviour.waited,
            exact=True,
            **div,
        )
        rows.append(row)
    return pd.DataFrame(rows)


class _Draws:
    """``reps`` batches of ``n`` samples from a versioned behaviour, shaped like a
    :class:`~simkit.envs.token_sampling.TokenBatch` for
    :func:`~simkit.experiment.monte_carlo.sample_gradients` (``log_ratio`` against the
    recorded behaviour)."""

    def __init__(self, actions, mask, states, rewards, log_ratio, J, J_mu):
        self.actions, self.mask, self.states = actions, mask, states
        self.rewards, self.log_ratio, self.J, self.J_mu = rewards, log_ratio, J, J_mu


def sample_versioned(env, behaviour: VersionedBehaviour, n: int, reps: int, rng, record="true"):
    """``reps`` batches of ``n`` samples: each sample's component drawn with the behaviour's
    weights, then its tokens from the component's table; returns (draws, old-ratio context)
    where ``draws.log_ratio`` = log π − log r with r the ``record``-ed behaviour, and the
    per-sample component (reps, n)."""
    check_record(record)
    tables = [behaviour.table(c) for c in range(len(behaviour.components))]
    comp = rng.choice(len(tables), size=(reps, n), p=behaviour.weights)
    T = env.T
    actions = np.zeros((reps, n, T), dtype=np.int32)
    states = np.zeros((reps, n, T), dtype=np.int32)
    mask = np.zeros((reps, n, T), dtype=bool)
    rewards = np.zeros((reps, n))
    log_ratio = np.zeros((reps, n, T))
    for c in np.unique(comp):
        sel = comp == c
        b = env.sample(tables[c], int(sel.sum()), rng)
        actions[sel], states[sel], mask[sel], rewards[sel] = b.actions, b.states, b.mask, b.rewards
        if record == "true":
            log_ratio[sel] = b.log_ratio
            continue
        view = _Draws(b.actions, b.mask, b.states, None, None, None, None)
        rec = _recorded(env, behaviour, record, int(c), view, tables)
        lp_pi = _token_log_probs(env, env.pi, view)
        with np.errstate(invalid="ignore"):
            log_ratio[sel] = np.where(b.mask, lp_pi - rec, 0.0)
    draws = _Draws(actions, mask, states, rewards, log_ratio, env.J(), behaviour.J(env))
    return draws, comp


def versioned_monte_carlo(
    env,
    behaviour: VersionedBehaviour,
    estimator,
    n: int,
    reps: int = 1000,
    seed: int = 0,
    record="true",
    level: float = 0.95,
    n_boot: int = 1000,
) -> dict[str, float]:
    """Monte Carlo metrics with bootstrap bounds
    (:func:`~simkit.experiment.monte_carlo.monte_carlo_metrics`) of any estimator — batch-dependent
    ones included (group advantages, self-normalised or PSIS weights) — on ``reps`` batches of
    ``n`` samples from ``behaviour`` (:func:`sample_versioned`), ``record`` as in
    :func:`versioned_moments`.
    Randomness from ``SeedSequence(seed)``: the draws, the estimator's own randomness and
    the bootstrap from three children."""
    from simkit.experiment.monte_carlo import (
        bootstrap_weights,
        monte_carlo_metrics,
        sample_gradients,
    )

    est = as_estimator(estimator)
    if not isinstance(behaviour, VersionedBehaviour):
        raise ValueError(f"behaviour must be a VersionedBehaviour, got {type(behaviour).__name__}")
    est.check_batch_size(n)
    s_draw, s_coef, s_boot = np.random.SeedSequence(seed).spawn(3)
    draws, _ = sample_versioned(env, behaviour, n, reps, np.random.default_rng(s_draw), record)
    g = sample_gradients(env, draws, est, None, np.random.default_rng(s_coef))
    boot = bootstrap_weights(reps, n_boot, np.random.default_rng(s_boot))
    return monte_carlo_metrics(g, env.grad_J(), n, boot, level)
