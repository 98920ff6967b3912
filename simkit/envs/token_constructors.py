"""The token MDPs of the experiments: independent tokens, Markov, "the final answer is correct",
at least k hits, parity.

:class:`TokenMDPConstructors` is a mixin of :class:`~simkit.envs.token_mdp.TokenMDP`: each
constructor builds the automaton (``transition``, ``policy_index``, ``reward``) of its task and
hands it to one ``_build`` with the options it was given (:class:`LogitOptions`: the
logits, or random ``scale``·N(0, 1) from ``seed``, shared by every position when
``stationary``), so those options are declared and checked in one place.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from simkit._memory import check_token_mdp
from simkit._validation import check_seed, positive_int
from simkit.envs._checks import check_index

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from simkit.envs.token_mdp import TokenMDP


class LogitOptions(TypedDict, total=False):
    """The keyword options every constructor passes to ``_build``: where the logits come from.

    ``logits``: (V,), (P, V) or (T, P, V), broadcast over positions (default None: random);
    ``seed`` (default 0) and ``scale`` (default 1.0) of the random logits ``scale``·N(0, 1);
    ``stationary`` (default True): one random (P, V) table shared by every position.
    """

    logits: object
    seed: int
    scale: float
    stationary: bool


def _token_other_than_eos(value, name: str, V: int, eos) -> int:
    """A token in [0, V) that is not ``eos`` (the reward's token cannot end the sequence)."""
    token = check_index(value, name, V, "a token")
    if eos is not None and token == eos:
        raise ValueError(f"{name} must differ from eos (both {eos})")
    return token


def _logit_table(
    T: int, P: int, V: int, logits=None, seed=0, scale=1.0, stationary=True
) -> np.ndarray:
    """The (T, P, V) logits (a read-only broadcast view) of :class:`LogitOptions`: ``logits``
    (V,), (P, V) or (T, P, V) broadcast over positions, or random ``scale``·N(0, 1) from
    ``seed`` (one (P, V) table for every position when ``stationary``)."""
    if logits is None:
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale >= 0):
            raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
        rng = np.random.default_rng(check_seed(seed))
        shape = (1, P, V) if stationary else (T, P, V)
        logits = scale * rng.standard_normal(shape)
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim == 1:
        logits = logits[None, None, :]
    elif logits.ndim == 2:
        logits = logits[None]
    if logits.ndim != 3 or logits.shape[-1] != V or logits.shape[1] not in (1, P):
        raise ValueError(
            f"logits must have shape (V,), (P, V) or (T, P, V) with V = {V}, P = {P}, "
            f"T = {T}; got {np.shape(logits)}"
        )
    if logits.shape[0] not in (1, T):
        raise ValueError(f"logits has {logits.shape[0]} positions, expected 1 or T = {T}")
    return np.broadcast_to(logits, (T, P, V))


