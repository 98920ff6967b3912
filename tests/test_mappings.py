"""Registry-driven battery for every weight mapping of ``simkit.mappings``.

Each property is checked for every name in ``available()`` (exceptions are listed by name with a
reason). Exact properties use tolerances of 1e-12 relative; the reference coefficients come from
an independent per-element Python implementation of each formula of the notation page
``docs/reference.md`` (the weighted policy gradient and the Mappings tables).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simkit import mappings
from simkit.mappings import ScalarMapping, available, get, mapping_class

CANONICAL = [
    "naive",
    "is_token",
    "is_seq",
    "power",
    "snis",
    "psis",
    "soft_shrink",
    "ppo_clip",
    "dual_clip",
    "dapo",
    "gspo",
    "gmpo",
    "sapo",
    "luffy",
    "aspo",
    "cispo",
    "tis_token",
    "tis_seq",
    "mis_token",
    "mis_seq",
    "icepop",
    "geo_mask",
    "opsm",
    "token_veto",
    "m2po",
    "topr",
    "vespo",
    "kl_rs",
    "clip_cov",
    "kl_cov",
    "dro",
    "dppo_tv",
    "dppo_kl",
    "luspo",
    "rollout_is",
    "segment_is",
    "gepo",
]
ALL = available()
#: mappings whose coefficient reads the advantage's value, not only its sign (reason: the
#: token covariance (A − mean A)(log π − mean log π) selects the tokens; kl_cov's penalty
#: gradient κ·sign(log r) is written as c·A with c = r − κ·sign(log r)/A)
READS_ADVANTAGE_VALUE = {"clip_cov", "kl_cov"}
#: mappings whose coefficient may be negative (kl_cov: c = r − κ·sign(log r)/A)
SIGNED = {"kl_cov"}
SCALAR = [n for n in ALL if issubclass(mapping_class(n), ScalarMapping)]
WITH_HYPERPARAMETERS = [n for n in ALL if dataclasses.fields(mapping_class(n))]
RTOL = 1e-12
#: log μ of every token in the battery (μ(y_t) = 0.3): the mappings that need log π itself
#: (``requires_log_prob``: dppo_tv, dppo_kl, gepo) get log π = log r + log μ
LOG_MU = math.log(0.3)
#: mappings whose on-policy coefficient is not 1, with the closed form checked below
NOT_ON_POLICY_IDENTITY = {"luspo", "gepo"}


def coefs(m, log_ratio, mask, advantages):
    """``m.coefficients``, with log π = log r + :data:`LOG_MU` for a mapping that needs it."""
    if m.requires_log_prob:
        lp = np.asarray(log_ratio, dtype=np.float64) + LOG_MU
        return m.coefficients(log_ratio, mask, advantages, log_prob=lp)
    return m.coefficients(log_ratio, mask, advantages)


def random_batch(seed: int, N: int = 12, T: int = 9, scale: float = 0.4):
    """Ragged batch: log-ratios ~ N(0, scale²), prefix masks (one empty row), mixed-sign A."""
    rng = np.random.default_rng(seed)
    log_ratio = rng.normal(0.0, scale, size=(N, T))
    lengths = rng.integers(1, T + 1, size=N)
    lengths[0] = 0  # a sequence without valid tokens
    mask = np.arange(T)[None, :] < lengths[:, None]
    advantages = rng.normal(size=N)
    advantages[min(1, N - 1)] = 0.0  # A = 0 counts as positive
    return log_ratio, mask, advantages


# --- registry ------------------------------------------------------------------------------


def test_available_is_the_canonical_catalogue_in_order():
    assert ALL == CANONICAL


def test_unknown_name_raises_key_error_listing_names():
    with pytest.raises(KeyError, match="available mappings: naive, is_token") as info:
        get("ppo")
    assert "vespo" in str(info.value)


@pytest.mark.parametrize("name", ALL)
def test_unknown_hyperparameter_raises_type_error(name):
    with pytest.raises(TypeError, match="no hyperparameter"):
        get(name, not_a_hyperparameter=1.0)


@pytest.mark.parametrize("name", ALL)
def test_unknown_preset_raises_value_error(name):
    with pytest.raises(ValueError, match="no preset 'nope'"):
        get(name, preset="nope")


@pytest.mark.parametrize("name", ALL)
def test_every_preset_builds_and_overrides_apply(name):
    cls = mapping_class(name)
    for preset, values in cls.presets.items():
        m = get(name, preset=preset)
        for key, value in values.items():
            assert getattr(m, key) == value
    fields = dataclasses.fields(cls)
    if fields and cls.presets:
        preset = next(iter(cls.presets))
        field = next(iter(cls.presets[preset]))
        default = getattr(get(name, preset=preset), field)
        bumped = default + 0.5 if isinstance(default, float) and math.isfinite(default) else None
        if bumped is not None:
            assert getattr(get(name, preset=preset, **{field: bumped}), field) == bumped


def test_required_presets_and_paper_defaults():
    # values of the catalogue (docs/reference.md, Mappings tables, "defaults" and "notes" columns)
    assert get("cispo", preset="trl").phi(np.array([10.0])) == pytest.approx(5.0)
    assert get("cispo", preset="paper").eps_low == math.inf
    assert get("cispo", preset="verl").eps_low == 10.0
    assert (get("tis_token", preset="verl").c_high, get("tis_token", preset="trl").c_high) == (2, 3)
    openrlhf = get("tis_token", preset="openrlhf")
    assert (openrlhf.c_low, openrlhf.c_high) == (0.5, 5.0)
    slime = get("tis_token", preset="slime")
    assert (slime.c_low, slime.c_high) == (0, 2)
    assert get("mis_seq", preset="trl").c_high == 3.0
    assert get("mis_seq", preset="rl_collapse").c_high == 2.0
    for name in ("mis_token", "icepop"):
        assert (get(name, preset="icepop").c_low, get(name, preset="icepop").c_high) == (0.5, 5)
        assert get(name, preset="trl").c_high == 3.0
    assert (get("geo_mask", preset="verl").c_low, get("geo_mask", preset="verl").c_high) == (
        0.999,
        1.001,
    )
    assert (get("opsm", preset="slime").delta, get("opsm", preset="trl").delta) == (1e-4, 0.5)
    assert (get("gspo", preset="paper").eps_low, get("gspo", preset="paper").eps_high) == (
        3e-4,
        4e-4,
    )
    assert get("gspo", preset="libraries").eps_high == 0.2
    assert set(mapping_class("dual_clip").presets) >= {"paper", "verl"}
    # defaults
    assert (get("ppo_clip").eps_low, get("ppo_clip").eps_high) == (0.2, 0.2)
    assert (get("dapo").eps_low, get("dapo").eps_high) == (0.2, 0.28)
    assert get("gmpo").eps_low == get("gmpo").eps_high == 0.4
    assert (get("sapo").tau_pos, get("sapo").tau_neg) == (1.0, 1.05)
    assert get("tis_token").c_high == get("tis_seq").c == get("mis_seq").c_high == 2.0
    assert (get("icepop").c_low, get("icepop").c_high) == (0.5, 5.0)
    assert (get("geo_mask").c_low, get("geo_mask").c_high) == (0.5, 2.0)
    v = get("vespo")
    assert (v.k_pos, v.lambda_pos, v.k_neg, v.lambda_neg) == (2, 3, 3, 2)
    assert get("luffy").gamma == 0.1 and get("dual_clip").c_dual == 3.0
    assert get("opsm").delta == 1e-4 and get("token_veto").tau == 1e-4
    assert get("m2po").tau == 0.04


def test_levels_and_batch_dependence():
    batch = {"snis", "psis", "m2po", "clip_cov", "kl_cov", "gepo"}
    assert {n for n in ALL if mapping_class(n).batch_dependent} == batch
    assert {n for n in ALL if mapping_class(n).level == "batch"} == batch
    geometric = {n for n in SCALAR if mapping_class(n).ratio_kind == "geometric"}
    assert geometric == {"gspo", "geo_mask", "opsm"}
    for name in SCALAR:
        cls = mapping_class(name)
        if cls.ratio_kind == "token":
            assert cls.level == "token", name
        else:
            assert cls.level == "sequence", name


@pytest.mark.parametrize("name", WITH_HYPERPARAMETERS)
def test_frozen_dataclass(name):
    m = get(name)
    field = dataclasses.fields(m)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(m, field, getattr(m, field))


# --- hyperparameter validation -------------------------------------------------------------

#: at least one out-of-domain value per mapping with hyperparameters (field, bad value)
INVALID = {
    "is_token": [("max_log_ratio", 0.0), ("max_log_ratio", 800.0)],
    "is_seq": [("max_log_ratio", -1.0)],
    "power": [("alpha", -0.1), ("alpha", 1.5)],
    "soft_shrink": [("lam", -0.1), ("lam", 1.01)],
    "ppo_clip": [("eps_low", -0.1), ("eps_high", -1e-3)],
    "dual_clip": [("c_dual", 1.0), ("c_dual", 0.5)],
    "dapo": [("eps_high", -0.28), ("c_dual", 1.0)],
    "gspo": [("eps_low", -3e-4), ("grad_log_cap", 0.0)],
    "gmpo": [("eps_low", -0.4), ("eps_high", -1.0)],
    "sapo": [("tau_pos", 0.0), ("tau_neg", -1.05), ("tau_pos", math.inf)],
    "luffy": [("gamma", 0.0), ("normalize", 1.5), ("normalize", "yes")],
    "aspo": [("c_dual", 1.0), ("c_dual", math.inf), ("eps_high", -0.2)],
    "cispo": [("eps_high", -0.5), ("eps_low", -1.0)],
    "tis_token": [
        ("c_high", 0.5),
        ("c_low", 1.5),
        ("c_low", -0.1),
        ("batch_normalize", "yes"),
    ],
    "tis_seq": [("c", 0.9), ("batch_normalize", 1)],
    "mis_token": [("c_low", 2.0), ("c_high", 0.99)],
    "mis_seq": [("c_high", 0.5), ("c_low", -1.0)],
    "icepop": [("c_high", 0.8)],
    "geo_mask": [("c_low", 0.0), ("c_high", 0.9), ("base", "bogus"), ("tis_c", 0.5)],
    "opsm": [("delta", -1e-4), ("delta", math.inf)],
    "token_veto": [("tau", -1e-4), ("tau", 2.0)],
    "m2po": [("tau", -0.04), ("trust_region_only", "no")],
    "vespo": [
        ("k_pos", 0.0),
        ("lambda_neg", -2.0),
        ("max_log_ratio_tok", 0.0),
        ("max_log_ratio_seq", 1e4),
        ("min_log_ratio_seq", 0.0),
    ],
    "kl_rs": [
        ("criteria", "seq_mean_k1"),
        ("criteria", ()),
        ("criteria", ("token_k2", "bogus")),
        ("u", 0.0),
        ("u", -0.01),
        ("u", (0.1, 0.0)),
        ("max_log_ratio", 0.0),
    ],
    "clip_cov": [
        ("ratio", 0.0),
        ("ratio", 1.5),
        ("ratio", -2e-4),
        ("lb", math.nan),
        ("ub", 0.5),
        ("eps_high", -0.2),
    ],
    "kl_cov": [("ratio", 0.0), ("ratio", 2.0), ("kappa", -1.0)],
    "dro": [("beta", -0.1), ("beta", math.inf)],
    "dppo_tv": [("eps_low", -0.1), ("c", 0.5), ("beta", -1.0), ("max_log_ratio", 0.0)],
    "dppo_kl": [("eps_high", -0.2), ("c", 0.99), ("kl_eps", 2.0)],
    "luspo": [("eps_low", -0.2), ("eps_high", -1.0), ("max_log_ratio", 0.0)],
    "rollout_is": [("eps_low", 0.0), ("eps_low", 1.5), ("eps_high", 0.0)],
    "segment_is": [("upper_bound", 0.9), ("max_log_ratio", -1.0)],
    "gepo": [("group_size", 0), ("group_size", 1.5), ("max_log_ratio", 0.0)],
}


def test_every_mapping_with_hyperparameters_has_invalid_cases():
    assert set(WITH_HYPERPARAMETERS) == set(INVALID)


@pytest.mark.parametrize(
    "name, field, value", [(n, f, v) for n, cases in INVALID.items() for f, v in cases]
)
def test_invalid_hyperparameter_raises_value_error_naming_it(name, field, value):
    with pytest.raises(ValueError, match=field):
        get(name, **{field: value})


@pytest.mark.parametrize("name", WITH_HYPERPARAMETERS)
def test_every_numeric_hyperparameter_rejects_nan_and_strings(name):
    for field in dataclasses.fields(mapping_class(name)):
        default = getattr(get(name), field.name)
        if isinstance(default, bool) or not isinstance(default, float):
            continue
        for bad in (math.nan, "0.2", None, True):
            with pytest.raises(ValueError, match=field.name):
                get(name, **{field.name: bad})


# --- the battery over available() ---------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_on_policy_gives_reinforce(name):
    # every mapping but the listed ones (see module docstring)
    assert mapping_class(name).on_policy_identity == (name not in NOT_ON_POLICY_IDENTITY)
    _, mask, adv = random_batch(1, N=30)
    m = get(name)
    c = coefs(m, np.zeros(mask.shape), mask, adv)
    np.testing.assert_array_equal(c[~mask], 0.0)
    np.testing.assert_array_equal(m.additive(np.zeros(mask.shape), mask), 0.0)  # dro: b = 0
    lengths = mask.sum(axis=1)
    if name == "luspo":  # the loss scaled by |y|: c = |y| on-policy
        np.testing.assert_array_equal(c, lengths[:, None] * mask)
    elif name == "gepo":  # one group: π(y)/(Σ π² / Σ π) with π(y) = 0.3^|y|
        p = 0.3**lengths
        np.testing.assert_allclose(c, (p / ((p**2).sum() / p.sum()))[:, None] * mask, rtol=1e-12)
    else:
        np.testing.assert_array_equal(c[mask], 1.0)


def test_luffy_paper_preset_scales_on_policy_by_gamma_over_one_plus_gamma_squared():
    # LUFFY (arXiv 2504.14945): F = r/(r+γ) ⇒ c(1) = γ/(1+γ)²; simkit normalises it by default
    m = get("luffy", preset="paper")
    _, mask, adv = random_batch(2)
    c = m.coefficients(np.zeros(mask.shape), mask, adv)
    np.testing.assert_allclose(c[mask], 0.1 / 1.1**2, rtol=RTOL)


@pytest.mark.parametrize("name", ALL)
def test_shape_and_zero_on_padding(name):
    lr, mask, adv = random_batch(3)
    c = coefs(get(name), lr, mask, adv)
    assert c.shape == lr.shape and c.dtype == np.float64
    np.testing.assert_array_equal(c[~mask], 0.0)
    assert np.all(np.isfinite(c))


@pytest.mark.parametrize("name", ALL)
def test_padding_is_ignored(name):
    lr, mask, adv = random_batch(4, N=30)
    m = get(name)
    c = coefs(m, lr, mask, adv)
    rng = np.random.default_rng(5)
    changed = np.where(mask, lr, rng.normal(0, 50, size=lr.shape))
    np.testing.assert_allclose(coefs(m, changed, mask, adv), c, rtol=RTOL, atol=0)
    extra = rng.normal(0, 3, size=(lr.shape[0], 5))
    wide = coefs(m, np.hstack([lr, extra]), np.hstack([mask, np.zeros_like(extra, bool)]), adv)
    np.testing.assert_allclose(wide[:, : lr.shape[1]], c, rtol=RTOL, atol=0)
    np.testing.assert_array_equal(wide[:, lr.shape[1] :], 0.0)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("pattern", ["plus", "minus", "mixed"])
def test_finite_for_extreme_log_ratios(name, pattern):
    _, mask, adv = random_batch(6, N=40)
    rng = np.random.default_rng(7)
    lr = {
        "plus": np.full(mask.shape, 1000.0),
        "minus": np.full(mask.shape, -1000.0),
        "mixed": rng.choice([-1000.0, 1000.0], size=mask.shape),
    }[pattern]
    c = coefs(get(name), lr, mask, adv)
    assert c.shape == mask.shape
    assert np.all(np.isfinite(c))
    assert name in SIGNED or np.all(c >= 0)


@pytest.mark.parametrize("name", [n for n in ALL if n not in READS_ADVANTAGE_VALUE])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_coefficients_depend_on_advantages_only_through_sign(name, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    N = data.draw(st.integers(1, 30))
    T = data.draw(st.integers(1, 8))
    lr, mask, _ = random_batch(seed, N=N, T=T, scale=0.5)
    signs = np.array(data.draw(st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=N, max_size=N)))
    rng = np.random.default_rng(seed)
    magnitudes = np.exp(rng.normal(0, 3, size=N))  # positive rescaling per sequence
    m = get(name)
    c_sign = coefs(m, lr, mask, np.where(signs >= 0, 1.0, -1.0))
    c_scaled = coefs(m, lr, mask, np.where(signs == 0, 0.0, signs * magnitudes))
    np.testing.assert_array_equal(c_scaled, c_sign)


@pytest.mark.parametrize("name", sorted(READS_ADVANTAGE_VALUE))
def test_the_listed_exceptions_do_read_the_advantage_value(name):
    lr, mask, adv = random_batch(8, N=40, T=9, scale=0.6)
    hyper = {"ratio": 0.05, "lb": 0.0, "ub": 50.0} if name == "clip_cov" else {"ratio": 0.05}
    m = get(name, **hyper)
    a = m.coefficients(lr, mask, np.sign(adv))
    b = m.coefficients(lr, mask, adv * np.exp(np.arange(40) / 10.0))
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0), (1, 1)])
def test_empty_and_tiny_batches(name, shape):
    c = coefs(get(name), np.zeros(shape), np.ones(shape, bool), np.ones(shape[0]))
    assert c.shape == shape
    np.testing.assert_array_equal(c, 1.0)


@pytest.mark.parametrize("name", ALL)
def test_bad_batch_shapes_are_rejected(name):
    m = get(name)
    with pytest.raises(ValueError, match="log_ratio"):
        m.coefficients(np.zeros(5), np.ones(5, bool), np.zeros(5))
    with pytest.raises(ValueError, match="mask"):
        m.coefficients(np.zeros((2, 3)), np.ones((2, 4), bool), np.zeros(2))
    with pytest.raises(ValueError, match="advantages"):
        m.coefficients(np.zeros((2, 3)), np.ones((2, 3), bool), np.zeros(3))


# --- independent reference implementations (per element, plain Python) --------------------


def _rows(lr, mask, adv):
    for i in range(lr.shape[0]):
        valid = [float(lr[i, t]) for t in range(lr.shape[1]) if mask[i, t]]
        yield i, valid, adv[i] >= 0


def _seq_ref(fn):
    """Reference for a mapping with one value per sequence: fn(m, valid, positive)."""

    def ref(m, lr, mask, adv):
        c = np.zeros(lr.shape)
        for i, valid, positive in _rows(lr, mask, adv):
            value = fn(m, valid, positive)
            for t in range(lr.shape[1]):
                if mask[i, t]:
                    c[i, t] = value
        return c

    return ref


def _tok_ref(fn):
    """Reference for a token-level mapping: fn(m, r, positive) per valid token."""

    def ref(m, lr, mask, adv):
        c = np.zeros(lr.shape)
        for i in range(lr.shape[0]):
            for t in range(lr.shape[1]):
                if mask[i, t]:
                    c[i, t] = fn(m, math.exp(lr[i, t]), adv[i] >= 0)
        return c

    return ref


def _mean(valid):
    return sum(valid) / len(valid) if valid else 0.0


def _ppo(m, r, positive):
    if positive:
        return r if r <= 1 + m.eps_high else 0.0
    upper = getattr(m, "c_dual", math.inf)
    return r if 1 - m.eps_low <= r <= upper else 0.0


def _snis(m, lr, mask, adv):
    W = [math.exp(sum(v)) for _, v, _ in _rows(lr, mask, adv)]
    mean = sum(W) / len(W)
    return _seq_ref(lambda m, v, p: math.exp(sum(v)) / mean)(m, lr, mask, adv)


def _psis(m, lr, mask, adv):
    from arviz_stats.base import array_stats

    log_w = np.array([sum(v) for _, v, _ in _rows(lr, mask, adv)])
    smoothed, _ = array_stats.psislw(-log_w, r_eff=1)  # arviz smooths exp(−input)
    values = dict(enumerate(len(log_w) * np.exp(smoothed)))
    c = np.zeros(lr.shape)
    for i, _, _ in _rows(lr, mask, adv):
        c[i] = np.where(mask[i], values[i], 0.0)
    return c


def _gmpo(m, valid, positive):
    clipped = [min(x, m.eps_high) if positive else max(x, -m.eps_low) for x in valid]
    return math.exp(_mean(clipped))


def _gmpo_ref(m, lr, mask, adv):
    c = np.zeros(lr.shape)
    for i, valid, positive in _rows(lr, mask, adv):
        R = _gmpo(m, valid, positive)
        for t in range(lr.shape[1]):
            x = lr[i, t]
            inside = x <= m.eps_high if positive else x >= -m.eps_low
            if mask[i, t] and inside:
                c[i, t] = R
    return c


def _sapo(m, r, positive):
    tau = m.tau_pos if positive else m.tau_neg
    sigma = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
    return 4.0 * sigma * (1.0 - sigma) * r


def _luffy(m, r, positive):
    scale = (1 + m.gamma) ** 2 / m.gamma if m.normalize else 1.0
    return scale * m.gamma * r / (r + m.gamma) ** 2


def _aspo(m, r, positive):
    if positive:
        return 0.0 if r > 1 + m.eps_high else min(1.0 / r, m.c_dual)
    return r if 1 - m.eps_low <= r <= m.c_dual else 0.0


def _m2po_ref(m, lr, mask, adv):
    """Algorithm 1 of arXiv 2510.01161, literally: remove the argmax while the mean > τ."""
    cand = []
    for i in range(lr.shape[0]):
        for t in range(lr.shape[1]):
            x = lr[i, t]
            if mask[i, t] and (
                not m.trust_region_only or (adv[i] >= 0 and x > 0) or (adv[i] < 0 and x < 0)
            ):
                cand.append((i, t))
    removed = set()
    remaining = list(cand)
    while remaining and sum(lr[p] ** 2 for p in remaining) / len(remaining) > m.tau:
        j = max(range(len(remaining)), key=lambda q: (lr[remaining[q]] ** 2, -q))
        removed.add(remaining.pop(j))
    c = np.zeros(lr.shape)
    for i in range(lr.shape[0]):
        for t in range(lr.shape[1]):
            if mask[i, t] and (i, t) not in removed:
                c[i, t] = math.exp(lr[i, t])
    return c


def _vespo(m, valid, positive):
    log_w = sum(min(max(x, -m.max_log_ratio_tok), m.max_log_ratio_tok) for x in valid)
    log_w = min(max(log_w, m.min_log_ratio_seq), m.max_log_ratio_seq)
    k, lam = (m.k_pos, m.lambda_pos) if positive else (m.k_neg, m.lambda_neg)
    W = math.exp(log_w)
    return W**k * math.exp(lam * (1.0 - W))


def _kl_rs_ref(m, lr, mask, adv):
    """verl's compute_rollout_rejection_mask, per element (k2 = ½x², k3 = e^x − 1 − x)."""
    k = {"k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(x) - 1.0 - x}
    c = np.zeros(lr.shape)
    for i in range(lr.shape[0]):
        xs = [
            min(max(float(lr[i, t]), -m.max_log_ratio), m.max_log_ratio) for t in range(lr.shape[1])
        ]
        valid = [t for t in range(lr.shape[1]) if mask[i, t]]
        keep = {t: True for t in valid}
        for crit, u in m.rules:
            ks = {t: k[crit[-2:]](xs[t]) for t in valid}
            if crit.startswith("token_"):
                for t in valid:
                    keep[t] = keep[t] and ks[t] <= u
                continue
            values = list(ks.values())
            if crit.startswith("seq_sum"):
                stat = sum(values)
            elif crit.startswith("seq_mean"):
                stat = sum(values) / len(values) if values else 0.0
            else:
                stat = max(values) if values else 0.0
            for t in valid:
                keep[t] = keep[t] and stat <= u
        for t in valid:
            c[i, t] = 1.0 if keep[t] else 0.0
    return c


def _cov_ref(lr, mask, adv):
    cells = [(i, t) for i in range(lr.shape[0]) for t in range(lr.shape[1]) if mask[i, t]]
    if not cells:
        return {}, cells
    mean_a = sum(adv[i] for i, _ in cells) / len(cells)
    mean_lp = sum(lr[i, t] for i, t in cells) / len(cells)
    return {(i, t): (adv[i] - mean_a) * (lr[i, t] - mean_lp) for i, t in cells}, cells


def _clip_cov_ref(m, lr, mask, adv):
    """verl's compute_policy_loss_clip_cov (log π stood in by the log-ratio), per element; the
    random subset is ``default_rng(0).choice`` (without replacement) of the candidates in
    row-major order."""
    cov, cells = _cov_ref(lr, mask, adv)
    c = np.zeros(lr.shape)
    cand = []
    for i, t in cells:
        r = math.exp(lr[i, t])
        c[i, t] = _ppo(m, r, adv[i] >= 0)
        clipped = (adv[i] > 0 and r > 1 + m.eps_high) or (adv[i] < 0 and r < 1 - m.eps_low)
        if not clipped and m.lb < cov[i, t] < m.ub:
            cand.append((i, t))
    if cand:
        num = max(int(m.ratio * len(cells)), 1)
        for j in np.random.default_rng(0).choice(len(cand), min(num, len(cand)), replace=False):
            c[cand[j]] = 0.0
    return c


def _kl_cov_ref(m, lr, mask, adv):
    """verl's compute_policy_loss_kl_cov: gradient weight A·r − κ·sign(log r) on the top-k."""
    cov, cells = _cov_ref(lr, mask, adv)
    c = np.zeros(lr.shape)
    for i, t in cells:
        c[i, t] = math.exp(lr[i, t])
    if cells:
        k = max(1, int(len(cells) * m.ratio))
        top = sorted(range(len(cells)), key=lambda j: (-cov[cells[j]], j))[:k]
        for j in top:
            i, t = cells[j]
            if adv[i] != 0:
                c[i, t] -= m.kappa * float(np.sign(lr[i, t])) / adv[i]
    return c


def _tis_token_ref(m, lr, mask, adv):
    c = _tok_ref(lambda m, r, p: min(max(r, m.c_low), m.c_high))(m, lr, mask, adv)
    if m.batch_normalize and mask.any():
        mean = sum(c[mask]) / mask.sum()
        c = c / mean if mean > 1e-8 else c
    return c


def _tis_seq_ref(m, lr, mask, adv):
    c = _seq_ref(lambda m, v, p: min(math.exp(sum(v)), m.c))(m, lr, mask, adv)
    rows = [i for i in range(lr.shape[0]) if mask[i].any()]
    if m.batch_normalize and rows:
        mean = sum(c[i][mask[i]][0] for i in rows) / len(rows)
        c = c / mean if mean > 1e-8 else c
    return c


def _dppo_ref(m, r, positive):
    """DPPO per token (verl core_algos.py @1dda039) with μ(y_t) = 0.3, π(y_t) = 0.3·r."""
    lr = math.log(r)
    w = min(math.exp(min(max(lr, -m.max_log_ratio), m.max_log_ratio)), m.c)
    q = 0.3
    p = q * r
    if m.divergence == "tv":
        kept = (p - q <= m.eps_high) if positive else (p - q >= -m.eps_low)
    else:
        try:
            kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + m.kl_eps) / (1 - p + m.kl_eps))
        except ValueError:  # p > 1 + ε: the log of a negative number, NaN in numpy and torch
            kl = math.nan
        kept = (kl <= m.eps_high or p <= q) if positive else (kl <= m.eps_low or p >= q)
    return w if kept else 0.0


