"""The aggregation weight 1/Z_i of the torch losses (the normalisations of
:func:`simkit.estimators.aggregation_weights`)."""

from __future__ import annotations

import torch

from simkit.estimators import AGGREGATIONS


def aggregation_scale(
    mask: torch.Tensor, agg: str = "token-mean", max_length: int | None = None
) -> torch.Tensor:
    """Per-row aggregation weight 1/Z_i, shape (N,), from a (N, T) bool ``mask``.

    The normalisations of :func:`simkit.estimators.aggregation_weights` (notation page,
    section D): ``token-mean`` Z = Σ mask; ``seq-mean-token-mean`` Z_i = N·|y_i|;
    ``seq-mean-token-sum`` Z = N; ``token-sum`` Z = 1; ``seq-mean-token-sum-norm`` Z = N·L_max
    with L_max = ``max_length`` (default T), which must be >= the longest row. A row (or batch)
    without valid tokens gets 0. Dtype float64 on the mask's device.
    """
    _check_aggregation(agg, max_length)
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape (N, T), got shape {tuple(mask.shape)}")
    return _inverse_z(mask.sum(dim=1, dtype=torch.float64), mask.shape[1], agg, max_length)


def _check_aggregation(agg: str, max_length) -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(
            f"unknown aggregation {agg!r}; valid aggregations: {', '.join(AGGREGATIONS)}"
        )
    if max_length is not None:
        if agg != "seq-mean-token-sum-norm":
            raise ValueError(
                f"max_length applies to aggregation 'seq-mean-token-sum-norm' only, not {agg!r}"
            )
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")


def _inverse_z(lengths: torch.Tensor, T: int, agg: str, max_length: int | None) -> torch.Tensor:
    """1/Z_i (N,) from the valid lengths (N,) (any float dtype; the result has it)."""
    N = lengths.shape[0]
    zeros = torch.zeros_like(lengths)
    if agg == "token-mean":
        total = lengths.sum()
        return torch.where(total > 0, 1.0 / total.clamp(min=1), zeros)
    if agg == "seq-mean-token-mean":
        return torch.where(lengths > 0, 1.0 / (N * lengths).clamp(min=1), zeros)
    if agg == "seq-mean-token-sum":
        return torch.full_like(lengths, 1.0 / N) if N else zeros
    if agg == "token-sum":
        return torch.ones_like(lengths)
    L_max = T if max_length is None else max_length
    longest = int(lengths.max()) if N else 0
    if longest > L_max:
        raise ValueError(
            f"max_length = {L_max} is shorter than the longest sequence ({longest} valid tokens)"
        )
    return torch.full_like(lengths, 1.0 / (N * L_max)) if N else zeros
