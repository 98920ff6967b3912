"""Custom autograd steps of the torch policy losses: the linearised loss every surrogate loss
is returned through (value and gradient computed together, one multiplication in the
backward), a capped exponential whose derivative is its value, a band clamp whose backward
reuses the forward's outside-mask, and a surrogate whose value and derivative a kernel computes
together (see :mod:`simkit.lm.losses`)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class _CappedExp(torch.autograd.Function):
    """exp(min(x, cap)) whose derivative is its value (the cap bounds the value only).

    ``simkit.mappings`` computes a capped coefficient e^min(log r, cap): the surrogate F = r
    must then have ∂F/∂log r = e^min(log r, cap) everywhere, also above the cap.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, cap):
        return torch.exp(torch.clamp(x, max=cap))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out, None


def capped_exp(x: torch.Tensor, cap: float) -> torch.Tensor:
    """exp(min(x, cap)) with gradient exp(min(x, cap)) (also where x > cap); any shape."""
    if not x.requires_grad:
        return torch.exp(torch.clamp(x, max=cap))
    return _CappedExp.apply(x, cap)


class _BandClamp(torch.autograd.Function):
    """(clamp(x, lo, hi), x outside [lo, hi]) with backward grad·1[lo <= x <= hi] read from the
    kept outside-mask (the backward of ``torch.clamp`` recomputes two comparisons and a select:
    several times slower on CPU). ``lo``, ``hi`` broadcastable tensors, never differentiated."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, lo, hi):
        # = clamp(x, lo, hi) for lo <= hi; two broadcast min/max are faster than one clamp
        y = torch.maximum(torch.minimum(x, hi), lo)
        return y, y != x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        (outside,) = ctx.saved_tensors
        inside = torch.logical_not(outside).view(torch.uint8).to(grad.dtype)
        return grad * inside, None, None


def band_clamp(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """``(clamp(x, lo, hi), outside)``: the clamped values, differentiable with derivative
    1[lo <= x <= hi] (as ``torch.clamp``), and the bool tensor x ∉ [lo, hi]. Any shapes that
    broadcast (e.g. x (N, T), lo/hi (N, 1))."""
    if not x.requires_grad:
        y = torch.maximum(torch.minimum(x, hi), lo)
        return y, y != x
    return _BandClamp.apply(x, lo, hi)


class _AnalyticSurrogate(torch.autograd.Function):
    """A surrogate F(log r) and its derivative c = ∂F/∂log r computed together by the kernel;
    the backward is one multiplication grad·c (instead of the backward of every elementary
    operation of F). ``value_and_derivative(log_ratio) -> (F, c)`` runs without autograd."""

    generate_vmap_rule = True

    @staticmethod
    def forward(log_ratio, value_and_derivative):
        value, derivative = value_and_derivative(log_ratio)
        return value, derivative

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx, grad, _):
        (derivative,) = ctx.saved_tensors
        return grad * derivative, None


def analytic_surrogate(
    log_ratio: torch.Tensor,
    value_and_derivative: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The surrogate F = ``value_and_derivative(log_ratio)[0]`` (N, T), differentiable w.r.t.
    ``log_ratio`` with ∂F_t/∂log r_t = ``value_and_derivative(log_ratio)[1]`` (token t's own
    log-ratio only, as every per-token surrogate here). The pair must be F and its exact
    derivative (the kernels of :func:`~simkit.lm.losses.policy_loss` no longer go through this
    step; a test checks the step itself)."""
    if not log_ratio.requires_grad:
        with torch.no_grad():
            return value_and_derivative(log_ratio)[0]
    return _AnalyticSurrogate.apply(log_ratio, value_and_derivative)[0]


class _LinearisedLoss(torch.autograd.Function):
    """A 0-d loss ``value`` whose gradient w.r.t. ``x`` is ``gradient`` (both computed by the
    caller without autograd): the backward is one multiplication, grad·gradient. The classic
    ``forward(ctx, …)`` form: a ``setup_context`` form binds the arguments through
    ``inspect.signature`` on every call (15 µs of a 0.06 ms bare loss on a small batch), and
    its only use, a generated vmap rule, cannot apply here (the kernels synchronise with the
    host)."""

    @staticmethod
    def forward(ctx, x, value, gradient):
        ctx.save_for_backward(gradient)
        ctx.x_dtype = x.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        (gradient,) = ctx.saved_tensors
        return (grad.to(gradient.dtype) * gradient).to(ctx.x_dtype), None, None


def linearised_loss(x: torch.Tensor, value: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """``value`` (0-d) as a function of ``x`` with ∂value/∂x = ``gradient`` (the shape of x;
    cast to x's dtype in the backward). The caller guarantees that ``gradient`` is the exact
    derivative: :func:`simkit.lm.losses.policy_loss` forms it from each kernel's c = ∂F/∂log r
    (tests: gradient = −c·A/Z of :mod:`simkit.mappings` to 1e-10). Without autograd on ``x``
    it returns ``value``. No double backward."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return value
    return _LinearisedLoss.apply(x, value, gradient)
