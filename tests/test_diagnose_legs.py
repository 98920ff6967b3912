"""``simkit diagnose`` with two legs (π_old‖μ and π‖π_old), the user's batch and the refusal
to rank on too few effective sequences."""

import json

import numpy as np
import pandas as pd
import pytest

from simkit.cli import main
from simkit.diagnose import RolloutError, diagnose, legs


def _dump(tmp_path, N=256, T=6, G=8, seed=0, name="d.parquet"):
    rng = np.random.default_rng(seed)
    log_mu = np.log(rng.uniform(0.05, 1.0, size=(N, T)))
    log_old = np.minimum(log_mu + 0.05 * rng.standard_normal((N, T)), 0.0)
    log_new = np.minimum(log_old + 0.1 * rng.standard_normal((N, T)), 0.0)
    lengths = rng.integers(2, T + 1, size=N)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(int)
    df = pd.DataFrame(
        {
            "old_per_token_logps": list(log_old),
            "sampling_per_token_logps": list(log_mu),
            "per_token_logps": list(log_new),
            "completion_mask": list(mask),
            "rewards": rng.integers(0, 2, size=N).astype(float),
            "prompt_id": np.repeat(np.arange(N // G), G),
        }
    )
    path = tmp_path / name
    df.to_parquet(path)
    return path


def test_two_legs_rank_only_their_own_mappings_with_the_users_batch(tmp_path):
    path = _dump(tmp_path)
    out = tmp_path / "r"
    args = ["diagnose", str(path), "--out", str(out), "--boot", "3", "--aggregation", "token-mean"]
    args += ["--mappings", "naive,tis_token,icepop,ppo_clip,gspo"]
    assert main(args) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["legs"]) == {"mismatch", "staleness"}
    # groups of 8 from prompt_id: GRPO advantage, n = 8 by default
    assert m["groups"] == 32 and m["group_size"] == 8 and m["advantage"] == "grpo"
    assert m["twin_n"] == 8 and m["aggregation"] == "token-mean"
    ranked = {leg: {r["mapping"] for r in rows} for leg, rows in m["twin"].items()}
    assert ranked == {
        "mismatch": {"naive", "tis_token", "icepop"},
        "staleness": {"naive", "ppo_clip", "gspo"},
    }
    # the staleness leg is the larger one here (noise 0.1 vs 0.05 on the log-ratio)
    s, mm = m["legs"]["staleness"], m["legs"]["mismatch"]
    assert s["chi2_tok"]["lo"] > mm["chi2_tok"]["hi"]
    text = (out / "report.md").read_text()
    assert "## π‖π_old: policy at update vs at rollout (staleness)" in text
    assert "aggregation `token-mean`, advantage `grpo`" in text


def test_too_few_effective_sequences_are_not_ranked(tmp_path):
    path = _dump(tmp_path, N=24, G=4)
    out = tmp_path / "r"
    diagnose(path, out, n_boot=2)
    m = json.loads((out / "metrics.json").read_text())
    assert m["twin"] == {}
    for leg in ("mismatch", "staleness"):
        assert not m["legs"][leg]["rankable"]
        assert m["legs"][leg]["refusal"].startswith("not ranked: ESS of the sequence weights")
    assert "**not ranked: ESS of the sequence weights" in (out / "report.md").read_text()
    assert legs.MIN_ESS == 30 and legs.MAX_KHAT == 0.7


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"n": 12}, "--n 12 must be a multiple of the group size 8"),
        ({"aggregation": "tok-mean"}, "--aggregation 'tok-mean': expected one of"),
        ({"advantage": "gae"}, "--advantage 'gae': expected one of"),
    ],
)
def test_bad_batch_settings(tmp_path, kw, match):
    path = _dump(tmp_path, N=32)
    with pytest.raises(RolloutError, match=match):
        diagnose(path, tmp_path / "r", **kw)
    assert not (tmp_path / "r").exists()


def test_identical_columns_are_named_as_verl_bypass_mode(tmp_path):
    df = pd.DataFrame(
        {
            "old_log_probs": [[-1.0, -0.5]] * 40,
            "rollout_log_probs": [[-1.0, -0.5]] * 40,
            "rewards": [1.0, 0.0] * 20,
        }
    )
    path = tmp_path / "b.parquet"
    df.to_parquet(path)
    diagnose(path, tmp_path / "r", validate=False)
    m = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert m["legs"]["mismatch"]["refusal"].startswith(
        "not ranked: the two log-prob columns are identical on every token (verl's bypass mode"
    )
    assert m["twin"] == {} and m["answer"] is None