def _gepo_ref(m, lr, mask, adv):
    log_pi = [sum(v) + len(v) * math.log(0.3) for _, v, _ in _rows(lr, mask, adv)]
    log_mu = [len(v) * math.log(0.3) for _, v, _ in _rows(lr, mask, adv)]
    G = m.group_size or len(log_pi)
    c = np.zeros(lr.shape)
    for i, _, _ in _rows(lr, mask, adv):
        group = range(i - i % G, i - i % G + G)
        e = sum(math.exp(2 * log_mu[j]) for j in group) / sum(math.exp(log_mu[j]) for j in group)
        c[i] = mask[i] * min(math.exp(log_pi[i]) / e, math.exp(m.max_log_ratio))
    return c


REFERENCE = {
    "naive": _tok_ref(lambda m, r, p: 1.0),
    "is_token": _tok_ref(lambda m, r, p: r),
    "is_seq": _seq_ref(lambda m, v, p: math.exp(sum(v))),
    "power": _seq_ref(lambda m, v, p: math.exp(sum(v)) ** m.alpha),
    "snis": _snis,
    "psis": _psis,
    "soft_shrink": _seq_ref(
        lambda m, v, p: math.exp(sum(v)) / (1 - m.lam + m.lam * math.exp(sum(v)))
    ),
    "ppo_clip": _tok_ref(_ppo),
    "dual_clip": _tok_ref(_ppo),
    "dapo": _tok_ref(_ppo),
    "gspo": _seq_ref(
        lambda m, v, p: _ppo(m, math.exp(_mean(v)), p) if _mean(v) <= m.grad_log_cap else 0.0
    ),
    "gmpo": _gmpo_ref,
    "sapo": _tok_ref(_sapo),
    "luffy": _tok_ref(_luffy),
    "aspo": _tok_ref(_aspo),
    "cispo": _tok_ref(lambda m, r, p: min(max(r, 1 - m.eps_low), 1 + m.eps_high)),
    "tis_token": _tis_token_ref,
    "tis_seq": _tis_seq_ref,
    "mis_token": _tok_ref(lambda m, r, p: r if m.c_low <= r <= m.c_high else 0.0),
    "icepop": _tok_ref(lambda m, r, p: r if m.c_low <= r <= m.c_high else 0.0),
    "mis_seq": _seq_ref(
        lambda m, v, p: math.exp(sum(v)) if m.c_low <= math.exp(sum(v)) <= m.c_high else 0.0
    ),
    "geo_mask": _seq_ref(lambda m, v, p: 1.0 if m.c_low <= math.exp(_mean(v)) <= m.c_high else 0.0),
    "opsm": _seq_ref(lambda m, v, p: 0.0 if (not p and -_mean(v) > m.delta) else 1.0),
    "token_veto": _seq_ref(lambda m, v, p: 0.0 if any(math.exp(x) < m.tau for x in v) else 1.0),
    "m2po": _m2po_ref,
    "topr": _seq_ref(lambda m, v, p: 1.0 if p else min(math.exp(sum(v)), 1.0)),
    "vespo": _seq_ref(_vespo),
    "kl_rs": _kl_rs_ref,
    "clip_cov": _clip_cov_ref,
    "kl_cov": _kl_cov_ref,
    "dro": _tok_ref(lambda m, r, p: 1.0),
    "dppo_tv": _tok_ref(_dppo_ref),
    "dppo_kl": _tok_ref(_dppo_ref),
    "luspo": _seq_ref(lambda m, v, p: len(v) * _ppo(m, math.exp(_mean(v)), p)),
    "rollout_is": _tok_ref(lambda m, r, p: r if 1 - m.eps_low < r < 1 + m.eps_high else 0.0),
    "segment_is": _seq_ref(lambda m, v, p: min(math.exp(_mean(v)), m.upper_bound)),
    "gepo": _gepo_ref,
}

