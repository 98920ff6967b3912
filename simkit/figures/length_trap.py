"""The length trap, for rollouts that come from μ: what a sequence mask keeps, and of what.

rl-collapse (Liu, Li et al. 2025, part 3) argues that when every token ratio is about ρ̄ > 1 the
sequence ratio grows like W ≈ ρ̄^T, so the one-sided sequence mask 1[W ≤ C] (sequence MIS)
"rejects every sequence longer than T* = log C / log ρ̄" (:func:`simkit.theory.length_trap_T`).
That holds for sequences drawn from **π**: under π, E_π[log r_t] = KL(π‖μ) > 0, so log W drifts
up and ρ̄ = exp(KL(π‖μ)) is the per-token geometric-mean ratio *under π*. The trainer's rollouts
come from **μ**, and there E_μ[W] = 1 (E_μ[r_t] = 1 at every position), so by Markov's
inequality P_μ(W > C) ≤ 1/C at every T: the mask keeps at least 1 − 1/C of μ's samples,
however long; under μ, log W drifts *down* (E_μ[log r_t] = −KL(μ‖π)). What collapses is the
share of π's probability mass that the kept samples carry,

    E_μ[W·1{W ≤ C}] = P_π(W ≤ C),

which falls below ½ near T* and to 0 beyond. A two-sided mask 1[c_lo ≤ W ≤ c_hi] rejects μ's
samples through its *lower* bound (W → 0 under μ), and the length-normalised Geo-Mask
1[lo ≤ s ≤ hi] on s = exp(mean_t log r_t) keeps almost everything on both measures.

Setting: a token MDP of T i.i.d. tokens (:meth:`simkit.envs.TokenMDP.iid`, V tokens, seeded π
shared by every position) and μ dialed per token to KL(π‖μ) = ``kl_tok`` by
:func:`simkit.shifts.dial` (the same μ at every position). Three masks, the registered mappings
``mis_seq`` (c_low = 0, c_high = C: one-sided; and c_low, c_high two-sided) and ``geo_mask``;
a sequence is *kept* when the mask's band holds (:func:`kept`, in log space, equal to a
non-zero coefficient of the mapping). Two measures per (T, mask):

- ``mu_samples``: P_μ(kept), the fraction of μ's rollouts the mask keeps;
- ``pi_mass``: E_μ[W·1{kept}] = P_π(kept), the share of π's mass the kept rollouts carry.

Computation: W depends on a sequence only through its token counts, so both measures are
*exact* by enumerating the C(T+V−1, V−1) count vectors with their multinomial probabilities
under μ and π (V = 2: T + 1 binomial atoms, exact at any T), wherever that number is within
``count_budget``; beyond it (larger V), Monte Carlo. Monte Carlo points drawn on top come from
sequences sampled by :meth:`TokenMDP.sample` — from μ for ``mu_samples``, from π for
``pi_mass`` (the identity above) — with binomial standard errors.

Data: :class:`Data` with ``kept`` (tidy DataFrame: ``T``, ``mask``, ``measure``, ``fraction``,
``se`` (0 where exact), ``method`` (``"exact"`` or ``"monte_carlo"``), ``n`` (draws; 0 where
exact)), ``rejected`` (``T``, ``mask``, ``measure``, ``side`` (``"low"``/``"high"``),
``fraction``, ``method``: which end of the band rejects), ``masks`` (mask → label),
``rho_bar``, ``t_star``, ``kl_tok`` (KL(π‖μ) per token), ``kl_mu_pi`` (KL(μ‖π) per token),
``markov_floor`` (1 − 1/C), ``notes`` (sentences built from the data by :func:`notes`) and
``config``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.special import ndtr

from simkit import divergence, mappings, shifts, theory
from simkit.envs import TokenMDP
from simkit.figures import _common, style
from simkit.figures.staleness_curves import split_figure
from simkit.figures.vespo_bound import count_vectors, log_multinomial

NAME = "length_trap"
TITLE = "The length trap, for rollouts drawn from μ"
CAPTION = (
    "sequence masks on T i.i.d. tokens of a token MDP at a fixed per-token KL(π‖μ): (a) the "
    "fraction of μ's rollouts each mask keeps — for the one-sided mask W ≤ C at least 1 − 1/C at "
    "every T (Markov: E_μ[W] = 1); (b) the share of π's mass the kept rollouts carry, "
    "E_μ[W·1{kept}] = P_π(kept), which is what the one-sided mask loses beyond T* = log C / log "
    "ρ̄ (ρ̄ = e^KL(π‖μ), the token ratio's geometric mean under π). Curves exact (enumeration of "
    "token counts), points Monte Carlo (sequences sampled from μ, resp. π) with ±2 SE; the "
    "measured numbers are in the notes under the panels."
)

#: the three masks (ids of the ``mask`` column; :func:`mask_mappings` builds their mappings)
MASKS = ("mis_seq_one_sided", "mis_seq_two_sided", "geo_mask")
MEASURES = ("mu_samples", "pi_mass")
#: the default T grid: 53 log-spaced lengths 1…8192 and the reported ones
DEFAULT_LENGTHS = (
    *(int(t) for t in np.unique(np.geomspace(1, 8192, 53).round().astype(int))),
    256,
    1024,
    4096,
)

__all__ = [
    "MASKS",
    "MEASURES",
    "Config",
    "Data",
    "compute",
    "config",
    "draw",
    "kept",
    "kept_fraction_geo_mask",
    "kept_fraction_mis_seq",
    "notes",
]


@dataclass(frozen=True)
class Config:
    """Environment, mismatch, the masks' thresholds, lengths and the Monte Carlo size.

    ``lengths``: the T grid of the exact curves; ``report_lengths``: the lengths quoted in the
    notes (must be in ``lengths``); ``mc_lengths``, ``n_mc``: the Monte Carlo points
    (``n_mc`` sequences per (T, measure)); ``count_budget``: the largest number of token-count
    vectors enumerated per T (beyond it a length is Monte Carlo only).
    """

    V: int = 2
    seed: int = 0
    scale: float = 1.0
    kl_tok: float = 0.002
    shift_family: str = "logit_noise"
    c: float = 5.0
    two_sided: tuple[float, float] = (0.5, 3.0)
    geo: tuple[float, float] = (0.5, 2.0)
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    report_lengths: tuple[int, ...] = (256, 1024, 4096)
    mc_lengths: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    n_mc: int = 2000
    count_budget: int = 2_000_000

    def __post_init__(self):
        if isinstance(self.V, bool) or not isinstance(self.V, int) or self.V < 2:
            raise ValueError(f"V must be an integer >= 2, got {self.V!r}")
        if not self.kl_tok > 0:
            raise ValueError(f"kl_tok must be > 0, got {self.kl_tok}")
        if not self.c > 1:
            raise ValueError(f"c (one-sided mask threshold on W) must be > 1, got {self.c}")
        for name, (lo, hi) in (("two_sided", self.two_sided), ("geo", self.geo)):
            if not 0 < lo < 1 < hi:
                raise ValueError(f"{name} must be (lo, hi) with 0 < lo < 1 < hi, got {(lo, hi)}")
        for name in ("lengths", "mc_lengths"):
            values = getattr(self, name)
            if any(isinstance(t, bool) or not isinstance(t, int | np.integer) for t in values):
                raise ValueError(f"{name} must be positive integers, got {values}")
            if name == "lengths" and not values:
                raise ValueError("lengths must not be empty")
            if values and min(values) < 1:
                raise ValueError(f"{name} must be positive integers, got {values}")
        missing = sorted(set(self.report_lengths) - set(self.lengths))
        if not self.report_lengths or missing:
            raise ValueError(
                f"report_lengths must be a non-empty subset of lengths; not in lengths: {missing}"
            )
        if self.mc_lengths and self.n_mc < 2:
            raise ValueError(f"n_mc must be >= 2, got {self.n_mc}")
        if self.count_budget < 1:
            raise ValueError(f"count_budget must be >= 1, got {self.count_budget}")

    @property
    def grid(self) -> np.ndarray:
        """The sorted unique lengths of the exact curves."""
        return np.unique(np.asarray(self.lengths, dtype=np.int64))


def config(small: bool = False) -> Config:
    if small:
        return Config(
            lengths=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            report_lengths=(16, 256, 1024),
            mc_lengths=(16, 256),
            n_mc=400,
        )
    return Config()


@dataclass(frozen=True)
class Data:
    """What :func:`compute` returns (module docstring)."""

    kept: pd.DataFrame
    rejected: pd.DataFrame
    masks: dict
    rho_bar: float
    t_star: float
    kl_tok: float
    kl_mu_pi: float
    markov_floor: float
    notes: tuple[str, ...]
    config: Config


def kept_fraction_mis_seq(T, rho_bar: float, sigma: float, c: float) -> np.ndarray:
    """P_π(W ≤ C) = Φ((log C − T log ρ̄)/(σ√T)) for T i.i.d. N(log ρ̄, σ²) token log-ratios.

    A Gaussian model of sequences drawn from **π** (ρ̄ = e^KL(π‖μ) > 1 is the geometric-mean
    token ratio under π): the share of π's mass that the one-sided mask keeps, half of it at
    T* = log C / log ρ̄. It is not the fraction of μ's rollouts kept (≥ 1 − 1/C at every T,
    module docstring). T: (K,).
    """
    t = np.asarray(T, dtype=np.float64)
    return ndtr((math.log(c) - t * math.log(rho_bar)) / (sigma * np.sqrt(t)))


def kept_fraction_geo_mask(T, rho_bar: float, sigma: float, low: float, high: float) -> np.ndarray:
    """P(lo ≤ s ≤ hi) with log s ~ N(log ρ̄, σ²/T): Geo-Mask under the same Gaussian model of
    :func:`kept_fraction_mis_seq`. T: (K,)."""
    t = np.asarray(T, dtype=np.float64)
    scale = np.sqrt(t) / sigma
    mean = math.log(rho_bar)
    return ndtr((math.log(high) - mean) * scale) - ndtr((math.log(low) - mean) * scale)


def mask_mappings(cfg: Config) -> dict:
    """The three registered mappings, by mask id (:data:`MASKS`)."""
    return {
        "mis_seq_one_sided": mappings.get("mis_seq", c_low=0.0, c_high=cfg.c),
        "mis_seq_two_sided": mappings.get(
            "mis_seq", c_low=cfg.two_sided[0], c_high=cfg.two_sided[1]
        ),
        "geo_mask": mappings.get("geo_mask", c_low=cfg.geo[0], c_high=cfg.geo[1]),
    }


def mask_labels(cfg: Config) -> dict:
    lo, hi = cfg.two_sided
    return {
        "mis_seq_one_sided": f"mis_seq, W ≤ {cfg.c:g}",
        "mis_seq_two_sided": f"mis_seq, {lo:g} ≤ W ≤ {hi:g}",
        "geo_mask": f"geo_mask, {cfg.geo[0]:g} ≤ s ≤ {cfg.geo[1]:g}",
    }


def _band_statistic(mapping, log_w, lengths):
    """(the mask's log statistic, log c_low, log c_high): log W for mis_seq, log s for geo_mask."""
    with np.errstate(divide="ignore"):
        lo, hi = (
            math.log(mapping.c_low) if mapping.c_low > 0 else -math.inf,
            math.log(mapping.c_high),
        )
    if mapping.name == "geo_mask":
        return np.asarray(log_w) / np.maximum(np.asarray(lengths), 1), lo, hi
    if mapping.name == "mis_seq":
        return np.asarray(log_w), lo, hi
    raise ValueError(f"mapping must be 'mis_seq' or 'geo_mask', got {mapping.name!r}")


def kept(mapping, log_w, lengths) -> np.ndarray:
    """Whether the sequence mask ``mapping`` keeps sequences of log-ratio ``log_w`` and length
    ``lengths`` (broadcast, (…,) → bool (…)): c_low ≤ W ≤ c_high for ``mis_seq``,
    c_low ≤ exp(log W / T) ≤ c_high for ``geo_mask``.

    The band test of the mappings' coefficients, in log space (so a W that underflows to 0 is
    still kept by a one-sided mask): equal to ``mapping.coefficients(...) != 0`` wherever W is
    representable.
    """
    stat, lo, hi = _band_statistic(mapping, log_w, lengths)
    return (stat >= lo) & (stat <= hi)


def _side(mapping, log_w, lengths) -> tuple[np.ndarray, np.ndarray]:
    """(rejected below c_low, rejected above c_high) as bool arrays."""
    stat, lo, hi = _band_statistic(mapping, log_w, lengths)
    return stat < lo, stat > hi


def _token_pair(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """(π, μ) per token, (V,) each: π of ``TokenMDP.iid`` and μ dialed to KL = ``kl_tok``."""
    pi = TokenMDP.iid(V=cfg.V, T=1, seed=cfg.seed, scale=cfg.scale).pi[0, 0]
    mu = shifts.dial(pi, cfg.kl_tok, divergence="kl", family=cfg.shift_family)
    return np.asarray(pi), np.asarray(mu)


def _exact_rows(cfg, masks, log_ratio, pi, mu, T) -> tuple[list, list]:
    counts = count_vectors(int(T), cfg.V)
    log_w = counts @ log_ratio
    weights = {
        "mu_samples": np.exp(log_multinomial(counts, mu)),
        "pi_mass": np.exp(log_multinomial(counts, pi)),
    }
    rows, sides = [], []
    for mask, mapping in masks.items():
        keep = kept(mapping, log_w, T)
        low, high = _side(mapping, log_w, T)
        for measure, p in weights.items():
            rows.append(
                {
                    "T": int(T),
                    "mask": mask,
                    "measure": measure,
                    "fraction": float(p @ keep),
                    "se": 0.0,
                    "method": "exact",
                    "n": 0,
                }
            )
            for side, rejected in (("low", low), ("high", high)):
                sides.append(
                    {
                        "T": int(T),
                        "mask": mask,
                        "measure": measure,
                        "side": side,
                        "fraction": float(p @ rejected),
                        "method": "exact",
                    }
                )
    return rows, sides


def _mc_rows(cfg, masks, pi_tok, mu_tok, T, rng) -> tuple[list, list]:
    env = TokenMDP.iid(V=cfg.V, T=int(T), seed=cfg.seed, scale=cfg.scale)
    policies = {
        "mu_samples": np.broadcast_to(mu_tok, env.pi.shape),
        "pi_mass": np.broadcast_to(pi_tok, env.pi.shape),
    }
    log_r_tok = np.log(pi_tok) - np.log(mu_tok)
    rows, sides = [], []
    for measure, policy in policies.items():
        drawn = env.sample(policy, cfg.n_mc, rng)
        if measure == "mu_samples":  # the sampler's own log π − log μ of the drawn tokens
            log_w = drawn.log_ratio.sum(axis=-1)
        else:  # sequences drawn from π: the ratio π/μ of their tokens
            log_w = np.where(drawn.mask, log_r_tok[drawn.actions], 0.0).sum(axis=-1)
        lengths = drawn.lengths
        for mask, mapping in masks.items():
            keep = kept(mapping, log_w, lengths)
            p = float(keep.mean())
            rows.append(
                {
                    "T": int(T),
                    "mask": mask,
                    "measure": measure,
                    "fraction": p,
                    "se": math.sqrt(p * (1 - p) / cfg.n_mc),
                    "method": "monte_carlo",
                    "n": cfg.n_mc,
                }
            )
            low, high = _side(mapping, log_w, lengths)
            for side, rejected in (("low", low), ("high", high)):
                sides.append(
                    {
                        "T": int(T),
                        "mask": mask,
                        "measure": measure,
                        "side": side,
                        "fraction": float(rejected.mean()),
                        "method": "monte_carlo",
                    }
                )
    return rows, sides


def compute(cfg: Config) -> Data:
    masks = mask_mappings(cfg)
    pi, mu = _token_pair(cfg)
    log_ratio = np.log(pi) - np.log(mu)
    rows, sides = [], []
    for T in cfg.grid:
        if math.comb(int(T) + cfg.V - 1, cfg.V - 1) > cfg.count_budget:
            continue  # beyond enumeration: Monte Carlo points only
        r, s = _exact_rows(cfg, masks, log_ratio, pi, mu, T)
        rows += r
        sides += s
    rng = np.random.default_rng(cfg.seed)
    for T in sorted(set(cfg.mc_lengths)):
        r, s = _mc_rows(cfg, masks, pi, mu, T, rng)
        rows += r
        sides += s
    kl_tok = float(divergence.kl(pi, mu))
    rho_bar = math.exp(kl_tok)
    data = Data(
        kept=pd.DataFrame(rows),
        rejected=pd.DataFrame(sides),
        masks=mask_labels(cfg),
        rho_bar=rho_bar,
        t_star=float(theory.length_trap_T(cfg.c, rho_bar)),
        kl_tok=kl_tok,
        kl_mu_pi=float(divergence.kl(mu, pi)),
        markov_floor=1.0 - 1.0 / cfg.c,
        notes=(),
        config=cfg,
    )
    return Data(**{**data.__dict__, "notes": notes(data)})


# --- sentences built from the data ---------------------------------------------------------------


def _curve(data: Data, mask: str, measure: str) -> pd.DataFrame:
    """The exact rows of (mask, measure), or the Monte Carlo ones where no exact row exists."""
    k = data.kept
    part = k[(k["mask"] == mask) & (k.measure == measure)]
    exact = part[part.method == "exact"]
    return (exact if len(exact) else part).sort_values("T")


def _at(part: pd.DataFrame, T: int) -> float:
    row = part[part["T"] == T]
    return float(row.fraction.iloc[0]) if len(row) else math.nan


def _series(values) -> str:
    return " → ".join(f"{v:.3g}" for v in values)


def _half_crossing(part: pd.DataFrame) -> float | None:
    """The first T (log-interpolated) at which a decreasing fraction falls below ½, or None."""
    t, f = part["T"].to_numpy(float), part.fraction.to_numpy(float)
    below = np.nonzero(f < 0.5)[0]
    if not len(below) or below[0] == 0:
        return None
    i = below[0]
    x0, x1 = math.log(t[i - 1]), math.log(t[i])
    return math.exp(x0 + (f[i - 1] - 0.5) / (f[i - 1] - f[i]) * (x1 - x0))


def setting_note(data: Data) -> str:
    cfg = data.config
    methods = set(data.kept.method)
    exact = (
        "exact at every T of the curves (enumeration of token counts)"
        if ("exact" in methods)
        else "Monte Carlo only"
    )
    mc = (
        f"; points: {cfg.n_mc} sequences drawn by TokenMDP.sample per (T, measure), ±2 SE"
        if "monte_carlo" in methods
        else ""
    )
    return (
        f"Setting: TokenMDP.iid, V = {cfg.V}, π seeded softmax (seed {cfg.seed}); μ = "
        f"{cfg.shift_family} dialed to KL(π‖μ) = {data.kl_tok:.3g} per token at every position "
        f"(KL(μ‖π) = {data.kl_mu_pi:.3g}); ρ̄ = e^KL(π‖μ) = {data.rho_bar:.4g} is the token ratio's "
        f"geometric mean under π, T* = log C / log ρ̄ = {data.t_star:.0f}; {exact}{mc}."
    )


def one_sided_note(data: Data) -> str:
    """The one-sided mask's verdict: μ-samples kept against the Markov floor, π's mass lost."""
    cfg = data.config
    lengths = list(cfg.report_lengths)
    mu = _curve(data, "mis_seq_one_sided", "mu_samples")
    pi = _curve(data, "mis_seq_one_sided", "pi_mass")
    floor = data.markov_floor
    worst = mu.loc[mu.fraction.idxmin()]
    ts = "/".join(str(t) for t in lengths)
    mu_at = "/".join(f"{_at(mu, t):.3f}" for t in lengths)
    if (mu.fraction >= floor - 1e-12).all():
        head = (
            f"W ≤ {cfg.c:g} keeps {mu_at} of μ's rollouts at T = {ts} and at least "
            f"{worst.fraction:.3f} (T = {int(worst['T'])}) at every T drawn — never below the "
            f"Markov floor 1 − 1/C = {floor:.2f} (E_μ[W] = 1)"
        )
    else:
        bad = mu[mu.fraction < floor - 1e-12]
        head = (
            f"W ≤ {cfg.c:g} keeps {mu_at} of μ's rollouts at T = {ts}, and falls BELOW the "
            f"Markov floor 1 − 1/C = {floor:.2f} at T = "
            f"{', '.join(str(int(t)) for t in bad['T'])} — inconsistent with E_μ[W] = 1"
        )
    pi_vals = [_at(pi, t) for t in lengths]
    if all(a > b for a, b in itertools.pairwise(pi_vals)):
        trend = f"falls {_series(pi_vals)}"
    else:
        trend = f"goes {_series(pi_vals)} (not monotone)"
    crossing = _half_crossing(pi)
    cross = (
        f"; it crosses ½ at T ≈ {crossing:.0f} (T* = {data.t_star:.0f})"
        if crossing is not None
        else "; it does not fall below ½ on the lengths drawn"
    )
    return (
        f"{head}. The share of π's mass the kept rollouts carry, E_μ[W·1{{W ≤ C}}], {trend}"
        f"{cross}: the mask keeps the rollouts but not what they are worth."
    )


def two_sided_note(data: Data) -> str:
    """Which end of the two-sided band rejects μ's rollouts at the longest reported length."""
    cfg = data.config
    lo, hi = cfg.two_sided
    lengths = list(cfg.report_lengths)
    mu = _curve(data, "mis_seq_two_sided", "mu_samples")
    vals = [_at(mu, t) for t in lengths]
    T = lengths[-1]
    rej = data.rejected
    at = rej[
        (rej["mask"] == "mis_seq_two_sided")
        & (rej.measure == "mu_samples")
        & (rej["T"] == T)
        & (rej.method == ("exact" if (rej.method == "exact").any() else "monte_carlo"))
    ].set_index("side")
    low, high = float(at.fraction["low"]), float(at.fraction["high"])
    if low > high:
        which = (
            f"through its lower bound: W < {lo:g} rejects {low:.3f} of them, W > {hi:g} {high:.3f}"
        )
    elif high > low:
        which = (
            f"through its upper bound: W > {hi:g} rejects {high:.3f} of them, W < {lo:g} {low:.3f}"
        )
    else:
        which = f"equally at both ends ({low:.3f} each)"
    return (
        f"The two-sided mask {lo:g} ≤ W ≤ {hi:g} keeps {_series(vals)} of μ's rollouts at "
        f"T = {'/'.join(str(t) for t in lengths)}; at T = {T} it rejects {which} "
        f"(under μ, log W drifts down by KL(μ‖π) per token)."
    )


def geo_note(data: Data) -> str:
    cfg = data.config
    k = data.kept
    part = k[k["mask"] == "geo_mask"]
    worst = part.loc[part.fraction.idxmin()]
    lost = 1.0 - float(worst.fraction)
    amount = f"all but {lost:.1g}" if lost < 1e-3 else f"at least {worst.fraction:.3f}"
    return (
        f"Geo-Mask {cfg.geo[0]:g} ≤ s ≤ {cfg.geo[1]:g} keeps {amount} of both measures at every "
        f"T drawn (lowest: {worst.measure}, T = {int(worst['T'])})."
    )


def notes(data: Data) -> tuple[str, ...]:
    """The sentences printed under the figure, each computed from ``data``."""
    return (setting_note(data), one_sided_note(data), two_sided_note(data), geo_note(data))


# --- drawing -------------------------------------------------------------------------------------

_MASK_STYLE = {
    "mis_seq_one_sided": {"color": style.color("mis_seq"), "linestyle": "-", "marker": "o"},
    "mis_seq_two_sided": {"color": "#e6550d", "linestyle": "--", "marker": "s"},
    "geo_mask": {"color": style.color("geo_mask"), "linestyle": "-.", "marker": "^"},
}


def draw(data: Data):
    cfg = data.config
    fig, panels = split_figure(7.4, 3.3, data.notes)
    axes = panels.subplots(1, 2, sharex=True, sharey=True)
    titles = {
        "mu_samples": "fraction of μ's rollouts kept",
        "pi_mass": r"share of π's mass kept, $\mathbb{E}_\mu[W\,1\{\mathrm{kept}\}]$",
    }
    for ax, measure, letter in zip(axes, MEASURES, "ab", strict=True):
        for mask in MASKS:
            st = _MASK_STYLE[mask]
            part = data.kept[(data.kept["mask"] == mask) & (data.kept.measure == measure)]
            exact = part[part.method == "exact"].sort_values("T")
            mc = part[part.method == "monte_carlo"].sort_values("T")
            ax.plot(
                exact["T"],
                exact.fraction,
                color=st["color"],
                linestyle=st["linestyle"],
                linewidth=1.3,
                label=data.masks[mask],
            )
            if len(mc):
                ax.errorbar(
                    mc["T"],
                    mc.fraction,
                    yerr=2 * mc.se,
                    fmt=st["marker"],
                    color=st["color"],
                    markersize=3.2,
                    capsize=1.5,
                    elinewidth=0.7,
                )
        if measure == "mu_samples":
            ax.axhline(data.markov_floor, color="0.35", linestyle=":", linewidth=0.9)
            ax.annotate(
                f"Markov floor 1 − 1/C = {data.markov_floor:.2f} (one-sided)",
                (0.02, data.markov_floor),
                xycoords=("axes fraction", "data"),
                xytext=(0, -3),
                textcoords="offset points",
                va="top",
                fontsize=6.5,
                color="0.3",
            )
        else:
            ax.axvline(data.t_star, color="0.35", linestyle=":", linewidth=0.9)
            ax.axhline(0.5, color="0.8", linewidth=0.6)
            ax.annotate(
                f"T* = log C / log ρ̄ = {data.t_star:.0f}",
                (data.t_star, 0.55),
                xytext=(-3, 0),
                textcoords="offset points",
                ha="right",
                fontsize=6.5,
                color="0.3",
            )
        ax.set_xscale("log")
        ax.set_ylim(-0.03, 1.05)
        ax.set_xlabel("sequence length T")
        ax.set_title(titles[measure], fontsize=8.5)
        _common.panel_label(ax, letter)
    axes[0].set_ylabel("fraction")
    axes[0].plot(
        [],
        [],
        "o",
        color="0.4",
        markersize=3.2,
        label=f"Monte Carlo, n = {cfg.n_mc} (±2 SE)",
    )
    axes[0].legend(loc="lower left", fontsize=6.5)
    panels.suptitle(
        f"T i.i.d. tokens, KL(π‖μ) = {data.kl_tok:.3g} per token (V = {cfg.V}): the mask keeps "
        "μ's rollouts, not π's mass",
        fontsize=9,
    )
    return fig
