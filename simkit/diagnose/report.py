"""``simkit diagnose ROLLOUTS``: how off-policy are a trainer's rollouts, and what does it cost?

Reads rollouts logged by an RL trainer — per-token log-probabilities of the trainer's policy π
and of the rollout engine's behaviour μ, the response mask and the rewards (or advantages) —
and writes a report directory (``report.md``, ``diagnose.png``, ``metrics.json``):

- per-token χ²(π‖μ) over μ's visited states, estimated by the mean of w_t² − 1 over the valid
  tokens (w_t = π(y_t|h_t)/μ(y_t|h_t); E_μ[w² − 1 | h] = χ²(π(·|h)‖μ(·|h)), so the mean is
  unbiased for the chi2_tok of DESIGN.md) with a 95% bootstrap interval over responses;
- KL per token: k1 = −log w and k3 = (w − 1) − log w (both unbiased for KL(μ‖π) under μ,
  k3 ≥ 0 with lower variance: Schulman 2020, "Approximating KL divergence"), and
  E_μ[w log w] = KL(π‖μ);
- sequence χ² = E_μ[W²] − 1 with W = Π_t w_t, the ESS of the sequence weights (Kong 1992:
  (Σ W)²/Σ W², and N/(1 + χ²)), the PSIS k̂ of W (Vehtari et al. 2024; > 0.7: the sequence
  weights' variance is not estimable);
- the length profile (share of responses still running at each position) and the per-position
  χ²; the heavy-tail summary: the share of tokens with |log w| above 0.1, 0.5, 1, 2, 5;
- the distribution-matched twin's predicted scale-free error of every weight mapping —
  ``rel_mse_scaled`` = min_α E‖αĝ − ∇J‖² / ‖∇J‖² ∈ [0, 1], the error after the best step size
  relative to doing nothing (ĝ ≡ 0 scores 1; :func:`simkit.experiment.metrics.scale_free`) —
  with the shares of tokens and sequences the mapping keeps (``kept``, ``kept_seq``) and its
  bias, variance and MSE relative to naive, with bootstrap intervals, ranked by
  ``rel_mse_scaled`` (:mod:`simkit.lm.twin_dist`; MSE rewards mappings that shrink or drop
  samples, the scale-free error does not), with its caveats.

Input: :func:`simkit.diagnose.readers.read_rollouts` (trainer dumps, tables). Bad input
raises :class:`RolloutError` before anything is written; the report directory is written to a
temporary sibling and renamed at the end, so it is never half-written.

numpy / pandas / matplotlib; no torch.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from simkit.diagnose.readers import LoadedRollouts, RolloutError, read_rollouts

THRESHOLDS = (0.1, 0.5, 1.0, 2.0, 5.0)
CAVEATS = (
    "The twin replays the logged responses (π by self-normalised importance weights) with the "
    "score vectors of a softmax over mismatch atoms (position segment × log-ratio bin × "
    "log-probability bin), not the model's gradients: it predicts ratios to naive, not absolute "
    "bias or variance.",
    "Its π is a self-normalised IS estimate: its quality degrades as the sequence χ² grows "
    "(ESS = N/(1 + χ²)); with k̂ > 0.7 the predictions of IS-like mappings are unreliable.",
    "Tokens μ never sampled are invisible in logs: a support mismatch (top-p / top-k sampling "
    "where π has mass) makes χ² infinite and cannot be diagnosed from these columns.",
    "Checked against exact tree values on a truncated SmolLM2 and the tiny Llama (the lm_vs_sim "
    "figure): rank agreement is measured there, not guaranteed elsewhere.",
)


# --- metrics ---------------------------------------------------------------------------------


def _boot_ratio(num, den, rng, n_boot=500, level=0.95):
    """Σnum/Σden with a percentile bootstrap interval over responses (rows)."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    b = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-300)
    tail = (1 - level) / 2
    lo, hi = np.quantile(b, [tail, 1 - tail])
    return float(num.sum() / den.sum()), float(lo), float(hi)


