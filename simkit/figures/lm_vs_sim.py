"""Exact truth on a truncated LM: does the Monte Carlo study cover it, do the twins predict it?

The LM π (SmolLM2-135M-Instruct at full size) is truncated to its top-k tokens at every prefix
(π_k, renormalised) and every response of T tokens is enumerated (:func:`simkit.lm.exact.tree`):
for each behaviour μ (restricted to the same support) every per-sample mapping's exact mean and
variance, and the exact ∇J, with respect to the final RMSNorm weight
(:func:`simkit.lm.exact.exact_study`; batch-dependent mappings by Monte Carlo over exact leaf
draws). Against that truth, on the *same* truncated LM:

(a) the Monte Carlo gradient study (:func:`simkit.lm.topk.mc_study`: ``reps`` batches of n
    responses from μ_k against an on-policy REINFORCE reference of ``n_ref`` responses) —
    coverage: the share of mappings whose 95% intervals of bias and variance contain the exact
    value of the *same* estimator (its advantage R − Ĵ uses the study's pilot estimate Ĵ, so
    the exact values are computed on the tree with that baseline: ``mc_exact_<m>``);
(b) the distribution-matched twin (:mod:`simkit.lm.twin_dist`), fitted only from ``n_log``
    logged responses of μ_k (per-token log π, log μ, mask, reward: exact leaf draws), and the
    χ²-profile token-MDP twin (:func:`simkit.lm.twin.simulation_twin`, given the exact
    per-position χ², length profile and J) — Spearman ρ between each twin's predicted and the
    exact relative bias, variance and MSE (relative to naive), over the mappings (naive
    excluded), with a 95% bootstrap interval over mappings.

A rank correlation computed from Monte Carlo values is *resolved* only when at least half of
the pairs of mappings have disjoint intervals (the ordering is then measured, not noise);
otherwise it is reported as unresolved (the ``resolved`` column).

Data (:class:`Data`): ``comparison`` (behaviour × estimator: ``exact_rel_<m>``, ``mc_rel_<m>``
with ``mc_rel_<m>_lo``/``_hi``, ``twin_rel_<m>`` with ``_lo``/``_hi``, ``old_rel_<m>``, and the
coverage flags ``mc_covers_bias``/``mc_covers_variance``), ``agreement`` (behaviour × source
(``twin``, ``old_twin``, ``mc``) × metric: ``rho``, ``lo``, ``hi``, ``k``, ``resolved``),
``coverage`` (behaviour: the covered shares), ``exact``, ``mc`` (full tables), ``meta``
(sizes, J, D; the timings of the parts go to the ``simkit.figures.lm_vs_sim`` logger at
INFO level, so that the data are identical from run to run).

torch is imported inside :func:`compute` only.
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
    "SmolLM2-135M-Instruct truncated to its top-4 tokens at every prefix, every response of "
    "≤ 6 tokens enumerated (exact J, ∇J w.r.t. the final-norm weight, D = 576, and every "
    "per-sample mapping's exact mean and variance; μ = temperature 1.3 and 0.8 restricted to "
    "the same support; oracle advantage R − J(π), seq-mean-token-sum, n = 8). (a) The Monte "
    "Carlo gradient study on the same truncated LM against the exact values: its 95% "
    "intervals of bias and variance, with the share that covers the truth. (b–d) Relative "
    "bias, variance and MSE (over naive) predicted by the distribution-matched twin fitted "
    "from logged per-token log-probabilities, masks and rewards of μ's responses only "
    "(filled), and by the χ²-profile token-MDP twin (grey), against the exact values; "
    "Spearman ρ with 95% bootstrap intervals over mappings in the panel titles and notes. "
    "Rank correlations from Monte Carlo intervals that do not separate most pairs are "
    "reported as unresolved."
)

MODELS = ("tiny", "smollm2")
METRICS = ("bias", "variance", "mse")
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


def config(small: bool = False) -> Config:
    """Full size: SmolLM2, k = 4, T = 6, two temperatures, every mapping. Small: the tiny
    random Llama, a token-presence task, k = 3, T = 4 (seconds; the tests use it)."""
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
    return Config()


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


def estimators(cfg: Config, advantage: str = "oracle_pi"):
    """One estimator per mapping: ``cfg.aggregation``, advantage ``oracle_pi`` (R − J(π): the
    LM study's baseline is its pilot estimate of J(π))."""
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
    running = reach / reach[0]
    eos = cfg.stop_at_eos and not env.fixed_length
    tw, mu = twin.simulation_twin(prof, ex.J, V=cfg.old_twin_V, running=running if eos else None)
    table = twin.predict(tw, mu, ests, n=cfg.n, reps=cfg.old_twin_reps, seed=cfg.seed, n_boot=50)
    return table, prof, running


def compute(cfg: Config) -> Data:
    from simkit.lm import exact, topk, twin, twin_dist

    t_start, cpu_start = time.perf_counter(), time.process_time()
    model, tokenizer, task, eos = load(cfg)
    ests = estimators(cfg)
    rows, agreements, coverage, exact_tables, mc_tables = [], [], [], [], []
    meta = {"model": cfg.model, "task": cfg.task, "k": cfg.k, "T": cfg.T, "n": cfg.n}
    reference = None
    timings = {"exact": 0.0, "mc": 0.0, "twin": 0.0, "old_twin": 0.0}
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
        timings["exact"] += time.perf_counter() - t0
        truth = twin_dist.relative(ex.table)
        # (a) the Monte Carlo study on the same truncated LM
        t0 = time.perf_counter()
        prompt_task = _PromptSubset(task, cfg.prompts)
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
            reference=reference,
            progress=False,
        )
        reference = mc if reference is None else reference
        timings["mc"] += time.perf_counter() - t0
        mc_t = mc.table
        mc_rel = twin_dist.relative(mc_t)
        # the MC study's advantage is R − Ĵ with Ĵ its pilot estimate: its exact values on the
        # tree are those of the raw advantage on rewards R − Ĵ (∇J does not change)
        shifted = dataclasses.replace(ex.env, rewards=ex.env.rewards - mc.J)
        mc_truth = _experiment.run(
            shifted,
            "mu",
            estimators(cfg, advantage="raw"),
            n=cfg.n,
            reps=cfg.exact_reps,
            seed=cfg.seed + i,
            n_boot=50,
            progress=False,
        ).set_index("estimator")
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
        et = mc_truth
        mt = mc_t.set_index("estimator")
        cmp["mc_covers_bias"] = [
            mt.loc[e, "bias_lo"] <= et.loc[e, "bias"] <= mt.loc[e, "bias_hi"] for e in cmp.estimator
        ]
        cmp["mc_covers_variance"] = [
            mt.loc[e, "variance_lo"] <= et.loc[e, "variance"] <= mt.loc[e, "variance_hi"]
            for e in cmp.estimator
        ]
        cmp["mc_exact_bias"] = [et.loc[e, "bias"] for e in cmp.estimator]
        cmp["mc_exact_variance"] = [et.loc[e, "variance"] for e in cmp.estimator]
        for key in METRICS:
            cmp[f"exact_rel_{key}"] = truth[f"rel_{key}"].to_numpy()
            cmp[f"mc_rel_{key}"] = mc_rel[f"rel_{key}"].to_numpy()
            for side in ("lo", "hi"):
                cmp[f"mc_rel_{key}_{side}"] = mc_bounds[f"rel_{key}_{side}"].to_numpy()
            cmp[f"twin_rel_{key}"] = tw[f"rel_{key}"].to_numpy()
            cmp[f"twin_rel_{key}_lo"] = tw[f"rel_{key}_lo"].to_numpy()
            cmp[f"twin_rel_{key}_hi"] = tw[f"rel_{key}_hi"].to_numpy()
            cmp[f"old_rel_{key}"] = old_rel[f"rel_{key}"].to_numpy()
        keep = cmp.mapping != "naive"
        for key in METRICS:
            for source, col in (("twin", "twin"), ("old_twin", "old"), ("mc", "mc")):
                rho, lo, hi, k = twin.rank_agreement(
                    cmp.loc[keep, f"exact_rel_{key}"],
                    cmp.loc[keep, f"{col}_rel_{key}"],
                    n_boot=1000,
                    seed=cfg.seed,
                )
                res = (
                    resolved(cmp.loc[keep, f"mc_rel_{key}_lo"], cmp.loc[keep, f"mc_rel_{key}_hi"])
                    if source == "mc"
                    else True
                )
                agreements.append(
                    {
                        "behaviour": spec,
                        "source": source,
                        "metric": key,
                        "rho": rho,
                        "lo": lo,
                        "hi": hi,
                        "k": k,
                        "resolved": res,
                    }
                )
        coverage.append(
            {
                "behaviour": spec,
                "bias": float(cmp.mc_covers_bias.mean()),
                "variance": float(cmp.mc_covers_variance.mean()),
                "k": len(cmp),
            }
        )
        rows.append(cmp)
        exact_tables.append(ex.table.assign(behaviour=spec))
        mc_tables.append(mc_t.assign(behaviour=spec))
        meta[spec] = {
            "J": ex.J,
            "J_mc": mc.J,
            "J_mc_se": mc.J_se,
            "D": ex.env.D,
            "grad_norm": float(np.linalg.norm(ex.grad_J)),
            "leaves": int(sum(t.n_leaves for t in ex.trees)),
            "nodes": int(sum(t.n_nodes for t in ex.trees)),
            "chi2_tok": float(ex.table.chi2_tok.iloc[0]),
            "chi2_seq": float(ex.table.chi2_seq.iloc[0]),
            "chi2_profile": [float(x) for x in chi2_prof],
            "running": [float(x) for x in running],
            "n_ref": int(mc.reference_samples.shape[0]),
        }
    meta["params"] = cfg.params
    meta["n_log"] = cfg.n_log
    meta["reps"] = cfg.reps
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


