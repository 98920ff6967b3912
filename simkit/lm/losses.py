"""Torch policy losses for every weight mapping of the catalogue, in the form a trainer calls them.

    loss, metrics = policy_loss("ppo_clip", log_prob, old_log_prob, advantages, response_mask,
                                agg="token-mean", eps_high=0.28)
    loss.backward()

Every loss is built so that its gradient is the weighted policy gradient of the reference sheet
(``shared/reference/weight-mappings.md``)::

    ∂loss/∂log_prob[i, t] = −c[i, t] · A[i] / Z[i]        (0 on padded positions)

with ``c`` the effective coefficient of the mapping (the same numbers as
``simkit.mappings.get(name, **hp).coefficients(log_ratio, mask, advantages)``, implemented here
again, independently, in torch) and ``1/Z`` the aggregation weight of
``simkit.estimators.aggregation_weights`` (``agg``: token-mean, seq-mean-token-mean,
seq-mean-token-sum, seq-mean-token-sum-norm).

Two forms, following the reference implementations (verl, TRL, OpenRLHF, the papers):

- **surrogate** — ``loss = −Σ (A/Z)·F`` with the gradient flowing through the ratio
  r = exp(log π − log μ) (``c = r·F'(r)``);
- **detached** — ``loss = −Σ (A/Z)·sg(c)·log π`` (a weighted REINFORCE / SFT loss).

========== ========= ===========================================================================
mapping    form      F (surrogate) or c (detached); "clipped" tokens counted by ``clip_frac``
========== ========= ===========================================================================
naive      detached  c = 1 (REINFORCE); never clipped
is_token   surrogate F = r; never clipped
is_seq     detached  c = W = exp Σ_t log r_t; never clipped
power      detached  c = W^α; never clipped
snis       detached  c = N·W_i/Σ_j W_j; never clipped
psis       detached  c = N·(Pareto-smoothed normalised W); never clipped (``khat`` reported)
soft_shrink detached c = W/(1−λ+λW); never clipped
ppo_clip   surrogate F = clip(r, 1−ε_low, 1+ε_high) on the pessimistic side (= PPO's min form);
                     clipped: r outside the band for the sign of A (gradient 0)
dual_clip  surrogate as ppo_clip, A<0 band capped at c_dual (verl's clip_ratio_c)
dapo       surrogate as ppo_clip with ε_high = 0.28
gspo       surrogate F_t = clip(s_t) with s_t = exp(sg(log s) + log π_t − sg(log π_t)) (verl /
                     TRL "sequence" ratio, per-token gradient); clipped: rows outside the band
gmpo       surrogate F_t = exp(sg(log R) + u_t − sg(u_t)), u_t the log-ratio where it is not
                     clipped (0 where clipped), R = exp(mean clipped log r); clipped: clipped tokens
sapo       surrogate F = (4/τ)·σ(τ(r − 1)); never clipped
luffy      surrogate F = κ·(1 − γ/(r + γ)) (= κ·r/(r+γ)), κ = (1+γ)²/γ if normalize else 1;
                     never clipped
aspo       surrogate A≥0: flipped ratio sg(min(1/r, c_dual))·exp(log π − sg(log π)), A<0: dual-clip
                     PPO; clipped: out-of-band tokens and A≥0 tokens whose 1/r was capped
cispo      detached  c = clip(r, 1−ε_low, 1+ε_high); clipped: r outside the clamp
tis_token  detached  c = clip(r, c_low, c_high); clipped: r outside the clamp
tis_seq    detached  c = min(W, c); clipped: rows with W > c
mis_token  detached  c = r·1[c_low ≤ r ≤ c_high]; clipped: masked tokens
mis_seq    detached  c = W·1[c_low ≤ W ≤ c_high]; clipped: masked rows
icepop     detached  as mis_token
geo_mask   detached  c = 1[c_low ≤ s ≤ c_high]·(1 or min(r, tis_c)); clipped: rejected rows and
                     (base "tis") truncated tokens
opsm       detached  c = 0 for A<0 rows with mean log(μ/π) > δ, else 1; clipped: dropped rows
token_veto detached  c = 0 for rows with some r_t < τ, else 1; clipped: vetoed rows
m2po       surrogate F = r·M (M the M2PO keep mask, batch dependent); clipped: removed tokens
topr       detached  c = 1 (A≥0), min(W, 1) (A<0); clipped: A<0 rows with W > 1
vespo      detached  c = W^k·exp(λ(1 − W)); never clipped (it reshapes, it does not clip)
kl_rs      detached  c = 1[every k2/k3 criterion keeps the token]; clipped: rejected tokens
clip_cov   surrogate F = PPO clip × (1 − detached), ``detached`` the random covariance subset
                     (numpy Generator ``rng``); clipped: out-of-band and detached tokens
kl_cov     surrogate F = r, plus κ·|log r|/Z on the top-k covariance tokens (not ∝ A: the
                     gradient there is −(A·r − κ·sign log r)/Z); clipped: penalised, log r ≠ 0
========== ========= ===========================================================================

``tis_token`` / ``tis_seq`` with ``batch_normalize=True`` divide c by its batch mean (over valid
tokens / non-empty rows; not when the mean is ≤ 1e-8). ``clip_cov`` / ``kl_cov`` read the
advantage values and ``log_prob`` itself (the covariance (A − mean A)(log π − mean log π) over
valid tokens), as verl does; pass ``log_prob=`` to the numpy mapping to get the same numbers.

Composed losses (three policies, :mod:`simkit.composition`): ``policy_loss(name, log_prob,
old_log_prob, A, mask, correction="tis_token", rollout_log_prob=log_mu)`` puts the mapping on
log π − log π_old (``old_log_prob``) and multiplies every token weight by the detached
correction of log π_old − log μ (``mode="decoupled"``); ``mode="bypass"`` (old_log_prob = log μ,
both on π/μ) and ``mode="trl_vespo"`` (TRL's VESPO, the correction folded into W) as in
:class:`simkit.estimators.Estimator`.

(r token ratio, W = exp Σ_t log r_t the sequence ratio, s = exp(mean_t log r_t) the geometric
mean, all over the valid tokens of the row; a row without valid tokens has W = s = 1.)
Hyperparameters have the names, defaults, presets and validation of the numpy dataclasses of
:mod:`simkit.mappings` (``policy_loss`` builds ``simkit.mappings.get(name, preset, **hp)`` and
reads its fields); the clamps are theirs too. ``max_log_ratio`` caps the *value* of an
exponentiated log-ratio; as in :mod:`simkit.mappings` the coefficient above the cap is e^cap,
not 0 (the capped exponential passes its value as gradient); clip bands are decided on the
log-ratio itself, so a cap below a band's upper end does not bring a clipped token back.

How the gradient is carried. Most surrogates are plain autograd through r = exp(log π − log μ)
(with one custom step, :func:`band_clamp`, whose backward reuses the forward's outside-mask).
SAPO, LUFFY, GMPO and ASPO compute F and its derivative c = ∂F/∂log r together
(:func:`analytic_surrogate`): the backward is then one multiplication instead of the chain of
every elementary operation. Either way autograd's ∂loss/∂log_prob is −c·A/Z, and the tests
check the gradient against :mod:`simkit.mappings` and the surrogate values against the papers'
F (``mapping.f``).

Conventions and numerics
------------------------
- Shapes: ``log_prob``, ``old_log_prob``, ``response_mask`` (N, T); ``advantages`` (N,) — the
  sequence advantage — or (N, T) with one value per row over its valid tokens (verl's token-level
  layout; a row whose valid tokens carry different advantages is rejected, since every mapping
  reads one sign per sequence). ``A >= 0`` counts as positive, as in :mod:`simkit.mappings`.
- ``old_log_prob`` is log μ (behaviour) and is never differentiated.
- Computation in float32 (float64 when ``log_prob`` is float64), whatever the input dtype
  (bf16/fp16 inputs are upcast). The loss is returned in that dtype. Everything is in log space;
  exponentials are capped before they are taken.
- Padded positions contribute exactly nothing: log r = (log π − log μ)·mask when every
  difference is finite, else (±inf/NaN garbage on padding) with ``torch.where``, so that the
  garbage reaches neither the loss, nor the gradient, nor the metrics. A NaN log-ratio on a
  valid token is a ``ValueError``.
- One host synchronisation per call for the range of the log-ratios (it decides whether a cap
  can bind and whether the padding needs the select) and one more for the metrics.
- Device-agnostic: every tensor is created on the inputs' device.

Metrics
-------
``metrics`` is a dict of Python floats (one host synchronisation per call), NaN where a mean is
over nothing (no valid token): ``clip_frac`` (fraction of valid tokens clipped, zeroed or
truncated, per the table above), ``ess`` (normalised effective sample size (ΣW)²/(N·ΣW²) of the
sequence weights), ``chi2_tok`` / ``chi2_seq`` (Monte Carlo χ²(π‖μ): mean r² − 1 over valid
tokens / mean W² − 1 over rows), ``kl_k1`` / ``kl_k3`` and ``kl_k1_seq`` / ``kl_k3_seq`` (Schulman's
estimators of KL(μ‖π) from samples of μ, per token and per sequence: k1 = −log r,
k3 = (r − 1) − log r), ``log_ratio_mean`` and ``log_ratio_abs_max`` (mean and largest |log r|
over valid tokens) and, for ``psis``, ``khat`` (the Pareto tail shape of the batch's W). Token
sums use e = expm1(log r) (no cancellation near r = 1): χ² = mean(e² + 2e), k3 = mean(e − log r);
in float32 both stay within ~1e-5 relative of the float64 values down to a log-ratio spread of
1e-4 (0.5M tokens). When r² could overflow the compute dtype, χ² is formed in float64 log space
and k3 in float64; values beyond the float64 range are reported as ``inf``, never NaN.
``compute_metrics=False`` skips them (the metrics cost about as much as a cheap loss on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from simkit import mappings as _mappings
from simkit.estimators import AGGREGATIONS
from simkit.mappings.base import Mapping
from simkit.mappings.covariance import draw_subset
from simkit.mappings.truncation import BATCH_NORM_EPS

SURROGATE = "surrogate"
DETACHED = "detached"

#: which loss form each mapping uses (see the module docstring)
FORMS: dict[str, str] = {
    "naive": DETACHED,
    "is_token": SURROGATE,
    "is_seq": DETACHED,
    "power": DETACHED,
    "snis": DETACHED,
    "psis": DETACHED,
    "soft_shrink": DETACHED,
    "ppo_clip": SURROGATE,
    "dual_clip": SURROGATE,
    "dapo": SURROGATE,
    "gspo": SURROGATE,
    "gmpo": SURROGATE,
    "sapo": SURROGATE,
    "luffy": SURROGATE,
    "aspo": SURROGATE,
    "cispo": DETACHED,
    "tis_token": DETACHED,
    "tis_seq": DETACHED,
    "mis_token": DETACHED,
    "mis_seq": DETACHED,
    "icepop": DETACHED,
    "geo_mask": DETACHED,
    "opsm": DETACHED,
    "token_veto": DETACHED,
    "m2po": SURROGATE,
    "topr": DETACHED,
    "vespo": DETACHED,
    "kl_rs": DETACHED,
    "clip_cov": SURROGATE,
    "kl_cov": SURROGATE,
}

#: aggregation denominators: ``valid`` (every valid token, verl's new engine) or ``kept`` (the
#: tokens a rejection mapping keeps, verl's legacy path that shrinks ``response_mask``)
DENOMINATORS = ("valid", "kept")

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


def available() -> list[str]:
    """Names of every mapping with a torch loss, in the order of ``simkit.mappings.available()``."""
    return [name for name in _mappings.available() if name in _KERNELS]


def loss_form(name: str) -> str:
    """``"surrogate"`` or ``"detached"``: how mapping ``name``'s loss carries its gradient."""
    if name not in FORMS:
        raise KeyError(f"unknown mapping {name!r}; available losses: {', '.join(available())}")
    return FORMS[name]


