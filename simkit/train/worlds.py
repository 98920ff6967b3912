"""Harder training worlds: prompt distributions, sparse rewards, distractors, lengths.

A single token MDP with a deterministic optimum J* = 1 is an easy world: nothing competes with
the task. This module builds the worlds of issue 16 §2 out of :class:`~simkit.envs.TokenMDP`
automata, keeping every quantity exact:

- :class:`Prompts` — a **prompt distribution**: K token MDPs ("prompts") of different
  difficulty that share one policy (one logits table (T, P, V); each prompt has its own
  automaton, policy classes, reward and EOS). The trainer (:func:`simkit.train.train`) draws
  the rollout's GRPO groups round-robin over the prompts (group g → prompt g mod K, so that
  every mini-batch of ≥ K groups sees every prompt), J = (1/K) Σ_k J_k (uniform prompt
  distribution), ∇J = (1/K) Σ_k ∇J_k, and the estimator's gradient is the sum of the
  per-prompt token terms of the mini-batch (one aggregation over the whole mini-batch). With
  disjoint policy classes (prompt visible to the policy, :func:`prompt_set`) a tabular policy
  learns the prompts independently and only the shared parameters of ``"tied"`` / ``"features"``
  (:mod:`simkit.train.params`) make them compete; with ``shared_classes=True`` the policy does
  not see the prompt and must trade one prompt for another even when tabular. Sequence
  divergences of the joint (prompt, sequence) law are the prompt means (KL, χ²: the prompt law
  is the same under π and μ); token divergences, entropy and length are averaged over all the
  tokens (occupancy-weighted).
- :func:`sparse_pattern` — a **sparse reward**: R = 1 iff the sequence contains a given
  pattern of m consecutive tokens (a KMP automaton), J₀ ≈ (T − m + 1)·V^{−m}.
- :func:`distractor` — a **distractor**: the ``at_least_k`` task (R = 1 after k hits) plus a
  lure token that ends the chance of reward 1 and pays ``lure_reward`` < 1 at once: the easy
  local optimum that makes premature determinism (entropy collapse at J ≈ lure_reward) possible.
- EOS and length dynamics: every constructor takes ``eos``; the trainer records E|y| every
  recorded step (column ``length``) and the summaries flag a length blow-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkit.envs.token_mdp import TokenMDP

__all__ = [
    "Prompts",
    "as_prompts",
    "difficulty_prompts",
    "distractor",
    "prompt_set",
    "sparse_pattern",
]


@dataclass(frozen=True, eq=False)
class Prompts:
    """K prompts sharing one policy (module docstring): ``envs`` is a tuple of
    :class:`~simkit.envs.TokenMDP` with equal ``logits`` (the shared initial policy)."""

    envs: tuple

    def __post_init__(self):
        envs = tuple(self.envs)
        if not envs:
            raise ValueError("Prompts needs at least one prompt (a TokenMDP)")
        for i, e in enumerate(envs):
            if not isinstance(e, TokenMDP):
                raise TypeError(f"prompt {i} must be a TokenMDP, got {type(e).__name__}")
            if e.logits.shape != envs[0].logits.shape:
                raise ValueError(
                    f"prompt {i} has logits of shape {e.logits.shape}, prompt 0 "
                    f"{envs[0].logits.shape}: the prompts share one policy table (T, P, V)"
                )
            if not np.array_equal(e.logits, envs[0].logits):
                raise ValueError(
                    f"prompt {i} has other initial logits than prompt 0: the prompts share one "
                    "policy (build them with prompt_set)"
                )
        object.__setattr__(self, "envs", envs)

    @property
    def K(self) -> int:
        return len(self.envs)

    @property
    def logits(self) -> np.ndarray:
        return self.envs[0].logits

    @property
    def T(self) -> int:
        return self.envs[0].T

    @property
    def P(self) -> int:
        return self.envs[0].P

    @property
    def V(self) -> int:
        return self.envs[0].V

    def with_logits(self, logits) -> Prompts:
        return Prompts(tuple(e.with_logits(logits) for e in self.envs))

    def J(self) -> float:
        """(1/K) Σ_k J_k, exact."""
        return float(np.mean([e.J() for e in self.envs]))


def as_prompts(env) -> tuple:
    """The prompts of ``env``: ``(env,)`` for a TokenMDP, ``env.envs`` for :class:`Prompts`."""
    if isinstance(env, Prompts):
        return env.envs
    if isinstance(env, TokenMDP):
        return (env,)
    raise TypeError(f"env must be a TokenMDP or Prompts, got {type(env).__name__}")


def prompt_set(envs, shared_classes: bool = False, logits=None) -> Prompts:
    """:class:`Prompts` from token MDPs with the same T and V.

    ``shared_classes=False`` (the prompt is visible): the policy classes of the prompts are
    disjoint, P = Σ_k P_k, prompt k's classes are offset by Σ_{j<k} P_j and the initial logits
    are the prompts' own logits side by side. ``shared_classes=True`` (the policy does not see
    the prompt): every prompt must have the same P; class p of every prompt is the same row of
    the table, and the initial logits are prompt 0's (or ``logits``).
    """
    envs = tuple(envs)
    if not envs:
        raise ValueError("prompt_set needs at least one TokenMDP")
    T, V = envs[0].T, envs[0].V
    for i, e in enumerate(envs):
        if not isinstance(e, TokenMDP):
            raise TypeError(f"prompt {i} must be a TokenMDP, got {type(e).__name__}")
        if (e.T, e.V) != (T, V):
            raise ValueError(f"prompt {i} has (T, V) = {(e.T, e.V)}, prompt 0 {(T, V)}")
    if shared_classes:
        P = envs[0].P
        if any(e.P != P for e in envs):
            raise ValueError(
                f"shared_classes needs the same number of policy classes P in every prompt, "
                f"got {[e.P for e in envs]}"
            )
        table = envs[0].logits if logits is None else np.asarray(logits, dtype=np.float64)
        offsets = [0] * len(envs)
    else:
        table = np.concatenate([e.logits for e in envs], axis=1)
        offsets = np.cumsum([0, *(e.P for e in envs[:-1])]).tolist()
        if logits is not None:
            table = np.asarray(logits, dtype=np.float64)
    out = [
        TokenMDP(
            table,
            e.transition,
            np.asarray(e.policy_index) + off,
            e.reward,
            eos=e.eos,
            initial_state=e.initial_state,
        )
        for e, off in zip(envs, offsets, strict=True)
    ]
    return Prompts(tuple(out))


def difficulty_prompts(V: int, T: int, ks=(1, 2, 4, 8), eos=None, seed: int = 0, scale=1.0):
    """K = len(ks) ``at_least_k`` prompts of increasing difficulty, prompt i rewarding k_i hits
    of token i mod (V − 1) (token V − 1 is left for ``eos``), disjoint classes
    (:func:`prompt_set`); random stationary logits ``scale``·N(0, 1) from ``seed`` per prompt."""
    envs = [
        TokenMDP.at_least_k(
            V=V, T=T, k=int(k), hit=i % max(V - 1, 1), eos=eos, seed=seed + i, scale=scale
        )
        for i, k in enumerate(ks)
    ]
    return prompt_set(envs)


def _random_logits(V, T, P, seed, scale):
    rng = np.random.default_rng(seed)
    return np.broadcast_to(scale * rng.standard_normal((1, P, V)), (T, P, V))


def sparse_pattern(
    V: int, T: int, pattern=(0, 1, 2), eos=None, seed: int = 0, scale: float = 1.0
) -> TokenMDP:
    """R = 1 iff the m tokens of ``pattern`` occur consecutively somewhere in the sequence.

    Automaton: the Knuth–Morris–Pratt matcher of the pattern (state j < m = length of the
    longest prefix of the pattern that is a suffix of the text; state m absorbing = found),
    each state its own policy class (P = m + 1). J(uniform) ≈ (T − m + 1)·V^{−m}: the reward is
    sparse and the policy must discover an m-token chain.
    """
    pat = [int(x) for x in pattern]
    m = len(pat)
    if m < 1 or any(not 0 <= x < V for x in pat) or (eos is not None and eos in pat):
        raise ValueError(f"pattern must be 1+ tokens in [0, V) other than eos, got {pattern!r}")
    if m > T:
        raise ValueError(f"pattern of {m} tokens cannot occur in T = {T} positions")
    S = m + 1
    trans = np.zeros((S, V), dtype=np.int64)
    for j in range(m):
        for v in range(V):
            seq = [*pat[:j], v]
            # longest suffix of seq that is a prefix of the pattern
            n = min(len(seq), m)
            while n > 0 and seq[len(seq) - n :] != pat[:n]:
                n -= 1
            trans[j, v] = n
    trans[m, :] = m
    if eos is not None:
        trans[:, eos] = np.arange(S)
    reward = np.zeros(S)
    reward[m] = 1.0
    logits = _random_logits(V, T, S, seed, scale)
    return TokenMDP(logits, trans, np.arange(S), reward, eos=eos)


def distractor(
    V: int,
    T: int,
    k: int,
    hit: int = 0,
    lure: int = 1,
    lure_reward: float = 0.3,
    eos=None,
    seed: int = 0,
    scale: float = 1.0,
) -> TokenMDP:
    """``at_least_k`` with a lure: R = 1 after k hits of ``hit``; emitting ``lure`` before that
    moves to an absorbing "lured" state with R = ``lure_reward`` (0 < lure_reward < 1).

    States 0..k count hits (k absorbing, R = 1), state k + 1 = lured; each its own class
    (P = k + 2). The lure is reachable in one token, the real reward needs k: a greedy policy
    takes the lure and its entropy collapses at J = lure_reward — premature determinism.
    """
    if not 0 < lure_reward < 1:
        raise ValueError(f"lure_reward must be in (0, 1), got {lure_reward!r}")
    if not 1 <= k <= T:
        raise ValueError(f"k must be in [1, T = {T}], got {k!r}")
    if len({hit, lure, eos} - {None}) != (3 if eos is not None else 2):
        raise ValueError("hit, lure and eos must be different tokens")
    S = k + 2
    trans = np.repeat(np.arange(S)[:, None], V, axis=1)
    trans[: k + 1, hit] = np.minimum(np.arange(k + 1) + 1, k)
    trans[:k, lure] = k + 1
    if eos is not None:
        trans[:, eos] = np.arange(S)
    reward = np.zeros(S)
    reward[k] = 1.0
    reward[k + 1] = lure_reward
    logits = _random_logits(V, T, S, seed, scale)
    return TokenMDP(logits, trans, np.arange(S), reward, eos=eos)