#: non-default settings also checked against the reference (exercise every branch)
VARIANTS = [
    ("power", {"alpha": 0.3}),
    ("soft_shrink", {"lam": 0.7}),
    ("ppo_clip", {"eps_low": 0.1}),
    ("dual_clip", {"c_dual": 1.3}),
    ("gspo", {"eps_low": 0.1, "eps_high": 0.05}),
    ("gspo", {"eps_low": 0.5, "eps_high": 0.5, "grad_log_cap": 0.05}),
    ("gmpo", {"eps_low": 0.1, "eps_high": 0.3}),
    ("luffy", {"normalize": False}),
    ("aspo", {"c_dual": 1.5, "eps_low": 0.1}),
    ("cispo", {"eps_low": 0.3}),
    ("tis_token", {"c_low": 0.7, "c_high": 1.4}),
    ("tis_seq", {"c": 1.2}),
    ("mis_token", {"c_low": 0.8, "c_high": 1.3}),
    ("mis_seq", {"c_low": 0.6, "c_high": 1.5}),
    ("geo_mask", {"c_low": 0.9, "c_high": 1.1}),
    ("opsm", {"delta": 0.05}),
    ("token_veto", {"tau": 0.5}),
    ("m2po", {"tau": 0.02}),
    ("m2po", {"tau": 0.05, "trust_region_only": False}),
    ("vespo", {"max_log_ratio_tok": 0.3, "max_log_ratio_seq": 0.8}),
    ("vespo", {"preset": "trl", "max_log_ratio_tok": 0.3, "min_log_ratio_seq": -0.5}),
    ("dapo", {"preset": "verl"}),
    ("dapo", {"c_dual": 1.2}),
    ("geo_mask", {"preset": "verl_head", "c_low": 0.8}),
    ("tis_token", {"batch_normalize": True}),
    ("tis_token", {"c_low": 0.7, "c_high": 1.4, "batch_normalize": True}),
    ("tis_seq", {"batch_normalize": True, "c": 1.2}),
    ("kl_rs", {"criteria": "token_k2", "u": 0.02}),
    ("kl_rs", {"criteria": "token_k3", "u": 0.03}),
    ("kl_rs", {"criteria": "seq_sum_k2", "u": 0.2}),
    ("kl_rs", {"criteria": "seq_sum_k3", "u": 0.3}),
    ("kl_rs", {"criteria": "seq_mean_k2", "u": 0.05}),
    ("kl_rs", {"criteria": "seq_max_k2", "u": 0.15}),
    ("kl_rs", {"criteria": "seq_max_k3", "u": 0.2}),
    ("kl_rs", {"criteria": ("token_k3", "seq_mean_k2"), "u": (0.1, 0.06)}),
    ("kl_rs", {"criteria": ("seq_max_k3", "seq_sum_k2", "token_k2"), "u": 0.12}),
    ("kl_rs", {"criteria": "token_k3", "u": 0.05, "max_log_ratio": 0.3}),
    ("clip_cov", {"ratio": 0.1, "lb": 0.0, "ub": 0.3}),
    ("clip_cov", {"ratio": 1.0, "lb": -1.0, "ub": 1.0, "eps_high": 0.1}),
    ("kl_cov", {"ratio": 0.1}),
    ("kl_cov", {"ratio": 0.3, "kappa": 0.4}),
    ("dppo_tv", {"eps_low": 0.05, "eps_high": 0.1, "c": 1.2}),
    ("dppo_tv", {"preset": "prime_rl"}),
    ("dppo_kl", {"eps_low": 0.002, "eps_high": 0.01, "c": math.inf}),
    ("luspo", {"eps_low": 0.05, "eps_high": 0.1}),
    ("rollout_is", {"eps_low": 0.1, "eps_high": 0.3}),
    ("segment_is", {"upper_bound": 1.05}),
    ("gepo", {"group_size": 7}),
]


