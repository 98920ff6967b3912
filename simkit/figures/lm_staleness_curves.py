"""Learning curves under staleness N with a real transformer: the tiny Llama beside the simulator.

The simulator's ``staleness_curves`` (tabular policy on a token MDP, exact J) run on a real
causal LM: :func:`simkit.lm.train.train_lm` trains the tiny Llama of
:func:`simkit.lm.models.tiny_llama` on the verifiable token task of
:class:`simkit.lm.tasks.TokenTask` (R = 1 iff the target token occurs in the response) with the
same rollout schedule — a rollout batch of N mini-batches updated in sequence, μ lagged by
``lag`` rollouts and served through an emulated inference engine (bf16 logits, temperature) —
and the same recipes (:data:`simkit.train.recipes.RECIPES`: mapping × aggregation through
:func:`simkit.lm.losses.policy_loss`, GRPO group advantage). J is estimated on held-out prompts
with its standard error (sd/√n); the curves are the mean over seeds with a ±SE band (the SE of
the seed mean of the per-seed estimates).

Sizes (full): vocabulary 64, hidden 32, 1 layer, response length 3 (held-out J(π₀) ≈ 0.05),
mini-batch of 16 responses (4 groups of 4), N ∈ {1, 8}, lag 2 rollouts, Adam lr 0.05, 96
updates, J on 64 held-out responses every 8 steps, seeds 0–3; one torch thread. Measured:
47 s for the full grid (48 runs) plus the simulator comparison, on the shared 2-core machine;
the small size (``config(small=True)``) ≈ 6 s. ``benchmarks/lm_gpu.py`` (section 5, ``train``)
times the same loop at ``--device cuda`` sizes.

The notes compare, from data, the measured final-J ordering at the largest N with the
simulator's ordering at the same N: :func:`compute` runs :mod:`simkit.figures.staleness_curves`
at its small size with this figure's recipes and N values and counts the recipe pairs that the
two orderings rank the same way (pairs whose difference is within 2 SE in either count as ties).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pandas as pd

from simkit.figures import staleness_curves as sim_curves
from simkit.train.recipes import RECIPES, recipe_label

NAME = "lm_staleness_curves"
TITLE = "Learning curves under staleness N with a real transformer (tiny Llama)"
CAPTION = (
    "held-out J (mean reward, ±SE band over seeds) against the optimizer step for the GRPO, "
    "GSPO, SAPO, VESPO, token-TIS and seq-MIS recipes training the tiny Llama with "
    "simkit.lm.train on a verifiable token task, one panel per staleness N (N mini-batches "
    "per rollout, μ lagged and served in bf16 with a temperature). The notes state the sizes, "
    "seeds, the measured ordering and where it agrees with the simulator's staleness_curves "
    "ordering at the same N, as measured."
)


@dataclass(frozen=True)
class Config:
    """Model (``vocab_size``, ``hidden_size``, ``num_layers``, ``init_std``), ``recipes``,
    ``staleness`` values N, the :class:`simkit.lm.train.LMTrainConfig` fields of the run
    (``minibatch_size``, ``group_size``, ``lag``, ``lr``, ``steps``, ``response_length``,
    ``precision``, ``temperature``, ``eval_every``, ``eval_samples``, ``n_prompts``) and
    ``seeds``; ``compare``: also run the simulator's staleness_curves (small size) for the
    agreement note."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 1
    init_std: float = 0.3
    recipes: tuple[str, ...] = ("grpo", "gspo", "sapo", "vespo", "tis", "mis")
    staleness: tuple[int, ...] = (1, 8)
    minibatch_size: int = 16
    group_size: int = 4
    lag: int = 2
    lr: float = 0.05
    steps: int = 96
    response_length: int = 3
    precision: str | None = "bf16"
    temperature: float = 0.9
    eval_every: int = 8
    eval_samples: int = 64
    n_prompts: int = 4
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    compare: bool = True

    def __post_init__(self):
        sim_curves.check_grid(self.recipes, staleness=self.staleness, seeds=self.seeds)


def config(small: bool = False) -> Config:
    if small:
        return Config(
            vocab_size=8,
            hidden_size=16,
            lag=1,
            lr=0.03,
            steps=8,
            response_length=4,
            recipes=("grpo", "vespo", "tis"),
            staleness=(1, 4),
            minibatch_size=8,
            eval_every=4,
            eval_samples=16,
            seeds=(0, 1),
        )
    return Config()


def _model(cfg: Config, seed: int):
    from simkit.lm.models import tiny_llama

    return tiny_llama(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=2 * cfg.hidden_size,
        seed=seed,
        init_std=cfg.init_std,
    )


def _hyperparams(recipe: str) -> tuple:
    """The recipe's preset (e.g. GSPO "paper") as the loss's keyword pairs."""
    from simkit import mappings

    mapping, preset = RECIPES[recipe].mapping, RECIPES[recipe].preset
    if preset is None:
        return ()
    m = mappings.get(mapping, preset=preset)
    return tuple((f.name, getattr(m, f.name)) for f in dataclasses.fields(m))


