"""Truncated sampling (top-p / top-k) seen in a dump: the log-ratio offset by the kept mass.

With top-p or top-k sampling the engine samples from μ(y|h) = π_e(y|h)/K(h) on the kept set
S(h) and returns these renormalised log-probabilities, K(h) = π_e(S(h)|h) the kept mass. The
trainer's π is not truncated, so on every sampled token

    log w_t = log π(y_t|h_t) − log μ(y_t|h_t) = log K(h_t) + (log π − log π_e)(y_t|h_t):

an offset log K(h_t) ≤ 0, the same for every token of S(h) (constant within a position's
support), on top of the numerical mismatch. Three consequences used here:

- E_μ[w | h] = π(S(h)|h): without truncation it is 1 (full support), with it the kept mass
  (exactly, when π_e = π). So the mean of w over the valid tokens estimates the mean kept mass
  K̄ under μ's visited states, and a 95% interval below 1 detects truncation (a full-support
  μ cannot give E_μ[w] < 1);
- responses of one prompt share h at their first token, so log w_0 is the same for all of a
  group's responses when the offset is the only mismatch: the within-group spread of log w_0
  against the spread between groups is reported when the dump has group ids;
- K(h) ≥ p for top-p: min_t w_t bounds top_p from above (if the offset is the only mismatch).

What the offset does, reported from the dump: every ratio-based metric includes it (k1 = −E
log w ≈ −E log K is truncation, not engine error; the sequence weight W carries Π_t K(h_t));
a correction's *lower* band rejects tokens or sequences on truncation alone — the shares of
tokens with w below IcePop / MIS lower bounds and of sequences whose geometric mean of w is
below geo-mask's are listed; χ²(π‖μ) itself is infinite (π has mass where μ has none), so the
χ² estimates of the report measure only μ's support. The trl#6789 report (mean ratio 0.896 at
top_p 0.8) is this offset.

numpy only.
"""

from __future__ import annotations

import numpy as np

#: lower bounds of the corrections whose rejections the report lists (IcePop / token MIS
#: c_low = 0.5, geo-mask c_low = 0.5 are the simkit defaults; 0.8 a tighter band)
LOWER_BANDS = (0.5, 0.8, 0.9)


def kept_mass(log_num, log_den, mask, groups=None, seed: int = 0, n_boot: int = 500) -> dict:
    """The truncation check of one leg (module docstring), as a JSON-able dict.

    ``kept_mass``: mean of w over valid tokens with a 95% bootstrap interval over responses;
    ``detected``: that interval lies below 1; ``min_w``; ``share_w_above_1``: tokens with
    w > 1 + 1e-6 (0 when the offset is the only mismatch); ``token_reject``/``seq_reject``:
    c → share of tokens with w < c / of sequences with exp(mean_t log w) < c, for c in
    :data:`LOWER_BANDS`; ``mean_log_W``: the mean sequence log-weight; ``first_token_spread``
    (with groups): within-group and between-group standard deviations of log w at t = 0."""
    m = np.asarray(mask, bool)
    r = np.where(m, np.asarray(log_num, float) - np.asarray(log_den, float), 0.0)
    w = np.where(m, np.exp(np.minimum(r, 700.0)), 0.0)
    tokens = m.sum(1).astype(float)
    rng = np.random.default_rng(seed)
    num = w.sum(1)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    boot = num[idx].sum(1) / tokens[idx].sum(1)
    K = float(num.sum() / tokens.sum())
    lo, hi = (float(x) for x in np.quantile(boot, [0.025, 0.975]))
    geo = r.sum(1) / np.maximum(tokens, 1.0)
    out = {
        "kept_mass": {"value": K, "lo": lo, "hi": hi},
        "detected": bool(hi < 1.0),
        "min_w": float(w[m].min()),
        "share_w_above_1": float(np.mean(w[m] > 1.0 + 1e-6)),
        "token_reject": {f"{c:g}": float(np.mean(w[m] < c)) for c in LOWER_BANDS},
        "seq_reject": {f"{c:g}": float(np.mean(np.exp(geo) < c)) for c in LOWER_BANDS},
        "mean_log_W": float(r.sum(1).mean()),
        "first_token_spread": None,
    }
    if groups is not None:
        g = np.asarray(groups)
        first = m[:, 0]
        r0, g0 = r[first, 0], g[first]
        sizes = np.bincount(g0)
        if (sizes >= 2).any():
            means = np.bincount(g0, weights=r0) / np.maximum(sizes, 1)
            within = float(np.sqrt(np.sum((r0 - means[g0]) ** 2) / max(len(r0) - len(sizes), 1)))
            out["first_token_spread"] = {
                "within_group_sd": within,
                "between_group_sd": float(np.std(means[sizes > 0])),
            }
    return out


def summary_lines(tr: dict) -> list[str]:
    """Markdown lines of the truncation check (report.md)."""
    k = tr["kept_mass"]
    if not tr["detected"]:
        return [
            f"Truncated sampling: not detected (mean w = {k['value']:.4g} [{k['lo']:.4g}, "
            f"{k['hi']:.4g}], consistent with full support).",
            "",
        ]
    lines = [
        f"**Truncated sampling (top-p / top-k) detected**: mean w = {k['value']:.4g} "
        f"[{k['lo']:.4g}, {k['hi']:.4g}] < 1, which a full-support engine cannot give. The engine "
        "returned log-probabilities renormalised over the kept tokens, so log w = log K(h) + "
        f"(engine error) on every token: mean kept mass K̄ ≈ {k['value']:.3g}; "
        f"min w = {tr['min_w']:.3g} (top_p ≤ this if the offset is the only mismatch); "
        f"{tr['share_w_above_1']:.1%} of tokens have w > 1.",
        "",
        f"- Every ratio-based number above includes the offset: mean sequence log W = "
        f"{tr['mean_log_W']:.3g} (Π_t K); χ²(π‖μ) is infinite (π has mass outside the kept "
        "set), the χ² rows measure μ's support only.",
        "- Lower bands reject on truncation alone — share of tokens with w < c: "
        + ", ".join(f"c = {c}: {v:.1%}" for c, v in tr["token_reject"].items())
        + "; share of sequences with geometric-mean w < c: "
        + ", ".join(f"c = {c}: {v:.1%}" for c, v in tr["seq_reject"].items())
        + ".",
        "- Caps above 1 (TIS, MIS c_high) act on ratios already shrunk by K: a cap C behaves "
        "like C/K on the engine-error part.",
    ]
    sp = tr["first_token_spread"]
    if sp is not None:
        lines.append(
            f"- Constant within a position's support: at the first response token (one context "
            f"per prompt) log w varies by sd {sp['within_group_sd']:.3g} within a prompt's "
            f"group vs {sp['between_group_sd']:.3g} between prompts."
        )
    lines += [
        "- To separate the engine error from the offset, log the engine's log-probabilities "
        "before truncation, or sample without top-p / top-k for the diagnosis.",
        "",
    ]
    return lines