def agreement_text(data: Data, source: str, metric: str) -> str:
    """``behaviour ρ = x [lo, hi]`` per behaviour (``unresolved`` where so), for the notes."""
    part = data.agreement[(data.agreement.source == source) & (data.agreement.metric == metric)]
    out = []
    for r in part.itertuples():
        tag = "" if r.resolved else " (unresolved)"
        out.append(f"{r.behaviour} ρ = {r.rho:.2f} [{r.lo:.2f}, {r.hi:.2f}]{tag}")
    return "; ".join(out)


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
    fig = _common.new_figure(11.0, 4.4)
    axes = fig.subplots(1, 4)
    cmp = data.comparison
    behaviours = list(dict.fromkeys(cmp.behaviour))
    # (a) MC vs exact (relative bias and variance)
    ax = axes[0]
    values = []
    for b, spec in enumerate(behaviours):
        part = cmp[(cmp.behaviour == spec) & (cmp.mapping != "naive")]
        for row in part.itertuples():
            values += scatter_relative(
                ax,
                row.exact_rel_bias,
                row.mc_rel_bias,
                row.mc_rel_bias_lo,
                row.mc_rel_bias_hi,
                color=style.color(row.mapping),
                marker=MARKERS[b % len(MARKERS)],
                hollow=not row.mc_covers_bias,
                label=row.mapping if b == 0 else None,
            )
    log_diagonal(ax, values)
    ax.set_xlabel("exact bias / naive (tree)")
    ax.set_ylabel("Monte Carlo bias / naive (95% CI)")
    cov = data.coverage
    ax.set_title(
        "MC interval covers exact:\nbias "
        + ", ".join(f"{v:.0%}" for v in cov.bias)
        + "; variance "
        + ", ".join(f"{v:.0%}" for v in cov.variance),
        fontsize=7,
    )
    # (b–d) twins vs exact
    for ax, key in zip(axes[1:], METRICS, strict=True):
        values = []
        for b, spec in enumerate(behaviours):
            part = cmp[(cmp.behaviour == spec) & (cmp.mapping != "naive")]
            marker = MARKERS[b % len(MARKERS)]
            for row in part.itertuples():
                values += scatter_relative(
                    ax,
                    getattr(row, f"exact_rel_{key}"),
                    getattr(row, f"old_rel_{key}"),
                    color="0.65",
                    marker=marker,
                )
                values += scatter_relative(
                    ax,
                    getattr(row, f"exact_rel_{key}"),
                    getattr(row, f"twin_rel_{key}"),
                    getattr(row, f"twin_rel_{key}_lo"),
                    getattr(row, f"twin_rel_{key}_hi"),
                    color=style.color(row.mapping),
                    marker=marker,
                )
        log_diagonal(ax, values)
        ax.set_xlabel(f"exact {key} / naive (tree)")
        ax.set_ylabel(f"predicted {key} / naive")
        ag = data.agreement[data.agreement.metric == key]
        new = ag[ag.source == "twin"].rho
        old = ag[ag.source == "old_twin"].rho
        ax.set_title(
            f"{key}: twin ρ = "
            + ", ".join(f"{r:.2f}" for r in new)
            + "\nχ²-profile twin ρ = "
            + ", ".join(f"{r:.2f}" for r in old),
            fontsize=7,
        )
    for letter, ax in zip("abcd", axes, strict=True):
        _common.panel_label(ax, letter)
    mapping_legend(fig, axes[0])
    meta = data.meta
    first = meta[behaviours[0]]
    marks = behaviour_marks(behaviours)
    fig.suptitle(
        f"{meta['model']} truncated to top-{meta['k']}, T ≤ {meta['T']} ({first['leaves']} "
        f"leaves, {first['nodes']} forward positions), θ = {meta['params']} (D = {first['D']}), "
        f"J(π_k) = {first['J']:.2f}, n = {meta['n']}\nMC study: {meta['reps']} batches, "
        f"n_ref = {first['n_ref']}; twin fitted from {meta['n_log']} logged responses; "
        f"markers: {marks}"
    )
    notes = [
        "Spearman ρ vs exact over mappings (naive excluded) [95% bootstrap CI] — "
        "distribution-matched twin: "
        + " — ".join(f"{k}: {agreement_text(data, 'twin', k)}" for k in METRICS),
        "χ²-profile twin: "
        + " — ".join(f"{k}: {agreement_text(data, 'old_twin', k)}" for k in METRICS),
        "Monte Carlo study: "
        + " — ".join(f"{k}: {agreement_text(data, 'mc', k)}" for k in METRICS),
        f"(a) hollow: the MC interval misses the exact value. Values below {FLOOR:g} drawn at "
        f"{FLOOR:g}. Grey: χ²-profile twin.",
    ]
    import textwrap

    wrapped = [textwrap.fill(line, width=190, subsequent_indent="    ") for line in notes]
    fig.text(0.0, -0.01, "\n".join(wrapped), fontsize=6, ha="left", va="top")
    return fig
