"""Exact bias and variance on a real language model: enumerate the top-k prefix tree.

A causal LM π restricted at every prefix h to its k most probable tokens and renormalised
(top-k sampling, Fan et al. 2018, "Hierarchical neural story generation") is a finite policy

    π_k(v | h) = π(v | h) / Σ_{u ∈ top_k(h)} π(u | h)   for v ∈ top_k(h), else 0,

over at most k^T responses of T tokens. The behaviour μ of a :mod:`simkit.lm.mismatch`
generator (temperature, bf16/fp16 logits, weight noise, stale weights, …) is restricted to the
*same* support and renormalised, μ_k(v | h) = μ(v | h)/Σ_{u ∈ top_k(h)} μ(u | h), so χ²(π_k‖μ_k)
is finite. :func:`tree` visits every node once (one forward position per node, batched by depth
with a key/value cache: the prompt is encoded once, each depth's nodes run as one batch of
single-token steps, in chunks of ``batch_size``) and returns a :class:`Tree`: every leaf's
tokens, mask, per-token log π_k and log μ_k, reward, and per-token score vectors
S_t = ∇θ log π_k(y_t | x, y_<t) for a parameter subset θ:

- closed form for the final RMSNorm weight γ and an untied ``lm_head`` W (``grad_method=
  "head"``): with n the normalised final hidden state of the node, a = γ ⊙ n and p = π_k(·|h)
  on the support s_1..s_k, the child s_j has
  ∂/∂γ = n ⊙ (W_{s_j} − Σ_i p_i W_{s_i}) and ∂/∂W = (e_{s_j} − Σ_i p_i e_{s_i}) aᵀ
  (the top-k set is locally constant in θ, so only the support's logits move π_k);
- ``torch.func`` otherwise (``"vmap"``): ``vmap(jacrev(functional_call))`` over the leaves of the
  top-k-renormalised per-token log-probabilities of the full sequence.

The tree math runs in float64 (log-softmax over the support of the model's logits, cast).
:func:`exact_study` turns one tree per prompt into a :class:`simkit.lm.leaves.LeafEnv` and runs
:func:`simkit.experiment.run` on it: exact mean and variance for every per-sample estimator
(``exact = True``), Monte Carlo over exact leaf draws for batch-dependent ones (snis, psis,
m2po; ``exact = False``), always against the exact ∇J of π_k.

Cost: Σ_{t<T} k^t forward positions (k = 4, T = 6: 1 365 positions, 4 096 leaves) and E = Σ_t
k^{t+1} edges of D float64 scores. :func:`memory_estimate` is checked before any work.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from simkit._validation import int_at_least
from simkit.estimators import GROUP_ADVANTAGES
from simkit.lm import scores as _scores
from simkit.lm import study as _study
from simkit.lm.behaviour import Behaviour
from simkit.lm.leaves import LeafEnv
from simkit.lm.mismatch import prepare_pair
from simkit.lm.scale_free import with_scale_free

GRAD_METHODS = ("auto", "head", "vmap")
#: share of the free memory a tree may use when ``memory_limit`` is None
MEMORY_SHARE = 0.5


# --- memory ----------------------------------------------------------------------------------


def tree_sizes(k: int, T: int) -> dict[str, int]:
    """Worst-case (no EOS) sizes: ``positions`` Σ_{t<T} k^t forwards, ``edges`` Σ_{t≤T} k^t − 1,
    ``leaves`` k^T, ``frontier`` k^t per depth (list)."""
    frontier = [k**t for t in range(T)]
    return {
        "positions": sum(frontier),
        "edges": sum(f * k for f in frontier),
        "leaves": k**T,
        "frontier": frontier,
    }


def _kv_bytes_per_token(net: torch.nn.Module) -> int:
    cfg = net.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(net.parameters()).element_size()
    return int(cfg.num_hidden_layers * 2 * heads * head_dim * elem)


def memory_estimate(
    nets: Sequence[torch.nn.Module],
    k: int,
    T: int,
    D: int,
    prompt_length: int,
    batch_size: int,
    grad_method: str = "head",
) -> dict[str, int]:
    """Bytes a :func:`tree` needs at most (no EOS): ``scores`` (E + 1)·D·8, ``leaves`` the
    per-leaf arrays, ``kv`` the response key/values of two consecutive depths of every network
    plus one chunk's full cache, ``logits`` one chunk's vocabulary logits, ``jacobian`` the
    torch.func per-leaf Jacobians of one chunk (``vmap`` only); ``total``."""
    sz = tree_sizes(k, T)
    f = sz["frontier"] + [0]
    vocab = int(nets[0].config.vocab_size)
    kv = 0
    for net in nets:
        per = _kv_bytes_per_token(net)
        stored = max(f[t] * t + f[t + 1] * (t + 1) for t in range(T))
        kv += per * (stored + 2 * batch_size * (prompt_length + T))
    out = {
        "scores": (sz["edges"] + 1) * D * 8 + batch_size * k * D * 8 * 3,
        "leaves": sz["leaves"] * T * (8 * 5 + 2),
        "kv": kv,
        "logits": batch_size * vocab * 4 * 4 * len(nets),
        "jacobian": (batch_size * T * D * 8 * 4 if grad_method == "vmap" else 0),
    }
    out["total"] = sum(out.values())
    return out


def available_memory(device) -> int:
    """Free memory in bytes: ``torch.cuda.mem_get_info`` on CUDA, the OS's available physical
    memory on CPU (``SC_AVPHYS_PAGES``; 8 GiB when unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _human(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} TiB"


def check_memory(estimate: dict[str, int], limit: int, k: int, T: int) -> None:
    """``MemoryError`` naming k, T and the bytes when ``estimate["total"]`` exceeds ``limit``."""
    if estimate["total"] <= limit:
        return
    parts = ", ".join(f"{key} {_human(v)}" for key, v in estimate.items() if key != "total" and v)
    raise MemoryError(
        f"the exact tree with k = {k}, T = {T} needs about {estimate['total']} bytes "
        f"({_human(estimate['total'])}: {parts}), more than the {limit} bytes "
        f"({_human(limit)}) allowed; lower k or T, choose a smaller params subset (params='norm'), "
        "lower batch_size, or raise memory_limit"
    )


# --- the tree --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Tree:
    """Every response of π_k to one prompt (module docstring). Shapes: L leaves, T positions,
    E edges, N internal nodes (forward positions), D parameters.

    ``sequences`` (L, T) int64 response tokens (after an EOS: the EOS id, else 0); ``mask``
    (L, T) bool (True up to and including EOS); ``token_log_pi``/``token_log_mu`` (L, T)
    float64 log π_k and log μ_k of each token (0 on padding); ``log_pi``/``log_mu`` (L,) their
    sums; ``edges`` (L, T) int64 edge id of each token (E on padding); ``scores`` (E + 1, D)
    float64 S = ∇θ log π_k per edge (zero last row; None without ``params``); ``rewards`` (L,)
    or None; ``node_depth`` (N,), ``node_log_reach_mu`` (N,) log μ_k of reaching each node,
    ``node_divergences`` name → (N,) exact χ², KL, TV between π_k(·|h) and μ_k(·|h) over the
    support; ``param_names``; ``behaviour``, ``strength`` (μ's label); ``prompt_ids``.
    """

    prompt_ids: tuple[int, ...]
    k: int
    T: int
    eos_token_id: int | None
    sequences: np.ndarray
    mask: np.ndarray
    token_log_pi: np.ndarray
    token_log_mu: np.ndarray
    edges: np.ndarray
    scores: np.ndarray | None = field(repr=False)
    rewards: np.ndarray | None
    node_depth: np.ndarray = field(repr=False)
    node_log_reach_mu: np.ndarray = field(repr=False)
    node_divergences: dict = field(repr=False)
    param_names: tuple[str, ...] = ()
    behaviour: str = "on_policy"
    strength: float = 0.0

    @property
    def log_pi(self) -> np.ndarray:
        return self.token_log_pi.sum(axis=1)

    @property
    def log_mu(self) -> np.ndarray:
        return self.token_log_mu.sum(axis=1)

    @property
    def n_leaves(self) -> int:
        return int(self.mask.shape[0])

    @property
    def n_nodes(self) -> int:
        """Internal nodes = forward positions evaluated."""
        return int(self.node_depth.shape[0])

    @property
    def n_edges(self) -> int:
        return int(self.edges.max()) if self.scores is None else int(self.scores.shape[0] - 1)

    def env(self, rewards=None, weight: float = 1.0) -> LeafEnv:
        """The :class:`~simkit.lm.leaves.LeafEnv` of this tree (``rewards`` default: the
        tree's)."""
        return leaf_env([self], rewards=None if rewards is None else [rewards], weights=[weight])


def leaf_env(trees: Sequence[Tree], rewards=None, weights=None) -> LeafEnv:
    """One :class:`~simkit.lm.leaves.LeafEnv` from several trees (one per prompt), leaves
    concatenated with prompt weights ``weights`` (default uniform 1/P) and edge ids offset."""
    trees = list(trees)
    if not trees:
        raise ValueError("trees is empty")
    P = len(trees)
    weights = [1.0 / P] * P if weights is None else [float(w) for w in weights]
    rewards = [t.rewards for t in trees] if rewards is None else list(rewards)
    if any(r is None for r in rewards):
        raise ValueError("every tree needs rewards (pass rewards= to tree())")
    if any(t.scores is None for t in trees):
        raise ValueError("every tree needs scores (pass params= to tree())")
    T = trees[0].T
    if any(t.T != T for t in trees):
        raise ValueError("trees of one environment must share T")
    E = sum(t.scores.shape[0] - 1 for t in trees)
    edges, scores, offset = [], [], 0
    for t in trees:
        e = t.scores.shape[0] - 1
        edges.append(np.where(t.edges == e, E, t.edges + offset))
        scores.append(t.scores[:-1])
        offset += e
    D = trees[0].scores.shape[1]
    scores.append(np.zeros((1, D)))
    node_w = np.concatenate([w * np.exp(t.node_log_reach_mu) for t, w in zip(trees, weights)])
    return LeafEnv(
        edges=np.concatenate(edges),
        mask=np.concatenate([t.mask for t in trees]),
        log_pi_tok=np.concatenate([t.token_log_pi for t in trees]),
        log_mu_tok=np.concatenate([t.token_log_mu for t in trees]),
        weight=np.concatenate([np.full(t.n_leaves, w) for t, w in zip(trees, weights)]),
        rewards=np.concatenate([np.asarray(r, dtype=np.float64) for r in rewards]),
        scores=np.concatenate(scores),
        node_weight_mu=node_w,
        node_divergences={
            key: np.concatenate([t.node_divergences[key] for t in trees])
            for key in ("chi2", "kl", "tv")
        },
    )


class _Net:
    """One network of the tree (π's, or μ's own) with its prompt cache and the response
    key/values of the current frontier."""

    def __init__(self, net, prompt: torch.Tensor, capture_hidden: bool):
        from simkit.lm import models

        self.net = net
        self.kw = models._cache_keyword(net)
        self.capture = capture_hidden
        self.p = prompt.shape[1]
        out, hidden = self._forward(input_ids=prompt, position_ids=None, cache=None)
        cache = models._output_cache(out)
        self.prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
        self.logits = out.logits[:, -1]
        self.hidden = None if hidden is None else hidden[:, -1]
        self.resp_kv = None  # list of (K, V) (N, h, t, d) for the frontier

    def _forward(self, input_ids, position_ids, cache, attention_mask=None):
        captured = {}
        handle = None
        if self.capture:

            def hook(module, args):
                captured["h"] = args[0]

            handle = self.net.model.norm.register_forward_pre_hook(hook)
        kwargs = {"input_ids": input_ids, "use_cache": True}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if cache is not None:
            kwargs[self.kw] = cache
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=FutureWarning)
                out = self.net(**kwargs)
        finally:
            if handle is not None:
                handle.remove()
        return out, captured.get("h")

    def children(self, parents: torch.Tensor, tokens: torch.Tensor, t: int):
        """Forward the children (``tokens`` (m,)) of frontier rows ``parents`` (m,) at depth t:
        (logits (m, V), hidden (m, d) or None, response key/values (m, h, t + 1, d))."""
        from transformers import DynamicCache

        from simkit.lm import models

        m = tokens.shape[0]
        layers = []
        for i, (pk, pv) in enumerate(self.prompt_kv):
            k = pk.expand(m, -1, -1, -1)
            v = pv.expand(m, -1, -1, -1)
            if self.resp_kv is not None:
                rk, rv = self.resp_kv[i]
                k = torch.cat([k, rk[parents]], dim=2)
                v = torch.cat([v, rv[parents]], dim=2)
            layers.append((k, v))
        cache = DynamicCache(ddp_cache_data=layers, config=self.net.config)
        length = self.p + t + 1
        device = tokens.device
        out, hidden = self._forward(
            input_ids=tokens[:, None],
            position_ids=torch.full((m, 1), self.p + t, dtype=torch.long, device=device),
            cache=cache,
            attention_mask=torch.ones((m, length), dtype=torch.long, device=device),
        )
        new = models._output_cache(out)
        kv = [(layer.keys[:, :, self.p :], layer.values[:, :, self.p :]) for layer in new.layers]
        return out.logits[:, -1], None if hidden is None else hidden[:, -1], kv


