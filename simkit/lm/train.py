"""RL training of a real causal LM with the rollout schedule of :mod:`simkit.train`.

The simulator's loop (:func:`simkit.train.train`) on a ``transformers`` causal LM (the tiny
Llama of :func:`simkit.lm.models.tiny_llama`, or any causal LM) and a verifiable token task
(:class:`simkit.lm.tasks.TokenTask`: R = 1 iff the target token occurs in the response). One
**rollout**:

1. μ's network is the trainer's θ ``lag`` rollouts ago (a copy, asynchronous RL), served
   through an emulated inference engine: its logits rounded to bfloat16 (``precision``) and
   divided by ``temperature`` before the softmax (none of this by default: μ = π_b);
2. ``batch`` = N·``minibatch_size`` responses of ``response_length`` tokens are sampled from
   μ (:func:`simkit.lm.models.sample_responses`, one seeded ``torch.Generator``), groups of
   ``group_size`` responses per prompt, prompts round-robin over the task's training prompts;
   log μ of every token is recomputed by a full forward pass of μ's network
   (:func:`simkit.lm.models.sequence_log_probs`, with the engine's logit map);
3. rewards and GRPO advantages (:func:`simkit.estimators.advantages`) are computed once;
4. N optimizer steps (Adam, ``torch.optim.Adam``), one per mini-batch in order, each on the loss
   :func:`simkit.lm.losses.policy_loss` of the mapping with log π (current θ, differentiable)
   against log μ — the same estimators as the simulator. With a ``correction`` (a composed
   loss: verl's decoupled PPO × token TIS, ``mode="decoupled"``; bypass; TRL's VESPO) the
   trainer also recomputes log π_old with its own weights at the rollout's start (no engine
   transform), as verl and TRL do: the mapping acts on π/π_old and the correction on
   π_old/μ — the three policies of :mod:`simkit.train.core`.

With N = 1, no lag and no engine transform, μ's log-probabilities are computed by the same
function on the same weights as π's: every log-ratio is exactly 0, every mapping with
``on_policy_identity`` has c = 1, and the first update equals REINFORCE's (to float rounding
of the loss scaling).

**J** is computed every ``eval_every`` steps (and at the first and last) on held-out prompts
(the task's prompts drawn with ``eval_seed``). With ``exact_J=True`` (default) it is **exact**:
for the presence task R = 1{target ∈ y}, J(π) = 1 − mean_x Σ_{y ∈ (V∖{target})^T} Π_t π(y_t
| x, y_<t), every target-free response of T tokens scored in one batched forward pass in
float64 (:func:`exact_presence_J`; (V − 1)^T responses per prompt), ``J_se`` = 0 — the curves
carry no evaluation noise. With ``exact_J=False``: ``eval_samples`` responses from π (no
engine transform) with a generator seeded by (seed, step); ``J`` is their mean reward and
``J_se`` its standard error (sd/√n, ddof = 1).

``max_grad_norm`` clips the gradient's global norm before the Adam step
(``torch.nn.utils.clip_grad_norm_``), as the simulator's ``TrainConfig.max_grad_norm`` does.

**Reproducibility and resume**: all randomness comes from ``seed`` (the rollout generator
``torch.Generator(device=d).manual_seed(seed)`` on the model's device d; evaluation generators
from (seed, step), on d too); with ``out_dir`` a checkpoint (weights, optimizer state, lagged
versions, generator state, the table so far) is written atomically after every rollout
(:func:`simkit.shards.atomic_write`), and the same call resumes from it, giving the table of an
uninterrupted run.

**Devices**: the run lives where the model's parameters live (move the model first, e.g.
``tiny_llama(device="cuda")``): sampling, log-probabilities, losses and updates run there, the
generators are built there (``torch.multinomial`` needs its generator on the logits' device).
On CPU the draws are those of ``torch.Generator()`` (bit-identical to the CPU-only trainer);
a CUDA generator is a different stream (Philox), so a CUDA run reproduces itself, not the CPU
table. GPU timings are not recorded yet (no GPU was lent to this project; see
``benchmarks/lm_gpu.py``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from simkit import estimators
from simkit._validation import int_at_least
from simkit.lm import losses, models
from simkit.lm.arg_checks import _model_device
from simkit.lm.tasks import TokenTask
from simkit.shards import atomic_write

__all__ = ["COLUMNS", "LMTrainConfig", "exact_presence_J", "train_lm"]

#: columns of the table (one row per optimizer step)
COLUMNS = {
    "step": "optimizer step s; the row describes π_s before update s",
    "rollout": "rollout index s // N",
    "minibatch": "mini-batch j = s % N",
    "staleness": "updates between μ's weights and π_s",
    "loss": "the policy loss of the mini-batch",
    "grad_norm": "‖∇θ loss‖ over every trained parameter",
    "max_abs_log_ratio": "largest |log π_s − log μ| over the mini-batch's tokens",
    "reward_mean": "mean reward of the mini-batch",
    "recorded": "True where J was estimated",
    "J": "held-out J(π_s): exact (exact_J) or the mean reward of eval_samples responses",
    "J_se": "standard error of J (sd/√n; 0 when exact)",
}
_CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class LMTrainConfig:
    """Hyperparameters of an LM training run (module docstring).

    ``mapping`` (a name of :func:`simkit.lm.losses.available`) with ``hyperparams`` (pairs),
    ``aggregation``, optional ``correction`` (a mapping name) and its ``mode``, GRPO
    ``group_size``; schedule ``steps``, ``minibatches`` (N),
    ``minibatch_size`` (responses per update, a multiple of ``group_size``), ``lag``; Adam
    ``lr``; ``response_length``; inference engine ``precision`` (None or ``"bf16"``) and
    ``temperature``; task ``target`` token, ``n_prompts``, ``prompt_length``, ``task_seed``,
    ``eval_seed``; evaluation ``eval_every``, ``eval_samples``, ``exact_J``; gradient clipping
    ``max_grad_norm`` (None: none). A bypass composition whose mapping and correction both carry
    the ratio (:func:`simkit.composition.carries_ratio`) is refused unless
    ``allow_same_ratio``, as :class:`simkit.estimators.Estimator` refuses it.
    """

    mapping: str = "naive"
    hyperparams: tuple = ()
    aggregation: str = "token-mean"
    correction: str | None = None
    mode: str = "decoupled"
    group_size: int = 4
    steps: int = 8
    minibatches: int = 1
    minibatch_size: int = 8
    lag: int = 0
    lr: float = 1e-2
    response_length: int = 6
    precision: str | None = None
    temperature: float = 1.0
    target: int = 1
    n_prompts: int = 4
    prompt_length: int = 3
    task_seed: int = 0
    eval_seed: int = 1
    eval_every: int = 4
    eval_samples: int = 32
    exact_J: bool = False
    max_grad_norm: float | None = None
    allow_same_ratio: bool = False

    def __post_init__(self):
        for name, low in (
            ("group_size", 2),
            ("steps", 1),
            ("minibatches", 1),
            ("minibatch_size", 1),
            ("lag", 0),
            ("response_length", 1),
            ("n_prompts", 1),
            ("prompt_length", 1),
            ("eval_every", 1),
            ("eval_samples", 2),
        ):
            value = int_at_least(getattr(self, name), f"LMTrainConfig.{name}", low)
            object.__setattr__(self, name, value)
        if self.minibatch_size % self.group_size:
            raise ValueError(
                f"LMTrainConfig.minibatch_size = {self.minibatch_size} must be a multiple of "
                f"group_size = {self.group_size}"
            )
        if self.mapping not in losses.available():
            raise ValueError(
                f"LMTrainConfig.mapping must be one of {', '.join(losses.available())}, "
                f"got {self.mapping!r}"
            )
        if self.correction is not None and self.correction not in losses.available():
            raise ValueError(
                f"LMTrainConfig.correction must be None or one of {', '.join(losses.available())}"
                f", got {self.correction!r}"
            )
        if self.mode not in ("decoupled", "bypass", "trl_vespo"):
            raise ValueError(
                "LMTrainConfig.mode must be 'decoupled', 'bypass' or 'trl_vespo', got "
                f"{self.mode!r}"
            )
        if self.correction is not None and self.mode == "bypass" and not self.allow_same_ratio:
            from simkit import composition, mappings

            both = all(
                composition.carries_ratio(mappings.get(name))
                for name in (self.mapping, self.correction)
            )
            if both:
                raise ValueError(
                    f"LMTrainConfig: mode 'bypass' sets π_old := μ, so mapping {self.mapping!r} "
                    f"and correction {self.correction!r} would both act on the one ratio π/μ "
                    "(the ratio counted twice); use mode 'decoupled' or allow_same_ratio=True"
                )
        if self.precision not in (None, "bf16"):
            raise ValueError(
                f"LMTrainConfig.precision must be None or 'bf16', got {self.precision!r}"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"LMTrainConfig.temperature must be > 0, got {self.temperature!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"LMTrainConfig.lr must be > 0, got {self.lr!r}")
        if self.max_grad_norm is not None and not (
            math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0
        ):
            raise ValueError(
                f"LMTrainConfig.max_grad_norm must be None or > 0, got {self.max_grad_norm!r}"
            )

    @property
    def batch(self) -> int:
        return self.minibatches * self.minibatch_size


def _engine(cfg: LMTrainConfig):
    """μ's logit map (None: plain softmax, exactly π's computation)."""
    if cfg.precision is None and cfg.temperature == 1.0:
        return None

    def processor(z):
        if cfg.precision == "bf16":
            z = z.to(torch.bfloat16).to(z.dtype)
        return torch.log_softmax(z / cfg.temperature, dim=-1)

    return processor


def _log_probs(model, ids, attn, resp, processor=None):
    return models.sequence_log_probs(model, ids, attn, resp, logits_processor=processor)


def _evaluate(model, task: TokenTask, cfg: LMTrainConfig, seed: int, step: int):
    prompts = torch.tensor(task.prompt_ids(), dtype=torch.long)
    idx = np.arange(cfg.eval_samples) % len(prompts)
    gen = torch.Generator(device=_model_device(model)).manual_seed(
        int(np.random.SeedSequence([seed, step]).generate_state(1)[0])
    )
    roll = models.sample_responses(model, prompts[idx], cfg.response_length, gen)
    r = task.rewards(idx, roll.response_ids, roll.response_mask[:, roll.prompt_length :])
    return float(r.mean()), float(r.std(ddof=1) / math.sqrt(len(r)))


def exact_presence_J(model, prompts, target: int, T: int) -> float:
    """J(π) = E_x P_π(target ∈ y | x) over the ``prompts`` (uniform), exactly: one minus the
    probability of the (V − 1)^T target-free responses of T tokens, each scored by one batched
    forward pass (float64 log-softmax of the model's logits). Shapes: prompts (K, p)."""
    V = model.config.vocab_size
    others = torch.tensor([v for v in range(V) if v != target], dtype=torch.long)
    grid = torch.cartesian_prod(*([others] * T)).reshape(-1, T)  # ((V−1)^T, T)
    device = _model_device(model)
    total = 0.0
    with torch.no_grad():
        for x in torch.as_tensor(prompts, dtype=torch.long):
            p = len(x)
            ids = torch.cat([x.expand(len(grid), p), grid], dim=1).to(device)
            logits = model(ids).logits[:, p - 1 : p + T - 1].to(torch.float64)
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None])[..., 0]
            total += float(torch.exp(lp.sum(dim=1)).sum())
    return 1.0 - total / len(prompts)


