"""Behaviour policies μ for a :class:`~simkit.envs.token_mdp.TokenMDP`, dialed from its π.

A behaviour policy is an array of probabilities of the shape (T, P, V) of ``env.pi``: one
next-token distribution per *row* (t, p) — position t, policy class p. It is built by applying a
:mod:`simkit.shifts` family (``temperature``, ``logit_noise``, ``mixture``, ``top_p``,
``top_k``, ``tail``, ``tilt``) row by row to π, with a strength chosen so that a divergence
D(π‖μ) ∈ {χ², KL, TV} (target first, behaviour second) equals a target, at one of two levels:

``level="token"``
    - ``aggregate="each"`` (default): every selected row gets D(π_{t,p}‖μ_{t,p}) = target
      (a scalar, or one target per row, shape (T, P)); the rows are dialed one by one by
      :func:`simkit.shifts.dial` (its strength is per row).
    - ``aggregate="average"``: one strength s shared by the selected rows such that the
      per-token divergence averaged over the emitted tokens of μ's sequences equals the
      target (:func:`token_average`):

          D̄_tok(μ) = Σ_{t,s} o_μ(t, s)·D(π_{t,p(s)}‖μ_{t,p(s)}) / Σ_{t,s} o_μ(t, s),

      o_μ = ``env.occupancy(mu)`` (probability of being in automaton state s at position t
      with the sequence still running; computed by ``env.divergences_tok``). o_μ depends on
      s, so this is a 1-D root solve over s.

``level="sequence"``
    One strength s shared by the selected rows such that the sequence-level divergence of the
    environment's exact dynamic programming equals the target: ``env.chi2_seq(mu)``
    (1 + χ²_seq = E_μ[W²], W = Π_t π/μ), ``env.kl_seq(mu)`` or ``env.tv_seq(mu)`` (TV only where
    the environment computes it exactly, i.e. does not return NaN).

The shared-strength solves scan the family's strength range in expanding steps (doubling from
1e-8 on an unbounded range, 64 even steps on a bounded one) until the divergence first reaches
the target, then refine the bracket with Brent's method (``scipy.optimize.brentq``); the
achieved divergence is checked against the target to ``SEQ_RTOL`` = 1e-6 relative. An
unreachable target raises ``ValueError`` naming the largest value reached.

Profiles where the mismatch concentrates (the "toxic tail" of real inference engines, e.g.
Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
rare tokens sampled by the inference engine with much smaller probability than the trainer
assigns them):

- :func:`concentrated`: only a few rows (t, p) are shifted — a random fraction of the rows π
  reaches, or explicit ``states`` — the others are exactly π;
- :func:`toxic_tail`: the ``tail`` family (the rarest tokens of every row multiplied by
  e^{−s}), whose ratios π/μ are heavy-tailed: large χ² for a small KL.

:func:`behaviour` is the one entry point; :class:`BehaviourSpec` holds the same choices as a
validated frozen dataclass (for configs) and builds μ with :meth:`BehaviourSpec.build`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from simkit import shifts
from simkit._validation import as_prob, nonnegative_int

__all__ = [
    "AGGREGATES",
    "LEVELS",
    "SEQ_RTOL",
    "BehaviourSpec",
    "behaviour",
    "concentrated",
    "random_states",
    "row_weights",
    "sequence_divergence",
    "shift_rows",
    "token_average",
    "toxic_tail",
]

#: levels at which a target can be set
LEVELS = ("token", "sequence")
#: how a token-level target is read: every row hits it, or their μ-weighted average does
AGGREGATES = ("each", "average")
#: relative accuracy guaranteed (and checked) by the shared-strength solves
SEQ_RTOL = 1e-6

_SEQ_METHOD = {"chi2": "chi2_seq", "kl": "kl_seq", "tv": "tv_seq"}
_SYMBOL = {"chi2": "χ²", "kl": "KL", "tv": "TV"}


# --- input checks ---------------------------------------------------------------------------


def _policy_of(env) -> np.ndarray:
    """π of ``env`` as a validated (T, P, V) array."""
    pi = getattr(env, "pi", None)
    if pi is None:
        raise TypeError(f"env must be a TokenMDP-like environment with a `pi`, got {env!r}")
    p = as_prob(pi, "env.pi")
    if p.ndim != 3:
        raise ValueError(f"env.pi must have shape (T, P, V), got shape {p.shape}")
    return p


def _check_divergence(divergence: str) -> None:
    if divergence not in shifts.DIVERGENCES:
        raise ValueError(
            f"divergence must be one of {sorted(shifts.DIVERGENCES)}, got {divergence!r}"
        )


def _check_level(level: str, aggregate: str | None) -> str | None:
    """Validate ``level`` and ``aggregate``; return the aggregate to use (None at sequence)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if level == "sequence":
        if aggregate is not None:
            raise ValueError(
                f"aggregate applies to level='token' only; got aggregate={aggregate!r} with "
                "level='sequence'"
            )
        return None
    aggregate = "each" if aggregate is None else aggregate
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    return aggregate


