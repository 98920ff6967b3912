"""Per-token scores ∇θ log π(y_t | x, y_<t) and per-sample gradients of a causal LM.

θ is a parameter subset (:func:`select_parameters`). :func:`per_token_scores` returns S (N, T, D)
in closed form for the final norm weight and an untied lm_head (:func:`head_scores`, one forward
pass), else by ``torch.func`` ``vmap(jacrev(functional_call))`` or a loop of backward passes;
:func:`per_sample_gradients` gives h_i = ∇θ Σ_t λ_{i,t} log π(y_{i,t}) (N, D) directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch.func import functional_call, grad, jacrev, vmap

#: parameter-subset presets of :func:`select_parameters`
PARAMETER_PRESETS = ("lm_head", "norm", "last_layer", "last_mlp", "all")
GRAD_METHODS = ("auto", "head", "vmap", "loop")
LOSS_PATHS = ("torch", "numpy")
# --- parameter subsets -----------------------------------------------------------------------


def select_parameters(model: torch.nn.Module, spec: str | Sequence[str]) -> tuple[str, ...]:
    """Names of the parameters θ the gradients are taken with respect to.

    ``spec``: a preset — ``"lm_head"`` (the output projection; the embedding matrix when tied),
    ``"norm"`` (the final RMSNorm weight), ``"last_layer"`` (every parameter of the last
    decoder layer), ``"last_mlp"`` (its MLP), ``"all"`` — or a comma-separated string / list of
    parameter names or name prefixes (``"model.layers.1.mlp."``). Names are those of
    ``model.named_parameters()`` (tied weights appear once). Raises ``ValueError`` naming the
    spec and listing the available top-level names when nothing matches.
    """
    names = [n for n, _ in model.named_parameters()]
    if isinstance(spec, str):
        items = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        items = [str(s) for s in spec]
    if not items:
        raise ValueError("params must name at least one parameter or preset")
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    chosen: list[str] = []
    for item in items:
        if item == "all":
            match = names
        elif item == "lm_head":
            match = [n for n in names if n.startswith("lm_head.")] or [
                n for n in names if n == "model.embed_tokens.weight"
            ]
        elif item == "norm":
            match = [n for n in names if n == "model.norm.weight"]
        elif item in ("last_layer", "last_mlp"):
            if not layers:
                raise ValueError(f"params {item!r}: the model has no model.layers.<i> parameters")
            prefix = f"model.layers.{layers[-1]}." + ("mlp." if item == "last_mlp" else "")
            match = [n for n in names if n.startswith(prefix)]
        else:
            match = [n for n in names if n == item or n.startswith(item)]
        if not match:
            tops = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ValueError(
                f"params {item!r} matches no parameter; presets: {', '.join(PARAMETER_PRESETS)}; "
                f"parameter names start with: {', '.join(tops)}"
            )
        chosen += [n for n in match if n not in chosen]
    return tuple(chosen)


def parameter_dim(model: torch.nn.Module, param_names: Sequence[str]) -> int:
    """D = total number of values of the parameters ``param_names``."""
    params = dict(model.named_parameters())
    return int(sum(params[n].numel() for n in param_names))


# --- per-token scores and per-sample gradients -----------------------------------------------


def _check_rows(input_ids: torch.Tensor, prompt_length: int) -> int:
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape (N, L), got {tuple(input_ids.shape)}")
    p = int(prompt_length)
    if not 1 <= p < input_ids.shape[1]:
        raise ValueError(f"prompt_length must be in [1, L) = [1, {input_ids.shape[1]}), got {p}")
    return input_ids.shape[1] - p


def _subset(model, param_names) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    missing = [n for n in param_names if n not in params]
    if missing:
        raise ValueError(f"unknown parameter names {missing}; see select_parameters")
    return {n: params[n].detach() for n in param_names}


def _row_log_probs(model, params, ids_row: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """log π(y_t | prefix) (T,) of one row (L,), θ = ``params`` swapped in (functional_call).

    No attention mask: one unpadded causal row (padding after an EOS comes *after* every valid
    token, so causal attention keeps it out of their log-probs).
    """
    logits = functional_call(model, params, (ids_row[None],))
    if hasattr(logits, "logits"):
        logits = logits.logits
    lp = torch.log_softmax(logits[0, prompt_length - 1 : -1], dim=-1)
    return lp.gather(-1, ids_row[prompt_length:, None])[:, 0]


def _flatten(grads: dict[str, torch.Tensor], names, lead: int) -> torch.Tensor:
    return torch.cat([grads[n].reshape(*grads[n].shape[:lead], -1) for n in names], dim=-1)


def head_parameter_names(model: torch.nn.Module) -> tuple[str, ...]:
    """Parameters whose per-token scores :func:`head_scores` computes in closed form.

    The final RMSNorm weight ``model.norm.weight`` and an *untied* ``lm_head.weight`` of a
    Llama-style causal LM (``model.model.norm`` with ``variance_epsilon``, ``model.lm_head``
    without bias). A tied output matrix is excluded: its gradient also flows through the input
    embedding, which the closed form does not see.
    """
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    head = getattr(model, "lm_head", None)
    if norm is None or not hasattr(norm, "variance_epsilon") or head is None:
        return ()
    if getattr(head, "bias", None) is not None:
        return ()
    names = {n for n, _ in model.named_parameters()}
    out = []
    if "model.norm.weight" in names:
        out.append("model.norm.weight")
    if "lm_head.weight" in names:  # absent from named_parameters when tied to the embedding
        out.append("lm_head.weight")
    return tuple(out)


def resolve_grad_method(model: torch.nn.Module, param_names: Sequence[str], method: str) -> str:
    """``"auto"`` → ``"head"`` when every parameter of θ has a closed-form score
    (:func:`head_parameter_names`), else ``"vmap"``; other methods are returned unchanged."""
    if method not in GRAD_METHODS:
        raise ValueError(f"method must be one of {GRAD_METHODS}, got {method!r}")
    supported = set(head_parameter_names(model))
    if method == "head" and not set(param_names) <= supported:
        raise ValueError(
            f"grad method 'head' computes scores of {sorted(supported) or 'no parameter'} of "
            f"this model only, not {sorted(set(param_names) - supported)}; use 'vmap' or 'loop'"
        )
    if method == "auto":
        return "head" if set(param_names) <= supported else "vmap"
    return method


def final_hidden_and_logits(model: torch.nn.Module, input_ids: torch.Tensor):
    """One forward pass returning (h, logits): h (N, L, d) the input of the final norm
    ``model.model.norm`` (captured by a forward pre-hook) and the model's logits (N, L, V)."""
    captured = {}

    def hook(module, args):
        captured["h"] = args[0]

    handle = model.model.norm.register_forward_pre_hook(hook)
    try:
        logits = model(input_ids).logits
    finally:
        handle.remove()
    return captured["h"], logits


