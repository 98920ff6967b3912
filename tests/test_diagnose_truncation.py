"""``simkit diagnose`` on a dump from top-p sampling: the kept-mass offset is detected, its
size recovered exactly, and reported (simkit.diagnose.truncation)."""

import json

import numpy as np
import pytest

from simkit.diagnose import diagnose, read_rollouts
from simkit.diagnose.truncation import kept_mass

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")


@pytest.fixture(scope="module")
def top_p_dump(tmp_path_factory):
    from simkit.lm import dump, models, tasks

    torch.set_num_threads(1)
    model = models.tiny_llama(dtype=torch.float64, init_std=1.0)
    task = tasks.get_task("token", vocab_size=64, target=58, n_prompts=4)
    table, meta = dump.dump_table(model, task, "top_p:0.8", n=256, T=6, fmt="verl")
    path, _ = dump.write(table, meta, tmp_path_factory.mktemp("topp") / "d.parquet")
    return path, meta


def test_kept_mass_is_recovered_exactly_and_the_offset_detected(top_p_dump, tmp_path):
    path, meta = top_p_dump
    ro = read_rollouts(path)
    tr = kept_mass(ro.log_pi, ro.log_mu, ro.mask)
    # μ = π renormalised on its nucleus: w = K(h) on every token, TV(π, μ) = 1 − K(h), so the
    # token mean of w is 1 − the exact token-mean TV of the dump (same visited states)
    assert tr["kept_mass"]["value"] == pytest.approx(1.0 - meta["tv_tok"], abs=1e-10)
    assert tr["detected"] and tr["kept_mass"]["hi"] < 1.0
    assert tr["share_w_above_1"] == 0.0  # the offset is one-sided
    assert 0.8 <= tr["min_w"] < 1.0  # K ≥ top_p
    out = tmp_path / "r"
    diagnose(path, out, n_boot=2)
    m = json.loads((out / "metrics.json").read_text())
    assert m["legs"]["mismatch"]["truncation"]["detected"]
    text = (out / "report.md").read_text()
    assert "**Truncated sampling (top-p / top-k) detected**" in text
    assert f"mean kept mass K̄ ≈ {tr['kept_mass']['value']:.3g}" in text


def test_no_truncation_is_not_flagged_and_groups_show_constancy(top_p_dump):
    rng = np.random.default_rng(0)
    N, T = 400, 5
    log_mu = np.log(rng.uniform(0.05, 0.9, size=(N, T)))
    mask = np.ones((N, T), bool)
    # a full-support mismatch with E_μ[w] = 1: w ∈ {0.9, 1.1} with equal μ-probability
    w = np.where(rng.random((N, T)) < 0.5, 0.9, 1.1)
    tr = kept_mass(log_mu + np.log(w), log_mu, mask)
    assert not tr["detected"] and tr["kept_mass"]["lo"] < 1.0 < tr["kept_mass"]["hi"]
    # a pure offset shared by each prompt's first token: no spread within groups
    groups = np.repeat(np.arange(N // 8), 8)
    K = rng.uniform(0.8, 1.0, size=N // 8)[groups]
    off = np.log(rng.uniform(0.8, 1.0, size=(N, T)))
    off[:, 0] = np.log(K)
    tr = kept_mass(log_mu + off, log_mu, mask, groups)
    sp = tr["first_token_spread"]
    assert tr["detected"] and sp["within_group_sd"] < 1e-12 < sp["between_group_sd"]