def _check_support(fam: shifts.ShiftFamily, divergence: str) -> None:
    if fam.cuts_support and divergence in ("chi2", "kl"):
        raise ValueError(
            f"family {fam.name!r} cuts π's support (tokens with π > 0 get μ = 0), so "
            f"{_SYMBOL[divergence]}(π‖μ) is infinite as soon as a token is cut; only 'tv' can "
            "be dialed with it"
        )


def _scalar_target(target, what: str) -> float:
    t = np.asarray(target, dtype=np.float64)
    if t.ndim != 0:
        raise ValueError(
            f"target must be a scalar for {what} (one shared strength), got shape {t.shape}"
        )
    t = float(t)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"target must be finite and >= 0, got {target!r}")
    return t


def _state_mask(states, shape: tuple[int, int]) -> np.ndarray:
    """The (T, P) boolean mask of the rows to shift: ``None`` = all rows, a boolean (T, P)
    array, or a sequence of (t, p) index pairs."""
    T, P = shape
    if states is None:
        return np.ones(shape, dtype=bool)
    arr = np.asarray(states)
    if arr.dtype == bool:
        if arr.shape != shape:
            raise ValueError(
                f"shape mismatch: a boolean states mask must have shape (T, P) = {shape}, "
                f"got shape {arr.shape}"
            )
        mask = arr.copy()
    else:
        if arr.size == 0:
            arr = arr.reshape(0, 2)
        if arr.ndim != 2 or arr.shape[1] != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                "states must be None, a boolean (T, P) mask or a sequence of integer (t, p) "
                f"pairs, got an array of shape {arr.shape} and dtype {arr.dtype}"
            )
        bad = (arr[:, 0] < 0) | (arr[:, 0] >= T) | (arr[:, 1] < 0) | (arr[:, 1] >= P)
        if np.any(bad):
            t, p = (int(v) for v in arr[np.argmax(bad)])
            raise ValueError(
                f"states contains the row (t, p) = ({t}, {p}), outside 0 <= t < T = {T}, "
                f"0 <= p < P = {P}"
            )
        mask = np.zeros(shape, dtype=bool)
        mask[arr[:, 0], arr[:, 1]] = True
    if not mask.any():
        raise ValueError("states selects no row (t, p): nothing to shift")
    return mask


# --- divergences of a behaviour policy --------------------------------------------------------


def row_weights(env, mu) -> np.ndarray:
    """Expected number of tokens emitted from each row (t, p) under μ, shape (T, P):
    Σ_{s: policy_index[s] = p} o_μ(t, s) with o_μ = ``env.occupancy(mu)`` (T, S)."""
    occupancy = np.asarray(env.occupancy(mu), dtype=np.float64)
    T, P = np.shape(env.pi)[:2]
    weights = np.zeros((T, P))
    np.add.at(weights.T, np.asarray(env.policy_index), occupancy.T)
    return weights


def token_average(env, mu, divergence: str = "chi2") -> float:
    """Per-token divergence averaged over the tokens μ emits, from ``env.divergences_tok``:
    Σ_{t,s} o_μ(t, s)·D(π_{t,p(s)}‖μ_{t,p(s)}) / Σ_{t,s} o_μ(t, s) (the denominator is
    E_μ[length]). env: a TokenMDP; mu: (T, P, V); divergence: ``"chi2"``, ``"kl"``, ``"tv"``.
    """
    _check_divergence(divergence)
    return float(env.divergences_tok(mu)[f"{divergence}_tok"])


