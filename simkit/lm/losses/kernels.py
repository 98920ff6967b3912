"""The loss kernels, one per family of weight mappings: each ``kernel(mapping, batch) -> _Terms``
implements the coefficient of ``simkit.mappings.<family>`` in torch, from the notation page,
without calling the numpy implementation (the table of :mod:`simkit.lm.losses`). Kernels run
without autograd (the batch's log-ratio is detached): a surrogate kernel returns F and its
derivative c = ∂F/∂log r together, and :func:`~simkit.lm.losses.policy_loss` carries the
gradient through one :func:`~simkit.lm.losses.autograd.linearised_loss` step.

The module is not split: the kernels form one table (``_KERNELS``, at the end) over
private helpers that the families share (band flags, next-float bounds, sequence values per
token, the log-ratio penalty); moving the 2026 kernels (DRO, DPPO, rollout/segment IS, GEPO)
out would put those helpers in a third module that both import, for no reader's benefit."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from simkit.lm.losses.batch import _Batch, _Terms
from simkit.lm.losses.batch_weights import m2po_removed, psis_smooth
from simkit.lm.losses.selection import (
    flagged_counts,
    flagged_positions,
    nth_flagged,
    top_k_first,
)
from simkit.mappings.base import Mapping
from simkit.mappings.covariance import draw_subset
from simkit.mappings.truncation import BATCH_NORM_EPS


def _log(x: float) -> float:
    """log x with log 0 = −inf (and a negative bound below every ratio: −inf)."""
    return math.log(x) if x > 0 else -math.inf


def _sequence_value_per_token(
    log_value: torch.Tensor, log_ratio: torch.Tensor, gate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F, c) of F_t = exp(sg(log_value_i) + g_i·(log r_t − sg(log r_t))): the value
    exp(log_value_i) on every token of row i, derivative w.r.t. log r_t equal to g_i·value
    (verl's per-token form of a sequence ratio: only token t's own log-probability is
    differentiated). ``log_value``, ``gate`` (N,) (0/1), ``log_ratio`` (N, T); both results are
    (N, T) views of (N, 1) columns."""
    value = torch.exp(log_value)
    shape = log_ratio.shape
    return value[:, None].expand(shape), (value * gate)[:, None].expand(shape)


