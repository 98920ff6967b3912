"""Mismatch generators: a behaviour policy μ derived from a language model π, and how far it is.

In RL for LLMs the responses are sampled by a policy μ that is not the policy π being trained.
Each generator below builds one mechanism of that mismatch from a causal LM and returns the
pair (π, μ) that :func:`simkit.lm.study.gradient_study` runs on (``prepare``):

================ ===================================================================== =========
generator        μ (and π)                                                             identity
================ ===================================================================== =========
``temperature``  μ = softmax(z/τ), z = π's logits (sampling temperature)               τ = 1
``top_p``        μ = π restricted to its nucleus — the smallest set of most probable   p = 1
                 tokens holding mass ≥ p — renormalised (Holtzman et al. 2020, ICLR,
                 "The curious case of neural text degeneration")
``precision``    μ = softmax(round(z)) with z rounded to bf16/fp16/fp32 (``scope=      fp32 on a
                 "logits"``, an engine sampling from low-precision logits), or μ = the  float32
                 whole network cast to that dtype (``scope="forward"``)                model
``weight_noise`` μ = the network with θ + σ·s·ε, ε ~ N(0, 1) per weight, s the RMS of  σ = 0
                 each tensor (``relative``) or 1
``staleness``    μ = the given network θ₀ (the rollout policy), π = θ_k after k         k = 0
                 optimizer steps of a policy-gradient loss on k mini-batches of one
                 rollout batch drawn from μ: VESPO's setting (Shen et al. 2025, "VESPO",
                 §5), where the N-th mini-batch of a global batch is trained with
                 N = global batch / mini batch and staleness k = N − 1
================ ===================================================================== =========

Generators compose with :class:`Combined` (``"temperature:0.7+top_p:0.9"``: logit transforms
applied in order, after at most one generator that changes a network). :func:`parse` reads the
command-line form ``name:value[,key=value...]``.

:func:`measure` reports what a generator does: responses are sampled from μ, and at every
visited state (prompt and response prefix) the divergences between π(·|h) and μ(·|h) are
computed *exactly over the vocabulary* from the two logit vectors
(:func:`simkit.lm.sampling.token_divergences`): χ²(π‖μ) = Σ π²/μ − 1, KL(π‖μ) = Σ π log(π/μ)
and TV = ½Σ|π − μ| (the conventions of :mod:`simkit.divergence`), then averaged over μ's
visited tokens (the ``chi2_tok``/``kl_tok``/``tv_tok`` of DESIGN.md) and per position.
A top-p μ gives zero probability to tokens π can emit, so χ² and KL are ``inf`` there — the
honest value: importance weights cannot correct for a support μ never samples.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import partial

import numpy as np
import pandas as pd
import torch

from simkit._validation import int_at_least
from simkit.lm._checks import finite as _finite
from simkit.lm.behaviour import Behaviour
from simkit.lm.sampling import _draw, _seed_of
from simkit.lm.scores import select_parameters
from simkit.lm.staleness import OPTIMIZERS, stale_target
from simkit.lm.staleness import RolloutBatch as RolloutBatch  # re-exported
from simkit.lm.staleness import rollout_batch as rollout_batch  # re-exported

#: generator name -> class (:func:`get`, :func:`parse`)
GENERATORS: dict[str, type] = {}
#: ``precision`` dtypes: name -> torch dtype
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRECISION_SCOPES = ("logits", "forward")


# --- pure logit transforms -------------------------------------------------------------------


def temperature_logits(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Logits of softmax(z/τ) (…, V): the sampling temperature τ > 0."""
    return logits / float(tau)


