"""π_k as a module, and the Monte Carlo gradient study on it.

:class:`TopK` wraps a causal LM so that every logit outside its top k is −inf: the truncated
policy π_k of :mod:`simkit.lm.exact` as a network, on which any :mod:`simkit.lm.study` study
runs (sampling with the KV cache included). :meth:`TopK.head_scores` gives the closed-form
final-norm / LM-head scores of π_k, and :func:`mc_study` runs
:func:`simkit.lm.study.gradient_study` on the truncated LM with them
(:func:`topk_head_scores`), so that the Monte Carlo study can be checked against the exact
tree values of :func:`simkit.lm.exact.exact_study` on the same LM.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from simkit._validation import int_at_least
from simkit.lm import study as _study
from simkit.lm.exact import _head_edge_scores, _support_log_probs
from simkit.lm.scores import normed_head_inputs

#: logits outside the top k are set this far below the largest logit (exp(−1e4) = 0 exactly)
_GAP = 1e4


class TopK(torch.nn.Module):
    """π_k as a module: the wrapped causal LM with every logit outside its top k set to
    (max logit − 1e4), so that their probability is exactly 0 in float32 and float64.

    Shares the wrapped model's ``model`` (decoder) and ``lm_head`` submodules, so parameter
    names are unchanged (``model.norm.weight``, ``lm_head.weight``) and any
    :mod:`simkit.lm.experiment` study runs on the truncated LM — with ``grad_method="vmap"``:
    the closed-form head scores assume the full softmax. The top-k set is chosen without
    gradient (it is locally constant in θ). Accepts the KV-cache keyword ``cache``.
    """

    def __init__(self, lm: torch.nn.Module, k: int):
        super().__init__()
        from simkit.lm import models

        self.model = lm.model
        self.lm_head = lm.lm_head
        self.config = lm.config
        self.k = int_at_least(k, "k", 1)
        self._kw = models._cache_keyword(lm.model)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        **kwargs,
    ):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from simkit.lm import models

        if cache is not None:
            kwargs[self._kw] = cache
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                **kwargs,
            )
        logits = self.lm_head(out.last_hidden_state)
        top = torch.topk(logits.detach().float(), self.k, dim=-1).indices
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        keep = keep.scatter(-1, top, True)
        # far below every kept logit rather than −inf: exp underflows to exactly 0 (π_k is
        # unchanged) while log-probabilities stay finite (no −inf − (−inf) on padding)
        floor = logits.detach().amax(-1, keepdim=True) - _GAP
        logits = torch.where(keep, logits, floor.expand_as(logits))
        past = models._output_cache(out)
        try:
            return CausalLMOutputWithPast(logits=logits, cache=past)
        except TypeError:  # older transformers
            return CausalLMOutputWithPast(logits=logits, past_key_values=past)

    def head_scores(self, param_names, hidden, input_ids, prompt_length) -> torch.Tensor:
        """Closed-form per-token scores ∇θ log π_k(y_t | h_t) (N, T, D) float64 of full rows,
        θ ⊆ {final norm weight, untied lm_head}: :func:`simkit.lm.experiment.head_scores` with
        the softmax restricted to each position's top-k support (module docstring)."""
        p = int(prompt_length)
        x = hidden[:, p - 1 : -1]
        n, gamma, W = normed_head_inputs(self, x)
        z = (n * gamma) @ W.T
        N, T, V = z.shape
        support = torch.topk(z.float(), self.k, dim=-1).indices
        lp = _support_log_probs(z.reshape(-1, V), support.reshape(-1, self.k))
        sc = _head_edge_scores(
            self, tuple(param_names), x.reshape(N * T, -1), support.reshape(-1, self.k), lp
        )  # (N·T, k, D): the score of each support token; pick the sampled one
        hit = support.reshape(-1, self.k) == input_ids[:, p:].reshape(-1, 1)
        out = (sc * hit[..., None].to(sc.dtype)).sum(1)
        return out.reshape(N, T, -1)


@contextmanager
def topk_head_scores():
    """Within the block, :func:`simkit.lm.experiment.gradient_study` computes the closed-form
    scores of a :class:`TopK` model with :meth:`TopK.head_scores` (π_k's softmax over the
    support) instead of the full-vocabulary closed form; other models are unchanged.

    Swaps the ``head_scores`` name in the namespace of the study's draw function for the
    duration of the block (the study has no scorer hook). Guarded by a test that compares the
    patched ``"head"`` study with the ``"vmap"`` study on the same draws."""
    study = _study.gradient_study.__globals__
    draw = study.get("_draw")
    namespace = draw.__globals__ if draw is not None else study
    original = namespace.get("head_scores")
    if original is None:
        raise RuntimeError("simkit.lm.experiment has no head_scores to extend for TopK models")

    def scores(model, param_names, hidden, input_ids, prompt_length):
        if isinstance(model, TopK):
            return model.head_scores(param_names, hidden, input_ids, prompt_length)
        return original(model, param_names, hidden, input_ids, prompt_length)

    namespace["head_scores"] = scores
    try:
        yield
    finally:
        namespace["head_scores"] = original


def mc_study(model, task, estimators, k: int, *, behaviour=None, **kwargs):
    """The Monte Carlo :func:`simkit.lm.experiment.gradient_study` on the truncated LM π_k
    (:class:`TopK`), μ restricted to the same support (a logit-transform behaviour: the
    transform sees π_k's −inf outside the top k), closed-form scores for norm / lm_head
    (:func:`topk_head_scores`). ``kwargs`` go to the study (n, reps, n_ref, …)."""
    wrapped = TopK(model, k)
    with topk_head_scores():
        return _study.gradient_study(wrapped, task, estimators, behaviour=behaviour, **kwargs)
