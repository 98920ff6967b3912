"""Exact truth on a truncated LM: does the Monte Carlo study cover it, do the twins predict it?

The LM π (SmolLM2-135M-Instruct at full size) is truncated to its top-k tokens at every prefix
(π_k, renormalised) and every response of at most T tokens is enumerated, for several prompts
whose J(π_k) carries a signal (:func:`simkit.lm.exact.tree`): for each behaviour μ (restricted
to the same support) every per-sample mapping's exact mean and variance, the exact ∇J with
respect to θ (``params``) and the scale-free error ``rel_mse_scaled`` = min_α E‖αĝ − ∇J‖² /
‖∇J‖² (:func:`simkit.experiment.metrics.scale_free`; 1 = no better than ĝ ≡ 0), with the
oracle advantage R − J(μ) (:func:`simkit.lm.exact.exact_study`; batch-dependent mappings by
Monte Carlo over exact leaf draws). Against that truth, on the *same* truncated LM:

(a) the Monte Carlo gradient study (:func:`simkit.lm.topk.mc_study`: ``reps`` batches of n
    responses from μ_k, baseline a pilot estimate Ĵ(μ), against an on-policy REINFORCE
    reference of ``n_ref`` responses) — coverage: the share of rows whose 95% intervals of
    bias, variance and rel_mse_scaled contain the exact value of the *same* estimator (its
    advantage R − Ĵ(μ): the exact values are computed on the tree with that baseline), over
    all rows and over the rows the study flags ``reliable`` (:mod:`simkit.reliability`'s rule
    on the draws). The rows of one behaviour share their draws, so their misses are
    correlated;
(b) the distribution-matched twin (:mod:`simkit.lm.twin_dist`), fitted only from ``n_log``
    logged responses of μ_k (per-token log π, log μ, mask, reward: exact leaf draws), the
    χ²-profile token-MDP twin (:func:`simkit.lm.twin.simulation_twin`, given the exact
    per-position χ², length profile and J) and the trivial predictor (every mapping equal to
    naive) — Spearman ρ between each predictor's and the exact relative bias, relative
    variance (over naive) and rel_mse_scaled, with a 95% bootstrap interval, over the
    *distinct* mappings (naive excluded; mappings whose exact values agree to
    :data:`SIGNIFICANT` digits with an earlier one — e.g. equal default thresholds — counted
    once, :func:`distinct_mappings`) and within each family of at least 3 distinct mappings;
    and the median log10 error (the trivial predictor ranks nothing but has an error).

Ranks are taken of values rounded to :data:`SIGNIFICANT` significant digits, so rounding noise
of another machine (BLAS, thread count) cannot swap two mappings; ρ is printed with 2 digits.
A rank correlation computed from Monte Carlo values is *resolved* only when at least half of
the pairs of mappings have disjoint intervals; otherwise it is reported as unresolved. The
sentences of the notes that state results come from :func:`claims` (tested on made-up data).

Data (:class:`Data`): ``comparison`` (behaviour × estimator: ``exact_<key>``, ``mc_<key>``
with ``_lo``/``_hi``, ``twin_<key>`` with ``_lo``/``_hi``, ``old_<key>``, ``trivial_<key>``
for key in :data:`KEYS`; ``covers_<m>``, ``mc_exact_<m>`` for m in :data:`COVERAGE_METRICS`;
``mc_reliable``, ``truth_exact``, ``family``, ``duplicate_of``, ``exact_kept``,
``exact_kept_seq``), ``agreement`` (behaviour × scope × source × metric: ``rho``, ``lo``,
``hi``, ``k``, ``log_error``, ``resolved``), ``coverage`` (behaviour × metric: ``all``,
``k_all``, ``reliable``, ``k_reliable``), ``exact``, ``mc`` (full tables), ``meta`` (sizes,
J(π_k) per prompt, J(μ), χ² of each behaviour, D; the timings of the parts go to the
``simkit.figures.lm_vs_sim`` logger at INFO level, so that the data are identical from run to
run).

torch is imported inside :func:`compute` only.

This module is not split: the config, the comparison's pure functions (:func:`significant`,
:func:`distinct_mappings`, :func:`agreement_rows`, :func:`coverage_rows`, :func:`claims`),
:func:`compute` and :func:`draw` all read and write the one column layout of ``comparison``
documented above, and :mod:`simkit.figures._lm_vs_sim_mc` imports the shared study helpers
from here; the pure functions could move to their own module without changing that layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from simkit import experiment as _experiment
from simkit import mappings
from simkit.figures import _common, style

_log = logging.getLogger(__name__)

NAME = "lm_vs_sim"
TITLE = "Exact truth on a truncated LM: Monte Carlo coverage and twin predictions"
CAPTION = (
    "SmolLM2-135M-Instruct truncated to its top-2 tokens at every prefix, every response of "
    "≤ 10 tokens to 4 chat prompts enumerated (exact J, ∇J w.r.t. the final-norm weight, "
    "D = 576, and every per-sample mapping's exact mean, variance and scale-free error "
    "rel_mse_scaled = min_α E‖αĝ − ∇J‖²/‖∇J‖²; μ = temperature 1.3, a bf16 forward pass and a "
    "one-step-stale policy, each restricted to the same support, with its χ² in the title; "
    "oracle advantage R − J(μ), seq-mean-token-sum, n = 8). (a) Coverage of the Monte Carlo "
    "gradient study's 95% intervals of bias, variance and rel_mse_scaled on the same "
    "truncated LM, over all rows and the rows flagged reliable. (b–d) Relative bias and "
    "variance (over naive) and rel_mse_scaled predicted by the distribution-matched twin "
    "fitted from logged per-token log-probabilities, masks and rewards of μ's responses only "
    "(coloured; hollow: a duplicate of an earlier mapping), and by the χ²-profile token-MDP "
    "twin (grey), against the exact values; Spearman ρ over the distinct mappings in the "
    "panel titles, with bootstrap intervals, within-family ρ, the trivial predictor's (every "
    "mapping = naive) log error and the measured claims in the notes."
)

MODELS = ("tiny", "smollm2")
#: the relative metrics of :func:`relative_bounds` (over naive)
METRICS = ("bias", "variance", "mse")
#: what the twins are compared on: bias and variance relative to naive, and the scale-free
#: error rel_mse_scaled (absolute: it is already relative to doing nothing, ĝ ≡ 0)
KEYS = ("rel_bias", "rel_variance", "rel_mse_scaled")
LABELS = {
    "rel_bias": "bias / naive",
    "rel_variance": "variance / naive",
    "rel_mse_scaled": "scaled MSE / ‖∇J‖²",
}
#: the predictors compared with the exact values, and their column prefix in ``comparison``
SOURCES = ("twin", "old_twin", "trivial", "mc")
SOURCE_PREFIX = {"twin": "twin", "old_twin": "old", "trivial": "trivial", "mc": "mc"}
#: the Monte Carlo metrics whose interval coverage is measured
COVERAGE_METRICS = ("bias", "variance", "rel_mse_scaled")
#: significant digits of the values ranks are taken of (:func:`significant`)
SIGNIFICANT = 3
#: the range of J(π_k) where the reward carries a signal (issue 22)
J_RANGE = (0.2, 0.8)
#: relative values below this are drawn at it (unbiased mappings have relative bias 0)
FLOOR = 1e-3
#: the mappings of the small configurations (here and in ``_lm_vs_sim_mc``; the tests use them)
SMALL_MAPPINGS = (
    "naive",
    "is_token",
    "is_seq",
    "ppo_clip",
    "cispo",
    "tis_token",
    "tis_seq",
    "mis_seq",
    "gspo",
    "sapo",
    "vespo",
    "snis",
)
#: what the small configurations (here and in ``_lm_vs_sim_mc``) share: the tiny random Llama
#: on the token-presence task, fixed-length responses, :data:`SMALL_MAPPINGS`
SMALL_LM = {
    "model": "tiny",
    "task": "token",
    "stop_at_eos": False,
    "mapping_names": SMALL_MAPPINGS,
}


@dataclass(frozen=True)
class LMStudyConfig:
    """What every LM-vs-simulation configuration sets (this module's :class:`Config` and
    :class:`simkit.figures._lm_vs_sim_mc.Config`, checked by :func:`check_config`): the LM,
    its task, the behaviours, the mappings and the Monte Carlo gradient study's sizes.

    ``model``: ``"tiny"`` (:func:`simkit.lm.models.tiny_llama`, float64, ``tiny_init_std``,
    seed ``seed``) or ``"smollm2"`` (:func:`simkit.lm.models.load_smollm2`); ``task``: a
    :mod:`simkit.lm.tasks` name with ``task_kwargs`` (pairs); ``stop_at_eos``: responses end at
    the tokenizer's EOS (SmolLM2); ``behaviours``: :func:`simkit.lm.mismatch.parse` specs;
    ``mapping_names``: None for every mapping; ``aggregation``; ``params``: θ
    (:func:`simkit.lm.experiment.select_parameters`); ``T``: max response length; ``n``,
    ``reps``, ``n_ref``, ``n_pilot``: the study (:func:`study_sizes`); ``n_boot``: bootstrap
    resamples; ``device``; ``seed``.
    """

    model: str = "smollm2"
    tiny_init_std: float = 1.0
    task: str = "keyword"
    task_kwargs: tuple = (("n_prompts", 1), ("chat", False))
    stop_at_eos: bool = True
    behaviours: tuple[str, ...] = ("temperature:1.3", "temperature:0.8")
    mapping_names: tuple[str, ...] | None = None
    aggregation: str = "seq-mean-token-sum"
    params: str = "norm"
    T: int = 6
    n: int = 8
    reps: int = 16
    n_ref: int = 128
    n_pilot: int = 32
    n_boot: int = 200
    device: str = "cpu"
    seed: int = 0


@dataclass(frozen=True)
class Config(LMStudyConfig):
    """The LM study (:class:`LMStudyConfig`), the tree and the twins.

    ``prompts``: prompt indices (one tree each); ``target_auto``: the token task's target is
    the rank-2 token at the first prompt's root (tiny); ``k``, ``T``: the tree;
    ``exact_reps``: Monte Carlo batches of the batch-dependent mappings on the tree; ``reps``,
    ``n_ref``, ``n_pilot``: the MC study; ``n_log``: logged responses the twin is fitted from;
    ``twin_boot``: bootstrap refits of the twin; ``bins``, ``segments``: the twin's atoms;
    ``old_twin_V``, ``old_twin_reps``: the χ²-profile twin; ``batch_size``: tree rows per
    forward pass.
    """

    prompts: tuple[int, ...] = (0,)
    target_auto: bool = False
    k: int = 4
    exact_reps: int = 200
    n_log: int = 512
    twin_boot: int = 20
    bins: int = 4
    segments: int = 8
    old_twin_V: int = 4
    old_twin_reps: int = 200
    batch_size: int = 256

    def __post_init__(self):
        check_config(
            self,
            sizes=("k", "T", "n", "exact_reps", "reps", "n_ref", "n_pilot", "n_log", "twin_boot"),
            at_least_two=("reps", "n_ref", "exact_reps", "n_log"),
        )
        if not self.prompts:
            raise ValueError("prompts is empty: name at least one prompt index")


def check_config(cfg, sizes: tuple[str, ...], at_least_two: tuple[str, ...]) -> None:
    """The checks every LM-vs-simulation configuration shares (this module's :class:`Config`
    and :class:`simkit.figures._lm_vs_sim_mc.Config`): ``model`` in :data:`MODELS`, at least
    one behaviour, the fields named in ``sizes`` integers ≥ 1 (≥ 2 for those in
    ``at_least_two``), and ``mapping_names`` (None, or registered names including ``naive``)."""
    if cfg.model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {cfg.model!r}")
    if not cfg.behaviours:
        raise ValueError("behaviours is empty: name at least one mismatch generator spec")
    for key in sizes:
        value = getattr(cfg, key)
        low = 2 if key in at_least_two else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
    if cfg.mapping_names is not None:
        unknown = sorted(set(cfg.mapping_names) - set(mappings.available()))
        if unknown:
            raise ValueError(
                f"unknown mappings {unknown}; available: {', '.join(mappings.available())}"
            )
        if "naive" not in cfg.mapping_names:
            raise ValueError("mapping_names must include 'naive' (the normaliser)")


#: the behaviours of the full figure: a sampling temperature, an inference engine in bf16
#: (every matmul of μ's network in bfloat16) and a stale policy (π one Adam step on the final
#: norm ahead of μ, trained on 16 responses of μ)
FULL_BEHAVIOURS = (
    "temperature:1.3",
    "precision:bf16,scope=forward",
    "staleness:1,lr=0.02,batch_size=16,params=norm",
)


def config(small: bool = False) -> Config:
    """Full size: SmolLM2-135M-Instruct, the chat prompts 0, 2, 3, 6 of the keyword task
    (J(π_k) between 0.25 and 0.54 at k = 2, T = 10), k = 2, T ≤ 10 (EOS ends responses),
    :data:`FULL_BEHAVIOURS`, every mapping, oracle advantage R − J(μ). Small: the tiny random
    Llama, a token-presence task, k = 3, T = 4 (seconds; the tests use it)."""
    if small:
        return Config(
            **SMALL_LM,
            task_kwargs=(("vocab_size", 64), ("n_prompts", 1)),
            target_auto=True,
            k=3,
            T=4,
            behaviours=("temperature:1.5",),
            exact_reps=100,
            reps=40,
            n_ref=300,
            n_pilot=100,
            n_log=256,
            twin_boot=10,
            old_twin_reps=100,
            n_boot=100,
        )
    return Config(
        task_kwargs=(("n_prompts", 8), ("chat", True)),
        prompts=(0, 2, 3, 6),
        k=2,
        T=10,
        behaviours=FULL_BEHAVIOURS,
        reps=40,
        n_ref=256,
        n_pilot=64,
        n_log=512,
    )


@dataclass(frozen=True)
class Data:
    comparison: pd.DataFrame
    agreement: pd.DataFrame
    coverage: pd.DataFrame
    exact: pd.DataFrame
    mc: pd.DataFrame
    meta: dict = field(default_factory=dict)


def load(cfg, default_target: int | None = 0):
    """(model, tokenizer, task, eos_token_id) of the configuration ``cfg`` (this module's
    :class:`Config` or :class:`simkit.figures._lm_vs_sim_mc.Config`): the float64 tiny Llama
    or float32 SmolLM2 on ``cfg.device``. The token task's target is ``default_target`` unless
    ``cfg.task_kwargs`` names one (None: the task's own default), or the rank-2 token at the
    first prompt's root when ``cfg.target_auto``."""
    import torch

    from simkit.lm import models, tasks

    if cfg.model == "tiny":
        model = models.tiny_llama(dtype=torch.float64, init_std=cfg.tiny_init_std, seed=cfg.seed)
        tokenizer = None
    else:
        model, tokenizer = models.load_smollm2(dtype=torch.float32)
    model = model.to(cfg.device).eval()
    kwargs = dict(cfg.task_kwargs)
    if cfg.task == "token":
        kwargs.setdefault("vocab_size", int(model.config.vocab_size))
        if default_target is not None:
            kwargs.setdefault("target", default_target)
    task = tasks.get_task(cfg.task, **kwargs)
    if getattr(cfg, "target_auto", False):
        from simkit.lm.exact import auto_target

        target = auto_target(model, [task.prompt_ids(tokenizer)[cfg.prompts[0]]], cfg.k)
        task = tasks.get_task(cfg.task, **{**kwargs, "target": target})
    eos = None
    if cfg.stop_at_eos:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("stop_at_eos needs a tokenizer with an eos_token_id (use smollm2)")
    return model, tokenizer, task, eos


def study_sizes(cfg: LMStudyConfig) -> dict:
    """The Monte Carlo gradient study's settings of a configuration, as the keyword arguments
    of :func:`simkit.lm.study.gradient_study` and :func:`simkit.lm.topk.mc_study`: ``params``,
    ``n``, ``reps``, ``n_ref``, ``n_pilot``, ``max_new_tokens`` (= ``T``), ``n_boot``."""
    return {
        "params": cfg.params,
        "n": cfg.n,
        "reps": cfg.reps,
        "n_ref": cfg.n_ref,
        "n_pilot": cfg.n_pilot,
        "max_new_tokens": cfg.T,
        "n_boot": cfg.n_boot,
    }


def behaviour_pair(cfg: LMStudyConfig, spec: str, model, task, tokenizer, eos):
    """The (π, μ) pair of behaviour ``spec`` (:func:`simkit.lm.mismatch.parse`) prepared on
    ``model`` for ``task``, responses of at most ``cfg.T`` tokens ending at ``eos``."""
    from simkit.lm import mismatch

    generator = mismatch.parse(spec)
    return generator.prepare(
        model, task=task, tokenizer=tokenizer, eos_token_id=eos, max_new_tokens=cfg.T
    )


def estimators(cfg: Config, advantage: str = "oracle"):
    """One estimator per mapping: ``cfg.aggregation``, advantage ``oracle`` (R − J(μ): the
    exact J(μ_k) on the tree, the pilot estimate of J(μ) in the Monte Carlo study)."""
    from simkit.estimators import Estimator

    names = _common.chosen_mappings(cfg.mapping_names)
    return [Estimator(m, aggregation=cfg.aggregation, advantage=advantage, name=m) for m in names]


def resolved(lo, hi) -> bool:
    """True iff at least half of the pairs of intervals [lo_i, hi_i] are disjoint."""
    lo, hi = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
    ok = np.isfinite(lo) & np.isfinite(hi)
    lo, hi = lo[ok], hi[ok]
    k = lo.size
    if k < 3:
        return False
    i, j = np.triu_indices(k, 1)
    disjoint = (hi[i] < lo[j]) | (hi[j] < lo[i])
    return bool(disjoint.mean() >= 0.5)


def relative_bounds(
    table: pd.DataFrame, reference: str = "naive", metrics: tuple[str, ...] = METRICS
) -> pd.DataFrame:
    """``rel_<m>_lo``/``_hi`` = the row's ``<m>_lo``/``<m>_hi`` over the reference mapping's
    point value ``<m>`` (NaN when that is not positive), one row per estimator, for m in
    ``metrics`` (in that order)."""
    base = table[table["mapping"] == reference].iloc[0]
    out = table[["estimator"]].copy()
    for key in metrics:
        denom = float(base[key])
        for side in ("lo", "hi"):
            col = f"{key}_{side}"
            out[f"rel_{col}"] = table[col] / denom if denom > 0 else math.nan
    return out


def _old_twin(cfg, ex, ests):
    """The χ²-profile twin given the tree's exact per-position χ², μ's length profile and J."""
    from simkit.lm import twin

    env = ex.env
    depth = np.concatenate([t.node_depth for t in ex.trees])
    w = env.node_weight_mu
    chi2 = env.node_divergences["chi2"]
    T = cfg.T
    reach = np.array([w[depth == t].sum() for t in range(T)])
    prof = np.array(
        [w[depth == t] @ chi2[depth == t] / reach[t] if reach[t] > 0 else np.nan for t in range(T)]
    )
    # sums of μ's node weights: rounding can leave them above 1 or increasing by ~1e-16
    running = np.minimum.accumulate(np.clip(reach / reach[0], 0.0, 1.0))
    eos = cfg.stop_at_eos and not env.fixed_length
    prof_fit = np.where(np.isfinite(prof), prof, 0.0)
    tw, mu = twin.simulation_twin(
        prof_fit, ex.J, V=cfg.old_twin_V, running=running if eos else None
    )
    table = twin.predict(tw, mu, ests, n=cfg.n, reps=cfg.old_twin_reps, seed=cfg.seed, n_boot=50)
    return table, prof, running


# --- the comparison: pure functions of the tables (tested on made-up data) -------------------


def significant(x, digits: int = SIGNIFICANT):
    """``x`` rounded to ``digits`` significant digits (NaN and 0 unchanged): the values ranks
    are taken of, so that rounding noise below the printed precision (another BLAS, another
    thread count) cannot swap two mappings."""
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    ok = np.isfinite(x) & (x != 0)
    mag = np.floor(np.log10(np.abs(x[ok])))
    scale = 10.0 ** (digits - 1 - mag)
    out[ok] = np.round(x[ok] * scale) / scale
    return out


def distinct_mappings(cmp: pd.DataFrame, keys=KEYS) -> pd.Series:
    """For each row of ``cmp`` (one behaviour: ``mapping`` and ``exact_<key>`` columns), the
    first mapping (in row order) whose exact values of every key agree with it to
    :data:`SIGNIFICANT` significant digits: itself when the row is distinct, else the mapping
    it duplicates (e.g. two mappings whose default thresholds coincide). A rank correlation
    over duplicates counts one ordering several times."""
    seen: dict[tuple, str] = {}
    out = []
    for _, row in cmp.iterrows():
        key = tuple(float(significant([row[f"exact_{k}"]])[0]) for k in keys)
        key = tuple("nan" if math.isnan(v) else v for v in key)
        out.append(seen.setdefault(key, row["mapping"]))
    return pd.Series(out, index=cmp.index, name="duplicate_of")


def log_error(exact, predicted) -> float:
    """Median over pairs of |log10(predicted / exact)|, both floored at :data:`FLOOR` (NaN
    pairs dropped): how far a predictor is from the truth, in decades. A constant predictor
    has no ranking (ρ undefined) but has a log error."""
    x = np.maximum(np.asarray(exact, dtype=np.float64), FLOOR)
    y = np.maximum(np.asarray(predicted, dtype=np.float64), FLOOR)
    ok = np.isfinite(x) & np.isfinite(y)
    if not ok.any():
        return math.nan
    return float(np.median(np.abs(np.log10(y[ok] / x[ok]))))


def agreement_rows(cmp: pd.DataFrame, behaviour: str, seed: int = 0, n_boot: int = 1000):
    """The rank agreement of every source with the exact values, for one behaviour.

    ``cmp``: one row per mapping with ``mapping``, ``family``, ``duplicate_of``,
    ``exact_<key>``, ``twin_<key>``, ``old_<key>``, ``trivial_<key>``, ``mc_<key>`` (and
    ``mc_<key>_lo``/``_hi``) for every key of :data:`KEYS`. Naive (the normaliser) and the
    duplicates are dropped; ``scope`` ``"all"`` ranks every distinct mapping, a family name
    the distinct mappings of that family (families with at least 3). Per row: Spearman ``rho``
    [``lo``, ``hi``] (percentile bootstrap over mappings, seed ``seed``; computed on
    :func:`significant` values), ``k`` mappings, ``log_error`` (:func:`log_error`) and
    ``resolved`` (Monte Carlo only: :func:`resolved`; True for predictions)."""
    from simkit.lm import twin

    keep = (cmp.mapping != "naive") & (cmp.duplicate_of == cmp.mapping)
    base = cmp[keep]
    scopes = [("all", base)]
    for fam, part in base.groupby("family", sort=True):
        if len(part) >= 3:
            scopes.append((fam, part))
    rows = []
    for scope, part in scopes:
        for key in KEYS:
            truth = significant(part[f"exact_{key}"])
            for source in SOURCES:
                pred = part[f"{SOURCE_PREFIX[source]}_{key}"].to_numpy(dtype=np.float64)
                if np.nanstd(pred) == 0:  # a constant predictor ranks nothing
                    rho = lo = hi = math.nan
                    k = int(np.isfinite(pred).sum())
                else:
                    rho, lo, hi, k = twin.rank_agreement(
                        truth, significant(pred), n_boot=n_boot, seed=seed
                    )
                res = True
                if source == "mc":
                    res = resolved(part[f"mc_{key}_lo"], part[f"mc_{key}_hi"])
                rows.append(
                    {
                        "behaviour": behaviour,
                        "scope": scope,
                        "source": source,
                        "metric": key,
                        "rho": rho,
                        "lo": lo,
                        "hi": hi,
                        "k": k,
                        "log_error": log_error(part[f"exact_{key}"], pred),
                        "resolved": res,
                    }
                )
    return rows


def coverage_rows(cmp: pd.DataFrame, behaviour: str) -> list[dict]:
    """Coverage of the Monte Carlo intervals, for one behaviour: per metric of
    :data:`COVERAGE_METRICS`, the share of rows whose interval contains the exact value of the
    same estimator (``covers_<m>``; rows whose truth is exact only), over all rows (``all``,
    ``k_all``) and over the rows flagged ``reliable`` (``reliable``, ``k_reliable``)."""
    rows = []
    exact_rows = cmp[cmp.truth_exact]
    for key in COVERAGE_METRICS:
        hit = exact_rows[f"covers_{key}"].astype(bool)
        rel = hit[exact_rows.mc_reliable.astype(bool)]
        rows.append(
            {
                "behaviour": behaviour,
                "metric": key,
                "all": float(hit.mean()) if len(hit) else math.nan,
                "k_all": len(hit),
                "reliable": float(rel.mean()) if len(rel) else math.nan,
                "k_reliable": len(rel),
            }
        )
    return rows


def coverage_verdict(share: float, k: int, level: float = 0.95) -> str:
    """``"consistent with"`` the nominal ``level`` when ``share`` is within two binomial
    standard errors √(level(1 − level)/k) of it, ``"below"`` or ``"above"`` otherwise;
    ``"untested"`` when k < 5."""
    if k < 5 or not math.isfinite(share):
        return "untested"
    se = math.sqrt(level * (1.0 - level) / k)
    if share < level - 2.0 * se:
        return "below"
    if share > level + 2.0 * se:
        return "above"
    return "consistent with"


def claims(data) -> list[str]:
    """The sentences of the notes that state measured results, built from ``data`` alone
    (``meta``, ``coverage``, ``agreement``): the prompts' J(π_k) against [0.2, 0.8]; the Monte
    Carlo coverage (all rows and reliable rows) against the nominal 95%; whether the twin ranks
    the distinct mappings better than the χ²-profile twin and has a smaller log error than the
    trivial predictor, per metric, counted over behaviours. ``tests/test_lm_vs_sim.py`` feeds
    made-up data to check that each sentence follows it."""
    meta = data.meta
    out = []
    J = [float(x) for x in meta.get("J_prompts", [])]
    if J:
        low, high = J_RANGE
        inside = [low <= x <= high for x in J]
        span = f"J(π_k) per prompt {min(J):.2f}–{max(J):.2f}"
        if all(inside):
            out.append(f"{span}: every prompt inside [{low}, {high}].")
        else:
            out.append(
                f"{span}: {len(J) - sum(inside)} of {len(J)} prompts outside [{low}, {high}] "
                "(their rewards are nearly constant)."
            )
    cov = data.coverage
    for key in COVERAGE_METRICS:
        part = cov[cov.metric == key]
        if part.empty:
            continue
        k_all, k_rel = int(part.k_all.sum()), int(part.k_reliable.sum())
        share_all = float((part["all"] * part.k_all).sum() / k_all) if k_all else math.nan
        share_rel = (
            float((part.reliable.fillna(0) * part.k_reliable).sum() / k_rel) if k_rel else math.nan
        )
        out.append(
            f"MC 95% intervals of {key} cover the exact value in {share_all:.0%} of {k_all} "
            f"rows ({coverage_verdict(share_all, k_all)} 95%) and {share_rel:.0%} of the "
            f"{k_rel} reliable rows ({coverage_verdict(share_rel, k_rel)} 95%; the rows of a "
            "behaviour share their draws, so their misses are correlated)."
            if k_rel
            else f"MC 95% intervals of {key} cover the exact value in {share_all:.0%} of "
            f"{k_all} rows ({coverage_verdict(share_all, k_all)} 95%); no row is reliable."
        )
    ag = data.agreement[data.agreement.scope == "all"]
    behaviours = list(dict.fromkeys(ag.behaviour))
    for key in KEYS:
        a = ag[ag.metric == key].set_index(["behaviour", "source"])
        better_rho = sum(
            bool(a.loc[(b, "twin"), "rho"] > a.loc[(b, "old_twin"), "rho"]) for b in behaviours
        )
        better_err = sum(
            bool(a.loc[(b, "twin"), "log_error"] < a.loc[(b, "trivial"), "log_error"])
            for b in behaviours
        )
        out.append(
            f"{LABELS[key]}: the twin ranks the distinct mappings better than the χ²-profile "
            f"twin (higher ρ) for {better_rho} of {len(behaviours)} behaviours and is closer "
            f"than the trivial predictor (every mapping = naive; smaller median log error) for "
            f"{better_err} of {len(behaviours)}."
        )
    return out


def compute(cfg: Config) -> Data:
    from simkit.lm import exact, topk, twin_dist
    from simkit.lm.scale_free import with_scale_free
    from simkit.lm.study import model_fingerprint

    t_start, cpu_start = time.perf_counter(), time.process_time()
    model, tokenizer, task, eos = load(cfg)
    ests = estimators(cfg)
    rows, agreements, coverage, exact_tables, mc_tables = [], [], [], [], []
    meta = {"model": cfg.model, "task": cfg.task, "k": cfg.k, "T": cfg.T, "n": cfg.n}
    references: dict[str, object] = {}
    timings = {"exact": 0.0, "mc": 0.0, "twin": 0.0, "old_twin": 0.0}
    J_prompts = None
    for i, spec in enumerate(cfg.behaviours):
        pair = behaviour_pair(cfg, spec, model, task, tokenizer, eos)
        t0 = time.perf_counter()
        ex = exact.exact_study(
            model,
            task,
            pair,
            ests,
            k=cfg.k,
            T=cfg.T,
            n=cfg.n,
            params=cfg.params,
            tokenizer=tokenizer,
            eos_token_id=eos,
            prompts=list(cfg.prompts),
            reps=cfg.exact_reps,
            seed=cfg.seed + i,
            batch_size=cfg.batch_size,
            progress=False,
        )
        if J_prompts is None:  # the prompts' J(π_k) of the first behaviour's π
            J_prompts = [float(t.env().J()) for t in ex.trees]
        timings["exact"] += time.perf_counter() - t0
        truth = twin_dist.relative(ex.table)
        ext = ex.table.set_index("estimator")
        # (a) the Monte Carlo study on the same truncated LM (a reference ∇̂J per π)
        t0 = time.perf_counter()
        prompt_task = _PromptSubset(task, cfg.prompts)
        fingerprint = model_fingerprint(topk.TopK(pair.target, cfg.k))
        mc = topk.mc_study(
            pair.target,
            prompt_task,
            ests,
            cfg.k,
            behaviour=pair.behaviour,
            tokenizer=tokenizer,
            eos_token_id=eos,
            seed=cfg.seed + 100 + i,
            grad_method="head",
            **study_sizes(cfg),
            reference=references.get(fingerprint),
            progress=False,
        )
        references.setdefault(mc.fingerprint, mc)
        timings["mc"] += time.perf_counter() - t0
        mc_t = mc.table
        mc_rel = twin_dist.relative(mc_t)
        # the MC study's oracle advantage is R − Ĵ(μ) with Ĵ(μ) its pilot estimate: its exact
        # values on the tree are those of the raw advantage on rewards R − Ĵ(μ) (∇J unchanged)
        shifted = dataclasses.replace(ex.env, rewards=ex.env.rewards - mc.J_mu)
        raw = estimators(cfg, advantage="raw")
        mc_truth = _experiment.run(
            shifted,
            "mu",
            raw,
            n=cfg.n,
            reps=cfg.exact_reps,
            seed=cfg.seed + i,
            n_boot=50,
            progress=False,
        )
        mc_truth = with_scale_free(mc_truth, shifted, "mu", raw, cfg.n).set_index("estimator")
        mc_bounds = relative_bounds(mc_t)
        # (b) the distribution-matched twin from logged responses of μ_k
        t0 = time.perf_counter()
        rng = np.random.default_rng(cfg.seed + 200 + i)
        draw = ex.env.sample("mu", cfg.n_log, rng)
        logs = twin_dist.Rollouts(
            ex.env.log_pi_tok[draw.leaves], ex.env.log_mu_tok[draw.leaves], draw.mask, draw.rewards
        )
        tw = twin_dist.predict_with_intervals(
            logs,
            ests,
            cfg.n,
            n_boot=cfg.twin_boot,
            reps=100,
            seed=cfg.seed,
            bins=cfg.bins,
            segments=cfg.segments,
        )
        timings["twin"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        old, chi2_prof, running = _old_twin(cfg, ex, ests)
        old_rel = twin_dist.relative(old)
        timings["old_twin"] += time.perf_counter() - t0
        cmp = pd.DataFrame(
            {"behaviour": spec, "estimator": truth.estimator, "mapping": truth.mapping}
        )
        cmp["family"] = [style.family(m) for m in cmp.mapping]
        mt = mc_t.set_index("estimator")
        names = list(cmp.estimator)
        cmp["truth_exact"] = [bool(mc_truth.loc[e, "exact"]) for e in names]
        cmp["mc_reliable"] = [bool(mt.loc[e, "reliable"]) for e in names]
        cmp["mc_tail_draws"] = [float(mt.loc[e, "tail_draws"]) for e in names]
        for key in COVERAGE_METRICS:
            cmp[f"covers_{key}"] = [
                bool(mt.loc[e, f"{key}_lo"] <= mc_truth.loc[e, key] <= mt.loc[e, f"{key}_hi"])
                for e in names
            ]
            cmp[f"mc_exact_{key}"] = [float(mc_truth.loc[e, key]) for e in names]
        old_t = old.set_index("estimator")
        naive = cmp.mapping == "naive"
        for key in KEYS:
            if key == "rel_mse_scaled":
                cmp[f"exact_{key}"] = [float(ext.loc[e, key]) for e in names]
                cmp[f"mc_{key}"] = mt.loc[names, key].to_numpy(dtype=float)
                for side in ("lo", "hi"):
                    cmp[f"mc_{key}_{side}"] = mt.loc[names, f"{key}_{side}"].to_numpy(dtype=float)
                cmp[f"old_{key}"] = old_t.loc[names, key].to_numpy(dtype=float)
                trivial = float(cmp.loc[naive, f"exact_{key}"].iloc[0])
            else:
                cmp[f"exact_{key}"] = truth[key].to_numpy()
                cmp[f"mc_{key}"] = mc_rel[key].to_numpy()
                for side in ("lo", "hi"):
                    cmp[f"mc_{key}_{side}"] = mc_bounds[f"{key}_{side}"].to_numpy()
                cmp[f"old_{key}"] = old_rel[key].to_numpy()
                trivial = 1.0
            cmp[f"twin_{key}"] = tw[key].to_numpy(dtype=float)
            cmp[f"twin_{key}_lo"] = tw[f"{key}_lo"].to_numpy(dtype=float)
            cmp[f"twin_{key}_hi"] = tw[f"{key}_hi"].to_numpy(dtype=float)
            cmp[f"trivial_{key}"] = trivial
        cmp["exact_kept"] = [float(ext.loc[e, "kept"]) for e in names]
        cmp["exact_kept_seq"] = [float(ext.loc[e, "kept_seq"]) for e in names]
        cmp["duplicate_of"] = distinct_mappings(cmp)
        agreements += agreement_rows(cmp, spec, seed=cfg.seed)
        coverage += coverage_rows(cmp, spec)
        rows.append(cmp)
        exact_tables.append(ex.table.assign(behaviour=spec))
        mc_tables.append(mc_t.assign(behaviour=spec))
        row0 = ex.table.iloc[0]
        meta[spec] = {
            "J": ex.J,
            "J_mu": float(ex.env.J("mu")),
            "J_mc": mc.J,
            "J_mc_se": mc.J_se,
            "J_mu_mc": mc.J_mu,
            "J_mu_mc_se": mc.J_mu_se,
            "D": ex.env.D,
            "grad_norm": float(np.linalg.norm(ex.grad_J)),
            "leaves": int(sum(t.n_leaves for t in ex.trees)),
            "nodes": int(sum(t.n_nodes for t in ex.trees)),
            "chi2_tok": float(row0.chi2_tok),
            "chi2_seq": float(row0.chi2_seq),
            "kl_tok": float(row0.kl_tok),
            "chi2_profile": [float(x) for x in chi2_prof],
            "running": [float(x) for x in running],
            "n_ref": int(mc.reference_samples.shape[0]),
        }
    meta["params"] = cfg.params
    meta["n_log"] = cfg.n_log
    meta["reps"] = cfg.reps
    meta["prompts"] = [int(p) for p in cfg.prompts]
    meta["J_prompts"] = J_prompts
    # the timings go to the log, not into the data: the data (and its hash in the manifest)
    # must be the same from run to run
    _log.info(
        "lm_vs_sim: %s; total %.1f s wall, %.1f s CPU",
        ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()),
        time.perf_counter() - t_start,
        time.process_time() - cpu_start,
    )
    return Data(
        comparison=pd.concat(rows, ignore_index=True),
        agreement=pd.DataFrame(agreements),
        coverage=pd.DataFrame(coverage),
        exact=pd.concat(exact_tables, ignore_index=True),
        mc=pd.concat(mc_tables, ignore_index=True),
        meta=meta,
    )


class _PromptSubset:
    """A task restricted to some of its prompts (for the MC study on the tree's prompts)."""

    def __init__(self, task, indices):
        self.task = task
        self.indices = [int(i) for i in indices]
        self.name = getattr(task, "name", "task")

    def prompt_ids(self, tokenizer=None):
        ids = self.task.prompt_ids(tokenizer)
        return [ids[i] for i in self.indices]

    def rewards(self, prompt_index, response_ids, response_mask, tokenizer=None):
        mapped = np.asarray([self.indices[int(i)] for i in np.asarray(prompt_index)], dtype=int)
        return self.task.rewards(mapped, response_ids, response_mask, tokenizer)


#: one marker per behaviour (in the order of ``Config.behaviours``), and its glyph for notes
MARKERS = ("o", "s", "^", "D", "v")
MARKER_GLYPHS = ("○", "□", "△", "◇", "▽")


def agreement_text(data: Data, source: str, metric: str, scope: str = "all") -> str:
    """``behaviour ρ = x [lo, hi] (k)`` per behaviour (``unresolved`` where so; ``no ranking``
    for a constant predictor), for the notes."""
    ag = data.agreement
    part = ag[(ag.source == source) & (ag.metric == metric) & (ag.scope == scope)]
    out = []
    for r in part.itertuples():
        if not math.isfinite(r.rho):
            out.append(f"{r.behaviour}: no ranking (k = {r.k})")
            continue
        tag = "" if r.resolved else " (unresolved)"
        out.append(f"{r.behaviour} ρ = {r.rho:.2f} [{r.lo:.2f}, {r.hi:.2f}] (k = {r.k}){tag}")
    return "; ".join(out)


def log_error_text(data: Data, metric: str) -> str:
    """Median log errors (decades) of the twin, the χ²-profile twin and the trivial predictor
    per behaviour, for the notes."""
    ag = data.agreement
    part = ag[(ag.metric == metric) & (ag.scope == "all")]
    out = []
    for b in dict.fromkeys(part.behaviour):
        p = part[part.behaviour == b].set_index("source").log_error
        out.append(
            f"{b}: twin {p['twin']:.2f}, χ²-profile {p['old_twin']:.2f}, trivial {p['trivial']:.2f}"
        )
    return "; ".join(out)


def family_text(data: Data, metric: str) -> str:
    """The twin's ρ within each family of at least 3 distinct mappings, for the notes."""
    ag = data.agreement
    part = ag[(ag.metric == metric) & (ag.scope != "all") & (ag.source == "twin")]
    if part.empty:
        return "no family has 3 distinct mappings"
    return "; ".join(
        f"{r.behaviour} {r.scope} ρ = {r.rho:.2f} (k = {r.k})"
        if math.isfinite(r.rho)
        else f"{r.behaviour} {r.scope}: no ranking"
        for r in part.itertuples()
    )


def scatter_relative(ax, x, y, lo=None, hi=None, color="k", marker="o", hollow=False, label=None):
    """One point (x, y) of relative values on log axes, both drawn at :data:`FLOOR` or above,
    with a vertical bar from ``lo`` to ``hi`` where both are finite; ``hollow``: white face.
    Returns ``[x, y]`` as drawn (floored), for :func:`log_diagonal`."""
    x, y = max(x, FLOOR), max(y, FLOOR)
    yerr = None
    if lo is not None and np.isfinite(lo) and np.isfinite(hi):
        yerr = [[max(y - max(lo, FLOOR), 0.0)], [max(hi - y, 0.0)]]
    ax.errorbar(
        x,
        y,
        yerr=yerr,
        color=color,
        marker=marker,
        markersize=4,
        linewidth=0.6,
        markerfacecolor="white" if hollow else color,
        label=label,
    )
    return [x, y]


def log_diagonal(ax, values, unit_lines: bool = False) -> None:
    """The dashed diagonal y = x over the range of ``values`` (widened 1.5× each way; none
    when empty), grey lines at x = 1 and y = 1 when ``unit_lines`` (and ``values``), then
    log scales on both axes."""
    if values:
        lo_v, hi_v = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo_v, hi_v], [lo_v, hi_v], color="0.5", linewidth=0.8, linestyle="--")
        if unit_lines:
            ax.axhline(1.0, color="0.75", linewidth=0.5)
            ax.axvline(1.0, color="0.75", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")


def mapping_legend(fig, ax) -> None:
    """The figure legend of the mappings drawn in ``ax``, outside on the right."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside right center", fontsize=6, title="mapping", title_fontsize=7
    )


def behaviour_marks(behaviours) -> str:
    """``○ spec, □ spec, …``: which marker stands for which behaviour (for the suptitle)."""
    return ", ".join(f"{m} {s}" for m, s in zip(MARKER_GLYPHS, behaviours, strict=False))


def draw(data: Data):
    fig = _common.new_figure(13.5, 4.6)
    axes = fig.subplots(1, 4)
    cmp = data.comparison
    behaviours = list(dict.fromkeys(cmp.behaviour))
    # (a) coverage of the MC intervals: all rows (hollow) and reliable rows (filled)
    ax = axes[0]
    cov = data.coverage
    width = 0.8 / max(len(behaviours), 1)
    for b, spec in enumerate(behaviours):
        part = cov[cov.behaviour == spec].set_index("metric")
        x = np.arange(len(COVERAGE_METRICS)) + (b - (len(behaviours) - 1) / 2) * width
        vals_all = [part.loc[m, "all"] for m in COVERAGE_METRICS]
        vals_rel = [part.loc[m, "reliable"] for m in COVERAGE_METRICS]
        color = f"C{b}"
        ax.bar(x, vals_all, width * 0.9, facecolor="white", edgecolor=color, linewidth=0.8)
        ax.bar(x, np.nan_to_num(vals_rel), width * 0.45, color=color, label=spec)
        for xi, m in zip(x, COVERAGE_METRICS, strict=True):
            ax.text(
                xi,
                1.02,
                f"{part.loc[m, 'k_reliable']}/{part.loc[m, 'k_all']}",
                fontsize=4,
                ha="center",
                rotation=90,
            )
    ax.axhline(0.95, color="0.3", linewidth=0.7, linestyle="--")
    ax.set_xticks(np.arange(len(COVERAGE_METRICS)), [m.replace("_", " ") for m in COVERAGE_METRICS])
    ax.set_ylim(0, 1.2)
    ax.set_ylabel("share of MC 95% intervals covering the exact value")
    ax.set_title("MC coverage of exact values\noutline: all rows; filled: reliable", fontsize=7)
    ax.legend(fontsize=5, loc="lower left")
    # (b–d) twins vs exact over the distinct mappings
    for ax, key in zip(axes[1:], KEYS, strict=True):
        values = []
        for b, spec in enumerate(behaviours):
            part = cmp[(cmp.behaviour == spec) & (cmp.mapping != "naive")]
            marker = MARKERS[b % len(MARKERS)]
            for row in part.itertuples():
                dup = row.duplicate_of != row.mapping
                x = getattr(row, f"exact_{key}")
                values += scatter_relative(
                    ax, x, getattr(row, f"old_{key}"), color="0.65", marker=marker
                )
                values += scatter_relative(
                    ax,
                    x,
                    getattr(row, f"twin_{key}"),
                    getattr(row, f"twin_{key}_lo"),
                    getattr(row, f"twin_{key}_hi"),
                    color=style.color(row.mapping),
                    marker=marker,
                    hollow=dup,
                    label=row.mapping if b == 0 else None,
                )
        log_diagonal(ax, values, unit_lines=key == "rel_mse_scaled")
        ax.set_xlabel(f"exact {LABELS[key]} (tree)")
        ax.set_ylabel(f"predicted {LABELS[key]}")
        ag = data.agreement[(data.agreement.metric == key) & (data.agreement.scope == "all")]

        def rhos(source, ag=ag):
            r = ag[ag.source == source]
            return ", ".join(f"{v:.2f}" if math.isfinite(v) else "n/a" for v in r.rho)

        k = int(ag[ag.source == "twin"].k.max()) if len(ag) else 0
        ax.set_title(
            f"{LABELS[key]}, k = {k} distinct\ntwin ρ = {rhos('twin')}; "
            f"χ²-prof. ρ = {rhos('old_twin')}",
            fontsize=7,
        )
    for letter, ax in zip("abcd", axes, strict=True):
        _common.panel_label(ax, letter)
    mapping_legend(fig, axes[1])
    meta = data.meta
    first = meta[behaviours[0]]
    marks = behaviour_marks(
        [
            f"{b} (χ²_tok {meta[b]['chi2_tok']:.2g}, χ²_seq {meta[b]['chi2_seq']:.2g})"
            for b in behaviours
        ]
    )
    J = meta.get("J_prompts") or [first["J"]]
    fig.suptitle(
        f"{meta['model']} truncated to top-{meta['k']}, T ≤ {meta['T']}, {len(J)} prompts "
        f"(J(π_k) {min(J):.2f}–{max(J):.2f}; {first['leaves']} leaves), θ = {meta['params']} "
        f"(D = {first['D']}), advantage R − J(μ), n = {meta['n']}; MC study: {meta['reps']} "
        f"batches, n_ref = {first['n_ref']}; twin from {meta['n_log']} logged responses\n"
        f"markers: {marks}",
        fontsize=8,
    )
    notes = list(claims(data))
    notes += [
        "Spearman ρ vs exact over the distinct mappings (naive and duplicates excluded; values "
        f"rounded to {SIGNIFICANT} significant digits) [95% bootstrap CI] — twin: "
        + " — ".join(f"{LABELS[k]}: {agreement_text(data, 'twin', k)}" for k in KEYS),
        "χ²-profile twin: "
        + " — ".join(f"{LABELS[k]}: {agreement_text(data, 'old_twin', k)}" for k in KEYS),
        "Monte Carlo study: "
        + " — ".join(f"{LABELS[k]}: {agreement_text(data, 'mc', k)}" for k in KEYS),
        "Median log10 error (decades): "
        + " — ".join(f"{LABELS[k]}: {log_error_text(data, k)}" for k in KEYS),
        "Twin within families: " + " — ".join(f"{LABELS[k]}: {family_text(data, k)}" for k in KEYS),
        "Duplicates (same exact values as an earlier mapping): "
        + (
            ", ".join(
                sorted(
                    {
                        f"{r.mapping} = {r.duplicate_of}"
                        for r in cmp.itertuples()
                        if r.duplicate_of != r.mapping
                    }
                )
            )
            or "none"
        )
        + f". Hollow markers: duplicates. Values below {FLOOR:g} drawn at {FLOOR:g}. Grey: "
        "χ²-profile twin. Trivial predictor: every mapping equal to naive.",
    ]
    import textwrap

    wrapped = [textwrap.fill(line, width=200, subsequent_indent="    ") for line in notes]
    fig.text(0.0, -0.01, "\n".join(wrapped), fontsize=5.5, ha="left", va="top")
    return fig
