"""Families that move the behaviour policy μ away from the target π, and ``dial`` / ``dial_pair``.

A *shift family* is a frozen dataclass (its fields are hyperparameters, validated in
``__post_init__``) with ``apply(pi, strength) -> mu`` on (…, V) arrays, row by row, such that
``strength = 0`` gives ``μ = π``. ``strength`` is a scalar or an array of the batch shape (…).
The registry works like the mapping registry: ``available()`` lists the names and
``get(name, **hyperparams)`` builds a family.

========================  ==============================================  =====================
family                    μ                                               strength range
========================  ==============================================  =====================
``temperature``           ∝ π^β, β = e^{−s} (``"flatten"``) or e^{s}       [0, ∞), s = |log β|
                          (``"sharpen"``)
``logit_noise``           ∝ π·exp(s·z), z ~ N(0, I_V) from ``seed``        [0, ∞)
``mixture``               (1 − λ)π + λ·uniform(V)                         λ ∈ [0, 1]
``top_p``                 π on the nucleus of mass p = 1 − s, renormalised  [0, 1]
``top_k``                 π without its s least likely tokens, renormalised [0, n_support − 1]
``tail``                  the n rarest tokens multiplied by e^{−s},       [0, ∞)
                          renormalised
``tilt``                  ∝ π·exp(s·(cos θ·û + sin θ·v̂)) (two-parameter  [0, ∞)
                          with the angle θ, see :func:`dial_pair`)
========================  ==============================================  =====================

``dial(pi, target, divergence, family)`` solves for the strength at which D(π‖μ) equals a
target (χ², KL or TV of :mod:`simkit.divergence`) to 1e-8 relative, by scanning the strength
range for the first bracket and refining it with Brent's method (``scipy.optimize.brentq``).
``dial_pair(pi, kl=..., chi2=...)`` sets KL and χ² together with the ``tilt`` family.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy.optimize import brentq

from simkit import divergence as _div
from simkit._validation import as_prob, check_hyperparameters, nonnegative_int, positive_int

__all__ = [
    "DIVERGENCES",
    "LogitNoise",
    "Mixture",
    "ShiftFamily",
    "Tail",
    "Temperature",
    "Tilt",
    "TopK",
    "TopP",
    "available",
    "dial",
    "dial_pair",
    "get",
    "register",
]

#: divergences that ``dial`` can target, by name
DIVERGENCES = {"chi2": _div.chi2, "kl": _div.kl, "tv": _div.tv}
# their kernels on validated arrays (same numbers, without the input checks): used inside the
# root finding, where π is validated once and every μ comes out of a family
_KERNELS = {"chi2": _div._chi2_raw, "kl": _div._kl_raw, "tv": _div._tv_raw}
_SYMBOL = {"chi2": "χ²", "kl": "KL", "tv": "TV"}
#: relative accuracy that ``dial`` and ``dial_pair`` guarantee on the achieved divergence
DIAL_RTOL = 1e-8

_REGISTRY: dict[str, type[ShiftFamily]] = {}


# --- small helpers --------------------------------------------------------------------------


def _log(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p)


def _softmax(logits: np.ndarray) -> np.ndarray:
    """exp(logits) normalised over the last axis, after subtracting the row maximum (each row
    has a finite entry; −inf entries give exact zeros)."""
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _ascending_order(p: np.ndarray) -> np.ndarray:
    """Per row of p (B, V): token indices from the least to the most likely among p > 0, then
    the tokens with p = 0. Ties: the higher index counts as less likely (so, as in top-p's
    descending order, the lower index is kept first)."""
    V = p.shape[-1]
    key = np.where(p > 0, p, np.inf)[:, ::-1]
    return V - 1 - np.argsort(key, axis=-1, kind="stable")


def _rarest_mask(p: np.ndarray, n: int) -> np.ndarray:
    """Boolean (B, V) marking, per row, the ``n`` least likely tokens among those with p > 0
    (ties: the higher index first)."""
    order = _ascending_order(p)[:, :n]
    mask = np.zeros(p.shape, dtype=bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask & (p > 0)


def _require_support_larger(p: np.ndarray, n: int, what: str) -> None:
    n_support = (p > 0).sum(axis=-1)
    if np.any(n_support <= n):
        raise ValueError(
            f"{what} = {n} needs pi to have more than {n} tokens with positive probability; "
            f"a row of pi has only {int(n_support.min())}"
        )


# --- the family contract and registry -------------------------------------------------------


class ShiftFamily:
    """Base class of shift families (subclasses are frozen dataclasses)."""

    name: ClassVar[str] = ""
    #: True when some strengths give μ = 0 where π > 0 (χ² and KL then infinite)
    cuts_support: ClassVar[bool] = False
    #: for families with an unbounded strength range: a strength beyond which the family is
    #: numerically saturated (used by ``dial`` to scan the range)
    scan_cap: ClassVar[float] = np.inf

    def max_strength(self, pi_row: np.ndarray) -> float:
        """Upper end of the strength range for the distribution ``pi_row`` (V,)."""
        return np.inf

    def apply(self, pi, strength) -> np.ndarray:
        """μ for each row of ``pi`` (…, V); ``strength`` is a scalar or of shape (…)."""
        p = as_prob(pi, "pi")
        batch = p.shape[:-1]
        s = _per_row(strength, batch, "strength", f"strength of family {self.name!r}")
        p2 = p.reshape(-1, p.shape[-1])
        s2 = s.reshape(-1)
        self.check_rows(p2)
        upper = np.array([self.max_strength(row) for row in p2])
        if np.any(s2 > upper):
            i = int(np.argmax(s2 - upper))
            raise ValueError(
                f"strength of family {self.name!r} must be in [0, {upper[i]:g}] for this pi, "
                f"got {s2[i]:g}"
            )
        return self._apply(p2, s2).reshape(p.shape)

    def check_rows(self, p: np.ndarray) -> None:
        """Family-specific checks of π's rows (B, V); raise ValueError."""

    def _apply(self, p: np.ndarray, s: np.ndarray) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    @property
    def hyperparameters(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def label(self) -> str:
        """Short human-readable label, e.g. ``temperature(direction=flatten)``."""
        hp = ", ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.hyperparameters.items()
        )
        return f"{self.name}({hp})" if hp else self.name