def test_every_mapping_has_a_reference():
    assert set(REFERENCE) == set(ALL)


@pytest.mark.parametrize("name, hyper", [(n, {}) for n in ALL] + VARIANTS)
@pytest.mark.parametrize("seed", [11, 12])
def test_coefficients_match_the_reference_formula(name, hyper, seed):
    lr, mask, adv = random_batch(seed, N=40 if name == "psis" else 14, T=7, scale=0.4)
    m = get(name, **hyper)
    expected = REFERENCE[name](m, lr, mask, adv)
    np.testing.assert_allclose(coefs(m, lr, mask, adv), expected, rtol=1e-11, atol=1e-300)


DENSE = [n for n in ALL if mapping_class(n).level == "token"] + ["gmpo"]


@pytest.mark.parametrize(
    "name, hyper", [(n, {}) for n in DENSE] + [(n, h) for n, h in VARIANTS if n in DENSE]
)
def test_token_coefficients_match_the_reference_on_a_dense_grid(name, hyper):
    """Rows of log-ratios every 1e-3 on [−1.5, 1.5] (shifted per row): every band edge is hit
    within 1e-3, on both signs of A."""
    grid = np.linspace(-1.5, 1.5, 3001)
    lr = grid[None, :] + np.array([0.0, 1.7e-4, 3.3e-4, 5.1e-4])[:, None]
    mask = np.ones(lr.shape, dtype=bool)
    mask[:, ::7] = False
    adv = np.array([1.0, -1.0, -2.0, 0.0])
    m = get(name, **hyper)
    np.testing.assert_allclose(
        coefs(m, lr, mask, adv), REFERENCE[name](m, lr, mask, adv), rtol=1e-11, atol=1e-300
    )


