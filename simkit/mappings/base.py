"""The weight-mapping contract and the registry.

A *weight mapping* turns token log-ratios ``log_ratio = log π(y_t|s_t) − log μ(y_t|s_t)`` into the
effective coefficient ``c_{i,t}`` that multiplies ``A_i · ∇θ log π(y_{i,t}|s_{i,t})`` in the policy
gradient (see the notation page, ``docs/reference.md``)::

    g = (1/Z) Σ_i Σ_t c_{i,t} · A_i · ∇θ log πθ(y_{i,t} | s_{i,t}),    y_i ~ μ

Every mapping is a frozen dataclass whose fields are its hyperparameters (validated in
``__post_init__``) and which implements::

    coefficients(log_ratio, mask, advantages) -> c      # (N, T), (N, T), (N,) -> (N, T)

with ``c == 0`` on padded positions (``mask == False``). The coefficients depend on the
advantages only through their sign (``A >= 0`` is "positive"). Mappings whose coefficient is a
scalar function of one ratio (a token ratio ``r_t``, the sequence ratio ``W`` or the geometric
mean ``s``) subclass :class:`ScalarMapping` and also expose ``phi(w, positive=True)`` (the
coefficient as a function of the ratio) and ``f(w, positive=True)`` (a surrogate ``F`` with
``w · F'(w) = phi(w)``).

Two optional extensions of the contract (issue 24):

- ``requires_log_prob``: the coefficient needs log π itself, not only the log-ratio (DPPO's
  trust region acts on the probability difference π − μ): ``coefficients(..., log_prob=...)``
  with ``log_prob`` (N, T) = log π is then mandatory (log μ = log π − log_ratio), and every
  caller passes it (:mod:`simkit.composition`, the experiment's exact and Monte Carlo paths,
  the token DP through :meth:`Mapping.phi_probs`, the torch loss).
- ``additive`` (instance property ``has_additive``): a per-token term b that is not
  proportional to A (DRO's −β·log r_t, the gradient of the penalty β/2·(log r_t)²); the
  gradient is then ``g = (1/Z) Σ_i Σ_t (c_{i,t}·A_i + b_{i,t}) · ∇θ log πθ(y_{i,t}|s_{i,t})``,
  with ``additive(log_ratio, mask, log_prob=None) -> b`` (N, T), 0 on padding.

Class attributes describe each mapping for the test battery and the experiment runner:

- ``level``: ``"token"`` (c_t depends on r_t), ``"sequence"`` (one value per sequence, from W or s
  or the whole row) or ``"batch"`` (depends on other sequences of the batch).
- ``batch_dependent``: ``True`` when c_i depends on other rows (snis, psis, m2po); such estimators
  have no exact per-sample mean and the experiment falls back to Monte Carlo.
- ``on_policy_identity``: ``True`` when ``log_ratio == 0`` must give ``c == 1`` on every valid
  token (the notation page's "on-policy ⇒ REINFORCE" rule).
- ``ratio_kind`` (:class:`ScalarMapping` only): which ratio ``phi`` acts on — ``"token"`` (r_t),
  ``"sequence"`` (W = exp Σ_t log r_t) or ``"geometric"`` (s = exp of the mean log r_t over the
  sequence's valid tokens).

Surrogate convention (``f``): a paper's own surrogate where it defines one (PPO clip, SAPO, LUFFY,
VESPO); otherwise F(w) = ∫_0^w φ(u)/u du (anchored at F(0) = 0), or, where φ(u)/u is not
integrable at 0, F(w) = 1 + ∫_1^w φ(u)/u du (anchored at F(1) = 1). Each class says which.

Numerics: everything is computed in log space; every clamp is a named hyperparameter (typically
``max_log_ratio``, the largest log-ratio that is exponentiated). Token-level kernels run over
blocks of rows (``BLOCK_ELEMENTS`` values at a time) so that their temporaries stay in cache.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from simkit._validation import check_batch, check_hyperparameters

_REGISTRY: dict[str, type[Mapping]] = {}

#: values per block of the token-level kernels (512 KiB of float64: fits in L2 cache)
BLOCK_ELEMENTS = 1 << 16

#: default largest log-ratio that is exponentiated (e^80 ≈ 5.5e34; e^709 would overflow)
DEFAULT_MAX_LOG_RATIO = 80.0

RATIO_KINDS = ("token", "sequence", "geometric")


class Mapping:
    """Base class of every weight mapping (subclasses are frozen dataclasses)."""

    name: ClassVar[str] = ""
    level: ClassVar[str] = "token"
    batch_dependent: ClassVar[bool] = False
    on_policy_identity: ClassVar[bool] = True
    #: named presets: preset name -> dict of hyperparameters (see ``get(name, preset=...)``)
    presets: ClassVar[dict[str, dict]] = {}
    #: True for rejection mappings (c = 0 means "token dropped"): see :meth:`kept_mask`
    rejects: ClassVar[bool] = False
    #: True when ``coefficients`` draws random numbers (keyword ``rng``: a numpy Generator)
    stochastic: ClassVar[bool] = False
    #: True when ``coefficients`` also reads log π itself (keyword ``log_prob``, (N, T))
    uses_log_prob: ClassVar[bool] = False
    #: True when ``coefficients`` cannot be computed without ``log_prob`` (DPPO): every caller
    #: must pass log π (a ``ValueError`` names the keyword otherwise)
    requires_log_prob: ClassVar[bool] = False

    @property
    def has_additive(self) -> bool:
        """True when :meth:`additive` is not identically 0 (DRO, DPPO with ``beta`` > 0)."""
        return False

    def additive(self, log_ratio, mask, log_prob=None) -> np.ndarray:
        """The additive per-token gradient term b (N, T), 0 on padding (module docstring):
        g = (1/Z) Σ (c·A + b)·∇log π. Zeros for a mapping without one."""
        lr, _, _ = check_batch(log_ratio, mask, np.zeros(np.shape(log_ratio)[:1]))
        return np.zeros(lr.shape)

    def kept_mask(self, log_ratio, mask, advantages) -> np.ndarray:
        """Tokens kept by this mapping's rejection, (N, T) bool (the aggregation option
        ``denominator="kept"`` divides by them): ``mask`` when the mapping does not reject,
        else the valid tokens with c ≠ 0 (a kept ratio below e^−745 would underflow to 0)."""
        lr, m, adv = check_batch(log_ratio, mask, advantages)
        if not self.rejects:
            return m.copy()
        return m & (self._coefficients(lr, m, adv) != 0)

    def coefficients(self, log_ratio, mask, advantages) -> np.ndarray:
        """Effective coefficients c of shape (N, T); 0 where ``mask`` is False.

        ``log_ratio`` (N, T) = log π − log μ per token, ``mask`` (N, T) bool (valid tokens),
        ``advantages`` (N,) (only their sign, ``A >= 0``, is used).
        """
        lr, m, adv = check_batch(log_ratio, mask, advantages)
        return self._coefficients(lr, m, adv)

    def _coefficients(self, log_ratio, mask, advantages) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    #: fields left out of :attr:`hyperparameters` while they hold their default (options added
    #: later, so that tables of the estimators that do not use them keep their columns)
    quiet_defaults: ClassVar[tuple[str, ...]] = ()

    @property
    def hyperparameters(self) -> dict:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in self.quiet_defaults or getattr(self, f.name) != f.default
        }

    @property
    def label(self) -> str:
        """Short label naming only the hyperparameters that differ from the defaults.

        ``get("ppo_clip").label == "ppo_clip"``;
        ``get("ppo_clip", eps_high=0.28).label == "ppo_clip(eps_high=0.28)"``.
        """
        changed = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default
        }
        hp = ", ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in changed.items()
        )
        return f"{self.name}({hp})" if hp else self.name


class ScalarMapping(Mapping):
    """A mapping whose coefficient is ``phi`` of one ratio (token r_t, sequence W or geometric s).

    ``phi(w, positive)`` is the coefficient as a function of the ratio, ``f(w, positive)`` the
    surrogate ``F`` with ``w·F'(w) = phi(w)``; ``w`` is any array of ratios (>= 0, ``inf``
    allowed), ``positive`` the sign of the advantage (``A >= 0``). ``phi`` is the exact formula:
    the ``max_log_ratio`` clamps of ``coefficients`` are not applied (they only matter for ratios
    above e^max_log_ratio). ``ratio_kind`` says which ratio ``coefficients`` feeds to ``phi``.
    """

    ratio_kind: ClassVar[str] = "token"

    def phi(self, w, positive: bool = True) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def f(self, w, positive: bool = True) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError


def register(cls: type[Mapping]) -> type[Mapping]:
    """Class decorator: add a mapping class to the registry under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no registry name")
    if cls.name in _REGISTRY:
        raise TypeError(f"mapping name {cls.name!r} registered twice")
    if cls.level not in ("token", "sequence", "batch"):
        raise TypeError(f"{cls.__name__}.level must be token/sequence/batch, got {cls.level!r}")
    if issubclass(cls, ScalarMapping) and cls.ratio_kind not in RATIO_KINDS:
        raise TypeError(f"{cls.__name__}.ratio_kind must be one of {RATIO_KINDS}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of every registered mapping, in registry order."""
    return list(_REGISTRY)


def mapping_class(name: str) -> type[Mapping]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown mapping {name!r}; available mappings: {', '.join(available())}"
        ) from None


