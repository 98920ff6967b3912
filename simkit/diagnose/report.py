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

from simkit.diagnose.dashboards import lines as dashboard_lines
from simkit.diagnose.legs import (
    LEGS,
    MAX_KHAT,
    leg_arrays,
    leg_metrics,
)
from simkit.diagnose.readers import ROLES, LoadedRollouts, RolloutError, read_rollouts
from simkit.diagnose.recommend import answer_lines
from simkit.diagnose.truncation import summary_lines

CAVEATS = (
    "The twin replays the logged responses (π by self-normalised importance weights) with the "
    "score vectors of a softmax over mismatch atoms (position segment × log-ratio bin × "
    "log-probability bin), not the model's gradients: it predicts ratios to naive, not absolute "
    "bias or variance.",
    "Its π is a self-normalised IS estimate: its quality degrades as the sequence χ² grows "
    "(ESS = N/(1 + χ²)); with k̂ > 0.7 the predictions of IS-like mappings are unreliable.",
    "Tokens μ never sampled are invisible in logs: where μ drops tokens π can emit (top-p / "
    "top-k), χ²(π‖μ) is infinite and the χ² rows measure μ's support only; the truncation "
    "check (mean w < 1) detects the kept-mass offset and reports its size.",
    "Per-prompt groups set the advantage (GRPO on the dump's group size) but the twin draws "
    "each group from the pooled replay of all prompts: one J, not one per prompt.",
    "Checked against exact tree values on a truncated SmolLM2 and the tiny Llama (the lm_vs_sim "
    "figure): rank agreement is measured there, not guaranteed elsewhere.",
)


def metrics(ro: LoadedRollouts, seed: int = 0) -> dict:
    """Every number of the report except the twin's, per leg present (JSON-able dict):
    ``legs``: leg key → :func:`leg_metrics`; the batch's shape, groups and reward."""
    from simkit.diagnose.dashboards import dashboards
    from simkit.diagnose.truncation import kept_mass

    arrays = leg_arrays(ro)
    legs = {
        k: leg_metrics(a, b, ro.mask, seed=seed, rewards=ro.rewards) for k, (a, b) in arrays.items()
    }
    legs["mismatch"]["dashboards"] = dashboards(*arrays["mismatch"], ro.mask)
    legs["mismatch"]["truncation"] = kept_mass(*arrays["mismatch"], ro.mask, ro.groups, seed=seed)
    first = legs["mismatch"]
    out = {
        "N": first["N"],
        "T": first["T"],
        "tokens": first["tokens"],
        "mean_length": first["mean_length"],
        "reward_mean": float(ro.rewards.mean()),
        "reward_kind": ro.reward_kind,
        "groups": None if ro.groups is None else int(ro.groups.max() + 1),
        "legs": legs,
    }
    return out


def group_size(ro: LoadedRollouts) -> int | None:
    """The dump's per-prompt group size when every group has the same size ≥ 2, else None."""
    if ro.groups is None:
        return None
    sizes = np.bincount(ro.groups)
    return int(sizes[0]) if sizes.min() == sizes.max() and sizes[0] >= 2 else None


def twin_predictions(
    ro: LoadedRollouts,
    n: int = 8,
    n_boot: int = 20,
    seed: int = 0,
    mappings_=None,
    *,
    leg: str = "mismatch",
    aggregation: str = "seq-mean-token-sum",
    advantage: str = "oracle_pi",
    group: int | None = None,
):
    """The distribution-matched twin's prediction for every mapping that acts on ``leg``
    (:data:`LEGS`; ``mappings_`` restricts them further), with 90% bootstrap intervals
    (:mod:`simkit.lm.twin_dist`): ``rel_mse_scaled`` (the scale-free error,
    mse_scaled/mse_zero ∈ [0, 1]; the ranking key, lowest first), ``kept``, ``kept_seq``, and
    bias / variance / MSE relative to naive (``rel_mse``, ``rel_bias``, ``rel_variance``).
    The estimators use the user's batch size ``n``, ``aggregation`` and ``advantage``
    (``group``: the group size of a group advantage). The staleness twin treats the logged
    responses as draws from π_old (they are μ's; the leg's ratio is π/π_old)."""
    from simkit import mappings
    from simkit.estimators import GROUP_ADVANTAGES, Estimator
    from simkit.lm import twin_dist

    avail = set(mappings.available())
    names = [m for m in LEGS[leg][1] if m in avail]
    if mappings_ is not None:
        names = [m for m in names if m in set(mappings_)]
    if "naive" not in names:
        names = ["naive", *names]
    kw = {"group_size": group} if advantage in GROUP_ADVANTAGES else {}
    ests = [Estimator(m, aggregation=aggregation, advantage=advantage, name=m, **kw) for m in names]
    num, den = leg_arrays(ro)[leg]
    logs = twin_dist.Rollouts(num, den, ro.mask, ro.rewards)
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