@pytest.mark.parametrize(
    "name, bound",
    [
        ("mis_seq", "c_high"),
        ("mis_seq", "c_low"),
        ("mis_token", "c_high"),
        ("mis_token", "c_low"),
        ("icepop", "c_low"),
        ("geo_mask", "c_high"),
        ("geo_mask", "c_low"),
    ],
)
def test_mask_bands_are_inclusive(name, bound):
    """Sheet §C: r·1[a ≤ r ≤ b], W·1[C_min ≤ W ≤ C_max], 1[lo ≤ s ≤ hi]: a ratio exactly on
    a bound is kept."""
    m = get(name, **({"c_low": 0.5} if name == "mis_seq" else {}))
    value = getattr(m, bound)
    lr = np.array([[math.log(value)]])
    c = m.coefficients(lr, np.ones((1, 1), bool), np.array([1.0]))
    assert c[0, 0] > 0
    outside = math.log(value) + (1e-9 if bound == "c_high" else -1e-9)
    c = m.coefficients(np.array([[outside]]), np.ones((1, 1), bool), np.array([1.0]))
    assert c[0, 0] == 0


def test_m2po_masks_in_the_slow_path_and_matches_algorithm_1():
    lr, mask, adv = random_batch(21, N=20, T=9, scale=0.6)
    lr[3, 2] = lr[5, 1] = 2.0  # a tie among the largest squared log-ratios
    adv[3] = adv[5] = 1.0
    m = get("m2po")
    removed = m.masked_tokens(lr, mask, adv)
    assert removed.sum() > 2  # the threshold is active
    np.testing.assert_allclose(
        m.coefficients(lr, mask, adv), _m2po_ref(m, lr, mask, adv), rtol=RTOL
    )
    kept = mask & ~removed & np.where(adv[:, None] >= 0, lr > 0, lr < 0)
    assert np.mean(lr[kept] ** 2) <= m.tau


