"""``simkit lm dump``: rollouts with known mismatch, in a trainer's logging format.

Samples n responses from the behaviour μ of a :mod:`simkit.lm.mismatch` generator (the tiny
Llama or SmolLM2), scores them under π and μ, and writes what a trainer logs — per-token
log π (the trainer's recomputation), log μ (the rollout engine's), the response mask and the
reward — in verl's column names (``old_log_probs``, ``rollout_log_probs``, ``response_mask``,
``token_level_scores``), TRL's (``old_per_token_logps``, ``sampling_per_token_logps``,
``completion_mask``, ``advantages``: here the reward itself) or a long per-token table
(``sample_id``, ``position``, ``log_pi``, ``log_mu``, ``reward``). A sidecar
``<file>.meta.json`` records the *known* mismatch: the per-token χ²(π‖μ), KL and TV computed
exactly over the vocabulary at every visited state (:func:`simkit.lm.sampling.token_divergences`)
and averaged over the valid tokens, against which ``simkit diagnose`` can be checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

FORMATS = ("verl", "trl", "long")


def dump_table(
    model,
    task,
    behaviour,
    *,
    n: int,
    T: int,
    tokenizer=None,
    eos_token_id=None,
    seed: int = 0,
    fmt: str = "verl",
    rows_per_call: int = 64,
) -> tuple[pd.DataFrame, dict]:
    """(table, meta): ``n`` responses from μ as a trainer would log them (module docstring)."""
    from simkit.lm import sampling
    from simkit.lm.mismatch import divergence_summary, prepare_pair

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    pi, mu = prepare_pair(behaviour, model, task, tokenizer, eos_token_id, T)
    prompts = task.prompt_ids(tokenizer)
    rng = np.random.default_rng(seed)
    device = next(pi.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    parts = []
    for start in range(0, n, rows_per_call):
        k = min(rows_per_call, n - start)
        parts.append(
            sampling._draw(
                pi,
                mu,
                task,
                tokenizer,
                prompts,
                rng.integers(0, len(prompts), size=k),
                T,
                eos_token_id,
                gen,
                (),
                "vmap",
                None,
                with_scores=False,
            )
        )
    lp = np.concatenate([d.log_prob for d in parts])
    lq = np.concatenate([d.old_log_prob for d in parts])
    mask = np.concatenate([d.mask for d in parts])
    rewards = np.concatenate([d.rewards for d in parts])
    divs = {k: np.concatenate([d.divergences[k] for d in parts]) for k in ("chi2", "kl", "tv")}
    means, profile = divergence_summary(divs, mask)
    L = mask.sum(1)
    rows = [slice(0, int(x)) for x in L]
    if fmt == "long":
        i, t = np.nonzero(mask)
        table = pd.DataFrame(
            {
                "sample_id": i,
                "position": t,
                "log_pi": lp[i, t],
                "log_mu": lq[i, t],
                "reward": rewards[i],
            }
        )
    else:
        names = (
            ("old_log_probs", "rollout_log_probs", "response_mask", "token_level_scores")
            if fmt == "verl"
            else (
                "old_per_token_logps",
                "sampling_per_token_logps",
                "completion_mask",
                "advantages",
            )
        )
        per_tok_reward = []
        for r, s in zip(rewards, rows):
            v = np.zeros(s.stop)
            if fmt == "verl":
                v[-1] = r  # verl puts the sequence score on the last token
            else:
                v[:] = r
            per_tok_reward.append(v.tolist())
        table = pd.DataFrame(
            {
                names[0]: [lp[i, s].tolist() for i, s in enumerate(rows)],
                names[1]: [lq[i, s].tolist() for i, s in enumerate(rows)],
                names[2]: [[1] * s.stop for s in rows],
                names[3]: per_tok_reward
                if fmt == "verl"
                else [[float(r)] * s.stop for r, s in zip(rewards, rows)],
            }
        )
    meta = {
        "behaviour": mu.name,
        "strength": float(mu.strength),
        "n": int(n),
        "T": int(T),
        "format": fmt,
        **{k: float(v) for k, v in means.items()},
        "profile_chi2_tok": [None if not np.isfinite(x) else float(x) for x in profile.chi2_tok],
        "mean_length": float(L.mean()),
        "reward_mean": float(rewards.mean()),
    }
    return table, meta


def write(table: pd.DataFrame, meta: dict, out) -> tuple[Path, Path]:
    """Write ``table`` (.parquet or .jsonl) and ``<out>.meta.json``."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        table.to_parquet(path, index=False)
    elif path.suffix in (".jsonl", ".json"):
        table.to_json(path, orient="records", lines=True, double_precision=15)
    else:
        raise ValueError(f"--out must end in .parquet or .jsonl, got {str(out)!r}")
    side = path.with_name(path.name + ".meta.json")
    side.write_text(json.dumps(meta, indent=2))
    return path, side
