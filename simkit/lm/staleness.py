"""Staleness training: θ_k, a copy of a language model after k policy-gradient steps on one
rollout batch sampled from it (the target π of :class:`simkit.lm.mismatch.Staleness`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from simkit._validation import int_at_least
from simkit.lm.behaviour import Behaviour
from simkit.lm.sampling import _seed_of, response_log_probs, sample_group
from simkit.lm.scores import select_parameters

#: optimizers of a staleness generator
OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """Responses sampled from a model for a task, laid out by prompt length.

    ``prompt_index`` (N,); ``groups``: a list of (row indices (k,), input_ids (k, p + T),
    response mask (k, T), p) — one per prompt length p (rows of a group share p, no padding);
    ``response`` (N, T) and ``mask`` (N, T) in row order; ``rewards`` (N,) from the task;
    ``old_log_prob`` (N, T) float64, log μ of the sampled tokens under the sampling model.
    """

    prompt_index: np.ndarray
    groups: list
    response: torch.Tensor
    mask: torch.Tensor
    rewards: np.ndarray
    old_log_prob: torch.Tensor


def rollout_batch(
    model: torch.nn.Module,
    task,
    n: int,
    max_new_tokens: int,
    seed: int = 0,
    tokenizer=None,
    eos_token_id: int | None = None,
) -> RolloutBatch:
    """``n`` responses of ``max_new_tokens`` tokens sampled from ``model`` (μ) for prompts
    drawn uniformly from ``task``; prompts and tokens from one ``SeedSequence(seed)``."""
    n = int_at_least(n, "n", 1)
    T = int_at_least(max_new_tokens, "max_new_tokens", 1)
    device = next(model.parameters()).device
    prompts = task.prompt_ids(tokenizer)
    ss_prompt, ss_sample = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(ss_prompt)
    gen = torch.Generator(device=device)
    gen.manual_seed(_seed_of(ss_sample))
    prompt_index = rng.integers(0, len(prompts), size=n)
    groups = _sample_rows(model, prompts, prompt_index, T, gen, eos_token_id)
    response = torch.zeros((n, T), dtype=torch.long)
    mask = torch.zeros((n, T), dtype=torch.bool)
    old = torch.zeros((n, T), dtype=torch.float64)
    with torch.no_grad():
        for idx, ids, m, p in groups:
            response[idx] = ids[:, p:].cpu()
            mask[idx] = m.cpu()
            old[idx] = response_log_probs(model(ids).logits, ids, p).cpu()
    rewards = np.asarray(task.rewards(prompt_index, response, mask, tokenizer), dtype=np.float64)
    return RolloutBatch(prompt_index, groups, response, mask, rewards, old)


def stale_target(
    model: torch.nn.Module,
    task,
    *,
    steps: int,
    lr: float,
    optimizer: str = "adam",
    batch_size: int = 8,
    loss: str = "ppo_clip",
    params: str | Sequence[str] = "all",
    max_new_tokens: int = 8,
    seed: int = 0,
    tokenizer=None,
    eos_token_id: int | None = None,
) -> torch.nn.Module:
    """θ_k: a copy of ``model`` after ``steps`` policy-gradient steps (:class:`Staleness`).

    The rollout batch (:func:`rollout_batch` of steps × batch_size responses, ``seed``) is
    sampled once from ``model`` (μ = θ₀); mini-batch j is rows [j·B, (j+1)·B) and its loss is
    ``policy_loss(loss, log π_θ, log μ, A, mask, agg="token-mean")`` with A = R − mean R over
    the rollout batch. ``model`` is not modified; the copy is in eval mode with every
    parameter's ``requires_grad`` restored to True.
    """
    from simkit.lm import losses

    steps = int_at_least(steps, "steps", 1)
    B = int_at_least(batch_size, "batch_size", 1)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    device = next(model.parameters()).device
    batch = rollout_batch(
        model, task, steps * B, max_new_tokens, seed, tokenizer=tokenizer, eos_token_id=eos_token_id
    )
    rewards = batch.rewards
    if np.ptp(rewards) == 0:
        warnings.warn(
            f"staleness: every response of the rollout batch has reward {rewards[0]}; the "
            "advantages are 0 and the steps leave π = μ (use a task with varied rewards)",
            stacklevel=3,
        )
    adv = torch.as_tensor(rewards - rewards.mean(), dtype=torch.float64)
    T = batch.mask.shape[1]

    target = copy.deepcopy(model).eval()
    trainable = set(select_parameters(target, params))
    for name, prm in target.named_parameters():
        prm.requires_grad_(name in trainable)
    chosen = [prm for name, prm in target.named_parameters() if name in trainable]
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(chosen, lr=float(lr))
    for j in range(steps):
        lo, hi = j * B, (j + 1) * B
        log_prob = torch.zeros((B, T), dtype=torch.float64, device=device)
        for idx, ids, _, p in batch.groups:
            sel = (idx >= lo) & (idx < hi)
            if sel.any():
                sub = ids[torch.as_tensor(sel, device=ids.device)]
                lp = response_log_probs(target(sub).logits, sub, p)
                where = torch.as_tensor(idx[sel] - lo, device=device)
                log_prob = log_prob.index_put((where,), lp)
        value, _ = losses.policy_loss(
            loss,
            log_prob,
            batch.old_log_prob[lo:hi].to(device),
            adv[lo:hi].to(device),
            batch.mask[lo:hi].to(device),
            agg="token-mean",
            compute_metrics=False,
        )
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
    for prm in target.parameters():
        prm.requires_grad_(True)
    return target.eval()


def _sample_rows(model, prompts, prompt_index, T, generator, eos_token_id):
    """Responses from ``model`` to ``prompts[prompt_index]``, grouped by prompt length:
    a list of (row indices (k,), input_ids (k, p + T), response mask (k, T), p)."""
    device = next(model.parameters()).device
    lengths = np.array([len(prompts[int(i)]) for i in prompt_index])
    out = []
    for p in np.unique(lengths):
        idx = np.flatnonzero(lengths == p)
        prompt_ids = torch.tensor([prompts[int(prompt_index[i])] for i in idx], device=device)
        ids, m = sample_group(model, Behaviour(), prompt_ids, T, generator, eos_token_id)
        out.append((idx, ids, m, int(p)))
    return out