def lm_config(cfg: Config, recipe: str, N: int):
    """The :class:`~simkit.lm.train.LMTrainConfig` of one (recipe, N) run."""
    from simkit.lm.train import LMTrainConfig

    r = RECIPES[recipe]
    composed = {}
    if r.correction is not None:
        composed = dict(correction=r.correction, mode=r.mode)
    return LMTrainConfig(
        mapping=r.mapping,
        **composed,
        hyperparams=_hyperparams(recipe),
        aggregation=r.aggregation,
        minibatches=N,
        **train_fields(cfg),
    )


def train_fields(cfg: Config) -> dict:
    """The fields of :class:`~simkit.lm.train.LMTrainConfig` that ``cfg`` sets, by the same
    name (``group_size``, ``steps``, ``minibatch_size``, ``lag``, ``lr``, ``response_length``,
    ``precision``, ``temperature``, ``n_prompts``, ``eval_every``, ``eval_samples``)."""
    from simkit.lm.train import LMTrainConfig

    names = [f.name for f in dataclasses.fields(LMTrainConfig)]
    return {name: getattr(cfg, name) for name in names if hasattr(cfg, name)}


def run_grid(cfg: Config) -> pd.DataFrame:
    """Every (recipe, N, seed) run's table, with those three columns; one torch thread."""
    import torch

    from simkit.lm.train import train_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tables = []
    try:
        for recipe in cfg.recipes:
            for N in cfg.staleness:
                for seed in cfg.seeds:
                    t = train_lm(_model(cfg, seed), lm_config(cfg, recipe, N), seed=seed)
                    tables.append(t.assign(recipe=recipe, N=N, seed=seed))
    finally:
        torch.set_num_threads(threads)
    return pd.concat(tables, ignore_index=True)


def curves_of(table: pd.DataFrame) -> pd.DataFrame:
    """Recorded J per (recipe, N, step): mean over seeds and its SE (sd/√seeds; one seed: the
    run's own held-out SE)."""
    rec = table[table["recorded"]]
    g = rec.groupby(["recipe", "N", "step"], sort=False)
    out = g.agg(J=("J", "mean"), sd=("J", "std"), n=("J", "size"), J_se_run=("J_se", "mean"))
    out = out.reset_index()
    se = out.pop("sd") / np.sqrt(out["n"])
    out["se"] = np.where(out["n"] > 1, se, out.pop("J_se_run"))
    return out.drop(columns=[c for c in ("J_se_run",) if c in out])


def summary_of(table: pd.DataFrame) -> pd.DataFrame:
    """Per (recipe, N): final held-out J, mean ± SE over seeds."""
    last = table[table["recorded"]].sort_values("step").groupby(["recipe", "N", "seed"]).tail(1)
    g = last.groupby(["recipe", "N"], sort=False)
    out = g.agg(J_final=("J", "mean"), sd=("J", "std"), runs=("J", "size")).reset_index()
    out["J_final_se"] = out.pop("sd") / np.sqrt(out["runs"])
    return out


def _order(summary: pd.DataFrame, N: int) -> list[tuple[str, float, float]]:
    rows = summary[summary["N"] == N].sort_values("J_final", ascending=False)
    return [
        (r.recipe, float(r.J_final), float(r.J_final_se) if np.isfinite(r.J_final_se) else 0.0)
        for r in rows.itertuples(index=False)
    ]


def ranking(order) -> str:
    return " > ".join(f"{recipe_label(r)} {m:.3f} ± {s:.3f}" for r, m, s in order)


def agreement(lm: pd.DataFrame, sim: pd.DataFrame, N: int) -> dict:
    """Recipe pairs at staleness N ranked the same way by the LM's and the simulator's final J.

    A pair is ``tied`` when the LM's or the simulator's difference is within 2 SE (combined),
    else ``agree`` or ``disagree`` by the signs of the two differences."""
    a = {r: (m, s) for r, m, s in _order(lm, N)}
    b = {r: (m, s) for r, m, s in _order(sim, N)}
    common = [r for r in a if r in b]
    out = {"agree": [], "disagree": [], "tied": []}
    for x, y in combinations(common, 2):
        d = a[x][0] - a[y][0]
        e = b[x][0] - b[y][0]
        if abs(d) <= 2 * math.hypot(a[x][1], a[y][1]) or abs(e) <= 2 * math.hypot(b[x][1], b[y][1]):
            out["tied"].append((x, y))
        elif np.sign(d) == np.sign(e):
            out["agree"].append((x, y))
        else:
            out["disagree"].append((x, y))
    return out


def simulator_config(cfg: Config):
    """The simulator's staleness_curves small configuration with this figure's recipes and N."""
    return dataclasses.replace(
        sim_curves.config(small=True), recipes=cfg.recipes, staleness=cfg.staleness
    )


