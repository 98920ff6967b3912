"""The metrics of the torch losses (clip fraction, ESS, χ², KL estimators, log-ratio range),
from one host synchronisation; the list is in the docstring of :mod:`simkit.lm.losses`."""

from __future__ import annotations

import math

import numpy as np
import torch

from simkit.lm.losses.batch import _Batch, _Terms

METRICS = (
    "clip_frac",
    "ess",
    "chi2_tok",
    "chi2_seq",
    "kl_k1",
    "kl_k3",
    "kl_k1_seq",
    "kl_k3_seq",
    "log_ratio_mean",
    "log_ratio_abs_max",
)


def _extremes(x: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a tensor as Python floats (NaN if it holds a NaN; 0, 0 if empty)."""
    if x.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(x.detach())
    return tuple(torch.stack([lo, hi]).tolist())  # aminmax propagates NaN


def _metrics(b: _Batch, terms: _Terms) -> dict[str, float]:
    """Every metric of the module docstring, from one host synchronisation: the token sums
    and counts are reduced on the device, the sequence statistics (N values) on the host from
    log W (in the same transfer: fewer small device operations)."""
    with torch.no_grad():
        lr = b.log_ratio.detach()
        N = lr.shape[0]
        n_valid = max(lr.numel(), 1)
        # Σ(r² − 1) and Σ(r − 1 − log r) over valid tokens (padding: log r = 0 adds 0). Direct
        # sums of e = expm1(log r) when no e² can overflow the compute dtype (r² − 1 = e² + 2e),
        # else in float64 with Σr² in log space (reported inf only beyond the float64 range)
        limit = 0.5 * (math.log(torch.finfo(lr.dtype).max) - math.log(n_valid)) - 1.0
        direct = lr.numel() > 0 and b.lr_max <= limit
        if lr.numel() == 0:
            stats = [lr.new_zeros(()), lr.new_zeros(()), lr.new_zeros(())]
        elif direct:
            # Σ(r² − 1) = Σe² + 2Σe and Σ(r − 1 − log r) = Σ(e − log r), e = expm1(log r):
            # each term accurate (the kernel may have taken them already: clip_cov)
            stats = list(b.expm1_sums())
        else:
            lr64 = lr.to(torch.float64)
            shift = max(b.lr_max, 0.0)
            log_sum_r2 = torch.log(((lr64 - shift) * 2.0).exp_().mul_(b.maskf).sum()) + 2.0 * shift
            stats = [log_sum_r2, lr64.new_zeros(()), (torch.expm1(lr64) - lr64).sum()]
        n_clipped = terms.n_clipped() if terms.n_clipped is not None else lr.new_zeros(())
        stats += [n_clipped, b.lengths.sum()]
        extra = terms.extra or {}
        stats += [v.to(lr.device) for v in extra.values()]
        # one transfer; the float64 conversion once after stacking when the dtypes agree
        # (exact either way: fewer small device operations)
        parts = [*stats, b.log_w]
        if any(s.dtype != lr.dtype for s in parts):
            parts = [s.to(torch.float64) for s in parts]
        values = torch.cat([torch.stack(parts[:-1]), parts[-1]])
        values = values.to("cpu", torch.float64).numpy()
    tok_sq, tok_sum, sum_k3, clipped, n_tok = (float(v) for v in values[:5])
    n_extra = len(extra)
    log_w = values[5 + n_extra :]
    tok_a = tok_sq + 2.0 * tok_sum if direct else tok_sq
    sum_lr = float(log_w.sum())
    lse2_seq, lse_seq, sum_k3_seq = _sequence_stats(log_w)
    out = dict.fromkeys(METRICS, math.nan)
    if n_tok > 0:
        if direct:
            chi2_tok = tok_a / n_tok
        else:
            chi2_tok = _expm1(tok_a - math.log(n_tok))
        out.update(
            clip_frac=clipped / n_tok,
            chi2_tok=chi2_tok,
            kl_k1=-sum_lr / n_tok,
            kl_k3=sum_k3 / n_tok,
            log_ratio_mean=sum_lr / n_tok,
            log_ratio_abs_max=max(abs(b.lr_min), abs(b.lr_max)),
        )
    if N > 0:
        out.update(
            ess=_exp(2.0 * lse_seq - lse2_seq - math.log(N)),
            chi2_seq=_expm1(lse2_seq - math.log(N)),
            kl_k1_seq=-sum_lr / N,
            kl_k3_seq=sum_k3_seq / N,
        )
    out.update(zip(extra, (float(v) for v in values[5 : 5 + n_extra]), strict=True))
    return out


def _sequence_stats(log_w: np.ndarray) -> tuple[float, float, float]:
    """(log Σ W², log Σ W, Σ(W − 1 − log W)) of the rows' log W (float64, host), as
    ``torch.logsumexp`` (±inf kept) and expm1; zeros for no rows."""
    if log_w.size == 0:
        return 0.0, 0.0, 0.0
    with np.errstate(all="ignore"):
        return _logsumexp(2.0 * log_w), _logsumexp(log_w), float((np.expm1(log_w) - log_w).sum())


def _logsumexp(x: np.ndarray) -> float:
    # not scipy.special.logsumexp: ~65 µs a call against ~4.5 µs (64 values, this project's
    # CPU machine), twice per loss call of ~0.06 ms on a small batch
    m = float(x.max())
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.exp(x - m).sum()))


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _expm1(x: float) -> float:
    try:
        return math.expm1(x)
    except OverflowError:
        return math.inf