def get(name: str, preset: str | None = None, **hyperparams) -> Mapping:
    """Build mapping ``name`` with its defaults, an optional named ``preset``, then overrides.

    >>> get("ppo_clip", eps_high=0.28)
    >>> get("cispo", preset="trl")
    """
    cls = mapping_class(name)
    kwargs: dict = {}
    if preset is not None:
        if preset not in cls.presets:
            known = ", ".join(cls.presets) or "none"
            raise ValueError(f"mapping {name!r} has no preset {preset!r}; presets: {known}")
        kwargs.update(cls.presets[preset])
    check_hyperparameters(cls, hyperparams, f"mapping {name!r}")
    kwargs.update(hyperparams)
    return cls(**kwargs)


# --- hyperparameter validation ----------------------------------------------------------------


def as_mapping(spec, argument: str = "mapping", none: bool = False) -> Mapping:
    """``spec`` if it is a :class:`Mapping`, else the mapping of that name (:func:`get`);
    ``TypeError`` naming ``argument`` otherwise (``none``: the caller also accepts None)."""
    if isinstance(spec, str):
        return get(spec)
    if not isinstance(spec, Mapping):
        accepted = (
            "a simkit.mappings.Mapping, a mapping name or None"
            if none
            else ("a simkit.mappings.Mapping or a mapping name")
        )
        raise TypeError(f"{argument} must be {accepted}, got {type(spec).__name__}")
    return spec


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` (hyperparameter validation)."""
    if not condition:
        raise ValueError(message)


def check_real(
    owner,
    field: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
) -> float:
    """Validate the real hyperparameter ``owner.<field>`` and return it as a float.

    Raises ``ValueError`` naming ``<mapping>.<field>`` unless the value is a real number (not a
    bool, not NaN; ±inf only with ``allow_inf``) inside [low, high] (open ends as requested).
    """
    value = getattr(owner, field)
    where = f"{owner.name}: {field}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where} must be a real number, got {value!r}")
    v = float(value)
    if math.isnan(v) or (math.isinf(v) and not allow_inf):
        raise ValueError(f"{where} must be {'not NaN' if allow_inf else 'finite'}, got {v}")
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if too_low or too_high:
        lo = ("(" if low_open else "[") + f"{low:g}"
        hi = f"{high:g}" + (")" if high_open else "]")
        raise ValueError(f"{where} must be in {lo}, {hi}, got {v}")
    return v


def check_bool(owner, field: str) -> bool:
    value = getattr(owner, field)
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{owner.name}: {field} must be True or False, got {value!r}")
    return bool(value)


def check_choice(owner, field: str, choices: tuple[str, ...]) -> str:
    value = getattr(owner, field)
    if value not in choices:
        raise ValueError(f"{owner.name}: {field} must be one of {choices}, got {value!r}")
    return value


def check_max_log_ratio(owner, field: str = "max_log_ratio") -> float:
    """``max_log_ratio`` in (0, 700] (e^700 is still a finite float64)."""
    return check_real(owner, field, low=0.0, high=700.0, low_open=True)


# --- ratio helpers (phi / f) ------------------------------------------------------------------


def as_ratio(w, name: str = "w") -> np.ndarray:
    """``w`` as a float64 array of ratios; ``ValueError`` if any is negative or NaN."""
    arr = np.asarray(w, dtype=np.float64)
    if np.isnan(arr).any():
        raise ValueError(f"{name} contains NaN; ratios must be >= 0")
    if (arr < 0).any():
        raise ValueError(f"{name} must be >= 0 (a ratio of probabilities), min is {arr.min():g}")
    return arr


def log_of(w: np.ndarray) -> np.ndarray:
    """log w with log 0 = −inf (no warning)."""
    with np.errstate(divide="ignore"):
        return np.log(w)


def safe_log(x: float) -> float:
    """math.log with log 0 = −inf and log of a negative bound = −inf (bound below every ratio)."""
    return math.log(x) if x > 0 else -math.inf


# --- batch helpers ----------------------------------------------------------------------------


def positive_rows(advantages: np.ndarray) -> np.ndarray:
    """``A >= 0`` per sequence (N,) bool: the only thing a mapping may read from A."""
    return advantages >= 0


def per_row(positive: np.ndarray, value_pos: float, value_neg: float) -> np.ndarray:
    """(N,) array taking ``value_pos`` on positive rows and ``value_neg`` on the others."""
    return np.where(positive, value_pos, value_neg)


def seq_log_ratio(log_ratio: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log W = Σ_t log r_t over valid tokens, shape (N,) (0 for an empty sequence)."""
    return np.add.reduce(log_ratio, axis=1, where=mask, initial=0.0)


def seq_lengths(mask: np.ndarray) -> np.ndarray:
    """Number of valid tokens per sequence, shape (N,) int."""
    return np.count_nonzero(mask, axis=1)


def seq_mean_log_ratio(log_ratio: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log s = (1/|y|) Σ_t log r_t over valid tokens, shape (N,) (0 for an empty sequence)."""
    total = seq_log_ratio(log_ratio, mask)
    n = seq_lengths(mask)
    return np.divide(total, n, out=np.zeros_like(total), where=n > 0)


def map_blocks(
    log_ratio: np.ndarray,
    mask: np.ndarray,
    kernel: Callable[[np.ndarray, np.ndarray, np.ndarray, slice], None],
) -> np.ndarray:
    """Run a token-level ``kernel`` over row blocks; return c (N, T) with 0 on padding.

    ``kernel(lr, out, tmp, rows)`` must fill ``out`` (a view of c for rows ``rows``) from ``lr``
    (the same rows of ``log_ratio``); ``tmp`` is a scratch array of the same shape. Padded
    positions are set to 0 afterwards whatever the kernel wrote there.
    """
    N, T = log_ratio.shape
    out = np.empty((N, T))
    if out.size == 0:
        return out
    rows = max(1, BLOCK_ELEMENTS // T)
    tmp = np.empty((min(rows, N), T))
    for start in range(0, N, rows):
        stop = min(start + rows, N)
        block = out[start:stop]
        kernel(log_ratio[start:stop], block, tmp[: stop - start], slice(start, stop))
        np.copyto(block, 0.0, where=~mask[start:stop])
    return out


def broadcast_seq(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Put one finite value per sequence (N,) on every valid token, 0 on padding: (N, T)."""
    out = np.empty(mask.shape)
    np.multiply(mask, values[:, None], out=out)
    return out


def clamped_exp(log_w: np.ndarray, max_log_ratio: float) -> np.ndarray:
    """exp(min(log w, max_log_ratio)) (a new array)."""
    return np.exp(np.minimum(log_w, max_log_ratio))


def band_mask_1d(log_w: np.ndarray, lo: np.ndarray | float, hi: np.ndarray | float) -> np.ndarray:
    """1[lo <= log w <= hi] as bool (NaN → False)."""
    return (log_w >= lo) & (log_w <= hi)


def banded_ratio_kernel(lo: np.ndarray, hi: np.ndarray, max_log_ratio: float):
    """Kernel for c_t = r_t · 1[lo_i <= log r_t <= hi_i] (per-row log-space band lo, hi (N,)).

    r_t = exp(min(log r_t, max_log_ratio)); infinite band ends skip their comparison.
    """
    zero_outside = band_zeroing(lo, hi)
    cap = min(max_log_ratio, float(np.max(hi))) if hi.size else max_log_ratio

    def kernel(lr, out, tmp, rows):
        np.minimum(lr, cap, out=out)
        np.exp(out, out=out)
        zero_outside(lr, out, rows)

    return kernel


def band_zeroing(lo: np.ndarray, hi: np.ndarray):
    """``zero_outside(lr, out, rows)``: set ``out`` to 0 where a block's log-ratio ``lr`` leaves
    the per-row log-space band [lo_i, hi_i] (``lo``, ``hi`` (N,); ``rows`` the block's rows, as
    :func:`map_blocks` passes them). An end that is infinite for every row skips its comparison.
    """
    check_lo = bool(np.any(lo > -np.inf))
    check_hi = bool(np.any(hi < np.inf))

    def zero_outside(lr, out, rows):
        flags = np.empty(lr.shape, dtype=bool)
        if check_hi:
            np.greater(lr, hi[rows, None], out=flags)
            if flags.any():  # a masked copy costs more than the test
                np.copyto(out, 0.0, where=flags)
        if check_lo:
            np.less(lr, lo[rows, None], out=flags)
            if flags.any():
                np.copyto(out, 0.0, where=flags)

    return zero_outside


def clamped_ratio_kernel(lo: np.ndarray, hi: np.ndarray):
    """Kernel for c_t = exp(clip(log r_t, lo_i, hi_i)) (per-row log-space clamp lo, hi (N,))."""

    def kernel(lr, out, tmp, rows):
        np.clip(lr, lo[rows, None], hi[rows, None], out=out)
        np.exp(out, out=out)

    return kernel


def clamp_ratio_phi(w: np.ndarray, low: float, high: float) -> np.ndarray:
    """clip(w, low, high) (TIS / CISPO coefficient as a function of the ratio)."""
    return np.clip(w, low, high)


def clamp_ratio_f(w: np.ndarray, low: float, high: float) -> np.ndarray:
    """Surrogate of φ(w) = clip(w, low, high) with w·F'(w) = φ, F(1) = 1 (low <= 1 <= high).

    F(w) = clip(w, low, high) + low·log(w/low)·1[w < low] + high·log(w/high)·1[w > high];
    with low = 0 this is also ∫_0^w φ(u)/u du (F(0) = 0).
    """
    w = np.asarray(w, dtype=np.float64)
    out = np.clip(w, low, high)
    with np.errstate(divide="ignore", invalid="ignore"):
        if low > 0:
            out = out + np.where(w < low, low * np.log(w / low), 0.0)
        if np.isfinite(high):
            out = out + np.where(w > high, high * np.log(w / high), 0.0)
    return out


def band_phi(w: np.ndarray, low: float, high: float) -> np.ndarray:
    """w·1[low <= w <= high] (MIS / clip coefficient as a function of the ratio)."""
    return np.where((w >= low) & (w <= high), w, 0.0)


def band_f(w: np.ndarray, low: float, high: float) -> np.ndarray:
    """Surrogate of φ(w) = w·1[low <= w <= high]: F(w) = clip(w, low, high) − low (F(0) = 0)."""
    return np.clip(w, low, high) - max(low, 0.0)