def register(cls: type[ShiftFamily]) -> type[ShiftFamily]:
    """Class decorator: add a shift family to the registry under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no registry name")
    if cls.name in _REGISTRY:
        raise TypeError(f"shift family name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of every registered shift family, in registry order."""
    return list(_REGISTRY)


def get(name: str, **hyperparams) -> ShiftFamily:
    """Build shift family ``name`` with its defaults overridden by ``hyperparams``.

    >>> get("temperature", direction="sharpen")
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown shift family {name!r}; available families: {', '.join(available())}"
        ) from None
    check_hyperparameters(cls, hyperparams, f"shift family {name!r}")
    return cls(**hyperparams)


# --- the families ---------------------------------------------------------------------------


@register
@dataclass(frozen=True)
class Temperature(ShiftFamily):
    """Temperature move μ ∝ π^β (softmax of β·log π), support preserved.

    ``direction="flatten"``: β = e^{−s} < 1 (temperature e^{s} > 1); as s → ∞, μ → uniform on
    the support of π. ``direction="sharpen"``: β = e^{s} > 1; as s → ∞, μ → uniform on π's
    most likely tokens. strength s = |log β| ∈ [0, ∞) (β is capped at e^{700}).
    KL(π‖μ_β) increases with |log β| (its derivative in β is E_{μ_β}[log π] − E_π[log π]).
    """

    direction: str = "flatten"
    name = "temperature"
    scan_cap = 750.0

    def __post_init__(self):
        if self.direction not in ("flatten", "sharpen"):
            raise ValueError(f"direction must be 'flatten' or 'sharpen', got {self.direction!r}")

    def _apply(self, p, s):
        log_p = _log(p)
        sign = -1.0 if self.direction == "flatten" else 1.0
        beta = np.exp(sign * np.minimum(s, 700.0))[:, None]
        centred = log_p - log_p.max(axis=-1, keepdims=True)
        with np.errstate(over="ignore"):
            logits = np.where(p > 0, beta * np.where(p > 0, centred, 0.0), -np.inf)
        return _softmax(logits)


#: second word of the logit-noise direction's seed (ASCII "zdir"), see :class:`LogitNoise`
NOISE_STREAM = 0x7A646972


@register
@dataclass(frozen=True)
class LogitNoise(ShiftFamily):
    """Logit noise μ ∝ π·exp(s·z) with a fixed standard-Gaussian direction z ∈ R^V.

    z = ``numpy.random.default_rng([seed, NOISE_STREAM]).standard_normal(V)`` (the same z for
    every row of a batch with the same V), so the family is deterministic. The stream is keyed by
    (seed, ``NOISE_STREAM``) rather than by ``seed`` alone so that z never coincides with logits a
    user drew as ``default_rng(seed).normal(size=V)``: with that coincidence "logit noise" would
    be a sharpening temperature (μ ∝ π^{1+s}), not a perturbation in an independent direction.
    Strength s ∈ [0, ∞); as s → ∞, μ concentrates on the token of π's support with the largest
    z. KL(π‖μ_s) increases with s (derivative E_{μ_s}[z] − E_π[z] ≥ 0 for an exponential tilt).
    """

    seed: int = 0
    name = "logit_noise"
    scan_cap = 1e12

    def __post_init__(self):
        nonnegative_int(self.seed, "seed")

    def direction(self, V: int) -> np.ndarray:
        """The noise direction z of shape (V,)."""
        return np.random.default_rng([int(self.seed), NOISE_STREAM]).standard_normal(V)

    def _apply(self, p, s):
        z = self.direction(p.shape[-1])
        logits = np.where(p > 0, _log(p) + s[:, None] * z, -np.inf)
        return _softmax(logits)


@register
@dataclass(frozen=True)
class Mixture(ShiftFamily):
    """Uniform mixing μ = (1 − λ)·π + λ/V (ε-greedy-like exploration), strength λ ∈ [0, 1].

    χ², KL and TV(π‖μ_λ) all increase with λ (convexity in μ along the segment; TV is linear),
    up to D(π‖uniform) at λ = 1.
    """

    name = "mixture"

    def max_strength(self, pi_row):
        return 1.0

    def _apply(self, p, s):
        lam = s[:, None]
        return (1.0 - lam) * p + lam / p.shape[-1]


@dataclass(frozen=True)
class _Truncation(ShiftFamily):
    """A family that cuts π's least likely tokens (χ² and KL(π‖μ) infinite once one is cut);
    ``fractional``: the boundary token keeps part of its mass, so μ is continuous in s."""

    fractional: bool = True
    cuts_support = True

    def __post_init__(self):
        if not isinstance(self.fractional, (bool, np.bool_)):
            raise ValueError(f"fractional must be a bool, got {self.fractional!r}")


@register
@dataclass(frozen=True)
class TopP(_Truncation):
    """Nucleus (top-p) truncation: μ = π on its most likely tokens of total mass p = 1 − s,
    renormalised (Holtzman et al. 2020, "The curious case of neural text degeneration").

    Tokens are taken in decreasing order of π (ties: lower index first). With
    ``fractional=True`` (default) the boundary token keeps only the part of its mass that fits
    in p, so μ is continuous in s (TV is dialable to any precision); it is the usual nucleus
    whenever p is a cumulative mass of π. With ``fractional=False`` the nucleus is the usual
    smallest set of mass ≥ p (μ is piecewise constant in s). strength s ∈ [0, 1]; s = 1 (p → 0)
    keeps only the most likely token. χ² and KL(π‖μ) are infinite once a token is cut.
    """

    name = "top_p"

    def max_strength(self, pi_row):
        return 1.0

    def _apply(self, p, s):
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the more likely tokens
        keep_mass = ((1.0 - s) * p.sum(axis=-1))[:, None]
        if self.fractional:
            kept_sorted = np.clip(keep_mass - before, 0.0, sorted_p)
        else:
            kept_sorted = np.where(before < keep_mass, sorted_p, 0.0)
        kept = np.empty_like(p)
        np.put_along_axis(kept, order, kept_sorted, axis=-1)
        top = np.zeros_like(p)
        np.put_along_axis(top, order[:, :1], 1.0, axis=-1)
        total = kept.sum(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            mu = np.where(total > 0, kept / total, top)
        return np.where((s == 0)[:, None], p, mu)


@register
@dataclass(frozen=True)
class TopK(_Truncation):
    """Top-k truncation: μ = π without its s least likely tokens (k = n_support − s kept),
    renormalised.

    Among the n_support tokens with π > 0, ranked from the least likely (ties: higher index
    first), the first ⌊s⌋ are removed. With ``fractional=True`` (default) the next one keeps a
    fraction 1 − (s − ⌊s⌋) of its mass, so μ is continuous in s (TV is dialable); with
    ``fractional=False`` only ⌊s⌋ matters. strength s ∈ [0, n_support − 1]. χ² and KL(π‖μ)
    are infinite once a token is cut.
    """

    name = "top_k"

    def max_strength(self, pi_row):
        return float(np.count_nonzero(pi_row > 0) - 1)

    def _apply(self, p, s):
        order = _ascending_order(p)  # least likely first, zeros last
        rank = np.empty(p.shape, dtype=np.float64)
        np.put_along_axis(rank, order, np.broadcast_to(np.arange(p.shape[-1]), p.shape), -1)
        cut = s[:, None] if self.fractional else np.floor(s)[:, None]
        factor = np.clip(rank + 1.0 - cut, 0.0, 1.0)
        kept = p * factor
        return kept / kept.sum(axis=-1, keepdims=True)


@register
@dataclass(frozen=True)
class Tail(ShiftFamily):
    """Tail starvation: the ``n_tokens`` least likely tokens of π's support (ties: higher index
    first) are multiplied by e^{−s}, then μ is renormalised. strength s ∈ [0, ∞).

    With m the starved mass, KL(π‖μ) = m·s + log(1 − m + m e^{−s}) grows linearly while
    1 + χ² = (1 − m + m e^{−s})(1 − m + m e^{s}) grows like m·e^{s}: heavy-tailed ratios π/μ,
    large χ² at small KL.
    """

    n_tokens: int = 1
    name = "tail"
    scan_cap = 1e4

    def __post_init__(self):
        positive_int(self.n_tokens, "n_tokens")

    def check_rows(self, p):
        _require_support_larger(p, int(self.n_tokens), "n_tokens")

    def _apply(self, p, s):
        tail = _rarest_mask(p, int(self.n_tokens))
        logits = np.where(p > 0, _log(p) - s[:, None] * tail, -np.inf)
        return _softmax(logits)


def _tilt_directions(p: np.ndarray, n_tail: int) -> tuple[np.ndarray, np.ndarray]:
    """The two standardised directions (û, v̂) of the tilt family, each (B, V), 0 off-support.

    û = standardised −log π (a flattening direction), v̂ = standardised −1[rarest n_tail
    tokens] (a spike that starves them); standardised = centred and scaled to unit variance
    under π. û is 0 when π is uniform on its support (−log π is then constant).
    """
    support = p > 0
    u = np.where(support, -_log(p), 0.0)
    mean_u = np.sum(p * u, axis=-1, keepdims=True)
    sd_u = np.sqrt(np.sum(p * (u - mean_u) ** 2, axis=-1, keepdims=True))
    flat = sd_u <= 1e-12 * np.maximum(1.0, np.abs(mean_u))
    with np.errstate(divide="ignore", invalid="ignore"):
        u_hat = np.where(support & ~flat, (u - mean_u) / sd_u, 0.0)
    tail = _rarest_mask(p, n_tail)
    m = np.sum(p * tail, axis=-1, keepdims=True)
    v_hat = np.where(support, (m - tail) / np.sqrt(m * (1.0 - m)), 0.0)
    return u_hat, v_hat


@register
@dataclass(frozen=True)
class Tilt(ShiftFamily):
    """Two-direction exponential tilt μ ∝ π·exp(s·(cos θ·û + sin θ·v̂)).

    û: −log π standardised under π (a flattening, temperature-like move: light tails, about the
    smallest χ² for a given KL); v̂: −1 on the ``n_tail`` rarest tokens, standardised (starves
    them: heavy-tailed ratios π/μ, large χ² for a given KL). ``angle`` θ ∈ [0, π/2] mixes the two
    directions; strength s ≥ 0 is the length of the move (for small s, KL ≈ s²/2 at θ = 0 and
    θ = π/2, since both directions have unit variance under π). For every θ, KL(π‖μ) increases
    with s (exponential tilt), which :func:`dial_pair` uses to set KL and χ² together.
    """

    angle: float = 0.0
    n_tail: int = 1
    name = "tilt"
    scan_cap = 1e6

    def __post_init__(self):
        if not 0.0 <= self.angle <= math.pi / 2:
            raise ValueError(f"angle must be in [0, π/2], got {self.angle!r}")
        positive_int(self.n_tail, "n_tail")

    def check_rows(self, p):
        _require_support_larger(p, int(self.n_tail), "n_tail")

    def _apply(self, p, s):
        u_hat, v_hat = _tilt_directions(p, int(self.n_tail))
        return _tilt_mu(_log(p), u_hat, v_hat, self.angle, s[:, None])


def _tilt_mu(log_p, u_hat, v_hat, angle, strength):
    direction = math.cos(angle) * u_hat + math.sin(angle) * v_hat
    with np.errstate(over="ignore", invalid="ignore"):
        logits = np.where(np.isfinite(log_p), log_p + strength * direction, -np.inf)
    return _softmax(logits)


# --- root finding ---------------------------------------------------------------------------


class Unreachable(Exception):
    """The target lies above everything the scan saw; ``best`` is the largest value seen."""

    def __init__(self, best: float, detail: str = ""):
        super().__init__(best, detail)
        self.best = best
        self.detail = detail

    def as_error(self, name: str, target: float, family: ShiftFamily, where: str = ""):
        """The ``ValueError`` of a dial that cannot reach ``name`` = ``target`` with ``family``
        (``where``: which rows, appended to the family's label)."""
        detail = f" ({self.detail})" if self.detail else ""
        return ValueError(
            f"target {name} = {target:.6g} is not reachable with family {family.label!r}{where}: "
            f"the largest reachable value is {self.best:.6g}{detail}"
        )


def _brent(fun, lo: float, hi: float) -> float:
    """Root of ``fun`` on [lo, hi] (values of opposite signs at the ends), full precision."""
    if fun(hi) == 0.0:
        return hi
    return brentq(fun, lo, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)


def solve_increasing_crossing(value_at, target: float, grid, grid_values) -> float:
    """Smallest strength (up to the grid's resolution) where ``value_at`` reaches ``target``.

    ``grid_values`` are ``value_at`` on ``grid`` (increasing, starting above 0, where the value
    is 0 < target). Takes the first grid point at or above the target, shrinks an infinite value
    there by bisection, then refines the bracket with Brent's method. Raises ``Unreachable``
    with the largest value seen below the target.
    """
    above = np.flatnonzero(grid_values >= target)
    if above.size == 0:
        raise Unreachable(float(np.max(grid_values)))
    j = int(above[0])
    lo, hi = (0.0 if j == 0 else float(grid[j - 1])), float(grid[j])
    best = 0.0 if j == 0 else float(np.max(grid_values[:j]))
    while not np.isfinite(value_at(hi)):  # μ underflowed: find a finite value above the target
        mid = 0.5 * (lo + hi)
        v = value_at(mid)
        if v < target:
            lo, best = mid, max(best, v)
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            raise Unreachable(
                best, f"the divergence jumps to inf (μ underflows) at strength ≈ {hi:.6g}"
            )
    return _brent(lambda s: value_at(s) - target, lo, hi)


def scan_grid(family: ShiftFamily, pi_row: np.ndarray) -> np.ndarray:
    """Increasing strengths (0, max] at which to scan ``family`` from ``pi_row`` for a bracket:
    64 even steps on a bounded range, doubling from 1e-8 up to ``family.scan_cap`` otherwise."""
    upper = family.max_strength(pi_row)
    if np.isfinite(upper):
        return np.linspace(0.0, upper, 65)[1:]
    grid = 1e-8 * 2.0 ** np.arange(int(np.ceil(np.log2(family.scan_cap / 1e-8))) + 1)
    return np.append(grid[grid < family.scan_cap], family.scan_cap)


def resolve_family(family, family_kwargs) -> ShiftFamily:
    """A :class:`ShiftFamily` from a registry name and hyperparameters, or an instance as is."""
    if isinstance(family, ShiftFamily):
        if family_kwargs:
            raise TypeError(
                f"hyperparameters {sorted(family_kwargs)} were given with a family instance "
                f"({family.label}); pass them to shifts.get(...) instead"
            )
        return family
    return get(family, **family_kwargs)


def _per_row(value, batch: tuple, name: str, label: str | None = None) -> np.ndarray:
    """``value`` (a scalar or one per row) broadcast to pi's ``batch`` shape, finite and >= 0;
    ``ValueError`` naming ``name`` (``label`` in the range message, default ``name``)."""
    v = np.asarray(value, dtype=np.float64)
    try:
        v = np.broadcast_to(v, batch)
    except ValueError:
        raise ValueError(
            f"{name} must be a scalar or of pi's batch shape {batch}, got shape {v.shape}"
        ) from None
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"{label or name} must be finite and >= 0, got {value!r}")
    return v