def simulator_summary(cfg: Config) -> pd.DataFrame:
    """The simulator's staleness_curves at its small size with this figure's recipes and N."""
    data = sim_curves.compute(simulator_config(cfg), workers=1)
    return data.summary[["recipe", "N", "J_final", "J_final_se", "runs"]]


def _pairs(pairs) -> str:
    return ", ".join(f"{recipe_label(x)}/{recipe_label(y)}" for x, y in pairs) or "none"


def make_notes(cfg: Config, summary: pd.DataFrame, table: pd.DataFrame, sim) -> tuple[str, ...]:
    N_max = max(cfg.staleness)
    J0 = table[(table["step"] == 0) & table["recorded"]]["J"]
    notes = [
        f"Environment: tiny Llama (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layer(s)), token task with {cfg.n_prompts} training prompts (R = 1 "
        f"iff the target token occurs in the {cfg.response_length}-token response), held-out "
        f"J(π₀) = {J0.mean():.3f}; μ lagged {cfg.lag} rollout(s), engine "
        f"{cfg.precision or 'fp32'} logits at temperature {cfg.temperature:g}.",
        f"Sizes: N ∈ {{{', '.join(map(str, cfg.staleness))}}} mini-batches of "
        f"{cfg.minibatch_size} responses (groups of {cfg.group_size}), {cfg.steps} Adam updates "
        f"(lr {cfg.lr:g}), J on {cfg.eval_samples} held-out responses every {cfg.eval_every} "
        f"steps; seeds {', '.join(map(str, cfg.seeds))}; band ±SE over seeds.",
        f"max |log π − log μ| reached: {table['max_abs_log_ratio'].max():.3g} nats.",
    ]
    for N in cfg.staleness:
        notes.append(f"Final J at N = {N} (mean ± SE over seeds): {ranking(_order(summary, N))}.")
    if sim is not None:
        ag = agreement(summary, sim, N_max)
        sc = simulator_config(cfg)
        n = sum(len(v) for v in ag.values())
        notes.append(
            f"Simulator (staleness_curves at small size: {sc.constructor} V = {sc.V}, "
            f"T = {sc.T}, lag {sc.lag}, lr {sc.lr:g}, {sc.steps} steps, "
            f"{len(sc.seeds)} seeds; same recipes and N) at N = {N_max}: "
            f"{ranking(_order(sim, N_max))}."
        )
        notes.append(
            f"Agreement at N = {N_max}: of {n} recipe pairs, {len(ag['agree'])} ordered as in "
            f"the simulator ({_pairs(ag['agree'])}), {len(ag['disagree'])} reversed "
            f"({_pairs(ag['disagree'])}), {len(ag['tied'])} within 2 SE in either (not resolved)."
        )
    else:
        notes.append("No simulator comparison (Config.compare = False).")
    return tuple(notes)


@dataclass(frozen=True)
class Data:
    """``table``: every step of every run (:data:`simkit.lm.train.COLUMNS`, recipe, N, seed);
    ``curves``: J mean and SE per (recipe, N, step); ``summary``: final J per (recipe, N);
    ``sim_summary``: the simulator's (or None); ``notes``."""

    config: Config
    table: pd.DataFrame
    curves: pd.DataFrame
    summary: pd.DataFrame
    sim_summary: pd.DataFrame | None
    notes: tuple[str, ...]


def compute(cfg: Config) -> Data:
    table = run_grid(cfg)
    summary = summary_of(table)
    sim = simulator_summary(cfg) if cfg.compare else None
    return Data(
        config=cfg,
        table=table,
        curves=curves_of(table),
        summary=summary,
        sim_summary=sim,
        notes=make_notes(cfg, summary, table, sim),
    )


def draw(data: Data):
    Ns = list(data.config.staleness)
    fig, panels = sim_curves.split_figure(2.6 * len(Ns) + 1.2, 2.4, data.notes)
    axes = panels.subplots(1, len(Ns), sharex=True, sharey=True, squeeze=False).ravel()
    for ax, N in zip(axes, Ns, strict=True):
        for recipe in data.config.recipes:
            c = data.curves[(data.curves["recipe"] == recipe) & (data.curves["N"] == N)]
            x = c["step"].to_numpy(float)
            sim_curves.plot_band(ax, recipe, x, c["J"], c["J"] - c["se"], c["J"] + c["se"])
        ax.set_title(f"N = {N}")
        ax.set_xlabel("optimizer step")
    axes[0].set_ylabel("held-out J (± SE)")
    sim_curves.recipe_legend(panels, axes[0])
    panels.suptitle(
        f"tiny Llama (vocab {data.config.vocab_size}, hidden {data.config.hidden_size}), "
        f"mean of {len(data.config.seeds)} seeds, ±SE band",
        fontsize=8,
    )
    return fig
