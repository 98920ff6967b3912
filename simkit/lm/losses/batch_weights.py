"""Batch-dependent pieces of the torch losses: Pareto-smoothed importance weights (PSIS, with
its generalised Pareto fit) and the M2PO keep mask."""

from __future__ import annotations

import math

import torch


def psis_tail_length(n: int) -> int:
    """Number of largest weights PSIS smooths out of ``n`` draws (relative efficiency 1):
    ⌊3√n⌋ if n > 225, else ⌊n/5⌋ (Vehtari et al., JMLR 2024, §3)."""
    return math.floor(3 * math.sqrt(n)) if n > 225 else n // 5


def gpd_fit(x: torch.Tensor) -> tuple[float, float]:
    """Empirical-Bayes fit (k̂, σ̂) of a generalised Pareto distribution to sorted ``x`` (M,) >= 0.

    Zhang & Stephens, "A new and efficient estimation method for the generalized Pareto
    distribution", Technometrics 51 (2009): a posterior mean of b = −k/σ over a grid of
    m = 30 + ⌊√M⌋ values b_j = 1/x_M + (1 − √(m/(j − ½)))/(3·x_⌊M/4+½⌋), weighted by the profile
    likelihood M·(log(−b/k(b)) − k(b) − 1) with k(b) = mean log(1 − b·x); then the weakly
    informative prior of Vehtari et al. (JMLR 2024, PSIS §3): k̂ ← (M·k̂ + 10·0.5)/(M + 10).
    Grid weights below 10·eps are dropped, as arviz-stats does. Computed in float64.
    """
    x = x.to(torch.float64)
    n = x.numel()
    m_est = 30 + int(n**0.5)
    j = torch.arange(1, m_est + 1, dtype=torch.float64, device=x.device)
    b = 1.0 - torch.sqrt(m_est / (j - 0.5))
    b = b / (3.0 * x[int(n / 4 + 0.5) - 1])
    b = b + 1.0 / x[-1]
    k = torch.log1p(-b[:, None] * x).mean(dim=1)
    profile = n * (torch.log(-b / k) - k - 1.0)
    weights = torch.exp(profile - torch.logsumexp(profile, dim=0))
    keep = weights >= 10 * torch.finfo(torch.float64).eps
    weights, b = weights[keep], b[keep]
    weights = weights / weights.sum()
    b_post = (b * weights).sum()
    kappa = torch.log1p(-b_post * x).mean()
    sigma = -kappa / b_post
    kappa = (n * kappa + 10 * 0.5) / (n + 10)
    return float(kappa), float(sigma)


def gpd_quantile(p: torch.Tensor, kappa: float, sigma: float, mu: torch.Tensor) -> torch.Tensor:
    """Quantile function of the generalised Pareto distribution (shape κ, scale σ, location μ):
    μ + σ·((1 − p)^{−κ} − 1)/κ (μ − σ·log(1 − p) at κ = 0); NaN when σ <= 0."""
    if not sigma > 0:
        return torch.full_like(p, math.nan)
    if kappa == 0:
        return mu - sigma * torch.log1p(-p)
    return mu + sigma * torch.expm1(-kappa * torch.log1p(-p)) / kappa