def train_lm(model, config: LMTrainConfig, seed: int = 0, *, out_dir=None, stop_after=None):
    """Train ``model`` (a transformers causal LM, modified in place) with ``config``; return
    the per-step table (:data:`COLUMNS`). ``out_dir``: checkpoint after every rollout and
    resume from it; ``stop_after``: stop after this many steps (rounded up to a rollout)."""
    if not isinstance(config, LMTrainConfig):
        raise TypeError(f"config must be an LMTrainConfig, got {type(config).__name__}")
    vocab = model.config.vocab_size
    if not 0 <= config.target < vocab:
        raise ValueError(
            f"LMTrainConfig.target must be a token in [0, {vocab}), got {config.target}"
        )
    train_task = TokenTask(
        vocab, config.target, config.n_prompts, config.prompt_length, seed=config.task_seed
    )
    eval_task = TokenTask(
        vocab, config.target, config.n_prompts, config.prompt_length, seed=config.eval_seed
    )
    prompts = torch.tensor(train_task.prompt_ids(), dtype=torch.long)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    device = _model_device(model)
    gen = torch.Generator(device=device).manual_seed(seed)
    versions: list[dict] = []
    rows: list[dict] = []
    step = 0
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        ck = out / _CHECKPOINT
        if ck.exists():
            # on CPU: the generator state must be a CPU tensor; weights and optimizer state
            # are copied to the model's device by load_state_dict
            state = torch.load(ck, weights_only=False, map_location="cpu")
            if state["config"] != asdict(config) or state["seed"] != seed:
                raise ValueError(f"{out} holds another LM training run (other config or seed)")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            versions, rows, step = state["versions"], state["rows"], state["step"]
            gen.set_state(state["gen"])
    end = config.steps if stop_after is None else min(config.steps, int(stop_after))
    mu_net = copy.deepcopy(model)
    processor = _engine(config)
    N, m, G = config.minibatches, config.minibatch_size, config.group_size
    hp = dict(config.hyperparams)
    while step < end:
        r = step // N
        versions.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        del versions[: max(len(versions) - (config.lag + 1), 0)]
        mu_net.load_state_dict(versions[0])
        behind = len(versions) - 1
        groups = config.batch // G
        pidx = (np.arange(config.batch) // G + r * groups) % len(prompts)
        roll = models.sample_responses(
            mu_net, prompts[pidx], config.response_length, gen, logits_processor=processor
        )
        ids, attn, resp = roll.input_ids, roll.attention_mask, roll.response_mask
        with torch.no_grad():
            log_mu = _log_probs(mu_net, ids, attn, resp, processor)
            # π_old: the trainer's own recompute at the rollout's start (composed losses)
            log_old = _log_probs(model, ids, attn, resp) if config.correction else None
        rewards = train_task.rewards(pidx, roll.response_ids, resp[:, roll.prompt_length :])
        adv = estimators.advantages(rewards, "grpo", group_size=G)
        adv_t = torch.tensor(adv, dtype=log_mu.dtype, device=log_mu.device)
        for j in range(N):
            if step >= config.steps:
                break
            rows_j = slice(j * m, (j + 1) * m)
            record = step % config.eval_every == 0 or step == config.steps - 1
            J, J_se = (math.nan,) * 2
            if record and config.exact_J:
                J = exact_presence_J(
                    model, eval_task.prompt_ids(), config.target, config.response_length
                )
                J_se = 0.0
            elif record:
                J, J_se = _evaluate(model, eval_task, config, seed, step)
            log_pi = _log_probs(model, ids[rows_j], attn[rows_j], resp[rows_j])
            composed = {}
            if config.correction is not None:
                composed = dict(
                    correction=config.correction,
                    mode=config.mode,
                    allow_same_ratio=config.allow_same_ratio,
                )
                if config.mode != "bypass":  # bypass: old_log_prob is log μ itself
                    composed["rollout_log_prob"] = log_mu[rows_j]
            old = log_mu if config.correction is None or config.mode == "bypass" else log_old
            loss, _ = losses.policy_loss(
                config.mapping,
                log_pi,
                old[rows_j],
                adv_t[rows_j],
                resp[rows_j],
                agg=config.aggregation,
                compute_metrics=False,
                **composed,
                **hp,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            gnorm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if config.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            opt.step()
            with torch.no_grad():
                lr_tok = (log_pi.detach() - log_mu[rows_j]).masked_fill(~resp[rows_j], 0.0)
            rows.append(
                dict(
                    step=step,
                    rollout=r,
                    minibatch=j,
                    staleness=behind * N + j,
                    loss=float(loss.detach()),
                    grad_norm=gnorm,
                    max_abs_log_ratio=float(lr_tok.abs().max()),
                    reward_mean=float(rewards[rows_j].mean()),
                    recorded=record,
                    J=J,
                    J_se=J_se,
                )
            )
            step += 1
        if out is not None:
            checkpoint = dict(
                config=asdict(config),
                seed=seed,
                model=model.state_dict(),
                opt=opt.state_dict(),
                versions=versions,
                rows=rows,
                step=step,
                gen=gen.get_state(),
            )
            atomic_write(out / _CHECKPOINT, partial(torch.save, checkpoint))  # torch.save(obj, fh)
    return pd.DataFrame(rows, columns=list(COLUMNS))