def top_p_logits(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Logits of the nucleus distribution (…, V): tokens outside the top-p set get −inf.

    Sorting the probabilities π₍₁₎ ≥ π₍₂₎ ≥ …, token (k) is kept iff Σ_{j<k} π₍ⱼ₎ < p, i.e.
    the smallest prefix of most probable tokens with mass ≥ p (the most probable token is
    always kept; ties are broken by the sort). p = 1 returns ``logits`` unchanged. The set is
    decided in float32 whatever the input dtype, so float32 sampling logits and float64
    scoring logits select the same tokens.
    """
    p = float(p)
    if p >= 1.0:
        return logits
    z = logits.float()
    probs, order = torch.sort(torch.softmax(z, dim=-1), dim=-1, descending=True)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep_sorted = mass_before < p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, -math.inf)


def round_logits(logits: torch.Tensor, dtype: str) -> torch.Tensor:
    """The logits rounded to ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``; round to nearest
    even, IEEE 754) and cast back to their dtype. bf16 keeps 8 significant bits, fp16 11 (and
    saturates to ±inf beyond 65504), fp32 24."""
    if dtype not in PRECISIONS:
        raise ValueError(f"precision dtype must be one of {list(PRECISIONS)}, got {dtype!r}")
    return logits.to(PRECISIONS[dtype]).to(logits.dtype)


def perturbed_copy(
    model: torch.nn.Module,
    sigma: float,
    param_names: Sequence[str],
    seed: int = 0,
    relative: bool = True,
) -> torch.nn.Module:
    """A deep copy of ``model`` with θ_j + σ·s_j·ε_j on the parameters ``param_names``.

    ε ~ N(0, 1) i.i.d., drawn from ``torch.Generator().manual_seed(seed)`` on the CPU in the
    order of ``param_names`` (bit-reproducible); s_j = RMS of tensor j when ``relative``
    (noise relative to each tensor's scale), else 1. ``model`` is not modified.
    """
    noisy = copy.deepcopy(model)
    params = dict(noisy.named_parameters())
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name in param_names:
            prm = params[name]
            eps = torch.randn(prm.shape, generator=gen, dtype=torch.float64)
            scale = float(prm.detach().double().pow(2).mean().sqrt()) if relative else 1.0
            prm.add_((float(sigma) * scale * eps).to(device=prm.device, dtype=prm.dtype))
    return noisy.eval()


# --- generators ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MismatchPair:
    """A prepared mismatch: π's network ``target``, the behaviour μ, and what made them."""

    target: torch.nn.Module
    behaviour: Behaviour
    generator: object = None

    def prepare(self, model, **_):
        """Already prepared: returns itself (``model`` is ignored)."""
        return self


def _register(cls):
    GENERATORS[cls.name] = cls
    return cls


class _Generator:
    """Shared behaviour of the generators (each is a frozen dataclass with a primary knob)."""

    name = ""
    knob = ""  # the field set by the positional value of :func:`parse`
    changes_network = False

    def transform(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The logit transform of μ (None: identity)."""
        return None

    @property
    def strength(self) -> float:
        return float(getattr(self, self.knob))

    @property
    def spec(self) -> str:
        """The :func:`parse` form: ``name:knob[,field=value]`` for non-default fields."""
        extra = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name != self.knob and getattr(self, f.name) != f.default
        ]
        return f"{self.name}:{getattr(self, self.knob)}" + "".join(f",{e}" for e in extra)

    def prepare(
        self, model, *, task=None, tokenizer=None, eos_token_id=None, max_new_tokens=None
    ) -> MismatchPair:
        """(π, μ) from ``model``: μ = softmax(transform(π's logits)); π = ``model``."""
        return MismatchPair(
            model,
            Behaviour(transform=self.transform(), name=self.name, strength=self.strength),
            self,
        )


@_register
@dataclass(frozen=True)
class Temperature(_Generator):
    """μ = softmax(z/τ) with z = π's logits; τ > 0 (τ = 1: μ = π).

    Along τ the family is a one-parameter exponential family in β = 1/τ, so χ²(π‖μ), KL(π‖μ)
    and TV grow monotonically as τ moves away from 1 on either side.
    """

    tau: float = 1.0
    name = "temperature"
    knob = "tau"

    def __post_init__(self):
        tau = _finite(self.tau, "temperature tau")
        if tau <= 0:
            raise ValueError(f"temperature tau must be > 0, got {tau}")
        object.__setattr__(self, "tau", tau)

    def transform(self):
        return None if self.tau == 1.0 else partial(temperature_logits, tau=self.tau)


@_register
@dataclass(frozen=True)
class TopP(_Generator):
    """μ = the nucleus (top-p) truncation of π, renormalised (:func:`top_p_logits`); 0 < p ≤ 1.

    TV(π, μ) = 1 − (mass of the nucleus) decreases as p grows; χ²(π‖μ) and KL(π‖μ) are
    infinite wherever the nucleus drops a token π can emit.
    """

    p: float = 1.0
    name = "top_p"
    knob = "p"

    def __post_init__(self):
        p = _finite(self.p, "top_p p")
        if not 0 < p <= 1:
            raise ValueError(f"top_p p must be in (0, 1], got {p}")
        object.__setattr__(self, "p", p)

    def transform(self):
        return None if self.p >= 1.0 else partial(top_p_logits, p=self.p)


@_register
@dataclass(frozen=True)
class Precision(_Generator):
    """μ computed in low precision, as an inference engine does (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training").

    ``dtype``: ``"bf16"``, ``"fp16"`` or ``"fp32"``. ``scope="logits"``: μ = softmax of π's
    logits rounded to ``dtype`` (:func:`round_logits`); ``"forward"``: μ's network is a copy of
    π's cast to ``dtype`` (every matmul in low precision; far larger mismatch). fp32 on a
    float32 model is the identity.
    """

    dtype: str = "bf16"
    scope: str = "logits"
    name = "precision"
    knob = "dtype"

    def __post_init__(self):
        if self.dtype not in PRECISIONS:
            raise ValueError(
                f"precision dtype must be one of {list(PRECISIONS)}, got {self.dtype!r}"
            )
        if self.scope not in PRECISION_SCOPES:
            raise ValueError(
                f"precision scope must be one of {PRECISION_SCOPES}, got {self.scope!r}"
            )

    @property
    def strength(self) -> float:
        """Unit roundoff of the dtype, 2^−(significant bits): bf16 2^−8, fp16 2^−11, fp32 2^−24."""
        return float(torch.finfo(PRECISIONS[self.dtype]).eps) / 2.0

    @property
    def changes_network(self) -> bool:  # type: ignore[override]
        return self.scope == "forward"

    def transform(self):
        return None if self.scope == "forward" else partial(round_logits, dtype=self.dtype)

    def prepare(self, model, **kwargs) -> MismatchPair:
        if self.scope == "logits":
            return super().prepare(model, **kwargs)
        net = copy.deepcopy(model).to(PRECISIONS[self.dtype]).eval()
        return MismatchPair(
            model, Behaviour(model=net, name=self.name, strength=self.strength), self
        )


@_register
@dataclass(frozen=True)
class WeightNoise(_Generator):
    """μ's network = π's with Gaussian weight noise (:func:`perturbed_copy`); σ ≥ 0 (σ = 0:
    μ = π). ``params``: the perturbed parameters (:func:`simkit.lm.experiment.select_parameters`
    spec, default every parameter); ``relative``: σ in units of each tensor's RMS; ``seed``."""

    sigma: float = 0.0
    params: str = "all"
    relative: bool = True
    seed: int = 0
    name = "weight_noise"
    knob = "sigma"
    changes_network = True

    def __post_init__(self):
        sigma = _finite(self.sigma, "weight_noise sigma")
        if sigma < 0:
            raise ValueError(f"weight_noise sigma must be >= 0, got {sigma}")
        object.__setattr__(self, "sigma", sigma)
        int_at_least(self.seed, "weight_noise seed", 0)
        if not isinstance(self.relative, bool):
            raise ValueError(f"weight_noise relative must be True or False, got {self.relative!r}")

    def prepare(self, model, **_) -> MismatchPair:
        if self.sigma == 0.0:
            return MismatchPair(model, Behaviour(name=self.name, strength=0.0), self)
        names = select_parameters(model, self.params)
        net = perturbed_copy(model, self.sigma, names, self.seed, self.relative)
        return MismatchPair(model, Behaviour(model=net, name=self.name, strength=self.sigma), self)


@_register
@dataclass(frozen=True)
class Staleness(_Generator):
    """π is ``steps`` optimizer steps ahead of the behaviour μ = the given network (k = 0: μ = π).

    VESPO's schedule: one rollout batch of ``steps × batch_size`` responses is drawn from μ =
    θ₀ (the given model) for the task's prompts; mini-batch j (``batch_size`` rows) updates
    θ_{j−1} → θ_j with the policy loss ``loss`` of :func:`simkit.lm.losses.policy_loss`
    (token-mean aggregation, advantage A = R − mean R of the rollout batch, μ's log-probs as
    ``old_log_prob``) and ``optimizer`` (``"adam"`` or ``"sgd"``, learning rate ``lr``) on the
    parameters ``params``. π = θ_k is the policy that trains the (k+1)-th mini-batch, which
    was sampled k updates ago (staleness N = k + 1 = global batch / mini batch). Responses
    have ``max_new_tokens`` tokens (None: the study's T). Needs the study's task (rewards).
    A rollout batch with constant reward has A = 0 and leaves π = μ (a warning says so).
    """

    steps: int = 0
    lr: float = 1e-3
    optimizer: str = "adam"
    batch_size: int = 8
    loss: str = "ppo_clip"
    params: str = "all"
    max_new_tokens: int | None = None
    seed: int = 0
    name = "staleness"
    knob = "steps"
    changes_network = True

    def __post_init__(self):
        from simkit.lm import losses

        int_at_least(self.steps, "staleness steps", 0)
        lr = _finite(self.lr, "staleness lr")
        if lr <= 0:
            raise ValueError(f"staleness lr must be > 0, got {lr}")
        object.__setattr__(self, "lr", lr)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"staleness optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"
            )
        int_at_least(self.batch_size, "staleness batch_size", 1)
        if self.loss not in losses.available():
            raise ValueError(
                f"staleness loss {self.loss!r} is not a policy loss; available: "
                f"{', '.join(losses.available())}"
            )
        if self.max_new_tokens is not None:
            int_at_least(self.max_new_tokens, "staleness max_new_tokens", 1)
        int_at_least(self.seed, "staleness seed", 0)

    def prepare(
        self, model, *, task=None, tokenizer=None, eos_token_id=None, max_new_tokens=None
    ) -> MismatchPair:
        if self.steps == 0:
            return MismatchPair(model, Behaviour(name=self.name, strength=0.0), self)
        if task is None:
            raise ValueError("the staleness generator needs the task (its rewards drive the steps)")
        T = self.max_new_tokens or max_new_tokens
        if T is None:
            raise ValueError("staleness: set max_new_tokens (no study length to default to)")
        settings = {f.name: getattr(self, f.name) for f in fields(self)}  # stale_target's
        settings["max_new_tokens"] = int(T)  # arguments, with the response length resolved
        target = stale_target(
            model, task, **settings, tokenizer=tokenizer, eos_token_id=eos_token_id
        )
        return MismatchPair(
            target, Behaviour(model=model, name=self.name, strength=float(self.steps)), self
        )


@dataclass(frozen=True)
class Combined:
    """Generators applied in order: at most one that changes a network (staleness, weight
    noise, precision ``forward``) — it must come first — then logit transforms composed in
    order (``Combined((Temperature(0.7), TopP(0.9)))``: top-p of the tempered logits)."""

    parts: tuple = field(default_factory=tuple)
    name = "combined"

    def __post_init__(self):
        parts = tuple(self.parts)
        if len(parts) < 1:
            raise ValueError("Combined needs at least one generator")
        for part in parts:
            if not isinstance(part, _Generator):
                raise ValueError(f"Combined parts must be mismatch generators, got {part!r}")
        nets = [i for i, part in enumerate(parts) if part.changes_network]
        if len(nets) > 1 or (nets and nets[0] != 0):
            raise ValueError(
                "at most one generator that changes a network (staleness, weight_noise, "
                "precision with scope=forward) can be combined, and it must come first; got "
                + " + ".join(p.spec for p in parts)
            )
        object.__setattr__(self, "parts", parts)

    @property
    def spec(self) -> str:
        return "+".join(p.spec for p in self.parts)

    @property
    def strength(self) -> float:
        return self.parts[0].strength if len(self.parts) == 1 else math.nan

    def prepare(self, model, **kwargs) -> MismatchPair:
        first = self.parts[0]
        if first.changes_network:
            pair = first.prepare(model, **kwargs)
            target, net, rest = pair.target, pair.behaviour.model, self.parts[1:]
        else:
            target, net, rest = model, None, self.parts
        transforms = [t for t in (p.transform() for p in rest) if t is not None]

        def composed(z):
            for t in transforms:
                z = t(z)
            return z

        behaviour = Behaviour(
            model=net,
            transform=composed if transforms else None,
            name=self.spec if len(self.parts) > 1 else first.name,
            strength=self.strength,
        )
        return MismatchPair(target, behaviour, self)


# --- resolving a behaviour argument --------------------------------------------------------


def temperature_behaviour(tau: float) -> Behaviour:
    """μ = softmax(logits/τ) (sampling temperature τ > 0; τ = 1 is on-policy): the behaviour
    of :class:`simkit.lm.mismatch.Temperature`."""
    return Temperature(tau).prepare(None).behaviour


def resolve_behaviour(
    behaviour,
    model: torch.nn.Module,
    *,
    task=None,
    tokenizer=None,
    eos_token_id: int | None = None,
    max_new_tokens: int | None = None,
) -> tuple[torch.nn.Module, Behaviour]:
    """The pair (π's network, μ) a study runs on, from ``behaviour`` and the given ``model``.

    Accepts None (on-policy: μ = π = ``model``), a :class:`Behaviour` or a number (a
    temperature τ) — π is ``model`` —, a spec string of :func:`simkit.lm.mismatch.parse`
    (``"temperature:1.3"``, ``"staleness:4"``), a generator of :mod:`simkit.lm.mismatch`
    (anything with ``prepare(model, task=…, tokenizer=…, eos_token_id=…, max_new_tokens=…)``;
    a staleness generator *trains* π away from ``model``, which stays the behaviour), or an
    already prepared :class:`simkit.lm.mismatch.MismatchPair` (anything with ``target`` and
    ``behaviour``).
    """
    if isinstance(behaviour, str):
        behaviour = parse(behaviour)
    if behaviour is None or isinstance(behaviour, Behaviour):
        return model, behaviour if behaviour is not None else Behaviour()
    if isinstance(behaviour, int | float) and not isinstance(behaviour, bool):
        return model, temperature_behaviour(float(behaviour))
    if hasattr(behaviour, "prepare"):
        behaviour = behaviour.prepare(
            model,
            task=task,
            tokenizer=tokenizer,
            eos_token_id=eos_token_id,
            max_new_tokens=max_new_tokens,
        )
    prepared = getattr(behaviour, "behaviour", None)
    if hasattr(behaviour, "target") and isinstance(prepared, Behaviour):
        return behaviour.target, prepared
    raise TypeError(
        "behaviour must be None, a temperature (float), a simkit.lm.behaviour.Behaviour, a "
        "simkit.lm.mismatch generator or MismatchPair; got "
        f"{type(behaviour).__name__}"
    )


def prepare_pair(behaviour, model, task=None, tokenizer=None, eos_token_id=None, T=None):
    """(π's network, μ) for responses of ``T`` tokens to the prompts of ``task``: the
    :func:`resolve_behaviour` call every study makes (a staleness generator trains π on
    ``task``; ``tokenizer`` and ``eos_token_id`` as the responses are drawn)."""
    return resolve_behaviour(
        behaviour,
        model,
        task=task,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        max_new_tokens=T,
    )


def as_behaviour(behaviour, pi_model: torch.nn.Module | None = None) -> Behaviour:
    """μ alone, for behaviours that leave π = ``pi_model`` unchanged (:func:`resolve_behaviour`).

    Raises ``ValueError`` for a generator that changes π (staleness): use
    :func:`resolve_behaviour` and study the returned π.
    """
    target, mu = resolve_behaviour(behaviour, pi_model)
    if target is not pi_model:
        raise ValueError(
            f"behaviour {mu.name!r} changes the target policy π (not only μ); use "
            "resolve_behaviour(behaviour, model, task=...) and study the returned π"
        )
    return mu


# --- registry and parsing --------------------------------------------------------------------


def available() -> list[str]:
    """Names of the generators."""
    return list(GENERATORS)


def get(name: str, *args, **kwargs):
    """Generator ``name`` built with its knob (positional) and keyword fields."""
    try:
        cls = GENERATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown mismatch generator {name!r}; available: {', '.join(GENERATORS)}"
        ) from None
    return cls(*args, **kwargs)


def _convert(cls, key: str, text: str):
    typ = {f.name: f.type for f in fields(cls)}[key]
    typ = str(typ)
    try:
        if typ.startswith("int"):
            return None if text.lower() == "none" else int(text)
        if typ == "float":
            return float(text)
        if typ == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
    except ValueError:
        raise ValueError(f"{cls.name} {key}: cannot read {text!r} as {typ}") from None
    return text


def parse(spec: str):
    """A generator from its command-line form.

    ``name:value`` sets the generator's knob (``temperature:1.3``, ``top_p:0.9``,
    ``precision:bf16``, ``weight_noise:0.01``, ``staleness:4``); further fields follow as
    ``,key=value`` (``staleness:4,lr=0.001,optimizer=sgd``, ``precision:bf16,scope=forward``);
    ``+`` combines generators (``temperature:0.7+top_p:0.9``; :class:`Combined`).
    ``on_policy`` (or ``none``) is μ = π. Errors name the offending part and the valid choices.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a behaviour spec must be a non-empty string, got {spec!r}")
    parts = [s.strip() for s in spec.split("+")]
    if len(parts) == 1 and parts[0].lower() in ("on_policy", "none"):
        return None
    gens = []
    for part in parts:
        name, _, rest = part.partition(":")
        name = name.strip()
        if name not in GENERATORS:
            raise ValueError(
                f"unknown mismatch generator {name!r} in {spec!r}; available: "
                f"{', '.join(GENERATORS)} (or on_policy)"
            )
        cls = GENERATORS[name]
        kwargs = {}
        items = [s.strip() for s in rest.split(",")] if rest.strip() else []
        names = {f.name for f in fields(cls)}
        for i, item in enumerate(items):
            key, eq, value = item.partition("=")
            if not eq:
                if i != 0:
                    raise ValueError(f"{part!r}: only the first value may omit its key")
                key, value = cls.knob, item
            key = key.strip()
            if key not in names:
                raise ValueError(
                    f"{part!r}: {name} has no field {key!r}; fields: {', '.join(sorted(names))}"
                )
            kwargs[key] = _convert(cls, key, value.strip())
        gens.append(cls(**kwargs))
    return gens[0] if len(gens) == 1 else Combined(tuple(gens))


def coerce(behaviour):
    """A generator from a spec string (:func:`parse`); anything else is returned unchanged."""
    return parse(behaviour) if isinstance(behaviour, str) else behaviour


# --- measuring a mismatch --------------------------------------------------------------------


@dataclass(frozen=True)
class MismatchReport:
    """What :func:`measure` found: per-token divergences between π and μ over μ's visited states.

    ``chi2_tok``, ``kl_tok``, ``tv_tok``: exact over the vocabulary at each visited state,
    averaged over the valid response tokens of ``n`` responses from μ; ``profile``: per
    position t the same averages (``chi2_tok``, ``kl_tok``, ``tv_tok``, NaN where no response
    runs), ``running`` (fraction of responses still running) and ``tokens``; ``lengths`` (n,)
    the response lengths; ``behaviour``, ``strength``: μ's label.
    """

    behaviour: str
    strength: float
    chi2_tok: float
    kl_tok: float
    tv_tok: float
    profile: pd.DataFrame = field(repr=False)
    lengths: np.ndarray = field(repr=False)
    n: int = 0
    T: int = 0

    def as_row(self) -> dict:
        """One tidy row: behaviour, strength, n, T, the three divergences, mean length."""
        return {
            "behaviour": self.behaviour,
            "strength": self.strength,
            "n": self.n,
            "T": self.T,
            "chi2_tok": self.chi2_tok,
            "kl_tok": self.kl_tok,
            "tv_tok": self.tv_tok,
            "mean_length": float(np.mean(self.lengths)),
        }


def divergence_summary(divergences: dict, mask) -> tuple[dict[str, float], pd.DataFrame]:
    """Token-weighted means of per-position divergences over valid tokens, and their profile.

    ``divergences``: name → (N, T) arrays (``chi2``, ``kl``, ``tv``); ``mask`` (N, T) bool.
    Returns ({``chi2_tok``, ``kl_tok``, ``tv_tok``}, profile DataFrame as in
    :class:`MismatchReport`). An ``inf`` at a visited state makes the mean ``inf``.
    """
    m = np.asarray(mask, dtype=bool)
    if m.ndim != 2:
        raise ValueError(f"mask must have shape (N, T), got {m.shape}")
    count = m.sum(axis=0)
    total = max(int(count.sum()), 1)
    means, prof = {}, {"position": np.arange(m.shape[1])}
    for key in ("chi2", "kl", "tv"):
        d = np.asarray(divergences[key], dtype=np.float64)
        if d.shape != m.shape:
            raise ValueError(f"divergences[{key!r}] has shape {d.shape}, expected {m.shape}")
        per_pos = np.where(m, d, 0.0).sum(axis=0)
        means[f"{key}_tok"] = float(per_pos.sum() / total)
        with np.errstate(invalid="ignore", divide="ignore"):
            prof[f"{key}_tok"] = np.where(count > 0, per_pos / np.maximum(count, 1), np.nan)
    prof["running"] = count / m.shape[0]
    prof["tokens"] = count.astype(np.int64)
    return means, pd.DataFrame(prof)


def measure(
    model: torch.nn.Module,
    behaviour,
    task,
    *,
    tokenizer=None,
    n: int = 64,
    max_new_tokens: int = 16,
    eos_token_id: int | None = None,
    seed: int = 0,
    rows_per_call: int = 64,
) -> MismatchReport:
    """Per-token χ², KL, TV between π and μ over μ's visited states (module docstring).

    ``behaviour``: a generator, a spec string (:func:`parse`), a :class:`MismatchPair`, a
    :class:`~simkit.lm.behaviour.Behaviour` or None (prepared by
    :func:`resolve_behaviour`). ``n`` responses of ``max_new_tokens``
    tokens to prompts drawn uniformly from ``task``, sampled from μ with a generator seeded
    from ``seed``; ``rows_per_call`` responses per model call.
    """
    n = int_at_least(n, "n", 1)
    T = int_at_least(max_new_tokens, "max_new_tokens", 1)
    rows_per_call = int_at_least(rows_per_call, "rows_per_call", 1)
    behaviour = coerce(behaviour)
    pi, mu = prepare_pair(behaviour, model, task, tokenizer, eos_token_id, T)
    prompts = task.prompt_ids(tokenizer)
    ss_prompt, ss_sample = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(ss_prompt)
    device = next(pi.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(_seed_of(ss_sample))
    divs = {k: np.zeros((n, T)) for k in ("chi2", "kl", "tv")}
    mask = np.zeros((n, T), dtype=bool)
    for start in range(0, n, rows_per_call):
        k = min(rows_per_call, n - start)
        d = _draw(
            pi,
            mu,
            task=task,
            tokenizer=tokenizer,
            prompts=prompts,
            prompt_index=rng.integers(0, len(prompts), size=k),
            max_new_tokens=T,
            eos_token_id=eos_token_id,
            generator=gen,
            param_names=(),
            grad_method="vmap",
            chunk_size=None,
            with_scores=False,
        )
        mask[start : start + k] = d.mask
        for key in divs:
            divs[key][start : start + k] = d.divergences[key]
    means, profile = divergence_summary(divs, mask)
    return MismatchReport(
        behaviour=mu.name,
        strength=float(mu.strength),
        **means,
        profile=profile,
        lengths=mask.sum(axis=1),
        n=n,
        T=T,
    )