# --- the batch every kernel receives ---------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    """Validated inputs in the compute dtype; padded positions already neutralised.

    ``log_ratio`` (N, T): log π − log μ, exactly 0 on padding; it carries the gradient to
    ``log_prob`` for surrogate losses and is detached for detached ones. ``mask`` (N, T) bool and
    ``maskf`` the same as 0/1 in the compute dtype. ``positive`` (N,) bool: A >= 0. ``lengths``
    (N,) valid tokens per row (compute dtype). ``log_w`` (N,) detached Σ_t log r_t, ``log_s``
    (N,) detached mean_t log r_t (0 for an empty row). ``lr_min``, ``lr_max``: the smallest and
    largest entry of ``log_ratio`` (padding zeros included), as Python floats.
    """

    log_ratio: torch.Tensor
    mask: torch.Tensor
    maskf: torch.Tensor
    positive: torch.Tensor
    lengths: torch.Tensor
    log_w: torch.Tensor
    log_s: torch.Tensor
    lr_min: float
    lr_max: float
    adv: torch.Tensor | None = None
    log_prob: torch.Tensor | None = None
    rng: object = None
    full: bool = False

    def per_row(self, value_pos: float, value_neg: float) -> torch.Tensor:
        """(N,) tensor: ``value_pos`` on rows with A >= 0, ``value_neg`` on the others."""
        pos = torch.tensor(value_pos, dtype=self.log_w.dtype, device=self.log_w.device)
        neg = torch.tensor(value_neg, dtype=self.log_w.dtype, device=self.log_w.device)
        return torch.where(self.positive, pos, neg)

    def ratio(self, cap: float) -> torch.Tensor:
        """r = exp(min(log r, cap)) (N, T), differentiable with ∂r/∂log r = r also above the cap
        (:func:`capped_exp`); a plain ``exp`` when no log-ratio exceeds the cap."""
        if self.lr_max <= cap:
            return torch.exp(self.log_ratio)
        return capped_exp(self.log_ratio, cap)

    def ratio_value(self, log_ratio: torch.Tensor, cap: float) -> torch.Tensor:
        """exp(min(``log_ratio``, cap)) without autograd, for a kernel that computes its own
        derivative; ``log_ratio`` is this batch's (its detached values)."""
        if self.lr_max <= cap:
            return torch.exp(log_ratio)
        return torch.exp(torch.clamp(log_ratio, max=cap))

    def count_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """Number of True entries of ``flags`` (N, T) bool, which must be False wherever the
        log-ratio is 0 (so on every padded position): the clipped valid tokens."""
        return torch.count_nonzero(flags)

    def count_rows(self, clipped: torch.Tensor) -> torch.Tensor:
        """Number of valid tokens in the rows flagged by ``clipped`` (N,) bool."""
        return torch.where(clipped, self.lengths, 0.0).sum()


