"""Shared test helpers: the small bandit sweep configuration the sweep, CLI, report and
reliability tests write to disk (imported as ``from conftest import bandit_toml``), and the
random token-MDP behaviours of the moment tests (``from conftest import noisy_policy``), and
session fixtures for data that several test modules compute the same way."""

from __future__ import annotations

import copy

import numpy as np
import pytest


@pytest.fixture(scope="session")
def _bandit_small_data_once():
    from simkit.figures import bandit_bias_variance

    return bandit_bias_variance.compute(bandit_bias_variance.config(small=True))


@pytest.fixture(scope="module")
def bandit_small_data(_bandit_small_data_once):
    """``bandit_bias_variance.compute(config(small=True))`` (≈ 4 s of CPU), computed once per
    test process and shared by tests/test_figures.py and tests/test_figure_claims.py (issue
    28); each module gets its own deep copy, as when each computed it."""
    return copy.deepcopy(_bandit_small_data_once)


def noisy_policy(logits, seed: int, scale: float, zero_last: bool = False) -> np.ndarray:
    """softmax(``logits`` + ``scale``·N(0, 1)) over the last axis, the noise drawn from
    ``default_rng(seed)``. ``zero_last``: the last token gets probability 0 (a token the
    behaviour never emits)."""
    rng = np.random.default_rng(seed)
    logits = logits + scale * rng.standard_normal(np.shape(logits))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    if zero_last:
        e[..., -1] = 0.0
    return e / e.sum(axis=-1, keepdims=True)


def bandit_toml(name: str, seed: int, targets, estimators=("naive", "is_seq")) -> str:
    """The text of a small bandit sweep file (K = 4 arms, n ∈ {8, 16}, 20 batches, 20
    bootstrap resamples, logit-noise behaviours at the χ² ``targets``). ``estimators``: mapping
    names, or (name, extra TOML line) pairs such as ``("ppo_clip", "grid = { eps_high = [0.2,
    0.28] }")``. Tests edit the text with ``str.replace`` (``"n = [8, 16]"``, ``"reps = 20"``,
    ``"K = 4"``, ``'mapping = "snis"'``), so those lines keep this spelling."""
    blocks = []
    for entry in estimators:
        mapping, extra = (entry, None) if isinstance(entry, str) else entry
        blocks.append(f'[[estimators]]\nmapping = "{mapping}"\n' + (f"{extra}\n" if extra else ""))
    return (
        f'name = "{name}"\n'
        f"seed = {seed}\n"
        "n = [8, 16]\n"
        "reps = 20\n"
        "n_boot = 20\n"
        "\n"
        "[environment]\n"
        'kind = "bandit"\n'
        "K = 4\n"
        "seed = 0\n"
        "\n"
        "[behaviour]\n"
        'family = "logit_noise"\n'
        'divergence = "chi2"\n'
        f"targets = {list(targets)}\n"
        "\n" + "\n".join(blocks)
    )
