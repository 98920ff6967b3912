"""The behaviour policy μ of a gradient study on a language model (:class:`Behaviour`).

A plain value: μ's network (None: π's own) and a logit transform. The generators of
:mod:`simkit.lm.mismatch` build them; :func:`simkit.lm.mismatch.resolve_behaviour` turns a spec
string, a number or a generator into one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