def _targets(target, batch: tuple, name: str) -> np.ndarray:
    return _per_row(target, batch, name).reshape(-1)


def _row_label(batch: tuple, i: int) -> str:
    return f" (row {tuple(int(k) for k in np.unravel_index(i, batch))} of pi)" if batch else ""


def dial(
    pi,
    target,
    divergence: str = "chi2",
    family: str | ShiftFamily = "temperature",
    *,
    return_strength: bool = False,
    **family_kwargs,
):
    """Move π with a shift family until D(π‖μ) equals ``target``; return μ.

    Solves D(π‖family.apply(π, s)) = target for the strength s: the strength range is scanned
    (a grid of 64 points on a bounded range, doubling steps from 1e-8 on an unbounded one) for
    the first bracket, then refined with ``scipy.optimize.brentq`` at full double precision, so
    the achieved divergence matches the target to ``DIAL_RTOL`` = 1e-8 relative (checked).
    The first crossing is returned, so a family whose divergence is not monotone in the
    strength still gives the smallest strength found by the scan.

    Parameters
    ----------
    pi : (V,) or (…, V) target distribution(s); rows are dialed one by one.
    target : scalar or array of pi's batch shape (…): the divergence to reach, ≥ 0.
    divergence : ``"chi2"``, ``"kl"`` or ``"tv"`` (of :mod:`simkit.divergence`, D(π‖μ)).
    family : a registered family name (hyperparameters as keyword arguments) or an instance.
    return_strength : also return the solved strength(s) (a float, or an array (…)).

    Returns ``mu`` of pi's shape, or ``(mu, strength)``.

    Raises ``ValueError`` for an unreachable target (the message names the largest reachable
    value), for χ²/KL with a family that cuts π's support (top_p, top_k), and for a target that
    a discontinuous family (``fractional=False``) jumps over.
    """
    fam = resolve_family(family, family_kwargs)
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {sorted(DIVERGENCES)}, got {divergence!r}")
    if fam.cuts_support and divergence in ("chi2", "kl"):
        raise ValueError(
            f"family {fam.name!r} cuts π's support (tokens with π > 0 get μ = 0), so "
            f"{_SYMBOL[divergence]}(π‖μ) is infinite as soon as a token is cut: "
            f"{_SYMBOL[divergence]} cannot be dialed with it; only 'tv' can"
        )
    p = as_prob(pi, "pi")
    batch = p.shape[:-1]
    targets = _targets(target, batch, "target")
    rows = p.reshape(-1, p.shape[-1])
    fam.check_rows(rows)
    div_fn = _KERNELS[divergence]
    sym = _SYMBOL[divergence]
    strengths = np.zeros(len(rows))
    for i, (row, t) in enumerate(zip(rows, targets)):
        if t == 0.0:
            continue

        def value_at(s, row=row):
            return float(div_fn(row, fam._apply(row[None, :], np.array([s]))[0]))

        grid = scan_grid(fam, row)
        grid_values = div_fn(row, fam._apply(np.broadcast_to(row, (len(grid), len(row))), grid))
        try:
            s_star = solve_increasing_crossing(value_at, t, grid, grid_values)
        except Unreachable as exc:
            raise exc.as_error(sym, t, fam, f" from this π{_row_label(batch, i)}") from None
        achieved = value_at(s_star)
        if not abs(achieved - t) <= DIAL_RTOL * t:
            step = 1e-9 * max(s_star, 1e-12)
            left, right = value_at(max(s_star - step, 0.0)), value_at(s_star + step)
            if abs(right - left) > DIAL_RTOL * t:
                why = (
                    f"the divergence jumps from {left:.6g} to {right:.6g} at strength "
                    f"{s_star:.6g} (the family is discontinuous there)"
                )
            else:
                why = (
                    f"near strength {s_star:.6g} the divergence is only resolved to "
                    f"{abs(achieved - t):.3g} (rounding level), more than {DIAL_RTOL:g} "
                    "relative of this target"
                )
            raise ValueError(
                f"target {sym} = {t:.6g} cannot be hit with family {fam.label!r}"
                f"{_row_label(batch, i)}: {why}"
            )
        strengths[i] = s_star
    mu = fam._apply(rows, strengths)
    mu[targets == 0.0] = rows[targets == 0.0]  # exactly π
    mu = mu.reshape(p.shape)
    if return_strength:
        s_out = strengths.reshape(batch)
        return mu, (float(s_out) if s_out.ndim == 0 else s_out)
    return mu


