"""Composed estimators: a mapping on the staleness ratio π/π_old × a correction on π_old/μ.

A real trainer holds three policies: μ (the inference engine that sampled the rollout),
π_old (the trainer's recomputation of the rollout-time policy) and π (the policy being
updated). With the token log-ratios

    ℓ_t = log π − log μ          (what every simkit batch carries: ``log_ratio``)
    o_t = log π_old − log μ      (``old_log_ratio``; None means π_old = π, i.e. o = ℓ)

the composed coefficient of :class:`simkit.estimators.Estimator` with ``correction`` set is

- ``mode="decoupled"``: c = c_mapping(ℓ − o) · c_correction(o) — verl's decoupled mode
  (``actor_rollout_ref.actor.policy_loss`` on log π − log π_old with the detached
  ``rollout_is_weights`` of ``algorithm.rollout_correction`` (``rollout_is``, ``rollout_rs``)
  on log π_old − log μ, ``core_algos.py`` / ``rollout_corr_helper.py`` at b178a3c) and TRL's
  ``vllm_importance_sampling_correction`` (``grpo_trainer.py`` at f2cd577: the per-token loss
  of π/π_old times ``importance_sampling_ratio`` = truncated or masked π_old/μ);
- ``mode="bypass"``: π_old := μ, both act on the one ratio π/μ: c = c_mapping(ℓ)·c_correction(ℓ)
  — verl's ``bypass_mode`` (old_log_prob = rollout_log_prob; REINFORCE with IS weights, or
  PPO-clip with the rejection mask only: pass ``correction=None``/a mask accordingly). When
  both the mapping and the correction carry the ratio (:func:`carries_ratio`: PPO clip × TIS,
  c = r·min(r, C) — the ratio counted twice, which verl's bypass mode refuses) the
  composition is refused unless ``allow_same_ratio=True``;
- ``mode="trl_vespo"``: TRL's VESPO (``GRPOTrainer.get_gamma_weights``, f2cd577), which folds
  the token correction into the sequence ratio instead of multiplying the loss:
  log W = Σ_t clip(ℓ_t − o_t, ±``max_log_ratio_tok``) + Σ_t clip(log w_t, log 1e-8, 20) with
  w_t = c_correction(o)_t (``tis_token`` = TRL ``token_truncate``, ``mis_token`` / ``icepop`` =
  ``token_mask``: a masked token enters W as 1e-8, it is not dropped), then c = φ(W) with the
  mapping's (VESPO's) sequence clamp and (k, λ).

``correction=None`` is the single-ratio estimator of before, c = c_mapping(ℓ), bit for bit
(whatever π_old is: an estimator without correction ignores it). The pieces are pure functions
of (N, T) arrays; :class:`~simkit.estimators.Estimator` calls them row-batch by row-batch.
"""

from __future__ import annotations

import math

import numpy as np

from simkit._validation import like_log_ratio
from simkit.mappings import Mapping, as_mapping

MODES = ("decoupled", "bypass", "trl_vespo")
DENOMINATORS = ("valid", "kept")
#: mappings whose loss is a surrogate through the ratio (not a detached weight): they cannot be
#: a ``correction`` (the surrogate forms of ``simkit.lm.losses.FORMS`` except ``is_token``, whose
#: coefficient r_t is also the detached token IS weight; a test checks the list)
SURROGATE_MAPPINGS = (
    "ppo_clip",
    "dual_clip",
    "dapo",
    "gspo",
    "gmpo",
    "sapo",
    "luffy",
    "aspo",
    "m2po",
    "clip_cov",
    "kl_cov",
    "dro",
    "dppo_tv",
    "dppo_kl",
    "luspo",
)
#: corrections TRL's VESPO folds into W (token-level truncation or mask)
TRL_VESPO_CORRECTIONS = ("tis_token", "mis_token", "icepop")
#: TRL's clamp of the log importance ratio folded into VESPO's W (f2cd577)
TRL_LOG_IS_LOW, TRL_LOG_IS_HIGH = math.log(1e-8), 20.0


#: log-ratios (two rows, A = +1 and −1) near on-policy, inside every mapping's trust band:
#: the probe of :func:`carries_ratio` (unequal, so that sequence ratios differ from 1 too)
_PROBE_LOG_RATIO = np.array([[0.03, 0.05, -0.01, 0.02], [0.04, -0.02, 0.03, 0.01]])


