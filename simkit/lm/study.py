"""Gradient study on a real language model, and its comparison with the token-MDP simulation.

**The study** (:func:`gradient_study`). A policy π (a causal LM), a behaviour μ derived from it
(:class:`Behaviour`: a logit transform such as a temperature, and/or another model such as a
stale or noisy copy; the generators of :mod:`simkit.lm.mismatch` build them), prompts with a
verifiable reward (:mod:`simkit.lm.tasks`). Every estimator of the catalogue is the weighted
policy gradient of the notation page

    ĝ = Σ_i Σ_t λ_{i,t} ∇θ log π(y_{i,t} | x_i, y_{i,<t}),     y_i ~ μ(·|x_i),

with λ = −∂loss/∂log π taken from the torch loss a trainer would call
(:func:`simkit.lm.losses.policy_loss`, ``loss_path="torch"``) or, equivalently, c·A/Z from the
numpy registry (``loss_path="numpy"``). θ is a chosen parameter subset (:func:`select_parameters`:
``lm_head``, ``norm``, ``last_layer``, ``last_mlp`` or explicit names). The per-token scores
∇θ log π(y_t|…) of a batch are computed once (:func:`per_token_scores`: in closed form from the
final hidden states for the final norm weight and an untied lm_head (:func:`head_scores`, one
forward pass), else ``torch.func`` ``vmap(jacrev(functional_call))`` or a loop of backward
passes), so every estimator of the
batch costs one contraction ĝ = einsum(λ, S): all estimators see the same batches (common random
numbers), as in :func:`simkit.experiment.run`.

The truth ∇J is unknown on an LM, so it is *estimated* on-policy: M independent responses from π
give the REINFORCE terms u_j = (R_j − b)·Σ_t ∇θ log π(y_{j,t}) (Williams 1992), with b an
estimate of J from a separate pilot batch (a constant independent of the u_j, so E u_j = ∇J
exactly); ∇̂J = mean u_j with covariance Σ_u/M. The estimator side is ``reps`` independent
batches of n responses from μ, ĝ_r, mean ḡ, covariance Σ_g (per batch).

**Honest bias.** ‖ḡ − ∇̂J‖² over-estimates the squared bias ‖E ĝ − ∇J‖² by the Monte Carlo floor
tr(Σ_g)/R + tr(Σ_u)/M (both means are noisy). The table reports ``bias_sq`` = ‖ḡ − ∇̂J‖² −
tr(Σ̂_g)/R − tr(Σ̂_u)/M (unbiased: Σ̂ are the unbiased sample covariances; it can be negative),
``bias`` = √max(bias_sq, 0), and ``bias_sq_se``, its standard error under the Gaussian
approximation Var‖Δ̂‖² = 2·tr(Σ²) + 4·ΔᵀΣΔ with Σ = Σ_g/R + Σ_u/M (traces of squared covariances
from Gram matrices, without forming D×D matrices). ``bias_lo``/``bias_hi`` are
√max(bias_sq ∓ z·bias_sq_se, 0) (z the normal quantile of ``level``); ``bias_dir_lo``/``_hi``
come from a confidence ball for E ĝ − ∇J (radius: the ``level`` quantile of ‖Δ̂* − Δ̂‖ over a
bootstrap that resamples the batches and the reference draws independently), as in
:mod:`simkit.experiment`. The reference carries its own standard error: ``ref_se`` =
√(tr Σ̂_u/M) (the root-mean-square error of ∇̂J, summed over the D coordinates) and
``ref_variance`` = tr Σ̂_u.

Columns (the same tidy layout as :func:`simkit.experiment.run`, ``exact=False``): ``estimator``,
``mapping``, ``aggregation``, ``advantage``, ``group_size``, ``adv_eps``, ``max_length``, the
mapping hyperparameters, the setting, ``T`` (max response length), ``n``, ``reps``, ``n_ref``,
``chi2_tok``/``kl_tok``/``tv_tok`` (exact over the vocabulary at every visited response position,
averaged over μ's tokens), ``chi2_seq``/``kl_seq``/``tv_seq`` (Monte Carlo from μ's draws:
E_μ W² − 1, E_μ[W log W], ½E_μ|W − 1|, W = π(y)/μ(y)), ``bias``, ``bias_dir``, ``cosine``,
``variance``, ``mse``, ``snr``, ``ess``, ``mse_scaled``, ``rel_mse_scaled``, ``kept``,
``kept_seq`` (each with ``_lo``/``_hi``), ``mse_zero``, ``alpha_star``, ``khat``, ``exact``,
and ``bias_sq``, ``bias_sq_se``, ``grad_norm`` (debiased ‖∇J‖), ``ref_variance``, ``ref_se``,
``J`` (the pilot estimate of J(π)), ``J_mu`` (the pilot estimate of J(μ)), ``reliable``,
``tail_draws``, and ``behaviour``, ``strength`` (μ's generator and knob).

**Baselines.** The ``oracle`` advantage is A = R − J(μ) (DESIGN.md: the baseline real trainers
estimate, centred under the sampling law); J(μ) is the mean reward of ``n_pilot`` separate
draws from μ (a constant independent of the batches, column ``J_mu``). ``oracle_pi`` uses the
pilot estimate of J(π) (column ``J``), which is also the reference's baseline b.

**Scale-free error** (:func:`simkit.lm.metrics.scale_free_statistics`, the formulas of
:func:`simkit.experiment.metrics.scale_free`): ``mse_zero`` = ‖∇J‖² (the error of ĝ ≡ 0),
``alpha_star`` = ⟨E ĝ, ∇J⟩/E‖ĝ‖² (the best step size), ``mse_scaled`` = ‖∇J‖² −
⟨E ĝ, ∇J⟩²/E‖ĝ‖² (the error after that step size, which a learning-rate sweep finds) and
``rel_mse_scaled`` = mse_scaled/mse_zero ∈ [0, 1] (1: no better than doing nothing). MSE
rewards estimators that shrink or drop samples; these do not. Each piece is estimated without
bias from the draws: ⟨E ĝ, ∇J⟩² by a U-statistic over distinct (batch, reference) pairs — the
plug-in ⟨ḡ, ∇̂J⟩² would add Var⟨ĝ, ∇J⟩/reps —, E‖ĝ‖² by the mean of ‖ĝ_r‖², ‖∇J‖² by
‖∇̂J‖² − tr Σ̂_u/M; bounds by the same bootstrap as the other metrics. ``kept`` / ``kept_seq``:
the share of valid tokens with a non-zero coefficient and of responses with one
(:func:`simkit.lm.metrics.kept_statistics`).

**Reliability** (:func:`simkit.lm.metrics.draw_reliability`): ``reliable`` is the rule of
:mod:`simkit.reliability` on the draws (k̂ and largest share of the per-batch squared errors,
and the tail-draw count ν̂ = N·(mean c̄²)²/mean c̄⁴ from the drawn coefficients, ``tail_draws``).

The pieces live in their own modules: :mod:`simkit.lm.behaviour` (μ), :mod:`simkit.lm.sampling`
(drawing responses), :mod:`simkit.lm.scores` (per-token scores, per-sample gradients),
:mod:`simkit.lm.metrics` (bias and variance with their intervals); the comparison with the
simulation is :mod:`simkit.lm.twin`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from simkit import mappings as _mappings
from simkit._validation import int_at_least
from simkit.estimators import Estimator, as_estimator, as_estimators
from simkit.experiment.table import DIVERGENCE_COLUMNS, ESTIMATOR_COLUMNS, METRIC_COLUMNS, describe
from simkit.lm.behaviour import Behaviour
from simkit.lm.metrics import _resample_weights, gradient_metrics
from simkit.lm.mismatch import prepare_pair
from simkit.lm.sampling import _chunked_draws, _draw, _model_device_dtype, _seed_of
from simkit.lm.scores import (
    GRAD_METHODS,
    LOSS_PATHS,
    parameter_dim,
    resolve_grad_method,
    select_parameters,
)

#: largest number of stored gradient values E·R·D (float64) of one study (about 1.6 GB)
MAX_STORED_VALUES = 200_000_000


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's parameters (names, shapes, Σθ and Σθ² in float64): two
    studies share a reference gradient only if they ran on the same π."""
    import hashlib

    h = hashlib.sha256()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            x = prm.detach().double()
            h.update(f"{name}{tuple(prm.shape)}{float(x.sum())!r}{float((x * x).sum())!r}".encode())
    return h.hexdigest()[:16]


