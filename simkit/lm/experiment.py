"""Gradient study on a real language model, and its comparison with the token-MDP simulation.

**The study** (:func:`gradient_study`). A policy π (a causal LM), a behaviour μ derived from it
(:class:`Behaviour`: a logit transform such as a temperature, and/or another model such as a
stale or noisy copy; the generators of :mod:`simkit.lm.mismatch` build them), prompts with a
verifiable reward (:mod:`simkit.lm.tasks`). Every estimator of the catalogue is the weighted
policy gradient of the reference sheet

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
``variance``, ``mse``, ``snr``, ``ess`` (each with ``_lo``/``_hi``), ``khat``, ``exact``, and
``bias_sq``, ``bias_sq_se``, ``grad_norm`` (debiased ‖∇J‖), ``ref_variance``, ``ref_se``, ``J``
(the pilot estimate of J(π)), and ``behaviour``, ``strength`` (μ's generator and knob).

**The comparison** (:func:`simulation_twin`, :func:`predict`, :func:`compare`,
:func:`rank_agreement`). A state-independent token MDP (:meth:`simkit.envs.TokenMDP.iid`) with the
LM's response length T, its length distribution (an EOS with the LM's per-position stopping
hazard) and reward rate J, whose behaviour at position t is dialled (:func:`simkit.shifts.dial`)
to the LM's measured χ²(π_t‖μ_t) at that position, predicts each mapping's bias and variance
*relative to naive* (no correction) on the same setting; the measured relative numbers are
compared with the predicted ones (Spearman rank correlation with a bootstrap interval over
mappings). The ``lm_vs_sim`` figure (:mod:`simkit.figures.lm_vs_sim`) reports the outcome.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch.func import functional_call, grad, jacrev, vmap

from simkit import experiment as _experiment
from simkit import mappings as _mappings
from simkit import shifts
from simkit.envs import TokenMDP
from simkit.estimators import Estimator, as_estimator

#: parameter-subset presets of :func:`select_parameters`
PARAMETER_PRESETS = ("lm_head", "norm", "last_layer", "last_mlp", "all")
GRAD_METHODS = ("auto", "head", "vmap", "loop")
LOSS_PATHS = ("torch", "numpy")
#: largest number of stored gradient values E·R·D (float64) of one study (about 1.6 GB)
MAX_STORED_VALUES = 200_000_000


# --- parameter subsets -----------------------------------------------------------------------


def select_parameters(model: torch.nn.Module, spec: str | Sequence[str]) -> tuple[str, ...]:
    """Names of the parameters θ the gradients are taken with respect to.

    ``spec``: a preset — ``"lm_head"`` (the output projection; the embedding matrix when tied),
    ``"norm"`` (the final RMSNorm weight), ``"last_layer"`` (every parameter of the last
    decoder layer), ``"last_mlp"`` (its MLP), ``"all"`` — or a comma-separated string / list of
    parameter names or name prefixes (``"model.layers.1.mlp."``). Names are those of
    ``model.named_parameters()`` (tied weights appear once). Raises ``ValueError`` naming the
    spec and listing the available top-level names when nothing matches.
    """
    names = [n for n, _ in model.named_parameters()]
    if isinstance(spec, str):
        items = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        items = [str(s) for s in spec]
    if not items:
        raise ValueError("params must name at least one parameter or preset")
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    chosen: list[str] = []
    for item in items:
        if item == "all":
            match = names
        elif item == "lm_head":
            match = [n for n in names if n.startswith("lm_head.")] or [
                n for n in names if n == "model.embed_tokens.weight"
            ]
        elif item == "norm":
            match = [n for n in names if n == "model.norm.weight"]
        elif item in ("last_layer", "last_mlp"):
            if not layers:
                raise ValueError(f"params {item!r}: the model has no model.layers.<i> parameters")
            prefix = f"model.layers.{layers[-1]}." + ("mlp." if item == "last_mlp" else "")
            match = [n for n in names if n.startswith(prefix)]
        else:
            match = [n for n in names if n == item or n.startswith(item)]
        if not match:
            tops = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ValueError(
                f"params {item!r} matches no parameter; presets: {', '.join(PARAMETER_PRESETS)}; "
                f"parameter names start with: {', '.join(tops)}"
            )
        chosen += [n for n in match if n not in chosen]
    return tuple(chosen)


def parameter_dim(model: torch.nn.Module, param_names: Sequence[str]) -> int:
    """D = total number of values of the parameters ``param_names``."""
    params = dict(model.named_parameters())
    return int(sum(params[n].numel() for n in param_names))


# --- behaviour -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Behaviour:
    """The behaviour policy μ seen by the study: μ(·|h) = softmax(transform(logits_μ(h))).

    ``model``: the network producing μ's logits (None: π's own network — temperature, top-p,
    precision generators only transform π's logits); ``transform``: a function of a logits tensor
    (…, V) → μ's logits (…, V) (None: identity), e.g. ``lambda z: z / 1.2`` (temperature 1.2).
    ``name`` and ``strength`` label the table rows. ``Behaviour()`` is μ = π (on-policy).
    """

    model: torch.nn.Module | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    name: str = "on_policy"
    strength: float = 0.0

    def logits(self, pi_model: torch.nn.Module, input_ids: torch.Tensor, pi_logits=None):
        """μ's logits (N, L, V) for ``input_ids`` (N, L); ``pi_logits`` reused when μ has no
        model of its own."""
        if self.model is None:
            z = pi_model(input_ids).logits if pi_logits is None else pi_logits
        else:
            z = self.model(input_ids).logits
        return z if self.transform is None else self.transform(z)


def temperature_behaviour(tau: float) -> Behaviour:
    """μ = softmax(logits/τ) (sampling temperature τ > 0; τ = 1 is on-policy): the behaviour
    of :class:`simkit.lm.mismatch.Temperature`."""
    from simkit.lm.mismatch import Temperature

    return Temperature(tau).prepare(None).behaviour


def resolve_behaviour(
    behaviour,
    model: torch.nn.Module,
    *,
    task=None,
    tokenizer=None,
    eos_token_id: int | None = None,
    max_new_tokens: int | None = None,
) -> tuple[torch.nn.Module, Behaviour]:
    """The pair (π's network, μ) a study runs on, from ``behaviour`` and the given ``model``.

    Accepts None (on-policy: μ = π = ``model``), a :class:`Behaviour` or a number (a
    temperature τ) — π is ``model`` —, a spec string of :func:`simkit.lm.mismatch.parse`
    (``"temperature:1.3"``, ``"staleness:4"``), a generator of :mod:`simkit.lm.mismatch`
    (anything with ``prepare(model, task=…, tokenizer=…, eos_token_id=…, max_new_tokens=…)``;
    a staleness generator *trains* π away from ``model``, which stays the behaviour), or an
    already prepared :class:`simkit.lm.mismatch.MismatchPair` (anything with ``target`` and
    ``behaviour``).
    """
    if isinstance(behaviour, str):
        from simkit.lm import mismatch

        behaviour = mismatch.parse(behaviour)
    if behaviour is None or isinstance(behaviour, Behaviour):
        return model, behaviour if behaviour is not None else Behaviour()
    if isinstance(behaviour, int | float) and not isinstance(behaviour, bool):
        return model, temperature_behaviour(float(behaviour))
    if hasattr(behaviour, "prepare"):
        behaviour = behaviour.prepare(
            model,
            task=task,
            tokenizer=tokenizer,
            eos_token_id=eos_token_id,
            max_new_tokens=max_new_tokens,
        )
    prepared = getattr(behaviour, "behaviour", None)
    if hasattr(behaviour, "target") and isinstance(prepared, Behaviour):
        return behaviour.target, prepared
    raise TypeError(
        "behaviour must be None, a temperature (float), a simkit.lm.experiment.Behaviour, a "
        "simkit.lm.mismatch generator or MismatchPair; got "
        f"{type(behaviour).__name__}"
    )


def as_behaviour(behaviour, pi_model: torch.nn.Module | None = None) -> Behaviour:
    """μ alone, for behaviours that leave π = ``pi_model`` unchanged (:func:`resolve_behaviour`).

    Raises ``ValueError`` for a generator that changes π (staleness): use
    :func:`resolve_behaviour` and study the returned π.
    """
    target, mu = resolve_behaviour(behaviour, pi_model)
    if target is not pi_model:
        raise ValueError(
            f"behaviour {mu.name!r} changes the target policy π (not only μ); use "
            "resolve_behaviour(behaviour, model, task=...) and study the returned π"
        )
    return mu


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


# --- sampling and log-probabilities ----------------------------------------------------------


def _model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


def sample_group(
    model: torch.nn.Module,
    behaviour: Behaviour,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    generator: torch.Generator,
    eos_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses of ``max_new_tokens`` tokens to prompts of one length, sampled from μ.

    ``prompt_ids`` (k, p) (no padding). Ancestral sampling by
    :func:`simkit.lm.models.sample_responses` on μ's network (KV cache) with μ's logit
    transform as the logits processor and the explicit ``generator`` (reproducible). Returns
    ``input_ids`` (k, p + T) = prompt then response (after an EOS the row is filled with the
    EOS id) and ``response_mask`` (k, T) bool: True up to and including the first EOS.
    """
    from simkit.lm import models

    net = model if behaviour.model is None else behaviour.model
    transform = behaviour.transform

    def processor(z):
        return torch.log_softmax(z if transform is None else transform(z), dim=-1)

    device, _ = _model_device_dtype(net)
    prompt_ids = prompt_ids.to(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        roll = models.sample_responses(
            net,
            prompt_ids,
            max_new_tokens,
            generator,
            eos_token_id=eos_token_id,
            logits_processor=processor if transform is not None else None,
        )
    p = prompt_ids.shape[1]
    ids, mask = roll.input_ids, roll.response_mask[:, p:]
    missing = max_new_tokens - mask.shape[1]
    if missing:  # every row stopped early: pad to T
        fill = eos_token_id if eos_token_id is not None else 0
        ids = torch.cat(
            [ids, torch.full((ids.shape[0], missing), fill, dtype=ids.dtype, device=ids.device)],
            dim=1,
        )
        mask = torch.cat(
            [mask, torch.zeros((mask.shape[0], missing), dtype=torch.bool, device=mask.device)],
            dim=1,
        )
    return ids, mask


def response_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, prompt_length: int):
    """log softmax(logits)[y_t] of the response tokens: (N, T) for ``logits`` (N, L, V),
    ``input_ids`` (N, L) and responses starting at ``prompt_length`` (T = L − prompt_length)."""
    if logits.ndim != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (N, L, V) and input_ids (N, L); got {tuple(logits.shape)} and "
            f"{tuple(input_ids.shape)}"
        )
    p = int(prompt_length)
    if not 1 <= p < input_ids.shape[1]:
        raise ValueError(f"prompt_length must be in [1, L) = [1, {input_ids.shape[1]}), got {p}")
    lp = torch.log_softmax(logits[:, p - 1 : -1].double(), dim=-1)
    return lp.gather(-1, input_ids[:, p:, None])[..., 0]


