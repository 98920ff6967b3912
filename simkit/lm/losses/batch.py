"""The batch every loss kernel receives (:class:`_Batch`) and what a kernel returns
(:class:`_Terms`), for :mod:`simkit.lm.losses`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Batch:
    """Validated inputs in the compute dtype; padded positions already neutralised.

    ``log_ratio`` (N, T): log π − log μ, exactly 0 on padding; it carries the gradient to
    ``log_prob`` for surrogate losses and is detached for detached ones. ``mask`` (N, T) bool and
    ``maskf`` the same as 0/1 in the compute dtype. ``positive`` (N,) bool: A >= 0. ``lengths``
    (N,) valid tokens per row (compute dtype). ``log_w`` (N,) detached Σ_t log r_t, ``log_s``
    (N,) detached mean_t log r_t (0 for an empty row). ``lr_min``, ``lr_max``: the smallest and
    largest entry of ``log_ratio`` (padding zeros included), as Python floats.
    """

    log_ratio: torch.Tensor
    mask: torch.Tensor
    maskf: torch.Tensor
    positive: torch.Tensor
    lengths: torch.Tensor
    log_w: torch.Tensor
    log_s: torch.Tensor
    lr_min: float
    lr_max: float
    adv: torch.Tensor | None = None
    log_prob: torch.Tensor | None = None
    rng: object = None
    full: bool = False

    def expm1(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """expm1(log r) (N, T), computed once per batch and shared (kl_rs's k3 criteria,
        clip_cov's ratio and the metrics need it; 0 on padding). Callers must not modify it in
        place. ``out``: a free buffer of that shape and dtype to compute it into (optional)."""
        cache = self.__dict__.setdefault("_cache", {})
        if "expm1" not in cache:
            cache["expm1"] = torch.expm1(self.log_ratio.detach(), out=out)
        return cache["expm1"]

    def expm1_sums(self) -> list[torch.Tensor]:
        """[Σe², Σe, Σ(e − log r)] over every entry of e = :meth:`expm1` (0-d tensors; padding
        adds 0): the metrics' token sums (χ² = mean(e² + 2e), k3 = mean(e − log r), each term
        without cancellation). Computed once, after which the batch forgets the expm1 (its
        buffer is overwritten: a kernel that shares the expm1 takes the sums before reusing
        the buffer, so that the metrics need no (N, T) memory of their own; e − log r is
        :meth:`k3`'s when a kernel formed it)."""
        cache = self.__dict__.setdefault("_cache", {})
        if "expm1_sums" not in cache:
            e = self.expm1().reshape(-1)
            del cache["expm1"]
            k3 = cache.pop("k3", None)  # e − log r, when a kernel formed it (kl_rs)
            sums = [torch.dot(e, e), e.sum()]
            if k3 is None:  # (e's buffer, after its own sums)
                k3 = e.sub_(self.log_ratio.detach().reshape(-1))
            cache["expm1_sums"] = [*sums, k3.reshape(-1).sum()]
        return cache["expm1_sums"]

    def k3(self) -> torch.Tensor:
        """e − log r (N, T), e = :meth:`expm1` (Schulman's k3 per token; 0 on padding), computed
        once and shared with the metrics' Σ(e − log r) (:meth:`expm1_sums`). Callers must not
        modify it in place."""
        cache = self.__dict__.setdefault("_cache", {})
        if "k3" not in cache:
            cache["k3"] = self.expm1() - self.log_ratio.detach()
        return cache["k3"]

    def per_row(self, value_pos: float, value_neg: float) -> torch.Tensor:
        """(N,) tensor: ``value_pos`` on rows with A >= 0, ``value_neg`` on the others."""
        return torch.full_like(self.log_w, value_neg).masked_fill_(self.positive, value_pos)

    def ratio_value(self, log_ratio: torch.Tensor, cap: float, out=None) -> torch.Tensor:
        """exp(min(``log_ratio``, cap)) without autograd, for a kernel that computes its own
        derivative; ``log_ratio`` is this batch's (its detached values). ``out``: a buffer of
        that shape and dtype to write into (optional)."""
        if self.lr_max <= cap:
            return torch.exp(log_ratio, out=out)
        return torch.clamp(log_ratio, max=cap, out=out).exp_()

    def count_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """Number of True entries of ``flags`` (N, T) bool, which must be False wherever the
        log-ratio is 0 (so on every padded position): the clipped valid tokens."""
        return torch.count_nonzero(flags)

    def count_outside(self, inside: torch.Tensor) -> torch.Tensor:
        """Number of 0 entries of the 0/1 float ``inside`` (N, T), which must be 1 on every
        padded position (a band that contains r = 1): the clipped valid tokens."""
        # a float32 sum of 0/1 is exact up to 2^24 entries (and ~4.5x faster than float64:
        # 256×2048, one thread, torch 2.13 CPU, 0.025 vs 0.11 ms, best of 5)
        exact = inside.numel() <= 2**24 or inside.dtype == torch.float64
        return inside.numel() - inside.sum(dtype=None if exact else torch.float64)

    def count_rows(self, clipped: torch.Tensor) -> torch.Tensor:
        """Number of valid tokens in the rows flagged by ``clipped`` (N,) bool."""
        return torch.where(clipped, self.lengths, 0.0).sum()


@dataclass(frozen=True)
class _Terms:
    """What a kernel returns.

    Surrogate form: ``tok`` (N, T) is F and ``dtok`` its derivative c = ∂F/∂log r (both
    computed without autograd, finite everywhere, padding included; ``dtok`` may be a broadcast
    one, c = 1). ``penalty``/``dpenalty`` (K,): kl_cov's penalty term and its derivative on the
    K tokens of flat (row-major) positions ``penalty_index`` (K,) (valid tokens; 0 elsewhere);
    without ``penalty_index`` they are dense (N, T) (DRO's β/2·(log r)², 0 on padding).
    ``scratch``: ``dtok`` is a
    fresh tensor that the loss may overwrite once it has read ``tok`` (no later reader).
    Detached form: ``tok`` (N, T) the token coefficient c, or ``seq`` (N,) one coefficient per
    row. ``n_clipped``: a function returning the number of clipped valid tokens as a 0-d tensor
    (only called when metrics are requested; ``None``: the mapping never clips). ``extra``:
    mapping-specific metrics (0-d tensors).
    """

    tok: torch.Tensor | None = None
    seq: torch.Tensor | None = None
    n_clipped: Callable[[], torch.Tensor] | None = None
    extra: dict | None = None
    penalty: torch.Tensor | None = None
    dtok: torch.Tensor | None = None
    dpenalty: torch.Tensor | None = None
    penalty_index: torch.Tensor | None = None
    scratch: bool = False
