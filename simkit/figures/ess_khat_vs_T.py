"""Effective sample size and PSIS k̂ of the sequence ratio W as the length T grows.

For T i.i.d. tokens with per-token χ²(π‖μ), E_μ[W²] = (1+χ²)^T, so the effective sample size
of n sequence weights is ESS ≈ n/(1+χ²)^T (Kish 1965; notation page §F;
:func:`simkit.theory.expected_ess`): it collapses exponentially in T. The Pareto k̂ of PSIS
(Vehtari et al., "Pareto smoothed importance sampling", JMLR 2024) diagnoses the same collapse
from the draws. k̂ is a *pre-asymptotic* diagnostic: here the vocabulary is finite, so W is
bounded and Var W = χ²_seq is finite at every T — k̂ > 0.5 does not mean infinite variance. It
says that, at this sample size N, the largest weights look like the tail of a distribution
without a finite variance, so the importance-sampling estimate behaves as if it had none;
Vehtari et al. read k̂ ≤ 0.7 as "the estimate is reliable at this N" (their threshold
min(1 − 1/log10 N, 0.7)).

For each per-token χ² and length T: ``reps`` batches of n sequences drawn from μ (the sequence
ratio depends on the token counts only, drawn as multinomials), the Kish ESS/n
(:func:`simkit.divergence.ess_fraction`) and k̂ (:func:`simkit.mappings.psis.psis_khat`) of
each batch, reported as mean ± SE over batches; the ESS curve n/(1+χ²_seq) for comparison.

Data: DataFrame, one row per (chi2_tok, T): ess_frac, ess_frac_se, khat, khat_se,
ess_frac_theory, chi2_seq, n, reps, khat_defined (batches where k̂ is defined, see
:func:`khat_or_nan`; khat is NaN with fewer than 2). ``data.attrs["notes"]``: the sentences
under the figure, built from the data by :func:`notes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkit import divergence, theory
from simkit.figures import _common
from simkit.figures.staleness_curves import split_figure
from simkit.figures.vespo_bound import policy_pair
from simkit.mappings.psis import psis_khat

NAME = "ess_khat_vs_T"
TITLE = "ESS/N and PSIS k̂ vs sequence length"
CAPTION = (
    "Kish ESS/N (with the curve 1/(1+χ²)^T) and the PSIS Pareto k̂ of the sequence ratio W of "
    "T i.i.d. tokens, for several per-token χ²(π‖μ); mean ± 2 SE over batches of N sequences. "
    "The vocabulary is finite, so Var W = χ²_seq is finite at every T: k̂ is a pre-asymptotic "
    "diagnostic (k̂ > 0.7: the estimate is unreliable at this N), not a test of infinite "
    "variance. The lengths at which k̂ crosses 0.5 and 0.7 are in the notes under the panels."
)

#: PSIS thresholds (Vehtari et al., JMLR 2024, §3)
KHAT_THRESHOLDS = (0.5, 0.7)


@dataclass(frozen=True)
class Config:
    """Per-token mismatch levels, lengths and batch sizes."""

    V: int = 6
    chi2_toks: tuple[float, ...] = (0.002, 0.01, 0.05)
    lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    n: int = 1000
    reps: int = 20
    shift_family: str = "logit_noise"
    seed: int = 0

    def __post_init__(self):
        _common.check_token_grid(self.V, self.chi2_toks, lengths=self.lengths)
        if self.n < 25:
            raise ValueError(f"n must be >= 25 (PSIS needs a tail), got {self.n}")
        if self.reps < 2:
            raise ValueError(f"reps must be >= 2, got {self.reps}")


def config(small: bool = False) -> Config:
    if small:
        return Config(V=4, chi2_toks=(0.01, 0.2), lengths=(1, 2, 4, 16, 64), n=400, reps=8)
    return Config()


def psis_tail_size(n: int) -> int:
    """M = ⌈min(n/5, 3√n)⌉, the number of largest weights PSIS fits its Pareto tail to
    (Vehtari et al., JMLR 2024, §3)."""
    return math.ceil(min(n / 5, 3 * math.sqrt(n)))


def khat_or_nan(log_w: np.ndarray) -> float:
    """PSIS k̂ of the weights exp(``log_w``) (n,), NaN when it is undefined: fewer distinct
    weights than the tail size M (a short sequence over a small vocabulary takes few values,
    and a Pareto fit to ties is meaningless) or a non-finite k̂."""
    if len(np.unique(log_w)) < psis_tail_size(len(log_w)):
        return math.nan
    khat = psis_khat(log_w)
    return float(khat) if np.isfinite(khat) else math.nan


def compute(cfg: Config) -> pd.DataFrame:
    rng = np.random.default_rng(cfg.seed)
    rows = []
    for chi2_tok in cfg.chi2_toks:
        pi, mu = policy_pair(cfg.V, chi2_tok, cfg.shift_family, cfg.seed)
        log_ratio = np.log(pi) - np.log(mu)
        for T in cfg.lengths:
            log_w = rng.multinomial(int(T), mu, size=(cfg.reps, cfg.n)) @ log_ratio  # (reps, n)
            ess = np.asarray(divergence.ess_fraction(log_w))
            khat = np.array([khat_or_nan(row) for row in log_w])
            khat = khat[np.isfinite(khat)]
            chi2_seq = float(theory.seq_is_variance(chi2_tok, T))
            rows.append(
                {
                    "chi2_tok": chi2_tok,
                    "T": int(T),
                    "chi2_seq": chi2_seq,
                    "ess_frac": float(ess.mean()),
                    "ess_frac_se": float(ess.std(ddof=1) / math.sqrt(cfg.reps)),
                    "khat": float(khat.mean()) if len(khat) >= 2 else math.nan,
                    "khat_se": (
                        float(khat.std(ddof=1) / math.sqrt(len(khat)))
                        if len(khat) >= 2
                        else math.nan
                    ),
                    "khat_defined": len(khat),
                    "ess_frac_theory": float(theory.expected_ess(cfg.n, chi2_seq)) / cfg.n,
                    "n": cfg.n,
                    "reps": cfg.reps,
                }
            )
    data = pd.DataFrame(rows)
    data.attrs["notes"] = notes(data)
    return data


def _first_crossing(part: pd.DataFrame, level: float) -> int | None:
    above = part[part.khat > level]
    return int(above["T"].min()) if len(above) else None


def notes(data: pd.DataFrame) -> tuple[str, ...]:
    """Sentences built from the data: where the mean k̂ first exceeds 0.5 and 0.7, per χ²."""
    n, reps = int(data.n.iloc[0]), int(data.reps.iloc[0])
    lines = [
        f"N = {n} sequences per batch, {reps} batches per point; k̂ is NaN where a batch has "
        "fewer distinct weights than PSIS's tail size. Finite vocabulary: Var W = (1+χ²)^T − 1 "
        "is finite at every T, so k̂ measures how heavy the tail looks at this N."
    ]
    parts = []
    for chi2, part in data.groupby("chi2_tok", sort=True):
        part = part.sort_values("T")
        t5, t7 = (_first_crossing(part, level) for level in KHAT_THRESHOLDS)
        t_max = int(part["T"].max())
        if t5 is None:
            parts.append(f"χ² = {chi2:g}: mean k̂ stays ≤ 0.5 up to T = {t_max}")
            continue
        text = f"χ² = {chi2:g}: mean k̂ first exceeds 0.5 at T = {t5}"
        text += f", 0.7 at T = {t7}" if t7 is not None else f", stays ≤ 0.7 up to T = {t_max}"
        parts.append(text)
    lines.append("; ".join(parts) + ".")
    return tuple(lines)


_COLORS = ("#6baed6", "#2171b5", "#08306b", "#084594")


def draw(data: pd.DataFrame):
    fig, panels = split_figure(7.2, 3.2, data.attrs.get("notes", ()))
    ax_e, ax_k = panels.subplots(1, 2, sharex=True)
    n = int(data.n.iloc[0])
    for k, (chi2, part) in enumerate(data.groupby("chi2_tok", sort=True)):
        color = _COLORS[k % len(_COLORS)]
        label = f"χ² per token = {chi2:g}"
        for ax, column in ((ax_e, "ess_frac"), (ax_k, "khat")):
            ax.errorbar(
                part["T"],
                part[column],
                yerr=2 * part[f"{column}_se"],
                fmt="o-",
                color=color,
                markersize=3,
                capsize=1.5,
                elinewidth=0.7,
                label=label,
            )
        ax_e.plot(
            part["T"],
            np.maximum(part.ess_frac_theory, 1e-6),
            color=color,
            linestyle=":",
            linewidth=1.0,
        )
    _common.mark_floor(ax_e, 1.0 / n, "1/N (one sequence)", linewidth=0.7, linestyle="--")
    ax_e.plot([], [], color="0.3", linestyle=":", label="1/(1+χ²)^T (population)")
    ax_e.set_yscale("log")
    ax_e.set_ylim(0.3 / n, 1.5)
    ax_e.set_ylabel("ESS / N")
    ax_e.set_title("effective sample size")
    ax_e.legend(fontsize=6.5, loc="lower left")
    for level, text in zip(
        KHAT_THRESHOLDS,
        ("0.5 (pre-asymptotic: Var W is finite here)", "0.7: unreliable at this N"),
        strict=True,
    ):
        ax_k.axhline(level, color="#d94801", linewidth=0.8, linestyle="--")
        ax_k.annotate(
            text,
            (0.0, level),
            xycoords=("axes fraction", "data"),
            xytext=(3, 2) if level == max(KHAT_THRESHOLDS) else (3, -2),
            va="bottom" if level == max(KHAT_THRESHOLDS) else "top",
            textcoords="offset points",
            fontsize=7,
            color="#a63603",
        )
    ax_k.set_ylabel(r"PSIS $\hat k$")
    ax_k.set_ylim(min(-0.3, float(np.nanmin(data.khat)) - 0.1), float(np.nanmax(data.khat)) + 0.3)
    ax_k.set_title(r"Pareto $\hat k$ of the sequence ratio W")
    for ax, letter in ((ax_e, "a"), (ax_k, "b")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T")
        _common.panel_label(ax, letter)
    panels.suptitle(
        f"N = {n} sequences of T i.i.d. tokens per batch, mean ± 2 SE over "
        f"{int(data.reps.iloc[0])} batches"
    )
    return fig