def token_divergences(pi_logits: torch.Tensor, mu_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Exact χ²(π‖μ), KL(π‖μ) and TV(π, μ) over the vocabulary, per position: (…,) each.

    From logits (…, V) in float64 log space: χ² = Σ_v exp(2 log π_v − log μ_v) − 1 (logsumexp;
    ``inf`` where μ_v = 0 < π_v), KL = Σ_v π_v (log π_v − log μ_v) (terms with π_v = 0 are 0),
    TV = ½ Σ_v |π_v − μ_v| (definitions of :mod:`simkit.divergence`).
    """
    if pi_logits.shape != mu_logits.shape:
        raise ValueError(
            f"pi_logits and mu_logits must have the same shape, got {tuple(pi_logits.shape)} "
            f"and {tuple(mu_logits.shape)}"
        )
    log_pi = torch.log_softmax(pi_logits.double(), dim=-1)
    log_mu = torch.log_softmax(mu_logits.double(), dim=-1)
    pi = log_pi.exp()
    chi2 = torch.expm1(torch.logsumexp(2.0 * log_pi - log_mu, dim=-1)).clamp_min(0.0)
    diff = torch.where(pi > 0, log_pi - log_mu, torch.zeros_like(log_pi))
    kl = (pi * diff).sum(-1).clamp_min(0.0)
    tv = 0.5 * (pi - log_mu.exp()).abs().sum(-1)
    return {"chi2": chi2, "kl": kl, "tv": tv}


# --- per-token scores and per-sample gradients -----------------------------------------------


def _check_rows(input_ids: torch.Tensor, prompt_length: int) -> int:
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape (N, L), got {tuple(input_ids.shape)}")
    p = int(prompt_length)
    if not 1 <= p < input_ids.shape[1]:
        raise ValueError(f"prompt_length must be in [1, L) = [1, {input_ids.shape[1]}), got {p}")
    return input_ids.shape[1] - p


def _subset(model, param_names) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    missing = [n for n in param_names if n not in params]
    if missing:
        raise ValueError(f"unknown parameter names {missing}; see select_parameters")
    return {n: params[n].detach() for n in param_names}


def _row_log_probs(model, params, ids_row: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """log π(y_t | prefix) (T,) of one row (L,), θ = ``params`` swapped in (functional_call).

    No attention mask: one unpadded causal row (padding after an EOS comes *after* every valid
    token, so causal attention keeps it out of their log-probs).
    """
    logits = functional_call(model, params, (ids_row[None],))
    if hasattr(logits, "logits"):
        logits = logits.logits
    lp = torch.log_softmax(logits[0, prompt_length - 1 : -1], dim=-1)
    return lp.gather(-1, ids_row[prompt_length:, None])[:, 0]


def _flatten(grads: dict[str, torch.Tensor], names, lead: int) -> torch.Tensor:
    return torch.cat([grads[n].reshape(*grads[n].shape[:lead], -1) for n in names], dim=-1)


def head_parameter_names(model: torch.nn.Module) -> tuple[str, ...]:
    """Parameters whose per-token scores :func:`head_scores` computes in closed form.

    The final RMSNorm weight ``model.norm.weight`` and an *untied* ``lm_head.weight`` of a
    Llama-style causal LM (``model.model.norm`` with ``variance_epsilon``, ``model.lm_head``
    without bias). A tied output matrix is excluded: its gradient also flows through the input
    embedding, which the closed form does not see.
    """
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    head = getattr(model, "lm_head", None)
    if norm is None or not hasattr(norm, "variance_epsilon") or head is None:
        return ()
    if getattr(head, "bias", None) is not None:
        return ()
    names = {n for n, _ in model.named_parameters()}
    out = []
    if "model.norm.weight" in names:
        out.append("model.norm.weight")
    if "lm_head.weight" in names:  # absent from named_parameters when tied to the embedding
        out.append("lm_head.weight")
    return tuple(out)


def resolve_grad_method(model: torch.nn.Module, param_names: Sequence[str], method: str) -> str:
    """``"auto"`` → ``"head"`` when every parameter of θ has a closed-form score
    (:func:`head_parameter_names`), else ``"vmap"``; other methods are returned unchanged."""
    if method not in GRAD_METHODS:
        raise ValueError(f"method must be one of {GRAD_METHODS}, got {method!r}")
    supported = set(head_parameter_names(model))
    if method == "head" and not set(param_names) <= supported:
        raise ValueError(
            f"grad method 'head' computes scores of {sorted(supported) or 'no parameter'} of "
            f"this model only, not {sorted(set(param_names) - supported)}; use 'vmap' or 'loop'"
        )
    if method == "auto":
        return "head" if set(param_names) <= supported else "vmap"
    return method


def final_hidden_and_logits(model: torch.nn.Module, input_ids: torch.Tensor):
    """One forward pass returning (h, logits): h (N, L, d) the input of the final norm
    ``model.model.norm`` (captured by a forward pre-hook) and the model's logits (N, L, V)."""
    captured = {}

    def hook(module, args):
        captured["h"] = args[0]

    handle = model.model.norm.register_forward_pre_hook(hook)
    try:
        logits = model(input_ids).logits
    finally:
        handle.remove()
    return captured["h"], logits


def head_scores(
    model: torch.nn.Module,
    param_names: Sequence[str],
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    prompt_length: int,
) -> torch.Tensor:
    """Closed-form per-token scores ∇θ log π(y_t | h_t) for θ ⊆ {final norm weight γ, lm_head W}.

    With x the final hidden state (the norm's input, ``hidden`` (N, L, d)), n = x/√(mean x² + ε)
    (RMSNorm, Zhang & Sennrich 2019), z = W(γ ⊙ n) and π = softmax(z):
    ∂ log π_y/∂γ = n ⊙ Wᵀ(e_y − π) and ∂ log π_y/∂W = (e_y − π)(γ ⊙ n)ᵀ (C order, (V, d)).
    Everything after the norm's input is recomputed in float64, so one forward pass gives the
    scores of every position — no backward pass. Returns (N, T, D) float64 in the order of
    ``param_names`` (T = L − ``prompt_length``), like :func:`per_token_scores`.
    """
    T = _check_rows(input_ids, prompt_length)
    names = tuple(param_names)
    supported = head_parameter_names(model)
    if not names or not set(names) <= set(supported):
        raise ValueError(f"head_scores supports {supported}, got {names}")
    p = int(prompt_length)
    norm, head = model.model.norm, model.lm_head
    x = hidden[:, p - 1 : -1].double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(norm.variance_epsilon))
    gamma = norm.weight.detach().double()
    W = head.weight.detach().double()
    a = n * gamma
    probs = torch.softmax(a @ W.T, dim=-1)  # (N, T, V)
    resid = -probs
    resid.scatter_add_(-1, input_ids[:, p:, None], torch.ones_like(resid[..., :1]))
    parts = []
    for name in names:
        if name == "model.norm.weight":
            parts.append(n * (resid @ W))
        else:
            parts.append((resid[..., :, None] * a[..., None, :]).reshape(*resid.shape[:2], -1))
    out = torch.cat(parts, dim=-1)
    assert out.shape[1] == T
    return out