# --- two targets at once: dial_pair -----------------------------------------------------------

_N_ANGLES = 17


def _pair_row(
    row: np.ndarray, kl_target: float, chi2_target: float, n_tail: int, where: str
) -> tuple[float, float]:
    """(angle, strength) of the tilt family hitting both targets for one row of π."""
    log_p = _log(row)[None, :]
    u_hat, v_hat = _tilt_directions(row[None, :], n_tail)

    def mu_at(angle, s):
        return _tilt_mu(log_p, u_hat, v_hat, angle, s)[0]

    def strength_for_kl(angle) -> float | None:
        """KL(π‖μ) is increasing in s: bracket from s ≈ √(2 KL) by doubling / halving."""

        def excess(s):
            return float(_div._kl_raw(row, mu_at(angle, s))) - kl_target

        lo = hi = math.sqrt(2.0 * kl_target)
        if excess(hi) < 0:
            while excess(hi) < 0:
                lo, hi = hi, 2.0 * hi
                if hi > Tilt.scan_cap:
                    return None
            while not np.isfinite(excess(hi)):
                mid = 0.5 * (lo + hi)
                if excess(mid) < 0:
                    lo = mid
                else:
                    hi = mid
                if hi - lo <= 1e-13 * hi:
                    return None
        else:
            while excess(lo) >= 0:
                hi, lo = lo, 0.5 * lo
        return _brent(excess, lo, hi)

    def chi2_at(angle) -> float | None:
        s = strength_for_kl(angle)
        return None if s is None else float(_div._chi2_raw(row, mu_at(angle, s)))

    def chi2_excess(angle) -> float:
        value = chi2_at(angle)
        if value is None:
            raise ValueError(
                f"dial_pair: KL = {kl_target:.6g} is not reachable at angle {angle:.6g}{where}, "
                "between two angles where it is (û and v̂ nearly cancel there); try n_tail > 1"
            )
        return value - chi2_target

    angles = np.linspace(0.0, math.pi / 2, _N_ANGLES)
    values = [chi2_at(a) for a in angles]
    if all(v is None for v in values):
        raise ValueError(
            f"KL = {kl_target:.6g} is not reachable with family 'tilt'{where}: μ underflows "
            "before the KL gets there"
        )
    for i, v in enumerate(values):
        if v == chi2_target:
            return float(angles[i]), strength_for_kl(angles[i])
    for i in range(_N_ANGLES - 1):
        v0, v1 = values[i], values[i + 1]
        if v0 is not None and v1 is not None and (v0 - chi2_target) * (v1 - chi2_target) < 0:
            angle = _brent(chi2_excess, float(angles[i]), float(angles[i + 1]))
            return angle, strength_for_kl(angle)
    # not reached: describe what is, one interval per run of angles where the KL is reachable
    runs, current = [], []
    for a, v in zip(angles, values):
        if v is None:
            if current:
                runs.append(current)
            current = []
        else:
            current.append((a, v))
    if current:
        runs.append(current)
    intervals = " and ".join(
        f"from {min(v for _, v in run):.6g} to {max(v for _, v in run):.6g} "
        f"(angles {run[0][0]:.3g} to {run[-1][0]:.3g})"
        for run in runs
    )
    rare_mass = float(np.sum(row[_rarest_mask(row[None, :], n_tail)[0]]))
    raise ValueError(
        f"(KL = {kl_target:.6g}, χ² = {chi2_target:.6g}) is not reachable with family 'tilt' "
        f"(n_tail={n_tail}) from this π{where}: at KL = {kl_target:.6g} it reaches χ² "
        f"{intervals}; angle 0 flattens π, angle π/2 starves its {n_tail} rarest token(s) "
        f"(mass {rare_mass:.3g}). Any μ needs χ² > e^KL − 1 = {math.expm1(kl_target):.6g} "
        "(KL ≤ log(1 + χ²)); a larger χ² at this KL needs a rarer token in π"
    )


