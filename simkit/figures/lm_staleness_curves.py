"""Learning curves under staleness N with a real transformer, beside its simulator twin.

:func:`simkit.lm.train.train_lm` trains the tiny Llama of :func:`simkit.lm.models.tiny_llama`
on the verifiable token task of :class:`simkit.lm.tasks.TokenTask` (R = 1 iff the target
token occurs in the T-token response) with the rollout schedule of :mod:`simkit.train` — a
rollout batch of N mini-batches updated in sequence, μ lagged and served through an emulated
inference engine (bf16 logits) — and the recipes of :data:`simkit.train.recipes.RECIPES`
(mapping × aggregation × mode through :func:`simkit.lm.losses.policy_loss`, GRPO group
advantage). Its J is **exact** at every evaluation step
(:func:`simkit.lm.train.exact_presence_J`: every target-free response enumerated), so the
curves carry no evaluation noise.

The **twin** is the simulator on the same task and schedule: ``TokenMDP.at_least_k(V, T,
k = 1, hit = target)`` (the same vocabulary size, length and reward) with its target logit
shifted so that J(π₀) equals the LM's mean exact J(π₀), ``features`` parameters sized to the
LM's hidden size, the same N, the same lag in optimizer updates (the LM's lag of k rollouts is
L = k·N updates), the same engine transform (bf16 logits), Adam with the same lr and gradient
clipping, the same steps and at least 8 seeds on both sides. (The LM's prompts carry no task
information — R depends on the response only —; the twin has one context.)

The notes print, at the largest N, each side's final-J ordering (± SE over seeds, ties within
2 SE), **Kendall τ-b** between the two orderings with a bootstrap interval over seeds, the
fraction of the pairs resolved on both sides (> 2 SE) that agree, and the same numbers for a
**trivial predictor**: the LM's own on-policy ordering (N = 1), so that the reader sees what
the simulator adds over "the ordering does not change with N".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pandas as pd

from simkit.figures import staleness_curves as sim_curves
from simkit.train.analysis import TAIL_FRACTION
from simkit.train.recipes import RECIPES, recipe, recipe_label

NAME = "lm_staleness_curves"
TITLE = "Learning curves under staleness N with a real transformer (tiny Llama) and its twin"
CAPTION = (
    "exact J (mean over seeds, ±SE band) against the optimizer step for the GRPO, GSPO, SAPO, "
    "VESPO (bypass) and token-TIS (decoupled PPO × TIS) recipes training the tiny Llama with "
    "simkit.lm.train on a verifiable token task, one panel per staleness N (μ lagged and "
    "served in bf16), and the simulator twin on the same task and schedule (dashed). The "
    "notes give both orderings with ± SE, Kendall τ between them with a bootstrap interval, "
    "the agreement of the pairs resolved on both sides, and the same for the trivial "
    "predictor (the LM's on-policy ordering), as measured."
)
#: bootstrap resamples of the seeds for Kendall τ's interval
BOOTSTRAP = 1000


@dataclass(frozen=True)
class Config:
    """Model (``vocab_size``, ``hidden_size``, ``num_layers``, ``init_std``), ``recipes``,
    ``staleness`` values N, the :class:`simkit.lm.train.LMTrainConfig` fields of the run
    (``minibatch_size``, ``group_size``, ``lag`` in rollouts, ``lr``, ``max_grad_norm``,
    ``steps``, ``response_length``, ``precision``, ``eval_every``, ``n_prompts``, ``target``)
    and ``seeds`` (both sides); ``compare``: also run the simulator twin."""

    vocab_size: int = 8
    hidden_size: int = 16
    num_layers: int = 1
    init_std: float = 0.3
    recipes: tuple[str, ...] = ("grpo", "gspo", "sapo", "vespo", "tis")
    staleness: tuple[int, ...] = (1, 8)
    minibatch_size: int = 16
    group_size: int = 4
    lag: int = 1
    lr: float = 0.03
    max_grad_norm: float | None = 1.0
    steps: int = 48
    response_length: int = 3
    precision: str | None = "bf16"
    eval_every: int = 8
    n_prompts: int = 4
    target: int = 1
    seeds: tuple[int, ...] = tuple(range(8))
    compare: bool = True

    def __post_init__(self):
        sim_curves.check_grid(self.recipes, staleness=self.staleness, seeds=self.seeds)


def config(small: bool = False) -> Config:
    if small:
        return Config(
            vocab_size=6,
            hidden_size=8,
            recipes=("grpo", "vespo", "tis"),
            staleness=(1, 4),
            minibatch_size=8,
            steps=8,
            eval_every=4,
            response_length=2,
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


def _hyperparams(mapping: str, preset) -> tuple:
    """A mapping's preset (e.g. GSPO "paper") as the loss's keyword pairs."""
    from simkit import mappings

    if preset is None:
        return ()
    m = mappings.get(mapping, preset=preset)
    return tuple((f.name, getattr(m, f.name)) for f in dataclasses.fields(m))


def lm_config(cfg: Config, name: str, N: int):
    """The :class:`~simkit.lm.train.LMTrainConfig` of one (recipe, N) run (exact J)."""
    from simkit.lm.train import LMTrainConfig

    r = RECIPES[name]
    composed = {}
    if r.correction is not None:
        composed = dict(correction=r.correction, mode=r.mode)
    return LMTrainConfig(
        mapping=r.mapping,
        hyperparams=_hyperparams(r.mapping, r.preset),
        aggregation=r.aggregation,
        minibatches=N,
        exact_J=True,
        **composed,
        **train_fields(cfg),
    )


def train_fields(cfg: Config) -> dict:
    """The fields of :class:`~simkit.lm.train.LMTrainConfig` that ``cfg`` sets, by name."""
    from simkit.lm.train import LMTrainConfig

    names = [f.name for f in dataclasses.fields(LMTrainConfig)]
    return {name: getattr(cfg, name) for name in names if hasattr(cfg, name)}


def run_grid(cfg: Config) -> pd.DataFrame:
    """Every (recipe, N, seed) LM run's table, with those three columns; one torch thread."""
    import torch

    from simkit.lm.train import train_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tables = []
    try:
        for name in cfg.recipes:
            for N in cfg.staleness:
                for seed in cfg.seeds:
                    t = train_lm(_model(cfg, seed), lm_config(cfg, name, N), seed=seed)
                    tables.append(t.assign(recipe=name, N=N, seed=seed))
    finally:
        torch.set_num_threads(threads)
    return pd.concat(tables, ignore_index=True)


