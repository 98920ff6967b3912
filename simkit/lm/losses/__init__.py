"""Torch policy losses for every weight mapping of the catalogue, in the form a trainer calls them.

    loss, metrics = policy_loss("ppo_clip", log_prob, old_log_prob, advantages, response_mask,
                                agg="token-mean", eps_high=0.28)
    loss.backward()

Every loss is built so that its gradient is the weighted policy gradient of the notation page
(the notation page, ``docs/reference.md``)::

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

How the gradient is carried. The kernels run without autograd: every surrogate kernel
computes F and its derivative c = ∂F/∂log r together (the clip bands' inside-mask as a float
tensor, (clamp(r) − r).eq_(0), a bool comparison and its cast costing several float
operations on CPU), and :func:`policy_loss` returns loss = −Σ F·A/Z through one custom step
(:func:`~simkit.lm.losses.autograd.linearised_loss`) whose backward is one multiplication by
the precomputed −c·A/Z — instead of the chain of every elementary operation (sub, mask product,
exp, clamp, dot). A detached loss is −Σ sg(c)·(A/Z)·log π, one dot. Either way autograd's
∂loss/∂log_prob is −c·A/Z, and the tests check the gradient against :mod:`simkit.mappings` and
the surrogate values against the papers' F (``mapping.f``). No double backward (nor a
functional transform of the loss itself: the kernels synchronise with the host).
:func:`band_clamp`, :func:`capped_exp` and :func:`analytic_surrogate` remain as differentiable
building blocks for code that wants a surrogate inside a larger autograd graph.

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
- Host synchronisations per call: whether the mask has padding (its byte minimum; a mask
  without padding skips the mask products and every row has length T), the range of the
  log-ratios (it decides whether a cap can bind and whether the padding needs the select), one
  more for the metrics, and clip_cov / kl_cov's subset (clip_cov: the per-block candidate
  counts; kl_cov: whether a NaN or ties straddle the k-th covariance), DPPO's undecided tokens
  (its trust-region test runs only on the tokens a proven bound does not settle) and, with
  padding, segment_is's count of runs (a row of one run of valid tokens is summed by one
  numpy reduction on CPU, the same sequential sums as the general path's ``index_add_``).
- Memory: on CPU a fresh (N, T) buffer is paid in page faults when the allocator has returned
  the memory to the system, so the kernels keep few full-size buffers alive at once (in-place
  steps, a broadcast 1 as the float mask of a full batch, the kernel's F and c released before
  the metrics allocate theirs; without padding clip_cov computes r = 1 + expm1(log r) from the
  batch's expm1 and takes the metrics' token sums from it before its buffer holds F, so that
  its metrics need neither an expm1 pass nor a buffer of their own — done with or without
  metrics, so that the loss does not depend on them). clip_cov and kl_cov locate their tokens
  through per-block summaries (:mod:`~simkit.lm.losses.selection`: candidate counts,
  covariance maxima) instead of a cumulative count or a top-k over all N·T tokens, with the
  same result; kl_cov's penalty is sparse (its k tokens), DRO's (and DPPO's with β > 0) dense
  (weighted per row, no index).
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

The code, one idea a module: :mod:`~simkit.lm.losses.loss` (:func:`policy_loss`, the forms),
:mod:`~simkit.lm.losses.kernels` (one kernel per mapping family),
:mod:`~simkit.lm.losses.autograd` (the custom autograd steps), :mod:`~simkit.lm.losses.batch`
(the batch a kernel receives), :mod:`~simkit.lm.losses.batch_weights` (PSIS, the M2PO mask),
:mod:`~simkit.lm.losses.aggregation`, :mod:`~simkit.lm.losses.inputs` (input checks),
:mod:`~simkit.lm.losses.selection` (clip_cov / kl_cov's token selection by block summaries) and
:mod:`~simkit.lm.losses.metrics`; every public name is importable from here.
"""

from simkit.lm.losses.aggregation import aggregation_scale
from simkit.lm.losses.autograd import analytic_surrogate, band_clamp, capped_exp
from simkit.lm.losses.batch_weights import (
    gpd_fit,
    gpd_quantile,
    m2po_removed,
    psis_smooth,
    psis_tail_length,
)
from simkit.lm.losses.loss import (
    DENOMINATORS,
    DETACHED,
    FORMS,
    SURROGATE,
    available,
    loss_form,
    policy_loss,
)
from simkit.lm.losses.metrics import METRICS

__all__ = [
    "DENOMINATORS",
    "DETACHED",
    "FORMS",
    "METRICS",
    "SURROGATE",
    "aggregation_scale",
    "analytic_surrogate",
    "available",
    "band_clamp",
    "capped_exp",
    "gpd_fit",
    "gpd_quantile",
    "loss_form",
    "m2po_removed",
    "policy_loss",
    "psis_smooth",
    "psis_tail_length",
]