def _khat_word(k: float) -> str:
    if not np.isfinite(k):
        return "no Pareto tail to fit: too few draws or repeated weights"
    return "unreliable" if k > MAX_KHAT else "ok"


def _leg_table(mt: dict) -> list[str]:
    tails = ", ".join(
        f"> {k}: {v:.3%} ({mt['tail_count'][k]} tokens)" if mt["tail_count"][k] else f"> {k}: none"
        for k, v in mt["tail_share"].items()
    )
    return [
        "| quantity | value [95% CI] |",
        "|---|---|",
        f"| per-token χ², mean of (w − 1)² (≥ 0) | {_fmt(mt['chi2_tok'])} |",
        f"| per-token χ², mean of w² − 1 | {_fmt(mt['chi2_tok_w2'])} |",
        f"| mean of w (1 without truncation) | {_fmt(mt['mean_w'])} |",
        f"| per-token KL, k1 = −log w | {_fmt(mt['kl_k1'])} |",
        f"| per-token KL, k3 = w − 1 − log w | {_fmt(mt['kl_k3'])} |",
        f"| per-token KL (other direction), w log w | {_fmt(mt['kl_pi_mu'])} |",
        f"| sequence χ², mean of (W − 1)² | {_fmt(mt['chi2_seq'])} |",
        f"| ESS of W (Kong) / N/(1+χ²) | {mt['ess_kong']:.1f} / {mt['ess_chi2']:.1f} "
        f"of {mt['N']} |",
        f"| PSIS k̂ of W | {mt['khat_seq']:.3f} ({_khat_word(mt['khat_seq'])}) |",
        "",
        "Heavy tails — share of tokens with |log w| above a threshold: " + tails,
        "",
    ]


