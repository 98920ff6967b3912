"""Sampling responses from μ and scoring them under π and μ (one batch of a gradient study).

:func:`sample_group` (ancestral sampling of μ with an explicit generator),
:func:`response_log_probs`, :func:`token_divergences` (exact χ², KL, TV per position), and the
batch draw ``_draw`` shared by :mod:`simkit.lm.study` and :func:`simkit.lm.mismatch.measure`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from simkit.lm.behaviour import Behaviour
from simkit.lm.scores import final_hidden_and_logits, head_scores, per_token_scores

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


def _chunked_draws(model, policy, common, n_prompts, total, chunk, seed_seq, torch_gen, **kw):
    """``total`` draws from ``policy`` in chunks of at most ``chunk`` prompts, uniform over the
    ``n_prompts`` prompts, from the numpy and torch streams of ``seed_seq``.

    Yields ``(k, draw)`` per chunk of ``k`` prompts."""
    rng, gen = np.random.default_rng(seed_seq), torch_gen(seed_seq)
    for start in range(0, total, chunk):
        k = min(chunk, total - start)
        index = rng.integers(0, n_prompts, size=k)
        yield k, _draw(model, policy, prompt_index=index, generator=gen, **kw, **common)
