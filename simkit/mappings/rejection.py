"""Divergence-based rejection (verl's ``rollout_rs``): drop tokens or sequences whose estimated
divergence between the two policies exceeds a threshold.

verl ``verl/trainer/ppo/rollout_corr_helper.py`` at commit b178a3c,
``compute_rollout_rejection_mask``: with x = log r clamped to ±``max_log_ratio`` (verl's
``SAFETY_BOUND`` = 20), the per-token estimators k2 = ½x² and k3 = e^x − 1 − x (Schulman,
"Approximating KL divergence", 2020) are compared with an upper threshold u, per token
(``token_k2``/``token_k3``) or after a sum / mean / max over the row's valid tokens
(``seq_sum_*``/``seq_mean_*``/``seq_max_*``). Several criteria are chained with AND. The k1
(ratio-band) modes of verl are :class:`~simkit.mappings.masking.GeoMask` (``seq_mean_k1``, see
its preset ``verl_head``) and the masked-IS mappings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from simkit.mappings.base import (
    BLOCK_ELEMENTS,
    Mapping,
    check_real,
    register,
    seq_lengths,
)

#: every criterion ``kl_rs`` understands (verl's names; the k1 ones live in geo_mask / mis_*)
KL_RS_CRITERIA = (
    "token_k2",
    "token_k3",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def divergence_terms(x: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """Per-token k2 = ½x² or k3 = e^x − 1 − x (= expm1(x) − x, no cancellation) of log-ratios x."""
    if kind == "k2":
        out = np.multiply(x, x, out=out)
        return np.multiply(out, 0.5, out=out)
    out = np.expm1(x, out=out)
    return np.subtract(out, x, out=out)


@register
@dataclass(frozen=True)
class KLRejection(Mapping):
    """Divergence rejection: c_t = 1 if every criterion keeps token t, else 0 (base 1).

    ``criteria`` is one name of :data:`KL_RS_CRITERIA` or a tuple of them (all must pass: verl
    chains a comma-separated ``rollout_rs`` with AND); ``u`` the threshold, one shared value or
    one per criterion (verl's ``rollout_rs_threshold``), each > 0. A token criterion keeps
    token t iff k(x_t) ≤ u; a sequence criterion keeps every token of row i iff
    agg_t k(x_t) ≤ u (agg = sum / mean / max over the valid tokens; an empty row has statistic
    0 and is kept). x = clip(log r, ±``max_log_ratio``). Defaults: ``seq_mean_k3`` with
    u = 0.01 (verl ``RolloutCorrectionConfig.decoupled_k3_rs``). On-policy every statistic is
    0 ⇒ c = 1. No surrogate: it is a detached mask.
    """

    criteria: str | tuple[str, ...] = "seq_mean_k3"
    u: float | tuple[float, ...] = 0.01
    max_log_ratio: float = 20.0
    name = "kl_rs"
    rejects = True
    level = "sequence"
    presets: ClassVar[dict[str, dict]] = {
        "verl_k3": {"criteria": "seq_mean_k3", "u": 0.01},
        "verl_token_k3": {"criteria": "token_k3", "u": 0.01},
    }

    def __post_init__(self):
        crit = (self.criteria,) if isinstance(self.criteria, str) else self.criteria
        if not isinstance(crit, tuple | list) or not crit:
            raise ValueError(
                f"kl_rs: criteria must be a criterion name or a non-empty tuple of them, got "
                f"{self.criteria!r}; valid criteria: {', '.join(KL_RS_CRITERIA)}"
            )
        for c in crit:
            if c not in KL_RS_CRITERIA:
                raise ValueError(
                    f"kl_rs: unknown criterion {c!r} in criteria; valid criteria: "
                    f"{', '.join(KL_RS_CRITERIA)}"
                )
        crit = tuple(dict.fromkeys(crit))  # duplicates are one criterion (as verl)
        us = self.u if isinstance(self.u, tuple | list) else (self.u,)
        if len(us) not in (1, len(crit)):
            raise ValueError(
                f"kl_rs: u must be one threshold or one per criterion ({len(crit)}), got {self.u!r}"
            )
        for value in us:
            probe = _Probe(value)
            check_real(probe, "u", low=0.0, high=math.inf, low_open=True, allow_inf=True)
        check_real(self, "max_log_ratio", low=0.0, high=700.0, low_open=True)
        object.__setattr__(self, "criteria", crit[0] if len(crit) == 1 else crit)
        if isinstance(self.u, list):
            object.__setattr__(self, "u", tuple(float(v) for v in us))
        if all(c.startswith("token_") for c in crit):
            object.__setattr__(self, "level", "token")

    @property
    def rules(self) -> list[tuple[str, float]]:
        """(criterion, threshold) pairs in order."""
        crit = (self.criteria,) if isinstance(self.criteria, str) else self.criteria
        us = self.u if isinstance(self.u, tuple) else (self.u,) * len(crit)
        if len(us) == 1:
            us = us * len(crit)
        return [(c, float(v)) for c, v in zip(crit, us, strict=True)]

    def kept_mask(self, log_ratio, mask, advantages) -> np.ndarray:
        """The tokens this rejection keeps, (N, T) bool (False on padding)."""
        from simkit._validation import check_batch

        lr, m, _ = check_batch(log_ratio, mask, advantages)
        return self._keep(lr, m)

    def _keep(self, log_ratio, mask) -> np.ndarray:
        N, T = log_ratio.shape
        keep = mask.copy()
        if keep.size == 0:
            return keep
        cap = self.max_log_ratio
        rules = self.rules
        seq_rules = [(c, u) for c, u in rules if not c.startswith("token_")]
        tok_rules = [(c, u) for c, u in rules if c.startswith("token_")]
        kinds = sorted({c[-2:] for c, _ in rules})
        n = seq_lengths(mask)
        row_ok = np.ones(N, dtype=bool)
        rows = max(1, BLOCK_ELEMENTS // max(T, 1))
        x = np.empty((min(rows, N), T))
        k = np.empty((min(rows, N), T))
        flags = np.empty((min(rows, N), T), dtype=bool)
        for start in range(0, N, rows):
            stop = min(start + rows, N)
            b = slice(0, stop - start)
            np.clip(log_ratio[start:stop], -cap, cap, out=x[b])
            m = mask[start:stop]
            for kind in kinds:
                divergence_terms(x[b], kind, out=k[b])
                for crit, u in tok_rules:
                    if crit[-2:] == kind:
                        np.less_equal(k[b], u, out=flags[b])
                        keep[start:stop] &= flags[b]
                for crit, u in seq_rules:
                    if crit[-2:] != kind:
                        continue
                    if crit.startswith("seq_max"):
                        stat = np.maximum.reduce(k[b], axis=1, where=m, initial=-np.inf)
                        stat = np.where(np.isneginf(stat), 0.0, stat)
                    else:
                        stat = np.add.reduce(k[b], axis=1, where=m, initial=0.0)
                        if crit.startswith("seq_mean"):
                            nn = n[start:stop]
                            stat = np.divide(stat, nn, out=np.zeros_like(stat), where=nn > 0)
                    row_ok[start:stop] &= stat <= u
        keep &= row_ok[:, None]
        return keep

    def _coefficients(self, log_ratio, mask, advantages):
        return self._keep(log_ratio, mask).astype(np.float64)


@dataclass(frozen=True)
class _Probe:
    """Holder so that :func:`check_real` names ``kl_rs: u`` for each threshold of a tuple."""

    u: float
    name: str = "kl_rs"