@dataclass(frozen=True)
class _Terms:
    """What a kernel returns.

    Surrogate form: ``tok`` (N, T) is F (differentiable, finite everywhere, padding included).
    Detached form: ``tok`` (N, T) the token coefficient c, or ``seq`` (N,) one coefficient per
    row. ``n_clipped``: a function returning the number of clipped valid tokens as a 0-d tensor
    (only called when metrics are requested; ``None``: the mapping never clips). ``extra``:
    mapping-specific metrics (0-d tensors).
    """

    tok: torch.Tensor | None = None
    seq: torch.Tensor | None = None
    n_clipped: Callable[[], torch.Tensor] | None = None
    extra: dict | None = None
    penalty: torch.Tensor | None = None


# --- small autograd helpers -------------------------------------------------------------------


class _CappedExp(torch.autograd.Function):
    """exp(min(x, cap)) whose derivative is its value (the cap bounds the value only).

    ``simkit.mappings`` computes a capped coefficient e^min(log r, cap): the surrogate F = r
    must then have ∂F/∂log r = e^min(log r, cap) everywhere, also above the cap.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, cap):
        return torch.exp(torch.clamp(x, max=cap))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out, None


def capped_exp(x: torch.Tensor, cap: float) -> torch.Tensor:
    """exp(min(x, cap)) with gradient exp(min(x, cap)) (also where x > cap); any shape."""
    if not x.requires_grad:
        return torch.exp(torch.clamp(x, max=cap))
    return _CappedExp.apply(x, cap)


class _BandClamp(torch.autograd.Function):
    """(clamp(x, lo, hi), x outside [lo, hi]) with backward grad·1[lo <= x <= hi] read from the
    kept outside-mask (the backward of ``torch.clamp`` recomputes two comparisons and a select:
    several times slower on CPU). ``lo``, ``hi`` broadcastable tensors, never differentiated."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, lo, hi):
        # = clamp(x, lo, hi) for lo <= hi; two broadcast min/max are faster than one clamp
        y = torch.maximum(torch.minimum(x, hi), lo)
        return y, y != x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        (outside,) = ctx.saved_tensors
        inside = torch.logical_not(outside).view(torch.uint8).to(grad.dtype)
        return grad * inside, None, None