def dial_pair(pi, kl: float, chi2: float, *, n_tail: int = 1, return_params: bool = False):
    """μ with KL(π‖μ) = ``kl`` and χ²(π‖μ) = ``chi2`` (both to 1e-8 relative), from the ``tilt``
    family μ ∝ π·exp(s·(cos θ·û + sin θ·v̂)) (see :class:`Tilt`).

    For each angle θ the strength s(θ) with KL = ``kl`` is unique (KL increases with s for an
    exponential tilt); θ is then solved so that χ² = ``chi2`` (scan of 17 angles in [0, π/2]
    for a bracket, then ``brentq``). Same KL, very different χ²: the hard constraint is
    KL ≤ log(1 + χ²) (Jensen, notation page §F), and at a fixed KL the tilt reaches χ² from
    about its flattening end (θ = 0) to its tail-starving end (θ = π/2), larger the rarer π's
    rarest tokens are.

    pi: (V,) or (…, V) (rows solved one by one); kl, chi2: scalars or arrays of pi's batch
    shape, > 0 (both 0 gives μ = π). Returns μ of pi's shape, or ``(mu, angle, strength)``
    with ``return_params=True``. Raises ``ValueError`` describing the feasible region when the
    pair is infeasible (KL ≥ log(1 + χ²)) or outside what the tilt reaches from this π.
    """
    tilt = Tilt(n_tail=n_tail)
    p = as_prob(pi, "pi")
    batch = p.shape[:-1]
    kls = _targets(kl, batch, "kl")
    chi2s = _targets(chi2, batch, "chi2")
    rows = p.reshape(-1, p.shape[-1])
    tilt.check_rows(rows)
    angles = np.zeros(len(rows))
    strengths = np.zeros(len(rows))
    mus = rows.copy()
    for i, (row, k, c) in enumerate(zip(rows, kls, chi2s)):
        where = _row_label(batch, i)
        if k == 0.0 and c == 0.0:
            continue
        if k == 0.0 or c == 0.0 or k >= math.log1p(c):
            raise ValueError(
                f"(KL = {k:.6g}, χ² = {c:.6g}) is infeasible{where}: every μ whose support "
                f"contains π's has 0 < KL < log(1 + χ²) unless μ = π (Jensen), and "
                f"log(1 + {c:.6g}) = {math.log1p(c):.6g}; with KL = {k:.6g} the χ² must "
                f"exceed e^KL − 1 = {math.expm1(k):.6g}"
            )
        angle, s = _pair_row(row, k, c, int(n_tail), where)
        mu = _tilt_mu(_log(row)[None, :], *_tilt_directions(row[None, :], int(n_tail)), angle, s)[0]
        got_k, got_c = float(_div.kl(row, mu)), float(_div.chi2(row, mu))
        if not (abs(got_k - k) <= DIAL_RTOL * k and abs(got_c - c) <= DIAL_RTOL * c):
            raise ValueError(  # pragma: no cover - a numerical failure, not expected
                f"dial_pair could not reach (KL = {k:.6g}, χ² = {c:.6g}){where} to "
                f"{DIAL_RTOL:g} relative: got ({got_k:.10g}, {got_c:.10g})"
            )
        angles[i], strengths[i], mus[i] = angle, s, mu
    mu_out = mus.reshape(p.shape)
    if return_params:
        a_out, s_out = angles.reshape(batch), strengths.reshape(batch)
        if a_out.ndim == 0:
            return mu_out, float(a_out), float(s_out)
        return mu_out, a_out, s_out
    return mu_out
