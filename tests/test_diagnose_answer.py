"""The answer of ``simkit diagnose`` (thresholds per correction family, the user's current
setting) and its validation on token-MDP twins with exact truth."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from simkit.diagnose import RolloutError, diagnose, validation
from simkit.diagnose.recommend import FAMILIES, parse_setting, recommend

ROOT = Path(__file__).resolve().parents[1]


def _logged(seed=1, case=1):
    from simkit.envs.random_instances import random_behaviour, random_token_mdp

    _name, kind, family, target, s = validation.CASES[case]
    rng = np.random.default_rng(s)
    env = random_token_mdp(rng, kind, V=4, T=6)
    mu = random_behaviour(env, rng, target=target, family=family)
    return validation.logged(env, mu, 2000, seed)


def assert_pages_state(phrases, pages=("README.md", "docs/diagnose.md")):
    """Every phrase appears in every page (whitespace runs read as one space)."""
    for page in pages:
        text = re.sub(r"\s+", " ", (ROOT / page).read_text())
        for phrase in phrases:
            assert phrase in text, f"{page} does not state {phrase!r}"


def test_recommendation_per_family_and_the_current_setting():
    lpi, lmu, mask, rewards = _logged()
    answer, curves, cur = recommend(
        lpi, lmu, mask, rewards, n=8, current="tis_token:c_high=2", n_boot=4
    )
    assert list(answer.family) != [] and set(answer.family) == set(FAMILIES)
    assert list(answer.rel_mse_scaled) == sorted(answer.rel_mse_scaled)
    for r in answer.itertuples():
        grid = FAMILIES[r.family][2]
        fam = curves[curves.family == r.family]
        # the recommendation is the argmin of the family's predicted curve
        assert r.value in grid and r.rel_mse_scaled == fam.rel_mse_scaled.min()
        assert r.value_lo <= r.value_hi and r.value_lo in grid and r.value_hi in grid
        assert 0 <= r.rel_mse_scaled_lo <= r.rel_mse_scaled <= r.rel_mse_scaled_hi <= 1
        assert 0 <= r.kept <= 1 and 0 <= r.kept_seq <= 1
        span = fam.rel_mse_scaled.max() - fam.rel_mse_scaled.min()
        assert r.flat == (span < 0.005)
    # c_high = 2 is on the tis_token grid: the family's best cannot be worse
    assert cur["best_family"] == "tis_token" and cur["excess"] >= 0
    row = curves[(curves.family == "tis_token") & (curves.value == 2.0)].iloc[0]
    assert cur["rel_mse_scaled"] == pytest.approx(row.rel_mse_scaled, abs=1e-12)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("tis_tok:c_high=2", r"--current 'tis_tok:c_high=2': unknown mapping 'tis_tok'"),
        ("tis_token:c_high", r"--current 'tis_token:c_high': expected key=value"),
        ("tis_token:cap=2", r"--current 'tis_token:cap=2': "),
    ],
)
def test_bad_current_setting(spec, match, tmp_path):
    with pytest.raises(RolloutError, match=match):
        parse_setting(spec)


def test_report_prints_the_answer_and_the_validation(tmp_path):
    import pandas as pd

    lpi, lmu, mask, rewards = _logged(case=2)  # k̂ ≤ 0.7: ranked
    df = pd.DataFrame(
        {
            "old_log_probs": [r[m] for r, m in zip(lpi, mask)],
            "rollout_log_probs": [r[m] for r, m in zip(lmu, mask)],
            "rewards": rewards,
        }
    )
    path = tmp_path / "d.parquet"
    df.to_parquet(path)
    out = tmp_path / "r"
    diagnose(path, out, n_boot=3, current="icepop:c_low=0.5,c_high=5")
    m = json.loads((out / "metrics.json").read_text())
    assert {r["family"] for r in m["answer"]} == set(FAMILIES)
    assert m["current"]["best_family"] == "icepop"
    text = (out / "report.md").read_text()
    assert "### The answer: thresholds for π_old‖μ" in text
    assert "Your setting `icepop:c_low=0.5,c_high=5`" in text
    assert "## How far to trust the twin: validation on exact twins" in text
    assert m["validation"] == validation.summary(validation.run())
    # the stored validation on the exact SmolLM2 tree (simkit.diagnose.validation_lm)
    from simkit.diagnose import validation_lm

    lm_table, lm_prov = validation_lm.stored()
    assert m["validation_smollm2"] == validation_lm.summary(lm_table)
    assert "\n".join(validation_lm.lines(lm_table, lm_prov)) in text


def test_validation_meets_the_threshold_target_and_the_docs_print_its_numbers():
    s = validation.summary(validation.run())
    assert s["excess_max"] <= 0.10  # recommended thresholds within 10% of the exact optimum
    assert s["pair_agreement_median"] >= 0.9 and s["rho_median"] >= 0.8
    # README and the docs page print the numbers of this run
    stated = (
        f"min {s['rho_min']:.2f}, median {s['rho_median']:.2f}",
        f"max {s['excess_max']:.1%} (median {s['excess_median']:.1%})",
        f"min {s['pair_agreement_min']:.0%}, median {s['pair_agreement_median']:.0%}",
    )
    assert_pages_state(stated)


def test_more_logged_responses_leave_the_worst_case_and_the_docs_say_so():
    """4× more logged responses leave the worst case where it is: its miss is the twin's
    systematic error, not sampling noise (README and docs print the N = 8000 numbers)."""
    base = validation.summary(validation.run())
    more = validation.summary(validation.run(N=8000))
    assert base["rho_at_least_0.8"] <= more["rho_at_least_0.8"] < more["cases"]
    assert abs(more["rho_min"] - base["rho_min"]) < 0.1 and more["rho_min"] < 0.8
    phrase = (
        "N = 8000",
        f"min {more['rho_min']:.2f}, median {more['rho_median']:.2f} "
        f"(≥ 0.8 in {more['rho_at_least_0.8']} of {more['cases']} cases)",
    )
    assert_pages_state(phrase)


def test_fresh_instances_and_the_docs_say_what_they_give():
    """16 fresh instances of the eight designs (seeds + 100, + 200): the docs print their
    numbers, including the threshold target's miss; an instance whose 2000 logged rewards are
    all 0 has no signal and is refused, not scored."""
    table = validation.run(validation.HELD_OUT)
    s = validation.summary(table)
    no_signal = table[~np.isfinite(table["rho"].to_numpy(dtype=float))]
    assert s["no_signal"] == len(no_signal) and no_signal["refused"].all()
    phrase = (
        f"{s['cases'] + s['no_signal']} fresh instances",
        f"min {s['rho_min']:.2f}, median {s['rho_median']:.2f} "
        f"(≥ 0.8 in {s['rho_at_least_0.8']} of {s['cases']} cases)",
        f"excess max {s['excess_max']:.1%} (above 10% in {s['excess_above_10%']} of "
        f"{s['cases']} cases)",
        f"{s['no_signal']} instance",
    )
    assert_pages_state(phrase)


def test_a_dump_whose_rewards_are_all_equal_is_not_ranked():
    from simkit.diagnose.legs import leg_metrics

    lpi, lmu, mask, rewards = _logged(case=2)
    assert leg_metrics(lpi, lmu, mask, rewards=rewards)["rankable"]
    lm = leg_metrics(lpi, lmu, mask, rewards=np.zeros_like(rewards))
    assert not lm["rankable"] and "every logged reward is 0" in lm["refusal"]


@pytest.mark.xfail(
    strict=True,
    reason="ρ ≥ 0.8 on every case is not met: on the temperature χ² 0.2 and the concentrated "
    "χ² 0.5 twins the twin's score model (a softmax over mismatch atoms) misorders corrections "
    "that the exact errors separate (min ρ 0.69, 78% of resolved pairs ordered); more "
    "logged responses do not lift the worst case",
)
def test_rho_at_least_0_8_on_every_case():
    assert validation.summary(validation.run())["rho_min"] >= 0.8


def test_the_docs_name_the_missed_cases_and_the_two_bin_numbers():
    """The sentences of README and the docs page on which twins miss ρ ≥ 0.8 (with their ρ and
    resolved-pair share), and on what two probability bins gave instead of four."""
    table = validation.run()
    missed = table[table["rho"] < 0.8]
    assert list(missed["case"]) == [
        "temperature, χ² 0.2",
        "concentrated on 10% of states, χ² 0.5 there",
    ]
    docs = [f'"{r.case}" (ρ {r.rho:.2f},' for r in missed.itertuples()]
    docs += [f"{r.pair_agreement:.0%}" for r in missed.itertuples()]
    assert_pages_state(docs, pages=("docs/diagnose.md",))
    assert_pages_state(
        ("the target is missed on the temperature χ² 0.2 and the concentrated χ² 0.5 twins",),
        pages=("README.md",),
    )
    held = validation.run(validation.HELD_OUT)
    first = held.iloc[:8]  # the seeds + 100 instances
    two = validation.run(prob_bins=2), validation.run(validation.HELD_OUT[:8], prob_bins=2)
    phrase = (
        f"two bins give min ρ {two[0]['rho'].min():.2f} on the eight cases and "
        f"{two[1]['rho'].min():.2f} on the seeds + 100 instances; four give "
        f"{table['rho'].min():.2f} and {first['rho'].min():.2f}"
    ).replace("-", "−")
    assert_pages_state((phrase,), pages=("docs/diagnose.md",))