def sequence_divergence(env, mu, divergence: str = "chi2") -> float:
    """D(π‖μ) between the *sequence* distributions, from the environment's exact DP:
    ``env.chi2_seq(mu)``, ``env.kl_seq(mu)`` or ``env.tv_seq(mu)`` (NaN where the env has no
    exact TV). env: a TokenMDP; mu: (T, P, V)."""
    _check_divergence(divergence)
    return float(getattr(env, _SEQ_METHOD[divergence])(mu))


# --- building μ -----------------------------------------------------------------------------


def shift_rows(env, strength, family="temperature", states=None, **family_kwargs) -> np.ndarray:
    """μ = π with the rows (t, p) selected by ``states`` moved by ``family`` at ``strength``
    (a scalar shared by the rows, or one per row, shape (T, P)); other rows are exactly π.

    env: a TokenMDP; states: None (every row), a boolean (T, P) mask or (t, p) pairs.
    Returns μ of shape (T, P, V).
    """
    fam = shifts.resolve_family(family, family_kwargs)
    pi = _policy_of(env)
    mask = _state_mask(states, pi.shape[:2])
    s = np.asarray(strength, dtype=np.float64)
    try:
        s = np.broadcast_to(s, pi.shape[:2])
    except ValueError:
        raise ValueError(
            f"strength must be a scalar or of shape (T, P) = {pi.shape[:2]}, got shape {s.shape}"
        ) from None
    mu = pi.copy()
    mu[mask] = fam.apply(pi[mask], s[mask])
    return mu


def random_states(env, fraction: float, seed: int = 0) -> np.ndarray:
    """A (T, P) boolean mask of ``max(1, round(fraction·R))`` rows drawn uniformly without
    replacement (``numpy.random.default_rng(seed)``) among the R rows (t, p) that π reaches
    (positive expected number of tokens, :func:`row_weights` of π)."""
    if isinstance(fraction, bool) or not (
        isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0
    ):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    nonnegative_int(seed, "seed")
    pi = _policy_of(env)
    reachable = np.flatnonzero(row_weights(env, pi) > 0)
    k = max(1, round(fraction * reachable.size))
    chosen = np.random.default_rng(int(seed)).choice(reachable, size=k, replace=False)
    mask = np.zeros(pi.shape[:2], dtype=bool)
    mask.flat[chosen] = True
    return mask


def _solve_shared_strength(value_of, pi, mask, fam, target: float, name: str):
    """The smallest strength s (shared by the rows in ``mask``) with ``value_of(μ_s)`` =
    ``target``; returns (μ, s). Expanding scan, then Brent (via :mod:`simkit.shifts`)."""
    rows = pi[mask]
    fam.check_rows(rows)
    upper = np.array([fam.max_strength(r) for r in rows])
    grid = shifts.scan_grid(fam, rows[int(np.argmin(upper))])

    def mu_at(s):
        mu = pi.copy()
        mu[mask] = fam.apply(rows, s)
        return mu

    def value_at(s):
        return value_of(mu_at(float(s)))

    if target == 0.0:
        return pi.copy(), 0.0
    values = []
    for s in grid:  # expand until the target is first reached
        v = value_at(s)
        if math.isnan(v):
            raise ValueError(
                f"{name} is not computed exactly for this environment (it returns NaN, e.g. "
                "TV_seq with too many sequences to enumerate): it cannot be dialed; dial "
                "'chi2' or 'kl' instead"
            )
        values.append(v)
        if v >= target:
            break
    where = " on the selected rows" if not mask.all() else ""
    try:
        s_star = shifts.solve_increasing_crossing(
            value_at, target, grid[: len(values)], np.asarray(values)
        )
    except shifts.Unreachable as exc:
        raise exc.as_error(name, target, fam, where) from None
    mu = mu_at(s_star)
    achieved = value_of(mu)
    if not abs(achieved - target) <= SEQ_RTOL * target:
        raise ValueError(
            f"target {name} = {target:.6g} cannot be hit with family {fam.label!r}{where} to "
            f"{SEQ_RTOL:g} relative: the solve ended at strength {s_star:.6g} with {name} = "
            f"{achieved:.10g} (the family is discontinuous there, or {name} is not resolved "
            "at this precision)"
        )
    return mu, s_star


