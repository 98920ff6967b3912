"""The planner: how one row of :func:`simkit.experiment.run` is computed, and why.

Every path that needs the decision "exact by enumeration, exact by dynamic programming, or
Monte Carlo" asks :func:`plan` once: ``run`` (and its ``method`` / ``why_mc`` columns),
:func:`simkit.experiment.exact.exact_moments`, :func:`~simkit.experiment.exact.why_not_exact`,
:func:`~simkit.experiment.exact.has_exact_path` and the config check of ``exact = true``.

The rules, in order (the first that applies decides):

1. ``exact=False`` was asked → ``monte_carlo``.
2. Obstacles of the estimator itself (any environment): a batch-dependent mapping or
   correction, an advantage that couples the samples of a group, a random per-batch Z
   (``denominator="kept"`` with ``token-mean``) → ``monte_carlo``.
3. Obstacles of the estimator on this environment: ``token-mean`` divides by the batch's total
   number of tokens, which is random when lengths vary (EOS) → ``monte_carlo``.
4. The environment's support can be enumerated (the bandit; a token MDP within the enumeration
   budget) → ``enumeration`` (:func:`simkit.experiment.exact.exact_moments`).
5. A moment DP applies (:mod:`simkit.envs.token_moments` for untied parameters, composed
   estimators included, and a per-token additive term — a KL penalty in the loss, DRO's or
   DPPO's b — on a token-level mapping without a correction, not a KL penalty in the reward;
   :mod:`simkit.envs.token_moments_tied` for tied ones, whose second moment carries the
   cross-position terms) → ``dp``.
6. Otherwise → ``monte_carlo``, with the DP's reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from simkit.estimators import PER_SAMPLE_ADVANTAGES, Estimator, as_estimator

#: how a row is computed (the ``method`` column)
METHODS = ("enumeration", "dp", "monte_carlo")
#: parameterisations of θ for the gradient: per-position blocks, or one table for all positions
PARAMS = ("untied", "tied")


def check_params(params) -> str:
    """``params`` if it is one of :data:`PARAMS` (``ValueError`` naming it otherwise)."""
    if params not in PARAMS:
        raise ValueError(f"params must be one of {PARAMS}, got {params!r}")
    return params


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one estimator on one environment.

    ``method``: one of :data:`METHODS`; ``why_mc``: for ``monte_carlo``, the obstacle to an
    exact path in words ('' otherwise).
    """

    method: str
    why_mc: str = ""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if (self.method == "monte_carlo") != bool(self.why_mc):
            raise ValueError("why_mc is given exactly for monte_carlo plans")

    @property
    def exact(self) -> bool:
        """True for the exact methods (``enumeration`` and ``dp``)."""
        return self.method != "monte_carlo"


def plan(estimator, env, params: str = "untied", exact="auto") -> Plan:
    """How :func:`simkit.experiment.run` computes ``estimator``'s row on ``env`` (module
    docstring: the rules). ``exact``: ``"auto"`` or ``True`` plan by the rules; ``False``
    plans Monte Carlo."""
    est = as_estimator(estimator)
    params = check_params(params)
    if exact is False:
        return Plan("monte_carlo", "exact=False was asked")
    reasons = estimator_obstacles(est, env)
    if reasons:
        return Plan("monte_carlo", " and ".join(reasons))
    if is_enumerable(env):
        return Plan("enumeration")
    why_dp = dp_obstacle(est, env, params)
    if why_dp:
        return Plan(
            "monte_carlo",
            f"the environment has {env.n_sequences} sequences, more than the enumeration "
            f"budget, and {why_dp}",
        )
    return Plan("dp")


def dp_obstacle(est: Estimator, env, params: str) -> str:
    """'' if a moment DP gives ``est``'s exact moments on ``env`` with ``params``, else why not."""
    from simkit.envs.token_moments import additive_dp_applies, composed_dp_applies

    if est.aggregation == "token-sum":  # n × seq-mean-token-sum (exact.exact_moments)
        est = as_token_sum_base(est)
    if est.kl is not None or est.mapping.has_additive:
        if params == "tied":
            return (
                "an additive per-token term (a KL penalty in the loss, a mapping's b) has a "
                "moment DP for untied parameters only"
            )
        return additive_dp_applies(
            env, est.mapping, est.correction, est.aggregation, est.denominator, est.kl
        )

    if params == "tied":
        from simkit.envs.token_moments_tied import tied_composed_dp_applies

        return tied_composed_dp_applies(
            env, est.mapping, est.correction, est.mode, est.aggregation, est.denominator
        )
    return composed_dp_applies(
        env, est.mapping, est.correction, est.mode, est.aggregation, est.denominator
    )


def as_token_sum_base(est: Estimator) -> Estimator:
    """The ``seq-mean-token-sum`` twin of a ``token-sum`` estimator: its ĝ is the twin's times
    the batch size n (Z = 1 instead of N), so the twin's exact path serves both."""
    import dataclasses

    return dataclasses.replace(est, aggregation="seq-mean-token-sum")


def estimator_obstacles(est: Estimator, env) -> list[str]:
    reasons = []
    if est.mapping.batch_dependent:
        reasons.append(f"mapping {est.mapping.name!r} is batch dependent")
    if est.advantage not in PER_SAMPLE_ADVANTAGES:
        reasons.append(f"advantage {est.advantage!r} couples the samples of a group")
    reasons.extend(est.exact_obstacles())
    if (
        env is not None
        and est.aggregation == "token-mean"
        and not getattr(env, "fixed_length", True)
    ):
        reasons.append(
            "aggregation 'token-mean' divides by the batch's total number of tokens, which "
            "is random when lengths vary (eos)"
        )
    return reasons


def is_enumerable(env) -> bool:
    """False for an environment whose support cannot be enumerated (no ``enumerable``: True)."""
    enumerable = getattr(env, "enumerable", None)
    return enumerable is None or bool(enumerable())