def head_scores(
    model: torch.nn.Module,
    param_names: Sequence[str],
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    prompt_length: int,
) -> torch.Tensor:
    """Closed-form per-token scores ∇θ log π(y_t | h_t) for θ ⊆ {final norm weight γ, lm_head W}.

    With x the final hidden state (the norm's input, ``hidden`` (N, L, d)), n = x/√(mean x² + ε)
    (RMSNorm, Zhang & Sennrich 2019), z = W(γ ⊙ n) and π = softmax(z):
    ∂ log π_y/∂γ = n ⊙ Wᵀ(e_y − π) and ∂ log π_y/∂W = (e_y − π)(γ ⊙ n)ᵀ (C order, (V, d)).
    Everything after the norm's input is recomputed in float64, so one forward pass gives the
    scores of every position — no backward pass. Returns (N, T, D) float64 in the order of
    ``param_names`` (T = L − ``prompt_length``), like :func:`per_token_scores`.
    """
    T = _check_rows(input_ids, prompt_length)
    names = tuple(param_names)
    supported = head_parameter_names(model)
    if not names or not set(names) <= set(supported):
        raise ValueError(f"head_scores supports {supported}, got {names}")
    p = int(prompt_length)
    n, gamma, W = normed_head_inputs(model, hidden[:, p - 1 : -1])
    a = n * gamma
    probs = torch.softmax(a @ W.T, dim=-1)  # (N, T, V)
    resid = -probs
    resid.scatter_add_(-1, input_ids[:, p:, None], torch.ones_like(resid[..., :1]))
    parts = []
    for name in names:
        if name == "model.norm.weight":
            parts.append(n * (resid @ W))
        else:
            parts.append((resid[..., :, None] * a[..., None, :]).reshape(*resid.shape[:2], -1))
    out = torch.cat(parts, dim=-1)
    assert out.shape[1] == T
    return out