def band_clamp(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """``(clamp(x, lo, hi), outside)``: the clamped values, differentiable with derivative
    1[lo <= x <= hi] (as ``torch.clamp``), and the bool tensor x ∉ [lo, hi]. Any shapes that
    broadcast (e.g. x (N, T), lo/hi (N, 1))."""
    if not x.requires_grad:
        y = torch.maximum(torch.minimum(x, hi), lo)
        return y, y != x
    return _BandClamp.apply(x, lo, hi)


class _AnalyticSurrogate(torch.autograd.Function):
    """A surrogate F(log r) and its derivative c = ∂F/∂log r computed together by the kernel;
    the backward is one multiplication grad·c (instead of the backward of every elementary
    operation of F). ``value_and_derivative(log_ratio) -> (F, c)`` runs without autograd."""

    generate_vmap_rule = True

    @staticmethod
    def forward(log_ratio, value_and_derivative):
        value, derivative = value_and_derivative(log_ratio)
        return value, derivative

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        (derivative,) = ctx.saved_tensors
        return grad * derivative, None


def analytic_surrogate(
    log_ratio: torch.Tensor,
    value_and_derivative: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The surrogate F = ``value_and_derivative(log_ratio)[0]`` (N, T), differentiable w.r.t.
    ``log_ratio`` with ∂F_t/∂log r_t = ``value_and_derivative(log_ratio)[1]`` (token t's own
    log-ratio only, as every per-token surrogate here). The pair must be F and its exact
    derivative; the tests check both against :mod:`simkit.mappings` (values and ``c``)."""
    if not log_ratio.requires_grad:
        with torch.no_grad():
            return value_and_derivative(log_ratio)[0]
    return _AnalyticSurrogate.apply(log_ratio, value_and_derivative)[0]


def _log(x: float) -> float:
    """log x with log 0 = −inf (and a negative bound below every ratio: −inf)."""
    return math.log(x) if x > 0 else -math.inf


def _sequence_value_per_token(
    log_value: torch.Tensor, log_ratio: torch.Tensor, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """F_t = exp(sg(log_value_i) + g_i·(log r_t − sg(log r_t))): the value exp(log_value_i) on
    every token of row i, derivative w.r.t. log r_t equal to g_i·value (verl's per-token form
    of a sequence ratio: only token t's own log-probability is differentiated). ``log_value``,
    ``gate`` (N,) (``gate`` 0/1; None = 1), ``log_ratio`` (N, T)."""
    delta = log_ratio - log_ratio.detach()
    if gate is not None:
        delta = delta * gate[:, None]
    return torch.exp(log_value.detach()[:, None] + delta)


def _row_bounds(b: _Batch, lo_pos, hi_pos, lo_neg, hi_neg) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row bounds (lo, hi) as (N, 1) tensors for the sign of A."""
    return b.per_row(lo_pos, lo_neg)[:, None], b.per_row(hi_pos, hi_neg)[:, None]


# --- kernels: one per family ------------------------------------------------------------------
# Each kernel(mapping, batch) -> _Terms implements the coefficient of simkit.mappings.<family>
# in torch, from the reference sheet, without calling the numpy implementation.


def _naive(m, b: _Batch) -> _Terms:
    return _Terms(seq=torch.ones_like(b.log_w))


def _is_token(m, b: _Batch) -> _Terms:
    return _Terms(tok=b.ratio(m.max_log_ratio))


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


def _clip_band(m, b: _Batch) -> _Terms:
    """PPO / dual clip / DAPO: F = clamp(r, lo, hi) with lo = 0 (none), hi = 1+ε_high for A >= 0
    and lo = 1−ε_low, hi = c_dual (∞ without dual clip) for A < 0 — PPO's min(rA, clip(r)A)
    (and dual clip's max(·, c_dual·A) for A < 0). ∂F/∂log r = r inside [lo, hi], 0 outside."""
    c_dual = getattr(m, "c_dual", math.inf)
    lo, hi = _row_bounds(b, -math.inf, 1.0 + m.eps_high, 1.0 - m.eps_low, c_dual)
    r = b.ratio(m.max_log_ratio)
    F, outside = band_clamp(r, lo, hi)
    finite_highs = [h for h in (1.0 + m.eps_high, c_dual) if math.isfinite(h)]
    if b.lr_max > m.max_log_ratio and any(math.log(h) > m.max_log_ratio for h in finite_highs):
        # a capped r = e^cap can sit inside the band while log r is above it: the band is
        # decided on the log-ratio itself, as in simkit.mappings (only for tiny caps)
        log_hi = b.per_row(math.log1p(m.eps_high), _log(c_dual))[:, None]
        above = b.log_ratio.detach() > log_hi
        F = torch.where(above, hi, F)
        outside = outside | above
    # lo <= 1 <= hi: a padded position (r = 1) is never flagged
    return _Terms(tok=F, n_clipped=lambda: b.count_flags(outside))


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
    F = _sequence_value_per_token(log_value, b.log_ratio, in_band.to(b.log_w.dtype))
    return _Terms(tok=F, n_clipped=lambda: b.count_rows(~in_band))


def _gmpo(m, b: _Batch) -> _Terms:
    """GMPO: log r_t clipped to [−ε_low, ∞) (A < 0) or (−∞, ε_high] (A >= 0); R = exp(mean of
    the clipped values); F_t = exp(sg(log R) + (ℓ_t − sg(ℓ_t))) with ℓ_t the clipped log-ratio,
    whose derivative is 1 where token t is not clipped: c_t = R·1[not clipped]."""
    lo, hi = _row_bounds(b, -math.inf, m.eps_high, -m.eps_low, math.inf)
    with torch.no_grad():
        lr = b.log_ratio.detach()
        clipped_lr = torch.maximum(torch.minimum(lr, hi), lo)  # padding: 0 stays 0
        clipped = clipped_lr != lr
        log_R = clipped_lr.sum(dim=1) / b.lengths.clamp(min=1)
        R = torch.exp(torch.clamp(log_R, max=m.max_log_ratio))[:, None]

    def value_and_derivative(_):
        kept = torch.logical_not(clipped).view(torch.uint8).to(R.dtype)
        return R.expand(clipped.shape), kept.mul_(R)

    F = analytic_surrogate(b.log_ratio, value_and_derivative)
    return _Terms(tok=F, n_clipped=lambda: b.count_flags(clipped))


def _sapo(m, b: _Batch) -> _Terms:
    """SAPO: F = (4/τ)·σ(τ(r − 1)), τ = τ_pos (A >= 0) or τ_neg (A < 0)."""
    tau = b.per_row(m.tau_pos, m.tau_neg)[:, None]

    def value_and_derivative(lr):
        # c = r·F'(r) = 4r·σ(x)·σ(−x), x = τ(r − 1): both sigmoids are accurate in their tails,
        # where σ(x)·(1 − σ(x)) would lose every digit of 1 − σ
        r = b.ratio_value(lr, m.max_log_ratio)
        x = (r - 1.0).mul_(tau)
        s = torch.sigmoid(x)
        c = torch.sigmoid(x.neg_()).mul_(s).mul_(r).mul_(4.0)
        return s.mul_(4.0 / tau), c

    return _Terms(tok=analytic_surrogate(b.log_ratio, value_and_derivative))


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

    return _Terms(tok=analytic_surrogate(b.log_ratio, value_and_derivative))


def _aspo(m, b: _Batch) -> _Terms:
    """ASPO: ρ_t = exp(sg(log w_t) + ℓ_t − sg(ℓ_t)) with w_t = min(1/r_t, c_dual) (A >= 0, the
    flipped ratio π_old·π/sg(π²), soft-clipped) or min(r_t, c_dual) (A < 0), and ℓ_t the log-ratio
    clamped to the PPO band [log(1−ε_low), log c_dual] (A < 0) or (−∞, log(1+ε_high)] (A >= 0):
    the gradient w_t·1[inside the band]."""
    lr = b.log_ratio
    log_cap = math.log(m.c_dual)
    sign = b.per_row(-1.0, 1.0)[:, None]
    lo, hi = _row_bounds(b, -math.inf, math.log1p(m.eps_high), _log(1.0 - m.eps_low), log_cap)
    with torch.no_grad():
        outside = torch.maximum(torch.minimum(lr.detach(), hi), lo) != lr.detach()

    def value_and_derivative(lr):
        weight = torch.exp(torch.clamp(lr * sign, max=log_cap))
        inside = torch.logical_not(outside).view(torch.uint8).to(weight.dtype)
        return weight, inside.mul_(weight)

    F = analytic_surrogate(lr, value_and_derivative)

    def n_clipped():
        if -b.lr_min <= log_cap:  # no flipped weight reaches the cap
            return b.count_flags(outside)
        capped = b.positive[:, None] & (-lr.detach() > log_cap)
        return b.count_flags(outside | capped)

    return _Terms(tok=F, n_clipped=n_clipped)


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
    removed = m2po_removed(b.log_ratio, b.mask, b.positive, m.tau, m.trust_region_only)
    r = b.ratio(m.max_log_ratio)
    if removed is None:
        return _Terms(tok=r, n_clipped=None)
    kept = torch.logical_not(removed).view(torch.uint8).to(r.dtype)
    return _Terms(tok=r * kept, n_clipped=lambda: b.count_flags(removed))


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
        x = b.log_ratio.detach()
        if b.lr_min < -m.max_log_ratio or b.lr_max > m.max_log_ratio:
            x = torch.clamp(x, -m.max_log_ratio, m.max_log_ratio)
        terms = {}
        keep = b.mask.clone()
        row_ok = torch.ones_like(b.positive)
        for crit, u in m.rules:
            kind = crit[-2:]
            if kind not in terms:  # padding: x = 0 ⇒ k = 0
                terms[kind] = 0.5 * x * x if kind == "k2" else torch.expm1(x) - x
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
    −inf on padding."""
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
    permutation is the numpy Generator's (``rng``), as :class:`simkit.mappings.ClipCov`."""
    terms = _clip_band(m, b)
    cov = _covariance(b)
    with torch.no_grad():
        lr = b.log_ratio.detach()
        adv = b.adv[:, None]
        clipped = ((adv > 0) & (lr > math.log1p(m.eps_high))) | (
            (adv < 0) & (lr < _log(1.0 - m.eps_low))
        )
        cand = b.mask & ~clipped & (cov > m.lb) & (cov < m.ub)
        idx = torch.nonzero(cand.reshape(-1)).reshape(-1)
        detached = torch.zeros_like(b.mask)
        if idx.numel():
            n_valid = int(b.lengths.sum())
            picks = draw_subset(b.rng, idx.numel(), max(int(m.ratio * n_valid), 1))
            chosen = idx[torch.as_tensor(picks, device=idx.device)]
            detached = detached.reshape(-1).index_fill(0, chosen, True).reshape(b.mask.shape)
        keep = torch.logical_not(detached).view(torch.uint8).to(terms.tok.dtype)
    F = terms.tok * keep

    def n_clipped():
        return terms.n_clipped() + b.count_flags(detached)

    return _Terms(tok=F, n_clipped=n_clipped)


def _kl_cov(m, b: _Batch) -> _Terms:
    """verl ``compute_policy_loss_kl_cov`` (b178a3c): −A·r everywhere, + κ·|log r| on the
    k = max(1, ⌊ρ·#valid⌋) valid tokens of largest covariance (ties: first in row-major order)."""
    cov = _covariance(b)  # −inf on padding: never among the k <= #valid largest
    with torch.no_grad():
        n_valid = int(b.lengths.sum())
        selected = torch.zeros_like(b.mask)
        if n_valid:
            k = max(1, int(n_valid * m.ratio))
            chosen = _top_k_first(cov.reshape(-1), k)
            selected = selected.reshape(-1).index_fill(0, chosen, True).reshape(b.mask.shape)
        sel = selected.view(torch.uint8).to(b.log_w.dtype)
    penalty = b.log_ratio.abs() * sel * m.kappa if m.kappa > 0 else None
    # clipped: penalised tokens where the penalty acts (log r ≠ 0; on-policy it is 0)
    return _Terms(
        tok=b.ratio(m.max_log_ratio),
        n_clipped=lambda: b.count_flags(selected & (b.log_ratio.detach() != 0)),
        penalty=penalty,
    )


def _top_k_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest ``values`` (1-D), ties at the k-th value first by position
    (as :func:`simkit.mappings.covariance.top_k_first`): ``torch.topk`` for the k-th value,
    then the strictly larger ones and the first ties."""
    k = min(k, values.numel())
    kth = torch.topk(values, k).values[-1]
    above = torch.nonzero(values > kth).reshape(-1)
    ties = torch.nonzero(values == kth).reshape(-1)[: k - above.numel()]
    return torch.sort(torch.cat([above, ties])).values


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
}


# --- batch-dependent pieces: PSIS and the M2PO mask -------------------------------------------


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
) -> torch.Tensor | None:
    """The M2PO mask: True where a token is removed, (N, T) bool, or None if none is.

    Zheng et al., "Prosperity before collapse", arXiv 2510.01161, Algorithm 1: while the mean
    of (log r_t)² over the remaining candidate tokens exceeds τ, remove the largest (ties: first
    in row-major order). Candidates: valid tokens, restricted (``trust_region_only``) to the side
    PPO's clip acts on (A >= 0 and r_t > 1, or A < 0 and r_t < 1). ``log_ratio`` (N, T) must be
    0 on padded positions; ``mask`` (N, T) bool, ``positive`` (N,) bool. The total is summed in
    float64.
    """
    lr = log_ratio.detach()
    if trust_region_only:
        # the side of the sign of A: s·log r > 0 with s = ±1 (a padded log r = 0 never is)
        side = torch.where(positive, 1.0, -1.0).to(lr.dtype)[:, None]
        cand = (lr * side) > 0
        sq = (lr * lr).mul_(cand.view(torch.uint8).to(lr.dtype))
    else:
        cand = mask
        sq = lr * lr  # 0 on padding
    total, n = torch.stack(
        [sq.sum(dtype=torch.float64), torch.count_nonzero(cand).to(torch.float64)]
    ).tolist()
    n = int(n)
    if n == 0 or total <= tau * n:
        return None
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


# --- aggregation --------------------------------------------------------------------------------


def aggregation_scale(
    mask: torch.Tensor, agg: str = "token-mean", max_length: int | None = None
) -> torch.Tensor:
    """Per-row aggregation weight 1/Z_i, shape (N,), from a (N, T) bool ``mask``.

    The normalisations of :func:`simkit.estimators.aggregation_weights` (reference sheet,
    section D): ``token-mean`` Z = Σ mask; ``seq-mean-token-mean`` Z_i = N·|y_i|;
    ``seq-mean-token-sum`` Z = N; ``seq-mean-token-sum-norm`` Z = N·L_max with L_max =
    ``max_length`` (default T), which must be >= the longest row. A row (or batch) without valid
    tokens gets 0. Dtype float64 on the mask's device.
    """
    _check_aggregation(agg, max_length)
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape (N, T), got shape {tuple(mask.shape)}")
    return _inverse_z(mask.sum(dim=1, dtype=torch.float64), mask.shape[1], agg, max_length)


def _check_aggregation(agg: str, max_length) -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(
            f"unknown aggregation {agg!r}; valid aggregations: {', '.join(AGGREGATIONS)}"
        )
    if max_length is not None:
        if agg != "seq-mean-token-sum-norm":
            raise ValueError(
                f"max_length applies to aggregation 'seq-mean-token-sum-norm' only, not {agg!r}"
            )
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")


def _inverse_z(lengths: torch.Tensor, T: int, agg: str, max_length: int | None) -> torch.Tensor:
    """1/Z_i (N,) from the valid lengths (N,) (any float dtype; the result has it)."""
    N = lengths.shape[0]
    zeros = torch.zeros_like(lengths)
    if agg == "token-mean":
        total = lengths.sum()
        return torch.where(total > 0, 1.0 / total.clamp(min=1), zeros)
    if agg == "seq-mean-token-mean":
        return torch.where(lengths > 0, 1.0 / (N * lengths).clamp(min=1), zeros)
    if agg == "seq-mean-token-sum":
        return torch.full_like(lengths, 1.0 / N) if N else zeros
    L_max = T if max_length is None else max_length
    longest = int(lengths.max()) if N else 0
    if longest > L_max:
        raise ValueError(
            f"max_length = {L_max} is shorter than the longest sequence ({longest} valid tokens)"
        )
    return torch.full_like(lengths, 1.0 / (N * L_max)) if N else zeros


# --- input checks ---------------------------------------------------------------------------------


def _as_tensor(x, name: str, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.device != device:
            raise ValueError(
                f"{name} is on device {x.device}, log_prob on {device}: put them on one device"
            )
        return x
    try:
        return torch.as_tensor(x, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must be a tensor (or array-like), got {type(x).__name__}") from err


def _check_inputs(log_prob, old_log_prob, advantages, response_mask):
    """Validate shapes/dtypes; return (log_prob, old_log_prob (compute dtype, detached),
    mask (bool), advantages (N,) compute dtype, compute dtype)."""
    if not isinstance(log_prob, torch.Tensor):
        raise TypeError(f"log_prob must be a torch.Tensor, got {type(log_prob).__name__}")
    if log_prob.ndim != 2:
        raise ValueError(f"log_prob must have shape (N, T), got shape {tuple(log_prob.shape)}")
    if not log_prob.is_floating_point():
        raise ValueError(f"log_prob must be a floating-point tensor, got dtype {log_prob.dtype}")
    shape = tuple(log_prob.shape)
    device = log_prob.device
    dtype = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    old = _as_tensor(old_log_prob, "old_log_prob", device)
    if tuple(old.shape) != shape:
        raise ValueError(
            f"shape mismatch: log_prob has shape {shape}, old_log_prob has {tuple(old.shape)}"
        )
    if not old.is_floating_point():
        raise ValueError(f"old_log_prob must be floating point, got dtype {old.dtype}")
    mask = _as_tensor(response_mask, "response_mask", device)
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"shape mismatch: log_prob has shape {shape}, response_mask has {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("response_mask must be boolean (or 0/1)")
        mask = mask != 0
    adv = _as_tensor(advantages, "advantages", device)
    if not (adv.is_floating_point() or adv.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"advantages must be real numbers, got dtype {adv.dtype}")
    adv = adv.detach().to(dtype)
    N = shape[0]
    if tuple(adv.shape) == (N,):
        if not bool(torch.isfinite(adv).all()):
            raise ValueError("advantages contains non-finite values")
    elif tuple(adv.shape) == shape:
        adv = _row_advantages(adv, mask)
    else:
        raise ValueError(
            f"advantages must have shape (N,) = ({N},) or (N, T) = {shape}, "
            f"got shape {tuple(adv.shape)}"
        )
    return log_prob, old.detach().to(dtype), mask, adv, dtype


def _row_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) token advantages that are constant over each row's valid tokens → (N,)."""
    hi = torch.where(mask, adv, -math.inf).amax(dim=1) if adv.shape[1] else adv.new_zeros(0)
    lo = torch.where(mask, adv, math.inf).amin(dim=1) if adv.shape[1] else adv.new_zeros(0)
    if adv.shape[1] == 0:
        return adv.new_zeros(adv.shape[0])
    nonempty = mask.any(dim=1)
    if not bool(torch.isfinite(torch.where(nonempty, hi, 0.0)).all()):
        raise ValueError("advantages contains non-finite values on valid tokens")
    differs = nonempty & (hi != lo)
    if bool(differs.any()):
        row = int(torch.nonzero(differs)[0, 0])
        raise ValueError(
            f"advantages of shape (N, T) must be constant over each row's valid tokens (one "
            f"sequence advantage); row {row} ranges from {float(lo[row]):g} to "
            f"{float(hi[row]):g}. Pass the sequence advantages, shape (N,)"
        )
    return torch.where(nonempty, hi, 0.0)


def _build_mapping(name, preset, hyperparams) -> Mapping:
    if isinstance(name, Mapping):
        if preset is not None or hyperparams:
            raise TypeError(
                "pass hyperparameters either in the Mapping object or as keywords, not both"
            )
        mapping = name
    elif isinstance(name, str):
        mapping = _mappings.get(name, preset=preset, **hyperparams)
    else:
        raise TypeError(f"name must be a mapping name (str), got {type(name).__name__}")
    if mapping.name not in _KERNELS:
        raise KeyError(
            f"mapping {mapping.name!r} has no torch loss; "
            f"available losses: {', '.join(available())}"
        )
    return mapping


# --- the loss ---------------------------------------------------------------------------------


def policy_loss(
    name,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    max_length: int | None = None,
    preset: str | None = None,
    compute_metrics: bool = True,
    denominator: str = "valid",
    rng=None,
    correction=None,
    mode: str = "decoupled",
    rollout_log_prob=None,
    **hyperparams,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of weight mapping ``name`` and its metrics.

    Parameters
    ----------
    name : str or simkit.mappings.Mapping
        A name of :func:`available` (hyperparameters as keywords, optional ``preset``), or a
        mapping object built with :func:`simkit.mappings.get`.
    log_prob : Tensor (N, T)
        log π(y_t | s_t) of the sampled tokens under the policy being trained (requires grad).
    old_log_prob : Tensor (N, T)
        log μ(y_t | s_t) under the behaviour policy that sampled them (never differentiated).
    advantages : Tensor (N,) or (N, T)
        Sequence advantages A_i; (N, T) must hold one value per row on its valid tokens.
    response_mask : Tensor (N, T)
        Valid tokens (bool or 0/1). Padded positions may hold any value (±inf, NaN).
    agg : str
        Aggregation, one of :data:`simkit.estimators.AGGREGATIONS` (Z as in
        :func:`aggregation_scale`); ``max_length`` is L_max of ``seq-mean-token-sum-norm``.
    compute_metrics : bool
        False skips the metrics (``metrics`` is then ``{}``).
    denominator : str
        ``"valid"`` (default: Z counts every valid token, verl's new engine) or ``"kept"``
        (Z counts the tokens a rejecting mapping keeps — kl_rs, mis_*, icepop, geo_mask, opsm,
        token_veto — as verl's legacy path, which shrinks ``response_mask`` before
        ``agg_loss``; the same as ``"valid"`` for a mapping that does not reject).
    rng : numpy Generator or int, optional
        The random stream of a stochastic mapping (``clip_cov``; default ``default_rng(0)``).
    correction, mode, rollout_log_prob : optional
        A composed loss (:mod:`simkit.composition`, the same c as
        ``Estimator(mapping, correction=…, mode=…)``). ``mode="decoupled"`` (verl decoupled,
        TRL vLLM IS): ``old_log_prob`` is log π_old (the trainer's recomputation) and
        ``rollout_log_prob`` log μ (the engine's); the mapping acts on log π − log π_old and the
        detached correction weight c_correction(log π_old − log μ) multiplies every token's
        weight. ``mode="bypass"``: ``old_log_prob`` is log μ (π_old := μ) and the correction acts
        on log π − log μ too. ``mode="trl_vespo"``: TRL's VESPO, the token correction folded into
        W (mapping ``vespo``). ``denominator="kept"`` then counts the tokens both rejections
        keep. The metrics describe the mapping's ratio (π/π_old, or π/μ in bypass mode).
    **hyperparams
        The mapping's hyperparameters (names and defaults of ``simkit.mappings``).

    Returns
    -------
    loss : 0-d Tensor
        In float32 (float64 for float64 ``log_prob``), with
        ∂loss/∂log_prob = −c·A/Z (c the mapping's coefficient, 0 on padding).
    metrics : dict[str, float]
        See the module docstring (:data:`METRICS`, plus ``khat`` for psis).
    """
    mapping = _build_mapping(name, preset, hyperparams)
    _check_aggregation(agg, max_length)
    if denominator not in DENOMINATORS:
        raise ValueError(
            f"unknown denominator {denominator!r}; valid denominators: {', '.join(DENOMINATORS)}"
        )
    lp, old, mask, adv, dtype = _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    maskf = mask.view(torch.uint8).to(dtype)  # (a bool → float cast is several times slower)
    lengths = maskf.sum(dim=1)
    inv_z = _inverse_z(lengths, mask.shape[1], agg, max_length)
    surrogate = FORMS[mapping.name] == SURROGATE
    lp = lp.to(dtype)

    # log r = (log π − log μ)·mask: one multiplication, exact whenever every log π − log μ is
    # finite (padding included); otherwise (±inf/NaN garbage somewhere) a select that keeps
    # padded positions out of the values and of the gradient
    with torch.set_grad_enabled(surrogate and torch.is_grad_enabled()):
        log_ratio = (lp - old).mul_(maskf)
    lr_min, lr_max = _extremes(log_ratio)
    finite = math.isfinite(lr_min) and math.isfinite(lr_max)
    if not finite:
        with torch.set_grad_enabled(surrogate and torch.is_grad_enabled()):
            log_ratio = torch.where(mask, lp - old, 0.0)
        lr_min, lr_max = _extremes(log_ratio)
        if not (math.isfinite(lr_min) and math.isfinite(lr_max)):
            bad = torch.nonzero(~torch.isfinite(log_ratio.detach()))[0].tolist()
            kind = "NaN" if math.isnan(lr_min) or math.isnan(lr_max) else "infinite"
            raise ValueError(
                f"log_prob - old_log_prob is {kind} on a valid token at position "
                f"{tuple(bad)} (e.g. -inf - (-inf), or a zero probability); check log_prob and "
                "old_log_prob where response_mask is True (padding may hold anything), as the "
                "numpy mappings do"
            )
    log_w = log_ratio.detach().sum(dim=1)
    log_s = log_w / lengths.clamp(min=1)  # 0 for an empty row (its log W is 0)
    needs_log_prob = mapping.name in ("clip_cov", "kl_cov")
    full = needs_log_prob and bool(mask.all())  # no padding: the selects can be skipped
    batch = _Batch(
        log_ratio,
        mask,
        maskf,
        adv >= 0,
        lengths,
        log_w,
        log_s,
        float(lr_min),
        float(lr_max),
        adv=adv,
        log_prob=(lp.detach() if full else torch.where(mask, lp.detach(), 0.0))
        if needs_log_prob
        else None,
        rng=rng,
        full=full,
    )

    corr, c_corr = _correction_weights(
        mapping, correction, mode, rollout_log_prob, denominator, batch, old, dtype
    )
    if corr is not None and mode == "trl_vespo":
        terms = _Terms(seq=c_corr)  # φ(W) with the correction folded into W
        corr = c_corr = None
    else:
        terms = _KERNELS[mapping.name](mapping, batch)
    kept = None
    if denominator == "kept" and mapping.rejects:
        with torch.no_grad():
            c = terms.tok if terms.tok is not None else terms.seq[:, None].expand(mask.shape)
            kept = (c.detach() != 0) & mask
    if denominator == "kept" and corr is not None and corr.rejects:
        kept = (c_corr != 0) & (mask if kept is None else kept)
    if kept is not None:
        inv_z = _inverse_z(kept.sum(dim=1).to(dtype), mask.shape[1], agg, max_length)
    row_weight = adv * inv_z  # A_i / Z_i
    if surrogate:
        with torch.no_grad():
            token_weight = maskf * row_weight[:, None]
            if c_corr is not None:
                token_weight = token_weight * c_corr
        loss = -torch.dot(terms.tok.reshape(-1), token_weight.reshape(-1))
        if terms.penalty is not None:
            with torch.no_grad():
                pen_weight = maskf * inv_z[:, None]
                if c_corr is not None:
                    pen_weight = pen_weight * c_corr
            loss = loss + torch.dot(terms.penalty.reshape(-1), pen_weight.reshape(-1))
    else:
        with torch.no_grad():
            if terms.seq is not None:
                token_weight = maskf * (terms.seq * row_weight)[:, None]
            else:
                token_weight = (terms.tok * maskf).mul_(row_weight[:, None])
            if c_corr is not None:
                token_weight = token_weight * c_corr
        # the weights are 0 on padding; where log π may be non-finite there, zero it first
        log_pi = lp if finite else torch.where(mask, lp, 0.0)
        loss = -torch.dot(token_weight.reshape(-1), log_pi.reshape(-1))
    return loss, (_metrics(batch, terms) if compute_metrics else {})


def _leg_batch(log_ratio: torch.Tensor, b: _Batch) -> _Batch:
    """A detached batch on another log-ratio leg (0 on padding), same rows as ``b``."""
    lr_min, lr_max = _extremes(log_ratio)
    log_w = log_ratio.sum(dim=1)
    return _Batch(
        log_ratio,
        b.mask,
        b.maskf,
        b.positive,
        b.lengths,
        log_w,
        log_w / b.lengths.clamp(min=1),
        float(lr_min),
        float(lr_max),
        adv=b.adv,
    )


def _correction_weights(mapping, correction, mode, rollout_log_prob, denominator, b, old, dtype):
    """(correction Mapping or None, its detached token weights (N, T) or None); for
    ``trl_vespo`` the second item is φ(W) per row (N,) with the token correction in W."""
    from simkit import composition

    corr = composition.check_correction(mapping, correction, mode, denominator)
    if corr is None:
        if rollout_log_prob is not None:
            raise ValueError("rollout_log_prob applies to a composed loss only (pass correction)")
        return None, None
    if corr.name not in _KERNELS:
        raise KeyError(f"correction {corr.name!r} has no torch kernel")
    with torch.no_grad():
        if mode == "bypass":
            if rollout_log_prob is not None:
                raise ValueError(
                    "mode 'bypass' sets π_old := μ: pass log μ as old_log_prob and no "
                    "rollout_log_prob"
                )
            leg = b.log_ratio.detach()
        else:
            if rollout_log_prob is None:
                raise ValueError(
                    f"mode {mode!r} needs rollout_log_prob (log μ of the inference engine); "
                    "old_log_prob is then log π_old"
                )
            rollout = _as_tensor(rollout_log_prob, "rollout_log_prob", old.device)
            if tuple(rollout.shape) != tuple(old.shape):
                raise ValueError(
                    f"shape mismatch: old_log_prob has shape {tuple(old.shape)}, "
                    f"rollout_log_prob has {tuple(rollout.shape)}"
                )
            leg = torch.where(b.mask, old - rollout.detach().to(dtype), 0.0)
            if bool(torch.isnan(leg).any()):
                raise ValueError("old_log_prob - rollout_log_prob is NaN on a valid token")
        if mode == "trl_vespo":
            return corr, _trl_vespo(mapping, corr, b, leg)
        terms = _KERNELS[corr.name](corr, _leg_batch(leg, b))
        c = terms.tok if terms.tok is not None else terms.seq[:, None].expand(b.mask.shape)
        return corr, c * b.maskf


def _trl_vespo(m, corr, b: _Batch, leg: torch.Tensor) -> torch.Tensor:
    """TRL ``get_gamma_weights`` (f2cd577): log W = Σ clip(log π − log π_old, ±cap) + Σ clip(log
    w_t, log 1e-8, 20), w_t the token correction of log π_old − log μ; φ(W) per row."""
    from simkit.composition import TRL_LOG_IS_HIGH, TRL_LOG_IS_LOW

    lo_c, hi_c = _log(corr.c_low), _log(corr.c_high)
    if corr.name == "tis_token":
        lo = max(lo_c, TRL_LOG_IS_LOW)
        hi = min(hi_c, TRL_LOG_IS_HIGH, corr.max_log_ratio)
        log_is = torch.clamp(leg, lo, max(lo, hi))
    else:
        log_is = torch.clamp(leg, TRL_LOG_IS_LOW, min(TRL_LOG_IS_HIGH, corr.max_log_ratio))
        log_is = torch.where((leg < lo_c) | (leg > hi_c), TRL_LOG_IS_LOW, log_is)
    cap = m.max_log_ratio_tok
    tok = (torch.clamp(b.log_ratio.detach(), -cap, cap) + log_is) * b.maskf
    log_w = torch.clamp(tok.sum(dim=1), m.min_log_ratio_seq, m.max_log_ratio_seq)
    k = b.per_row(m.k_pos, m.k_neg)
    lam = b.per_row(m.lambda_pos, m.lambda_neg)
    phi = torch.exp(k * log_w + lam * (1.0 - torch.exp(log_w)))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def _extremes(x: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a tensor as Python floats (NaN if it holds a NaN; 0, 0 if empty)."""
    if x.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(x.detach())
    return tuple(torch.stack([lo, hi]).tolist())  # aminmax propagates NaN


def _metrics(b: _Batch, terms: _Terms) -> dict[str, float]:
    """Every metric of the module docstring, from one host synchronisation."""
    with torch.no_grad():
        lr = b.log_ratio.detach()
        N = lr.shape[0]
        n_valid = max(lr.numel(), 1)
        zero = torch.zeros((), dtype=torch.float64, device=lr.device)
        n_clipped = terms.n_clipped() if terms.n_clipped is not None else zero
        # Σ(r² − 1) and Σ(r − 1 − log r) over valid tokens (padding: log r = 0 adds 0). Direct
        # sums of e = expm1(log r) when no e² can overflow the compute dtype (r² − 1 = e² + 2e),
        # else in float64 with Σr² in log space (reported inf only beyond the float64 range)
        limit = 0.5 * (math.log(torch.finfo(lr.dtype).max) - math.log(n_valid)) - 1.0
        log_w = b.log_w.to(torch.float64)
        if lr.numel() == 0:
            token_stats = [zero, zero]
        elif b.lr_max <= limit:
            e = torch.expm1(lr).reshape(-1)  # r − 1 without cancellation; 0 on padding
            # Σ(r² − 1) = Σ(e² + 2e) and Σ(r − 1 − log r) = Σ(e − log r), each term accurate
            sum_r2m1 = torch.dot(e, e) + 2.0 * e.sum()
            token_stats = [sum_r2m1, e.sub_(lr.reshape(-1)).sum()]
        else:
            lr64 = lr.to(torch.float64)
            shift = max(b.lr_max, 0.0)
            log_sum_r2 = torch.log(((lr64 - shift) * 2.0).exp_().mul_(b.maskf).sum()) + 2.0 * shift
            token_stats = [log_sum_r2, (torch.expm1(lr64) - lr64).sum()]
        if N:
            seq_stats = [
                torch.logsumexp(2.0 * log_w, dim=0),
                torch.logsumexp(log_w, dim=0),
                (torch.expm1(log_w) - log_w).sum(),
            ]
        else:
            seq_stats = [zero, zero, zero]
        stats = [n_clipped, b.lengths.sum(), log_w.sum(), *token_stats, *seq_stats]
        extra = terms.extra or {}
        stats += [v.to(lr.device) for v in extra.values()]
        values = torch.stack([s.to(torch.float64) for s in stats]).tolist()
    clipped, n_tok, sum_lr, tok_a, sum_k3, lse2_seq, lse_seq, sum_k3_seq = values[:8]
    out = dict.fromkeys(METRICS, math.nan)
    if n_tok > 0:
        if lr.numel() and b.lr_max <= limit:
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
    out.update(zip(extra, values[8:], strict=True))
    return out


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
