"""The Monte Carlo comparison behind ``simkit lm compare``: a gradient study on the LM vs the
χ²-profile token-MDP twin (the first version of the ``lm_vs_sim`` figure, now
:mod:`simkit.figures.lm_vs_sim`, which compares against exact tree values).

Does the token-MDP simulation predict what the weight mappings do on a real language model?

For each behaviour μ of the configuration (a :mod:`simkit.lm.mismatch` generator applied to the
LM π), two numbers per mapping:

- **measured** on the LM (:func:`simkit.lm.experiment.gradient_study`): every mapping's policy
  gradient (oracle advantage R − Ĵ, ``seq-mean-token-sum``) with respect to the final RMSNorm
  weight, over ``reps`` independent batches of n responses from μ, against an on-policy
  REINFORCE reference ∇̂J (``n_ref`` responses from π, with its own standard error);
- **predicted** by the simulation twin (:func:`simkit.lm.experiment.simulation_twin`): a
  state-independent token MDP with the LM's response length T, its reward rate Ĵ, its length
  distribution (EOS hazard per position) and, at every position, a μ_t dialled so that
  χ²(π_t‖μ_t) equals the LM's measured per-token χ² at that position;
  :func:`simkit.experiment.run` gives each mapping's bias and variance there (exact by
  enumeration for per-sample mappings; Monte Carlo for the batch-dependent snis, psis, m2po).

Absolute numbers cannot match (the twin has a 2–3 token vocabulary, the LM a parameter
subset of dimension D), so both sides are divided by the naive (uncorrected) estimator's on the
same setting: relative variance, relative bias, relative MSE. Agreement is the Spearman rank
correlation between measured and predicted over the mappings (naive excluded, it is 1 on both
sides), with a 95% percentile-bootstrap interval over mappings
(:func:`simkit.lm.experiment.rank_agreement`).

Data (:class:`Data`): ``comparison`` (one row per behaviour × estimator, measured and
predicted relative metrics, the measured 95% bounds divided by naive's point value),
``agreement`` (behaviour × metric: ``rho``, ``lo``, ``hi``, ``k``), ``profiles`` (behaviour ×
position: the LM's and the twin's per-token χ² and running fraction), ``lm`` and ``sim``
(the full tidy tables), ``meta`` (model, task, sizes, seeds, Ĵ, D).

torch is imported inside :func:`compute` only (``simkit.figures`` stays importable without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from simkit.figures import _common, lm_vs_sim, style

NAME = "lm_vs_sim_mc"
TITLE = "Measured on a language model vs predicted by the token-MDP twin"
# No fixed CAPTION: this comparison is not a registered figure (``simkit lm compare`` draws it);
# its agreement sentences are computed from the data (``agreement`` notes in :func:`draw`), so
# the measured ρ values of a run are printed with that run, never hard-coded here.

MODELS = lm_vs_sim.MODELS
METRICS = ("variance", "bias", "mse")


@dataclass(frozen=True)
class Config(lm_vs_sim.LMStudyConfig):
    """The LM study of the comparison (:class:`simkit.figures.lm_vs_sim.LMStudyConfig`: model,
    task, behaviours, mappings, sizes) and its twin: ``twin_V``, ``twin_reps``: the twin's
    vocabulary and Monte Carlo batches; ``shift_family``: how the twin's μ_t is dialled;
    ``rows_per_call``: responses scored per forward pass. With ``stop_at_eos`` the twin has an
    EOS token.
    """

    task_kwargs: tuple = (("n_prompts", 8),)
    T: int = 12
    reps: int = 32
    n_ref: int = 192
    n_pilot: int = 96
    n_boot: int = 400
    twin_V: int = 4
    twin_reps: int = 400
    shift_family: str = "logit_noise"
    rows_per_call: int = 64

    def __post_init__(self):
        lm_vs_sim.check_config(
            self,
            sizes=("T", "n", "reps", "n_ref", "n_pilot", "twin_reps"),
            at_least_two=("reps", "n_ref", "twin_reps"),
        )
        if self.twin_V < 3 and self.stop_at_eos:
            raise ValueError(
                f"twin_V must be >= 3 with stop_at_eos (answer, other, EOS), got {self.twin_V}"
            )


def config(small: bool = False) -> Config:
    """Full size: SmolLM2 (330 s wall, 500 s CPU measured on 2 cores). Small: the tiny random
    Llama, a token-presence task at temperature 2, fixed-length responses (about 10 s; the
    tests use it)."""
    if small:
        return Config(
            **lm_vs_sim.SMALL_LM,
            task_kwargs=(("vocab_size", 64), ("target", 58), ("n_prompts", 4)),
            behaviours=("temperature:2.0",),
            T=5,
            n=8,
            reps=100,
            n_ref=600,
            n_pilot=200,
            twin_V=4,
            twin_reps=200,
            n_boot=200,
        )
    return Config()


@dataclass(frozen=True)
class Data:
    comparison: pd.DataFrame
    agreement: pd.DataFrame
    profiles: pd.DataFrame
    lm: pd.DataFrame
    sim: pd.DataFrame
    meta: dict = field(default_factory=dict)


def load(cfg: Config):
    """(model, tokenizer, task, eos_token_id) of the configuration
    (:func:`simkit.figures.lm_vs_sim.load`; the token task keeps its own default target)."""
    return lm_vs_sim.load(cfg, default_target=None)


def relative_bounds(table: pd.DataFrame, reference: str = "naive") -> pd.DataFrame:
    """``rel_<m>_lo``/``_hi`` over the reference's point value for m in :data:`METRICS`
    (:func:`simkit.figures.lm_vs_sim.relative_bounds`)."""
    return lm_vs_sim.relative_bounds(table, reference, metrics=METRICS)


def compute(cfg: Config) -> Data:
    from simkit.lm import experiment as X

    model, tokenizer, task, eos = load(cfg)
    names = _common.chosen_mappings(cfg.mapping_names)
    ests = X.default_estimators(names, aggregation=cfg.aggregation)
    references: dict[str, object] = {}
    comparisons, agreements, profiles, lm_tables, sim_tables = [], [], [], [], []
    meta = {"model": cfg.model, "task": cfg.task, "T": cfg.T, "n": cfg.n, "reps": cfg.reps}
    for i, spec in enumerate(cfg.behaviours):
        pair = lm_vs_sim.behaviour_pair(cfg, spec, model, task, tokenizer, eos)
        reference = references.get(X.model_fingerprint(pair.target))
        res = X.gradient_study(
            model,
            task,
            ests,
            behaviour=pair,
            tokenizer=tokenizer,
            eos_token_id=eos,
            seed=cfg.seed + i,
            rows_per_call=cfg.rows_per_call,
            **lm_vs_sim.study_sizes(cfg),
            reference=reference,
            progress=False,
        )
        references.setdefault(res.fingerprint, res)
        lm = res.table.assign(behaviour=spec)
        prof = res.profile
        env, mu = X.simulation_twin(
            prof.chi2_tok.to_numpy(),
            res.J,
            V=cfg.twin_V,
            shift_family=cfg.shift_family,
            running=prof.running.to_numpy() if eos is not None else None,
        )
        sim = X.predict(
            env, mu, ests, n=cfg.n, reps=cfg.twin_reps, seed=cfg.seed + i, n_boot=cfg.n_boot
        ).assign(behaviour=spec)
        cmp = X.compare(lm, sim).assign(behaviour=spec)
        cmp = cmp.merge(relative_bounds(lm), on="estimator")
        comparisons.append(cmp)
        for key in METRICS:
            keep = cmp.mapping != "naive"
            rho, lo, hi, k = X.rank_agreement(
                cmp.loc[keep, f"measured_rel_{key}"],
                cmp.loc[keep, f"predicted_rel_{key}"],
                n_boot=1000,
                seed=cfg.seed,
            )
            agreements.append(
                {"behaviour": spec, "metric": key, "rho": rho, "lo": lo, "hi": hi, "k": k}
            )
        twin_prof = env.divergence_profile(mu)
        lengths = env.length_distribution()
        twin_running = 1.0 - np.concatenate([[0.0], np.cumsum(lengths)[:-1]])
        profiles.append(
            pd.DataFrame(
                {
                    "behaviour": spec,
                    "position": prof.position,
                    "chi2_lm": prof.chi2_tok,
                    "kl_lm": prof.kl_tok,
                    "tv_lm": prof.tv_tok,
                    "running_lm": prof.running,
                    "chi2_twin": np.asarray(twin_prof["chi2_tok"], dtype=float),
                    "running_twin": twin_running[: len(prof)],
                }
            )
        )
        lm_tables.append(lm)
        sim_tables.append(sim)
        meta[spec] = {
            "J": res.J,
            "J_se": res.J_se,
            "J_twin": env.J(),
            "D": res.D,
            "grad_norm": res.grad_norm,
            "chi2_tok": float(lm.chi2_tok.iloc[0]),
            "kl_tok": float(lm.kl_tok.iloc[0]),
            "tv_tok": float(lm.tv_tok.iloc[0]),
            "mean_length": float(np.mean(res.lengths)),
            "n_ref": int(res.reference_samples.shape[0]),
            "seed": cfg.seed + i,
        }
    meta["params"] = cfg.params
    return Data(
        comparison=pd.concat(comparisons, ignore_index=True),
        agreement=pd.DataFrame(agreements),
        profiles=pd.concat(profiles, ignore_index=True),
        lm=pd.concat(lm_tables, ignore_index=True),
        sim=pd.concat(sim_tables, ignore_index=True),
        meta=meta,
    )


#: relative values below this are drawn at it (unbiased mappings have relative bias 0)
FLOOR = lm_vs_sim.FLOOR


def _agreement_line(data: Data, metric: str) -> str:
    part = data.agreement[data.agreement.metric == metric]
    return f"{metric}: " + "; ".join(
        f"{r.behaviour} ρ = {r.rho:.2f} [{r.lo:.2f}, {r.hi:.2f}]" for r in part.itertuples()
    )


def draw(data: Data):
    fig = _common.new_figure(10.5, 4.6)
    axes = fig.subplots(1, 4, width_ratios=[1, 1, 1, 0.8])
    cmp = data.comparison
    behaviours = list(dict.fromkeys(cmp.behaviour))
    for ax, key in zip(axes[:3], METRICS, strict=True):
        values = []
        for b, spec in enumerate(behaviours):
            part = cmp[(cmp.behaviour == spec) & (cmp.mapping != "naive")]
            for row in part.itertuples():
                x = getattr(row, f"predicted_rel_{key}")
                y = getattr(row, f"measured_rel_{key}")
                if not (np.isfinite(x) and np.isfinite(y)):
                    continue
                values += lm_vs_sim.scatter_relative(
                    ax,
                    x,
                    y,
                    getattr(row, f"rel_{key}_lo"),
                    getattr(row, f"rel_{key}_hi"),
                    color=style.color(row.mapping),
                    marker=lm_vs_sim.MARKERS[b % len(lm_vs_sim.MARKERS)],
                    hollow=x < FLOOR or y < FLOOR,
                    label=row.mapping if b == 0 else None,
                )
        lm_vs_sim.log_diagonal(ax, values, unit_lines=True)
        ax.set_xlabel(f"predicted {key} / naive (twin)")
        ax.set_ylabel(f"measured {key} / naive (LM)")
        rho = data.agreement[data.agreement.metric == key]
        ax.set_title(f"{key}: ρ = " + ", ".join(f"{r:.2f}" for r in rho.rho), fontsize=9)
    for letter, ax in zip("abc", axes[:3], strict=True):
        _common.panel_label(ax, letter)
    ax = axes[3]
    prof = data.profiles
    for b, spec in enumerate(behaviours):
        part = prof[prof.behaviour == spec]
        ax.plot(
            part.position,
            part.chi2_lm,
            marker=lm_vs_sim.MARKERS[b % len(lm_vs_sim.MARKERS)],
            markersize=3,
            label=f"{spec} (LM = twin)",
        )
    ax.set_xlabel("response position t")
    ax.set_ylabel(r"per-token $\chi^2(\pi_t\|\mu_t)$")
    ax.set_title("χ² profile, lengths")
    twin = ax.twinx()
    for b, spec in enumerate(behaviours):
        part = prof[prof.behaviour == spec]
        twin.plot(
            part.position,
            part.running_lm,
            color="0.45",
            linewidth=0.8,
            linestyle=("-", ":", "--", "-.")[b % 4],
            label=f"running, {spec}",
        )
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("fraction of responses still running", color="0.45")
    twin.grid(False)
    _common.panel_label(ax, "d")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
    ax.legend(handles, labels, fontsize=5.5, loc="lower left")
    lm_vs_sim.mapping_legend(fig, axes[0])
    meta = data.meta
    first = meta[behaviours[0]]
    marks = lm_vs_sim.behaviour_marks(behaviours)
    fig.suptitle(
        f"{meta['model']} LM vs token-MDP twin — task {meta['task']}, T ≤ {meta['T']}, "
        f"n = {meta['n']}, {meta['reps']} batches per behaviour, n_ref = {first['n_ref']}\n"
        f"θ = {meta['params']} (D = {first['D']}), Ĵ = {first['J']:.2f}; markers: {marks}"
    )
    notes = [
        "Spearman rank correlation over mappings (naive excluded) [95% bootstrap CI] — "
        + _agreement_line(data, "variance"),
        _agreement_line(data, "bias") + " — " + _agreement_line(data, "mse"),
        f"Hollow markers: a value below {FLOOR:g} drawn at {FLOOR:g} (unbiased mappings). "
        "Bars: the LM measurement's 95% interval over naive's point value.",
    ]
    fig.text(0.0, -0.01, "\n".join(notes), fontsize=6.5, ha="left", va="top")
    return fig
