"""How much staleness is tolerable, and what to do with stale samples: exact, under a lag
distribution.

Setting: a token MDP (``TokenMDP.answer_correct``, small enough to enumerate) and the
versions its trainer went through: π_a = softmax(θ − η·Σ ∇J) after a exact gradient steps
backwards from π (:func:`simkit.envs.stale.stale_policy`, a = 0 … ``max_lag``). A batch mixes
samples of several ages with a truncated geometric lag distribution
(:func:`simkit.envs.versions.lag_weights`), whose parameter is swept so that the mean age goes
from near 0 to a few updates. For each batch the strategies a trainer can take, with token TIS
(``tis_token``, C = 2) as the correction where there is one:

- ``keep, no IS``: train on every sample as if on-policy (``naive``);
- ``keep, single-version IS``: correct with the one version the trainer assumes for every
  sample (the version one update old, a one-step-off pipeline's belief);
- ``keep, per-version IS``: correct each sample with the version that generated it;
- ``keep, MIS``: multiple importance sampling across versions (the batch's own next-token
  law, the balance heuristic);
- ``drop > m``: verl's ``max_off_policy_strategy="drop"`` (samples older than ``max_age`` m
  are evicted; per-version IS on the rest), and the same without IS; ``wait ≤ m``: verl's
  ``wait`` (the samples that would be older are trained at age m; per-version IS);
- decoupled PPO (``ppo_clip`` on π/π_old × ``tis_token`` on π_old/μ) on its first mini-batch,
  with π_old recomputed (π_old = π: the PPO ratio is 1 and the correction carries π/μ), or
  AReaL's log-linear approximation of it (``prox_logp_method="loglinear"``, α = a/(a + 1)
  for a token of age a: :func:`simkit.envs.versions.loglinear_alpha`).

Every number is exact (:func:`simkit.experiment.versions.versioned_table`, by enumeration): the
relative bias ‖E ĝ − ∇J‖/‖∇J‖ and the scale-free error ``rel_mse_scaled`` at batch size n.
A third panel shows what ``drop`` does to a difficulty-mixed prompt set where slow (hard)
prompts are old prompts: their share of the trained batch against max_age (exact, from the
two lag distributions), with ``wait``/keep (share unchanged) for reference. An ensemble of
random instances (random logits of the same automaton) at one lag distribution gives the
rankings as fractions. A fourth and a fifth panel train (:func:`simkit.train.train`,
asynchronous ``TrainConfig``: a geometric lag over rollouts per prompt, the hard prompt's
heavier — ``prompt_lag_p`` —, ``max_off_policy`` drop / wait, one version per GRPO group) on
a difficulty-mixed prompt set (an easy and a slow hard prompt) and show the final J ± SE over
seeds of synchronous, keep, drop and wait, with and without token TIS, and of decoupled PPO ×
TIS with the recomputed or the log-linear π_old (its notes name the best and the recipes tied
with it within 2 SE), and the hard prompt's share of the trained rows (the table's
``prompt_rows``): a dropped group is gone and the batch is refilled from the next fresh
groups (verl's replay buffer), so drop's share falls as in panel (c), keep's and wait's stay
at one half.

Data: a tidy DataFrame (one row per strategy × lag parameter, plus the ensemble rows with
``part == "ensemble"``, the coverage rows with ``part == "coverage"`` and one row per training
run with ``part == "training"``); ``data.attrs["notes"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit.envs import TokenMDP
from simkit.envs import versions as V
from simkit.envs.stale import stale_policy
from simkit.estimators import Estimator
from simkit.figures import _claims, _common
from simkit.figures.staleness_curves import split_figure

NAME = "async_tolerance"
TITLE = "Asynchronous staleness: drop, keep, or correct with the right version"
CAPTION = (
    "a batch mixing policy versions of several ages (truncated geometric lag distribution, "
    "the versions are exact gradient steps of the environment's own training): exact "
    "relative gradient bias and scale-free error (rel_mse_scaled, n samples) against the "
    "mean age, for keeping stale samples without IS, with single-version IS, per-version IS "
    "or multiple IS across versions, dropping samples older than max_age, and decoupled PPO "
    "with a recomputed or log-linearly approximated π_old; the share of slow (hard) prompts "
    "that drop leaves in the batch; and the final J and the hard prompt's share of the "
    "trained rows of training runs that keep, drop or wait for stale samples (mean ± SE over "
    "seeds). Rankings over an ensemble of random instances "
    "and the training ordering are in the notes, computed from the data."
)

#: the correction of every IS strategy (token TIS, C = 2)
TIS = "tis_token"
#: a_t = 1: on-policy naive is unbiased (token-mean would scale E ĝ by 1/T)
AGGREGATION = "seq-mean-token-sum"


def strategies(max_age: int) -> dict[str, dict]:
    """The strategies of the figure (module docstring), keyed by their label."""
    ppo = {"mapping": "ppo_clip", "correction": TIS, "record": "true"}
    return {
        "keep, no IS": {"mapping": "naive", "record": "true"},
        "keep, single-version IS": {"mapping": TIS, "record": 1},
        "keep, per-version IS": {"mapping": TIS, "record": "true"},
        "keep, MIS": {"mapping": TIS, "record": "mixture"},
        f"drop > {max_age}, per-version IS": {"mapping": TIS, "record": "true", "drop": max_age},
        f"drop > {max_age}, no IS": {"mapping": "naive", "record": "true", "drop": max_age},
        f"wait ≤ {max_age}, per-version IS": {"mapping": TIS, "record": "true", "wait": max_age},
        "PPO, recomputed π_old": {**ppo, "old": "recomputed"},
        "PPO, log-linear π_old": {**ppo, "old": "loglinear"},
    }


@dataclass(frozen=True)
class Config:
    """Environment, versions, lag grid, batch size, ensemble and prompt-coverage settings."""

    V: int = 3
    T: int = 5
    seed: int = 0
    step_size: float = 2.0
    max_lag: int = 6
    p_grid: tuple[float, ...] = (0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1)
    max_age: int = 2
    n: int = 64
    ensemble: int = 20
    ensemble_p: float = 0.3
    hard_share: float = 0.5
    p_easy: float = 0.7
    p_hard: float = 0.25
    train_steps: int = 40
    train_seeds: int = 8
    train_batch: int = 48
    train_N: int = 4
    train_lr: float = 0.3
    train_lag_max: int = 4
    train_max_off: int = 4

    def __post_init__(self):
        _common.check_token_grid(self.V, T=(self.T,))
        if self.V**self.T > 4096:
            raise ValueError(f"V^T = {self.V**self.T} sequences: too many for this figure")
        if not self.step_size > 0:
            raise ValueError(f"step_size must be > 0, got {self.step_size}")
        if self.max_lag < 2 or not 1 <= self.max_age < self.max_lag:
            raise ValueError(
                f"need max_lag >= 2 and 1 <= max_age < max_lag, got max_lag={self.max_lag}, "
                f"max_age={self.max_age}"
            )
        for name in ("p_easy", "p_hard", "ensemble_p"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.p_grid or any(not 0 < p <= 1 for p in self.p_grid):
            raise ValueError(f"p_grid must be probabilities in (0, 1], got {self.p_grid}")
        if self.n < 1 or self.ensemble < 2 or not 0 < self.hard_share < 1:
            raise ValueError("need n >= 1, ensemble >= 2 and 0 < hard_share < 1")
        if self.train_seeds < 2 or self.train_steps < 2 or self.train_lag_max < 1:
            raise ValueError("need train_seeds >= 2, train_steps >= 2 and train_lag_max >= 1")


def config(small: bool = False) -> Config:
    if small:
        return Config(
            T=3,
            max_lag=3,
            p_grid=(0.8, 0.4),
            ensemble=3,
            train_steps=4,
            train_seeds=2,
            train_batch=16,
            train_N=2,
            train_lag_max=2,
            train_max_off=2,
        )
    return Config()


def _env(cfg: Config, seed: int) -> TokenMDP:
    return TokenMDP.answer_correct(cfg.V, cfg.T, seed=seed, stationary=False)


def _versions(env, cfg: Config) -> list:
    return [env.pi] + [stale_policy(env, a, cfg.step_size) for a in range(1, cfg.max_lag + 1)]


def _rows(env, versions, cfg: Config, p: float, setting: dict) -> list[dict]:
    from simkit.experiment.versions import mixture_divergences, versioned_metrics

    beh = V.mixture(env, versions, V.lag_weights("geometric", cfg.max_lag, p=p))
    grad_norm = float(np.linalg.norm(env.grad_J()))
    div = mixture_divergences(env, beh)
    rows = []
    for label, s in strategies(cfg.max_age).items():
        b = beh
        if "drop" in s:
            b = V.drop_stale(beh, s["drop"])
        elif "wait" in s:
            b = V.wait_stale(beh, s["wait"])
        est = Estimator(s["mapping"], AGGREGATION, correction=s.get("correction"), name=label)
        old = s.get("old")
        kwargs = {"record": s["record"]}
        if old == "recomputed":  # the first mini-batch: π_old is the weights π itself
            kwargs["old"] = versions[0]
        elif old == "loglinear":  # α = a/(a + 1) (AReaL's version counter)
            kwargs.update(old="loglinear", proximal_age=0, theta_lead=1)
        m = versioned_metrics(env, b, est, cfg.n, **kwargs)
        rows.append(
            {
                "strategy": label,
                "p": p,
                "mean_age": beh.mean_age(),
                "mean_age_trained": b.mean_age(),
                "wasted": b.wasted,
                "waited": b.waited,
                "rel_bias": m["bias"] / grad_norm,
                "bias": m["bias"],
                "variance": m["variance"],
                "rel_mse_scaled": m["rel_mse_scaled"],
                "cosine": m["cosine"],
                "chi2_seq_mix": div["chi2_seq"],
                "chi2_seq_versions": div["chi2_seq_versions"],
                "n": cfg.n,
                **setting,
            }
        )
    return rows


def coverage(cfg: Config) -> pd.DataFrame:
    """Share of hard prompts in the trained batch against max_age: ``drop`` and ``wait``
    (:func:`simkit.envs.versions.prompt_coverage`, exact from the two lag distributions),
    with the fraction of generated samples lost (drop) or waited for (wait)."""
    lags = [
        V.lag_weights("geometric", cfg.max_lag, p=cfg.p_easy),
        V.lag_weights("geometric", cfg.max_lag, p=cfg.p_hard),
    ]
    f = [1 - cfg.hard_share, cfg.hard_share]
    rows = []
    for m in range(cfg.max_lag + 1):
        for strategy in ("drop", "wait"):
            cov = V.prompt_coverage(f, lags, m, strategy)
            rows.append(
                {
                    "max_age": m,
                    "strategy": strategy,
                    "hard_share": float(cov["share"][1]),
                    "lost": cov["lost"] if strategy == "drop" else cov["waited"],
                }
            )
    return pd.DataFrame(rows)


#: training recipes: label -> (mapping, TrainConfig keyword arguments beyond the lag law)
def train_recipes(cfg: Config) -> dict[str, tuple[str, dict]]:
    """The training runs of the figure: decoupled PPO × token TIS with the recomputed or the
    log-linear π_old (``TrainConfig.old_logp``), then synchronous (no lag), keep, drop and
    wait, each with token TIS (per-token versions: log μ of the generating version) and
    without IS."""
    lag = {
        "lag_distribution": "geometric",
        "lag_rollouts_max": cfg.train_lag_max,
        "prompt_lag_p": (cfg.p_easy, cfg.p_hard),  # slow (hard) prompts are old prompts
    }
    m = cfg.train_max_off
    out = {}
    for how in ("recompute", "loglinear"):
        name = "recomputed" if how == "recompute" else "log-linear"
        out[f"keep, PPO × TIS, {name} π_old"] = ("ppo_clip", {**lag, "old_logp": how})
    for mapping, suffix in ((TIS, "per-version IS"), ("naive", "no IS")):
        out[f"synchronous, {suffix}"] = (mapping, {})
        out[f"keep, {suffix}"] = (mapping, lag)
        out[f"drop > {m}, {suffix}"] = (mapping, {**lag, "max_off_policy": m})
        out[f"wait ≤ {m}, {suffix}"] = (
            mapping,
            {**lag, "max_off_policy": m, "off_policy_strategy": "wait"},
        )
    return out


#: the training prompt set: at_least_k with k = 1 (easy) and k = 5 (hard), V = 4, T = 6
TRAIN_KS = (1, 5)


def train_coverage_exact(cfg: Config) -> float:
    """The hard prompt's share of an infinite stream of groups after ``drop`` in the training
    runs (:func:`simkit.envs.versions.prompt_coverage` with the two prompts' geometric lag
    laws over rollouts, max_age = ⌊train_max_off / N⌋ rollouts, prompts alternating): the
    share a large refilled batch tends to."""
    lags = [V.lag_weights("geometric", cfg.train_lag_max, p=q) for q in (cfg.p_easy, cfg.p_hard)]
    cov = V.prompt_coverage([0.5, 0.5], lags, cfg.train_max_off // cfg.train_N, "drop")
    return float(cov["share"][1])


def training(cfg: Config) -> pd.DataFrame:
    """Final J and per-prompt coverage of each training recipe (:func:`train_recipes`) per
    seed on a difficulty-mixed prompt set (``difficulty_prompts``: at_least_k with k = 1 and
    5, :data:`TRAIN_KS`) where slow prompts are old prompts: the easy prompt's groups come e
    rollouts back with geometric parameter ``p_easy``, the hard one's with ``p_hard``
    (``TrainConfig.prompt_lag_p``); GRPO (G = 4), N mini-batches. ``hard_share``: the hard
    prompt's share of the trained rows (the table's ``prompt_rows``); ``dropped_frac``: the
    share of generated samples drop evicted."""
    from simkit.train import TrainConfig, prompt_rows, train
    from simkit.train.worlds import difficulty_prompts

    env = difficulty_prompts(4, 6, ks=TRAIN_KS, seed=cfg.seed)
    rows = []
    for label, (mapping, kwargs) in train_recipes(cfg).items():
        correction = TIS if mapping == "ppo_clip" else None
        est = Estimator(mapping, advantage="grpo", group_size=4, correction=correction)
        tc = TrainConfig(
            est,
            steps=cfg.train_steps,
            batch=cfg.train_batch,
            minibatches=cfg.train_N,
            lr=cfg.train_lr,
            record_every=cfg.train_steps,
            **kwargs,
        )
        for seed in range(cfg.train_seeds):
            table = train(env, tc, seed=seed)
            generated = tc.rollouts * tc.batch + int(table.dropped.sum())
            counts = prompt_rows(table).sum(axis=0)
            rows.append(
                {
                    "strategy": label,
                    "seed": seed,
                    "J_final": float(table.J.iloc[-1]),
                    "J_start": float(table.J.iloc[0]),
                    "dropped_frac": float(table.dropped.sum()) / generated,
                    "waited_frac": float(table.waited.sum()) / (tc.rollouts * tc.batch),
                    "age_mean": float(table.policy_age_mean.mean()),
                    "hard_share": float(counts[-1] / counts.sum()),
                }
            )
    return pd.DataFrame(rows)


def compute(cfg: Config) -> pd.DataFrame:
    env = _env(cfg, cfg.seed)
    versions = _versions(env, cfg)
    rows = []
    for p in cfg.p_grid:
        rows += _rows(env, versions, cfg, p, {"part": "curves", "instance": cfg.seed})
    for k in range(cfg.ensemble):
        e = _env(cfg, cfg.seed + 1 + k)
        rows += _rows(
            e, _versions(e, cfg), cfg, cfg.ensemble_p, {"part": "ensemble", "instance": k}
        )
    data = pd.DataFrame(rows)
    cov = coverage(cfg).assign(part="coverage")
    runs = training(cfg).assign(part="training")
    data = pd.concat([data, cov, runs], ignore_index=True)
    data.attrs["notes"] = notes(data, cfg)
    return data


def _fraction(k: int, n: int) -> str:
    se = np.sqrt(k / n * (1 - k / n) / n)
    return f"{k}/{n} (SE {se:.2f})"


def ranking(data: pd.DataFrame, a: str, b: str, metric: str = "rel_mse_scaled") -> tuple:
    """(k, n): in how many ensemble instances strategy ``a`` has a smaller ``metric`` than
    ``b`` (ties, within 1e-12 relative, count for neither)."""
    ens = data[data.part == "ensemble"].pivot(index="instance", columns="strategy", values=metric)
    x, y = ens[a].to_numpy(), ens[b].to_numpy()
    wins = int(np.sum(x < y * (1 - 1e-12)))
    return wins, len(x)


def notes(data: pd.DataFrame, cfg: Config) -> tuple[str, ...]:
    """The sentences under the figure, each built from ``data``."""
    cur = data[data.part == "curves"]
    drop = next(s for s in cur.strategy.unique() if s.startswith("drop") and "per-version" in s)
    ages = cur.mean_age.unique()
    lines = [
        f"Setting: TokenMDP.answer_correct V = {cfg.V}, T = {cfg.T}; versions π_a after a exact "
        f"backward gradient steps of size {cfg.step_size:g} (a ≤ {cfg.max_lag}); truncated "
        f"geometric lags with mean age {ages.min():.2f} to {ages.max():.2f} (χ²_seq of the "
        f"mixture {cur.chi2_seq_mix.min():.3g} to {cur.chi2_seq_mix.max():.3g}); n = "
        f"{cfg.n}; exact (every sequence enumerated); correction tis_token (C = 2)."
    ]
    last = cur[cur.p == cur.p.min()].set_index("strategy")
    order = last.rel_bias.sort_values()
    lines.append(
        f"At mean age {last.mean_age.iloc[0]:.2f}, relative bias: "
        + ", ".join(f"{s} {_claims.fmt(v)}" for s, v in order.items())
        + f"; {drop} wastes {last.loc[drop, 'wasted']:.0%} of the generated samples."
    )
    pairs = [
        ("keep, per-version IS", "keep, single-version IS"),
        ("keep, MIS", "keep, per-version IS"),
        (drop, "keep, per-version IS"),
        ("PPO, log-linear π_old", "PPO, recomputed π_old"),
    ]
    ens = data[data.part == "ensemble"]
    n_inst = ens.instance.nunique()
    age = ens.mean_age.iloc[0]
    parts = []
    for a, b in pairs:
        k, n = ranking(data, a, b)
        parts.append(f"{a} < {b} in {_fraction(k, n)}")
    lines.append(
        f"Ensemble of {n_inst} random instances at mean age {age:.2f}, scale-free error "
        "(rel_mse_scaled) smaller: " + "; ".join(parts) + "."
    )
    gap = (
        ens.pivot(index="instance", columns="strategy", values="rel_bias")
        .eval("`PPO, log-linear π_old` - `PPO, recomputed π_old`")
        .to_numpy()
    )
    lines.append(
        "Log-linear π_old minus recomputed π_old, relative bias: mean "
        f"{gap.mean():+.3g} ± {gap.std(ddof=1) / np.sqrt(gap.size):.2g} (SE over instances)."
    )
    same = (
        cur.pivot(index="p", columns="strategy", values="rel_bias")
        .eval("`PPO, recomputed π_old` - `keep, per-version IS`")
        .abs()
        .max()
    )
    relation = (
        "coincides with keep, per-version IS (relative biases equal to 1e-12)"
        if same <= 1e-12
        else f"differs from keep, per-version IS by at most {same:.1g} in relative bias"
    )
    lines.append(
        "Decoupled PPO with the recomputed π_old (= π on the first mini-batch: the PPO ratio "
        f"is 1) {relation}; the "
        "log-linear π_old interpolates the ratio to (π/μ)^(1/(a+1)) for a token of age a."
    )
    cov = data[(data.part == "coverage") & (data.strategy == "drop")].set_index("max_age")
    m = cfg.max_age
    lines.append(
        f"Prompt coverage: with {cfg.hard_share:.0%} hard prompts (geometric lag p = "
        f"{cfg.p_hard:g}) and easy ones (p = {cfg.p_easy:g}), drop at max_age {m} leaves "
        f"{cov.loc[m, 'hard_share']:.0%} hard prompts in the batch and loses "
        f"{cov.loc[m, 'lost']:.0%} of the generated samples; wait keeps the share at "
        f"{cfg.hard_share:.0%} and waits for the same fraction."
    )
    lines.append(training_note(data, cfg))
    return tuple(lines)


def training_note(data: pd.DataFrame, cfg: Config) -> str:
    """Final J ± SE over seeds of every training recipe, best first, with the ties (within 2
    SE of the best) named, and the fraction of generated samples drop threw away."""
    runs = data[data.part == "training"]
    stats = runs.groupby("strategy", sort=False).J_final.agg(["mean", "std", "count"])
    stats["se"] = stats["std"] / np.sqrt(stats["count"])
    stats = stats.sort_values("mean", ascending=False)
    best = stats.index[0]
    tied = [
        s
        for s in stats.index[1:]
        if stats.loc[best, "mean"] - stats.loc[s, "mean"]
        <= 2 * np.hypot(stats.loc[best, "se"], stats.loc[s, "se"])
    ]
    dropped = runs[runs.strategy.str.startswith("drop")].dropped_frac.mean()
    text = (
        f"Training (difficulty_prompts k = {TRAIN_KS[0]} easy, k = {TRAIN_KS[1]} hard; GRPO "
        f"G = 4, N = {cfg.train_N}, lr {cfg.train_lr:g}, {cfg.train_steps} steps, geometric lag "
        f"up to {cfg.train_lag_max} rollouts, p = {cfg.p_easy:g} for the easy prompt and "
        f"{cfg.p_hard:g} for the slow hard one; {int(stats['count'].iloc[0])} seeds), final "
        "J ± SE: "
        + ", ".join(f"{s} {r['mean']:.3f} ± {r['se']:.3f}" for s, r in stats.iterrows())
        + f". Best: {best}"
    )
    text += f", tied within 2 SE with {_claims.name_list(tied)}" if tied else ", no tie within 2 SE"
    text += f"; drop threw away {dropped:.0%} of the generated samples. "
    return text + coverage_note(runs, cfg)


def coverage_share(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean ± SE over seeds of the hard prompt's share of the trained rows, per strategy kind
    (``keep`` / ``drop`` / ``wait``: the recipes whose label starts so, averaged within a seed
    first — recipes of one seed share their version draws)."""
    kind = runs.strategy.str.split(" ").str[0].str.rstrip(",").rename("kind")
    sel = kind.isin(["keep", "drop", "wait"])
    per_seed = runs[sel].groupby([kind[sel], runs.seed[sel]]).hard_share.mean()
    g = per_seed.groupby(level="kind").agg(["mean", "std", "count"])
    g["se"] = g["std"] / np.sqrt(g["count"])
    return g.reindex(["keep", "drop", "wait"])


