"""The schema of an experiment sweep: pydantic v2 models of its TOML tables.

Every model is frozen and forbids unknown keys (``extra="forbid"``); types and ranges are
declared on the fields, so pydantic checks them and :mod:`simkit.config.errors` turns its error
into one message naming the key path, the bad value and the valid keys or names. What a type
cannot say is checked by the models' validators, each raising a
:class:`~simkit.config.errors.KeyPathError` below its model: names from the registries
(mappings, shift families, presets), hyperparameters (each mapping is built with
:func:`simkit.mappings.get`), batch sizes that do not split into groups, repeated values, and
every environment (built at each length ``T``).

Lists are stored as tuples and tables of parameters as sorted ``(name, value)`` pairs, so that
a configuration is hashable and two dicts that differ only in key order are one configuration.
"""

from __future__ import annotations

import itertools
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from simkit import composition, mappings, shifts
from simkit import estimators as _estimators
from simkit.envs import Bandit, TokenMDP
from simkit.envs.bandit import REWARD_KINDS
from simkit.envs.behaviour import AGGREGATES, LEVELS, BehaviourSpec
from simkit.estimator_specs import plain

from .cells import experiment_cells
from .errors import ConfigError, KeyPathError
from .fields import (
    Frozen,
    Grid,
    Kwargs,
    NonNeg,
    NonNegInt,
    Number,
    Params,
    PosInt,
    _enum,
    _like_default,
    _message,
    _names,
    _omit_none,
    one_or_more,
)
from .old import OldConfig, served_environment
from .ref import KLConfig, RefConfig

__all__ = [
    "EXACT_CHOICES",
    "GRID_MODES",
    "TOKEN_MDP_CONSTRUCTORS",
    "BanditConfig",
    "BehaviourConfig",
    "EnvironmentConfig",
    "EstimatorConfig",
    "Frozen",
    "KLConfig",
    "OldConfig",
    "RefConfig",
    "SweepConfig",
    "TokenMDPConfig",
    "distinct_estimators",
    "one_or_more",
]

#: TokenMDP constructors a config can name
TOKEN_MDP_CONSTRUCTORS = ("iid", "markov", "answer_correct", "at_least_k", "parity")
#: values of ``exact`` (as in :func:`simkit.experiment.run`)
EXACT_CHOICES = ("auto", True, False)
#: values of ``grid_mode``
GRID_MODES = ("product", "zip")


# --- environments -------------------------------------------------------------------------------


class BanditConfig(Frozen):
    """A K-armed bandit (:class:`simkit.envs.Bandit`), T = 1.

    ``logits`` and ``means`` are given (each a list of K numbers), or drawn from ``seed`` as in
    the first-wave bandit figures (:mod:`simkit.figures.bandit_bias_variance`):
    ``rng = default_rng(seed)``, logits = rng.normal(0, 1, K), then means = rng.uniform(0.05,
    0.95, K) (a given array replaces its draw; the other is still drawn in that order).
    ``reward``: ``"bernoulli"`` or ``"gaussian"`` (``reward_std`` > 0, Gaussian only).
    """

    table: ClassVar[str] = "environment"

    kind: Literal["bandit"] = "bandit"
    K: PosInt
    logits: tuple[Number, ...] | None = None
    means: tuple[Number, ...] | None = None
    reward: Literal[REWARD_KINDS] = "bernoulli"
    reward_std: NonNeg | None = None
    seed: NonNegInt = 0

    @model_validator(mode="after")
    def _check(self):
        for name in ("logits", "means"):
            arr = getattr(self, name)
            if arr is not None and len(arr) != self.K:
                raise KeyPathError(f".{name}", f"expected K = {self.K} numbers, got {len(arr)}")
        try:
            self.build()
        except (ValueError, TypeError) as exc:
            raise KeyPathError("", str(exc)) from None
        return self

    @property
    def lengths(self) -> tuple[int, ...]:
        return (1,)

    def build(self, T: int = 1) -> Bandit:
        """The bandit (``T`` must be 1)."""
        if T != 1:
            raise ValueError(f"a bandit has T = 1, got T = {T}")
        from simkit._memory import check_bandit  # (issue 13 §5: before the (K,) draws)

        check_bandit(self.K)
        rng = np.random.default_rng(self.seed)
        logits = rng.normal(0.0, 1.0, self.K)
        means = rng.uniform(0.05, 0.95, self.K)
        if self.logits is not None:
            logits = np.array(self.logits)
        if self.means is not None:
            means = np.array(self.means)
        return Bandit(logits=logits, means=means, reward=self.reward, reward_std=self.reward_std)

    def spec(self, T: int = 1) -> dict:
        """Plain dict describing the environment at length ``T`` (cell parameters)."""
        return {**self.to_dict(), "T": 1}

    def to_dict(self) -> dict:
        return plain(_omit_none(dict(self)))