def _inside(clamped: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """1.0 where ``clamped`` == ``x`` (inside the band), 0.0 elsewhere, as a float tensor: an
    in-place comparison of the difference with 0 (a float difference is 0 exactly when the
    two are equal), which writes 1.0/0.0 into the float buffer — a bool comparison and its
    cast to float cost several float operations on CPU."""
    return (clamped - x).eq_(0.0)


def _row_bounds(b: _Batch, lo_pos, hi_pos, lo_neg, hi_neg) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row bounds (lo, hi) as (N, 1) tensors for the sign of A."""
    return b.per_row(lo_pos, lo_neg)[:, None], b.per_row(hi_pos, hi_neg)[:, None]


def _naive(m, b: _Batch) -> _Terms:
    return _Terms(seq=torch.ones_like(b.log_w))


def _is_token(m, b: _Batch) -> _Terms:
    r = b.ratio_value(b.log_ratio, m.max_log_ratio)  # capped: derivative = the capped value
    return _Terms(tok=r, dtok=r)


def _is_seq(m, b: _Batch) -> _Terms:
    return _Terms(seq=torch.exp(torch.clamp(b.log_w, max=m.max_log_ratio)))


def _power(m, b: _Batch) -> _Terms:
    return _Terms(seq=torch.exp(m.alpha * torch.clamp(b.log_w, max=m.max_log_ratio)))


def _snis(m, b: _Batch) -> _Terms:
    N = b.log_w.shape[0]
    return _Terms(seq=N * torch.softmax(b.log_w, dim=0))


def _psis(m, b: _Batch) -> _Terms:
    N = b.log_w.shape[0]
    if N == 0:
        return _Terms(seq=b.log_w.clone(), extra={"khat": torch.tensor(math.nan)})
    log_smooth, khat = psis_smooth(b.log_w)
    c = (N * torch.exp(log_smooth)).to(b.log_w.dtype)
    return _Terms(seq=c, extra={"khat": torch.tensor(khat, dtype=torch.float64)})


def _soft_shrink(m, b: _Batch) -> _Terms:
    lam = m.lam
    if lam == 1:
        return _Terms(seq=torch.ones_like(b.log_w))
    log_w = torch.clamp(b.log_w, max=m.max_log_ratio)
    e = torch.exp(-log_w.abs())  # in [0, 1]: no overflow on either side
    above = 1.0 / (lam + (1.0 - lam) * e)  # W >= 1: W/(1−λ+λW) = 1/(λ + (1−λ)/W)
    below = e / (lam * e + (1.0 - lam))  # W < 1
    return _Terms(seq=torch.where(log_w >= 0, above, below))


def _clip_band(m, b: _Batch, buffers=(None, None), ratio=None) -> _Terms:
    """PPO / dual clip / DAPO: F = clamp(r, lo, hi) with lo = 0 (none), hi = 1+ε_high for A >= 0
    and lo = 1−ε_low, hi = c_dual (∞ without dual clip) for A < 0 — PPO's min(rA, clip(r)A)
    (and dual clip's max(·, c_dual·A) for A < 0). ∂F/∂log r = r inside [lo, hi], 0 outside.
    ``buffers``: two free (N, T) buffers of the compute dtype to hold c and F (optional);
    ``ratio``: r (capped) already computed, in ``buffers[0]`` (optional)."""
    c_dual = getattr(m, "c_dual", math.inf)
    lo, hi = _row_bounds(b, -math.inf, 1.0 + m.eps_high, 1.0 - m.eps_low, c_dual)
    if ratio is None:
        r = b.ratio_value(b.log_ratio, m.max_log_ratio, out=buffers[0])
    else:
        r = ratio
    # then max with lo: clamp(r, lo, hi) for lo <= hi, faster
    F = torch.minimum(r, hi, out=buffers[1])
    F = torch.maximum(F, lo, out=F)
    inside = r.sub_(F).eq_(0.0)  # in r's buffer (as _inside): r − F = 0 exactly where F = r
    finite_highs = [h for h in (1.0 + m.eps_high, c_dual) if math.isfinite(h)]
    if b.lr_max > m.max_log_ratio and any(math.log(h) > m.max_log_ratio for h in finite_highs):
        # a capped r = e^cap can sit inside the band while log r is above it: the band is
        # decided on the log-ratio itself, as in simkit.mappings (only for tiny caps)
        log_hi = b.per_row(math.log1p(m.eps_high), _log(c_dual))[:, None]
        above = b.log_ratio > log_hi
        F = torch.where(above, hi, F)
        inside = inside.masked_fill_(above, 0.0)
    # lo <= 1 <= hi: a padded position (r = 1) is never flagged. The count is taken now (one
    # sum), then c = F·inside (= r·inside: F = r inside the band) in the same buffer: two
    # (N, T) buffers for F and c instead of three (fresh memory costs page faults); the loss
    # may overwrite c (scratch)
    n_outside = b.count_outside(inside)
    return _Terms(tok=F, dtok=inside.mul_(F), n_clipped=lambda: n_outside, scratch=True)


def _gspo(m, b: _Batch) -> _Terms:
    """GSPO: F_t = clip(s_t) with s_t = exp(sg(log s) + log r_t − sg(log r_t)) (verl's
    ``compute_policy_loss_gspo``, TRL's importance_sampling_level="sequence")."""
    log_s = torch.clamp(b.log_s, max=m.max_log_ratio)
    lo = b.per_row(-math.inf, _log(1.0 - m.eps_low))
    cap = m.grad_log_cap  # verl's clamp(log s, max=10): zero gradient above (preset "verl")
    hi = b.per_row(min(math.log1p(m.eps_high), cap), cap)
    in_band = (b.log_s >= lo) & (b.log_s <= hi)
    # outside the band F is the clipped value (constant); 1 − ε_low <= 0 never clips
    bound = b.per_row(1.0 + m.eps_high, max(1.0 - m.eps_low, 1e-30))
    log_value = torch.where(in_band, log_s, torch.log(bound))
    F, c = _sequence_value_per_token(log_value, b.log_ratio, in_band.to(b.log_w.dtype))
    return _Terms(tok=F, dtok=c, n_clipped=lambda: b.count_rows(~in_band))


def _gmpo(m, b: _Batch) -> _Terms:
    """GMPO: log r_t clipped to [−ε_low, ∞) (A < 0) or (−∞, ε_high] (A >= 0); R = exp(mean of
    the clipped values); F_t = exp(sg(log R) + (ℓ_t − sg(ℓ_t))) with ℓ_t the clipped log-ratio,
    whose derivative is 1 where token t is not clipped: c_t = R·1[not clipped].

    One (N, T) buffer: the clipped log-ratios, their row sums taken, then in place the flag
    1.0/0.0 of "not clipped" by a float ``eq_`` (as :func:`_clip_band`), its count taken at
    once, and c = flag·R."""
    lo, hi = _row_bounds(b, -math.inf, m.eps_high, -m.eps_low, math.inf)
    with torch.no_grad():
        lr = b.log_ratio.detach()
        clipped_lr = torch.maximum(torch.minimum(lr, hi), lo)  # padding: 0 stays 0
        log_R = clipped_lr.sum(dim=1) / b.lengths.clamp(min=1)
        R = torch.exp(torch.clamp(log_R, max=m.max_log_ratio))[:, None]
        inside = clipped_lr.sub_(lr).eq_(0.0)  # 1.0 where not clipped (padding included)
        n_clipped = b.count_outside(inside)
    return _Terms(
        tok=R.expand(lr.shape), dtok=inside.mul_(R), n_clipped=lambda: n_clipped, scratch=True
    )


def _sapo(m, b: _Batch) -> _Terms:
    """SAPO: F = (4/τ)·σ(τ(r − 1)), τ = τ_pos (A >= 0) or τ_neg (A < 0)."""
    tau = b.per_row(m.tau_pos, m.tau_neg)[:, None]

    def value_and_derivative(lr):
        # c = r·F'(r) = 4r·σ(x)·σ(−x), x = τ(r − 1): both sigmoids are accurate in their tails,
        # where σ(x)·(1 − σ(x)) would lose every digit of 1 − σ
        r = b.ratio_value(lr, m.max_log_ratio)
        x = (r - 1.0).mul_(tau)
        s = torch.sigmoid(x)
        c = x.neg_().sigmoid_().mul_(s).mul_(r).mul_(4.0)  # in x's buffer (three in all)
        return s.mul_(4.0 / tau), c

    F, c = value_and_derivative(b.log_ratio)
    return _Terms(tok=F, dtok=c, scratch=True)  # c: fresh, the loss may scale it in place


def _luffy(m, b: _Batch) -> _Terms:
    """LUFFY: F = κ·r/(r + γ), written κ·(1 − γ/(r + γ)) so that F' = κγ/(r+γ)² has no
    cancellation; κ = (1+γ)²/γ with ``normalize`` (c(1) = 1), else 1."""
    gamma = m.gamma
    scale = (1.0 + gamma) ** 2 / gamma if m.normalize else 1.0

    def value_and_derivative(lr):
        r = b.ratio_value(lr, m.max_log_ratio)
        d = r + gamma
        q = r / d  # r/(r + γ) in [0, 1)
        c = (q / d).mul_(scale * gamma)  # κγr/(r + γ)²
        return q.mul_(scale), c

    F, c = value_and_derivative(b.log_ratio)
    return _Terms(tok=F, dtok=c)


def _aspo(m, b: _Batch) -> _Terms:
    """ASPO: ρ_t = exp(sg(log w_t) + ℓ_t − sg(ℓ_t)) with w_t = min(1/r_t, c_dual) (A >= 0, the
    flipped ratio π_old·π/sg(π²), soft-clipped) or min(r_t, c_dual) (A < 0), and ℓ_t the log-ratio
    clamped to the PPO band [log(1−ε_low), log c_dual] (A < 0) or (−∞, log(1+ε_high)] (A >= 0):
    the gradient w_t·1[inside the band].

    Two (N, T) buffers, written in place (issue 28: 3.1–3.5× the bare ratio expression with
    seven fresh buffers, one thread): the band flag 1.0/0.0 by an in-place float ``eq_`` of the
    clamped log-ratio with the log-ratio (equal exactly inside the band; the log-ratio is
    finite), its clipped count taken at once, then c = flag·w in the flag's buffer."""
    lr = b.log_ratio
    log_cap = math.log(m.c_dual)
    sign = b.per_row(-1.0, 1.0)[:, None]
    lo, hi = _row_bounds(b, -math.inf, math.log1p(m.eps_high), _log(1.0 - m.eps_low), log_cap)
    inside = torch.minimum(lr, hi)
    inside = torch.maximum(inside, lo, out=inside).eq_(lr)
    weight = torch.mul(lr, sign).clamp_(max=log_cap).exp_()
    # clipped: outside the band, or (A >= 0) a flipped weight at the cap; the union counted
    # as outside + (capped ∧ inside), both exact
    n_outside = b.count_outside(inside)
    if -b.lr_min > log_cap:  # some flipped weight may reach the cap
        capped = b.positive[:, None] & (-lr > log_cap)
        n_outside = n_outside + b.count_flags(capped & (inside != 0))
    return _Terms(tok=weight, dtok=inside.mul_(weight), n_clipped=lambda: n_outside, scratch=True)


def _clamped_ratio(b: _Batch, low: float, high: float, max_log_ratio: float) -> _Terms:
    """c_t = clip(r_t, low, high) as exp(clip(log r_t, log low, min(log high, cap)))."""
    lr = b.log_ratio
    lo, hi = _log(low), _log(high)
    if lo <= b.lr_min and hi >= b.lr_max:  # nothing to clip
        return _Terms(tok=torch.exp(torch.clamp(lr, max=max_log_ratio)), n_clipped=None)
    clipped_lr = torch.clamp(lr, lo, hi)
    c = torch.exp(clipped_lr if hi <= max_log_ratio else torch.clamp(clipped_lr, max=max_log_ratio))
    # low <= 1 <= high: a padded position (log r = 0) is never flagged
    return _Terms(tok=c, n_clipped=lambda: b.count_flags(clipped_lr != lr))


def _cispo(m, b: _Batch) -> _Terms:
    return _clamped_ratio(b, max(1.0 - m.eps_low, 0.0), 1.0 + m.eps_high, m.max_log_ratio)


def _tis_token(m, b: _Batch) -> _Terms:
    return _clamped_ratio(b, m.c_low, m.c_high, m.max_log_ratio)


def _tis_seq(m, b: _Batch) -> _Terms:
    cap = min(_log(m.c), m.max_log_ratio)
    c = torch.exp(torch.clamp(b.log_w, max=cap))
    return _Terms(seq=c, n_clipped=lambda: b.count_rows(b.log_w > _log(m.c)))


def _mis_token(m, b: _Batch) -> _Terms:
    lr = b.log_ratio
    lo, hi = _log(m.c_low), _log(m.c_high)
    r = torch.exp(torch.clamp(lr, max=min(hi, m.max_log_ratio)))
    if lo > b.lr_min and hi < b.lr_max:
        dropped = (lr < lo) | (lr > hi)
    elif lo > b.lr_min:
        dropped = lr < lo
    elif hi < b.lr_max:
        dropped = lr > hi
    else:  # every log-ratio is inside the band
        return _Terms(tok=r, n_clipped=None)
    # c_low <= 1 <= c_high: a padded position (log r = 0) is never dropped
    kept = torch.logical_not(dropped).view(torch.uint8).to(r.dtype)
    return _Terms(tok=r * kept, n_clipped=lambda: b.count_flags(dropped))


def _mis_seq(m, b: _Batch) -> _Terms:
    keep = (b.log_w >= _log(m.c_low)) & (b.log_w <= _log(m.c_high))
    w = torch.exp(torch.clamp(b.log_w, max=m.max_log_ratio))
    return _Terms(seq=torch.where(keep, w, 0.0), n_clipped=lambda: b.count_rows(~keep))


def _geo_mask(m, b: _Batch) -> _Terms:
    keep = (b.log_s >= math.log(m.c_low)) & (b.log_s <= _log(m.c_high))
    keepf = keep.to(b.log_w.dtype)
    if m.base == "one":
        return _Terms(seq=keepf, n_clipped=lambda: b.count_rows(~keep))
    lr = b.log_ratio
    c = torch.exp(torch.clamp(lr, max=min(_log(m.tis_c), m.max_log_ratio))) * keepf[:, None]

    def n_clipped():
        truncated = keep[:, None] & (lr > _log(m.tis_c))  # tis_c >= 1: never on padding
        return b.count_rows(~keep) + b.count_flags(truncated)

    return _Terms(tok=c, n_clipped=n_clipped)


def _opsm(m, b: _Batch) -> _Terms:
    dropped = (b.log_s < -m.delta) & ~b.positive
    return _Terms(seq=(~dropped).to(b.log_w.dtype), n_clipped=lambda: b.count_rows(dropped))


def _token_veto(m, b: _Batch) -> _Terms:
    # padding holds log r = 0 and log τ <= 0, so the row minimum including padding is below
    # log τ exactly when the minimum over the valid tokens is (an empty row is never vetoed)
    if b.log_ratio.shape[1]:
        vetoed = b.log_ratio.amin(dim=1) < _log(m.tau)
    else:
        vetoed = torch.zeros_like(b.positive)
    return _Terms(seq=(~vetoed).to(b.log_w.dtype), n_clipped=lambda: b.count_rows(vetoed))


def _m2po(m, b: _Batch) -> _Terms:
    bound = max(-b.lr_min, b.lr_max)
    removed = m2po_removed(b.log_ratio, b.mask, b.positive, m.tau, m.trust_region_only, bound)
    r = b.ratio_value(b.log_ratio, m.max_log_ratio)
    if removed is None:  # F = c = r: the loss reads F before it scales c in place
        return _Terms(tok=r, dtok=r, n_clipped=None, scratch=True)
    kept = torch.logical_not(removed).view(torch.uint8).to(r.dtype)
    F = r.mul_(kept)
    return _Terms(tok=F, dtok=F, n_clipped=lambda: b.count_flags(removed), scratch=True)


def _topr(m, b: _Batch) -> _Terms:
    w = torch.exp(torch.clamp(b.log_w, max=0.0))
    truncated = ~b.positive & (b.log_w > 0)
    return _Terms(seq=torch.where(b.positive, 1.0, w), n_clipped=lambda: b.count_rows(truncated))


def _vespo(m, b: _Batch) -> _Terms:
    cap_tok, cap_seq = m.max_log_ratio_tok, m.max_log_ratio_seq
    log_w = torch.clamp(b.log_ratio, -cap_tok, cap_tok).sum(dim=1)  # padding: clamp(0) = 0
    log_w = torch.clamp(log_w, m.min_log_ratio_seq, cap_seq)
    k = b.per_row(m.k_pos, m.k_neg)
    lam = b.per_row(m.lambda_pos, m.lambda_neg)
    phi = torch.exp(k * log_w + lam * (1.0 - torch.exp(log_w)))
    return _Terms(seq=torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def _kl_rs(m, b: _Batch) -> _Terms:
    """verl ``compute_rollout_rejection_mask`` (b178a3c): k2 = ½x², k3 = e^x − 1 − x of
    x = clamp(log r, ±cap), per token or summed / averaged / maximised over the row; AND."""
    with torch.no_grad():
        x = b.log_ratio  # (detached: kernels run without autograd)
        if b.lr_min < -m.max_log_ratio or b.lr_max > m.max_log_ratio:
            x = torch.clamp(x, -m.max_log_ratio, m.max_log_ratio)
        terms = {}
        keep = b.mask.clone() if any(crit.startswith("token_") for crit, _ in m.rules) else None
        row_ok = torch.ones_like(b.positive)
        for crit, u in m.rules:
            kind = crit[-2:]
            if kind not in terms:  # padding: x = 0 ⇒ k = 0
                if kind == "k2":
                    terms[kind] = 0.5 * x * x
                else:  # the batch's shared k3 unless the clamp above changed x
                    terms[kind] = b.k3() if x is b.log_ratio else torch.expm1(x) - x
            k = terms[kind]
            if crit.startswith("token_"):
                keep &= k <= u
                continue
            if crit.startswith("seq_max"):  # k >= 0 and 0 on padding: an empty row gives 0
                stat = k.amax(dim=1) if k.shape[1] else torch.zeros_like(b.log_w)
            else:
                stat = k.sum(dim=1)
                if crit.startswith("seq_mean"):
                    stat = stat / b.lengths.clamp(min=1)
            row_ok &= stat <= u
        if keep is None:
            # sequence criteria only: c = 1[row kept] per row (the same token weights as the
            # (N, T) flags: 1·w or 0·w on valid tokens, 0 on padding)
            return _Terms(seq=row_ok.to(b.log_w.dtype), n_clipped=lambda: b.count_rows(~row_ok))
        keep &= row_ok[:, None]
    rejected = b.mask & ~keep
    return _Terms(tok=keep.to(b.log_w.dtype), n_clipped=lambda: b.count_flags(rejected))


def _tis_token_normalised(m, b: _Batch) -> _Terms:
    terms = _clamped_ratio(b, m.c_low, m.c_high, m.max_log_ratio)
    if not m.batch_normalize:
        return terms
    n = b.lengths.sum()
    mean = (terms.tok * b.maskf).sum() / n.clamp(min=1)
    scale = torch.where(mean > BATCH_NORM_EPS, mean, torch.ones_like(mean))
    return _Terms(tok=terms.tok / scale, n_clipped=terms.n_clipped)


def _tis_seq_normalised(m, b: _Batch) -> _Terms:
    terms = _tis_seq(m, b)
    if not m.batch_normalize:
        return terms
    nonempty = (b.lengths > 0).to(b.log_w.dtype)
    mean = (terms.seq * nonempty).sum() / nonempty.sum().clamp(min=1)
    scale = torch.where(mean > BATCH_NORM_EPS, mean, torch.ones_like(mean))
    return _Terms(seq=terms.seq / scale, n_clipped=terms.n_clipped)


def _covariance(b: _Batch) -> torch.Tensor:
    """verl's cov_all = (A − mean A)(log π − mean log π), means over valid tokens (detached);
    −inf on padding. A fresh tensor (callers may overwrite it)."""
    with torch.no_grad():
        n = b.lengths.sum().clamp(min=1)
        mean_a = (b.adv * b.lengths).sum() / n
        mean_lp = b.log_prob.sum() / n  # log_prob is 0 on padding
        cov = (b.log_prob - mean_lp).mul_((b.adv - mean_a)[:, None])
        if b.full:
            return cov
        return cov.masked_fill_(~b.mask, -math.inf)


def _clip_cov(m, b: _Batch) -> _Terms:
    """verl ``compute_policy_loss_clip_cov`` (b178a3c): PPO's clipped surrogate; a random
    max(⌊ρ·#valid⌋, 1) of the unclipped tokens with lb < cov < ub are detached (F·0). The
    permutation is the numpy Generator's (``rng``), as :class:`simkit.mappings.ClipCov`: the
    draw picks ranks in the row-major candidate list, located by
    :func:`~simkit.lm.losses.selection.nth_flagged` from per-block candidate counts."""
    with torch.no_grad():  # the selection first: its buffers are freed before PPO's
        cand, spare = _clip_cov_candidates(m, b)
        cand = cand.reshape(-1)
        counts, running = flagged_counts(cand)
        n_cand = int(running[-1]) if running.size else 0
        chosen = None
        if n_cand:
            n_valid = int(b.lengths.sum())
            picks = draw_subset(b.rng, n_cand, max(int(m.ratio * n_valid), 1))
            chosen = nth_flagged(cand, counts, running, picks)
    # PPO's c and F in the selection's two buffers: no fresh (N, T) memory (page faults).
    # Below the cap r = 1 + e, e = expm1(log r) in the spare buffer (r within an ulp of
    # exp(log r)): e also gives the metrics' token sums, taken now (e's buffer then holds F),
    # so that the metrics need neither their own expm1 pass nor (N, T) memory. Done whether
    # or not metrics are requested (the loss does not depend on them): an expm1, an addition
    # and three sums instead of an exp. Only without padding: with a ragged mask it measured
    # no faster with metrics and slower without (README, bench_lm_losses)
    cand = cand.view(spare.shape)
    r = None
    if b.full and b.lr_max <= m.max_log_ratio:
        r = torch.add(b.expm1(out=spare), 1.0, out=cand)
        b.expm1_sums()  # (overwrites e, in ``spare``)
    terms = _clip_band(m, b, (cand, spare), ratio=r)
    del r
    del cand, spare
    with torch.no_grad():
        F, dF = terms.tok, terms.dtok
        n_detached = 0
        if chosen is not None:
            F.view(-1).index_fill_(0, chosen, 0.0)  # both fresh tensors of _clip_band
            dF.view(-1).index_fill_(0, chosen, 0.0)
            n_detached = chosen.numel()

    band_clipped = terms.n_clipped  # (not ``terms``: the closure must not keep F and c alive)

    def n_clipped():  # the detached tokens are unclipped ones: the two counts add up
        return band_clipped() + n_detached

    return _Terms(tok=F, dtok=dF, n_clipped=n_clipped, scratch=True)


def _clip_cov_candidates(m, b: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates, spare): valid ∧ not clipped ∧ lb < cov < ub as (N, T) float 1.0/0.0, and
    the other (N, T) buffer used (free for the caller), by float arithmetic in two buffers and
    one in-place compare: clipped is s·log r > θ with s = sign A and
    θ = log(1 + ε_high) (A > 0), −log(1 − ε_low) (A < 0), +∞ (A = 0); s·log r ≤ θ ⇔
    s·log r − θ' < 0 with θ' the next float above θ, computed as s'·(log r − s'·θ') with
    s' = −1 (A < 0), +1 (A >= 0), and lb < cov < ub ⇔
    max(lb − cov, cov − ub) < 0 (the sign of a float difference is exact); padding has
    cov = −∞, so lb − cov = +∞ excludes it."""
    dtype = b.log_ratio.dtype
    hi = _next_up(math.log1p(m.eps_high), dtype)
    lo = _next_up(-_log(1.0 - m.eps_low), dtype)
    # s·log r − θ' = s·(log r − s·θ'): per row t = s·θ' (A > 0: θ'_high, A < 0: −θ'_low, A = 0:
    # s = 1, t = +∞, always unclipped); log r − t has the exact sign of the difference and the
    # product with s = ±1 is exact — a subtraction and a multiplication by a column are
    # faster than one addcmul of two columns on CPU (256×2048 float32, one thread, torch 2.13:
    # 0.08 vs 0.24 ms, best of 5, on a shared machine)
    t = torch.full_like(b.adv, math.inf).masked_fill_(b.adv > 0, hi).masked_fill_(b.adv < 0, -lo)
    s = torch.ones_like(b.adv).masked_fill_(b.adv < 0, -1.0)
    cov = _covariance(b)
    band = torch.rsub(cov, m.lb)  # lb − cov
    above = cov.sub_(m.ub)  # cov − ub, in cov's buffer
    band = torch.maximum(band, above, out=band)
    unclipped = torch.sub(b.log_ratio, t[:, None], out=above).mul_(s[:, None])
    return torch.maximum(band, unclipped, out=band).lt_(0.0), above


def _next_up(x: float, dtype: torch.dtype) -> float:
    """The next float of ``dtype`` (float32 or float64) above x rounded to ``dtype``."""
    if dtype == torch.float64:
        return math.nextafter(x, math.inf)
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def _next_down(x: float, dtype: torch.dtype) -> float:
    """The next float of ``dtype`` (float32 or float64) below x rounded to ``dtype``."""
    if dtype == torch.float64:
        return math.nextafter(x, -math.inf)
    return float(np.nextafter(np.float32(x), np.float32(-np.inf)))


def _kl_cov(m, b: _Batch) -> _Terms:
    """verl ``compute_policy_loss_kl_cov`` (b178a3c): −A·r everywhere, + κ·|log r| on the
    k = max(1, ⌊ρ·#valid⌋) valid tokens of largest covariance (ties: first in row-major order,
    :func:`~simkit.lm.losses.selection.top_k_first`). The penalty is sparse: its values and
    derivatives on the k selected tokens (``penalty_index``)."""
    cov = _covariance(b)  # −inf on padding: never among the k <= #valid largest
    with torch.no_grad():
        n_valid = int(b.lengths.sum())
        chosen = torch.zeros(0, dtype=torch.int64, device=cov.device)
        if n_valid:
            k = max(1, int(n_valid * m.ratio))
            chosen = top_k_first(cov.reshape(-1), k)
    lr = b.log_ratio
    lr_chosen = lr.reshape(-1)[chosen]
    penalty = dpenalty = index = None
    if m.kappa > 0:  # κ·|log r| on the selected tokens; derivative κ·sign(log r) (0 at 0)
        index = chosen
        penalty = lr_chosen.abs() * m.kappa
        dpenalty = lr_chosen.sign() * m.kappa
    r = b.ratio_value(lr, m.max_log_ratio, out=cov)  # cov's buffer: no fresh (N, T) memory
    del cov
    # clipped: penalised tokens where the penalty acts (log r ≠ 0; on-policy it is 0)
    return _Terms(
        tok=r,
        dtok=r,
        n_clipped=lambda: torch.count_nonzero(lr_chosen),
        penalty=penalty,
        dpenalty=dpenalty,
        penalty_index=index,
        scratch=True,
    )


def _log_ratio_penalty(m, b: _Batch, terms: _Terms) -> _Terms:
    """``terms`` plus the dense penalty β/2·(log r_t)² (derivative β·log r_t) on every position
    (0 on padding, where log r = 0): DRO, and DPPO with ``beta`` > 0 (prime-rl's kl_tau). Dense:
    (N, T) values without an index (the loss weights them by 1/Z_i of their row, as it would
    gather for an index of every position)."""
    if not m.beta > 0:
        return terms
    lr = b.log_ratio.detach()
    return _Terms(
        tok=terms.tok,
        dtok=terms.dtok,
        n_clipped=terms.n_clipped,
        penalty=(lr * lr).mul_(0.5 * m.beta),
        dpenalty=lr * m.beta,
        scratch=terms.scratch,
    )


def _dro(m, b: _Batch) -> _Terms:
    """verl ``compute_policy_loss_dro`` (1dda039): loss −(A·log π − β/2·(log r)²); here F = log r
    (c = 1, a broadcast one: the loss takes −w as the gradient; the value differs from verl's by
    −A·log μ, which has no gradient) plus the penalty."""
    lr = b.log_ratio.detach()
    one = torch.ones((), dtype=lr.dtype, device=lr.device).expand(lr.shape)
    return _log_ratio_penalty(m, b, _Terms(tok=lr, dtok=one, n_clipped=None))


def _dppo(m, b: _Batch) -> _Terms:
    """verl ``compute_policy_loss_dppo_tv`` / ``_kl`` (1dda039): c = min(exp(clip(log r, ±L)), C)
    on the tokens whose probability did not leave the trust region in the direction of A
    (:mod:`simkit.mappings.dppo`); F = c·log r (value up to −A·c·log μ, no gradient).

    The trust-region test (two exponentials, and for KL two expm1 and a log per token) is
    evaluated only on the tokens a bound cannot settle (:func:`_dppo_undecided`: typically well
    under 1 % of them), gathered; every other token is kept, which the formula gives as well.
    The formula on a gathered token is the same elementwise arithmetic: bit-identical."""
    with torch.no_grad():
        lr = b.log_ratio.detach()
        log_p = b.log_prob  # 0 on padding: p = q = 1 there, always kept
        L = float(m.max_log_ratio)
        r = torch.exp(lr if -L <= b.lr_min and b.lr_max <= L else torch.clamp(lr, -L, L))
        # (min with C: the identity when every r is below it, exp being within an ulp)
        if math.isfinite(m.c) and not math.exp(min(b.lr_max, L)) * (1.0 + 1e-6) <= m.c:
            r = r.clamp_(max=float(m.c))
        index = _dppo_undecided(m, b, lr, log_p)  # None: every token (the formula on all)
        if index is None:
            kept = _dppo_kept(m, log_p, lr, b.positive[:, None])
            dropped = b.mask & ~kept
            c = r.masked_fill_(~kept, 0.0)  # = where(kept, r, 0)
            n_dropped = None
        else:
            T = lr.shape[1]
            rows = torch.div(index, max(T, 1), rounding_mode="floor")
            kept = _dppo_kept(m, log_p.reshape(-1)[index], lr.reshape(-1)[index], b.positive[rows])
            drop = index[~kept if b.full else ~kept & b.mask.reshape(-1)[index]]
            c = r.view(-1).index_fill_(0, drop, 0.0).view(lr.shape)
            n_dropped = torch.tensor(drop.numel())
    n_clipped = (lambda: b.count_flags(dropped)) if n_dropped is None else (lambda: n_dropped)
    terms = _Terms(tok=c * lr, dtok=c, n_clipped=n_clipped, scratch=True)
    return _log_ratio_penalty(m, b, terms)


def _dppo_kept(m, log_p, lr, positive) -> torch.Tensor:
    """DPPO's kept flags (bool, the shape of ``log_p``) of :func:`simkit.mappings.dppo_coefficient`
    elementwise; ``positive`` (A >= 0) broadcastable."""
    log_q = log_p - lr
    p, q = torch.exp(log_p), torch.exp(log_q)
    if m.divergence == "tv":
        diff = p - q
        return torch.where(positive, diff <= m.eps_high, diff >= -m.eps_low)
    eps = float(m.kl_eps)
    first = torch.where(q > 0, q * (log_q - log_p), 0.0)
    arg = (-torch.expm1(log_q) + eps) / (-torch.expm1(log_p) + eps)
    # log of a negative argument (log π > 0 or log q > 0) is NaN; taken as NaN directly, since
    # the vectorised log is an order of magnitude slower on such arguments (the same flags)
    negative = arg < 0
    second = (1.0 - q) * torch.log(arg.masked_fill_(negative, 1.0)).masked_fill_(negative, math.nan)
    kl = first + second
    return torch.where(positive, (kl <= m.eps_high) | (p <= q), (kl <= m.eps_low) | (p >= q))


def _dppo_undecided(m, b: _Batch, lr: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor | None:
    """Flat positions (int64, increasing) of the tokens whose DPPO test a bound cannot settle;
    every other token is kept. None: no bound applies (the test runs on every token).

    With x = log r, a = log p and log q = fl(a − x) <= 0 (x >= a, exactly the sign of the
    rounded difference), so that q <= 1 and p = e^a <= e^x:

    - TV: |p − q| <= e^{|x|} − 1 (x >= 0: p(1 − e^{−x}) <= e^x − 1; x < 0: a <= x < 0, so
      q(1 − e^x) <= 1 − e^x); the computed difference (two exponentials within an ulp of
      values <= e^{|x|}, log q rounded) is within 10⁻⁶ of it, so |x| <= log(1 + θ) with
      θ = ε·(1 − 10⁻⁴) − 10⁻⁵ (ε the smaller band) keeps the token on either side: the token is
      decided when clamp(x, max(a, −log(1 + θ)), log(1 + θ)) = x;
    - KL (also a <= 0, p <= 1): KL(q‖p) <= χ² = p(e^{−x} − 1)²/(1 − p) <= x²·e^{2|x|}/(−a)
      (|e^{−x} − 1| <= |x|e^{|x|}, 1 − e^{a} >= −a·e^{a}); verl's ε in the log adds at most ε;
      the computed value is within 10⁻⁵ of it (a few roundings of terms below 1 in size, and
      log q rounded: a relative change of x below 10⁻³ where the test is tight and p, q do not
      underflow), so a + (K/θ)·x² <= 0 (which implies a <= 0) with K = e^{2 max|x|},
      θ = ε_band·(1 − 10⁻²) − ε − 10⁻⁵ keeps it (the rounding of this test is covered too).

    KL also settles the tokens on the side that keeps them whatever the divergence: p <= q
    for A >= 0, p >= q for A < 0 (s·x <= −δ, s = ±1 the sign, δ covering the roundings).

    Padding (x = a = 0) is always decided. None when the bounds do not apply: max|x| > 1,
    θ <= 0, or (KL) an ε that rounds to 0. The test is three or four passes over the batch;
    the undecided tokens are typically well under 1 % (2 % on the benchmark's batch, whose
    log π exceeds 0 on 2 % of the tokens)."""
    if lr.numel() == 0:
        return None
    band = min(float(m.eps_low), float(m.eps_high))
    big = max(-b.lr_min, b.lr_max)
    if big > 1.0:
        return None
    if m.divergence == "tv":
        theta = band * (1.0 - 1e-4) - 1e-5
        if not theta > 0:
            return None
        bound = math.log1p(theta)
        hi = torch.tensor(bound, dtype=lr.dtype, device=lr.device)
        lo = torch.clamp(log_p, min=-bound)
        # x − clamp(x, lo, hi): 0 exactly where the token is decided
        flags = torch.clamp(lr, lo, hi, out=lo).sub_(lr)
    else:
        eps = float(m.kl_eps)
        theta = band * (1.0 - 1e-2) - eps - 1e-5
        if not (theta > 0 and eps >= 1e-30 and math.isfinite(theta)):
            return None
        t = torch.addcmul(log_p, lr, lr, value=math.exp(2.0 * big) / theta)
        # the comparisons in numpy on CPU (a bool comparison in torch costs ~5 float passes);
        # the same expressions on tensors elsewhere
        cpu = lr.device.type == "cpu"
        t, a, x, negative = (v.numpy() if cpu else v for v in (t, log_p, lr, ~b.positive))
        undecided = t > 0  # the bound fails
        undecided |= a > x  # log q > 0
        # the kept side: p <= q (A >= 0) or p >= q (A < 0) keeps the token whatever KL is;
        # exp within an ulp (2⁻²³ relative for a normal result, log q rounded: 2⁻²⁴·|log q|)
        # orders p and q when s·x <= −δ, s = ±1 the sign of A (|log q| <= 105 while p or q is
        # normal; below, p and q are 0 or subnormal and KL ≈ 0 keeps the token)
        delta = 1e-5 if lr.dtype == torch.float32 else 1e-12
        other_side = x > -delta
        other_side[negative] = (x < delta)[negative]
        undecided &= other_side
        if cpu:
            return torch.from_numpy(np.flatnonzero(undecided))
        return torch.nonzero(undecided.reshape(-1)).reshape(-1)
    return flagged_positions(flags.reshape(-1))


def _luspo(m, b: _Batch) -> _Terms:
    """TRL ``loss_type="luspo"`` (f2cd577): GSPO's per-token F and c, times the row's length."""
    terms = _gspo(m.gspo, b)
    n = b.lengths[:, None]
    return _Terms(tok=terms.tok * n, dtok=terms.dtok * n, n_clipped=terms.n_clipped)


def _rollout_is(m, b: _Batch) -> _Terms:
    """SkyRL ``rollout_is_policy_loss``: c = exp(clip(log r, ±20))·1[1−ε_low < r < 1+ε_high].

    The open band on log r as torch compares with the bounds (rounded to the compute dtype, t):
    t_lo < log r < t_hi, i.e. the closed band [next_up(t_lo), next_down(t_hi)], as a 1.0/0.0
    float flag by one clamp and an in-place comparison (as :func:`_clip_band`; a bool
    comparison, its negation and cast cost several float passes), its dropped count taken at
    once, then c = r·flag in r's buffer; nothing to drop when [lr_min, lr_max] is inside."""
    lr = b.log_ratio
    lo, hi = m.bounds
    L = float(m.max_log_ratio)
    log_lo, log_hi = _log(lo), math.log(hi)
    low = _next_up(log_lo, lr.dtype)
    high = _next_down(log_hi, lr.dtype)
    r = torch.exp(lr if -L <= b.lr_min and b.lr_max <= L else torch.clamp(lr, -L, L))
    if low <= b.lr_min and b.lr_max <= high:
        return _Terms(tok=r, n_clipped=None)
    if low <= 0.0 <= high:  # padding (log r = 0) inside: the count of 0s is the valid count
        inside = torch.clamp(lr, low, high).sub_(lr).eq_(0.0)
        n_outside = b.count_outside(inside)
        return _Terms(tok=r.mul_(inside), n_clipped=lambda: n_outside)
    keep = (lr > log_lo) & (lr < log_hi)  # open band, on log r as simkit.mappings
    c = r * keep.to(lr.dtype)
    return _Terms(tok=c, n_clipped=lambda: b.count_flags(~keep & b.mask))


def _segment_is(m, b: _Batch) -> _Terms:
    """ROLL's segment IS weight: c_t = min(exp(mean log r over t's run of valid tokens), U).

    The segment sums are sequential sums in the compute dtype (``index_add_`` over the valid
    tokens in row-major order, the CPU kernel's order). On CPU, when every row holds at most
    one run (a full mask, or a prefix / any contiguous run of valid tokens per row: every
    single-turn batch), a segment is its row and the same sequential sums are the column-wise
    numpy reduction of the transposed log-ratios (one pass vectorised over the rows, the
    rows' padding adding exact zeros): bit-identical, ~0.5 ms instead of ~25 ms at 256×2048
    (issue 28), and c is one value per row (``seq``)."""
    cap = min(float(m.max_log_ratio), math.log(m.upper_bound))
    rows = _single_run_row_sums(b)
    if rows is not None:
        mean = rows / b.lengths.clamp(min=1)  # 0 for an empty row: c = 1 (unused)
        c = torch.exp(torch.clamp(mean, max=cap))
        capped = mean > math.log(m.upper_bound)
        return _Terms(seq=c, n_clipped=lambda: b.count_rows(capped))
    mask = b.mask
    prev = torch.zeros_like(mask)
    prev[:, 1:] = mask[:, :-1]
    starts = (mask & ~prev).reshape(-1)
    ids = torch.cumsum(starts.to(torch.int64), 0) - 1
    valid = mask.reshape(-1)
    n_seg = int(starts.sum())
    lr = b.log_ratio.reshape(-1)
    sums = torch.zeros(n_seg, dtype=lr.dtype, device=lr.device).index_add_(0, ids[valid], lr[valid])
    counts = torch.bincount(ids[valid], minlength=n_seg).to(lr.dtype)
    mean = torch.zeros_like(lr)
    mean[valid] = (sums / counts.clamp(min=1))[ids[valid]]
    c = torch.exp(torch.clamp(mean, max=cap)).reshape(mask.shape)
    capped = (mean > math.log(m.upper_bound)).reshape(mask.shape) & mask
    return _Terms(tok=c, n_clipped=lambda: b.count_flags(capped))


def _single_run_row_sums(b: _Batch) -> torch.Tensor | None:
    """Σ_t log r_t of every row (N,) as the sequential sum in row order (the order of
    ``index_add_`` on CPU), when the batch is on CPU and every row's valid tokens form at most
    one run; else None. The log-ratio is transposed to (T, N) and reduced over axis 0 by numpy,
    whose reduction over a non-contiguous axis adds the rows one after the other (vectorised
    over the columns, no pairwise regrouping); padded positions hold log r = ±0, which leave
    a sum unchanged up to the sign of a zero sum (whose mean gives c = exp(±0) = 1 either way)."""
    lr = b.log_ratio.detach()
    N, T = lr.shape
    if lr.device.type != "cpu" or N == 0 or T == 0:
        return None
    if not b.full:
        mask = b.mask
        # runs = rows starting valid + positions where a valid token follows a padded one
        runs = torch.count_nonzero(mask[:, 1:] > mask[:, :-1]) + torch.count_nonzero(mask[:, 0])
        if int(runs) > int(torch.count_nonzero(b.lengths)):
            return None
    columns = lr.t().contiguous().numpy()
    return torch.from_numpy(np.add.reduce(columns, axis=0))


def _gepo(m, b: _Batch) -> _Terms:
    """GEPO (arXiv 2508.17850): w_i = π(y_i)/(Σ_j μ_j²/Σ_j μ_j) per group, in log space."""
    log_pi = b.log_prob.sum(dim=1)  # log_prob is 0 on padding
    log_mu = log_pi - b.log_w
    N = log_pi.shape[0]
    G = N if m.group_size is None else int(m.group_size)
    if N == 0:
        return _Terms(seq=log_pi.clone())
    if N % G:
        raise ValueError(f"gepo: the batch size N = {N} is not divisible by group_size = {G}")
    lm = log_mu.reshape(N // G, G)
    log_e = torch.logsumexp(2.0 * lm, dim=1) - torch.logsumexp(lm, dim=1)
    log_w = log_pi - torch.repeat_interleave(log_e, G)
    return _Terms(seq=torch.exp(torch.clamp(log_w, max=m.max_log_ratio)))


_KERNELS: dict[str, Callable[[Mapping, _Batch], _Terms]] = {
    "naive": _naive,
    "is_token": _is_token,
    "is_seq": _is_seq,
    "power": _power,
    "snis": _snis,
    "psis": _psis,
    "soft_shrink": _soft_shrink,
    "ppo_clip": _clip_band,
    "dual_clip": _clip_band,
    "dapo": _clip_band,
    "gspo": _gspo,
    "gmpo": _gmpo,
    "sapo": _sapo,
    "luffy": _luffy,
    "aspo": _aspo,
    "cispo": _cispo,
    "tis_token": _tis_token_normalised,
    "tis_seq": _tis_seq_normalised,
    "mis_token": _mis_token,
    "mis_seq": _mis_seq,
    "icepop": _mis_token,
    "geo_mask": _geo_mask,
    "opsm": _opsm,
    "token_veto": _token_veto,
    "m2po": _m2po,
    "topr": _topr,
    "vespo": _vespo,
    "kl_rs": _kl_rs,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "dro": _dro,
    "dppo_tv": _dppo,
    "dppo_kl": _dppo,
    "luspo": _luspo,
    "rollout_is": _rollout_is,
    "segment_is": _segment_is,
    "gepo": _gepo,
}