def coverage_note(runs: pd.DataFrame, cfg: Config) -> str:
    """The hard prompt's share of the trained rows under keep, drop and wait (mean ± SE over
    seeds), drop's difference from keep in SE, and the stream limit of drop
    (:func:`train_coverage_exact`)."""
    c = coverage_share(runs)
    diff = c.loc["keep", "mean"] - c.loc["drop", "mean"]
    se = float(np.hypot(c.loc["keep", "se"], c.loc["drop", "se"]))
    z = diff / se if se > 0 else np.inf
    parts = ", ".join(f"{k} {r['mean']:.3f} ± {r['se']:.3f}" for k, r in c.iterrows())
    verdict = (
        f"drop trains {diff:.3f} less of the hard prompt than keep ({z:.1f} SE)"
        if diff > 2 * se
        else f"drop's share is within 2 SE of keep's (difference {diff:.3f} ± {se:.3f})"
    )
    return (
        f"Coverage in training: the hard prompt's share of the trained rows is {parts} "
        f"(mean ± SE over seeds; a dropped group is gone and the batch is refilled from the next "
        f"fresh groups, as verl's replay buffer does); {verdict}; an infinite refilled stream "
        f"would give {train_coverage_exact(cfg):.3f} (exact)."
    )


def draw(data: pd.DataFrame):
    fig, sub = split_figure(7.4, 5.6, data.attrs.get("notes", ()))
    axes = sub.subplots(2, 3).ravel()
    cur = data[data.part == "curves"]
    colors = dict(zip(cur.strategy.unique(), [f"C{i}" for i in range(10)], strict=False))
    for metric, ax, label in (
        ("rel_bias", axes[0], r"relative bias $\|\mathbb{E}\hat g-\nabla J\|/\|\nabla J\|$"),
        ("rel_mse_scaled", axes[1], "scale-free error rel_mse_scaled"),
    ):
        for k, (name, part) in enumerate(cur.groupby("strategy", sort=False)):
            part = part.sort_values("mean_age")
            ax.plot(
                part.mean_age,
                _common.finite_positive(part[metric]),
                marker="os^vD<>p"[k % 8],
                markersize=3,
                linewidth=1.1,
                linestyle="--" if name.startswith("drop") else "-",
                color=colors[name],
                label=name,
            )
        ax.set_yscale("log")
        ax.set_xlabel("mean age of a sample (updates)")
        ax.set_ylabel(label, fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    sub.legend(handles, labels, loc="outside lower center", ncol=5, fontsize=5.2)
    cov = data[data.part == "coverage"]
    ax = axes[2]
    for name, part in cov.groupby("strategy", sort=False):
        ax.plot(part.max_age, part.hard_share, marker="o", markersize=3, label=name)
    ax.set_xlabel("max_age (updates)")
    ax.set_ylabel("share of hard prompts trained", fontsize=7)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6)
    runs = data[data.part == "training"]
    stats = runs.groupby("strategy", sort=False).J_final.agg(["mean", "std", "count"])
    ax = axes[3]
    y = np.arange(len(stats))
    _mean_se_points(ax, stats, y, "C0")
    ax.set_yticks(y, stats.index, fontsize=5.5)
    ax.invert_yaxis()
    ax.set_xlabel("final J (mean ± SE over seeds)")
    ax = axes[4]
    share = runs.groupby("strategy", sort=False).hard_share.agg(["mean", "std", "count"])
    _mean_se_points(ax, share, y, "C1")
    ax.axvline(0.5, color="0.6", linewidth=0.8)
    ax.set_yticks(y, [""] * len(y))
    ax.invert_yaxis()
    ax.set_xlabel("hard prompt's share of trained rows", fontsize=7)
    axes[5].axis("off")
    for ax, letter in zip(axes[:5], "abcde", strict=True):
        _common.panel_label(ax, letter)
    sub.suptitle(TITLE, fontsize=9)
    return fig


def _mean_se_points(ax, stats, y, color: str) -> None:
    """One point per row of ``stats`` (columns mean, std, count over seeds) at height ``y``,
    with its standard error (std/√count) as a horizontal bar."""
    ax.errorbar(
        stats["mean"],
        y,
        xerr=stats["std"] / np.sqrt(stats["count"]),
        fmt="o",
        markersize=3,
        capsize=2,
        color=color,
    )