class TokenMDPConfig(Frozen):
    """A token MDP built by ``TokenMDP.<constructor>(V=V, T=T, eos=eos, seed=seed,
    scale=scale, stationary=stationary, **kwargs)`` for every length of ``T`` (swept).

    ``constructor``: one of :data:`TOKEN_MDP_CONSTRUCTORS`; ``kwargs``: the constructor's own
    arguments (``answer``, ``target``, ``k``, ``hit``, ``marked``...) as a table.
    """

    table: ClassVar[str] = "environment"

    kind: Literal["token_mdp"] = "token_mdp"
    constructor: Literal[TOKEN_MDP_CONSTRUCTORS]
    V: Annotated[StrictInt, Field(ge=2)]
    T: one_or_more(PosInt)
    eos: NonNegInt | None = None
    seed: NonNegInt = 0
    scale: NonNeg = 1.0
    stationary: StrictBool = True
    kwargs: Kwargs = ()

    @model_validator(mode="after")
    def _check(self):
        reserved = sorted(
            set(dict(self.kwargs)) & {"V", "T", "eos", "seed", "scale", "stationary", "logits"}
        )
        if reserved:
            raise KeyPathError(
                f".kwargs.{reserved[0]}",
                f"{reserved[0]!r} is set at the environment level (or not configurable), not "
                "in kwargs",
            )
        for T in self.T:
            try:
                self.build(T)
            except (ValueError, TypeError) as exc:
                raise KeyPathError(f" (T = {T})", str(exc)) from None
        return self

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.T

    def build(self, T: int) -> TokenMDP:
        """The token MDP of length ``T``."""
        make = getattr(TokenMDP, self.constructor)
        kwargs = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.kwargs}
        return make(
            V=self.V,
            T=int(T),
            eos=self.eos,
            seed=self.seed,
            scale=self.scale,
            stationary=self.stationary,
            **kwargs,
        )

    def spec(self, T: int) -> dict:
        return {**self.to_dict(), "T": int(T)}

    def to_dict(self) -> dict:
        d = _omit_none(dict(self))
        d["kwargs"] = dict(self.kwargs)
        if not d["kwargs"]:
            del d["kwargs"]
        return plain(d)


EnvironmentConfig = Annotated[BanditConfig | TokenMDPConfig, Field(discriminator="kind")]


# --- behaviour ----------------------------------------------------------------------------------