def _ranking(pred) -> list[str]:
    lines = [
        f"Batch size n = {pred.attrs.get('n', 'n/a')} responses per gradient, aggregation "
        f"`{pred.attrs.get('aggregation', 'n/a')}`, advantage `{pred.attrs.get('advantage')}`.",
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
    return lines


def _markdown(path_in, ro, mt, preds, answer=None, validation=None) -> str:
    groups = f", {mt['groups']} prompt groups (`{ro.sources['group']}`)" if mt["groups"] else ""
    lines = [
        f"# simkit diagnose: `{path_in}`",
        "",
        f"{mt['N']} responses ({ro.layout} format; columns: "
        + ", ".join(f"{k} = `{v}`" for k, v in ro.sources.items() if v)
        + f"), {mt['tokens']} valid tokens, mean length {mt['mean_length']:.1f} (max {mt['T']})"
        + groups
        + f", mean {ro.reward_kind} {mt['reward_mean']:.4g}.",
        "",
        "Legs: π_old‖μ (trainer at rollout vs engine) is corrected by TIS / MIS / IcePop / "
        "geo-mask / k-rejection; π‖π_old (staleness) by the surrogates (PPO clip, GSPO, SAPO, "
        "...). Each leg's mappings are ranked only on that leg"
        + (
            "."
            if "staleness" in mt["legs"]
            else "; this dump has no π at update time, so the surrogates are not ranked."
        ),
        "",
    ]
    for leg, lm in mt["legs"].items():
        lines += [f"## {LEGS[leg][0]}", "", *_leg_table(lm)]
        if "truncation" in lm:
            lines += summary_lines(lm["truncation"])
        if "dashboards" in lm:
            lines += [
                "### Your dashboard's numbers, as each trainer defines them",
                "",
                "The same names mean different quantities (`simkit.diagnose.dashboards`: "
                "verl 1dda039, TRL f2cd577 defaults, ms-swift 3602360).",
                "",
                *dashboard_lines(lm["dashboards"]),
            ]
        lines += ["### What the distribution-matched twin predicts (90% bootstrap CI)", ""]
        if leg not in preds:
            lines += [f"**{lm['refusal'] or 'not ranked'}**", ""]
            continue
        lines += [
            "Ranked by the predicted scale-free error `rel_mse_scaled` = min_α E‖αĝ − ∇J‖² / "
            "‖∇J‖² (the error after the best step size, relative to the signal ‖∇J‖²: 1 = no "
            "better than ĝ ≡ 0; lower is better). `kept`: share of tokens with a non-zero "
            "coefficient; `kept seq`: share of responses with one. MSE, bias and variance are "
            "relative to naive. `exact` = per-sample mapping (enumerated on the twin), "
            "otherwise Monte Carlo on the twin.",
            "",
        ]
        lines += [*_ranking(preds[leg]), ""]
        if leg == "mismatch" and answer is not None:
            lines += ["### The answer: thresholds for π_old‖μ", "", *answer_lines(*answer[::2])]
    if validation is not None:
        lines += ["## How far to trust the twin: validation on exact twins", "", *validation]
    lines += ["![profile, tails and twin](diagnose.png)", ""]
    lines += ["## Caveats", ""] + [f"- {c}" for c in CAVEATS] + [""]
    return "\n".join(lines)


def _plot(mt, preds, path):
    from simkit.figures import _common, style

    lm = mt["legs"]["mismatch"]
    with style.context():
        fig = _common.new_figure(10.0, 3.4)
        ax1, ax2, ax3 = fig.subplots(1, 3)
        prof = lm["profile"]
        t = np.arange(len(prof["running"]))
        chi = np.array([np.nan if x is None else x for x in prof["chi2_tok"]])
        ax1.plot(t, chi, marker="o", markersize=2)
        ax1.set_xlabel("response position t")
        ax1.set_ylabel("per-token χ²(π_old‖μ), mean (w−1)²")
        tw = ax1.twinx()
        tw.plot(t, prof["running"], color="0.5", linewidth=0.8)
        tw.set_ylim(0, 1.05)
        tw.set_ylabel("running fraction", color="0.5")
        tw.grid(False)
        ks = list(lm["tail_share"])
        shares = np.array([lm["tail_share"][k] for k in ks])
        x = np.arange(len(ks))
        nz = shares > 0
        ax2.bar(x[nz], shares[nz], color="0.4")
        for i in x[~nz]:  # no bar for a zero share: say so
            ax2.annotate(
                "0",
                (i, 0),
                xycoords=("data", "axes fraction"),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax2.set_xticks(x, ks)
        if nz.any():
            ax2.set_yscale("log")
        ax2.set_xlabel("|log w| threshold (π_old‖μ)")
        ax2.set_ylabel("share of tokens above")
        pred = preds.get("mismatch")
        if pred is None:
            ax3.text(
                0.5,
                0.5,
                (lm["refusal"] or "not ranked").replace(": ", ":\n", 1),
                ha="center",
                va="center",
                wrap=True,
                fontsize=7,
                transform=ax3.transAxes,
            )
            ax3.set_axis_off()
        else:
            y = np.arange(len(pred))
            v = pred.rel_mse_scaled.to_numpy(dtype=float)
            lo = pred.rel_mse_scaled_lo.to_numpy(dtype=float)
            hi = pred.rel_mse_scaled_hi.to_numpy(dtype=float)
            err = np.nan_to_num(np.array([v - lo, hi - v]))
            ax3.errorbar(
                v, y, xerr=np.maximum(err, 0), fmt="o", markersize=3, color="k", linewidth=0.6
            )
            ax3.set_yticks(y, pred.mapping, fontsize=6)
            ax3.invert_yaxis()
            ax3.axvline(1.0, color="0.6", linewidth=0.6)  # ĝ ≡ 0
            ax3.set_xlim(0.0, 1.05)
            ax3.set_xlabel("twin: scaled MSE / ‖∇J‖² (90% CI; 1 = ĝ ≡ 0)")
        fig.savefig(path, dpi=style.DPI)


def resolve_batch(ro: LoadedRollouts, n=None, advantage=None) -> tuple[int, str, int | None]:
    """The batch the twin's estimators use: (n, advantage, group size). Defaults: with
    equal-size groups of G ≥ 2 in the dump, the GRPO advantage on groups of G and n = G;
    otherwise A = R − J(π) (``oracle_pi``) and n = 8."""
    from simkit.estimators import ADVANTAGES, GROUP_ADVANTAGES

    G = group_size(ro)
    if advantage is None:
        advantage = "grpo" if G else "oracle_pi"
    if advantage not in ADVANTAGES:
        raise RolloutError(f"--advantage {advantage!r}: expected one of {', '.join(ADVANTAGES)}")
    if advantage in GROUP_ADVANTAGES:
        if G is None:
            raise RolloutError(
                f"--advantage {advantage} needs per-prompt groups of equal size >= 2 in the dump "
                f"(a group column: {', '.join(ROLES['group'])}, or --group)"
            )
        n = G if n is None else n
        if n % G:
            raise RolloutError(f"--n {n} must be a multiple of the group size {G}")
    n = 8 if n is None else n
    if n < 1:
        raise RolloutError(f"--n must be >= 1, got {n}")
    return n, advantage, (G if advantage in GROUP_ADVANTAGES else None)


def diagnose(
    path,
    out_dir,
    *,
    columns=None,
    n: int | None = None,
    n_boot: int = 20,
    seed: int = 0,
    mappings_=None,
    aggregation: str = "seq-mean-token-sum",
    advantage: str | None = None,
    current: str | None = None,
    validate: bool = True,
    force: bool = False,
) -> Path:
    """Read ``path``, compute, and write the report directory ``out_dir`` (module docstring).

    Each leg present is measured; its mappings (:data:`LEGS`) are ranked by the twin unless
    the leg's ESS < 30 or k̂ > 0.7 (the reason is reported instead). ``n``, ``aggregation``,
    ``advantage``: the user's batch (:func:`resolve_batch`). ``current``: the user's correction
    spec, compared with the recommendation (:mod:`simkit.diagnose.recommend`). ``validate``:
    print the validation on exact token-MDP twins (:mod:`simkit.diagnose.validation`, ~3 s,
    cached per process) and the stored one on the exact SmolLM2 tree
    (:mod:`simkit.diagnose.validation_lm`). ``out_dir`` must not exist or be
    empty (``force``: replace it). Everything is computed and written into a temporary sibling
    directory first, then renamed: an error leaves no partial report. Returns the directory."""
    from simkit.estimators import AGGREGATIONS

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise RolloutError(f"report directory {str(out)!r} exists and is not empty (use --force)")
    if aggregation not in AGGREGATIONS:
        raise RolloutError(
            f"--aggregation {aggregation!r}: expected one of {', '.join(AGGREGATIONS)}"
        )
    from simkit.diagnose.recommend import parse_setting, recommend

    if current is not None:
        parse_setting(current)  # a bad spec is an error before any work
    ro = read_rollouts(path, columns)
    n, advantage, G = resolve_batch(ro, n, advantage)
    mt = metrics(ro, seed=seed)
    preds = {}
    for leg, lm in mt["legs"].items():
        if not lm["rankable"]:
            continue
        pred = twin_predictions(
            ro,
            n=n,
            n_boot=n_boot,
            seed=seed,
            mappings_=mappings_,
            leg=leg,
            aggregation=aggregation,
            advantage=advantage,
            group=G,
        )
        pred.attrs.update(n=n, aggregation=aggregation, advantage=advantage)
        preds[leg] = pred
    answer = None
    if "mismatch" in preds:
        answer = recommend(
            *leg_arrays(ro)["mismatch"],
            ro.mask,
            ro.rewards,
            n=n,
            aggregation=aggregation,
            advantage=advantage,
            group=G,
            current=current,
            n_boot=n_boot,
            seed=seed,
        )
    val_lines = val = val_lm = None
    if validate:
        from simkit.diagnose import validation as _validation
        from simkit.diagnose import validation_lm as _validation_lm

        table = _validation.run()
        val, val_lines = _validation.summary(table), _validation.lines(table)
        lm_table, lm_prov = _validation_lm.stored()
        val_lm = _validation_lm.summary(lm_table)
        val_lines += _validation_lm.lines(lm_table, lm_prov)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        payload = {
            "input": str(path),
            "layout": ro.layout,
            "columns": ro.sources,
            **mt,
            "twin_n": n,
            "aggregation": aggregation,
            "advantage": advantage,
            "group_size": G,
            "twin": {leg: p.to_dict(orient="records") for leg, p in preds.items()},
            "answer": None if answer is None else answer[0].to_dict(orient="records"),
            "curves": None if answer is None else answer[1].to_dict(orient="records"),
            "current": None if answer is None else answer[2],
            "validation": val,
            "validation_smollm2": val_lm,
            "caveats": list(CAVEATS),
        }
        (tmp / "metrics.json").write_text(json.dumps(payload, indent=2, default=float))
        _plot(mt, preds, tmp / "diagnose.png")
        (tmp / "report.md").write_text(_markdown(path, ro, mt, preds, answer, val_lines))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