def psis_smooth(log_w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Pareto-smoothed, normalised log-weights (S,) and the tail shape k̂, in torch (float64).

    Vehtari, Simpson, Gelman, Yao & Gabry, "Pareto smoothed importance sampling", JMLR 25
    (2024): the M = :func:`psis_tail_length` largest weights w = exp(log_w − max) are replaced by
    the quantiles F⁻¹((j − ½)/M) of a generalised Pareto fitted (:func:`gpd_fit`) to their
    excesses over the largest weight below them, capped at the largest raw weight; then
    normalised (Σ exp = 1). The same conventions as :func:`simkit.mappings.psis_smooth`:
    fewer than 5 tail draws → only normalised, k̂ = +inf; a constant tail → k̂ = −inf; a
    non-finite smoothed weight → only normalised, k̂ = +inf. Ties are ordered stably.
    """
    lw = log_w.detach().to(torch.float64)
    if lw.ndim != 1 or lw.numel() == 0:
        raise ValueError(f"log_w must have shape (S,) with S >= 1, got shape {tuple(lw.shape)}")
    if not bool(torch.isfinite(lw).all()):
        raise ValueError("log_w contains non-finite values (PSIS needs finite log-weights)")
    n = lw.numel()
    tail = psis_tail_length(n)
    if tail < 5:
        return torch.log_softmax(lw, dim=0), math.inf
    top = torch.topk(lw, tail).values
    spread = float(top.max() - top.min())
    if spread < torch.finfo(torch.float64).tiny or float(torch.exp(top - top.max()).min()) == 1:
        return torch.log_softmax(lw, dim=0), -math.inf
    ary = lw - lw.max()
    order = torch.argsort(ary, stable=True)
    tail_idx = order[n - tail :]
    draws = ary[tail_idx]
    cutoff = ary[order[n - tail - 1]]
    max_tail = draws.max()
    kappa, sigma = gpd_fit(torch.exp(draws) - torch.exp(cutoff))
    if math.isfinite(kappa):
        p = (torch.arange(tail, dtype=torch.float64, device=lw.device) + 0.5) / tail
        smoothed = torch.log(gpd_quantile(p, kappa, sigma, torch.exp(cutoff)))
        smoothed = torch.where(smoothed > max_tail, max_tail, smoothed)
        ary = ary.index_put((tail_idx,), smoothed)
    ary = ary - torch.logsumexp(ary, dim=0)
    if not bool(torch.isfinite(ary).all()):
        return torch.log_softmax(lw, dim=0), math.inf
    return ary, kappa


def m2po_removed(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    positive: torch.Tensor,
    tau: float,
    trust_region_only: bool = True,
    bound: float | None = None,
) -> torch.Tensor | None:
    """The M2PO mask: True where a token is removed, (N, T) bool, or None if none is.

    Zheng et al., "Prosperity before collapse", arXiv 2510.01161, Algorithm 1: while the mean
    of (log r_t)² over the remaining candidate tokens exceeds τ, remove the largest (ties: first
    in row-major order). Candidates: valid tokens, restricted (``trust_region_only``) to the side
    PPO's clip acts on (A >= 0 and r_t > 1, or A < 0 and r_t < 1). ``log_ratio`` (N, T) must be
    0 on padded positions; ``mask`` (N, T) bool, ``positive`` (N,) bool. The total is summed in
    float64. ``bound`` (optional): max |log r| over the tokens; when bound² <= τ·(1 − 10⁻⁶) every
    candidate's (log r)² (float32 or float64) is at most τ, so is their mean, and None is
    returned without reading ``log_ratio`` — the same answer as the sum: its float64 rounding
    (relative n·2⁻⁵³ at most) stays below the 10⁻⁶ margin for n < 10⁹ tokens.
    """
    if bound is not None and log_ratio.numel() < 10**9 and bound * bound <= tau * (1.0 - 1e-6):
        return None
    lr = log_ratio.detach()
    if trust_region_only:
        # the side of the sign of A: s·log r > 0 with s = ±1 (a padded log r = 0 never is),
        # as 1.0/0.0 in the compute dtype (an in-place float compare: no bool → float cast)
        side = torch.where(positive, 1.0, -1.0).to(lr.dtype)[:, None]
        cand = torch.mul(lr, side).gt_(0.0)
        sq = (lr * lr).mul_(cand)
        # a float sum of 0/1 is exact below 2^24 (float32) entries
        exact = (lr.dtype == torch.float32 and cand.numel() <= 2**24) or lr.dtype == torch.float64
        count = cand.sum() if exact else None
    else:
        cand = mask
        sq = lr * lr  # 0 on padding
        count = None
    if count is None:
        count = torch.count_nonzero(cand)
    if sq.dtype != torch.float32:
        total, n = torch.stack([sq.sum(dtype=torch.float64), count.to(torch.float64)]).tolist()
        n = int(n)
    else:
        # float32: the sum in float32 first (no float64 copy of (N, T)); with γ = m·2⁻²⁴/(1 −
        # m·2⁻²⁴), m = #entries − 1, any order of float32 additions of m + 1 values >= 0 is
        # within a factor (1 ± γ) of their exact sum S, so s32 <= τ·n·(1 − γ)·(1 − 10⁻⁶)
        # implies S < τ·n·(1 − 10⁻⁶) and the float64 sum of the decision below (relative error
        # < 10⁻⁷ for < 10⁹ entries) is <= τ·n as well: no removal, the same answer. Otherwise
        # (the mean within that margin of τ, or above) the float64 sum decides, as always
        s32, n = torch.stack([sq.sum(), count.to(sq.dtype)]).tolist()
        n = int(n)
        m = max(sq.numel() - 1, 0) * 2.0**-24
        if n == 0 or (m < 0.5 and s32 <= tau * n * (1.0 - m / (1.0 - m)) * (1.0 - 1e-6)):
            return None
        total = float(sq.sum(dtype=torch.float64))
    if n == 0 or total <= tau * n:
        return None
    if trust_region_only:
        cand = cand != 0
    k, threshold = _smallest_removal(sq.reshape(-1), n, total, tau)
    removed = sq > threshold  # implies a candidate: non-candidates hold 0 <= threshold
    extra = k - int(torch.count_nonzero(removed))
    if extra > 0:
        ties = torch.nonzero((cand & (sq == threshold)).reshape(-1)).reshape(-1)[:extra]
        removed = removed.reshape(-1).index_fill(0, ties, True).reshape(sq.shape)
    return removed


def _smallest_removal(
    values: torch.Tensor, n: int, total: float, tau: float
) -> tuple[int, torch.Tensor]:
    """Smallest k such that the mean of the n candidate values without their k largest is
    <= τ, and the k-th largest value. ``values`` holds the candidates' values and zeros for the
    other entries (never above a candidate's); only the top is sorted, grown until k is found."""
    top = min(n, 1024)
    while True:
        part = torch.topk(values, top).values
        removed_sum = torch.cumsum(part.to(torch.float64), dim=0)
        remaining = n - torch.arange(1, top + 1, device=values.device, dtype=torch.float64)
        mean_rest = torch.where(remaining > 0, (total - removed_sum) / remaining.clamp(min=1), 0.0)
        ok = torch.nonzero(mean_rest <= tau)
        if ok.numel():
            i = int(ok[0, 0])
            return i + 1, part[i]
        top = min(n, top * 4)