class BehaviourConfig(Frozen):
    """How μ is moved away from π, and the divergence ``targets`` to sweep.

    ``family`` (a :mod:`simkit.shifts` name) with its hyperparameters ``family_params``;
    ``divergence``: ``"chi2"``, ``"kl"`` or ``"tv"`` (D(π‖μ)); ``level``: ``"token"`` or
    ``"sequence"`` (token MDP; on the bandit T = 1 and both coincide: μ =
    ``shifts.dial(π, target, ...)``). Token MDP only: ``aggregate`` (``"each"``/``"average"``),
    ``fraction`` and ``select_seed`` (a concentrated profile), as in
    :class:`simkit.envs.BehaviourSpec`. ``old`` (a table, :class:`OldConfig`): π_old a few
    policy-gradient steps behind π; the targets are then D(π_old‖μ), the inference-mismatch leg.
    """

    table: ClassVar[str] = "behaviour"

    targets: one_or_more(NonNeg)
    family: Annotated[
        StrictStr,
        AfterValidator(_names(shifts.available, "shift family")),
        Field(json_schema_extra=_enum(shifts.available)),
    ] = "temperature"
    family_params: Params = ()
    divergence: Literal[tuple(shifts.DIVERGENCES)] = "chi2"
    level: Literal[LEVELS] = "token"
    aggregate: Literal[AGGREGATES] | None = None
    fraction: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] | None = None
    select_seed: NonNegInt = 0
    old: OldConfig | None = None

    @model_validator(mode="after")
    def _check(self):
        self._set("family_params", _like_default(shifts.get(self.family), self.family_params))
        try:
            shifts.get(self.family, **dict(self.family_params))
        except (ValueError, TypeError, KeyError) as exc:
            raise KeyPathError(".family_params", _message(exc)) from None
        try:  # the remaining cross-field checks of the token-MDP recipe
            self.spec(self.targets[0])
        except (ValueError, TypeError) as exc:
            raise KeyPathError("", _message(exc)) from None
        return self

    def spec(self, target: float) -> BehaviourSpec:
        """The :class:`~simkit.envs.BehaviourSpec` of one target (token MDP)."""
        return BehaviourSpec(
            target=target,
            divergence=self.divergence,
            level=self.level,
            family=self.family,
            aggregate=self.aggregate,
            fraction=self.fraction,
            select_seed=self.select_seed,
            family_params=self.family_params,
        )

    def build_old(self, env) -> np.ndarray | None:
        """π_old for ``env`` (None without an ``old`` table: π_old = π)."""
        return None if self.old is None else self.old.build(env)

    def build(self, env, target: float, old: np.ndarray | None = None) -> np.ndarray:
        """μ for ``env`` at one target: :func:`simkit.shifts.dial` of the bandit's π, or the
        :class:`~simkit.envs.BehaviourSpec` built on a token MDP (ValueError if unreachable).
        With an ``old`` table μ is dialed from π_old instead (``old``: π_old if already built,
        else :meth:`build_old`)."""
        if self.old is not None:
            old = self.build_old(env) if old is None else old
            env = served_environment(env, old)
        if isinstance(env, Bandit):
            return shifts.dial(
                env.pi,
                float(target),
                divergence=self.divergence,
                family=self.family,
                **dict(self.family_params),
            )
        return self.spec(target).build(env)

    def params(self, target: float) -> dict:
        """Plain dict of the behaviour at one target (cell parameters)."""
        d = self.to_dict()
        del d["targets"]
        d["target"] = float(target)
        return d

    def to_dict(self) -> dict:
        d = _omit_none(dict(self))
        d["family_params"] = dict(self.family_params)
        if not d["family_params"]:
            del d["family_params"]
        if self.old is not None:
            d["old"] = self.old.to_dict()
        return plain(d)


# --- estimators ---------------------------------------------------------------------------------


def correction_names() -> tuple[str, ...]:
    """Mappings that can be a ``correction`` (detached weights: every registered mapping but
    :data:`simkit.composition.SURROGATE_MAPPINGS`)."""
    return tuple(n for n in mappings.available() if n not in composition.SURROGATE_MAPPINGS)