def behaviour(
    env,
    target,
    divergence: str = "chi2",
    level: str = "token",
    family: str | shifts.ShiftFamily = "temperature",
    *,
    aggregate: str | None = None,
    states=None,
    return_strength: bool = False,
    **family_kwargs,
):
    """Behaviour policy μ (T, P, V) from ``env.pi`` by a shift family, dialed to a target.

    Parameters
    ----------
    env : TokenMDP (uses ``pi``, ``occupancy``, ``policy_index`` and, at sequence level,
        ``chi2_seq`` / ``kl_seq`` / ``tv_seq``).
    target : the divergence to reach, ≥ 0. A scalar; at ``level="token"`` with
        ``aggregate="each"`` also an array of shape (T, P) (one target per row).
    divergence : ``"chi2"``, ``"kl"`` or ``"tv"`` — D(π‖μ) (:mod:`simkit.divergence`).
    level : ``"token"`` (per-row divergences) or ``"sequence"`` (the env's exact
        sequence-level divergence, one shared strength).
    family : a :mod:`simkit.shifts` family name (hyperparameters as keyword arguments) or an
        instance.
    aggregate : at ``level="token"``: ``"each"`` (default; every selected row hits the target,
        :func:`simkit.shifts.dial` row by row) or ``"average"`` (one shared strength; the
        μ-weighted average :func:`token_average` hits the target). Must be None at sequence
        level.
    states : rows (t, p) to shift — None (all), a boolean (T, P) mask or (t, p) pairs; the
        other rows are exactly π.
    return_strength : also return the strength: a float for a shared strength, a (T, P) array
        (0 on untouched rows) for ``aggregate="each"``.

    Returns μ of shape (T, P, V), or ``(mu, strength)``.

    Accuracy: ``aggregate="each"`` to 1e-8 relative per row (``shifts.DIAL_RTOL``); shared
    strengths to ``SEQ_RTOL`` = 1e-6 relative (checked). Raises ``ValueError`` for an
    unreachable target (naming the largest reachable value), an unknown divergence / level /
    aggregate, χ²/KL with a support-cutting family, TV_seq where the env has no exact value,
    and shape mismatches; ``KeyError`` for an unknown family.
    """
    fam = shifts.resolve_family(family, family_kwargs)
    _check_divergence(divergence)
    aggregate = _check_level(level, aggregate)
    _check_support(fam, divergence)
    pi = _policy_of(env)
    mask = _state_mask(states, pi.shape[:2])

    if aggregate == "each":
        t = np.asarray(target, dtype=np.float64)
        try:
            t = np.broadcast_to(t, pi.shape[:2])
        except ValueError:
            raise ValueError(
                f"shape mismatch: target must be a scalar or of shape (T, P) = {pi.shape[:2]} "
                f"(one per row), got shape {t.shape}"
            ) from None
        if not np.all(np.isfinite(t)) or np.any(t < 0):
            raise ValueError(f"target must be finite and >= 0, got {target!r}")
        mu, strength = shifts.dial(
            pi, np.where(mask, t, 0.0), divergence, fam, return_strength=True
        )
    elif aggregate == "average":
        t = _scalar_target(target, "level='token', aggregate='average'")
        mu, strength = _solve_shared_strength(
            lambda m: token_average(env, m, divergence),
            pi,
            mask,
            fam,
            t,
            f"average per-token {_SYMBOL[divergence]}",
        )
    else:
        t = _scalar_target(target, "level='sequence'")
        mu, strength = _solve_shared_strength(
            lambda m: sequence_divergence(env, m, divergence),
            pi,
            mask,
            fam,
            t,
            f"{_SYMBOL[divergence]}_seq",
        )
    return (mu, strength) if return_strength else mu


def concentrated(
    env,
    target,
    divergence: str = "chi2",
    level: str = "sequence",
    family: str | shifts.ShiftFamily = "temperature",
    *,
    fraction: float | None = None,
    states=None,
    select_seed: int = 0,
    aggregate: str | None = None,
    return_strength: bool = False,
    **family_kwargs,
):
    """μ whose mismatch with π sits on a few rows (t, p) only: a random ``fraction`` of the
    rows π reaches (:func:`random_states` with ``select_seed``) or explicit ``states``; every other
    row is exactly π. Dialed like :func:`behaviour` (default: at sequence level, so the same
    χ²_seq / KL_seq is spread over fewer rows, each then much further from π).

    Give exactly one of ``fraction`` and ``states``. Returns μ (T, P, V) or ``(mu, strength)``.
    """
    if (fraction is None) == (states is None):
        raise ValueError("concentrated needs exactly one of fraction= and states=")
    if fraction is not None:
        states = random_states(env, fraction, select_seed)
    return behaviour(
        env,
        target,
        divergence,
        level,
        family,
        aggregate=aggregate,
        states=states,
        return_strength=return_strength,
        **family_kwargs,
    )


