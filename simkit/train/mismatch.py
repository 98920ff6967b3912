"""Inference mismatch: the behaviour policy μ that an inference engine actually samples from.

A trainer computes π = softmax(θ) in high precision; the inference engine that generates the
rollouts computes "the same" policy with other kernels, in low precision, sometimes with
outright bugs on rare tokens, so μ ≠ π even on-policy (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; Liu, Li et al. 2025, rl-collapse).
:class:`Mismatch` models three mechanisms, applied in this order to the behaviour logits θ_b
(the parameters the rollout was generated with):

1. **logit noise**: θ_b + σ·ε with ε ~ N(0, 1) i.i.d. per logit, drawn afresh for every rollout
   (different kernels / batch shapes give slightly different logits). Two noises **grow with
   the policy** (each drawn only when enabled, after σ's, in this order):

   - ``relative_noise`` ρ: + ρ·|θ_b − mean_v θ_b|·ε′ per logit — a kernel error proportional
     to the logit's magnitude (as floating-point error is), so it grows as logits sharpen;
   - ``sharpness_noise`` σ_s: + σ_s·(1 − H(π_b(·|t, p))/log V)·ε″ with ε″ ~ N(0, 1) per
     logit and one scale per row (t, p) — an expert-routing-like perturbation whose scale
     grows as the row becomes deterministic (0 on a uniform row, σ_s on a one-hot row);
2. **precision rounding**: every logit rounded to bfloat16 (8 significant bits) or float16
   (11 significant bits), round to nearest, ties to even (:func:`round_bf16`,
   :func:`round_fp16`) — the error grows with |θ|, so it grows as the policy sharpens;
3. **toxic-tail spikes**: in each row (t, p) independently, with probability ``spike_prob`` per
   rollout, the ``spike_tokens`` rarest tokens of the row get their μ-probability multiplied by
   e^{−``spike_strength``} (the ``tail`` family of :mod:`simkit.shifts`, the profile of
   :func:`simkit.envs.behaviour.toxic_tail`): rare events with huge ratios π/μ on rare tokens.

The result is returned as log-probabilities log μ (T, P, V) (log space: a starved token keeps
an exact finite log-probability).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from simkit import shifts
from simkit._validation import int_at_least

__all__ = [
    "PRECISIONS",
    "Mismatch",
    "behaviour_log_probs",
    "log_softmax",
    "round_bf16",
    "round_fp16",
    "round_logits",
    "row_entropy",
]

#: precisions the inference engine can be emulated in (None: float64, no rounding)
PRECISIONS = ("bf16", "fp16")


def log_softmax(logits) -> np.ndarray:
    """log softmax over the last axis: x − max − log Σ exp(x − max), shape of ``logits``.

    The trainer's log π and the engine's log μ are both computed with this function, so that
    when θ_b = θ and there is no mismatch, log π − log μ is exactly 0.0 (bit for bit). The
    input is made C-contiguous first: numpy sums a non-contiguous last axis in another order,
    so equal values laid out differently would otherwise differ in the last bits.
    """
    x = np.ascontiguousarray(logits, dtype=np.float64)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last axis, got shape {x.shape}")
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def row_entropy(logits) -> np.ndarray:
    """H(softmax(``logits``)) over the last axis, nats (shape of ``logits`` without it)."""
    log_p = log_softmax(logits)
    return -(np.exp(log_p) * log_p).sum(axis=-1)


def round_bf16(x) -> np.ndarray:
    """``x`` rounded to bfloat16 (1 sign, 8 exponent, 7 stored mantissa bits), as float64.

    Emulated in numpy: x → float32 (exact for the values we round, up to float32 rounding),
    then the low 16 bits of the float32 pattern are rounded to nearest, ties to even (add
    0x7FFF plus the lowest kept bit, clear the low 16 bits) — the conversion of
    ``torch.Tensor.to(torch.bfloat16)``. Finite inputs only (|x| < 3.39e38).
    """
    arr = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError("round_bf16: x contains non-finite entries")
    bits = arr.astype(np.float32).view(np.uint32)
    bits = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) & np.uint32(
        0xFFFF0000
    )
    return bits.view(np.float32).astype(np.float64)


def round_fp16(x) -> np.ndarray:
    """``x`` rounded to IEEE half precision (10 stored mantissa bits, round to nearest even),
    as float64 (numpy's float16 conversion). Values beyond the largest half (65504) raise."""
    arr = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError("round_fp16: x contains non-finite entries")
    if arr.size and np.abs(arr).max() > float(np.finfo(np.float16).max):
        raise ValueError(
            f"round_fp16: |x| up to {np.abs(arr).max():.6g} overflows float16 (max 65504)"
        )
    return arr.astype(np.float16).astype(np.float64)


def round_logits(logits, precision: str | None) -> np.ndarray:
    """``logits`` rounded to ``precision`` (``"bf16"``, ``"fp16"``) or unchanged (None)."""
    if precision is None:
        return np.asarray(logits, dtype=np.float64)
    if precision == "bf16":
        return round_bf16(logits)
    if precision == "fp16":
        return round_fp16(logits)
    raise ValueError(f"precision must be None or one of {PRECISIONS}, got {precision!r}")


@dataclass(frozen=True)
class Mismatch:
    """Inference-mismatch model (module docstring); the default is no mismatch (μ = π_b).

    Parameters
    ----------
    logit_noise : σ ≥ 0 of the Gaussian noise added to every behaviour logit, per rollout.
    relative_noise : ρ ≥ 0: noise ρ·|θ_b − row mean|·ε′ (grows with the logits' spread).
    sharpness_noise : σ_s ≥ 0: noise σ_s·(1 − H_row/log V)·ε″ (grows as a row sharpens).
    precision : None, ``"bf16"`` or ``"fp16"``: the engine's logits are rounded to it.
    spike_prob : probability in [0, 1] that a row (t, p) gets a toxic-tail spike in a rollout.
    spike_strength : s ≥ 0: a spiked row's rarest tokens have μ multiplied by e^{−s}.
    spike_tokens : how many rarest tokens of a spiked row are starved (≥ 1, < V).
    """

    logit_noise: float = 0.0
    precision: str | None = None
    spike_prob: float = 0.0
    spike_strength: float = 0.0
    spike_tokens: int = 1
    relative_noise: float = 0.0
    sharpness_noise: float = 0.0

    def __post_init__(self):
        for name in (
            "logit_noise",
            "spike_prob",
            "spike_strength",
            "relative_noise",
            "sharpness_noise",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise ValueError(f"Mismatch.{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Mismatch.{name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.spike_prob > 1:
            raise ValueError(f"Mismatch.spike_prob must be in [0, 1], got {self.spike_prob}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(
                f"Mismatch.precision must be None or one of {PRECISIONS}, got {self.precision!r}"
            )
        tokens = int_at_least(self.spike_tokens, "Mismatch.spike_tokens", 1)
        object.__setattr__(self, "spike_tokens", tokens)

    @property
    def none(self) -> bool:
        """True when μ is exactly the behaviour-version policy (no mismatch at all)."""
        return (
            self.logit_noise == 0
            and self.relative_noise == 0
            and self.sharpness_noise == 0
            and self.precision is None
            and (self.spike_prob == 0 or self.spike_strength == 0)
        )

    @property
    def stochastic(self) -> bool:
        """True when building μ draws random numbers (noise or spikes)."""
        return (
            self.logit_noise > 0
            or self.relative_noise > 0
            or self.sharpness_noise > 0
            or (self.spike_prob > 0 and self.spike_strength > 0)
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def label(self) -> str:
        """Short description, e.g. ``"bf16 + noise 0.05 + spikes p=0.001 s=8"`` or ``"none"``
        (``k=…`` is added when more than one token per row is spiked)."""
        parts = []
        if self.precision is not None:
            parts.append(self.precision)
        if self.logit_noise > 0:
            parts.append(f"noise {self.logit_noise:g}")
        if self.relative_noise > 0:
            parts.append(f"relative noise {self.relative_noise:g}")
        if self.sharpness_noise > 0:
            parts.append(f"sharpness noise {self.sharpness_noise:g}")
        if self.spike_prob > 0 and self.spike_strength > 0:
            tokens = f" k={self.spike_tokens}" if self.spike_tokens != 1 else ""
            parts.append(f"spikes p={self.spike_prob:g} s={self.spike_strength:g}{tokens}")
        return " + ".join(parts) or "none"


def behaviour_log_probs(
    logits, mismatch: Mismatch, rng: np.random.Generator | None = None
) -> np.ndarray:
    """log μ (T, P, V) of an inference engine serving the behaviour logits θ_b = ``logits``.

    Steps 1–3 of the module docstring: noise (from ``rng``), rounding, spikes (rows drawn from
    ``rng``: one uniform per row (t, p), in C order, then the tail family on the chosen rows).
    ``rng`` is required when ``mismatch.stochastic``. Without mismatch this is exactly
    :func:`log_softmax` (``logits``).
    """
    if not isinstance(mismatch, Mismatch):
        raise TypeError(f"mismatch must be a Mismatch, got {type(mismatch).__name__}")
    theta = np.asarray(logits, dtype=np.float64)
    if theta.ndim != 3:
        raise ValueError(f"logits must have shape (T, P, V), got shape {theta.shape}")
    if mismatch.stochastic and not isinstance(rng, np.random.Generator):
        raise TypeError("a stochastic mismatch (noise or spikes) needs rng, a numpy Generator")
    base = theta
    if mismatch.logit_noise > 0:
        theta = theta + mismatch.logit_noise * rng.standard_normal(theta.shape)
    if mismatch.relative_noise > 0:
        spread = np.abs(base - base.mean(axis=-1, keepdims=True))
        theta = theta + mismatch.relative_noise * spread * rng.standard_normal(theta.shape)
    if mismatch.sharpness_noise > 0 and theta.shape[-1] > 1:
        scale = mismatch.sharpness_noise * (1.0 - row_entropy(base) / math.log(theta.shape[-1]))
        theta = theta + scale[..., None] * rng.standard_normal(theta.shape)
    theta = round_logits(theta, mismatch.precision)
    log_mu = log_softmax(theta)
    if mismatch.spike_prob > 0 and mismatch.spike_strength > 0:
        T, P, V = theta.shape
        if mismatch.spike_tokens >= V:
            raise ValueError(
                f"Mismatch.spike_tokens = {mismatch.spike_tokens} must be < V = {V} (a spike "
                "starves the rarest tokens of a row, not all of them)"
            )
        rows = rng.random((T, P)) < mismatch.spike_prob
        if rows.any():
            family = shifts.get("tail", n_tokens=mismatch.spike_tokens)
            spiked = family.apply(np.exp(log_mu[rows]), mismatch.spike_strength)
            with np.errstate(divide="ignore"):
                log_mu[rows] = np.log(spiked)
    return log_mu
