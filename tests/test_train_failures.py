"""Failure detection in training summaries (issue 16 §4): collapse, premature determinism,
length blow-up, divergence explosion, stall — one column and one label each."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simkit.train.analysis import (
    DETERMINISM_ENTROPY,
    FAILURE_LABELS,
    KL_SEQ_EXPLOSION,
    LENGTH_BLOWUP,
    failure_label,
    run_summary,
)


def run_table(J, entropy=None, length=None, kl=None) -> pd.DataFrame:
    n = len(J)
    return pd.DataFrame(
        {
            "run": 0,
            "step": np.arange(n),
            "recorded": True,
            "J": J,
            "cosine": 0.5,
            "zero_frac": 0.0,
            "chi2_seq": 0.0,
            "kl_seq": np.zeros(n) if kl is None else kl,
            "entropy": np.ones(n) if entropy is None else entropy,
            "length": np.full(n, 4.0) if length is None else length,
        }
    )


def summary(table, J_star=1.0):
    return run_summary(table, "run", J_star=J_star).iloc[0]


def test_ok_run():
    s = summary(run_table(np.linspace(0.1, 0.95, 20)))
    assert s["failure"] == "ok"
    assert not (s["collapsed"] or s["determinism"] or s["stalled"])
    assert s["gain"] == pytest.approx((0.95 + np.linspace(0.1, 0.95, 20)[-2]) / 2 / 0.9 - 0.1 / 0.9)


def test_collapse():
    J = np.concatenate([np.linspace(0.1, 0.8, 10), np.full(10, 0.2)])
    s = summary(run_table(J))
    assert s["collapsed"] and s["failure"] == "collapse"


def test_premature_determinism_needs_low_entropy_and_low_J():
    J = np.linspace(0.0, 0.01, 20)  # J stuck far below J* = 1
    h = np.linspace(2.0, 0.05, 20)  # entropy collapsed: 0.05 < 0.1·2
    s = summary(run_table(J, entropy=h))
    assert s["determinism"] and s["failure"] == "determinism"
    # the same entropy collapse at the optimum is convergence, not a failure
    s = summary(run_table(np.linspace(0.0, 1.0, 20), entropy=h))
    assert not s["determinism"] and s["failure"] == "ok"
    # low J with entropy kept: a stall
    s = summary(run_table(J, entropy=np.full(20, 2.0)))
    assert s["failure"] == "stall" and not s["determinism"]
    # just above the threshold: not determinism
    s = summary(run_table(J, entropy=np.full(20, 2.0 * DETERMINISM_ENTROPY * 1.01)))
    assert not s["determinism"]


def test_length_blowup():
    J = np.linspace(0.1, 0.9, 20)
    s = summary(run_table(J, length=np.linspace(3.0, 3.0 * LENGTH_BLOWUP + 0.1, 20)))
    assert s["length_blowup"] and s["failure"] == "length"
    s = summary(run_table(J, length=np.linspace(3.0, 3.0 * LENGTH_BLOWUP - 0.1, 20)))
    assert not s["length_blowup"] and s["length_max"] == pytest.approx(3 * LENGTH_BLOWUP - 0.1)


def test_divergence_explosion():
    J = np.linspace(0.1, 0.9, 20)
    kl = np.zeros(20)
    kl[7] = KL_SEQ_EXPLOSION + 1
    s = summary(run_table(J, kl=kl))
    assert s["divergence_explosion"] and s["failure"] == "divergence"
    assert s["kl_seq_max"] == KL_SEQ_EXPLOSION + 1
    kl[7] = KL_SEQ_EXPLOSION
    assert not summary(run_table(J, kl=kl))["divergence_explosion"]


def test_label_order_and_no_J_star():
    assert failure_label(True, True, True, True, True) == "collapse"
    assert failure_label(False, False, True, True, False) == "length"
    assert failure_label(False, False, False, False, False) == "ok"
    assert FAILURE_LABELS[-1] == "ok"
    s = run_summary(run_table(np.full(10, 0.01)), "run").iloc[0]  # no J*: no gain, no stall
    assert np.isnan(s["gain"]) and s["failure"] == "ok"
    tab = run_table(np.full(10, 0.01)).assign(J_star=1.0)
    assert run_summary(tab, "run").iloc[0]["failure"] == "stall"