class EstimatorConfig(Frozen):
    """A family of estimators: one mapping, crossed with a hyperparameter grid, aggregations
    and advantages.

    ``mapping`` (a :func:`simkit.mappings.available` name), ``preset`` (a named preset of the
    mapping), ``params`` (fixed hyperparameters), ``grid`` ({hyperparameter: [values]}):
    ``grid_mode = "product"`` takes the cartesian product of the lists (in the order of the
    sorted hyperparameter names), ``"zip"`` pairs them element by element (lists of one length:
    linked knobs such as PPO's ε_low = ε_high). Each hyperparameter setting is crossed with
    ``aggregations`` × ``advantages``; ``group_size`` applies to the group advantages (grpo,
    dr_grpo, rloo, maxrl, otb, opob), ``adv_eps`` to grpo and maxrl, ``scale_rewards`` (``"group"``
    or TRL's ``"batch"``) to grpo, ``otb_is_cap`` (the rollout-IS variant's cap C) to otb,
    ``max_length`` to seq-mean-token-sum-norm.

    Three policies (:mod:`simkit.composition`): ``correction`` (a detached-weight mapping on
    π_old/μ, one of :func:`correction_names`: ``tis_token``, ``mis_seq``, ``icepop``...) with
    ``correction_preset`` and ``correction_params`` (its fixed hyperparameters), ``mode``
    (``"decoupled"``: c = c_mapping(π/π_old)·c_correction(π_old/μ), verl's decoupled mode and
    TRL's vLLM importance-sampling correction; ``"bypass"``: π_old := μ, verl's bypass mode;
    ``"trl_vespo"``: TRL's VESPO, the token correction folded into W), ``denominator``
    (``"valid"`` or ``"kept"``: verl's legacy token-mean over the surviving tokens) and ``seed``
    (the Generator of a stochastic mapping such as ``clip_cov``). Without these keys an entry is
    the single-ratio estimator of before; every estimator of the entry gets the same
    composition. π_old itself is the behaviour's ``old`` table.
    """

    table: ClassVar[str] = "estimators[?]"

    mapping: Annotated[
        StrictStr,
        AfterValidator(_names(mappings.available, "mapping")),
        Field(json_schema_extra=_enum(mappings.available)),
    ]
    preset: StrictStr | None = None
    params: Params = ()
    grid: Grid = ()
    grid_mode: Literal[GRID_MODES] = "product"
    aggregations: one_or_more(Literal[_estimators.AGGREGATIONS]) = ("token-mean",)
    advantages: one_or_more(Literal[_estimators.ADVANTAGES]) = ("oracle",)
    group_size: Annotated[StrictInt, Field(ge=2)] | None = None
    adv_eps: NonNeg = _estimators.DEFAULT_ADV_EPS
    scale_rewards: Literal[_estimators.REWARD_SCALES] = "group"
    otb_is_cap: Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)] | None = None
    max_length: PosInt | None = None
    correction: (
        Annotated[
            StrictStr,
            AfterValidator(_names(correction_names, "correction")),
            Field(json_schema_extra=_enum(correction_names)),
        ]
        | None
    ) = None
    correction_preset: StrictStr | None = None
    correction_params: Params = ()
    mode: Literal[composition.MODES] = "decoupled"
    denominator: Literal[composition.DENOMINATORS] = "valid"
    allow_same_ratio: StrictBool = False
    seed: NonNegInt = 0
    kl: KLConfig | None = None

    @model_validator(mode="after")
    def _check(self):
        self._check_correction()
        if self.preset is not None:
            presets = tuple(mappings.mapping_class(self.mapping).presets) or ("(none)",)
            if self.preset not in presets:
                raise KeyPathError(
                    ".preset", f"unknown preset {self.preset!r}; valid: {', '.join(presets)}"
                )
        defaults = mappings.get(self.mapping)
        self._set("params", _like_default(defaults, self.params))
        self._set("grid", _like_default(defaults, self.grid))
        both = sorted(set(dict(self.params)) & set(dict(self.grid)))
        if both:
            raise KeyPathError(f".grid.{both[0]}", f"{both[0]!r} is both in params and in grid")
        if self.grid_mode == "zip" and len({len(v) for _, v in self.grid}) > 1:
            lengths = {k: len(v) for k, v in self.grid}
            raise KeyPathError(".grid", f"grid_mode 'zip' needs lists of one length, got {lengths}")
        group = _estimators.GROUP_ADVANTAGES
        if self.scale_rewards != "group" and "grpo" not in self.advantages:
            raise KeyPathError(".scale_rewards", "applies to advantage 'grpo' only")
        if self.otb_is_cap is not None and "otb" not in self.advantages:
            raise KeyPathError(".otb_is_cap", "applies to advantage 'otb' only")
        if self.group_size is not None and not set(self.advantages) & set(group):
            raise KeyPathError(
                ".group_size",
                f"applies to the group advantages {group} only; advantages are "
                f"{list(self.advantages)}",
            )
        self.build()  # every hyperparameter setting and estimator, with key-path errors
        return self

    def _check_correction(self) -> None:
        if self.correction is None:
            for key in ("correction_preset", "correction_params"):
                if getattr(self, key):
                    raise KeyPathError(f".{key}", "applies with a correction only (no correction)")
            if self.mode == "trl_vespo":
                raise KeyPathError(".mode", "mode 'trl_vespo' needs a correction (tis_token, …)")
            return
        if self.correction_preset is not None:
            presets = tuple(mappings.mapping_class(self.correction).presets) or ("(none)",)
            if self.correction_preset not in presets:
                raise KeyPathError(
                    ".correction_preset",
                    f"unknown preset {self.correction_preset!r} of correction "
                    f"{self.correction!r}; valid: {', '.join(presets)}",
                )
        params = _like_default(mappings.get(self.correction), self.correction_params)
        self._set("correction_params", params)

    def _correction(self):
        """The correction Mapping (None without one); errors name the key."""
        if self.correction is None:
            return None
        try:
            return mappings.get(
                self.correction, preset=self.correction_preset, **dict(self.correction_params)
            )
        except (ValueError, TypeError, KeyError) as exc:
            where = ".correction_params" if self.correction_params else ".correction_preset"
            raise KeyPathError(where, _message(exc)) from None

    def settings(self) -> list[dict]:
        """The hyperparameter dicts of the grid (fixed ``params`` included), in grid order."""
        names = [k for k, _ in self.grid]
        lists = [v for _, v in self.grid]
        combos = zip(*lists) if self.grid_mode == "zip" else itertools.product(*lists)
        if not names:
            combos = [()]
        return [{**dict(self.params), **dict(zip(names, combo))} for combo in combos]

    def build(self) -> list[_estimators.Estimator]:
        """Every estimator of this entry: settings × aggregations × advantages (that order)."""
        try:  # the fixed part first, so that its errors point at params / preset
            mappings.get(self.mapping, preset=self.preset, **dict(self.params))
        except (ValueError, TypeError, KeyError) as exc:
            raise KeyPathError(".params" if self.params else ".preset", _message(exc)) from None
        correction = self._correction()
        try:
            composition.check_correction(
                mappings.get(self.mapping),
                correction,
                self.mode,
                self.denominator,
                self.allow_same_ratio,
            )
        except (ValueError, TypeError) as exc:
            where = ".mode" if self.mode != "decoupled" else ".correction"
            raise KeyPathError(where, _message(exc)) from None
        out = []
        grid_names = [k for k, _ in self.grid]
        for hp in self.settings():
            try:
                mapping = mappings.get(self.mapping, preset=self.preset, **hp)
            except (ValueError, TypeError, KeyError) as exc:
                where = ", ".join(f"{k}={hp[k]!r}" for k in grid_names)
                raise KeyPathError(f".grid ({where})", _message(exc)) from None
            for aggregation in self.aggregations:
                for advantage in self.advantages:
                    out.append(self._estimator(mapping, aggregation, advantage, correction))
        return out

    def _estimator(
        self, mapping, aggregation: str, advantage: str, correction=None
    ) -> _estimators.Estimator:
        group = advantage in _estimators.GROUP_ADVANTAGES
        if group and self.group_size is None:
            raise KeyPathError(".group_size", f"advantage {advantage!r} needs a group_size G >= 2")
        try:
            return _estimators.Estimator(
                mapping,
                aggregation=aggregation,
                advantage=advantage,
                group_size=self.group_size if group else None,
                adv_eps=self.adv_eps,
                scale_rewards=self.scale_rewards if advantage == "grpo" else "group",
                otb_is_cap=self.otb_is_cap if advantage == "otb" else None,
                max_length=self.max_length if aggregation == "seq-mean-token-sum-norm" else None,
                correction=correction,
                mode=self.mode,
                denominator=self.denominator,
                allow_same_ratio=self.allow_same_ratio,
                seed=self.seed,
                kl=None if self.kl is None else self.kl.build(),
            )
        except (ValueError, TypeError) as exc:
            raise KeyPathError("", _message(exc)) from None

    def to_dict(self) -> dict:
        d = _omit_none(dict(self))
        d["params"] = dict(self.params)
        d["grid"] = {k: list(v) for k, v in self.grid}
        d["correction_params"] = dict(self.correction_params)
        for key in ("params", "grid", "correction_params"):
            if not d[key]:
                del d[key]
        defaults = (("mode", "decoupled"), ("denominator", "valid"), ("allow_same_ratio", False))
        for key, default in (*defaults, ("seed", 0)):
            if d[key] == default:
                del d[key]
        if d["grid_mode"] == "product":
            del d["grid_mode"]
        if d["adv_eps"] == _estimators.DEFAULT_ADV_EPS:
            del d["adv_eps"]
        if d["scale_rewards"] == "group":
            del d["scale_rewards"]
        if self.kl is not None:
            d["kl"] = self.kl.to_dict()
        return plain(d)


