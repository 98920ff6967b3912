"""The public policy loss :func:`policy_loss` (and the composed losses of three policies):
builds the batch, runs the mapping's kernel, aggregates; the forms and conventions are in the
docstring of :mod:`simkit.lm.losses`."""

from __future__ import annotations

import math

import torch

from simkit import mappings as _mappings
from simkit.lm.losses.aggregation import _check_aggregation, _inverse_z
from simkit.lm.losses.autograd import linearised_loss
from simkit.lm.losses.batch import _Batch, _Terms
from simkit.lm.losses.inputs import _as_tensor, _check_inputs
from simkit.lm.losses.kernels import _KERNELS, _log
from simkit.lm.losses.kl_penalty import check_kl, loss_term, reward_penalty
from simkit.lm.losses.metrics import _extremes, _metrics
from simkit.mappings.base import Mapping

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
    "dro": SURROGATE,
    "dppo_tv": SURROGATE,
    "dppo_kl": SURROGATE,
    "luspo": SURROGATE,
    "rollout_is": DETACHED,
    "segment_is": DETACHED,
    "gepo": DETACHED,
}

#: aggregation denominators: ``valid`` (every valid token, verl's new engine) or ``kept`` (the
#: tokens a rejection mapping keeps, verl's legacy path that shrinks ``response_mask``)
DENOMINATORS = ("valid", "kept")


def available() -> list[str]:
    """Names of every mapping with a torch loss, in the order of ``simkit.mappings.available()``."""
    return [name for name in _mappings.available() if name in _KERNELS]


def loss_form(name: str) -> str:
    """``"surrogate"`` or ``"detached"``: how mapping ``name``'s loss carries its gradient."""
    if name not in FORMS:
        raise KeyError(f"unknown mapping {name!r}; available losses: {', '.join(available())}")
    return FORMS[name]


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
    allow_same_ratio: bool = False,
    ref_log_prob=None,
    kl=None,
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
    allow_same_ratio : bool
        ``mode="bypass"`` with a mapping and a correction that both carry the ratio (e.g. PPO
        clip × TIS: c = r·min(r, C) at A < 0, the ratio counted twice) is refused unless True,
        as :class:`simkit.estimators.Estimator` refuses it
        (:func:`simkit.composition.check_correction`).
    ref_log_prob, kl : optional
        A penalty β·KL(π‖π_ref) (:class:`simkit.kl.KLPenalty`, the same λ as
        ``Estimator(..., kl=...)``; :mod:`simkit.lm.losses.kl_penalty`): ``ref_log_prob`` (N, T)
        = log π_ref of the tokens. ``kl.where="loss"`` adds β·Σ (1/Z_i)·w·k(log π − log π_ref)
        over valid tokens, its gradient through log π (and through w = π/μ with
        ``correction="is"``, μ = ``rollout_log_prob`` if given, else ``old_log_prob``);
        ``"reward"`` subtracts β·Σ_t w·k (detached) from each row's advantage first.
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
    ref = check_kl(kl, ref_log_prob, log_prob, mask, dtype)
    if ref is not None:
        sampling = (
            old
            if rollout_log_prob is None
            else _as_tensor(rollout_log_prob, "rollout_log_prob", log_prob.device)
            .detach()
            .to(dtype)
        )
        if kl.where == "reward":
            adv = adv - reward_penalty(kl, log_prob.to(dtype), sampling, ref, mask)
    mask_bytes = mask.view(torch.uint8)  # (a bool → float cast is several times slower)
    full = mask.numel() == 0 or bool(mask_bytes.amin() == 1)  # no padding: no mask products
    if full:  # maskf a broadcast 1 (no memory), every row T long
        maskf = torch.ones((), dtype=dtype, device=mask.device).expand(mask.shape)
        lengths = torch.full(mask.shape[:1], float(mask.shape[1]), dtype=dtype, device=mask.device)
    else:
        maskf = mask_bytes.to(dtype)
        lengths = maskf.sum(dim=1)
    inv_z = _inverse_z(lengths, mask.shape[1], agg, max_length)
    inv_z_valid = inv_z  # the KL term's aggregation (valid tokens, whatever ``denominator``)
    surrogate = FORMS[mapping.name] == SURROGATE
    lp = lp.to(dtype)

    # log r = (log π − log μ)·mask, detached (the kernels run without autograd; a surrogate's
    # gradient is carried by one linearised step at the end): one multiplication, exact
    # whenever every log π − log μ is finite (padding included); otherwise (±inf/NaN garbage
    # somewhere) a select that keeps padded positions out of the values and of the gradient
    with torch.no_grad():
        log_ratio = lp - old if full else (lp - old).mul_(maskf)
    lr_min, lr_max = _extremes(log_ratio)
    finite = math.isfinite(lr_min) and math.isfinite(lr_max)
    if not finite:
        with torch.no_grad():
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
    log_w = log_ratio.sum(dim=1)
    log_s = log_w / lengths.clamp(min=1)  # 0 for an empty row (its log W is 0)
    needs_log_prob = mapping.uses_log_prob  # clip_cov, kl_cov, dppo_tv, dppo_kl, gepo
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
        mapping,
        correction,
        mode,
        rollout_log_prob,
        denominator,
        batch,
        old,
        dtype,
        allow_same_ratio,
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
        loss = _surrogate_loss(log_prob, terms, maskf, row_weight, inv_z, c_corr, full)
    else:
        with torch.no_grad():
            if terms.seq is not None:
                column = (terms.seq * row_weight)[:, None]
                # (a product of two broadcast operands is several times slower than a copy)
                token_weight = column.expand(mask.shape).contiguous() if full else maskf * column
            else:
                token_weight = (terms.tok * maskf).mul_(row_weight[:, None])
            if c_corr is not None:
                token_weight = token_weight * c_corr
        # the weights are 0 on padding; where log π may be non-finite there, zero it first
        log_pi = lp if finite else torch.where(mask, lp, 0.0)
        loss = -torch.dot(token_weight.reshape(-1), log_pi.reshape(-1))
    if ref is not None and kl.where == "loss":
        loss = loss + loss_term(kl, log_prob.to(dtype), sampling, ref, mask, inv_z_valid)
    if not compute_metrics:
        return loss, {}
    # the metrics need the counts only: F and c are released first (the metrics' own (N, T)
    # buffer then reuses their memory instead of growing the process's heap)
    counts = _Terms(n_clipped=terms.n_clipped, extra=terms.extra)
    del terms
    return loss, _metrics(batch, counts)


