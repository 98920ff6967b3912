"""The exact path: E ĝ, Var ĝ and ESS of a per-sample estimator without sampling error.

By enumeration of the environment's support (the atoms (y, sign A), weighted by the exact
partial moments of A; :func:`exact_moments`) or, beyond the enumeration budget on a token MDP
with untied parameters, by the moment DP of :mod:`simkit.envs.token_moments`.
:func:`has_exact_path` says when either applies (and :func:`why_not_exact` why not);
:func:`tie` maps untied gradients to tied ones. The module docstring of
:mod:`simkit.experiment` states the formulas.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from simkit import kl as kl_mod
from simkit import legs
from simkit.envs.token_moments import additive_moments, composed_moments
from simkit.envs.token_moments import moments as dp_moments
from simkit.estimators import Estimator, as_estimator
from simkit.experiment.metrics import (
    BOUNDED_METRICS,
    bias,
    bias_dir,
    cosine,
    effective_sample_size,
    kept_fractions,
    scale_free,
    snr,
)
from simkit.experiment.plan import (
    PARAMS,
    as_token_sum_base,
    check_params,
    estimator_obstacles,
    is_enumerable,
    plan,
)

__all__ = [
    "PARAMS",
    "ExactMoments",
    "check_params",
    "exact_metrics",
    "exact_moments",
    "has_exact_path",
    "is_enumerable",
    "oracle_baseline",
    "tie",
    "why_not_exact",
]


@dataclass(frozen=True)
class ExactMoments:
    """Exact moments of an n-sample per-sample estimator: ``mean`` E ĝ (D,), ``variance``
    E‖ĝ − E ĝ‖², ``ess`` (see :func:`effective_sample_size`), ``kept`` and ``kept_seq``
    (:func:`~simkit.experiment.metrics.kept_fractions`; NaN where the path does not give them),
    ``method`` (``enumeration`` or ``dp``, :mod:`simkit.experiment.plan`)."""

    mean: np.ndarray
    variance: float
    ess: float
    kept: float = math.nan
    kept_seq: float = math.nan
    method: str = "enumeration"


def exact_moments(
    env, behaviour, estimator, n: int, params: str = "untied", old=None, ref=None
) -> ExactMoments:
    """E ĝ, Var ĝ and ESS of an n-sample estimator by enumeration of the support (exact).

    Needs an exact path (:func:`has_exact_path`: a per-sample estimator, a deterministic Z and
    an enumerable environment). With the atoms of ``env.support(μ, b)`` (b = J(μ) for the
    ``oracle`` advantage, J(π) for ``oracle_pi``, 0 for raw: :func:`oracle_baseline`) — (y, sign
    A) on the bandit, whole sequences y on the token MDP —, c_t the mapping's coefficients on
    each atom (one (M, T) call) and a_t = n/Z_i the aggregation weight of one sample (the atom
    seen as a batch of one: 1/T for fixed-length token-mean, 1/|y| for seq-mean-token-mean, 1
    for seq-mean-token-sum, 1/L_max for seq-mean-token-sum-norm), each sample contributes h =
    A·Σ_t c_t a_t ∇log π(y_t|s_t) and
    ĝ = (1/n) Σ_i h_i with h_i i.i.d.:

        E h   = Σ_atoms E[A·1{atom}] · Σ_t c_t a_t ∇log π(y_t|s_t)       (one ``accumulate``)
        E‖h‖² = Σ_atoms E[A²·1{atom}] · ‖Σ_t c_t a_t ∇log π(y_t|s_t)‖²
        E ĝ = E h,   Var ĝ = (E‖h‖² − ‖E h‖²)/n

    The per-atom squared norms come from ``env.score_norms_sq`` when the environment has it,
    else from per-atom gradients in chunks (``env.accumulate`` on one atom per batch).
    ESS = n·(E Σ_t|c_t|)² / (E Σ_t c_t² · E|y|) (the population form of the Monte Carlo ESS
    over tokens; n·(E|c|)²/E c² when T = 1).

    ``params`` (:data:`PARAMS`): ``"untied"`` — θ has one block per position (the environment's
    own D = T·P·V parameters); ``"tied"`` — one table shared by every position, whose gradient
    is the sum of the per-position blocks (:func:`tie`): E h and ∇J are summed over positions
    and ‖h‖² is taken of the summed per-atom vector (cross-position terms included).

    ``old``: π_old (shape of ``behaviour``; None: π_old = π) for a composed estimator
    (:mod:`simkit.composition`): each atom's o_t = log π_old − log μ (:mod:`simkit.legs`) is
    known, so the exact path is unchanged; beyond enumeration the composed moment DP
    (:func:`simkit.envs.token_moments.composed_moments`) where the coefficient factorises.

    ``ref``: π_ref of an estimator with a KL penalty (:class:`simkit.kl.KLPenalty`; required
    then; beyond enumeration, a penalty in the loss on a token-level mapping without a
    correction has the moment DP :func:`simkit.envs.token_moments.additive_moments`, untied
    parameters). In the reward, each atom's advantage becomes
    A' = R − b' − β·Σ_t w_t k_t (b' the penalised oracle baseline, :func:`oracle_baseline`),
    known per atom, so the formulas above hold with A'. In the loss, each sample adds
    v = Σ_t λ^KL_t ∇log π(y_t|s_t), a function of y alone: with u = Σ_t c_t a_t ∇log π,
    h = A·u + v, E h = Σ_atoms (E[A 1{atom}]·u + P(atom)·v) and
    E‖h‖² = Σ_atoms (E[A² 1{atom}]‖u‖² + 2E[A 1{atom}] u·v + P(atom)‖v‖²),
    u·v = (‖u + v‖² − ‖u‖² − ‖v‖²)/2.

    ``token-sum`` (Z = 1): ĝ is n times the ``seq-mean-token-sum`` estimator's, so its mean is
    n·E ĝ and its variance n²·Var ĝ of that twin (ESS unchanged).
    """
    est = as_estimator(estimator)
    params = check_params(params)
    how = plan(est, env, params)
    if not how.exact:
        kind = "is not per-sample" if not est.per_sample else "has no exact path"
        raise ValueError(f"estimator {est.name!r} {kind}: {how.why_mc}")
    est.check_batch_size(n)
    mu = env.check_policy(behaviour, "behaviour")
    if est.kl is not None and ref is None:
        raise ValueError(f"estimator {est.name!r} has a KL penalty: pass ref = pi_ref")
    if est.aggregation == "token-sum":  # Z = 1: n times the seq-mean-token-sum estimator
        twin = exact_moments(env, mu, as_token_sum_base(est), n, params, old, ref)
        return dataclasses.replace(twin, mean=n * twin.mean, variance=n**2 * twin.variance)
    if how.method == "dp":  # beyond enumeration: the moment DP
        return _dp_moments(env, mu, est, n, old, params, ref)
    baseline = oracle_baseline(env, mu, est, ref)
    atoms = env.support(mu, baseline)
    if est.kl is not None and est.kl.where == "reward":
        atoms = penalised_support(env, mu, ref, est.kl, baseline, atoms)
    mask = np.asarray(atoms.mask, dtype=bool)  # (M, T)
    old_lr = old_log_ratio_of(env, old, mu, atoms)
    log_prob = legs.log_prob_for(est, env, atoms)  # log π of each token (DPPO, GEPO)
    c = est.coefficients(
        atoms.log_ratio, mask, atoms.advantage_sign, old_log_ratio=old_lr, log_prob=log_prob
    )
    check_finite_coefficients(est, c, mask, "tokens of the support")
    weights = _atom_weights(est, atoms, mask, old_lr)
    per_token = c * weights  # c_t·a_t, (M, T)
    first = env.accumulate(atoms.actions, per_token * atoms.adv_first[:, None])  # E h, (D,)
    # per-token terms not proportional to A (λ += v): a KL penalty in the loss, a mapping's
    # additive term b (DRO, DPPO's penalty); h = A·u + v, so E h gains Σ_atoms P(atom)·v
    additive = None
    if est.kl is not None and est.kl.where == "loss":
        x = kl_mod.token_log_ratio_to_ref(
            env, ref, mu, atoms.actions, mask, atoms.log_ratio, getattr(atoms, "states", None)
        )
        # λ^KL of each atom seen as a batch of one (its own aggregation weight), (M, T)
        additive = est.kl_loss_weights(
            x[:, None, :], atoms.log_ratio[:, None, :], mask[:, None, :]
        )[:, 0, :]
    b = est.additive_terms(atoms.log_ratio, mask, log_prob)
    if b is not None:
        additive = b * weights if additive is None else additive + b * weights
    if additive is not None:
        first = first + env.accumulate(atoms.actions, additive * atoms.prob[:, None])
    if params == "tied":
        first = tie(first, env.T)
    norms = _atom_score_norms_sq(env, atoms.actions, per_token, params)
    second = float(np.sum(atoms.adv_second * norms))
    if additive is not None:
        # E‖h‖² = Σ_atoms E[A²1]‖u‖² + 2·E[A·1]·u·v + P(atom)·‖v‖², u·v from three norms
        norms_v = _atom_score_norms_sq(env, atoms.actions, additive, params)
        norms_uv = _atom_score_norms_sq(env, atoms.actions, per_token + additive, params)
        cross = 0.5 * (norms_uv - norms - norms_v)
        second += float(np.sum(2.0 * atoms.adv_first * cross + atoms.prob * norms_v))
    var_one = max(second - float(first @ first), 0.0)
    abs_c = np.abs(c) * mask
    mean_length = float(atoms.prob @ mask.sum(axis=1))
    ess = effective_sample_size(
        n, float(atoms.prob @ abs_c.sum(axis=1)), float(atoms.prob @ (abs_c**2).sum(axis=1))
    )
    ess = ess / mean_length if mean_length > 0 else 0.0
    kept = kept_fractions(c, mask, atoms.prob)
    return ExactMoments(mean=first, variance=var_one / n, ess=ess, **kept)


def old_log_ratio_of(env, old, mu, draws):
    """o = log π_old − log μ on the tokens of a batch or support (None without ``old``)."""
    if old is None:
        return None
    states = getattr(draws, "states", None)
    return legs.old_log_ratio(env, old, mu, draws.actions, draws.mask, states)


def _atom_weights(est, atoms, mask, old_lr) -> np.ndarray:
    """a_t = n/Z_i of each atom seen as a batch of one, (M, T) (``denominator`` included)."""
    return est.kept_weights(
        atoms.log_ratio[:, None, :],
        mask[:, None, :],
        atoms.advantage_sign[:, None],
        None if old_lr is None else old_lr[:, None, :],
    )[:, 0, :]


def check_finite_coefficients(est: Estimator, c: np.ndarray, mask: np.ndarray, where: str) -> None:
    """``ValueError`` naming the estimator and its mapping when the coefficients ``c`` are NaN or
    inf on a valid token (``mask``), with the count of such tokens and ``where`` they are."""
    bad = int(np.count_nonzero(~np.isfinite(c[mask])))
    if bad:
        raise ValueError(
            f"estimator {est.name!r}: mapping {est.mapping.name!r} returned non-finite "
            f"coefficients (NaN/inf) on {bad} {where}"
        )


def oracle_baseline(env, mu, estimator, ref=None) -> float:
    """The exact baseline b of ``estimator``'s advantage A = R − b on ``env`` under μ = ``mu``.

    ``oracle``: J(μ) (``env.J(mu)``: what group and batch means of μ-drawn rewards estimate,
    so that E_μ[A] = 0); ``oracle_pi``: J(π) (``env.J()``); any other advantage: 0. With a KL
    penalty in the reward (``ref`` = π_ref) the mean of the penalised reward R − β·Σ_t w_t k_t
    under μ (``oracle``) or π (``oracle_pi``): :func:`simkit.kl.expected_penalty`.
    """
    est = as_estimator(estimator)
    if est.advantage not in ("oracle", "oracle_pi"):
        return 0.0
    b = float(env.J(mu)) if est.advantage == "oracle" else float(env.J())
    if est.kl is not None and est.kl.where == "reward":
        if ref is None:
            raise ValueError(f"estimator {est.name!r} has a KL penalty: pass ref = pi_ref")
        policy = mu if est.advantage == "oracle" else env.pi
        b -= est.kl.beta * kl_mod.expected_penalty(env, ref, mu, est.kl, policy)
        if not math.isfinite(b):
            raise ValueError(
                f"estimator {est.name!r}: the penalised reward has no finite mean under the "
                "baseline's policy (correction='is' with mu = 0 where pi > 0)"
            )
    return b


def penalised_support(env, mu, ref, kl, baseline: float, atoms):
    """The support ``atoms`` of ``env.support(mu, baseline)`` with the advantage of a KL
    penalty in the reward, A' = R − ``baseline`` − β·Σ_t w_t k_t (a function of the atom).

    Token MDP: the atoms are sequences; their A' replaces A. Bandit: the penalty depends on
    the arm y only, so the atoms (y, sign A') are those of ``env.support(mu, baseline + β·P_y)``
    restricted to arm y (the partial moments of the reward given y at that arm's baseline).
    """
    if hasattr(env, "transition"):
        mask = np.asarray(atoms.mask, dtype=bool)
        x = kl_mod.token_log_ratio_to_ref(
            env, ref, mu, atoms.actions, mask, atoms.log_ratio, atoms.states
        )
        adv = atoms.rewards - baseline - kl.beta * kl.values(x, atoms.log_ratio, mask).sum(1)
        return dataclasses.replace(
            atoms, positive=adv >= 0, adv_first=atoms.prob * adv, adv_second=atoms.prob * adv**2
        )
    table = kl_mod.penalty_table(env, ref, mu, kl)
    parts = []
    for y in range(env.K):
        if not mu[y] > 0:
            continue
        arm = env.support(mu, baseline + kl.beta * float(table[y]))
        keep = arm.actions == y
        parts.append({f.name: getattr(arm, f.name)[keep] for f in dataclasses.fields(arm)})
    return type(atoms)(**{k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


#: per-atom gradient vectors formed at once by :func:`_atom_score_norms_sq` (values)
_CHUNK_VALUES = 1 << 22


def _atom_score_norms_sq(env, actions, token_weights, params: str = "untied") -> np.ndarray:
    """‖Σ_t λ_t ∇log π(y_t|s_t)‖² per atom (M,), for ``actions`` (M, …) and λ (M, T).

    With ``params="tied"`` the norm is of the tied gradient (:func:`tie` of the vector)."""
    if hasattr(env, "score_norms_sq") and params == "untied":
        return env.score_norms_sq(actions, token_weights)
    M = token_weights.shape[0]
    out = np.empty(M)
    rows = max(1, _CHUNK_VALUES // max(env.D, 1))
    for start in range(0, M, rows):
        stop = min(start + rows, M)
        # every atom is its own batch of one sample: (m, 1, …) -> (m, D)
        grads = env.accumulate(actions[start:stop, None], token_weights[start:stop, None])
        if params == "tied":
            grads = tie(grads, env.T)
        out[start:stop] = np.sum(grads**2, axis=-1)
    return out


def tie(vectors, T: int) -> np.ndarray:
    """Gradient w.r.t. *tied* parameters from gradients w.r.t. untied ones: (…, T·B) → (…, B).

    The untied θ has one block θ[t] of B = D/T parameters per position t (C order, position
    first: the token MDP's logits (T, P, V)); a tied policy uses one table θ_tied for every
    position, θ[t] = θ_tied (plus any fixed per-position offset), so by the chain rule
    ∂f/∂θ_tied = Σ_t ∂f/∂θ[t]: the sum of the per-position blocks. Linear, so E ĝ, ∇J and
    every ĝ_r are tied the same way (issue 12 §2: the growth laws of the bias change with it).
    """
    v = np.asarray(vectors, dtype=np.float64)
    D = v.shape[-1]
    if T < 1 or D % T:
        raise ValueError(f"cannot tie a gradient of dimension {D} over T = {T} positions")
    return v.reshape(*v.shape[:-1], T, D // T).sum(axis=-2)


def has_exact_path(env, estimator, params: str = "untied") -> bool:
    """True iff :func:`exact_moments` applies to ``estimator`` on ``env`` (the planner,
    :func:`simkit.experiment.plan.plan`, says enumeration or DP)."""
    return plan(as_estimator(estimator), env, params).exact


def _dp_moments(
    env, mu, est: Estimator, n: int, old=None, params: str = "untied", ref=None
) -> ExactMoments:
    """Exact moments by the token-MDP DP (:mod:`simkit.envs.token_moments`; tied parameters:
    :mod:`simkit.envs.token_moments_tied`), any T; a composed estimator with π_old = ``old``.
    The kept fractions by :func:`simkit.envs.token_kept.kept_dp` where it applies (NaN
    otherwise)."""
    from simkit.envs.token_kept import kept_dp, kept_dp_applies
    from simkit.envs.token_moments_tied import tied_composed_moments, tied_moments

    if isinstance(old, legs.LogLinearOld):
        raise ValueError(
            f"estimator {est.name!r}: old=LogLinearOld (the log-linear π_old) has no table for "
            "the composed moment DP; use an environment small enough to enumerate"
        )
    b = oracle_baseline(env, mu, est)
    tied = params == "tied"
    if est.kl is not None or est.mapping.has_additive:  # λ_t = (c_t·A + β_t)/Z, untied
        m = additive_moments(
            env, mu, est.mapping, b, est.aggregation, est.max_length, kl=est.kl, ref=ref
        )
    elif est.correction is None:  # one ratio π/μ, whatever π_old is
        moments_of = tied_moments if tied else dp_moments
        m = moments_of(env, mu, est.mapping, b, est.aggregation, est.max_length)
    else:
        moments_of = tied_composed_moments if tied else composed_moments
        m = moments_of(
            env, mu, old, est.mapping, est.correction, est.mode, b, est.aggregation, est.max_length
        )
    kept = {"kept": math.nan, "kept_seq": math.nan}
    if not kept_dp_applies(env, est.mapping, est.correction, est.mode):
        kept = kept_dp(env, mu, est.mapping, b, est.correction, old, est.mode)
    return ExactMoments(mean=m.mean, variance=m.variance(n), ess=m.ess(n), method="dp", **kept)


def exact_metrics(moments: ExactMoments, grad_J) -> dict[str, float]:
    """Metrics of the exact path (bounds NaN), the scale-free error of
    :func:`~simkit.experiment.metrics.scale_free` and the kept fractions included."""
    mean = moments.mean
    b = bias(mean, grad_J)
    out = {
        "bias": b,
        "bias_dir": bias_dir(mean, grad_J),
        "cosine": cosine(mean, grad_J),
        "variance": moments.variance,
        "mse": b**2 + moments.variance,
        "snr": snr(float(mean @ mean), moments.variance),
        "ess": moments.ess,
        **scale_free(mean, moments.variance, grad_J),
        "kept": moments.kept,
        "kept_seq": moments.kept_seq,
    }
    for key in BOUNDED_METRICS:
        out[f"{key}_lo"] = out[f"{key}_hi"] = math.nan
    return out


def why_not_exact(est: Estimator, env=None, params: str = "untied") -> str:
    """Why ``est`` has no exact path on ``env`` ('' if it has one: enumeration or DP); without
    ``env``, the obstacles of the estimator itself. The planner decides
    (:func:`simkit.experiment.plan.plan`)."""
    if env is None:
        return " and ".join(estimator_obstacles(est, None))
    return plan(est, env, params).why_mc