def distinct_estimators(configs) -> list[tuple[int, _estimators.Estimator]]:
    """Every (index of its config entry, estimator) expanded from ``configs``; an estimator name
    produced twice is an error naming both entries."""
    names: dict[str, int] = {}
    out = []
    for i, e in enumerate(configs):
        for est in e.build():
            if est.name in names:
                raise KeyPathError(
                    f"estimators[{i}]",
                    f"estimator {est.name!r} is already produced by "
                    f"estimators[{names[est.name]}]; every expanded estimator must be distinct",
                )
            names[est.name] = i
            out.append((i, est))
    return out


# --- the sweep ----------------------------------------------------------------------------------


class SweepConfig(Frozen):
    """A whole sweep: environment × behaviour targets × (T) × n, with the estimators.

    ``name`` (a label), ``seed`` (≥ 0; the root of every cell's random stream), ``n`` (batch
    sizes, swept), ``reps`` (≥ 2), ``exact`` (``"auto"``, true, false), ``level`` (confidence
    level of the Monte Carlo bounds) and ``n_boot`` (bootstrap resamples) as in
    :func:`simkit.experiment.run`. Build it from a dict with :meth:`from_dict` or from a TOML
    file with :func:`simkit.config.load_config`; :meth:`to_dict` gives the canonical dict back
    (round trip). Validation checks each field; :meth:`validate` adds the checks that need the
    built environments (divergence targets reachable, exact paths).
    """

    kind: Literal["experiment"] = Field("experiment", description="the kind of sweep")
    name: Annotated[StrictStr, Field(min_length=1)]
    environment: EnvironmentConfig
    behaviour: BehaviourConfig
    estimators: Annotated[tuple[EstimatorConfig, ...], Field(min_length=1)]
    n: one_or_more(PosInt)
    seed: NonNegInt = 0
    reps: Annotated[StrictInt, Field(ge=2)] = 1000
    exact: Literal[EXACT_CHOICES] = "auto"
    level: Annotated[StrictFloat, Field(gt=0.0, lt=1.0)] = 0.95
    n_boot: Annotated[StrictInt, Field(ge=10)] = 1000
    ref: RefConfig | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.ref is None:
            for i, est in enumerate(self.estimators):
                if est.kl is not None:
                    raise KeyPathError(
                        f"estimators[{i}].kl",
                        "a KL penalty needs a reference policy: add a [ref] table "
                        "(noise = σ or kl = a target KL_seq(pi || ref))",
                    )
        if isinstance(self.environment, BanditConfig):
            for key in ("aggregate", "fraction"):
                if getattr(self.behaviour, key) is not None:
                    raise KeyPathError(
                        f"behaviour.{key}", "applies to a token MDP environment only"
                    )
        for i, est in distinct_estimators(self.estimators):
            for n in self.n:
                try:
                    est.check_batch_size(n)
                except ValueError as exc:
                    raise KeyPathError(f"estimators[{i}].group_size", str(exc)) from None
        return self

    @classmethod
    def from_dict(cls, d: dict):
        """Build (and check) a configuration from a plain dict, e.g. parsed TOML.

        A dict with ``kind = "train"`` is a training sweep: the result is then a
        :class:`simkit.train.config.TrainSweepConfig` (:func:`simkit.config.config_from_dict`);
        ``kind = "experiment"`` (the default) is this class.
        """
        from .tomlio import config_from_dict

        return config_from_dict(d)

    def to_dict(self) -> dict:
        """The canonical plain dict (``from_dict(to_dict(c)) == c``; TOML-writable)."""
        return {
            "name": self.name,
            "seed": self.seed,
            "n": list(self.n),
            "reps": self.reps,
            "exact": self.exact,
            "level": self.level,
            "n_boot": self.n_boot,
            "environment": self.environment.to_dict(),
            "behaviour": self.behaviour.to_dict(),
            "estimators": [e.to_dict() for e in self.estimators],
            **({} if self.ref is None else {"ref": self.ref.to_dict()}),
        }

    def validate(self) -> SweepConfig:
        """Every check that needs the built environments, before any work starts.

        For each length T: the environment is built, μ is dialed at every target (an
        unreachable target raises with the largest reachable value), ``exact = true`` is checked
        against each estimator's exact path. Returns ``self``; raises :class:`ConfigError`.
        """
        from simkit import experiment

        ests = [e for ec in self.estimators for e in ec.build()]
        lengths = self.environment.lengths
        for T in lengths:
            env = self.environment.build(T)
            try:
                old = self.behaviour.build_old(env)
            except ValueError as exc:
                at = f"behaviour.old (T = {T})" if len(lengths) > 1 else "behaviour.old"
                raise ConfigError(f"{at}: {exc}") from None
            if self.ref is not None:
                try:
                    self.ref.build(env)
                except ValueError as exc:
                    raise ConfigError(f"ref (T = {T}): {exc}") from None
            for target in self.behaviour.targets:
                try:
                    self.behaviour.build(env, target, old)
                except ValueError as exc:
                    at = f"behaviour.targets (T = {T})" if len(lengths) > 1 else "behaviour.targets"
                    raise ConfigError(f"{at}: {exc}") from None
            if self.exact is True:
                bad = [e.name for e in ests if not experiment.has_exact_path(env, e)]
                if bad:
                    raise ConfigError(
                        f"exact: exact = true but these estimators have no exact path at T = {T}: "
                        f'{", ".join(bad)} (use exact = "auto")'
                    )
        return self

    def cells(self):
        """The cells of this sweep (:func:`simkit.config.expand`)."""
        return experiment_cells(self)

    def toml_tables(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The keys written as ``[table]`` and as ``[[array of tables]]`` in TOML."""
        tables = ("environment", "behaviour") + (() if self.ref is None else ("ref",))
        return tables, ("estimators",)