def carries_ratio(mapping: Mapping) -> bool:
    """True when the mapping's coefficient moves with the ratio near on-policy: some c on the
    probe log-ratios (|ℓ| ≤ 0.05, A = ±1) is neither 0 nor 1. False for REINFORCE (``naive``)
    and the pure masks (``geo_mask``, ``opsm``, ``token_veto``, ``kl_rs``, ``topr``), whose c is 0
    or 1; True for PPO clip (c = r in the band), TIS (min(r, C)), masked IS (r·1[band]), VESPO…
    Two such factors on the one ratio π/μ count it twice."""
    lr = _PROBE_LOG_RATIO
    # mappings that need log π get a probe with π(y_t) = 0.5·r_t (μ(y_t) = 0.5)
    log_prob = lr + math.log(0.5) if mapping.requires_log_prob else None
    c = call(
        mapping,
        lr,
        np.ones(lr.shape, bool),
        np.array([1.0, -1.0]),
        np.random.default_rng(0),
        log_prob,
    )
    return bool(np.any((np.abs(c) > 1e-12) & (np.abs(c - 1.0) > 1e-12)))


def check_correction(
    mapping: Mapping, correction, mode: str, denominator: str, allow_same_ratio: bool = False
):
    """Validate the composition fields; return the correction as a Mapping (or None).

    ``mode="bypass"`` with a mapping and a correction that both carry the ratio
    (:func:`carries_ratio`) is refused unless ``allow_same_ratio``: both would act on the one
    ratio π/μ (bypass PPO clip × TIS gives c = r·min(r, C) at A < 0)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if denominator not in DENOMINATORS:
        raise ValueError(
            f"unknown denominator {denominator!r}; valid denominators: {', '.join(DENOMINATORS)}"
        )
    if correction is None:
        if mode == "trl_vespo":
            raise ValueError("mode 'trl_vespo' needs a correction (tis_token or mis_token)")
        return None
    correction = as_mapping(correction, "correction", none=True)
    if correction.name in SURROGATE_MAPPINGS:
        raise ValueError(
            f"correction {correction.name!r} is a surrogate loss, not a detached weight; "
            f"a correction is one of: "
            + ", ".join(n for n in _available() if n not in SURROGATE_MAPPINGS)
        )
    if correction.requires_log_prob:
        raise ValueError(
            f"correction {correction.name!r} needs log π itself (requires_log_prob), which the "
            "correction's leg π_old/μ does not carry; use it as the mapping instead"
        )
    if mapping.has_additive:
        raise ValueError(
            f"mapping {mapping.name!r} has an additive per-token term (−β·log r); composing it "
            "with a correction is not supported (use it without a correction, or beta = 0)"
        )
    if mode == "trl_vespo":
        if mapping.name != "vespo":
            raise ValueError(f"mode 'trl_vespo' needs mapping 'vespo', got {mapping.name!r}")
        if correction.name not in TRL_VESPO_CORRECTIONS:
            raise ValueError(
                f"mode 'trl_vespo' folds a token correction into W; correction must be one of "
                f"{', '.join(TRL_VESPO_CORRECTIONS)}, got {correction.name!r}"
            )
    if mode == "bypass" and not allow_same_ratio and carries_ratio(mapping):
        if carries_ratio(correction):
            raise ValueError(
                f"mode 'bypass' sets π_old := μ, so mapping {mapping.name!r} and correction "
                f"{correction.name!r} would both act on the one ratio π/μ (the ratio counted "
                "twice, e.g. PPO clip × TIS gives c = r·min(r, C)); use mode 'decoupled' "
                "(mapping on π/π_old, correction on π_old/μ), a mask correction (geo_mask, "
                "opsm, token_veto), or allow_same_ratio=True to compose them anyway"
            )
    return correction


def _available():
    from simkit.mappings import available

    return available()


def call(mapping: Mapping, log_ratio, mask, advantages, rng=None, log_prob=None) -> np.ndarray:
    """``mapping.coefficients`` (2-D), with ``rng`` for a stochastic mapping and ``log_prob``
    (log π, (N, T)) for one that reads it (clip_cov, kl_cov; None: they use the log-ratio) or
    needs it (``requires_log_prob``: the mapping raises without it)."""
    kwargs = {}
    if mapping.stochastic:
        kwargs["rng"] = rng
    if mapping.uses_log_prob and log_prob is not None:
        kwargs["log_prob"] = log_prob
    return mapping.coefficients(log_ratio, mask, advantages, **kwargs)


def legs(log_ratio, old_log_ratio) -> tuple[np.ndarray, np.ndarray]:
    """(log π − log π_old, log π_old − log μ) from ℓ = log π − log μ and o = log π_old − log μ
    (o = None: π_old = π, the staleness leg is 0). Non-finite padding stays out: the caller
    passes the mask to every mapping."""
    lr = np.asarray(log_ratio, dtype=np.float64)
    if old_log_ratio is None:
        return np.zeros_like(lr), lr
    old = like_log_ratio(old_log_ratio, lr, "old_log_ratio")
    with np.errstate(invalid="ignore"):
        return lr - old, old


def composed_coefficients(
    mapping,
    correction,
    mode,
    log_ratio,
    mask,
    advantages,
    old_log_ratio=None,
    rng=None,
    log_prob=None,
) -> np.ndarray:
    """c of a composed estimator on one batch (N, T) (module docstring): the two coefficient
    arrays and one in-place multiply (``trl_vespo``: one log-space pass for both legs). Row
    blocking brings nothing here: every mapping already runs its kernel over cache-sized
    blocks (measured in ``benchmarks/bench_composition.py``)."""
    lr = np.asarray(log_ratio, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    adv = np.asarray(advantages, dtype=np.float64)
    old = None if old_log_ratio is None else np.asarray(old_log_ratio, dtype=np.float64)
    return _composed_block(mapping, correction, mode, lr, m, adv, old, rng, log_prob)


def _composed_block(mapping, correction, mode, lr, m, adv, old, rng, log_prob) -> np.ndarray:
    if mode == "bypass":
        c = call(mapping, lr, m, adv, rng, log_prob)
        c *= call(correction, lr, m, adv, rng)
        return c
    stale, infer = legs(lr, old)
    if mode == "decoupled":
        c = call(mapping, stale, m, adv, rng, log_prob)
        c *= call(correction, infer, m, adv, rng)
        return c
    return _trl_vespo(mapping, correction, stale, infer, m, adv)


def trl_log_weights(correction, infer: np.ndarray) -> np.ndarray:
    """log w_t of TRL's token correction, clamped to [log 1e-8, 20], in log space.

    ``token_truncate`` (tis_token): log clip(e^o, c_low, c_high) = clip(o, log c_low,
    log c_high); ``token_mask`` (mis_token, icepop): o inside the band, else log 0 → log 1e-8.
    Padding values are returned as they come (the caller masks them).
    """
    lo_c = math.log(correction.c_low) if correction.c_low > 0 else -math.inf
    hi_c = math.log(correction.c_high) if math.isfinite(correction.c_high) else math.inf
    if correction.name == "tis_token":
        lo = max(lo_c, TRL_LOG_IS_LOW)
        hi = min(hi_c, TRL_LOG_IS_HIGH, correction.max_log_ratio)
        return np.clip(infer, lo, max(lo, hi))
    out = np.clip(infer, TRL_LOG_IS_LOW, min(TRL_LOG_IS_HIGH, correction.max_log_ratio))
    with np.errstate(invalid="ignore"):
        outside = (infer < lo_c) | (infer > hi_c)
    out[outside] = TRL_LOG_IS_LOW
    return out


def _trl_vespo(vespo, correction, stale, infer, mask, advantages) -> np.ndarray:
    """TRL's get_gamma_weights with the token correction folded into log W."""
    cap = vespo.max_log_ratio_tok
    tok = np.clip(stale, -cap, cap)
    tok += trl_log_weights(correction, infer)
    log_w = np.add.reduce(tok, axis=1, where=mask, initial=0.0)
    return vespo.coefficients_from_log_w(log_w, mask, advantages)


def kept_tokens(
    mapping, correction, mode, log_ratio, mask, advantages, old_log_ratio=None
) -> np.ndarray:
    """Tokens surviving the rejections of the estimator, (N, T) bool (``denominator="kept"``):
    the mapping's and the correction's ``kept_mask`` on their own legs (TRL's VESPO: every
    valid token — TRL divides by the valid tokens)."""
    m = np.asarray(mask, dtype=bool)
    if correction is None:
        return mapping.kept_mask(log_ratio, m, advantages)
    if mode == "trl_vespo":
        return m.copy()
    if mode == "bypass":
        stale = infer = np.asarray(log_ratio, dtype=np.float64)
    else:
        stale, infer = legs(log_ratio, old_log_ratio)
    return mapping.kept_mask(stale, m, advantages) & correction.kept_mask(infer, m, advantages)
