"""Covariance-targeted PPO variants: Clip-Cov and KL-Cov (entropy-mechanism regularisers).

Cui et al., "The entropy mechanism of reinforcement learning for reasoning language models",
arXiv 2505.22617, §4: the entropy change is driven by the token covariance
cov_t = (A_t − mean A)·(log π_t − mean log π) (means over the batch's valid tokens); a few
high-covariance tokens are detached (Clip-Cov) or KL-penalised (KL-Cov). Formulas from verl
``verl/trainer/ppo/core_algos.py`` at commit b178a3c (``compute_policy_loss_clip_cov``,
``compute_policy_loss_kl_cov``, adapted there from PRIME-RL/Entropy-Mechanism-of-RL).

Both read more than the sign of A (the covariance uses its value) and, in a trainer, log π
itself: ``coefficients`` takes the optional keyword ``log_prob`` (N, T); without it the
log-ratio stands in for log π (the simulator's batches carry log π − log μ only; the centred
log π and the centred log-ratio differ by the centred log μ). Both are batch dependent.

Speed: ``coefficients`` and ``selected`` make one pass over blocks of rows (the coefficients and
the block's covariance together, in cache) after the two means, instead of materialising cov,
the candidate mask and the index of every valid token. Clip-Cov keeps the block positions with
lb < cov < ub; KL-Cov keeps one maximum per group of :data:`GROUP_ROWS` rows of a column and
reads again only the groups whose maximum reaches the k-th largest maximum (every token of the
top k lies in one of them). The results are those of :func:`token_covariance` followed by
:func:`clip_cov_selection` / :func:`kl_cov_selection` bit for bit (the same floating-point
operations on the same values; a NaN covariance — only reachable when |A|·|log π| overflows —
and a k close to the number of tokens take those functions themselves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simkit._validation import check_batch, like_log_ratio
from simkit.mappings.base import (
    BLOCK_ELEMENTS,
    DEFAULT_MAX_LOG_RATIO,
    Mapping,
    check_max_log_ratio,
    check_real,
    positive_rows,
    register,
    safe_log,
)


def token_covariance(advantages, log_prob, mask) -> np.ndarray:
    """cov_t = (A_i − mean A)(log π_t − mean log π), means over valid tokens; −inf on padding.

    ``advantages`` (N,), ``log_prob`` (N, T), ``mask`` (N, T) bool (verl's ``cov_all``).
    """
    n = mask.sum(axis=1)
    total = int(n.sum())
    if total == 0:
        return np.full(mask.shape, -np.inf)
    mean_a = float(advantages @ n) / total
    mean_lp = float(np.add.reduce(log_prob, axis=None, where=mask, initial=0.0)) / total
    with np.errstate(invalid="ignore", over="ignore"):
        cov = (advantages - mean_a)[:, None] * (log_prob - mean_lp)
    return np.where(mask, cov, -np.inf)


def _inputs(log_ratio, mask, advantages, log_prob):
    lr, m, adv = check_batch(log_ratio, mask, advantages)
    if log_prob is None:
        return lr, m, adv, lr
    lp = like_log_ratio(log_prob, lr, "log_prob")
    return lr, m, adv, np.where(m, lp, 0.0)


def _as_rng(rng) -> np.random.Generator:
    if rng is None:
        return np.random.default_rng(0)
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, int | np.integer) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy Generator, an int seed or None, got {type(rng).__name__}")


def clip_cov_selection(cov, candidates, ratio: float, rng) -> np.ndarray:
    """Flat indices (row-major) of the tokens Clip-Cov detaches.

    verl: ``clip_num = max(int(ρ·#valid), 1)`` tokens drawn without replacement, uniformly,
    among the candidates (row-major order of ``torch.nonzero``; verl permutes them with
    ``torch.randperm``); here ``rng.choice(#candidates, min(clip_num, #candidates),
    replace=False)`` picks the positions in the candidate list (the same law). ``cov`` (−inf on
    padding) gives the number of valid tokens.
    """
    idx = np.flatnonzero(candidates)
    if idx.size == 0:
        return idx
    n_valid = int(np.count_nonzero(np.isfinite(cov)))
    return idx[draw_subset(rng, idx.size, max(int(ratio * n_valid), 1))]


def draw_subset(rng, n: int, k: int) -> np.ndarray:
    """min(k, n) distinct positions in [0, n), uniformly (``Generator.choice`` without
    replacement): the one random draw of Clip-Cov, shared by the numpy and torch versions."""
    return _as_rng(rng).choice(n, size=min(k, n), replace=False)


def top_k_first(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest ``values`` (1-D), ties at the k-th value broken by position
    (first first), in O(n): a partition for the k-th largest, then the ties in order."""
    n = values.size
    k = min(k, n)
    if k == 0:
        return np.zeros(0, dtype=np.intp)
    kth = np.partition(values, n - k)[n - k]
    above = np.flatnonzero(values > kth)
    ties = np.flatnonzero(values == kth)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def kl_cov_selection(cov, mask, ratio: float) -> np.ndarray:
    """Flat indices of the k = max(1, ⌊ρ·#valid⌋) valid tokens of largest covariance.

    verl uses ``torch.topk``; ties at the k-th value here go to the first in row-major order
    (:func:`top_k_first`).
    """
    valid = np.flatnonzero(mask)
    if valid.size == 0:
        return valid
    k = max(1, int(valid.size * ratio))
    return valid[top_k_first(cov.reshape(-1)[valid], k)]


#: rows per group of the KL-Cov maxima (one maximum per group of rows and column)
GROUP_ROWS = 16


def _centring(adv, lp, m):
    """(A − mean A (N,), mean log π, #valid) with the means of :func:`token_covariance`,
    computed by the same operations (so the covariances agree bit for bit); None, 0, 0 when
    no token is valid."""
    if np.count_nonzero(m) == m.size:  # no padding: the row counts without a pass
        n = np.full(m.shape[0], m.shape[1], dtype=np.int_)
    else:
        n = m.sum(axis=1)
    total = int(n.sum())
    if total == 0:
        return None, 0.0, 0
    mean_a = float(adv @ n) / total
    mean_lp = float(np.add.reduce(lp, axis=None, where=m, initial=0.0)) / total
    return adv - mean_a, mean_lp, total


def _block_rows(T: int) -> int:
    """Rows per block of the streaming pass: about :data:`BLOCK_ELEMENTS` values, a multiple
    of :data:`GROUP_ROWS`."""
    return max(GROUP_ROWS, (BLOCK_ELEMENTS // max(T, 1)) // GROUP_ROWS * GROUP_ROWS)


def _stream(lr, m, lp, dev, mean_lp, kernel, visit) -> np.ndarray | None:
    """One pass over row blocks. For each block: the coefficients (``kernel(lr, out, tmp,
    rows)`` as in :func:`~simkit.mappings.base.map_blocks`, 0 on padding; skipped when
    ``kernel`` is None), then cov = (A − mean A)·(log π − mean log π) of the block (valid
    tokens; padding holds whatever the same formula gives there) handed to
    ``visit(start, cov, padding)`` (``padding``: the block's ~mask, None when it has no
    padding). Returns c (N, T) or None."""
    N, T = lr.shape
    rows = _block_rows(T)
    c = np.empty((N, T)) if kernel is not None else None
    cov = np.empty((min(rows, N), T))
    tmp = np.empty_like(cov) if kernel is not None else None
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, N, rows):
            stop = min(start + rows, N)
            mb = m[start:stop]
            pad = None if mb.all() else ~mb
            if kernel is not None:
                out = c[start:stop]
                kernel(lr[start:stop], out, tmp[: stop - start], slice(start, stop))
                if pad is not None:
                    np.copyto(out, 0.0, where=pad)
            if dev is not None:
                cv = cov[: stop - start]
                np.subtract(lp[start:stop], mean_lp, out=cv)
                np.multiply(dev[start:stop, None], cv, out=cv)
                visit(start, cv, pad)
    return c


def _capped_exp(lr, cap: float, out) -> None:
    """out = exp(min(lr, cap)), skipping the minimum when no entry exceeds ``cap``."""
    if lr.max(initial=-np.inf) > cap:
        np.minimum(lr, cap, out=out)
        np.exp(out, out=out)
    else:
        np.exp(lr, out=out)


def _exp_kernel(cap: float):
    """Kernel of :func:`_stream`: c = exp(min(log r, cap))."""

    def kernel(lr, out, tmp, rows):
        _capped_exp(lr, cap, out)

    return kernel


def _ppo_kernel(positive, hi: float, lo: float, cap: float):
    """Kernel of :func:`_stream`: PPO's c = exp(min(log r, cap)), set to 0 where log r > hi on
    the rows with A >= 0 (``positive`` (N,)) and where log r < lo on the others. The two
    comparisons are with scalars; the few tokens outside the band are zeroed by position."""
    flags = []

    def kernel(lr, out, tmp, rows):
        _capped_exp(lr, cap, out)
        if not flags or flags[0].shape[0] < lr.shape[0]:
            flags[:] = [np.empty(lr.shape, dtype=bool)]
        f = flags[0][: lr.shape[0]]
        side = positive[rows]
        for bound, compare, on_rows in ((hi, np.greater, side), (lo, np.less, ~side)):
            if math.isinf(bound):
                continue
            compare(lr, bound, out=f)
            if f.any():
                idx = np.flatnonzero(f)
                out.reshape(-1)[idx[on_rows[idx // lr.shape[1]]]] = 0.0

    return kernel


class _ClipCovCandidates:
    """Visitor of :func:`_stream` for Clip-Cov: the flat positions with lb < cov < ub on valid
    tokens (row-major), and the number of valid tokens whose cov is not finite. A block is
    compared entry by entry only when its maximum exceeds lb (or is NaN), and counted only
    when its sum is not finite (padding is set to lb, which is neither)."""

    def __init__(self, T: int, lb: float, ub: float):
        self.T, self.lb, self.ub = T, lb, ub
        self.hits: list[np.ndarray] = []
        self.nonfinite = 0

    def __call__(self, start, cv, pad):
        if pad is not None:
            np.copyto(cv, self.lb, where=pad)
        if not cv.max() <= self.lb:  # some cov > lb, or a NaN
            hit = np.flatnonzero((cv > self.lb) & (cv < self.ub))
            if hit.size:
                self.hits.append(hit + start * self.T)
        if not np.isfinite(cv.sum()):  # rare: an overflowing covariance
            self.nonfinite += int(np.count_nonzero(~np.isfinite(cv)))


class _GroupMaxima:
    """Visitor of :func:`_stream` for KL-Cov: the largest valid cov of each group of
    :data:`GROUP_ROWS` consecutive rows in each column (−inf without a valid token)."""

    def __init__(self, N: int, T: int):
        self.T = T
        groups = -(-N // GROUP_ROWS)
        self.maxima = np.empty((groups, T))

    def __call__(self, start, cv, pad):
        if pad is not None:
            np.copyto(cv, -np.inf, where=pad)
        r = cv.shape[0]
        g0 = start // GROUP_ROWS
        q = r // GROUP_ROWS
        if q:
            np.max(
                cv[: q * GROUP_ROWS].reshape(q, GROUP_ROWS, self.T),
                axis=1,
                out=self.maxima[g0 : g0 + q],
            )
        if r % GROUP_ROWS:
            np.max(cv[q * GROUP_ROWS :], axis=0, out=self.maxima[g0 + q])


def _clip_cov_stream(owner, lr, m, adv, lp, rng, kernel):
    """(c or None, the flat positions Clip-Cov detaches) in one :func:`_stream` pass: the
    candidates of ``ClipCov._selection``'s definition and the draw of
    :func:`clip_cov_selection`."""
    T = lr.shape[1]
    dev, mean_lp, total = _centring(adv, lp, m)
    visit = _ClipCovCandidates(T, owner.lb, owner.ub)
    c = _stream(lr, m, lp, dev, mean_lp, kernel, visit)
    pos = np.concatenate(visit.hits) if visit.hits else np.zeros(0, dtype=np.intp)
    if pos.size:
        hi, lo = math.log1p(owner.eps_high), safe_log(1.0 - owner.eps_low)
        a = adv[pos // T]
        v = lr[pos // T, pos % T]
        pos = pos[~(((a > 0) & (v > hi)) | ((a < 0) & (v < lo)))]
    if pos.size == 0:
        return c, pos
    n_valid = total - visit.nonfinite
    return c, pos[draw_subset(rng, pos.size, max(int(owner.ratio * n_valid), 1))]


def _kl_cov_stream(ratio, lr, m, adv, lp, kernel):
    """(c or None, :func:`kl_cov_selection` of :func:`token_covariance`) in one
    :func:`_stream` pass, reading again only the row groups whose maximum (per column)
    reaches τ, the k-th largest group maximum: the k-th largest cov v_k is >= τ (k distinct
    groups hold a value >= τ), so every valid token with cov >= v_k is in such a group."""
    N, T = lr.shape
    dev, mean_lp, total = _centring(adv, lp, m)
    empty = np.zeros(0, dtype=np.intp)
    if dev is None:
        return _stream(lr, m, lp, None, 0.0, kernel, None), empty
    k = max(1, int(total * ratio))
    n = N * T

    def dense():
        return kl_cov_selection(token_covariance(adv, lp, m), m, ratio)

    if 4 * k * GROUP_ROWS > n:
        return _stream(lr, m, lp, None, 0.0, kernel, None), dense()
    visit = _GroupMaxima(N, T)
    c = _stream(lr, m, lp, dev, mean_lp, kernel, visit)
    maxima = visit.maxima.reshape(-1)
    if np.isnan(maxima).any():  # the dense path's ordering of NaN (the largest)
        return c, dense()
    tau = np.partition(maxima, maxima.size - k)[maxima.size - k]
    chosen = np.flatnonzero(maxima >= tau) if tau > -np.inf else None
    if chosen is None or 2 * chosen.size * GROUP_ROWS > n:  # ties at τ in most groups
        return c, dense()
    group, col = np.divmod(chosen, T)
    rows = group[:, None] * GROUP_ROWS + np.arange(GROUP_ROWS)
    cols = np.broadcast_to(col[:, None], rows.shape)
    inside = rows < N
    rows, cols = rows[inside], cols[inside]
    valid = m[rows, cols]
    rows, cols = rows[valid], cols[valid]
    pos = rows * T + cols
    order = np.argsort(pos)
    pos, rows, cols = pos[order], rows[order], cols[order]
    with np.errstate(invalid="ignore", over="ignore"):
        values = dev[rows] * (lp[rows, cols] - mean_lp)
    return c, pos[top_k_first(values, k)]


def _check_ratio(owner, field: str = "ratio") -> None:
    check_real(owner, field, low=0.0, high=1.0, low_open=True)


@register
@dataclass(frozen=True)
class ClipCov(Mapping):
    """Clip-Cov: PPO clip, plus a random fraction ρ of the high-covariance tokens detached.

    Cui et al. 2025 (arXiv 2505.22617), verl ``compute_policy_loss_clip_cov`` (b178a3c):
    candidates are the valid tokens PPO did not clip (verl's ``clip_by_origin``: A > 0 and
    r > 1+ε_high, or A < 0 and r < 1−ε_low) with lb < cov_t < ub; ``max(⌊ρ·#valid⌋, 1)`` of
    them, drawn uniformly without replacement, get c = 0; every other token has PPO's
    c = r·1[r in the band for the sign of A]. ρ = ``ratio`` ∈ (0, 1] (2e-4), lb = 1, ub = 5,
    ε = 0.2/0.2. Stochastic: ``coefficients(..., rng=Generator)`` (the estimator passes its
    seeded stream; without one a ``default_rng(0)`` is used, so repeated calls agree).
    ``log_prob`` as in the module docstring. On-policy (log r = 0, no ``log_prob``) cov = 0 ⇒
    c = 1.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    ratio: float = 2e-4
    lb: float = 1.0
    ub: float = 5.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "clip_cov"
    level = "batch"
    batch_dependent = True
    stochastic = True
    uses_log_prob = True

    def __post_init__(self):
        check_real(self, "eps_low", low=0.0, high=math.inf, allow_inf=True)
        check_real(self, "eps_high", low=0.0, high=math.inf, allow_inf=True)
        _check_ratio(self)
        lb = check_real(self, "lb")
        ub = check_real(self, "ub")
        if not lb < ub:
            raise ValueError(f"clip_cov: lb must be < ub, got lb = {lb}, ub = {ub}")
        check_max_log_ratio(self)

    def selected(self, log_ratio, mask, advantages, *, log_prob=None, rng=None) -> np.ndarray:
        """The detached tokens, (N, T) bool: the candidates are the valid tokens that PPO did
        not clip (A > 0 and log r > log(1+ε_high), or A < 0 and log r < log(1−ε_low)) with
        lb < cov < ub (:func:`token_covariance`), the draw :func:`clip_cov_selection`'s."""
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        out = np.zeros(lr.shape, dtype=bool)
        out.flat[_clip_cov_stream(self, lr, m, adv, lp, rng, None)[1]] = True
        return out

    def coefficients(self, log_ratio, mask, advantages, *, log_prob=None, rng=None):
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        hi, lo = math.log1p(self.eps_high), safe_log(1.0 - self.eps_low)
        kernel = _ppo_kernel(positive_rows(adv), hi, lo, self.max_log_ratio)
        c, chosen = _clip_cov_stream(self, lr, m, adv, lp, rng, kernel)
        c.flat[chosen] = 0.0
        return c


@register
@dataclass(frozen=True)
class KLCov(Mapping):
    """KL-Cov: unclipped r·A, plus κ·|log r| on the top-k covariance tokens.

    Cui et al. 2025 (arXiv 2505.22617), verl ``compute_policy_loss_kl_cov`` (b178a3c): loss
    −A·r_t on every valid token and −A·r_t + κ·|log r_t| on the k = max(1, ⌊ρ·#valid⌋) tokens
    of largest cov_t (ties: first in row-major order). ρ = ``ratio`` ∈ (0, 1] (2e-4),
    κ = ``kappa`` ≥ 0 (verl's ``ppo_kl_coef``, 1).

    Its gradient is *not* proportional to A on the selected tokens: ∂loss/∂log π_t =
    −A·r_t + κ·sign(log r_t). ``coefficients`` represents it as the c with c·A equal to that
    gradient weight, c_t = r_t − κ·sign(log r_t)/A on selected tokens (A ≠ 0), so c may be
    negative and depends on |A|; on a selected token of a row with A = 0 the penalty's
    gradient κ·sign(log r_t) has no c·A form and is dropped (c = r_t). Elsewhere c = r_t
    (capped at e^``max_log_ratio``). On-policy log r = 0 ⇒ c = 1.
    """

    ratio: float = 2e-4
    kappa: float = 1.0
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
    name = "kl_cov"
    level = "batch"
    batch_dependent = True
    uses_log_prob = True

    def __post_init__(self):
        _check_ratio(self)
        check_real(self, "kappa", low=0.0)
        check_max_log_ratio(self)

    def selected(self, log_ratio, mask, advantages, *, log_prob=None) -> np.ndarray:
        """The KL-penalised tokens, (N, T) bool."""
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        out = np.zeros(lr.shape, dtype=bool)
        out.flat[_kl_cov_stream(self.ratio, lr, m, adv, lp, None)[1]] = True
        return out

    def coefficients(self, log_ratio, mask, advantages, *, log_prob=None, rng=None):
        lr, m, adv, lp = _inputs(log_ratio, mask, advantages, log_prob)
        kernel = _exp_kernel(self.max_log_ratio)
        c, sel = _kl_cov_stream(self.ratio, lr, m, adv, lp, kernel)
        if sel.size and self.kappa > 0:
            rows = sel // max(lr.shape[1], 1)
            a = adv[rows]
            nz = a != 0
            penalty = self.kappa * np.sign(lr.reshape(-1)[sel[nz]]) / a[nz]
            c.reshape(-1)[sel[nz]] -= penalty
        return c


__all__ = [
    "ClipCov",
    "KLCov",
    "clip_cov_selection",
    "draw_subset",
    "kl_cov_selection",
    "token_covariance",
    "top_k_first",
]