def per_token_scores(
    model: torch.nn.Module,
    param_names: Sequence[str],
    input_ids: torch.Tensor,
    prompt_length: int,
    method: str = "auto",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """S[i, t] = ∇θ log π(y_{i,t} | x, y_{i,<t}) for θ = ``param_names``: (N, T, D).

    ``input_ids`` (N, L): N rows sharing the same ``prompt_length`` (responses y_i = the last
    T = L − prompt_length tokens). ``method="head"``: the closed form of :func:`head_scores`
    (one forward pass; θ ⊆ final norm weight, untied lm_head); ``"vmap"``: ``torch.func.vmap``
    over rows of ``jacrev`` of the row's log-probs (``functional_call``; ``chunk_size`` rows at
    a time); ``"loop"``: one forward per row and T backward passes; ``"auto"``: ``"head"`` when
    θ allows it, else ``"vmap"``. D flattens the parameters in the order of ``param_names``,
    each in C order. The model should be in eval mode.
    """
    _check_rows(input_ids, prompt_length)
    names = tuple(param_names)
    method = resolve_grad_method(model, names, method)
    params = _subset(model, names)
    p = int(prompt_length)
    if method == "head":
        with torch.no_grad():
            hidden, _ = final_hidden_and_logits(model, input_ids)
            return head_scores(model, names, hidden, input_ids, p)
    if method == "vmap":
        jac = vmap(
            jacrev(lambda prm, row: _row_log_probs(model, prm, row, p)),
            in_dims=(None, 0),
            chunk_size=chunk_size,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            return _flatten(jac(params, input_ids), names, 2).detach()
    rows = []
    for row in input_ids:
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        with torch.enable_grad():
            lp = _row_log_probs(model, leaves, row, p)
            per_t = []
            for t in range(lp.shape[0]):
                g = torch.autograd.grad(lp[t], [leaves[n] for n in names], retain_graph=True)
                per_t.append(torch.cat([x.reshape(-1) for x in g]))
        rows.append(torch.stack(per_t))
    return torch.stack(rows)


def per_sample_gradients(
    model: torch.nn.Module,
    param_names: Sequence[str],
    input_ids: torch.Tensor,
    prompt_length: int,
    token_weights: torch.Tensor,
    method: str = "vmap",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """h_i = ∇θ Σ_t λ_{i,t} log π(y_{i,t} | x, y_{i,<t}): per-sample gradients (N, D).

    The gradient of sample i's term of a weighted policy-gradient loss (λ = −∂loss/∂log π).
    ``token_weights`` λ (N, T). ``method="vmap"``: ``torch.func.vmap(grad(...))`` over rows with
    ``functional_call`` (Horace He et al., torch.func per-sample-gradient recipe); ``"loop"``:
    one forward and one backward per row; ``"head"``: λ-contraction of the closed-form scores
    of :func:`head_scores`; ``"auto"``: ``"head"`` when θ allows it, else ``"vmap"``.
    """
    T = _check_rows(input_ids, prompt_length)
    if token_weights.shape != (input_ids.shape[0], T):
        raise ValueError(
            f"token_weights must have shape (N, T) = ({input_ids.shape[0]}, {T}), got "
            f"{tuple(token_weights.shape)}"
        )
    names = tuple(param_names)
    method = resolve_grad_method(model, names, method)
    params = _subset(model, names)
    p = int(prompt_length)
    if method == "head":
        S = per_token_scores(model, names, input_ids, p, method="head")
        return torch.einsum("nt,ntd->nd", token_weights.to(S), S)
    lam = token_weights.to(next(iter(params.values())).dtype)

    def weighted(prm, row, w):
        return (_row_log_probs(model, prm, row, p) * w).sum()

    if method == "vmap":
        fn = vmap(grad(weighted), in_dims=(None, 0, 0), chunk_size=chunk_size)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            return _flatten(fn(params, input_ids, lam), names, 1).detach()
    out = []
    for row, w in zip(input_ids, lam):
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        with torch.enable_grad():
            g = torch.autograd.grad(weighted(leaves, row, w), [leaves[n] for n in names])
        out.append(torch.cat([x.reshape(-1) for x in g]))
    return torch.stack(out)


# --- estimator weights -----------------------------------------------------------------------


def estimator_token_weights(
    estimator, log_prob, old_log_prob, mask, rewards, J: float, loss_path: str = "torch"
) -> tuple[np.ndarray, np.ndarray]:
    """λ (N, T) with ĝ = Σ λ_{i,t} ∇ log π(y_{i,t}), and the mapping's coefficients c (N, T).

    ``loss_path="torch"``: λ = −∂loss/∂log_prob of :func:`simkit.lm.losses.policy_loss` (the
    trainer's loss, autograd in float64); ``"numpy"``: λ = c·A/Z of
    :meth:`simkit.estimators.Estimator.token_weights`. The two agree (the losses' registry
    consistency test). c always comes from the numpy registry (for ESS and k̂). Inputs are numpy
    arrays: ``log_prob`` = log π, ``old_log_prob`` = log μ of the sampled tokens, ``mask``
    (N, T) bool, ``rewards`` (N,), ``J`` the baseline of the ``oracle`` advantage. Leading
    batch axes (L..., N, T) are independent batches.
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
    c = est.coefficients(log_ratio, mask, adv, log_prob=np.where(mask, log_prob, 0.0))
    if loss_path == "numpy":
        return c * adv[..., None] * est.aggregation_weights(mask), c
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


# --- metrics ---------------------------------------------------------------------------------


def _gram_trace_sq(X: np.ndarray, Y: np.ndarray | None = None) -> float:
    """‖X Yᵀ‖_F² = tr(XᵀX·YᵀY) without forming D×D matrices (Y = X by default)."""
    K = X @ (X if Y is None else Y).T
    return float(np.sum(K * K))


def bias_statistics(gradients, reference_samples) -> dict[str, float]:
    """Debiased squared bias of E ĝ against ∇J and its standard error (module docstring).

    ``gradients`` (R, D): ĝ_r of R independent batches; ``reference_samples`` (M, D): i.i.d.
    unbiased single-sample estimates u_j of ∇J. Returns ``bias_sq`` (unbiased for
    ‖E ĝ − ∇J‖², may be < 0), ``bias_sq_se`` (Gaussian approximation
    √(2 tr Σ² + 4 ΔᵀΣΔ), Σ = Σ_g/R + Σ_u/M, with ΔᵀΣΔ estimated by Δ̂ᵀΣ̂Δ̂ − tr Σ̂², clipped
    at 0; tr Σ̂² from Gram matrices, which slightly over-estimates it: conservative),
    ``noise`` = tr(Σ̂_g)/R + tr(Σ̂_u)/M (the Monte Carlo floor removed), ``variance`` tr Σ̂_g,
    ``ref_variance`` tr Σ̂_u.
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
        + _gram_trace_sq(Xu) / ((M - 1) ** 2 * M**2)
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
    (``boot_weights`` = (W_g (B, R), W_u (B, M)) to share resamples between estimators).
    """
    g = np.asarray(gradients, dtype=np.float64)
    u = np.asarray(reference_samples, dtype=np.float64)
    stats = bias_statistics(g, u)
    R, M = g.shape[0], u.shape[0]
    if boot_weights is None:
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
    return out


# --- the study -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyResult:
    """What :func:`gradient_study` measured.

    ``table``: the tidy DataFrame (module docstring), one row per estimator. ``profile``: per
    response position t, ``chi2_tok``, ``kl_tok``, ``tv_tok`` (exact, averaged over μ's visited
    states at t), ``running`` (fraction of μ's responses still running at t) and ``tokens``.
    ``lengths``: the response length of every μ draw (reps·n,). ``J``, ``J_se``: the pilot
    estimate of J(π) (the oracle baseline). ``reference`` (D,) ∇̂J; ``grad_norm`` the debiased
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


@dataclass
class _Draws:
    """One batch of responses (numpy, response-aligned)."""

    prompt_index: np.ndarray  # (N,)
    log_prob: np.ndarray  # (N, T) log π
    old_log_prob: np.ndarray  # (N, T) log μ
    mask: np.ndarray  # (N, T)
    rewards: np.ndarray  # (N,)
    divergences: dict  # name -> (N, T) exact per-position divergences
    scores: torch.Tensor | None  # (N, T, D) on the model's device


def _seed_of(ss: np.random.SeedSequence) -> int:
    return int(ss.generate_state(1, dtype=np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF)


def _draw(
    model,
    behaviour: Behaviour,
    task,
    tokenizer,
    prompts,
    prompt_index: np.ndarray,
    max_new_tokens: int,
    eos_token_id,
    generator: torch.Generator,
    param_names,
    grad_method: str,
    chunk_size,
    with_scores: bool = True,
) -> _Draws:
    """Sample responses to ``prompts[prompt_index]`` from μ, score them under π and μ."""
    N, T = len(prompt_index), max_new_tokens
    device, _ = _model_device_dtype(model)
    response = torch.zeros((N, T), dtype=torch.long)
    mask = torch.zeros((N, T), dtype=torch.bool)
    log_prob = torch.zeros((N, T), dtype=torch.float64)
    old = torch.zeros((N, T), dtype=torch.float64)
    divs = {k: torch.zeros((N, T), dtype=torch.float64) for k in ("chi2", "kl", "tv")}
    scores = None
    lengths = np.array([len(prompts[int(i)]) for i in prompt_index])
    for p in np.unique(lengths):
        rows = np.flatnonzero(lengths == p)
        p = int(p)
        prompt_ids = torch.tensor([prompts[int(prompt_index[i])] for i in rows], device=device)
        ids, m = sample_group(model, behaviour, prompt_ids, T, generator, eos_token_id)
        head = with_scores and grad_method == "head"
        with torch.no_grad():
            if head:
                hidden, pi_logits = final_hidden_and_logits(model, ids)
            else:
                pi_logits = model(ids).logits
            mu_logits = behaviour.logits(model, ids, pi_logits=pi_logits)
            lp = response_log_probs(pi_logits, ids, p)
            lq = response_log_probs(mu_logits, ids, p)
            d = token_divergences(pi_logits[:, p - 1 : -1], mu_logits[:, p - 1 : -1])
        r = torch.as_tensor(rows)
        response[r] = ids[:, p:].cpu()
        mask[r] = m.cpu()
        log_prob[r] = lp.cpu()
        old[r] = lq.cpu()
        for k in divs:
            divs[k][r] = d[k].cpu()
        if with_scores:
            if head:
                s = head_scores(model, param_names, hidden, ids, p)
            else:
                s = per_token_scores(
                    model, param_names, ids, p, method=grad_method, chunk_size=chunk_size
                )
            s = s * m[..., None].to(s.dtype)
            if scores is None:
                scores = torch.zeros((N, T, s.shape[-1]), dtype=s.dtype, device=s.device)
            scores[r.to(s.device)] = s
    rewards = np.asarray(task.rewards(prompt_index, response, mask, tokenizer), dtype=np.float64)
    return _Draws(
        prompt_index=prompt_index,
        log_prob=log_prob.numpy(),
        old_log_prob=old.numpy(),
        mask=mask.numpy(),
        rewards=rewards,
        divergences={k: v.numpy() for k, v in divs.items()},
        scores=scores,
    )


def _prompt_layout(rng: np.random.Generator, n_prompts: int, n: int, group_size: int):
    return np.repeat(rng.integers(0, n_prompts, size=n // group_size), group_size)


def _int_at_least(value, low: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _describe(est: Estimator) -> dict:
    return {
        "estimator": est.name,
        "mapping": est.mapping.name,
        "aggregation": est.aggregation,
        "advantage": est.advantage,
        "group_size": est.group_size if est.group_size is not None else math.nan,
        "adv_eps": est.adv_eps if est.advantage == "grpo" else math.nan,
        "max_length": est.max_length if est.max_length is not None else math.nan,
        **{(f"hp_{k}" if k in _RESERVED else k): v for k, v in est.mapping.hyperparameters.items()},
    }


_METRIC_COLUMNS = [c for k in _experiment.BOUNDED_METRICS for c in (k, f"{k}_lo", f"{k}_hi")]
_EXTRA_COLUMNS = [
    "khat",
    "exact",
    "bias_sq",
    "bias_sq_se",
    "grad_norm",
    "ref_variance",
    "ref_se",
    "J",
]
_RESERVED = {
    "estimator",
    "mapping",
    "aggregation",
    "advantage",
    "group_size",
    "adv_eps",
    "max_length",
    "T",
    "n",
    "reps",
    "n_ref",
    *_experiment.DIVERGENCE_COLUMNS,
    *_METRIC_COLUMNS,
    *_EXTRA_COLUMNS,
}


def _chunked_draws(model, policy, common, n_prompts, total, chunk, seed_seq, torch_gen, **kw):
    """``total`` draws from ``policy`` in chunks of at most ``chunk`` prompts, uniform over the
    ``n_prompts`` prompts, from the numpy and torch streams of ``seed_seq``.

    Yields ``(k, draw)`` per chunk of ``k`` prompts."""
    rng, gen = np.random.default_rng(seed_seq), torch_gen(seed_seq)
    for start in range(0, total, chunk):
        k = min(chunk, total - start)
        index = rng.integers(0, n_prompts, size=k)
        yield k, _draw(model, policy, prompt_index=index, generator=gen, **kw, **common)


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
    n_ref : on-policy draws of the REINFORCE reference ∇̂J; ``n_pilot``: draws for the baseline J.
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
        whose pilot J and reference draws are reused (``n_ref``, ``n_pilot`` then ignored):
        several behaviours compared against one ∇̂J.
    """
    ests = [
        as_estimator(e)
        for e in (estimators if isinstance(estimators, list | tuple) else [estimators])
    ]
    if not ests:
        raise ValueError("estimators is empty")
    names = [e.name for e in ests]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ValueError(f"estimator names must be distinct; repeated: {dup} (set name=...)")
    n = _int_at_least(n, 1, "n")
    reps = _int_at_least(reps, 2, "reps")
    n_ref = _int_at_least(n_ref, 2, "n_ref")
    n_pilot = _int_at_least(n_pilot, 1, "n_pilot")
    T = _int_at_least(max_new_tokens, 1, "max_new_tokens")
    G = _int_at_least(group_size, 1, "group_size")
    n_boot = _int_at_least(n_boot, 10, "n_boot")
    rows_per_call = _int_at_least(rows_per_call, 1, "rows_per_call")
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
    model, mu = resolve_behaviour(
        behaviour,
        model,
        task=task,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        max_new_tokens=T,
    )
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
    ss_pilot, ss_ref, ss_batch, ss_boot = np.random.SeedSequence(seed).spawn(4)

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
                J,
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
    for e, est in enumerate(ests):
        metrics = gradient_metrics(grads[e], U, n, coeffs[e], masks, level=level, boot_weights=boot)
        rows.append(
            {
                **_describe(est),
                **setting,
                "T": T,
                "n": n,
                "reps": reps,
                "n_ref": n_ref,
                **divergences,
                **{k: metrics[k] for k in _METRIC_COLUMNS},
                "khat": metrics["khat"],
                "exact": False,
                "bias_sq": metrics["bias_sq"],
                "bias_sq_se": metrics["bias_sq_se"],
                "grad_norm": grad_norm,
                "ref_variance": metrics["ref_variance"],
                "ref_se": math.sqrt(metrics["ref_variance"] / n_ref),
                "J": J,
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
        *_experiment.DIVERGENCE_COLUMNS,
        *_METRIC_COLUMNS,
        *_EXTRA_COLUMNS,
    ]
    head = [
        "estimator",
        "mapping",
        "aggregation",
        "advantage",
        "group_size",
        "adv_eps",
        "max_length",
    ]
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
    )


# --- comparison with the simulation ----------------------------------------------------------


def hazards_from_running(running) -> np.ndarray:
    """Per-position stopping probabilities h_t = P(length = t + 1 | length > t) from the
    fraction of responses still running at each position (``running`` (T,), running[0] = 1,
    non-increasing): h_t = 1 − running[t+1]/running[t] for t < T − 1; the last position (whose
    stop is not observed: responses are cut at T) repeats h_{T−2}. Positions no response
    reaches get h = 1. Clipped to [0, 1 − 1e-6] (a twin needs some mass on every token)."""
    r = np.asarray(running, dtype=np.float64)
    if r.ndim != 1 or r.size < 1 or not np.all(np.isfinite(r)) or np.any((r < 0) | (r > 1)):
        raise ValueError(f"running must be a non-empty 1-d array of fractions in [0, 1], got {r!r}")
    if r[0] <= 0 or np.any(np.diff(r) > 1e-12):
        raise ValueError("running must start > 0 and be non-increasing (fractions still running)")
    T = r.size
    h = np.ones(T)
    with np.errstate(invalid="ignore", divide="ignore"):
        h[:-1] = np.where(r[:-1] > 0, 1.0 - r[1:] / r[:-1], 1.0)
    h[-1] = h[-2] if T > 1 else 0.0
    return np.clip(h, 0.0, 1.0 - 1e-6)


def simulation_twin(
    chi2_profile,
    J: float,
    V: int = 2,
    shift_family: str = "logit_noise",
    running=None,
) -> tuple[TokenMDP, np.ndarray]:
    """A token MDP with the LM's length distribution, reward rate and per-position χ² profile.

    :meth:`simkit.envs.TokenMDP.iid` with T = len(``chi2_profile``) positions and reward
    R = 1{the answer token (0) appears}. Without ``running`` (or when every response runs to
    T) the length is T and the V tokens are: the answer with π(answer) = a at every position,
    1 − (1 − a)^T = J, and V − 1 others sharing 1 − a. With a ``running`` profile (the fraction
    of the LM's responses still running at each position, :attr:`StudyResult.profile`) token
    V − 1 is an EOS with π_t(EOS) = h_t (:func:`hazards_from_running`), so the twin's lengths
    follow the LM's; the answer has π_t(answer) = a·(1 − h_t) with a solved (``brentq``) so
    that J(π) = ``J``; V ≥ 3 then. μ_t = ``shifts.dial(π_t, χ²_t, "chi2",
    family=shift_family)``, so χ²(π_t‖μ_t) equals the LM's χ² at position t (positions without
    tokens, NaN in the profile, get μ_t = π_t); with an EOS, μ_t keeps π_t's EOS probability
    h_t (so μ's lengths, which the LM's profile measured, are the twin's too) and the
    continuation given "no EOS" is dialled to χ²_t/(1 − h_t), which gives χ²(π_t‖μ_t) = χ²_t.
    J must be in (0, 1) (a reward that never or always fires carries no gradient). Returns
    ``(env, mu)`` with mu (T, 1, V).

    V matters: with several "other" tokens the dialled μ can reshuffle mass among them, as an
    LM's mismatch mostly moves mass among reward-irrelevant tokens; with a single other token
    the only way to reach χ²_t is to move the answer's own probability, which changes the
    reward under μ (measured on SmolLM2 with the ``lm_vs_sim`` data: the variance-rank
    agreement drops from ρ = 0.83 / 0.75 with V = 4 to 0.61 / 0.34 with V = 3).

    The LM's profile and lengths are measured under μ (its responses); the twin uses them for
    π, an approximation of order the mismatch itself.
    """
    chi2 = np.asarray(chi2_profile, dtype=np.float64)
    if chi2.ndim != 1 or chi2.size < 1 or np.any(chi2[np.isfinite(chi2)] < 0):
        raise ValueError(f"chi2_profile must be a non-empty 1-d array of values >= 0, got {chi2!r}")
    if np.any(np.isinf(chi2)):
        raise ValueError(
            "chi2_profile has infinite values (μ misses tokens π emits, e.g. top-p): no twin "
            "μ can reach them; compare a behaviour with finite χ²"
        )
    chi2 = np.where(np.isnan(chi2), 0.0, chi2)
    if not 0 < J < 1:
        raise ValueError(f"J must be in (0, 1) to carry a gradient, got {J}")
    V = _int_at_least(V, 2, "V")
    T = chi2.size
    h = None
    if running is not None:
        h = hazards_from_running(running)
        if h.shape != (T,):
            raise ValueError(f"running must have the length of chi2_profile ({T}), got {h.size}")
        if np.all(h[:-1] == 0):
            h = None  # every response runs to T: fixed length
    if h is None:
        a = -math.expm1(math.log1p(-J) / T)
        row = np.full(V, (1.0 - a) / (V - 1))
        row[0] = a
        logits = np.broadcast_to(np.log(row), (T, 1, V)).copy()
        env = TokenMDP.iid(V=V, T=T, answer=0, logits=logits)
    else:
        if V < 3:
            raise ValueError(
                f"a twin with variable length needs V >= 3 (answer, other, EOS), got {V}"
            )
        from scipy.optimize import brentq

        h = np.clip(h, 1e-9, None)  # finite logits: EOS is possible, if very rarely

        def build(a):
            rows = np.empty((T, 1, V))
            rows[:, 0, 0] = a * (1.0 - h)
            rows[:, 0, 1:-1] = ((1.0 - a) * (1.0 - h) / (V - 2))[:, None]
            rows[:, 0, -1] = h
            return TokenMDP.iid(V=V, T=T, answer=0, eos=V - 1, logits=np.log(rows))

        top = build(1.0 - 1e-12).J()
        if J >= top:
            raise ValueError(
                f"J = {J} is not reachable with this length profile (at most {top:.4g}: the "
                "answer must come before the first EOS)"
            )
        a = brentq(lambda x: build(x).J() - J, 1e-12, 1.0 - 1e-12, xtol=1e-14, rtol=1e-12)
        env = build(a)
    pi = env.pi[:, 0, :]
    mu = pi.copy()
    moved = chi2 > 0
    if moved.any() and env.eos is None:
        mu[moved] = shifts.dial(pi[moved], chi2[moved], "chi2", family=shift_family)
    elif moved.any():
        # μ keeps π's EOS hazard (the measured lengths are μ's) and moves the continuation:
        # χ²(π_t‖μ_t) = (1 − h_t)·χ²(π'_t‖μ'_t) for the conditionals π', μ' given "no EOS"
        stay = 1.0 - pi[moved, -1]
        cont = pi[moved, :-1] / stay[:, None]
        dialled = shifts.dial(cont, chi2[moved] / stay, "chi2", family=shift_family)
        mu[moved, :-1] = dialled * stay[:, None]
    return env, mu[:, None, :]


def predict(
    env: TokenMDP,
    mu,
    estimators,
    n: int,
    reps: int = 400,
    seed: int = 0,
    n_boot: int = 200,
) -> pd.DataFrame:
    """Each estimator's bias/variance on the simulation twin (:func:`simkit.experiment.run`,
    exact where the support is enumerable, Monte Carlo otherwise)."""
    return _experiment.run(
        env, mu, estimators, n=n, reps=reps, seed=seed, n_boot=n_boot, progress=False
    )


def relative_metrics(table: pd.DataFrame, reference: str = "naive") -> pd.DataFrame:
    """``rel_variance`` = variance / variance of the ``reference`` row (by ``mapping``),
    ``rel_bias`` = bias / bias of the reference, ``rel_mse`` likewise; one row per estimator."""
    if reference not in set(table["mapping"]):
        raise ValueError(f"the table has no {reference!r} row to normalise by")
    base = table[table["mapping"] == reference].iloc[0]
    out = table[["estimator", "mapping"]].copy()
    for key in ("variance", "bias", "mse"):
        denom = float(base[key])
        out[f"rel_{key}"] = table[key] / denom if denom > 0 else math.nan
    return out


def rank_agreement(measured, predicted, n_boot: int = 1000, level: float = 0.95, seed: int = 0):
    """Spearman rank correlation of ``measured`` vs ``predicted`` with a bootstrap interval.

    Pairs with a non-finite value are dropped. The interval is the percentile bootstrap over
    pairs (mappings) resampled with replacement (Efron & Tibshirani 1993, ch. 13). Returns
    ``(rho, lo, hi, k)`` with k the number of pairs used (NaNs when k < 3).
    """
    from scipy.stats import rankdata

    x = np.asarray(measured, dtype=np.float64)
    y = np.asarray(predicted, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(
            f"measured and predicted must be 1-d of equal length, got {x.shape}, {y.shape}"
        )
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    k = int(ok.sum())
    if k < 3:
        return math.nan, math.nan, math.nan, k

    def spearman(a, b):
        ra, rb = rankdata(a), rankdata(b)
        ra, rb = ra - ra.mean(), rb - rb.mean()
        den = math.sqrt(float(ra @ ra) * float(rb @ rb))
        return float(ra @ rb) / den if den > 0 else math.nan

    rho = spearman(x, y)
    rng = np.random.default_rng(seed)
    boot = np.array([spearman(x[i], y[i]) for i in rng.integers(0, k, size=(n_boot, k))])
    boot = boot[np.isfinite(boot)]
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [tail, 1.0 - tail]) if boot.size else (math.nan, math.nan)
    return rho, float(lo), float(hi), k


def compare(lm_table: pd.DataFrame, sim_table: pd.DataFrame, reference: str = "naive"):
    """Measured (LM) vs predicted (simulation) relative bias / variance / MSE per estimator.

    One row per estimator present in both tables: ``measured_rel_<m>``, ``predicted_rel_<m>``
    for m in variance, bias, mse (:func:`relative_metrics`).
    """
    a = relative_metrics(lm_table, reference).set_index("estimator")
    b = relative_metrics(sim_table, reference).set_index("estimator")
    common = [e for e in a.index if e in b.index]
    out = pd.DataFrame({"estimator": common, "mapping": a.loc[common, "mapping"].to_numpy()})
    for key in ("variance", "bias", "mse"):
        out[f"measured_rel_{key}"] = a.loc[common, f"rel_{key}"].to_numpy()
        out[f"predicted_rel_{key}"] = b.loc[common, f"rel_{key}"].to_numpy()
    return out


def default_estimators(names: Sequence[str] | None = None, aggregation="seq-mean-token-sum"):
    """One estimator per mapping (defaults, oracle advantage, ``aggregation``), named by mapping."""
    names = list(names) if names is not None else _mappings.available()
    return [Estimator(_mappings.get(m), aggregation=aggregation, name=m) for m in names]