def test_m2po_breaks_ties_by_position():
    """Algorithm 1 removes one argmax at a time; among equal (log r)² the first in row-major
    order goes, so exactly one of two tied tokens is removed here."""
    lr = np.full((2, 12), 0.01)
    lr[0, 3] = lr[1, 0] = 0.5
    mask = np.ones(lr.shape, bool)
    m = get("m2po", tau=0.015)  # (0.25 + 22e-4)/23 ≈ 0.011 ≤ τ once one 0.25 is gone
    removed = m.masked_tokens(lr, mask, np.ones(2))
    assert removed.sum() == 1 and removed[0, 3]
    np.testing.assert_allclose(
        m.coefficients(lr, mask, np.ones(2)), _m2po_ref(m, lr, mask, np.ones(2)), rtol=RTOL
    )


def test_geo_mask_with_tis_base():
    lr, mask, adv = random_batch(22, N=30, scale=0.3)
    m = get("geo_mask", base="tis", tis_c=1.2, c_low=0.8, c_high=1.25)
    keep = REFERENCE["geo_mask"](m, lr, mask, adv)
    expected = keep * np.minimum(np.exp(lr), 1.2) * mask
    np.testing.assert_allclose(m.coefficients(lr, mask, adv), expected, rtol=RTOL)
    with pytest.raises(ValueError, match="base='one'"):
        m.phi(np.array([1.0]))


# --- limits --------------------------------------------------------------------------------