# --- the twin -------------------------------------------------------------------------------


def twin_environment(cfg: Config, J0: float):
    """``at_least_k(V, T, k = 1, hit = target)`` with the target's logit shifted by the c
    (bisection, 60 halvings) that makes J(π₀) = ``J0``, the LM's mean exact J(π₀)."""
    from simkit.envs import TokenMDP

    base = TokenMDP.at_least_k(V=cfg.vocab_size, T=cfg.response_length, k=1, hit=cfg.target, seed=0)

    def shifted(c):
        logits = np.array(base.logits, dtype=np.float64)
        logits[..., cfg.target] += c
        return base.with_logits(logits)

    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if shifted(mid).J() < J0 else (lo, mid)
    return shifted((lo + hi) / 2)


def twin_config(cfg: Config, name: str, N: int):
    """The simulator's :class:`~simkit.train.TrainConfig` of one (recipe, N) twin run."""
    from simkit.train import Mismatch, TrainConfig

    return TrainConfig(
        recipe(name, cfg.group_size),
        steps=cfg.steps,
        batch=N * cfg.minibatch_size,
        minibatches=N,
        lag_updates=cfg.lag * N,
        lr=cfg.lr,
        max_grad_norm=cfg.max_grad_norm,
        mismatch=Mismatch(precision=cfg.precision),
        record_every=cfg.eval_every,
        parameterization="features",
        features=cfg.hidden_size,
        feature_rank=max(1, cfg.hidden_size // 4),
    )


def run_twin(cfg: Config, J0: float) -> pd.DataFrame:
    """Every (recipe, N, seed) twin run's recorded rows (step, J), with those columns."""
    from simkit.train import train

    env = twin_environment(cfg, J0)
    tables = []
    for name in cfg.recipes:
        for N in cfg.staleness:
            for seed in cfg.seeds:
                t = train(env, twin_config(cfg, name, N), seed=seed)
                t = t[t["recorded"]][["step", "recorded", "J"]]
                tables.append(t.assign(recipe=name, N=N, seed=seed))
    return pd.concat(tables, ignore_index=True)


# --- summaries and the comparison -----------------------------------------------------------


def final_J(table: pd.DataFrame, steps: int) -> pd.DataFrame:
    """Per (recipe, N, seed): J_final, the mean recorded J over the last
    :data:`~simkit.train.analysis.TAIL_FRACTION` of the steps (the last record if none)."""
    rec = table[table["recorded"]]
    tail = steps - max(1, math.ceil(TAIL_FRACTION * steps))
    rows = []
    for (r, N, seed), g in rec.groupby(["recipe", "N", "seed"], sort=False):
        part = g[g["step"] >= tail]
        J = part["J"].mean() if len(part) else g.sort_values("step")["J"].iloc[-1]
        rows.append({"recipe": r, "N": N, "seed": seed, "J_final": float(J), "collapsed": False})
    return pd.DataFrame(rows)


def summary_of(per_seed: pd.DataFrame) -> pd.DataFrame:
    """Per (recipe, N): mean ± SE over seeds of J_final
    (:func:`simkit.figures.staleness_curves.seed_means`)."""
    return sim_curves.seed_means(per_seed, ["recipe", "N"], ("J_final",))


def curves_of(table: pd.DataFrame) -> pd.DataFrame:
    """Recorded J per (recipe, N, step): mean over seeds and its SE (sd/√seeds)."""
    rec = table[table["recorded"]]
    g = rec.groupby(["recipe", "N", "step"], sort=False)
    out = g.agg(J=("J", "mean"), sd=("J", "std"), n=("J", "size")).reset_index()
    out["se"] = out.pop("sd") / np.sqrt(out["n"])
    return out


def _finals(per_seed: pd.DataFrame, N: int, recipes) -> list[np.ndarray]:
    """The per-seed J_final of each recipe at N (one array per recipe, in ``recipes`` order)."""
    at_n = per_seed[per_seed["N"] == N]
    return [at_n[at_n["recipe"] == r]["J_final"].to_numpy() for r in recipes]


def _means(finals: list[np.ndarray], rng=None) -> np.ndarray:
    """Mean J_final per recipe from :func:`_finals` (seeds resampled with replacement when
    ``rng``: one ``rng.integers`` draw per recipe, in order)."""
    out = []
    for v in finals:
        if rng is not None:
            v = v[rng.integers(0, len(v), len(v))]
        out.append(v.mean())
    return np.asarray(out)


def kendall_tau(a, b) -> float:
    """Kendall τ-b between two score vectors (NaN when either is constant)."""
    from scipy.stats import kendalltau

    tau = kendalltau(a, b).statistic
    return float(tau) if np.isfinite(tau) else math.nan


def compare(lm, other, recipes, N_lm: int, N_other: int, seed: int = 0) -> dict:
    """Kendall τ-b between the LM's final-J means at ``N_lm`` and ``other``'s at ``N_other``
    (per-seed tables), its 95 % percentile interval over :data:`BOOTSTRAP` resamples of the
    seeds of both sides, and the pairs resolved on both sides (difference > 2 combined SE)
    with how many of them agree in sign."""
    fa, fb = _finals(lm, N_lm, recipes), _finals(other, N_other, recipes)  # filtered once
    a, b = _means(fa), _means(fb)
    rng = np.random.default_rng(seed)
    taus = [kendall_tau(_means(fa, rng=rng), _means(fb, rng=rng)) for _ in range(BOOTSTRAP)]
    taus = np.asarray(taus)
    taus = taus[np.isfinite(taus)]
    lo, hi = np.quantile(taus, [0.025, 0.975]) if len(taus) else (math.nan, math.nan)
    sa, sb = (summary_of(t).set_index(["recipe", "N"]) for t in (lm, other))
    resolved = agree = 0
    for x, y in combinations(recipes, 2):
        ok = True
        signs = []
        for s, N in ((sa, N_lm), (sb, N_other)):
            d = s.loc[(x, N), "J_final"] - s.loc[(y, N), "J_final"]
            se = math.hypot(s.loc[(x, N), "J_final_se"], s.loc[(y, N), "J_final_se"])
            ok &= bool(np.isfinite(se) and abs(d) > 2 * se)
            signs.append(np.sign(d))
        if ok:
            resolved += 1
            agree += int(signs[0] == signs[1])
    return {
        "tau": kendall_tau(a, b),
        "lo": float(lo),
        "hi": float(hi),
        "resolved": resolved,
        "agree": agree,
        "pairs": len(recipes) * (len(recipes) - 1) // 2,
    }


def _tau_text(c: dict) -> str:
    tau = "n/a (a side is all ties)" if not np.isfinite(c["tau"]) else f"{c['tau']:.2f}"
    return (
        f"Kendall τ = {tau} [95 % bootstrap {c['lo']:.2f}, {c['hi']:.2f}]; "
        f"{c['resolved']} of {c['pairs']} pairs resolved on both sides (> 2 SE), "
        f"{c['agree']} of them agree"
    )


def make_notes(cfg: Config, lm: pd.DataFrame, sim, table: pd.DataFrame, J0: float):
    """The notes: setting, the exact J(π₀), the orderings, τ for the twin and the trivial
    predictor (``lm``, ``sim``: per-seed J_final tables; ``sim`` None without comparison)."""
    N_max, N_min = max(cfg.staleness), min(cfg.staleness)
    notes = [
        f"LM: tiny Llama (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_layers} "
        f"layer(s)), token task (R = 1 iff token {cfg.target} occurs in the "
        f"{cfg.response_length}-token response, {cfg.n_prompts} training prompts); J exact on "
        f"held-out prompts (every target-free response enumerated); J(π₀) = {J0:.3f} (mean over "
        "seeds).",
        f"Schedule (both sides): N ∈ {{{', '.join(map(str, cfg.staleness))}}} mini-batches of "
        f"{cfg.minibatch_size} responses (groups of {cfg.group_size}), lag {cfg.lag} rollout(s) "
        f"= {cfg.lag}·N optimizer updates, engine {cfg.precision or 'fp32'} logits, "
        f"{cfg.steps} Adam updates (lr {cfg.lr:g}, gradient norm clipped to "
        f"{cfg.max_grad_norm}), J every {cfg.eval_every} steps; seeds "
        f"{', '.join(map(str, cfg.seeds))}.",
        f"max |log π − log μ| reached (LM): {table['max_abs_log_ratio'].max():.3g} nats.",
    ]
    s_lm = summary_of(lm)
    for N in cfg.staleness:
        part = s_lm[s_lm["N"] == N]
        notes.append(f"LM final J at N = {N} (mean ± SE): {sim_curves.ordering(part)}.")
    if sim is None:
        notes.append("No simulator comparison (Config.compare = False).")
        return tuple(notes)
    s_sim = summary_of(sim)
    notes.append(
        f"Twin: TokenMDP.at_least_k(V = {cfg.vocab_size}, T = {cfg.response_length}, k = 1, "
        f"hit = {cfg.target}) with J(π₀) matched to the LM's, features parameters (d = "
        f"{cfg.hidden_size}); final J at N = {N_max}: "
        f"{sim_curves.ordering(s_sim[s_sim['N'] == N_max])}."
    )
    recipes = list(cfg.recipes)
    twin = compare(lm, sim, recipes, N_max, N_max)
    notes.append(f"Twin vs LM at N = {N_max}: {_tau_text(twin)}.")
    trivial = compare(lm, lm, recipes, N_max, N_min, seed=1)
    notes.append(
        f"Trivial predictor (the LM's own ordering at N = {N_min}) vs LM at N = {N_max}: "
        f"{_tau_text(trivial)}."
    )
    return tuple(notes)


@dataclass(frozen=True)
class Data:
    """``table``: every step of every LM run (:data:`simkit.lm.train.COLUMNS`, recipe, N,
    seed); ``curves``: LM J mean and SE per (recipe, N, step); ``summary``: LM final J per
    (recipe, N); ``sim_table`` / ``sim_curves`` / ``sim_summary``: the twin's (or None);
    ``J0``: the LM's mean exact J(π₀); ``notes``."""

    config: Config
    table: pd.DataFrame
    curves: pd.DataFrame
    summary: pd.DataFrame
    sim_table: pd.DataFrame | None
    sim_curves: pd.DataFrame | None
    sim_summary: pd.DataFrame | None
    J0: float
    notes: tuple[str, ...]


def compute(cfg: Config) -> Data:
    table = run_grid(cfg)
    J0 = float(table[(table["step"] == 0) & table["recorded"]]["J"].mean())
    lm = final_J(table, cfg.steps)
    sim_table = sim = None
    if cfg.compare:
        sim_table = run_twin(cfg, J0)
        sim = final_J(sim_table, cfg.steps)
    return Data(
        config=cfg,
        table=table,
        curves=curves_of(table),
        summary=summary_of(lm),
        sim_table=sim_table,
        sim_curves=None if sim_table is None else curves_of(sim_table),
        sim_summary=None if sim is None else summary_of(sim),
        J0=J0,
        notes=make_notes(cfg, lm, sim, table, J0),
    )


def draw(data: Data):
    Ns = list(data.config.staleness)
    fig, panels = sim_curves.split_figure(2.6 * len(Ns) + 1.4, 2.4, data.notes)
    axes = panels.subplots(1, len(Ns), sharex=True, sharey=True, squeeze=False).ravel()
    for ax, N in zip(axes, Ns, strict=True):
        for name in data.config.recipes:
            c = data.curves[(data.curves["recipe"] == name) & (data.curves["N"] == N)]
            x = c["step"].to_numpy(float)
            sim_curves.plot_band(ax, name, x, c["J"], c["J"] - c["se"], c["J"] + c["se"])
            if data.sim_curves is not None:
                s = data.sim_curves[
                    (data.sim_curves["recipe"] == name) & (data.sim_curves["N"] == N)
                ]
                ax.plot(
                    s["step"],
                    s["J"],
                    **sim_curves.recipe_style(name, linewidth=0.8, linestyle="--", label=None),
                )
        ax.set_title(f"N = {N}")
        ax.set_xlabel("optimizer step")
    axes[0].set_ylabel("exact J (± SE); dashed: twin")
    sim_curves.recipe_legend(panels, axes[0])
    panels.suptitle(
        f"tiny Llama (vocab {data.config.vocab_size}, hidden {data.config.hidden_size}) and its "
        f"simulator twin, mean of {len(data.config.seeds)} seeds, ±SE band",
        fontsize=8,
    )
    return fig


__all__ = ["BOOTSTRAP", "CAPTION", "NAME", "TITLE", "Config", "Data", "compute", "config", "draw"]
_ = recipe_label