# --- estimator weights -----------------------------------------------------------------------


def estimator_token_weights(
    estimator, log_prob, old_log_prob, mask, rewards, J: float, loss_path: str = "torch"
) -> tuple[np.ndarray, np.ndarray]:
    """λ (N, T) with ĝ = Σ λ_{i,t} ∇ log π(y_{i,t}), and the mapping's coefficients c (N, T).

    ``loss_path="torch"``: λ = −∂loss/∂log_prob of :func:`simkit.lm.losses.policy_loss` (the
    trainer's loss, autograd in float64); ``"numpy"``: λ = (c·A + b)/Z of
    :meth:`simkit.estimators.Estimator.token_weights` (b the additive term of dro). The two
    agree (the losses' registry consistency test). c always comes from the numpy registry (for
    ESS and k̂). Inputs are numpy arrays: ``log_prob`` = log π, ``old_log_prob`` = log μ of the
    sampled tokens, ``mask`` (N, T) bool, ``rewards`` (N,), ``J`` the baseline of the ``oracle``
    advantage. Leading batch axes (L..., N, T) are independent batches.
    """
    est = as_estimator(estimator)
    if loss_path not in LOSS_PATHS:
        raise ValueError(f"loss_path must be one of {LOSS_PATHS}, got {loss_path!r}")
    log_prob = np.asarray(log_prob, dtype=np.float64)
    old = np.asarray(old_log_prob, dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    rewards = np.asarray(rewards, dtype=np.float64)
    if log_prob.ndim < 2 or old.shape != log_prob.shape or mask.shape != log_prob.shape:
        raise ValueError(
            f"log_prob, old_log_prob and mask must share a shape (..., N, T), got "
            f"{log_prob.shape}, {old.shape}, {mask.shape}"
        )
    if rewards.shape != log_prob.shape[:-1]:
        raise ValueError(f"rewards must have shape {log_prob.shape[:-1]}, got {rewards.shape}")
    log_ratio = np.where(mask, log_prob - old, 0.0)
    adv = est.advantages(rewards, J)
    lp = np.where(mask, log_prob, 0.0)
    c = est.coefficients(log_ratio, mask, adv, log_prob=lp)
    if loss_path == "numpy":
        weights = est.aggregation_weights(mask)
        lam = c * adv[..., None] * weights
        b = est.additive_terms(log_ratio, mask, lp)  # dro, dppo with beta > 0
        return (lam if b is None else lam + b * weights), c
    if log_prob.ndim > 2:
        lead = log_prob.shape[:-2]
        flat = [
            estimator_token_weights(est, a, b, m, r, J, loss_path)[0]
            for a, b, m, r in zip(
                log_prob.reshape(-1, *log_prob.shape[-2:]),
                old.reshape(-1, *old.shape[-2:]),
                mask.reshape(-1, *mask.shape[-2:]),
                rewards.reshape(-1, rewards.shape[-1]),
            )
        ]
        return np.stack(flat).reshape(*lead, *log_prob.shape[-2:]), c
    from simkit.lm import losses

    lp = torch.tensor(np.where(mask, log_prob, 0.0), dtype=torch.float64, requires_grad=True)
    loss, _ = losses.policy_loss(
        est.mapping.name,
        lp,
        torch.tensor(np.where(mask, old, 0.0), dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask),
        agg=est.aggregation,
        max_length=est.max_length,
        **est.mapping.hyperparameters,
    )
    (g,) = torch.autograd.grad(loss, lp)
    return -g.numpy(), c


# --- the study -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyResult:
    """What :func:`gradient_study` measured.

    ``table``: the tidy DataFrame (module docstring), one row per estimator. ``profile``: per
    response position t, ``chi2_tok``, ``kl_tok``, ``tv_tok`` (exact, averaged over μ's visited
    states at t), ``running`` (fraction of μ's responses still running at t) and ``tokens``.
    ``lengths``: the response length of every μ draw (reps·n,). ``J``, ``J_se``: the pilot
    estimate of J(π) (the reference's and ``oracle_pi``'s baseline); ``J_mu``, ``J_mu_se``:
    that of J(μ) (the ``oracle`` baseline). ``reference`` (D,) ∇̂J; ``grad_norm`` the debiased
    ‖∇J‖; ``param_names``, ``D``. ``gradients`` (E, R, D) the ĝ_r of each estimator and
    ``reference_samples`` (M, D) (kept for further analysis). ``fingerprint``: the
    :func:`model_fingerprint` of π (a reference is reused only on the same π).
    """

    table: pd.DataFrame
    profile: pd.DataFrame
    lengths: np.ndarray
    J: float
    J_se: float
    reference: np.ndarray
    grad_norm: float
    param_names: tuple[str, ...]
    D: int
    gradients: np.ndarray = field(repr=False)
    reference_samples: np.ndarray = field(repr=False)
    fingerprint: str = ""
    J_mu: float = math.nan
    J_mu_se: float = math.nan


def _prompt_layout(rng: np.random.Generator, n_prompts: int, n: int, group_size: int):
    return np.repeat(rng.integers(0, n_prompts, size=n // group_size), group_size)


_EXTRA_COLUMNS = [
    "khat",
    "exact",
    "bias_sq",
    "bias_sq_se",
    "grad_norm",
    "ref_variance",
    "ref_se",
    "J",
    "J_mu",
    "reliable",
    "tail_draws",
]
_RESERVED = {
    *ESTIMATOR_COLUMNS,
    "T",
    "n",
    "reps",
    "n_ref",
    *DIVERGENCE_COLUMNS,
    *METRIC_COLUMNS,
    *_EXTRA_COLUMNS,
}


def _pilot_mean(model, behaviour, common, n_prompts, n_pilot, chunk, ss, torch_gen):
    """Mean reward of ``n_pilot`` draws from ``behaviour`` and its standard error."""
    r = np.concatenate(
        [
            d.rewards
            for _, d in _chunked_draws(
                model,
                behaviour,
                common,
                n_prompts,
                n_pilot,
                chunk,
                ss,
                torch_gen,
                with_scores=False,
            )
        ]
    )
    se = float(r.std(ddof=1) / math.sqrt(len(r))) if len(r) > 1 else math.nan
    return float(r.mean()), se


def _pilot_and_reference(
    model, on_policy, common, n_prompts, n_pilot, n_ref, chunk, ss_pilot, ss_ref, torch_gen, bar
):
    """J from ``n_pilot`` on-policy rewards; REINFORCE terms u_j (n_ref, D) with baseline J."""
    pilot_r = np.concatenate(
        [
            d.rewards
            for _, d in _chunked_draws(
                model,
                on_policy,
                common,
                n_prompts,
                n_pilot,
                chunk,
                ss_pilot,
                torch_gen,
                with_scores=False,
            )
        ]
    )
    J = float(pilot_r.mean())
    J_se = float(pilot_r.std(ddof=1) / math.sqrt(len(pilot_r))) if len(pilot_r) > 1 else math.nan
    ref_rows = []
    for k, d in _chunked_draws(
        model, on_policy, common, n_prompts, n_ref, chunk, ss_ref, torch_gen
    ):
        adv = torch.as_tensor(d.rewards - J, dtype=torch.float64, device=d.scores.device)
        u = torch.einsum("n,ntd->nd", adv, d.scores.double())
        ref_rows.append(u.cpu().numpy())
        bar.update(k)
    return J, J_se, np.concatenate(ref_rows), bar


def gradient_study(
    model: torch.nn.Module,
    task,
    estimators,
    *,
    behaviour=None,
    tokenizer=None,
    params: str | Sequence[str] = "lm_head",
    n: int = 8,
    reps: int = 32,
    n_ref: int = 256,
    n_pilot: int = 256,
    max_new_tokens: int = 8,
    eos_token_id: int | None = None,
    group_size: int = 1,
    seed: int = 0,
    loss_path: str = "torch",
    grad_method: str = "auto",
    chunk_size: int | None = None,
    level: float = 0.95,
    n_boot: int = 200,
    setting: dict | None = None,
    progress: bool | None = None,
    rows_per_call: int = 64,
    reference: StudyResult | None = None,
) -> StudyResult:
    """Bias / variance of ``estimators`` on a language model (module docstring).

    Parameters
    ----------
    model : causal LM (transformers ``LlamaForCausalLM`` or any module returning ``.logits``),
        in eval mode, on the device the study runs on (CPU or CUDA: everything follows it).
    task : a task of :mod:`simkit.lm.tasks` (prompts + verifiable reward).
    estimators : :class:`~simkit.estimators.Estimator` objects, mappings or mapping names.
    behaviour : μ (:func:`resolve_behaviour`: None on-policy, a temperature, a
        :class:`Behaviour`, a :mod:`simkit.lm.mismatch` generator or prepared pair; a
        staleness generator trains π away from ``model``). Its name and strength become the
        ``behaviour`` and ``strength`` columns.
    params : parameter subset θ (:func:`select_parameters`).
    n, reps : batch size and number of independent batches from μ.
    n_ref : on-policy draws of the REINFORCE reference ∇̂J; ``n_pilot``: draws from π for the
        baseline J(π) and, separately, from μ for J(μ).
    max_new_tokens, eos_token_id : response length T and optional stop token.
    group_size : responses per prompt inside a batch (consecutive rows; the group advantages
        need it equal to their G); prompts are drawn uniformly.
    seed : one ``SeedSequence`` spawns the pilot, reference, batch and bootstrap streams.
    loss_path : ``"torch"`` (λ from the torch losses) or ``"numpy"``
        (:func:`estimator_token_weights`).
    grad_method, chunk_size : :func:`per_token_scores`.
    level, n_boot : confidence level and bootstrap resamples of the bounds.
    setting : extra constant columns.
    progress : tqdm bar over drawn responses (None: only for long studies).
    rows_per_call : responses sampled and scored per model call (several batches at once;
        lower it to bound memory: the scores of one call take rows·T·D values).
    reference : a previous :class:`StudyResult` on the same model, task, parameters and T
        whose pilot J(π) and reference draws are reused (``n_ref`` then ignored; μ's pilot is
        drawn): several behaviours compared against one ∇̂J.
    """
    ests = as_estimators(estimators)
    n = int_at_least(n, "n", 1)
    reps = int_at_least(reps, "reps", 2)
    n_ref = int_at_least(n_ref, "n_ref", 2)
    n_pilot = int_at_least(n_pilot, "n_pilot", 1)
    T = int_at_least(max_new_tokens, "max_new_tokens", 1)
    G = int_at_least(group_size, "group_size", 1)
    n_boot = int_at_least(n_boot, "n_boot", 10)
    rows_per_call = int_at_least(rows_per_call, "rows_per_call", 1)
    if n % G:
        raise ValueError(f"n = {n} must be a multiple of group_size = {G}")
    for est in ests:
        est.check_batch_size(n)
        if est.group_size is not None and est.group_size != G:
            raise ValueError(
                f"estimator {est.name!r} has group_size {est.group_size} but the batches are "
                f"laid out in groups of group_size = {G}"
            )
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if loss_path not in LOSS_PATHS:
        raise ValueError(f"loss_path must be one of {LOSS_PATHS}, got {loss_path!r}")
    if grad_method not in GRAD_METHODS:
        raise ValueError(f"grad_method must be one of {GRAD_METHODS}, got {grad_method!r}")
    setting = dict(setting or {})
    clash = sorted(set(setting) & _RESERVED)
    if clash:
        raise ValueError(f"setting keys {clash} clash with result columns; rename them")
    model, mu = prepare_pair(behaviour, model, task, tokenizer, eos_token_id, T)
    setting = {"behaviour": mu.name, "strength": mu.strength, **setting}
    param_names = select_parameters(model, params)
    grad_method = resolve_grad_method(model, param_names, grad_method)
    fingerprint = model_fingerprint(model)
    D = parameter_dim(model, param_names)
    if len(ests) * reps * D > MAX_STORED_VALUES:
        raise ValueError(
            f"{len(ests)} estimators × {reps} batches × D = {D} parameters is too much to store; "
            "choose a smaller parameter subset (params='norm' or 'last_mlp') or fewer reps"
        )
    model.eval()
    device, _ = _model_device_dtype(model)
    prompts = task.prompt_ids(tokenizer)
    # a fifth child for μ's pilot (children 0–3 are those of spawn(4): the same streams)
    ss_pilot, ss_ref, ss_batch, ss_boot, ss_pilot_mu = np.random.SeedSequence(seed).spawn(5)

    def torch_gen(ss):
        gen = torch.Generator(device=device)
        gen.manual_seed(_seed_of(ss))
        return gen

    common = dict(
        task=task,
        tokenizer=tokenizer,
        prompts=prompts,
        max_new_tokens=T,
        eos_token_id=eos_token_id,
        param_names=param_names,
        grad_method=grad_method,
        chunk_size=chunk_size,
    )
    chunk = max(rows_per_call, 1)
    on_policy = Behaviour()
    if progress is None:
        progress = D * T * (reps * n + n_ref) > 50_000_000
    from tqdm.auto import tqdm

    if reference is not None:
        if not isinstance(reference, StudyResult):
            raise TypeError(f"reference must be a StudyResult, got {type(reference).__name__}")
        if reference.fingerprint and reference.fingerprint != fingerprint:
            raise ValueError(
                "reference was measured on another target policy π (its parameters differ; "
                "a staleness generator trains π): run the reference study on this π"
            )
        if reference.param_names != param_names or int(reference.table["T"].iloc[0]) != T:
            raise ValueError(
                "reference was measured on other parameters or another response length: "
                f"{reference.param_names}, T = {int(reference.table['T'].iloc[0])} vs "
                f"{param_names}, T = {T}"
            )
        J, J_se, U = reference.J, reference.J_se, reference.reference_samples
        n_ref = U.shape[0]
        bar = tqdm(total=reps * n, desc="LM gradient study", disable=not progress)
    else:
        J, J_se, U, bar = _pilot_and_reference(
            model,
            on_policy,
            common,
            len(prompts),
            n_pilot,
            n_ref,
            chunk,
            ss_pilot,
            ss_ref,
            torch_gen,
            tqdm(total=n_ref + reps * n, desc="LM gradient study", disable=not progress),
        )

    # J(μ), the ``oracle`` advantage's baseline: a pilot from μ, independent of the batches
    J_mu, J_mu_se = _pilot_mean(
        model, mu, common, len(prompts), n_pilot, chunk, ss_pilot_mu, torch_gen
    )
    baselines = {"oracle": J_mu, "oracle_pi": J}

    # batches from μ
    rng, gen = np.random.default_rng(ss_batch), torch_gen(ss_batch)
    grads = np.empty((len(ests), reps, D))
    coeffs = np.empty((len(ests), reps, n, T))
    masks = np.empty((reps, n, T), dtype=bool)
    div_sum = {k: np.zeros(T) for k in ("chi2", "kl", "tv")}
    tok_count = np.zeros(T)
    log_w = np.empty((reps, n))
    lengths = np.empty((reps, n), dtype=np.int64)
    per_call = max(1, rows_per_call // n)  # batches drawn per model call
    for r0 in range(0, reps, per_call):
        r1 = min(r0 + per_call, reps)
        k = r1 - r0
        layout = np.concatenate([_prompt_layout(rng, len(prompts), n, G) for _ in range(k)])
        d = _draw(model, mu, prompt_index=layout, generator=gen, **common)
        m = d.mask.reshape(k, n, T)
        masks[r0:r1] = m
        lengths[r0:r1] = m.sum(axis=2)
        lr = np.where(d.mask, d.log_prob - d.old_log_prob, 0.0)
        log_w[r0:r1] = lr.sum(axis=1).reshape(k, n)
        tok_count += d.mask.sum(axis=0)
        for key in div_sum:
            div_sum[key] += np.where(d.mask, d.divergences[key], 0.0).sum(axis=0)
        S = d.scores.double().reshape(k, n, T, -1)
        shape = (k, n, T)
        for e, est in enumerate(ests):
            lam, c = estimator_token_weights(
                est,
                d.log_prob.reshape(shape),
                d.old_log_prob.reshape(shape),
                m,
                d.rewards.reshape(k, n),
                baselines.get(est.advantage, J),
                loss_path,
            )
            if not np.all(np.isfinite(lam)):
                raise ValueError(f"estimator {est.name!r} produced non-finite token weights")
            lam_t = torch.as_tensor(lam, dtype=torch.float64, device=S.device)
            grads[e, r0:r1] = torch.einsum("rnt,rntd->rd", lam_t, S).cpu().numpy()
            coeffs[e, r0:r1] = np.where(m, c, 0.0)
        bar.update(k * n)
    bar.close()

    boot_rng = np.random.default_rng(ss_boot)
    boot = (_resample_weights(reps, n_boot, boot_rng), _resample_weights(n_ref, n_boot, boot_rng))
    ref = U.mean(0)
    ref_var = float(np.sum((U - ref) ** 2)) / (n_ref - 1)
    grad_norm = math.sqrt(max(float(ref @ ref) - ref_var / n_ref, 0.0))
    total = max(tok_count.sum(), 1.0)
    divergences = {f"{k}_tok": float(v.sum() / total) for k, v in div_sum.items()}
    with np.errstate(over="ignore"):
        w = np.exp(np.minimum(log_w.ravel(), 700.0))
        divergences["chi2_seq"] = float(np.mean(w * w) - 1.0)
        divergences["kl_seq"] = float(np.mean(w * log_w.ravel()))
        divergences["tv_seq"] = float(0.5 * np.mean(np.abs(w - 1.0)))
    rows = []
    cache = {}  # the reference draws' own terms, once for every estimator
    for e, est in enumerate(ests):
        metrics = gradient_metrics(
            grads[e], U, n, coeffs[e], masks, level=level, boot_weights=boot, cache=cache
        )
        rows.append(
            {
                **describe(est, _RESERVED, composition=False),
                **setting,
                "T": T,
                "n": n,
                "reps": reps,
                "n_ref": n_ref,
                **divergences,
                **{k: metrics.get(k, math.nan) for k in METRIC_COLUMNS},
                "khat": metrics["khat"],
                "exact": False,
                "bias_sq": metrics["bias_sq"],
                "bias_sq_se": metrics["bias_sq_se"],
                "grad_norm": grad_norm,
                "ref_variance": metrics["ref_variance"],
                "ref_se": math.sqrt(metrics["ref_variance"] / n_ref),
                "J": J,
                "J_mu": J_mu,
                "reliable": metrics["reliable"],
                "tail_draws": metrics["tail_draws"],
            }
        )
    hp_cols = list(
        dict.fromkeys(c for row in rows for c in row if c not in _RESERVED and c not in setting)
    )
    cols = [
        *hp_cols,
        *setting,
        "T",
        "n",
        "reps",
        "n_ref",
        *DIVERGENCE_COLUMNS,
        *METRIC_COLUMNS,
        *_EXTRA_COLUMNS,
    ]
    head = list(ESTIMATOR_COLUMNS)
    cols = head + [c for c in cols if c not in head]
    table = pd.DataFrame(rows).reindex(columns=cols)
    with np.errstate(invalid="ignore", divide="ignore"):
        profile = pd.DataFrame(
            {
                "position": np.arange(T),
                **{
                    f"{k}_tok": np.where(tok_count > 0, v / np.maximum(tok_count, 1), np.nan)
                    for k, v in div_sum.items()
                },
                "running": tok_count / (reps * n),
                "tokens": tok_count.astype(np.int64),
            }
        )
    return StudyResult(
        table=table,
        profile=profile,
        lengths=lengths.ravel(),
        J=J,
        J_se=J_se,
        reference=ref,
        grad_norm=grad_norm,
        param_names=param_names,
        D=D,
        gradients=grads,
        reference_samples=U,
        fingerprint=fingerprint,
        J_mu=J_mu,
        J_mu_se=J_mu_se,
    )


def default_estimators(names: Sequence[str] | None = None, aggregation="seq-mean-token-sum"):
    """One estimator per mapping (defaults, oracle advantage, ``aggregation``), named by mapping."""
    names = list(names) if names is not None else _mappings.available()
    return [Estimator(_mappings.get(m), aggregation=aggregation, name=m) for m in names]
