"""The two legs of a three-policy experiment: staleness π‖π_old and inference mismatch π_old‖μ.

``simkit.experiment.run(..., old=π_old)`` draws its batches from μ as always; a composed
estimator (:mod:`simkit.composition`) also needs, per drawn token (and per atom of the exact
path), o_t = log π_old(y_t|s_t) − log μ(y_t|s_t). :func:`old_log_ratio` computes it for the
bandit and the token MDP from the actions (and automaton states) the batch already holds;
:func:`leg_divergences` gives the χ²/KL columns of both legs. ``old`` has the shape of the
behaviour (K,) or (T, P, V). Default ``old = None`` means π_old = π and nothing here is used.

``old`` may also be :class:`LogLinearOld`: AReaL's approximated proximal policy
(``prox_logp_method="loglinear"``, A-3PO, arXiv 2512.06547), log π_old ≈ log μ + α·(log π −
log μ) per token, i.e. o_t = α·ℓ_t — no table, only the token log-ratios (exact path by
enumeration and Monte Carlo; the composed moment DP needs a table and refuses it).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

#: columns added to the experiment table when ``old`` is given (π‖π_old: ``_stale``,
#: π_old‖μ: ``_infer``)
LEG_COLUMNS = tuple(
    f"{d}_{level}_{leg}"
    for leg in ("stale", "infer")
    for level in ("tok", "seq")
    for d in ("chi2", "kl")
)


@dataclasses.dataclass(frozen=True)
class LogLinearOld:
    """π_old approximated log-linearly between the behaviour and the current policy.

    AReaL's ``prox_logp_method="loglinear"`` (``docs/algorithms/prox_approx.md`` at
    inclusionAI/AReaL 45a6d5f; A-3PO, arXiv 2512.06547): per token

        log π_old ≈ log μ + α·(log π − log μ),   α = (v_prox − v_behave)/(v_θ − v_behave),

    so o_t = log π_old − log μ = α·ℓ_t and the staleness leg ℓ_t − o_t = (1 − α)·ℓ_t. α = 1 is
    π_old = π (the recomputed π_old when π has not moved since the rollout's proximal step);
    α = 0 is π_old = μ (``prox_logp_method="rollout"``). ``alpha`` is a real number (one value
    for every token; :func:`simkit.envs.versions.loglinear_alpha` gives it per token from the
    versions, used by :mod:`simkit.experiment.versions`). Not a normalised policy: π_old's
    divergence columns are NaN.
    """

    alpha: float = 1.0

    def __post_init__(self):
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
            raise ValueError(f"LogLinearOld: alpha must be a finite real number, got {a!r}")
        object.__setattr__(self, "alpha", float(a))


def check_old(env, old):
    """Validate π_old (the shape and normalisation of a behaviour policy of ``env``); a
    :class:`LogLinearOld` is returned as it is."""
    if isinstance(old, LogLinearOld):
        return old
    return env.check_policy(old, "old")


def _log(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p)


def old_log_ratio(env, old, mu, actions, mask, states=None) -> np.ndarray:
    """o = log π_old − log μ per token, shape of ``mask`` (L..., n, T), 0 on padding.

    Bandit (T = 1): ``actions`` (L..., n) arm indices. Token MDP: ``actions``, ``states``
    (L..., n, T) as its batches and supports carry them. −inf where π_old gives a drawn token
    probability 0 (the correction's ratio is then 0).
    """
    m = np.asarray(mask, dtype=bool)
    if isinstance(old, LogLinearOld):  # o = α·(log π − log μ)
        lr = old_log_ratio(env, env.pi, mu, actions, mask, states)
        return old.alpha * lr
    if states is None:  # bandit
        diff = _log(old) - _log(mu)
        return np.where(m, diff[np.asarray(actions)][..., None], 0.0)
    lp_old = env._token_log_prob(old, actions, m, states)
    lp_mu = env._token_log_prob(mu, actions, m, states)
    with np.errstate(invalid="ignore"):
        return np.where(m, lp_old - lp_mu, 0.0)


def target_log_prob(env, actions, mask, states=None) -> np.ndarray:
    """log π per token of a batch or support (shape of ``mask``), π the environment's target
    (``env.pi``); 0 on padding. The mappings that need log π itself (``requires_log_prob``:
    DPPO, GEPO) get it from here on the experiment's exact and Monte Carlo paths. Bandit
    (T = 1): ``actions`` (L..., n); token MDP: ``actions``, ``states`` (L..., n, T); an
    environment with ``target_token_log_prob`` (the LM's leaves) answers itself."""
    m = np.asarray(mask, dtype=bool)
    if hasattr(env, "target_token_log_prob"):  # the LM's enumerated leaves (edge ids)
        return env.target_token_log_prob(actions, m, states)
    if states is None:  # bandit
        return np.where(m, _log(env.pi)[np.asarray(actions)][..., None], 0.0)
    return np.where(m, env._token_log_prob(env.pi, actions, m, states), 0.0)


def log_prob_for(est, env, draws) -> np.ndarray | None:
    """:func:`target_log_prob` of ``draws`` (a batch or a support) when ``est``'s mapping
    needs log π (``requires_log_prob``), else None."""
    if not est.mapping.requires_log_prob:
        return None
    return target_log_prob(env, draws.actions, draws.mask, getattr(draws, "states", None))


def _with_target(env, policy):
    """``env`` whose target is ``policy`` (for divergences from it); None if it has zeros."""
    if not np.all(policy > 0):
        return None
    logits = np.log(policy)
    if hasattr(env, "with_logits"):
        return env.with_logits(logits)
    return dataclasses.replace(env, logits=logits)


def leg_divergences(env, old, mu) -> dict[str, float]:
    """χ² and KL (token and sequence level) of π from π_old (``*_stale``) and of π_old from μ
    (``*_infer``), the environment's exact formulas; NaN for the second leg when π_old has a
    zero (it cannot be made a target)."""
    if isinstance(old, LogLinearOld):  # no normalised table: no divergences
        return dict.fromkeys(LEG_COLUMNS, math.nan)
    out = {}
    stale = env.divergences(old)
    target = _with_target(env, old)
    infer = target.divergences(mu) if target is not None else {}
    for leg, values in (("stale", stale), ("infer", infer)):
        for level in ("tok", "seq"):
            for d in ("chi2", "kl"):
                out[f"{d}_{level}_{leg}"] = float(values.get(f"{d}_{level}", math.nan))
    return out
