"""``simkit diagnose`` on rollouts written by ``simkit lm dump`` (tiny model) and bad input."""

import json

import numpy as np
import pandas as pd
import pytest

from simkit import diagnose

# one xdist worker runs this module, so that
# its module fixture (the dump and its report) is computed once
pytestmark = pytest.mark.xdist_group("diagnose")

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    from simkit.lm import dump, models, tasks

    torch.set_num_threads(1)
    model = models.tiny_llama(dtype=torch.float64, init_std=1.0)
    task = tasks.get_task("token", vocab_size=64, target=58, n_prompts=4)
    out = {}
    for fmt in ("verl", "trl", "long"):
        table, meta = dump.dump_table(model, task, "temperature:1.3", n=256, T=6, fmt=fmt)
        path, _ = dump.write(
            table,
            meta,
            tmp_path_factory.mktemp(fmt) / f"d.{'parquet' if fmt != 'trl' else 'jsonl'}",
        )
        out[fmt] = (path, meta)
    return out


def test_formats_read_to_the_same_rollouts(dumped):
    a = diagnose.read_rollouts(dumped["verl"][0])
    b = diagnose.read_rollouts(dumped["trl"][0])
    c = diagnose.read_rollouts(dumped["long"][0])
    assert (
        a.sources["log_pi"] == "old_log_probs" and b.sources["log_mu"] == "sampling_per_token_logps"
    )
    assert c.layout == "long"
    for x in (b, c):
        np.testing.assert_allclose(x.log_pi, a.log_pi, atol=1e-12)
        np.testing.assert_allclose(x.log_mu, a.log_mu, atol=1e-12)
        np.testing.assert_array_equal(x.mask, a.mask)
        np.testing.assert_allclose(x.rewards, a.rewards)


def test_diagnose_recovers_the_known_chi2_end_to_end(dumped, tmp_path):
    from simkit.cli import main

    path, meta = dumped["verl"]
    out = tmp_path / "report"
    assert main(["diagnose", str(path), "--out", str(out), "--boot", "4"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    leg = metrics["legs"]["mismatch"]
    assert "staleness" not in metrics["legs"]  # the dump has no π at update time
    for key in ("chi2_tok", "chi2_tok_w2"):  # both unbiased: (w − 1)² and w² − 1
        assert leg[key]["lo"] <= meta["chi2_tok"] <= leg[key]["hi"]  # exact χ² over the vocab
    assert leg["chi2_tok"]["lo"] >= 0 and leg["chi2_seq"]["lo"] >= 0  # non-negative estimators
    assert meta["chi2_tok"] > 0.01  # a mismatch to recover
    assert metrics["N"] == 256 and leg["kl_k3"]["value"] > 0 and leg["rankable"]
    report = (out / "report.md").read_text()
    assert "Caveats" in report and "| 1 |" in report
    assert "this dump has no π at update time, so the surrogates are not ranked" in report
    assert (out / "diagnose.png").stat().st_size > 1000
    twin = metrics["twin"]["mismatch"]
    ranks = [row["rel_mse_scaled"] for row in twin]
    assert ranks == sorted(ranks)  # ranked by the predicted scale-free error
    assert all(0.0 <= r <= 1.0 for r in ranks) and metrics["twin_n"] == 8
    rows = {row["mapping"]: row for row in twin}
    # only the corrections that act on π_old‖μ are ranked there
    assert set(rows) == set(diagnose.legs.MISMATCH_CORRECTIONS)
    assert rows["naive"]["kept"] == 1.0 and rows["naive"]["kept_seq"] == 1.0
    assert "rel. scaled MSE" in report and "n = 8" in report
    # an existing report is not overwritten without --force
    assert main(["diagnose", str(path), "--out", str(out), "--boot", "4"]) == 2


def _write(tmp_path, df, name="r.parquet"):
    path = tmp_path / name
    df.to_parquet(path, index=False)
    return path


@pytest.mark.parametrize(
    "frame,match",
    [
        (
            pd.DataFrame({"logp": [[-1.0]], "rollout_log_probs": [[-1.0]], "rewards": [1.0]}),
            r"r.parquet: one leg only: no log_pi column \(expected one of old_log_probs.*"
            r"columns found: logp, rollout_log_probs",
        ),
        (
            pd.DataFrame(
                {"old_log_probs": [[-1.0, -2.0]], "rollout_log_probs": [[-1.0]], "rewards": [1.0]}
            ),
            "row 0: per-token lengths differ: old_log_probs has 2, rollout_log_probs 1",
        ),
        (
            pd.DataFrame(
                {
                    "old_log_probs": [[-1.0, np.nan]],
                    "rollout_log_probs": [[-1.0, -1.0]],
                    "rewards": [1.0],
                }
            ),
            "NaN/inf values on valid tokens",
        ),
        (
            pd.DataFrame({"old_log_probs": [[-1.0]], "rollout_log_probs": [[-1.0]]}),
            "no reward column",
        ),
    ],
)
def test_bad_input_is_a_clear_error_and_nothing_is_written(tmp_path, frame, match):
    path = _write(tmp_path, frame)
    out = tmp_path / "report"
    with pytest.raises(diagnose.RolloutError, match=match):
        diagnose.diagnose(path, out)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".report")]


def test_empty_file_and_flags(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(diagnose.RolloutError, match="is empty"):
        diagnose.read_rollouts(empty)
    df = pd.DataFrame({"a": [[-1.0, -0.5], [-0.2]], "b": [[-1.1, -0.4], [-0.3]], "acc": [1.0, 0.0]})
    path = _write(tmp_path, df)
    ro = diagnose.read_rollouts(path, {"log_pi": "a", "log_mu": "b", "reward": "acc"})
    assert ro.mask.sum() == 3 and ro.sources["reward"] == "acc"
    with pytest.raises(diagnose.RolloutError, match=r"column 'zz' .* is not in the file"):
        diagnose.read_rollouts(path, {"log_pi": "zz", "log_mu": "b", "reward": "acc"})