def _surrogate_loss(log_prob, terms, maskf, row_weight, inv_z, c_corr, full) -> torch.Tensor:
    """loss = −Σ F·w (+ Σ penalty·w_pen) with w = mask·A/Z (× the correction), and its
    gradient −c·w (+ ∂penalty·w_pen) w.r.t. ``log_prob`` (the kernel's c = ∂F/∂log r) carried
    by one :func:`linearised_loss` step: the backward is one multiplication. Without padding
    and correction the weights are per row: −Σ_i (A_i/Z_i)·Σ_t F_it (row sums, no (N, T)
    weight array). The penalty is sparse (kl_cov: w_pen = 1/Z_i (× the correction) on its K
    tokens, added to the gradient there) or dense (DRO, DPPO with β > 0: every position, no
    index). A ``scratch`` c is multiplied in place; a broadcast c = 1 (DRO) is not multiplied."""
    needs_grad = log_prob.requires_grad and torch.is_grad_enabled()
    with torch.no_grad():
        neg_row = row_weight.neg()[:, None]
        per_row = full and c_corr is None
        if per_row:
            weight = neg_row
            value = terms.tok.sum(dim=1) @ neg_row[:, 0]
        else:  # c_corr is 0 on padding; the broadcast 1 of a full batch is not multiplied
            if c_corr is None:
                weight = maskf * neg_row
            else:
                weight = c_corr * neg_row if full else (maskf * neg_row).mul_(c_corr)
            value = torch.dot(terms.tok.reshape(-1), weight.reshape(-1))
        grad = None
        if needs_grad:
            if terms.scratch:
                grad = terms.dtok.mul_(weight)
            elif terms.dtok.stride() == (0, 0):  # c = 1 (a broadcast one): −w itself (1·w = w)
                grad = weight.expand(maskf.shape).contiguous()
            else:
                grad = terms.dtok * weight
        if terms.penalty is not None and terms.penalty_index is None:
            # a dense penalty (every position, row-major): w_pen = 1/Z_i (× the correction) per
            # token, the same numbers as the gathered weights of a sparse one at every index
            pen_weight = inv_z[:, None].expand(maskf.shape)
            if c_corr is not None:
                pen_weight = pen_weight * c_corr
            value = value + torch.dot(terms.penalty.reshape(-1), pen_weight.reshape(-1))
            if needs_grad:  # (index_add_ of unique indices in order: the same additions)
                grad.add_(terms.dpenalty.view(maskf.shape) * pen_weight)
        elif terms.penalty is not None:
            index = terms.penalty_index
            pen_weight = inv_z[torch.div(index, max(maskf.shape[1], 1), rounding_mode="floor")]
            if c_corr is not None:
                pen_weight = pen_weight * c_corr.reshape(-1)[index]
            value = value + torch.dot(terms.penalty, pen_weight)
            if needs_grad:
                grad.view(-1).index_add_(0, index, terms.dpenalty * pen_weight)
    return linearised_loss(log_prob, value, grad) if needs_grad else value


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


def _correction_weights(
    mapping, correction, mode, rollout_log_prob, denominator, b, old, dtype, allow_same_ratio=False
):
    """(correction Mapping or None, its detached token weights (N, T) or None); for
    ``trl_vespo`` the second item is φ(W) per row (N,) with the token correction in W."""
    from simkit import composition

    corr = composition.check_correction(mapping, correction, mode, denominator, allow_same_ratio)
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
        return corr, (c.contiguous() if b.full else c * b.maskf)


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