def toxic_tail(
    env,
    target,
    divergence: str = "chi2",
    level: str = "sequence",
    *,
    n_tokens: int = 1,
    states=None,
    aggregate: str | None = None,
    return_strength: bool = False,
):
    """The "toxic tail" profile: in every selected row the ``n_tokens`` rarest tokens of π are
    multiplied by e^{−s} (family ``tail`` of :mod:`simkit.shifts`), as an inference engine that
    under-samples rare tokens. The ratios π/μ on those tokens are e^{s}·(normaliser): heavy
    tailed, so χ² is large for a given KL (per row, with m the starved mass,
    1 + χ² = (1 − m + m e^{−s})(1 − m + m e^{s}) while KL ≈ m·s). Dialed like :func:`behaviour`.

    Returns μ (T, P, V) or ``(mu, strength)``.
    """
    return behaviour(
        env,
        target,
        divergence,
        level,
        "tail",
        aggregate=aggregate,
        states=states,
        return_strength=return_strength,
        n_tokens=n_tokens,
    )


# --- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class BehaviourSpec:
    """A behaviour policy recipe (hyperparameters only; the env is passed to :meth:`build`).

    Fields: ``target`` (≥ 0), ``divergence`` (``"chi2"``/``"kl"``/``"tv"``), ``level``
    (``"token"``/``"sequence"``), ``family`` (a :mod:`simkit.shifts` name), ``aggregate``
    (token level: ``"each"``/``"average"``, None → ``"each"``; must be None at sequence
    level), ``fraction`` (None: every row; a number in (0, 1]: a :func:`concentrated` profile
    on that fraction of the reachable rows, drawn with ``select_seed``), ``select_seed``, and
    ``family_params`` (the family's hyperparameters; a mapping is accepted and stored as a
    sorted tuple of (name, value) pairs so the spec stays hashable).
    """

    target: float
    divergence: str = "chi2"
    level: str = "token"
    family: str = "temperature"
    aggregate: str | None = None
    fraction: float | None = None
    select_seed: int = 0
    family_params: tuple = ()

    def __post_init__(self):
        target = np.asarray(self.target, dtype=np.float64)
        if target.ndim != 0 or not math.isfinite(float(target)) or float(target) < 0:
            raise ValueError(f"target must be a finite scalar >= 0, got {self.target!r}")
        object.__setattr__(self, "target", float(target))
        _check_divergence(self.divergence)
        aggregate = _check_level(self.level, self.aggregate)
        object.__setattr__(self, "aggregate", aggregate)
        params = self.family_params
        if isinstance(params, Mapping):
            params = tuple(sorted(params.items()))
        try:
            params = tuple((str(k), v) for k, v in params)
        except (TypeError, ValueError):
            raise ValueError(
                f"family_params must be a mapping or (name, value) pairs, got {params!r}"
            ) from None
        object.__setattr__(self, "family_params", params)
        if not isinstance(self.family, str):
            raise ValueError(f"family must be a shift family name, got {self.family!r}")
        _check_support(shifts.get(self.family, **self.family_kwargs), self.divergence)
        if self.fraction is not None and (
            isinstance(self.fraction, bool)
            or not (isinstance(self.fraction, (int, float)) and 0.0 < self.fraction <= 1.0)
        ):
            raise ValueError(f"fraction must be None or a number in (0, 1], got {self.fraction!r}")
        nonnegative_int(self.select_seed, "select_seed")

    @property
    def family_kwargs(self) -> dict:
        """The family's hyperparameters as a dict."""
        return dict(self.family_params)

    @property
    def hyperparameters(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def build(self, env, *, return_strength: bool = False):
        """μ (T, P, V) for ``env`` (or ``(mu, strength)``), by :func:`behaviour` or
        :func:`concentrated` when ``fraction`` is set."""
        common = dict(
            aggregate=self.aggregate,
            return_strength=return_strength,
            **self.family_kwargs,
        )
        args = (env, self.target, self.divergence, self.level, self.family)
        if self.fraction is not None:
            return concentrated(
                *args, fraction=self.fraction, select_seed=self.select_seed, **common
            )
        return behaviour(*args, **common)