LIMITS = [
    ("ppo_clip", {"eps_low": math.inf, "eps_high": math.inf}, "is_token", {}),
    ("ppo_clip", {"eps_low": 1.0, "eps_high": math.inf}, "is_token", {}),
    ("tis_token", {"c_high": math.inf}, "is_token", {}),
    ("tis_seq", {"c": math.inf}, "is_seq", {}),
    ("power", {"alpha": 1.0}, "is_seq", {}),
    ("power", {"alpha": 0.0}, "naive", {}),
    ("mis_token", {"c_low": 0.0, "c_high": math.inf}, "is_token", {}),
    ("icepop", {"c_low": 0.0, "c_high": math.inf}, "is_token", {}),
    ("mis_seq", {"c_low": 0.0, "c_high": math.inf}, "is_seq", {}),
    ("dual_clip", {"c_dual": math.inf}, "ppo_clip", {}),
    ("dual_clip", {"c_dual": math.inf, "eps_high": 0.28}, "dapo", {}),
    ("soft_shrink", {"lam": 0.0}, "is_seq", {}),
    ("soft_shrink", {"lam": 1.0}, "naive", {}),
    ("cispo", {"eps_high": math.inf}, "is_token", {}),
    ("token_veto", {"tau": 0.0}, "naive", {}),
    ("luffy", {"gamma": 0.1}, "luffy", {"preset": "normalized"}),
]


@pytest.mark.parametrize("name, hyper, other, other_hyper", LIMITS)
def test_limits(name, hyper, other, other_hyper):
    lr, mask, adv = random_batch(31, N=40, scale=1.0)
    lr[2, :3] = [30.0, -30.0, 5.0]
    lr[3, :2] = [200.0, -300.0]  # beyond max_log_ratio: the clamps must agree too
    mask[2:4, :3] = True
    a = get(name, **hyper).coefficients(lr, mask, adv)
    b = get(other, **other_hyper).coefficients(lr, mask, adv)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=0)


def test_vespo_phi_is_one_on_policy_and_peaks_at_c1_over_c2():
    v = get("vespo")
    for positive, (k, lam) in ((True, (2.0, 3.0)), (False, (3.0, 2.0))):
        assert v.phi(np.array(1.0), positive) == pytest.approx(1.0, rel=RTOL)
        # VESPO Prop. C.1: sup φ = (c1/c2)^c1·e^(c2−c1) at W = c1/c2
        w = np.linspace(0.01, 5, 20001)
        phi = v.phi(w, positive)
        peak = (k / lam) ** k * math.exp(lam - k)
        assert phi.max() <= peak * (1 + 1e-12)
        assert v.phi(np.array(k / lam), positive) == pytest.approx(peak, rel=RTOL)
        assert w[np.argmax(phi)] == pytest.approx(k / lam, abs=5e-4)
    # f(0) = 0 and f saturates at e^c2·c2^−c1·Γ(c1)
    assert mappings.vespo_f(np.array(0.0), 2.0, 3.0) == 0.0
    np.testing.assert_allclose(
        mappings.vespo_f(np.array([1e4]), 2.0, 3.0),
        math.exp(3.0) * 3.0**-2 * math.gamma(2.0),
        rtol=RTOL,
    )
    with pytest.raises(ValueError, match="k"):
        mappings.vespo_phi(1.0, 0.0, 3.0)


def test_sapo_is_one_on_policy_and_never_zero():
    s = get("sapo")
    for positive in (True, False):
        assert s.phi(np.array(1.0), positive) == pytest.approx(1.0, rel=RTOL)
        assert np.all(s.phi(np.linspace(0.01, 5.0, 100), positive) > 0)


# --- scalar mappings: φ, f and coefficients ------------------------------------------------


def _grid():
    rng = np.random.default_rng(41)
    return np.exp(np.sort(rng.uniform(-3.0, 3.0, size=400)))


@pytest.mark.parametrize("name", SCALAR)
@pytest.mark.parametrize("positive", [True, False])
def test_w_times_f_prime_equals_phi(name, positive):
    """w·f'(w) = φ(w), by central differences in log w, away from discontinuities of φ."""
    m = get(name)
    w = _grid()
    h = 1e-5
    up, down = w * math.exp(h), w * math.exp(-h)
    derivative = (m.f(up, positive) - m.f(down, positive)) / (2 * h)
    phi = m.phi(w, positive)
    jump = np.abs(m.phi(w * math.exp(3 * h), positive) - m.phi(w * math.exp(-3 * h), positive))
    smooth = jump < 1e-3 * (1 + np.abs(phi))
    assert smooth.mean() > 0.9
    np.testing.assert_allclose(derivative[smooth], phi[smooth], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", SCALAR)
def test_coefficients_agree_with_phi_of_the_right_ratio(name):
    lr, mask, adv = random_batch(51, N=30, scale=0.4)
    m = get(name)
    c = m.coefficients(lr, mask, adv)
    kind = m.ratio_kind
    for i in range(lr.shape[0]):
        valid = lr[i, mask[i]]
        if kind == "token":
            ratio = np.exp(valid)
        elif kind == "sequence":
            ratio = np.full(valid.size, math.exp(valid.sum()))
        else:
            ratio = np.full(valid.size, math.exp(valid.mean()) if valid.size else 1.0)
        np.testing.assert_allclose(c[i, mask[i]], m.phi(ratio, adv[i] >= 0), rtol=1e-11)


@pytest.mark.parametrize("name", SCALAR)
def test_phi_and_f_reject_negative_ratios_and_keep_shape(name):
    m = get(name)
    with pytest.raises(ValueError, match="w"):
        m.phi(np.array([1.0, -0.5]))
    with pytest.raises(ValueError, match="w"):
        m.f(np.array([math.nan]))
    w = np.ones((2, 3))
    assert np.shape(m.phi(w, True)) == (2, 3) and np.shape(m.f(w, False)) == (2, 3)


def test_paper_surrogates():
    w = np.linspace(0.05, 3, 50)
    clip = get("ppo_clip")
    np.testing.assert_allclose(clip.f(w, True), np.minimum(w, 1.2))
    np.testing.assert_allclose(clip.f(w, False), np.maximum(w, 0.8))
    tau = 1.05
    np.testing.assert_allclose(
        get("sapo").f(w, False), 4 / tau / (1 + np.exp(-tau * (w - 1))), rtol=RTOL
    )
    np.testing.assert_allclose(get("luffy", normalize=False).f(w), w / (w + 0.1), rtol=RTOL)


# --- paper facts ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["paper", "libraries"])
def test_gspo_is_length_invariant(preset):
    """VESPO Prop. E.1: the same mean log-ratio gives the same weight whatever the length."""
    m = get("gspo", preset=preset)
    T = 400
    mask = np.zeros((4, T), dtype=bool)
    lengths = [3, 50, 400, 17]
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    lr = np.zeros((4, T))
    rng = np.random.default_rng(61)
    for i, n in enumerate(lengths):
        x = rng.normal(0, 0.3, size=n)
        lr[i, :n] = x - x.mean() + 1e-4  # mean log-ratio 1e-4 for every length
    for adv in (np.ones(4), -np.ones(4)):
        c = m.coefficients(lr, mask, adv)
        first = c[0, 0]
        np.testing.assert_allclose(c[mask], first, rtol=1e-12)
    # while sequence IS is not length invariant
    w = get("is_seq").coefficients(lr, mask, np.ones(4))
    assert not np.allclose(w[0, 0], w[2, 0], rtol=1e-3)


def test_sequence_mis_length_trap():
    """Sheet §C: per-token ratio ρ̄ ⇒ W = ρ̄^T, every sequence longer than T* = log C/log ρ̄
    is rejected (C = 5, ρ̄ = 1.001 ⇒ T* ≈ 1610)."""
    C, rho = 5.0, 1.001
    t_star = math.log(C) / math.log(rho)
    assert t_star == pytest.approx(1610.2, abs=0.1)
    lengths = np.array([1, 100, 1000, 1600, 1610, 1611, 1650, 2000])
    T = int(lengths.max())
    mask = np.arange(T)[None, :] < lengths[:, None]
    lr = np.full(mask.shape, math.log(rho))
    m = get("mis_seq", c_high=C)
    c = m.coefficients(lr, mask, np.ones(lengths.size))
    kept = c[:, 0] > 0
    np.testing.assert_array_equal(kept, lengths <= t_star)
    # Geo-Mask is length invariant: s = ρ̄ for every length
    g = get("geo_mask", preset="verl").coefficients(lr, mask, np.ones(lengths.size))
    np.testing.assert_array_equal(g[mask], 1.0)


def test_token_veto_drops_the_whole_sequence():
    lr = np.zeros((3, 4))
    lr[1, 2] = math.log(1e-5)
    lr[2, 3] = math.log(1e-5)
    mask = np.ones((3, 4), bool)
    mask[2, 3] = False  # the bad token of row 2 is padding
    c = get("token_veto").coefficients(lr, mask, np.array([1.0, 1.0, -1.0]))
    np.testing.assert_array_equal(c, [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]])