class TokenMDPConstructors:
    """Constructors of :class:`~simkit.envs.token_mdp.TokenMDP` (mixin)."""

    @classmethod
    def _build(
        cls, transition, policy_index, reward, T, eos, **options: Unpack[LogitOptions]
    ) -> TokenMDP:
        """The token MDP of an automaton (``transition`` (S, V), ``policy_index`` (S,) with
        P = max + 1 classes, ``reward`` (S,)) with the logits of ``options``
        (:func:`_logit_table`). ``eos`` ends a sequence and does not move the automaton."""
        unknown = [key for key in options if key not in LogitOptions.__annotations__]
        if unknown:
            raise TypeError(
                f"unexpected keyword argument {unknown[0]!r}: neither an argument of this "
                "TokenMDP constructor nor one of the logit options "
                f"{', '.join(LogitOptions.__annotations__)}"
            )
        T = positive_int(T, "T")
        S, V = np.shape(transition)
        P = int(np.max(policy_index)) + 1
        check_token_mdp(T, P, V, S=S)  # before any (T, P, V) array is allocated
        logits = _logit_table(T, P, V, **options)
        if eos is not None:
            eos = check_index(eos, "eos", V, "a token")
            transition = np.array(transition)
            transition[:, eos] = np.arange(transition.shape[0])  # EOS does not move the automaton
        return cls(logits, transition, policy_index, reward, eos=eos)

    @classmethod
    def iid(
        cls,
        V: int,
        T: int,
        answer: int = 0,
        eos: int | None = None,
        **options: Unpack[LogitOptions],
    ) -> TokenMDP:
        """Independent tokens: one policy class (P = 1), π(·|t) = softmax(logits[t, 0]).

        The automaton only records whether the ``answer`` token has appeared (S = 2: not yet /
        seen); R = 1 iff it appeared at least once. Random logits ``scale``·N(0, 1) from
        ``seed`` (shared by every position when ``stationary``) unless ``logits`` (V,), (1, V) or
        (T, 1, V) are given. With ``eos`` the EOS token ends the sequence.
        """
        V = positive_int(V, "V")
        answer = _token_other_than_eos(answer, "answer", V, eos)
        transition = np.zeros((2, V), dtype=np.int64)
        transition[0, answer] = 1
        transition[1, :] = 1
        return cls._build(transition, [0, 0], [0.0, 1.0], T, eos, **options)

    @classmethod
    def markov(
        cls,
        V: int,
        T: int,
        target: int = 0,
        eos: int | None = None,
        **options: Unpack[LogitOptions],
    ) -> TokenMDP:
        """First-order Markov policy: the policy class is the previous token.

        S = V + 1 automaton states (0 = start, 1 + v = last token v), P = S,
        π(·|t, s) = softmax(logits[t, s]); R = 1 iff the last token (before EOS) is ``target``.
        Logits (V + 1, V) or (T, V + 1, V), or random as in :meth:`iid`.
        """
        V = positive_int(V, "V")
        target = _token_other_than_eos(target, "target", V, eos)
        S = V + 1
        transition = np.broadcast_to(1 + np.arange(V), (S, V))
        reward = np.zeros(S)
        reward[1 + target] = 1.0
        return cls._build(transition, np.arange(S), reward, T, eos, **options)

    @classmethod
    def answer_correct(
        cls,
        V: int,
        T: int,
        answer: int = 0,
        eos: int | None = None,
        **options: Unpack[LogitOptions],
    ) -> TokenMDP:
        """ "The final answer is correct": R = 1 iff the last token (before EOS) is ``answer``.

        S = 3 automaton states (0 = nothing yet, 1 = last token correct, 2 = last token
        wrong), each its own policy class (P = 3).
        """
        V = positive_int(V, "V")
        answer = _token_other_than_eos(answer, "answer", V, eos)
        transition = np.full((3, V), 2, dtype=np.int64)
        transition[:, answer] = 1
        return cls._build(transition, np.arange(3), [0.0, 1.0, 0.0], T, eos, **options)

    @classmethod
    def at_least_k(
        cls,
        V: int,
        T: int,
        k: int,
        hit: int = 0,
        eos: int | None = None,
        **options: Unpack[LogitOptions],
    ) -> TokenMDP:
        """R = 1 iff the ``hit`` token occurs at least ``k`` times (1 ≤ k ≤ T).

        S = k + 1 automaton states counting hits (saturating at k), each its own policy class.
        """
        V = positive_int(V, "V")
        T = positive_int(T, "T")
        k = positive_int(k, "k")
        if k > T:
            raise ValueError(f"k must be <= T = {T} (otherwise R = 0 always), got {k}")
        hit = _token_other_than_eos(hit, "hit", V, eos)
        S = k + 1
        transition = np.repeat(np.arange(S)[:, None], V, axis=1)
        transition[:, hit] = np.minimum(np.arange(S) + 1, k)
        reward = np.zeros(S)
        reward[k] = 1.0
        return cls._build(transition, np.arange(S), reward, T, eos, **options)

    @classmethod
    def parity(
        cls, V: int, T: int, marked=None, eos: int | None = None, **options: Unpack[LogitOptions]
    ) -> TokenMDP:
        """R = 1 iff an odd number of ``marked`` tokens is emitted (default: odd token ids).

        S = 2 automaton states (parity so far), each its own policy class.
        """
        V = positive_int(V, "V")
        marked_ids = np.arange(1, V, 2) if marked is None else np.asarray(marked, dtype=np.int64)
        if marked_ids.ndim != 1 or np.any((marked_ids < 0) | (marked_ids >= V)):
            raise ValueError(f"marked must be a list of tokens in [0, V) = [0, {V})")
        if eos is not None and eos in set(marked_ids.tolist()):
            raise ValueError(f"eos = {eos} cannot be a marked token")
        transition = np.repeat(np.arange(2)[:, None], V, axis=1)
        transition[:, marked_ids] = 1 - np.arange(2)[:, None]
        return cls._build(transition, np.arange(2), [0.0, 1.0], T, eos, **options)
