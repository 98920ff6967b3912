"""Bias, variance, MSE, SNR and ESS of LM gradient estimators against an estimated ∇J.

:func:`bias_statistics` (the honest, floor-corrected squared bias and its standard error) and
:func:`gradient_metrics` (every metric with its interval), as described in
:mod:`simkit.lm.study`.
"""

from __future__ import annotations

import math

import numpy as np

from simkit import experiment as _experiment
from simkit.experiment.metrics import kept_fractions

# --- metrics ---------------------------------------------------------------------------------


def _gram_trace_sq(X: np.ndarray, Y: np.ndarray | None = None) -> float:
    """‖X Yᵀ‖_F² = tr(XᵀX·YᵀY) without forming D×D matrices (Y = X by default)."""
    K = X @ (X if Y is None else Y).T
    return float(np.sum(K * K))


def _reference_term(cache: dict | None, key: str, compute):
    """``compute()``, or its value stored in ``cache`` under ``key``: the terms of the
    reference draws alone (the same for every estimator of a study) are computed once per
    study instead of once per estimator (issue 28); ``cache`` None computes every time."""
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def bias_statistics(gradients, reference_samples, cache: dict | None = None) -> dict[str, float]:
    """Debiased squared bias of E ĝ against ∇J and its standard error (module docstring).

    ``gradients`` (R, D): ĝ_r of R independent batches; ``reference_samples`` (M, D): i.i.d.
    unbiased single-sample estimates u_j of ∇J. Returns ``bias_sq`` (unbiased for
    ‖E ĝ − ∇J‖², may be < 0), ``bias_sq_se`` (Gaussian approximation
    √(2 tr Σ² + 4 ΔᵀΣΔ), Σ = Σ_g/R + Σ_u/M, with ΔᵀΣΔ estimated by Δ̂ᵀΣ̂Δ̂ − tr Σ̂², clipped
    at 0; tr Σ̂² from Gram matrices, which slightly over-estimates it: conservative),
    ``noise`` = tr(Σ̂_g)/R + tr(Σ̂_u)/M (the Monte Carlo floor removed), ``variance`` tr Σ̂_g,
    ``ref_variance`` tr Σ̂_u. ``cache``: a dict shared by calls with the same
    ``reference_samples`` (and bootstrap weights), which keeps their reference-only terms.
    """
    g = np.asarray(gradients, dtype=np.float64)
    u = np.asarray(reference_samples, dtype=np.float64)
    if g.ndim != 2 or u.ndim != 2 or g.shape[1] != u.shape[1]:
        raise ValueError(
            f"gradients (R, D) and reference_samples (M, D) must share D, got {g.shape} and "
            f"{u.shape}"
        )
    R, M = g.shape[0], u.shape[0]
    if R < 2 or M < 2:
        raise ValueError(f"need at least 2 batches and 2 reference samples, got {R} and {M}")
    Xg, Xu = g - g.mean(0), u - u.mean(0)
    delta = g.mean(0) - u.mean(0)
    variance = float(np.sum(Xg * Xg)) / (R - 1)
    ref_variance = float(np.sum(Xu * Xu)) / (M - 1)
    noise = variance / R + ref_variance / M
    bias_sq = float(delta @ delta) - noise
    tr_sigma2 = (
        _gram_trace_sq(Xg) / ((R - 1) ** 2 * R**2)
        + _reference_term(cache, "gram_uu", lambda: _gram_trace_sq(Xu)) / ((M - 1) ** 2 * M**2)
        + 2.0 * _gram_trace_sq(Xg, Xu) / ((R - 1) * (M - 1) * R * M)
    )
    quad = float(np.sum((Xg @ delta) ** 2)) / ((R - 1) * R) + float(np.sum((Xu @ delta) ** 2)) / (
        (M - 1) * M
    )
    quad = max(quad - tr_sigma2, 0.0)
    return {
        "bias_sq": bias_sq,
        "bias_sq_se": math.sqrt(2.0 * tr_sigma2 + 4.0 * quad),
        "noise": noise,
        "variance": variance,
        "ref_variance": ref_variance,
    }


def _normal_quantile(q: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(q))