def test_opsm_only_drops_negative_drifted_sequences():
    lr = np.full((4, 3), -0.01)  # mean log(μ/π) = 0.01 > δ = 1e-4
    lr[2:] = 0.0
    c = get("opsm").coefficients(lr, np.ones((4, 3), bool), np.array([1.0, -1.0, -1.0, 1.0]))
    np.testing.assert_array_equal(c[:, 0], [1.0, 0.0, 1.0, 1.0])
    # the drift is a per-token mean (DeepSeek-V3.2): Σ log(μ/π) = 0.1 > δ but the mean 0.01 < δ
    lr = np.full((2, 10), -0.01)
    lr[1, :] = -0.06
    c = get("opsm", delta=0.05).coefficients(lr, np.ones((2, 10), bool), -np.ones(2))
    np.testing.assert_array_equal(c[:, 0], [1.0, 0.0])


# --- PSIS ----------------------------------------------------------------------------------


def test_psis_khat_agrees_with_arviz():
    from arviz_stats.base import array_stats

    rng = np.random.default_rng(71)
    log_w = rng.standard_t(3, size=2000)
    smoothed, khat = mappings.psis_smooth(log_w)
    ref_smoothed, ref_khat = array_stats.psislw(-log_w, r_eff=1)
    assert khat == pytest.approx(float(ref_khat), rel=RTOL)
    np.testing.assert_allclose(smoothed, ref_smoothed, rtol=RTOL)
    assert mappings.psis_khat(log_w) == khat
    assert np.exp(smoothed).sum() == pytest.approx(1.0, rel=1e-12)


def test_psis_leaves_weights_below_the_tail_unchanged():
    rng = np.random.default_rng(72)
    log_w = rng.normal(0, 1.5, size=900)
    smoothed, _ = mappings.psis_smooth(log_w)
    tail = math.floor(3 * math.sqrt(900))  # 90 largest weights are smoothed
    order = np.argsort(log_w)
    body, top = order[:-tail], order[-tail:]
    shift = smoothed[body] - log_w[body]
    np.testing.assert_allclose(shift, shift[0], rtol=0, atol=1e-12)  # only normalisation
    assert np.max(np.abs(smoothed[top] - log_w[top] - shift[0])) > 1e-3
    # order of the weights is preserved by the smoothing
    assert np.all(np.diff(smoothed[order]) >= -1e-12)


def test_psis_khat_recovers_the_pareto_shape():
    """Weights W = U^(−ξ) have a generalised-Pareto tail of shape ξ exactly (exceedances of a
    Pareto), so E[k̂] ≈ ξ; checked as |mean k̂ − ξ| ≤ 4.5·SE over 40 seeded replicates."""
    xi = 0.6
    rng = np.random.default_rng(73)
    khats = np.array([mappings.psis_khat(-xi * np.log(rng.uniform(size=4000))) for _ in range(40)])
    se = khats.std(ddof=1) / math.sqrt(khats.size)
    assert abs(khats.mean() - xi) <= 4.5 * se


def test_psis_degenerate_cases():
    # under 25 draws: no tail to fit, SNIS weights, k̂ = inf
    small = np.log(np.arange(1.0, 11.0))
    smoothed, khat = mappings.psis_smooth(small)
    assert khat == math.inf
    np.testing.assert_allclose(np.exp(smoothed), np.arange(1.0, 11.0) / 55.0, rtol=RTOL)
    # all weights equal: bounded, k̂ = −inf, weights 1/S
    smoothed, khat = mappings.psis_smooth(np.zeros(400))
    assert khat == -math.inf
    np.testing.assert_allclose(np.exp(smoothed), 1 / 400, rtol=RTOL)
    with pytest.raises(ValueError, match="non-finite"):
        mappings.psis_smooth(np.array([0.0, np.inf]))
    with pytest.raises(ValueError, match="shape"):
        mappings.psis_smooth(np.zeros((2, 2)))


def test_psis_mapping_is_snis_scaled_smoothing_and_reports_khat():
    lr, mask, adv = random_batch(74, N=300, T=5, scale=0.8)
    m = get("psis")
    c = m.coefficients(lr, mask, adv)
    log_w = np.where(mask, lr, 0).sum(axis=1)
    smoothed, khat = mappings.psis_smooth(log_w)
    np.testing.assert_allclose(c[:, 0][mask[:, 0]], (300 * np.exp(smoothed))[mask[:, 0]], rtol=RTOL)
    assert m.khat(lr, mask) == khat
    # small batches reduce to SNIS
    lr, mask, adv = random_batch(75, N=10)
    np.testing.assert_allclose(
        m.coefficients(lr, mask, adv), get("snis").coefficients(lr, mask, adv), rtol=RTOL
    )
