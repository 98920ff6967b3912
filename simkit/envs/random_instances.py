"""Random problem instances for ensembles: factories of environments and of behaviour policies.

A conclusion drawn on one bandit with one shift direction ("X has the smallest error") may be
a property of that instance. :func:`simkit.experiment.ensemble.ensemble` repeats an experiment
over random instances; it calls two factories with a ``numpy.random.Generator`` of their own:

- ``make_env(rng)`` → an environment (:func:`bandit_factory`, :func:`token_mdp_factory`);
- ``make_behaviour(env, rng)`` → a behaviour policy μ of ``env.pi``'s shape, dialed to a
  target divergence with a random shift direction (:func:`behaviour_factory`).

Every random choice goes through the ``rng`` passed in, so an ensemble is reproducible from
its seed. What is random:

- **bandit** (:func:`random_bandit`): logits ``logit_scale``·N(0, 1) (K arms); reward means
  U(``mean_low``, ``mean_high``), Bernoulli or Gaussian rewards (Gaussian: standard deviation
  ``reward_std``);
- **token MDP** (:func:`random_token_mdp`): one of the :class:`~simkit.envs.token_mdp.TokenMDP`
  constructors (``iid``, ``markov``, ``answer_correct``, ``at_least_k``, ``parity``) with a
  logit seed drawn from ``rng`` (random logits ``scale``·N(0, 1));
- **behaviour** (:func:`random_behaviour`): a :mod:`simkit.shifts` family dialed to
  ``target`` (a number, or a range (lo, hi) from which the target is drawn log-uniformly),
  with the family's free direction drawn: ``logit_noise`` its noise seed (the direction z),
  ``tilt`` its angle θ ~ U[0, π/2] (light- to heavy-tailed), ``temperature`` flatten or sharpen
  (equal odds, unless ``direction`` is given). Families without a free direction (``mixture``,
  ``tail``, ``top_p``, ``top_k``) are deterministic given π, which is itself random. Two
  profiles of :mod:`simkit.envs.behaviour` are available by name on a token MDP:
  ``toxic_tail`` (the rarest tokens starved: heavy-tailed ratios; on a bandit it is the
  ``tail`` family) and ``concentrated`` (the mismatch on a random ``fraction`` of the rows
  (t, p), drawn with a seed from ``rng``; token MDP only).

On the bandit μ is ``shifts.dial(env.pi, target, divergence, family)`` (K,); on a token MDP it
is :func:`simkit.envs.behaviour.behaviour` at ``level`` (``"token"``: every row dialed to the
target, or ``"sequence"``: one shared strength reaching the sequence-level divergence).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from simkit import shifts
from simkit._validation import int_at_least
from simkit.envs import behaviour as _behaviour
from simkit.envs.bandit import REWARD_KINDS, Bandit
from simkit.envs.token_mdp import TokenMDP

#: the TokenMDP constructors :func:`random_token_mdp` can draw from
TOKEN_MDP_KINDS = ("iid", "markov", "answer_correct", "at_least_k", "parity")
#: behaviour profiles beyond the plain shift families (:mod:`simkit.envs.behaviour`)
PROFILES = ("toxic_tail", "concentrated")
#: seeds drawn for the random parts are uniform in [0, SEED_HIGH)
SEED_HIGH = 2**31


def _check_rng(rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    return rng


def _finite_number(value, name: str, low: float | None = None, strict: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if not ok:
        bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


# --- environments ---------------------------------------------------------------------------


def random_bandit(
    rng: np.random.Generator,
    arms: int = 16,
    *,
    reward: str = "bernoulli",
    logit_scale: float = 1.0,
    mean_low: float = 0.05,
    mean_high: float = 0.95,
    reward_std: float = 1.0,
) -> Bandit:
    """A K-armed bandit: logits ``logit_scale``·N(0, 1) (K,), reward means
    U(``mean_low``, ``mean_high``) (K,), ``reward`` ∈ {"bernoulli", "gaussian"} (Gaussian with
    standard deviation ``reward_std``). Drawn in that order from ``rng``."""
    _check_rng(rng)
    arms = int_at_least(arms, "arms", 2)
    if reward not in REWARD_KINDS:
        raise ValueError(f"reward must be one of {REWARD_KINDS}, got {reward!r}")
    logit_scale = _finite_number(logit_scale, "logit_scale", 0.0)
    mean_low = _finite_number(mean_low, "mean_low")
    mean_high = _finite_number(mean_high, "mean_high")
    if not mean_low < mean_high:
        raise ValueError(f"need mean_low < mean_high, got {mean_low} and {mean_high}")
    if reward == "bernoulli" and not 0 <= mean_low < mean_high <= 1:
        raise ValueError(
            f"Bernoulli means need 0 <= mean_low < mean_high <= 1, got {mean_low}, {mean_high}"
        )
    reward_std = _finite_number(reward_std, "reward_std", 0.0, strict=True)
    logits = logit_scale * rng.standard_normal(arms)
    means = rng.uniform(mean_low, mean_high, arms)
    return Bandit(
        logits=logits,
        means=means,
        reward=reward,
        reward_std=reward_std if reward == "gaussian" else None,
    )


def bandit_factory(arms: int = 16, **options) -> Callable[[np.random.Generator], Bandit]:
    """``make_env(rng)`` drawing :func:`random_bandit` (``arms``, ``options``); the options are
    checked now, on a throw-away draw, so a bad one fails before an ensemble starts."""
    random_bandit(np.random.default_rng(0), arms, **options)

    def make_env(rng: np.random.Generator) -> Bandit:
        return random_bandit(rng, arms, **options)

    make_env.__doc__ = f"random_bandit(rng, arms={arms}, **{options!r})"
    return make_env


def random_token_mdp(
    rng: np.random.Generator, kind: str = "answer_correct", *, V: int = 4, T: int = 6, **options
) -> TokenMDP:
    """``TokenMDP.<kind>(V=V, T=T, seed=s, **options)`` with the logit seed s drawn from ``rng``
    (random logits ``scale``·N(0, 1); ``scale``, ``stationary``, ``eos`` and the constructor's
    own arguments, e.g. ``k`` of ``at_least_k``, go in ``options``)."""
    _check_rng(rng)
    if kind not in TOKEN_MDP_KINDS:
        raise ValueError(f"kind must be one of {TOKEN_MDP_KINDS}, got {kind!r}")
    if "seed" in options or "logits" in options:
        raise ValueError("random_token_mdp draws the logits: do not pass seed= or logits=")
    seed = int(rng.integers(SEED_HIGH))
    return getattr(TokenMDP, kind)(V=V, T=T, seed=seed, **options)


def token_mdp_factory(
    kind: str = "answer_correct", *, V: int = 4, T: int = 6, **options
) -> Callable[[np.random.Generator], TokenMDP]:
    """``make_env(rng)`` drawing :func:`random_token_mdp` (checked now on a throw-away draw)."""
    random_token_mdp(np.random.default_rng(0), kind, V=V, T=T, **options)

    def make_env(rng: np.random.Generator) -> TokenMDP:
        return random_token_mdp(rng, kind, V=V, T=T, **options)

    make_env.__doc__ = f"random_token_mdp(rng, {kind!r}, V={V}, T={T}, **{options!r})"
    return make_env


# --- behaviours -----------------------------------------------------------------------------


def _check_target(target) -> tuple[float, float]:
    """(lo, hi) of a target or a range (a number gives lo = hi)."""
    if isinstance(target, tuple | list) and len(target) == 2:
        lo = _finite_number(target[0], "target[0]", 0.0, strict=True)
        hi = _finite_number(target[1], "target[1]", 0.0, strict=True)
        if not lo <= hi:
            raise ValueError(f"target range must have lo <= hi, got {tuple(target)!r}")
        return lo, hi
    value = _finite_number(target, "target", 0.0)
    return value, value


def _draw_target(rng, lo: float, hi: float) -> float:
    return lo if lo == hi else float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _random_family(rng, family: str, family_kwargs: dict) -> shifts.ShiftFamily:
    """The family with its free direction drawn from ``rng`` (unless given)."""
    kwargs = dict(family_kwargs)
    if family == "logit_noise" and "seed" not in kwargs:
        kwargs["seed"] = int(rng.integers(SEED_HIGH))
    elif family == "tilt" and "angle" not in kwargs:
        kwargs["angle"] = float(rng.uniform(0.0, math.pi / 2))
    elif family == "temperature" and "direction" not in kwargs:
        kwargs["direction"] = "flatten" if rng.random() < 0.5 else "sharpen"
    return shifts.get(family, **kwargs)


def _is_token_mdp(env) -> bool:
    return np.ndim(env.pi) == 3


def random_behaviour(
    env,
    rng: np.random.Generator,
    target=0.01,
    divergence: str = "chi2",
    family: str = "logit_noise",
    *,
    level: str = "token",
    fraction: float = 0.1,
    **family_kwargs,
) -> np.ndarray:
    """μ for ``env`` (a :class:`~simkit.envs.bandit.Bandit` or a token MDP): ``family`` (a
    :mod:`simkit.shifts` name or a profile of :data:`PROFILES`) with its free direction drawn
    from ``rng`` (module docstring), dialed so that D(π‖μ) = ``target`` (or a target drawn
    log-uniformly from the range (lo, hi)); ``divergence`` ∈ {"chi2", "kl", "tv"}.

    Token MDP: ``level`` ``"token"`` (every row dialed to the target) or ``"sequence"`` (one
    shared strength hitting the sequence-level divergence); ``concentrated`` shifts a random
    ``fraction`` of the rows (``level="sequence"`` is its natural setting: the same χ²_seq on
    fewer rows) and ``toxic_tail`` starves the rarest token of every row. Returns μ of
    ``env.pi``'s shape. Raises ``ValueError`` naming the argument for a bad choice and for a
    target the family cannot reach on this instance.
    """
    _check_rng(rng)
    lo, hi = _check_target(target)
    if divergence not in shifts.DIVERGENCES:
        raise ValueError(
            f"divergence must be one of {sorted(shifts.DIVERGENCES)}, got {divergence!r}"
        )
    if family not in (*shifts.available(), *PROFILES):
        raise ValueError(
            f"family must be a shift family {shifts.available()} or one of {PROFILES}, "
            f"got {family!r}"
        )
    value = _draw_target(rng, lo, hi)
    token_mdp = _is_token_mdp(env)
    if not token_mdp:
        if family == "concentrated":
            raise ValueError("family 'concentrated' needs a token MDP (a bandit has one row)")
        fam = "tail" if family == "toxic_tail" else family
        return shifts.dial(env.pi, value, divergence, _random_family(rng, fam, family_kwargs))
    aggregate = "each" if level == "token" else None
    if family == "toxic_tail":
        return _behaviour.toxic_tail(env, value, divergence, level, aggregate=aggregate)
    if family == "concentrated":
        base = family_kwargs.pop("base", "logit_noise")
        select_seed = int(rng.integers(SEED_HIGH))
        return _behaviour.concentrated(
            env,
            value,
            divergence,
            level,
            _random_family(rng, base, family_kwargs),
            fraction=fraction,
            select_seed=select_seed,
            aggregate=aggregate,
        )
    fam = _random_family(rng, family, family_kwargs)
    return _behaviour.behaviour(env, value, divergence, level, fam, aggregate=aggregate)


def behaviour_factory(
    target=0.01, divergence: str = "chi2", family: str = "logit_noise", **options
) -> Callable[[object, np.random.Generator], np.ndarray]:
    """``make_behaviour(env, rng)`` calling :func:`random_behaviour` with these arguments
    (``options``: ``level``, ``fraction``, family hyperparameters; for ``concentrated``,
    ``base`` names the family applied to the chosen rows, default ``logit_noise``). The
    arguments that do not need an environment are checked now."""
    _check_target(target)
    if divergence not in shifts.DIVERGENCES:
        raise ValueError(
            f"divergence must be one of {sorted(shifts.DIVERGENCES)}, got {divergence!r}"
        )
    if family not in (*shifts.available(), *PROFILES):
        raise ValueError(
            f"family must be a shift family {shifts.available()} or one of {PROFILES}, "
            f"got {family!r}"
        )
    level = options.get("level", "token")
    if level not in _behaviour.LEVELS:
        raise ValueError(f"level must be one of {_behaviour.LEVELS}, got {level!r}")

    def make_behaviour(env, rng: np.random.Generator) -> np.ndarray:
        return random_behaviour(env, rng, target, divergence, family, **dict(options))

    make_behaviour.__doc__ = (
        f"random_behaviour(env, rng, target={target!r}, divergence={divergence!r}, "
        f"family={family!r}, **{options!r})"
    )
    return make_behaviour