def _resample_weights(count: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    idx = rng.integers(0, count, size=(n_boot, count))
    W = np.zeros((n_boot, count))
    np.add.at(W, (np.arange(n_boot)[:, None], idx), 1.0 / count)
    return W


def gradient_metrics(
    gradients,
    reference_samples,
    n: int,
    coefficients,
    mask,
    level: float = 0.95,
    n_boot: int = 200,
    rng: np.random.Generator | None = None,
    boot_weights: tuple[np.ndarray, np.ndarray] | None = None,
    cache: dict | None = None,
) -> dict[str, float]:
    """Metrics of one estimator against the estimated ∇J (module docstring).

    ``gradients`` (R, D) ĝ_r; ``reference_samples`` (M, D) u_j; ``coefficients``, ``mask``
    (R, n, T) the mapping's c and the valid tokens (for ``ess`` and ``khat``). Point values:
    ``bias`` = √max(bias_sq, 0); ``bias_dir`` the same debiasing for the component of E ĝ
    orthogonal to ∇̂J (noise along ∇̂J removed; ∇̂J's direction treated as fixed);
    ``cosine`` = cos(ḡ, ∇̂J) (plug-in); ``variance`` = tr Σ̂_g; ``mse`` = bias² + variance;
    ``snr`` = (‖ḡ‖² − variance/R)/variance; ``ess`` = n·(Σ|c|)²/(Σc²·#tokens)
    (:func:`simkit.experiment.effective_sample_size`); ``khat`` of |c|. Bounds at ``level``:
    bias from bias_sq ± z·bias_sq_se, bias_dir from the bootstrap confidence ball; the others
    percentile bootstrap over batches and reference draws resampled independently
    (``boot_weights`` = (W_g (B, R), W_u (B, M)) to share resamples between estimators;
    ``cache``: a dict shared by the estimators of one study, the same ``reference_samples`` and
    ``boot_weights``, in which the reference-only terms are computed once — the same values).

    Also the scale-free error (:func:`scale_free_statistics`: ``mse_zero``, ``alpha_star``,
    ``mse_scaled``, ``rel_mse_scaled`` with bounds), the kept fractions
    (:func:`kept_statistics`: ``kept``, ``kept_seq`` with bounds) and the reliability of the
    row (:func:`draw_reliability`: ``reliable``, ``tail_draws``).
    """
    g = np.asarray(gradients, dtype=np.float64)
    u = np.asarray(reference_samples, dtype=np.float64)
    stats = bias_statistics(g, u, cache=cache)
    R, M = g.shape[0], u.shape[0]
    if boot_weights is None:
        if cache is not None:
            raise ValueError("cache needs boot_weights (its terms depend on the resamples)")
        rng = np.random.default_rng(0) if rng is None else rng
        boot_weights = (_resample_weights(R, n_boot, rng), _resample_weights(M, n_boot, rng))
    Wg, Wu = boot_weights
    mean, ref = g.mean(0), u.mean(0)
    delta = mean - ref
    variance = stats["variance"]
    bias_sq = stats["bias_sq"]
    alpha = _experiment.best_scale(mean, ref)
    rnorm2 = float(ref @ ref)
    unit = ref / math.sqrt(rnorm2) if rnorm2 > 0 else np.zeros_like(ref)
    perp = mean - alpha * ref
    along = (g @ unit).var(ddof=1) / R + (u @ unit).var(ddof=1) / M
    bias_dir_sq = float(perp @ perp) - max(stats["noise"] - along, 0.0)
    mean_sq = float(mean @ mean) - variance / R

    c = np.abs(np.asarray(coefficients, dtype=np.float64)) * np.asarray(mask, dtype=bool)
    m = np.asarray(mask, dtype=bool)
    s1, s2 = c.sum(axis=(1, 2)), (c**2).sum(axis=(1, 2))
    tokens = m.sum(axis=(1, 2)).astype(np.float64)

    def ess_of(a, b, k):
        den = b * k
        return n * np.divide(a**2, den, out=np.zeros_like(den), where=den > 0)

    ess = float(ess_of(np.array(s1.sum()), np.array(s2.sum()), np.array(tokens.sum())))
    mean_b, ref_b = Wg @ g, Wu @ u
    delta_b = mean_b - ref_b
    var_b = np.maximum(Wg @ np.sum(g * g, axis=1) - np.sum(mean_b**2, axis=1), 0.0) * R / (R - 1)
    var_u_b = np.maximum(Wu @ np.sum(u * u, axis=1) - np.sum(ref_b**2, axis=1), 0.0) * M / (M - 1)
    bias_sq_b = np.maximum(np.sum(delta_b**2, axis=1) - var_b / R - var_u_b / M, 0.0)
    denom = np.linalg.norm(mean_b, axis=1) * np.linalg.norm(ref_b, axis=1)
    cos_b = np.divide(
        np.sum(mean_b * ref_b, axis=1), denom, out=np.full(len(denom), np.nan), where=denom > 0
    )
    snr_b = np.divide(
        np.maximum(np.sum(mean_b**2, axis=1) - var_b / R, 0.0),
        var_b,
        out=np.full(len(var_b), np.nan),
        where=var_b > 0,
    )
    ess_b = ess_of(Wg @ s1, Wg @ s2, Wg @ tokens)
    radius = float(np.quantile(np.linalg.norm(delta_b - delta, axis=1), level))
    tail = (1.0 - level) / 2.0

    def pct(x):
        x = x[np.isfinite(x)]
        if not x.size:
            return math.nan, math.nan
        lo, hi = np.quantile(x, [tail, 1.0 - tail])
        return float(lo), float(hi)

    bias = math.sqrt(max(bias_sq, 0.0))
    z = float(_normal_quantile(1.0 - tail))
    pn = float(np.linalg.norm(perp))
    out = {
        "bias": bias,
        "bias_lo": math.sqrt(max(bias_sq - z * stats["bias_sq_se"], 0.0)),
        "bias_hi": math.sqrt(max(bias_sq + z * stats["bias_sq_se"], 0.0)),
        "bias_dir": math.sqrt(max(bias_dir_sq, 0.0)),
        "bias_dir_lo": max(pn - radius, 0.0),
        "bias_dir_hi": pn + radius,
        "cosine": _experiment.cosine(mean, ref),
        "variance": variance,
        "mse": max(bias_sq, 0.0) + variance,
        "snr": _experiment.snr(max(mean_sq, 0.0), variance),
        "ess": ess,
    }
    for key, values in (
        ("cosine", cos_b),
        ("variance", var_b),
        ("mse", bias_sq_b + var_b),
        ("snr", snr_b),
        ("ess", ess_b),
    ):
        out[f"{key}_lo"], out[f"{key}_hi"] = pct(values)
    valid = c[m]
    out["khat"] = _experiment.khat_of_weights(valid) if valid.size else math.nan
    out["bias_sq"] = bias_sq
    out["bias_sq_se"] = stats["bias_sq_se"]
    out["ref_variance"] = stats["ref_variance"]
    out.update(scale_free_statistics(g, u, level=level, boot_weights=boot_weights, cache=cache))
    out.update(kept_statistics(coefficients, mask, level=level, boot_weights=Wg))
    out.update(draw_reliability(g, u, coefficients, mask))
    return out


def draw_reliability(gradients, reference_samples, coefficients, mask) -> dict:
    """``reliable`` and ``tail_draws`` of a Monte Carlo LM row: the rule of
    :mod:`simkit.reliability` on the draws.

    Checks 1 and 2 (:func:`simkit.reliability.draw_checks`) on x_r = ‖ĝ_r − ḡ‖² and
    x_r = ‖ĝ_r − ∇̂J‖² (∇̂J the on-policy reference: the LM has no exact ∇J). Check 3 needs
    E_μ c̄² and E_μ c̄⁴ of one sample's coefficient c̄ = Σ_t |c_t| (scale-free: the aggregation's
    1/Z cancels in the ratio), unknown on an LM: they are replaced by their means over the
    N = R·n drawn responses, ν̂ = N·(mean c̄²)²/mean c̄⁴ — the share of Σ c̄⁴ one draw carries
    is ≥ 1/ν̂, so a single dominating response fails the check; a tail never drawn is not seen
    (the caveat of :mod:`simkit.reliability`). ``tail_draws`` = ν̂ (NaN when every c̄ is 0).
    """
    from simkit.reliability import draw_checks, is_reliable

    g = np.asarray(gradients, dtype=np.float64)
    ref = np.asarray(reference_samples, dtype=np.float64).mean(0)
    mean = g.mean(0)
    khat, share = draw_checks(np.sum((g - mean) ** 2, axis=1), np.sum((g - ref) ** 2, axis=1))
    cbar = (np.abs(np.asarray(coefficients, dtype=np.float64)) * np.asarray(mask, bool)).sum(-1)
    cbar = cbar.ravel()
    m2, m4 = float(np.mean(cbar**2)), float(np.mean(cbar**4))
    nu = cbar.size * m2**2 / m4 if m4 > 0 else math.nan
    return {"reliable": is_reliable(khat, share, nu), "tail_draws": nu}


# --- scale-free error and kept fractions on Monte Carlo draws --------------------------------


def _distinct_pair_inner_sq(A: np.ndarray, c: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Σ over distinct positions p ≠ p′ (batches) and q ≠ q′ (reference draws) of
    A[p, q]·A[p′, q′], for the resamples whose multiplicities are ``c`` (B, R) and ``d`` (B, M)
    (all ones: the sample itself). (B,)."""
    Ad = d @ A.T  # (B, R): Σ_q d_q A[r, q]
    cA = c @ A  # (B, M): Σ_p c_p A[p, j]
    total = np.sum(c * Ad, axis=1)
    rows = np.sum(c * Ad**2, axis=1)
    cols = np.sum(d * cA**2, axis=1)
    diag = np.sum(c * (d @ (A * A).T), axis=1)
    return total**2 - rows - cols + diag


def _distinct_pair_norm_sq(K: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Σ over distinct positions q ≠ q′ of K[q, q′] = ⟨u_q, u_q′⟩, multiplicities ``d``
    (B, M). (B,)."""
    return np.sum((d @ K) * d, axis=1) - d @ np.diag(K)


def scale_free_statistics(
    gradients,
    reference_samples,
    level: float = 0.95,
    boot_weights: tuple[np.ndarray, np.ndarray] | None = None,
    n_boot: int = 200,
    rng: np.random.Generator | None = None,
    cache: dict | None = None,
) -> dict[str, float]:
    """The scale-free error (:func:`simkit.experiment.metrics.scale_free`) from Monte Carlo
    draws, with the noise of both means removed.

    ``gradients`` (R, D): ĝ_r of R independent batches; ``reference_samples`` (M, D): i.i.d.
    unbiased single-sample estimates u_j of ∇J (independent of the batches). With
    A_{rj} = ⟨ĝ_r, u_j⟩ (independent factors: E A_{rj}A_{r′j′} = ⟨E ĝ, ∇J⟩² for r ≠ r′, j ≠ j′),
    every moment is estimated without bias by a U-statistic over distinct indices:

        ⟨E ĝ, ∇J⟩   ≈ mean_{r,j} A_{rj}
        ⟨E ĝ, ∇J⟩²  ≈ Σ_{r≠r′} Σ_{j≠j′} A_{rj} A_{r′j′} / (R(R−1) M(M−1))
                     (the plug-in ⟨ḡ, ∇̂J⟩² exceeds it by Var⟨ĝ, ·⟩/R-type terms:
                      E⟨ḡ, ∇J⟩² = ⟨E ĝ, ∇J⟩² + Var⟨ĝ, ∇J⟩/R)
        E‖ĝ‖²       ≈ mean_r ‖ĝ_r‖²
        ‖∇J‖²       ≈ Σ_{j≠j′} ⟨u_j, u_j′⟩ / (M(M−1)) = ‖∇̂J‖² − tr Σ̂_u/M

    and ``mse_zero``, ``alpha_star`` = ⟨E ĝ, ∇J⟩/E‖ĝ‖², ``mse_scaled`` = ‖∇J‖² −
    ⟨E ĝ, ∇J⟩²/E‖ĝ‖² (clipped to [0, mse_zero]) and ``rel_mse_scaled`` = mse_scaled/mse_zero
    are ratios of these unbiased pieces (consistent; NaN when the estimated ‖∇J‖² ≤ 0).
    ``mse_scaled_lo``/``_hi`` and ``rel_mse_scaled_lo``/``_hi``: percentile bootstrap at
    ``level`` resampling the batches and the reference draws independently (``boot_weights``
    = (W_g (B, R), W_u (B, M)) resampling weights that sum to 1 per row, shared with
    :func:`gradient_metrics`; the same U-statistics on each resample, over distinct positions
    of the resampled lists). ``cache``: as in :func:`gradient_metrics` (needs ``boot_weights``).
    """
    g = np.asarray(gradients, dtype=np.float64)
    u = np.asarray(reference_samples, dtype=np.float64)
    if g.ndim != 2 or u.ndim != 2 or g.shape[1] != u.shape[1]:
        raise ValueError(
            f"gradients (R, D) and reference_samples (M, D) must share D, got {g.shape} and "
            f"{u.shape}"
        )
    R, M = g.shape[0], u.shape[0]
    if R < 2 or M < 2:
        raise ValueError(f"need at least 2 batches and 2 reference samples, got {R} and {M}")
    if boot_weights is None:
        if cache is not None:
            raise ValueError("cache needs boot_weights (its terms depend on the resamples)")
        rng = np.random.default_rng(0) if rng is None else rng
        boot_weights = (_resample_weights(R, n_boot, rng), _resample_weights(M, n_boot, rng))
    A = g @ u.T
    sq = np.sum(g * g, axis=1)
    c = np.vstack([np.ones(R), boot_weights[0] * R])  # multiplicities; row 0 = the sample
    d = np.vstack([np.ones(M), boot_weights[1] * M])
    norm_rm = R * (R - 1) * M * (M - 1)
    inner = (c @ A * d).sum(axis=1) / (R * M)
    inner_sq = _distinct_pair_inner_sq(A, c, d) / norm_rm
    second = c @ sq / R
    zero = _reference_term(cache, "zero", lambda: _distinct_pair_norm_sq(u @ u.T, d))
    zero = zero / (M * (M - 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(second > 0, zero - inner_sq / second, zero)
        scaled = np.minimum(np.maximum(scaled, 0.0), np.maximum(zero, 0.0))
        rel = np.where(zero > 0, scaled / zero, np.nan)
        alpha = np.where(second > 0, inner[0] / second, 0.0)
    tail = (1.0 - level) / 2.0

    def pct(x):
        x = x[np.isfinite(x)]
        if not x.size:
            return math.nan, math.nan
        lo, hi = np.quantile(x, [tail, 1.0 - tail])
        return float(lo), float(hi)

    out = {
        "mse_zero": float(zero[0]),
        "alpha_star": float(alpha[0]),
        "mse_scaled": float(scaled[0]),
        "rel_mse_scaled": float(rel[0]),
    }
    out["mse_scaled_lo"], out["mse_scaled_hi"] = pct(scaled[1:])
    out["rel_mse_scaled_lo"], out["rel_mse_scaled_hi"] = pct(rel[1:])
    return out


def kept_statistics(
    coefficients, mask, level: float = 0.95, boot_weights: np.ndarray | None = None
) -> dict[str, float]:
    """``kept`` and ``kept_seq`` (:func:`simkit.experiment.metrics.kept_fractions`) of Monte
    Carlo batches, with percentile bootstrap bounds over the batches.

    ``coefficients``, ``mask`` (R, n, T): the mapping's c on R batches of n responses and the
    valid tokens. ``kept`` = Σ #{valid t: c_t ≠ 0} / Σ #{valid t} over every drawn response,
    ``kept_seq`` = the share of responses with a non-zero valid coefficient. ``boot_weights``
    (B, R): resampling weights of the batches (None: no bounds, NaN).
    """
    c = np.asarray(coefficients)
    m = np.asarray(mask, dtype=bool)
    if c.shape != m.shape or c.ndim != 3:
        raise ValueError(
            f"coefficients and mask must have the same shape (R, n, T), got {c.shape} and {m.shape}"
        )
    nz = (c != 0) & m
    kept_r = nz.sum(axis=(1, 2)).astype(np.float64)
    valid_r = m.sum(axis=(1, 2)).astype(np.float64)
    seq_r = nz.any(axis=2).mean(axis=1)
    out = kept_fractions(c.reshape(-1, c.shape[-1]), m.reshape(-1, m.shape[-1]))
    out = {key: float(v) for key, v in out.items()}
    tail = (1.0 - level) / 2.0
    for key in ("kept", "kept_seq"):
        out[f"{key}_lo"] = out[f"{key}_hi"] = math.nan
    if boot_weights is not None:
        W = np.asarray(boot_weights, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            kept_b = (W @ kept_r) / (W @ valid_r)
        for key, values in (("kept", kept_b), ("kept_seq", W @ seq_r)):
            values = values[np.isfinite(values)]
            if values.size:
                lo, hi = np.quantile(values, [tail, 1.0 - tail])
                out[f"{key}_lo"], out[f"{key}_hi"] = float(lo), float(hi)
    return out