def _support_log_probs(z: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """log softmax over the support: (m, k) float64 from logits (m, V) and ids (m, k)."""
    return torch.log_softmax(z.double().gather(-1, support), dim=-1)


def _node_divergences(lp: torch.Tensor, lq: torch.Tensor) -> dict[str, torch.Tensor]:
    p = lp.exp()
    chi2 = torch.expm1(torch.logsumexp(2.0 * lp - lq, dim=-1)).clamp_min(0.0)
    kl = (p * torch.where(p > 0, lp - lq, torch.zeros_like(lp))).sum(-1).clamp_min(0.0)
    tv = 0.5 * (p - lq.exp()).abs().sum(-1)
    return {"chi2": chi2, "kl": kl, "tv": tv}


def _head_edge_scores(model, names, hidden, support, lp) -> torch.Tensor:
    """Closed-form scores (m, k, D) of the k children of m nodes (module docstring)."""
    n, gamma, W = _scores.normed_head_inputs(model, hidden)
    p = lp.exp()  # (m, k)
    m, k = support.shape
    parts = []
    for name in names:
        if name == "model.norm.weight":
            Ws = W[support]  # (m, k, d)
            wbar = torch.einsum("mk,mkd->md", p, Ws)
            parts.append(n[:, None, :] * (Ws - wbar[:, None, :]))
        else:  # lm_head.weight (V, d), C order
            a = n * gamma  # (m, d)
            V = W.shape[0]
            resid = torch.zeros((m, k, V), dtype=torch.float64, device=n.device)
            resid.scatter_add_(
                -1, support[:, None, :].expand(m, k, k), -p[:, None, :].expand(m, k, k)
            )
            eye = torch.ones((m, k, 1), dtype=torch.float64, device=n.device)
            resid.scatter_add_(-1, support[:, :, None], eye)
            parts.append((resid[..., None] * a[:, None, None, :]).reshape(m, k, -1))
    return torch.cat(parts, dim=-1)


def tree(
    model: torch.nn.Module,
    prompt_ids,
    k: int,
    T: int,
    behaviour=None,
    eos_token_id: int | None = None,
    *,
    params: str | Sequence[str] | None = "norm",
    rewards: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    grad_method: str = "auto",
    batch_size: int = 256,
    progress: bool | None = None,
    memory_limit: int | None = None,
    task=None,
    tokenizer=None,
) -> Tree:
    """Enumerate every response of π_k to one prompt (module docstring).

    Parameters
    ----------
    model : causal LM (transformers Llama-style), in eval mode, on its device.
    prompt_ids : the prompt's token ids (a sequence of ints or a (p,) / (1, p) tensor).
    k, T : support size per prefix (k ≥ 1) and maximum response length (T ≥ 1).
    behaviour : μ, anything :func:`simkit.lm.experiment.resolve_behaviour` accepts (None: μ = π;
        a spec string ``"temperature:1.3"``, a generator, a prepared pair). A generator that
        trains π (staleness) needs ``task``; its π becomes the tree's π.
    eos_token_id : a child equal to it ends its response (a leaf of length ≤ T).
    params : θ for the score vectors (:func:`simkit.lm.experiment.select_parameters`); None:
        no scores.
    rewards : ``rewards(sequences (L, T), mask (L, T)) -> (L,)``, the task's checker; None: no
        rewards (set them later in :meth:`Tree.env`).
    grad_method : ``"head"`` (closed form, final norm / untied lm_head), ``"vmap"``
        (torch.func), ``"auto"`` (head when θ allows it).
    batch_size : nodes per forward call (memory: one chunk's cache and logits).
    progress : tqdm bar over depth (None: when more than 2 000 positions).
    memory_limit : bytes the tree may use (None: half the free memory);
        :func:`memory_estimate` is checked before any forward pass (``MemoryError`` naming k, T
        and the bytes).
    """
    k = int_at_least(k, "k", 1)
    T = int_at_least(T, "T", 1)
    batch_size = int_at_least(batch_size, "batch_size", 1)
    if grad_method not in GRAD_METHODS:
        raise ValueError(f"grad_method must be one of {GRAD_METHODS}, got {grad_method!r}")
    if eos_token_id is not None:
        eos_token_id = int_at_least(eos_token_id, "eos_token_id", 0)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if prompt.numel() == 0:
        raise ValueError("prompt_ids is empty")
    pi_net, mu = prepare_pair(behaviour, model, task, tokenizer, eos_token_id, T)
    pi_net.eval()
    vocab = int(pi_net.config.vocab_size)
    if k > vocab:
        raise ValueError(f"k = {k} exceeds the vocabulary size {vocab}")
    names: tuple[str, ...] = ()
    method = "head"
    D = 0
    if params is not None:
        names = _scores.select_parameters(pi_net, params)
        method = _scores.resolve_grad_method(pi_net, names, grad_method)
        D = _scores.parameter_dim(pi_net, names)
    nets = [pi_net] + ([mu.model] if mu.model is not None else [])
    est = memory_estimate(nets, k, T, D, prompt.numel(), batch_size, method)
    device = next(pi_net.parameters()).device
    limit = (
        int(MEMORY_SHARE * available_memory(device)) if memory_limit is None else int(memory_limit)
    )
    check_memory(est, limit, k, T)
    sizes = tree_sizes(k, T)
    if progress is None:
        progress = sizes["positions"] > 2000
    from tqdm.auto import tqdm

    prompt = prompt.to(device)[None]
    with torch.no_grad():
        pi = _Net(pi_net, prompt, capture_hidden=params is not None and method == "head")
        mu_net = _Net(mu.model, prompt, capture_hidden=False) if mu.model is not None else None
        # frontier state
        pi_logits = pi.logits
        mu_logits = mu_net.logits if mu_net is not None else pi_logits
        hidden = pi.hidden
        paths = torch.zeros((1, 0), dtype=torch.long)  # edge ids, CPU
        toks = torch.zeros((1, 0), dtype=torch.long)
        reach_pi = torch.zeros(1, dtype=torch.float64)
        reach_mu = torch.zeros(1, dtype=torch.float64)
        path_lp = torch.zeros((1, 0), dtype=torch.float64)
        path_lq = torch.zeros((1, 0), dtype=torch.float64)
        leaves = {"edges": [], "toks": [], "lp": [], "lq": []}
        node_depth, node_reach, node_div = [], [], {"chi2": [], "kl": [], "tv": []}
        edge_scores = []
        n_edges = 0
        bar = tqdm(range(T), desc=f"exact tree k={k} T={T}", disable=not progress)
        for t in bar:
            N = pi_logits.shape[0]
            support = torch.topk(pi_logits.float(), k, dim=-1).indices  # (N, k)
            lp = _support_log_probs(pi_logits, support)
            z_mu = mu_logits if mu.transform is None else mu.transform(mu_logits)
            lq = _support_log_probs(z_mu, support)
            if not torch.isfinite(lq).any(-1).all():
                raise ValueError(
                    f"μ ({mu.name}) gives probability 0 to every top-{k} token of π at a node of "
                    f"depth {t}: μ_k is undefined there"
                )
            d = _node_divergences(lp, lq)
            node_depth.append(np.full(N, t))
            node_reach.append(reach_mu.numpy())
            for key in node_div:
                node_div[key].append(d[key].cpu().numpy())
            if params is not None and method == "head":
                for s in range(0, N, batch_size):
                    sc = _head_edge_scores(
                        pi_net,
                        names,
                        hidden[s : s + batch_size],
                        support[s : s + batch_size],
                        lp[s : s + batch_size],
                    )
                    edge_scores.append(sc.reshape(-1, D).cpu().numpy())
            # children, in (node, rank) order: edge id = n_edges + node·k + rank
            ids = n_edges + torch.arange(N * k).reshape(N, k)
            n_edges += N * k
            child_tok = support.cpu()
            c_paths = torch.cat([paths.repeat_interleave(k, 0), ids.reshape(-1, 1)], 1)
            c_toks = torch.cat([toks.repeat_interleave(k, 0), child_tok.reshape(-1, 1)], 1)
            c_lp = torch.cat([path_lp.repeat_interleave(k, 0), lp.cpu().reshape(-1, 1)], 1)
            c_lq = torch.cat([path_lq.repeat_interleave(k, 0), lq.cpu().reshape(-1, 1)], 1)
            c_rp = reach_pi.repeat_interleave(k) + lp.cpu().reshape(-1)
            c_rq = reach_mu.repeat_interleave(k) + lq.cpu().reshape(-1)
            flat_tok = child_tok.reshape(-1)
            ended = (
                flat_tok == eos_token_id
                if eos_token_id is not None
                else torch.zeros_like(flat_tok, dtype=torch.bool)
            )
            if t == T - 1:
                ended = torch.ones_like(ended)
            for key, val in (("edges", c_paths), ("toks", c_toks), ("lp", c_lp), ("lq", c_lq)):
                leaves[key].append(val[ended])
            alive = torch.nonzero(~ended).reshape(-1)
            if alive.numel() == 0:
                break
            parents = (alive // k).to(device)
            tokens = flat_tok[alive].to(device)
            out_pi, out_mu, out_h, kv_pi, kv_mu = [], [], [], [], []
            for s in range(0, alive.numel(), batch_size):
                sl = slice(s, s + batch_size)
                z, h, kv = pi.children(parents[sl], tokens[sl], t)
                out_pi.append(z)
                out_h.append(h)
                kv_pi.append(kv)
                if mu_net is not None:
                    z2, _, kv2 = mu_net.children(parents[sl], tokens[sl], t)
                    out_mu.append(z2)
                    kv_mu.append(kv2)
            pi.resp_kv = _cat_kv(kv_pi)
            pi_logits = torch.cat(out_pi)
            hidden = torch.cat(out_h) if out_h[0] is not None else None
            if mu_net is not None:
                mu_net.resp_kv = _cat_kv(kv_mu)
                mu_logits = torch.cat(out_mu)
            else:
                mu_logits = pi_logits
            paths, toks = c_paths[alive], c_toks[alive]
            path_lp, path_lq = c_lp[alive], c_lq[alive]
            reach_pi, reach_mu = c_rp[alive], c_rq[alive]
        bar.close()
    pi.resp_kv = None
    if mu_net is not None:
        mu_net.resp_kv = None

    L = sum(x.shape[0] for x in leaves["edges"])
    edges = np.full((L, T), n_edges, dtype=np.int64)
    seqs = np.full((L, T), eos_token_id if eos_token_id is not None else 0, dtype=np.int64)
    mask = np.zeros((L, T), dtype=bool)
    tlp = np.zeros((L, T))
    tlq = np.zeros((L, T))
    row = 0
    for e, tk, a, b in zip(leaves["edges"], leaves["toks"], leaves["lp"], leaves["lq"]):
        m, length = e.shape
        edges[row : row + m, :length] = e.numpy()
        seqs[row : row + m, :length] = tk.numpy()
        mask[row : row + m, :length] = True
        tlp[row : row + m, :length] = a.numpy()
        tlq[row : row + m, :length] = b.numpy()
        row += m
    scores = None
    if params is not None:
        if method == "head":
            scores = np.concatenate([*edge_scores, np.zeros((1, D))])
        else:
            scores = _functional_scores(
                pi_net, names, prompt[0].cpu(), seqs, mask, edges, n_edges, k, batch_size
            )
    rew = None
    if rewards is not None:
        rew = np.asarray(rewards(seqs, mask), dtype=np.float64)
        if rew.shape != (L,) or not np.all(np.isfinite(rew)):
            raise ValueError(f"rewards must return {L} finite values, got shape {rew.shape}")
    return Tree(
        prompt_ids=tuple(int(x) for x in prompt[0].tolist()),
        k=k,
        T=T,
        eos_token_id=eos_token_id,
        sequences=seqs,
        mask=mask,
        token_log_pi=tlp,
        token_log_mu=tlq,
        edges=edges,
        scores=scores,
        rewards=rew,
        node_depth=np.concatenate(node_depth),
        node_log_reach_mu=np.concatenate(node_reach),
        node_divergences={key: np.concatenate(v) for key, v in node_div.items()},
        param_names=names,
        behaviour=mu.name,
        strength=float(mu.strength),
    )


def _cat_kv(chunks):
    return [
        (torch.cat([c[i][0] for c in chunks]), torch.cat([c[i][1] for c in chunks]))
        for i in range(len(chunks[0]))
    ]


def topk_token_log_probs(model, input_ids: torch.Tensor, prompt_length: int, k: int):
    """Independent scoring of full rows: log π_k(y_t | x, y_<t) (N, T) float64 from one forward
    pass without cache, top-k of each position's logits, log-softmax over them; −inf where
    y_t is not in the position's top-k."""
    p = int(prompt_length)
    with torch.no_grad():
        z = model(input_ids).logits[:, p - 1 : -1]
    support = torch.topk(z.float(), k, dim=-1).indices
    lp = _support_log_probs(z.reshape(-1, z.shape[-1]), support.reshape(-1, k)).reshape(
        *support.shape
    )
    y = input_ids[:, p:, None]
    hit = support == y
    return torch.where(hit.any(-1), (lp * hit).sum(-1), torch.full_like(lp[..., 0], -math.inf))


def auto_target(model, prompts, k: int) -> int:
    """The second most likely token of π's top-k (the first if k = 1) at the first prompt's
    root: a token reward that fires on some but not all leaves of the tree (the tiny model's
    default target of ``simkit lm exact`` and of the lm_vs_sim figure)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        z = model(torch.tensor([prompts[0]], device=device)).logits[0, -1]
    return int(torch.topk(z.float(), min(k, 2)).indices[-1])


def _functional_scores(model, names, prompt, seqs, mask, edges, n_edges, k, batch_size):
    """torch.func scores per edge: ``vmap(jacrev)`` of each leaf's top-k log-probabilities
    (the top-k set held fixed: the support ids are inputs, not functions of θ)."""
    from torch.func import functional_call, jacrev, vmap

    device = next(model.parameters()).device
    params = _scores._subset(model, names)
    p = prompt.numel()
    L = seqs.shape[0]
    rows = torch.cat([prompt[None].expand(L, -1), torch.as_tensor(seqs)], 1).to(device)
    with torch.no_grad():
        z = torch.cat(
            [model(rows[s : s + batch_size]).logits[:, p - 1 : -1] for s in range(0, L, batch_size)]
        )
    support = torch.topk(z.float(), k, dim=-1).indices  # (L, T, k)
    pos = (support == rows[:, p:, None]).float().argmax(-1)  # index of y_t in its support

    def row_lp(prm, row, sup, ps):
        out = functional_call(model, prm, (row[None],))
        logits = getattr(out, "logits", out)[0, p - 1 : -1]
        lpk = torch.log_softmax(logits.gather(-1, sup), dim=-1)
        return lpk.gather(-1, ps[:, None])[:, 0]

    jac = vmap(jacrev(row_lp), in_dims=(None, 0, 0, 0))
    D = _scores.parameter_dim(model, names)
    scores = np.zeros((n_edges + 1, D))
    for s in range(0, L, batch_size):
        sl = slice(s, s + batch_size)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            g = jac(params, rows[sl], support[sl], pos[sl])
        flat = _scores._flatten(g, names, 2).detach().double().cpu().numpy()  # (m, T, D)
        m = mask[sl]
        scores[edges[sl][m]] = flat[m]
    scores[-1] = 0.0
    return scores


# --- the exact study -------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ExactStudy:
    """What :func:`exact_study` computed: ``table`` (the tidy table of
    :func:`simkit.experiment.run`, plus the setting columns ``behaviour``, ``strength``,
    ``top_k``, ``n_prompts``, ``D``, ``J``, ``grad_norm``, and the scale-free columns
    ``mse_zero``, ``alpha_star``, ``mse_scaled``, ``rel_mse_scaled``, ``kept``, ``kept_seq`` of
    :func:`simkit.lm.scale_free.with_scale_free`: exact on exact rows), ``env`` (the
    :class:`~simkit.lm.leaves.LeafEnv`), ``trees`` (one per prompt), ``grad_J`` (D,) exact."""

    table: pd.DataFrame
    env: LeafEnv
    trees: list
    grad_J: np.ndarray
    J: float
    param_names: tuple[str, ...]


def exact_study(
    model: torch.nn.Module,
    task,
    behaviour,
    estimators,
    k: int = 4,
    T: int = 6,
    n: int = 8,
    *,
    params: str | Sequence[str] = "norm",
    tokenizer=None,
    eos_token_id: int | None = None,
    prompts: Sequence[int] | None = None,
    reps: int = 400,
    seed: int = 0,
    level: float = 0.95,
    n_boot: int = 200,
    grad_method: str = "auto",
    batch_size: int = 256,
    progress: bool | None = None,
    memory_limit: int | None = None,
) -> ExactStudy:
    """Exact bias / variance of ``estimators`` on the top-k-truncated LM (module docstring).

    One :func:`tree` per prompt of ``task`` (``prompts``: indices into ``task.prompt_ids``;
    None: all), prompts uniform; rewards from ``task.rewards``. ``behaviour`` is prepared once
    (a staleness generator trains π once). Then :func:`simkit.experiment.run` on the leaf
    environment with batches of ``n`` responses: per-sample estimators exact (``exact``
    True), batch-dependent ones by ``reps`` Monte Carlo batches of exact leaf draws (``exact``
    False, bounds at ``level``). Group advantages need a single prompt (the leaf draws of a
    batch mix prompts).
    """
    from simkit import experiment as _experiment

    if isinstance(estimators, str):
        estimators = [estimators]
    ests = _experiment._coerce_estimators(
        [_study.default_estimators([e])[0] if isinstance(e, str) else e for e in estimators]
    )
    all_prompts = task.prompt_ids(tokenizer)
    idx = list(range(len(all_prompts))) if prompts is None else [int(i) for i in prompts]
    if not idx or any(not 0 <= i < len(all_prompts) for i in idx):
        raise ValueError(f"prompts must be indices in [0, {len(all_prompts)}), got {prompts!r}")
    if len(idx) > 1:
        grouped = [e.name for e in ests if e.advantage in GROUP_ADVANTAGES]
        if grouped:
            raise ValueError(
                f"estimators {grouped} use group advantages, which need the responses of a "
                "group to share a prompt: run exact_study with one prompt (prompts=[i])"
            )
    pi_net, mu = prepare_pair(behaviour, model, task, tokenizer, eos_token_id, T)
    pair = _Pair(pi_net, mu)
    trees = []
    for i in idx:

        def reward(seqs, mask, i=i):
            return task.rewards(np.full(len(seqs), i), seqs, mask, tokenizer)

        trees.append(
            tree(
                model,
                all_prompts[i],
                k,
                T,
                pair,
                eos_token_id,
                params=params,
                rewards=reward,
                grad_method=grad_method,
                batch_size=batch_size,
                progress=progress,
                memory_limit=memory_limit,
            )
        )
    env = leaf_env(trees)
    J = env.J()
    grad_J = env.grad_J()
    setting = {
        "behaviour": mu.name,
        "strength": float(mu.strength),
        "top_k": k,
        "n_prompts": len(idx),
        "D": env.D,
        "J": J,
        "grad_norm": float(np.linalg.norm(grad_J)),
    }
    table = _experiment.run(
        env,
        "mu",
        ests,
        n=n,
        reps=reps,
        seed=seed,
        setting=setting,
        level=level,
        n_boot=n_boot,
        progress=False,
    )
    table = with_scale_free(table, env, "mu", ests, n)
    return ExactStudy(table, env, trees, grad_J, J, trees[0].param_names)


@dataclass(frozen=True, eq=False)
class _Pair:
    target: torch.nn.Module
    behaviour: Behaviour