def normed_head_inputs(model, x: torch.Tensor):
    """(n, γ, W) in float64 from the final norm's input ``x`` (..., d): n = x/√(mean x² + ε)
    (RMSNorm without its weight), γ = ``model.model.norm.weight`` (d,) and W =
    ``model.lm_head.weight`` (V, d), detached — what the closed-form scores of
    :func:`head_scores` and of the top-k tree (:mod:`simkit.lm.exact`, :mod:`simkit.lm.topk`)
    are computed from, logits z = W(γ ⊙ n)."""
    norm = model.model.norm
    x = x.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(norm.variance_epsilon))
    return n, norm.weight.detach().double(), model.lm_head.weight.detach().double()


def per_token_scores(
    model: torch.nn.Module,
    param_names: Sequence[str],
    input_ids: torch.Tensor,
    prompt_length: int,
    method: str = "auto",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """S[i, t] = ∇θ log π(y_{i,t} | x, y_{i,<t}) for θ = ``param_names``: (N, T, D).

    ``input_ids`` (N, L): N rows sharing the same ``prompt_length`` (responses y_i = the last
    T = L − prompt_length tokens). ``method="head"``: the closed form of :func:`head_scores`
    (one forward pass; θ ⊆ final norm weight, untied lm_head); ``"vmap"``: ``torch.func.vmap``
    over rows of ``jacrev`` of the row's log-probs (``functional_call``; ``chunk_size`` rows at
    a time); ``"loop"``: one forward per row and T backward passes; ``"auto"``: ``"head"`` when
    θ allows it, else ``"vmap"``. D flattens the parameters in the order of ``param_names``,
    each in C order. The model should be in eval mode.
    """
    _check_rows(input_ids, prompt_length)
    names = tuple(param_names)
    method = resolve_grad_method(model, names, method)
    params = _subset(model, names)
    p = int(prompt_length)
    if method == "head":
        with torch.no_grad():
            hidden, _ = final_hidden_and_logits(model, input_ids)
            return head_scores(model, names, hidden, input_ids, p)
    if method == "vmap":
        jac = vmap(
            jacrev(lambda prm, row: _row_log_probs(model, prm, row, p)),
            in_dims=(None, 0),
            chunk_size=chunk_size,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            return _flatten(jac(params, input_ids), names, 2).detach()
    rows = []
    for row in input_ids:
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        with torch.enable_grad():
            lp = _row_log_probs(model, leaves, row, p)
            per_t = []
            for t in range(lp.shape[0]):
                g = torch.autograd.grad(lp[t], [leaves[n] for n in names], retain_graph=True)
                per_t.append(torch.cat([x.reshape(-1) for x in g]))
        rows.append(torch.stack(per_t))
    return torch.stack(rows)


def per_sample_gradients(
    model: torch.nn.Module,
    param_names: Sequence[str],
    input_ids: torch.Tensor,
    prompt_length: int,
    token_weights: torch.Tensor,
    method: str = "vmap",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """h_i = ∇θ Σ_t λ_{i,t} log π(y_{i,t} | x, y_{i,<t}): per-sample gradients (N, D).

    The gradient of sample i's term of a weighted policy-gradient loss (λ = −∂loss/∂log π).
    ``token_weights`` λ (N, T). ``method="vmap"``: ``torch.func.vmap(grad(...))`` over rows with
    ``functional_call`` (Horace He et al., torch.func per-sample-gradient recipe); ``"loop"``:
    one forward and one backward per row; ``"head"``: λ-contraction of the closed-form scores
    of :func:`head_scores`; ``"auto"``: ``"head"`` when θ allows it, else ``"vmap"``.
    """
    T = _check_rows(input_ids, prompt_length)
    if token_weights.shape != (input_ids.shape[0], T):
        raise ValueError(
            f"token_weights must have shape (N, T) = ({input_ids.shape[0]}, {T}), got "
            f"{tuple(token_weights.shape)}"
        )
    names = tuple(param_names)
    method = resolve_grad_method(model, names, method)
    params = _subset(model, names)
    p = int(prompt_length)
    if method == "head":
        S = per_token_scores(model, names, input_ids, p, method="head")
        return torch.einsum("nt,ntd->nd", token_weights.to(S), S)
    lam = token_weights.to(next(iter(params.values())).dtype)

    def weighted(prm, row, w):
        return (_row_log_probs(model, prm, row, p) * w).sum()

    if method == "vmap":
        fn = vmap(grad(weighted), in_dims=(None, 0, 0), chunk_size=chunk_size)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            return _flatten(fn(params, input_ids, lam), names, 1).detach()
    out = []
    for row, w in zip(input_ids, lam):
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        with torch.enable_grad():
            g = torch.autograd.grad(weighted(leaves, row, w), [leaves[n] for n in names])
        out.append(torch.cat([x.reshape(-1) for x in g]))
    return torch.stack(out)