def metrics(ro: LoadedRollouts, seed: int = 0) -> dict:
    """Every number of the report except the twin's (module docstring), as a JSON-able dict."""
    from simkit.experiment import khat_of_weights

    rng = np.random.default_rng(seed)
    m = ro.mask
    r = np.where(m, ro.log_pi - ro.log_mu, 0.0)
    tokens = m.sum(1).astype(float)
    with np.errstate(over="ignore"):
        w = np.exp(np.minimum(r, 700.0))
    out = {"N": int(m.shape[0]), "T": int(m.shape[1]), "tokens": int(tokens.sum())}
    per = {
        "chi2_tok": np.where(m, w * w - 1.0, 0.0).sum(1),
        "kl_k1": np.where(m, -r, 0.0).sum(1),
        "kl_k3": np.where(m, (w - 1.0) - r, 0.0).sum(1),
        "kl_pi_mu": np.where(m, w * r, 0.0).sum(1),
    }
    for key, num in per.items():
        v, lo, hi = _boot_ratio(num, tokens, rng)
        out[key] = {"value": v, "lo": lo, "hi": hi}
    logW = r.sum(1)
    with np.errstate(over="ignore"):
        W = np.exp(np.minimum(logW, 700.0))
    N = len(W)
    idx = rng.integers(0, N, size=(500, N))
    chi2_b = (W[idx] ** 2).mean(1) - 1.0
    out["chi2_seq"] = {
        "value": float(np.mean(W * W) - 1.0),
        "lo": float(np.quantile(chi2_b, 0.025)),
        "hi": float(np.quantile(chi2_b, 0.975)),
    }
    out["ess_kong"] = float(W.sum() ** 2 / np.sum(W * W)) if np.sum(W * W) > 0 else 0.0
    out["ess_chi2"] = float(N / (1.0 + max(out["chi2_seq"]["value"], 0.0)))
    out["khat_seq"] = float(khat_of_weights(W))
    out["mean_length"] = float(tokens.mean())
    running = m.mean(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        chi2_pos = np.where(m.sum(0) > 0, np.where(m, w * w - 1.0, 0.0).sum(0) / m.sum(0), np.nan)
    out["profile"] = {
        "running": [float(x) for x in running],
        "chi2_tok": [None if not np.isfinite(x) else float(x) for x in chi2_pos],
    }
    absr = np.abs(r[m])
    out["tail_share"] = {f"{t:g}": float(np.mean(absr > t)) for t in THRESHOLDS}
    out["log_ratio_quantiles"] = {
        f"{q:g}": float(np.quantile(r[m], q)) for q in (0.001, 0.01, 0.5, 0.99, 0.999)
    }
    out["reward_mean"] = float(ro.rewards.mean())
    return out


def twin_predictions(
    ro: LoadedRollouts, n: int = 8, n_boot: int = 20, seed: int = 0, mappings_=None
):
    """The distribution-matched twin's prediction for every mapping, with 90% bootstrap
    intervals (:mod:`simkit.lm.twin_dist`): ``rel_mse_scaled`` (the scale-free error,
    mse_scaled/mse_zero ∈ [0, 1]; the ranking key, lowest first), ``kept``, ``kept_seq``, and
    bias / variance / MSE relative to naive (``rel_mse``, ``rel_bias``, ``rel_variance``)."""
    from simkit import mappings
    from simkit.estimators import Estimator
    from simkit.lm import twin_dist

    names = list(mappings_) if mappings_ is not None else mappings.available()
    if "naive" not in names:
        names = ["naive", *names]
    ests = [
        Estimator(m, aggregation="seq-mean-token-sum", advantage="oracle_pi", name=m) for m in names
    ]
    logs = twin_dist.Rollouts(ro.log_pi, ro.log_mu, ro.mask, ro.rewards)
    pred = twin_dist.predict_with_intervals(logs, ests, n, n_boot=n_boot, seed=seed, reps=100)
    cols = ["mapping", "exact"] + [
        f"{k}{s}"
        for k in ("rel_mse_scaled", "kept", "kept_seq", "rel_mse", "rel_bias", "rel_variance")
        for s in ("", "_lo", "_hi")
    ]
    return pred[cols].sort_values("rel_mse_scaled", kind="stable").reset_index(drop=True)


# --- report ----------------------------------------------------------------------------------


def _fmt(d):
    return f"{d['value']:.4g} [{d['lo']:.4g}, {d['hi']:.4g}]"


def _markdown(path_in, ro, mt, pred) -> str:
    lines = [
        f"# simkit diagnose: `{path_in}`",
        "",
        f"{mt['N']} responses ({ro.layout} format; columns: "
        + ", ".join(f"{k} = `{v}`" for k, v in ro.sources.items() if v)
        + f"), {mt['tokens']} valid tokens, mean length {mt['mean_length']:.1f} (max {mt['T']}), "
        f"mean reward {mt['reward_mean']:.4g}.",
        "",
        "## Mismatch between the trainer (π) and the rollout engine (μ)",
        "",
        "| quantity | value [95% CI] |",
        "|---|---|",
        f"| per-token χ²(π‖μ), mean of w² − 1 | {_fmt(mt['chi2_tok'])} |",
        f"| per-token KL(μ‖π), k1 = −log w | {_fmt(mt['kl_k1'])} |",
        f"| per-token KL(μ‖π), k3 = w − 1 − log w | {_fmt(mt['kl_k3'])} |",
        f"| per-token KL(π‖μ), w log w | {_fmt(mt['kl_pi_mu'])} |",
        f"| sequence χ² = E W² − 1 | {_fmt(mt['chi2_seq'])} |",
        f"| ESS of W (Kong) / N/(1+χ²) | {mt['ess_kong']:.1f} / {mt['ess_chi2']:.1f} "
        f"of {mt['N']} |",
        f"| PSIS k̂ of W | {mt['khat_seq']:.3f} "
        f"({'unreliable' if mt['khat_seq'] > 0.7 else 'ok'}) |",
        "",
        "Heavy tails — share of tokens with |log w| above a threshold: "
        + ", ".join(f"> {k}: {v:.3%}" for k, v in mt["tail_share"].items()),
        "",
        "![profile, tails and twin](diagnose.png)",
        "",
        "## What the distribution-matched twin predicts (90% bootstrap CI)",
        "",
        "Ranked by the predicted scale-free error `rel_mse_scaled` = min_α E‖αĝ − ∇J‖² / ‖∇J‖² "
        "(the error after the best step size, relative to doing nothing: 1 = no better than "
        "ĝ ≡ 0; lower is better). `kept`: share of tokens with a non-zero coefficient; "
        "`kept seq`: share of responses with one. MSE, bias and variance are relative to naive "
        "(MSE rewards mappings that shrink or drop samples). `exact` = per-sample mapping "
        "(enumerated on the twin), otherwise Monte Carlo on the twin (n/a: not computed there).",
        "",
        f"Batch size n = {pred.attrs.get('n', 'n/a')} responses per gradient.",
        "",
        "| rank | mapping | rel. scaled MSE | kept | kept seq | rel. MSE | rel. bias "
        "| rel. variance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(pred.itertuples(), 1):

        def cell(key, row=row):
            v, lo, hi = (getattr(row, f"{key}{s}") for s in ("", "_lo", "_hi"))
            return f"{v:.3g} [{lo:.3g}, {hi:.3g}]" if np.isfinite(v) else "n/a"

        lines.append(
            f"| {i} | {row.mapping} | {cell('rel_mse_scaled')} | {cell('kept')} "
            f"| {cell('kept_seq')} | {cell('rel_mse')} | {cell('rel_bias')} "
            f"| {cell('rel_variance')} |"
        )
    lines += ["", "## Caveats", ""] + [f"- {c}" for c in CAVEATS] + [""]
    return "\n".join(lines)


def _plot(mt, pred, path):
    from simkit.figures import _common, style

    with style.context():
        fig = _common.new_figure(10.0, 3.4)
        ax1, ax2, ax3 = fig.subplots(1, 3)
        prof = mt["profile"]
        t = np.arange(len(prof["running"]))
        chi = np.array([np.nan if x is None else x for x in prof["chi2_tok"]])
        ax1.plot(t, chi, marker="o", markersize=2)
        ax1.set_xlabel("response position t")
        ax1.set_ylabel("per-token χ² estimate")
        tw = ax1.twinx()
        tw.plot(t, prof["running"], color="0.5", linewidth=0.8)
        tw.set_ylim(0, 1.05)
        tw.set_ylabel("running fraction", color="0.5")
        tw.grid(False)
        ks = list(mt["tail_share"])
        ax2.bar(ks, [max(mt["tail_share"][k], 1e-6) for k in ks], color="0.4")
        ax2.set_yscale("log")
        ax2.set_xlabel("|log w| threshold")
        ax2.set_ylabel("share of tokens above")
        y = np.arange(len(pred))
        v = pred.rel_mse_scaled.to_numpy(dtype=float)
        lo, hi = (
            pred.rel_mse_scaled_lo.to_numpy(dtype=float),
            pred.rel_mse_scaled_hi.to_numpy(dtype=float),
        )
        err = np.nan_to_num(np.array([v - lo, hi - v]))
        ax3.errorbar(v, y, xerr=np.maximum(err, 0), fmt="o", markersize=3, color="k", linewidth=0.6)
        ax3.set_yticks(y, pred.mapping, fontsize=5)
        ax3.invert_yaxis()
        ax3.axvline(1.0, color="0.6", linewidth=0.6)  # ĝ ≡ 0
        ax3.set_xlim(0.0, 1.05)
        ax3.set_xlabel("twin: scaled MSE / ‖∇J‖² (90% CI; 1 = ĝ ≡ 0)")
        fig.savefig(path, dpi=style.DPI)


def diagnose(
    path,
    out_dir,
    *,
    columns=None,
    n: int = 8,
    n_boot: int = 20,
    seed: int = 0,
    mappings_=None,
    force: bool = False,
) -> Path:
    """Read ``path``, compute, and write the report directory ``out_dir`` (module docstring).

    ``out_dir`` must not exist or be empty (``force``: replace it). Everything is computed
    and written into a temporary sibling directory first, then renamed: an error leaves no
    partial report. Returns the report directory."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise RolloutError(f"report directory {str(out)!r} exists and is not empty (use --force)")
    ro = read_rollouts(path, columns)
    mt = metrics(ro, seed=seed)
    pred = twin_predictions(ro, n=n, n_boot=n_boot, seed=seed, mappings_=mappings_)
    pred.attrs["n"] = n
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        payload = {
            "input": str(path),
            "layout": ro.layout,
            "columns": ro.sources,
            **mt,
            "twin_n": n,
            "twin": pred.to_dict(orient="records"),
            "caveats": list(CAVEATS),
        }
        (tmp / "metrics.json").write_text(json.dumps(payload, indent=2, default=float))
        _plot(mt, pred, tmp / "diagnose.png")
        (tmp / "report.md").write_text(_markdown(path, ro, mt, pred))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
