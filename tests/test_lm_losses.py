"""simkit.lm.losses: the torch policy losses against the numpy registry, numerics and errors.

Every check here is exact (float64, compared with closed forms or with ``simkit.mappings`` on
the same inputs) or a deterministic property (padding invariance, finiteness): no Monte Carlo.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit import mappings  # noqa: E402
from simkit.estimators import AGGREGATIONS, aggregation_weights  # noqa: E402
from simkit.lm import losses  # noqa: E402

RTOL = 1e-10  # float64 torch vs float64 numpy: only summation order differs

# Hyperparameters beyond the defaults and presets, chosen to reach every branch of the kernels
# (limits ε → ∞ / c → ∞, one-sided bands, tiny caps below the clip band, the TIS base, …).
EXTRA_VARIANTS = {
    "is_token": [{"max_log_ratio": 0.5}],
    "is_seq": [{"max_log_ratio": 1.0}],
    "power": [{"alpha": 0.0}, {"alpha": 1.0}, {"alpha": 0.3, "max_log_ratio": 1.0}],
    "soft_shrink": [{"lam": 0.0}, {"lam": 1.0}, {"lam": 0.5, "max_log_ratio": 1.0}],
    "ppo_clip": [
        {"eps_low": math.inf, "eps_high": math.inf},
        {"eps_low": 0.1, "eps_high": 0.3},
        # cap e^0.1 below the band 1 + ε_high = 2: the band must be decided on log r
        {"eps_high": 1.0, "max_log_ratio": 0.1},
    ],
    "dual_clip": [{"c_dual": math.inf}, {"c_dual": 1.5, "max_log_ratio": 0.2}],
    "gspo": [
        {"eps_low": math.inf, "eps_high": math.inf},
        {"max_log_ratio": 0.05},
        {"eps_low": 0.5, "eps_high": 0.5, "grad_log_cap": 0.05},
    ],
    "gmpo": [{"eps_low": 0.1, "eps_high": 0.2}, {"eps_low": math.inf, "eps_high": math.inf}],
    "sapo": [{"tau_pos": 0.5, "tau_neg": 3.0}, {"max_log_ratio": 0.5}],
    "luffy": [{"gamma": 1.0}, {"max_log_ratio": 0.5}],
    "aspo": [{"c_dual": 1.5}, {"eps_low": 1.5, "eps_high": 0.1}],
    "cispo": [{"eps_low": 0.2, "eps_high": 0.2}, {"eps_high": math.inf}],
    "mis_token": [{"c_low": 0.0, "c_high": math.inf}, {"c_low": 0.0}, {"c_high": math.inf}],
    "mis_seq": [{"c_low": 0.5, "c_high": 5.0}, {"c_low": 0.0, "c_high": math.inf}],
    "icepop": [{"c_low": 0.8, "c_high": 1.25}],
    "geo_mask": [{"base": "tis"}, {"base": "tis", "tis_c": 1.2, "c_low": 0.9, "c_high": 1.1}],
    "opsm": [{"delta": 0.0}, {"delta": 0.05}],
    "token_veto": [{"tau": 0.0}, {"tau": 0.5}],
    "m2po": [{"trust_region_only": False}, {"tau": 0.0}, {"tau": 1.0}],
    "vespo": [
        {"k_pos": 1.0, "lambda_pos": 1.0, "k_neg": 4.0, "lambda_neg": 0.5},
        {"max_log_ratio_tok": 0.5, "max_log_ratio_seq": 1.0},
        {"min_log_ratio_seq": -0.3},
    ],
    "kl_rs": [
        {"criteria": "token_k2", "u": 0.05},
        {"criteria": "token_k3", "u": 0.05},
        {"criteria": "seq_sum_k2", "u": 0.5},
        {"criteria": "seq_sum_k3", "u": 0.5},
        {"criteria": "seq_mean_k2", "u": 0.05},
        {"criteria": "seq_max_k2", "u": 0.3},
        {"criteria": "seq_max_k3", "u": 0.3},
        {"criteria": ("token_k3", "seq_mean_k2", "seq_max_k3"), "u": (0.2, 0.05, 2.0)},
        {"criteria": "token_k3", "u": 0.5, "max_log_ratio": 0.4},
    ],
    "clip_cov": [{"ratio": 0.1, "lb": 0.0, "ub": 0.5}, {"ratio": 1.0, "lb": -0.2, "ub": 2.0}],
    "kl_cov": [{"ratio": 0.1}, {"ratio": 0.5, "kappa": 0.3}, {"kappa": 0.0, "ratio": 0.2}],
    "tis_token": [
        {"c_low": 0.0, "c_high": math.inf},
        {"c_high": 2.0, "max_log_ratio": 0.3},
        {"batch_normalize": True},
        {"batch_normalize": True, "c_low": 0.5, "c_high": 1.5},
    ],
    "tis_seq": [{"c": math.inf}, {"c": 1.0}, {"batch_normalize": True, "c": 3.0}],
    "dapo": [{"eps_high": 0.5}, {"c_dual": 1.5}],
    "dro": [{"beta": 0.0}, {"beta": 2.0}],
    "dppo_tv": [
        {"c": math.inf},
        {"eps_low": 0.05, "eps_high": 0.5, "beta": 0.3},
        {"max_log_ratio": 0.5, "c": 1.2},
    ],
    "dppo_kl": [{"eps_low": 0.01, "eps_high": 0.05}, {"c": math.inf, "beta": 0.1}],
    "luspo": [{"eps_low": 0.05, "eps_high": 0.1}, {"eps_low": math.inf, "eps_high": math.inf}],
    "rollout_is": [{"eps_low": 1.0, "eps_high": math.inf}, {"eps_low": 0.5, "eps_high": 1.0}],
    "segment_is": [{"upper_bound": math.inf}, {"upper_bound": 1.0}],
    "gepo": [{"group_size": 5}, {"group_size": 1, "max_log_ratio": 0.5}],
}

# Mappings whose torch loss is allowed to differ from −c·A/Z of the registry, with the reason
# (scipy.stats style: listed by name, never silently skipped). None today.
CONSISTENCY_EXCEPTIONS: dict[str, str] = {}

# (name, preset) pairs whose on-policy coefficient is not 1, with the reason.
ON_POLICY_EXCEPTIONS = {
    ("luffy", "paper"): "the paper's F = r/(r+γ) gives c(1) = γ/(1+γ)², a constant step factor",
}
# mappings whose on-policy torch gradient is not REINFORCE, with the reason: Clip-Cov detaches
# high-covariance tokens of (A, log π) whatever the ratio (it is an entropy regulariser, not an
# importance correction), so on-policy it still zeroes the selected tokens
ON_POLICY_NOT_REINFORCE = {"clip_cov": "detaches tokens by cov(A, log π), also on-policy"}
# mappings whose on-policy coefficient is a documented weight other than 1 (checked in closed
# form below): LUSPO scales the loss by |y|; GEPO's π(y)/Ê_group[π] is not a ratio
ON_POLICY_NOT_ONE = {
    "luspo": "c = |y| on-policy (GSPO's loss scaled by the length)",
    "gepo": "c = π(y_i)/(Σ_j π(y_j)²/Σ_j π(y_j)) on-policy (a group weight, not a ratio)",
}


def registry_coefficients(mapping, lp, old, mask, adv):
    """The numpy coefficients on the inputs of the torch loss (log π too where the mapping
    reads it: clip_cov, kl_cov, dppo_tv, dppo_kl, gepo)."""
    if mapping.uses_log_prob:
        return mapping.coefficients(lp - old, mask, adv, log_prob=lp)
    return mapping.coefficients(lp - old, mask, adv)


def variants():
    out = []
    for name in mappings.available():
        out.append((name, None, {}))
        for preset in mappings.mapping_class(name).presets:
            out.append((name, preset, {}))
        for hp in EXTRA_VARIANTS.get(name, []):
            out.append((name, None, hp))
    return out


def variant_id(v):
    name, preset, hp = v
    parts = [name] + ([f"preset={preset}"] if preset else [])
    parts += [f"{k}={val}" for k, val in hp.items()]
    return ",".join(parts)


VARIANTS = variants()


def make_inputs(seed=0, N=60, T=9, scale=0.4):
    """float64 numpy inputs: log μ, log π (heavy-tailed log-ratios so that every clip, mask
    and cap is hit), a ragged mask with an empty and a full row, advantages of both signs and
    an exact 0 (N = 60 rows: PSIS fits a 12-draw tail).

    Returns ``(old, lp, mask, adv)``: (N, T), (N, T), (N, T) bool, (N,).
    """
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, (N, T)) - 0.05
    lr = rng.normal(0.0, scale, (N, T))
    lr[rng.random((N, T)) < 0.1] *= 8.0
    if N > 4:
        lr[3, 0], lr[4, 0] = -12.0, 12.0  # a vetoed token (r < 1e-4) and a huge ratio
    lengths = rng.integers(1, T + 1, N)
    lengths[0], lengths[1] = 0, T
    mask = np.arange(T)[None, :] < lengths[:, None]
    adv = rng.normal(size=N)
    adv[2] = 0.0
    return old, old + lr, mask, adv


def torch_grad(name, lp, old, mask, adv, agg="token-mean", preset=None, dtype=None, **hp):
    x = torch.tensor(lp, dtype=dtype or torch.float64, requires_grad=True)
    loss, metrics = losses.policy_loss(
        name,
        x,
        torch.tensor(old, dtype=dtype or torch.float64),
        torch.tensor(adv, dtype=dtype or torch.float64),
        torch.tensor(mask),
        agg=agg,
        preset=preset,
        **hp,
    )
    loss.backward()
    return loss, x.grad, metrics


# --- the registry consistency test ------------------------------------------------------------


def test_every_registered_mapping_has_a_torch_loss():
    missing = set(mappings.available()) - set(losses.available()) - set(CONSISTENCY_EXCEPTIONS)
    assert not missing, f"mappings without a torch loss: {sorted(missing)}"
    assert losses.available() == mappings.available()
    assert set(EXTRA_VARIANTS) <= set(mappings.available())
    assert set(losses.FORMS) == set(mappings.available())


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_gradient_equals_registry_coefficients(variant, agg):
    """∂loss/∂log_prob = −c·A/Z with c = simkit.mappings.get(...).coefficients and 1/Z =
    simkit.estimators.aggregation_weights, on the same float64 inputs."""
    name, preset, hp = variant
    if name in CONSISTENCY_EXCEPTIONS:
        pytest.xfail(CONSISTENCY_EXCEPTIONS[name])
    old, lp, mask, adv = make_inputs()
    _assert_gradient_is_the_registrys(name, lp, old, mask, adv, agg, preset=preset, **hp)


def _assert_gradient_is_the_registrys(name, lp, old, mask, adv, agg, preset=None, **hp):
    m = mappings.get(name, preset=preset, **hp)
    c = registry_coefficients(m, lp, old, mask, adv)
    # the additive per-token term b (dro, dppo with beta > 0): ∂loss/∂log π = −(c·A + b)/Z
    b = m.additive(lp - old, mask, log_prob=lp)
    expected = -(c * adv[:, None] + b) * aggregation_weights(mask, agg)
    if name == "kl_cov":
        # the one gradient term with no c·A form (documented in KLCov): κ·sign(log r)/Z on a
        # penalised token of a row with A = 0 (row 2 of make_inputs)
        sel = m.selected(lp - old, mask, adv, log_prob=lp) & (adv == 0)[:, None]
        expected += m.kappa * np.sign(lp - old) * sel * aggregation_weights(mask, agg)
    _, grad, _ = torch_grad(name, lp, old, mask, adv, agg=agg, preset=preset, **hp)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=RTOL, atol=1e-14)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", mappings.available())
def test_gradient_equals_registry_coefficients_without_padding(name, agg):
    """The same check on a mask without padding, where policy_loss skips the mask products and
    a surrogate's weights are taken per row."""
    if name in CONSISTENCY_EXCEPTIONS:
        pytest.xfail(CONSISTENCY_EXCEPTIONS[name])
    old, lp, mask, adv = make_inputs(seed=3)
    _assert_gradient_is_the_registrys(name, lp, old, np.ones_like(mask), adv, agg)


def test_autograd_building_blocks_differentiate_as_documented():
    """capped_exp, band_clamp and analytic_surrogate (public, no longer inside policy_loss):
    their values and gradients are the documented ones, exactly."""
    x0 = torch.linspace(-3.0, 3.0, 13, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    y = losses.capped_exp(x, 1.0)
    y.sum().backward()
    capped = torch.exp(x0.clamp(max=1.0))
    assert torch.equal(y.detach(), capped) and torch.equal(x.grad, capped)  # also above the cap
    x.grad = None
    F, outside = losses.band_clamp(x, torch.tensor(-1.0), torch.tensor(2.0))
    F.sum().backward()
    inside = (x0 >= -1.0) & (x0 <= 2.0)
    assert torch.equal(F.detach(), x0.clamp(-1.0, 2.0)) and torch.equal(outside, ~inside)
    assert torch.equal(x.grad, inside.to(x0.dtype))
    x.grad = None
    F = losses.analytic_surrogate(x, lambda v: (torch.sin(v), torch.cos(v)))
    F.sum().backward()
    assert torch.equal(F.detach(), torch.sin(x0)) and torch.equal(x.grad, torch.cos(x0))


@pytest.mark.parametrize("name", [n for n in mappings.available() if n != "naive"])
def test_consistency_inputs_exercise_each_default_mapping(name):
    """The consistency test is not vacuous: on its inputs every default mapping's coefficient
    differs from plain REINFORCE (c = 1) somewhere and takes several values."""
    old, lp, mask, adv = make_inputs()
    m = mappings.get(name)
    c = registry_coefficients(m, lp, old, mask, adv)[mask]
    if m.has_additive:  # dro: c = 1, the gradient weight A − β·log r differs from A
        c = m.additive(lp - old, mask)[mask]
        assert not np.allclose(c, 0.0)
    else:
        assert not np.allclose(c, 1.0)
    assert np.unique(np.round(c, 12)).size > 1


def test_surrogate_values_equal_the_registry_surrogates():
    """Token-level surrogate losses: loss = −Σ (A/Z)·F(r_t) with F = the mapping's ``f``
    (same convention as the papers for these; other mappings' ``f`` differ by a constant)."""
    old, lp, mask, adv = make_inputs(seed=1, scale=0.2)
    w = aggregation_weights(mask, "token-mean")
    r = np.exp(lp - old)
    positive = adv >= 0
    for name in ("is_token", "ppo_clip", "dual_clip", "dapo", "sapo", "luffy"):
        m = mappings.get(name)
        F = np.where(positive[:, None], m.f(r, positive=True), m.f(r, positive=False))
        expected = -(F * adv[:, None] * w).sum()
        loss, _, _ = torch_grad(name, lp, old, mask, adv)
        assert loss.item() == pytest.approx(expected, rel=1e-12), name


@pytest.mark.parametrize(
    "name", [n for n in mappings.available() if losses.loss_form(n) == "detached"]
)
def test_detached_values_are_weighted_log_likelihoods(name):
    """Detached losses: loss = −Σ (A/Z)·c·log π over valid tokens."""
    old, lp, mask, adv = make_inputs(seed=2)
    c = registry_coefficients(mappings.get(name), lp, old, mask, adv)
    expected = -(c * adv[:, None] * aggregation_weights(mask, "token-mean") * lp).sum()
    loss, _, _ = torch_grad(name, lp, old, mask, adv)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


# --- special cases --------------------------------------------------------------------------


def reinforce_gradient(mask, adv, agg="token-mean"):
    """Plain REINFORCE: ∂loss/∂log π = −A/Z on valid tokens (closed form)."""
    return -adv[:, None] * aggregation_weights(mask, agg)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_on_policy_is_reinforce(variant):
    """log_prob == old_log_prob ⇒ the gradient of plain REINFORCE for every mapping whose
    coefficient is 1 on-policy (docs/reference.md: an on-policy identity is a test)."""
    name, preset, hp = variant
    old, _, mask, adv = make_inputs(seed=3)
    _, grad, metrics = torch_grad(name, old, old, mask, adv, preset=preset, **hp)
    expected = reinforce_gradient(mask, adv)
    if name in ON_POLICY_NOT_REINFORCE:
        m = mappings.get(name, preset=preset, **hp)
        detached = m.selected(np.zeros_like(old), mask, adv, log_prob=old)
        assert detached.any()  # the exception is real on these inputs
        np.testing.assert_allclose(grad.numpy(), np.where(detached, 0.0, expected), rtol=1e-12)
        return
    if (name, preset) in ON_POLICY_EXCEPTIONS:
        gamma = mappings.get(name, preset=preset, **hp).gamma
        expected = expected * gamma / (1.0 + gamma) ** 2
    if name in ON_POLICY_NOT_ONE:
        m = mappings.get(name, preset=preset, **hp)
        lengths = mask.sum(axis=1).astype(float)
        if name == "luspo":
            c = np.repeat(lengths[:, None], mask.shape[1], axis=1)
        else:  # gepo: groups of group_size rows (None: the batch), weights π(y)/Ê[π]
            log_pi = np.where(mask, old, 0.0).sum(axis=1)
            G = m.group_size or len(log_pi)
            p = np.exp(log_pi).reshape(-1, G)
            w = (p / ((p**2).sum(axis=1) / p.sum(axis=1))[:, None]).reshape(-1)
            c = np.repeat(np.minimum(w, math.exp(m.max_log_ratio))[:, None], mask.shape[1], 1)
        np.testing.assert_allclose(
            registry_coefficients(m, old, old, mask, adv), c * mask, rtol=1e-12
        )
        expected = expected * c
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-12, atol=1e-15)
    assert metrics["clip_frac"] == 0.0
    assert metrics["chi2_tok"] == 0.0 and metrics["kl_k3"] == 0.0
    assert metrics["ess"] == pytest.approx(1.0, abs=1e-12)


NO_CLIP_LIMITS = [
    # (mapping with its clip removed, the unclipped estimator it must equal)
    (("ppo_clip", {"eps_low": math.inf, "eps_high": math.inf}), ("is_token", {})),
    (("dapo", {"eps_low": math.inf, "eps_high": math.inf}), ("is_token", {})),
    (
        ("dual_clip", {"eps_low": math.inf, "eps_high": math.inf, "c_dual": math.inf}),
        ("is_token", {}),
    ),
    (("cispo", {"eps_low": math.inf, "eps_high": math.inf}), ("is_token", {})),
    (("tis_token", {"c_low": 0.0, "c_high": math.inf}), ("is_token", {})),
    (("mis_token", {"c_low": 0.0, "c_high": math.inf}), ("is_token", {})),
    (("icepop", {"c_low": 0.0, "c_high": math.inf}), ("is_token", {})),
    (("tis_seq", {"c": math.inf}), ("is_seq", {})),
    (("mis_seq", {"c_low": 0.0, "c_high": math.inf}), ("is_seq", {})),
    (("power", {"alpha": 1.0}), ("is_seq", {})),
    (("soft_shrink", {"lam": 0.0}), ("is_seq", {})),
    (("geo_mask", {"c_low": 1e-300, "c_high": math.inf}), ("naive", {})),
    (("token_veto", {"tau": 0.0}), ("naive", {})),
]


@pytest.mark.parametrize(("clipped", "unclipped"), NO_CLIP_LIMITS, ids=lambda p: p[0])
def test_removing_the_clip_gives_the_unclipped_estimator(clipped, unclipped):
    """ε → ∞ (and c → ∞) ⇒ no clipping: same gradient as the plain IS estimator, clip_frac 0."""
    old, lp, mask, adv = make_inputs(seed=4)
    _, grad, metrics = torch_grad(clipped[0], lp, old, mask, adv, **clipped[1])
    _, ref, _ = torch_grad(unclipped[0], lp, old, mask, adv, **unclipped[1])
    np.testing.assert_allclose(grad.numpy(), ref.numpy(), rtol=1e-12, atol=1e-15)
    assert metrics["clip_frac"] == 0.0


def test_geometric_mappings_without_clip_use_the_geometric_mean():
    """GSPO and GMPO with ε = ∞: every token of row i gets s_i = exp(mean_t log r_t)."""
    old, lp, mask, adv = make_inputs(seed=5)
    lr = np.where(mask, lp - old, 0.0)
    n = mask.sum(axis=1)
    s = np.exp(np.divide(lr.sum(axis=1), n, out=np.zeros(len(n)), where=n > 0))
    expected = -s[:, None] * adv[:, None] * aggregation_weights(mask, "token-mean")
    for name in ("gspo", "gmpo"):
        _, grad, metrics = torch_grad(name, lp, old, mask, adv, eps_low=math.inf, eps_high=math.inf)
        np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-12, atol=1e-15)
        assert metrics["clip_frac"] == 0.0


def test_hand_computed_ppo_gradient():
    """A 1×4 batch worked by hand: r = (0.5, 1.1, 1.5, 1.0), A = +1, ε = 0.2, token-mean:
    c = (0.5, 1.1, 0, 1.0) (only r > 1.2 is clipped for A > 0); A = −1: c = (0, 1.1, 1.5, 1.0)."""
    r = torch.tensor([[0.5, 1.1, 1.5, 1.0]], dtype=torch.float64)
    old = torch.full_like(r, -1.0)
    mask = torch.ones_like(r, dtype=torch.bool)
    for adv, c in ((1.0, [0.5, 1.1, 0.0, 1.0]), (-1.0, [0.0, 1.1, 1.5, 1.0])):
        lp = (old + r.log()).requires_grad_(True)
        loss, metrics = losses.policy_loss("ppo_clip", lp, old, torch.tensor([adv]), mask)
        loss.backward()
        np.testing.assert_allclose(lp.grad.numpy()[0], -adv * np.array(c) / 4, rtol=1e-14)
        assert metrics["clip_frac"] == 0.25


# --- numerics: extreme log-ratios, dtypes, padding ----------------------------------------


def extreme_inputs(dtype):
    """log-ratios ±50 (and 0) on valid tokens, ragged mask, both advantage signs."""
    gen = torch.Generator().manual_seed(0)
    N, T = 8, 6
    old = -torch.rand(N, T, generator=gen) * 3 - 60.0
    sign = torch.tensor([50.0, -50.0, 0.0])[torch.randint(0, 3, (N, T), generator=gen)]
    lp = old + sign
    mask = torch.arange(T)[None, :] < torch.tensor([6, 6, 5, 3, 1, 6, 4, 2])[:, None]
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.0, -1.0, 0.0, 3.0])
    return lp.to(dtype), old.to(dtype), adv, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", mappings.available())
def test_extreme_log_ratios_stay_finite(name, dtype):
    lp, old, adv, mask = extreme_inputs(dtype)
    for agg in AGGREGATIONS:
        x = lp.clone().requires_grad_(True)
        loss, metrics = losses.policy_loss(name, x, old, adv, mask, agg=agg)
        loss.backward()
        assert loss.dtype == torch.float32
        assert torch.isfinite(loss), (name, agg)
        assert x.grad.dtype == dtype
        assert torch.isfinite(x.grad).all(), (name, agg)
        assert (x.grad[~mask] == 0).all()
        assert not any(math.isnan(v) for v in metrics.values()), metrics
        # these are bounded or linear in log r: finite; χ² and k3 may be +inf (e^(50·T) is
        # beyond float64), never NaN
        for key in ("clip_frac", "ess", "kl_k1", "kl_k1_seq", "log_ratio_mean"):
            assert math.isfinite(metrics[key]), (name, key, metrics[key])
        assert metrics["log_ratio_abs_max"] == pytest.approx(50.0, abs=0.5)  # bf16 rounding
        assert math.isfinite(metrics["chi2_tok"])  # e^100 / n fits in float64


@pytest.mark.parametrize("name", mappings.available())
def test_bf16_inputs_match_float32_on_the_rounded_values(name):
    """bf16 inputs are upcast: the loss equals the float32 loss of the same (rounded) values."""
    old, lp, mask, adv = make_inputs(seed=6, scale=0.1)
    lp16 = torch.tensor(lp, dtype=torch.bfloat16)
    old16 = torch.tensor(old, dtype=torch.bfloat16)
    adv_t, mask_t = torch.tensor(adv, dtype=torch.float32), torch.tensor(mask)
    loss16, _ = losses.policy_loss(name, lp16, old16, adv_t, mask_t)
    loss32, _ = losses.policy_loss(name, lp16.float(), old16.float(), adv_t, mask_t)
    assert loss16.item() == loss32.item()


@pytest.mark.parametrize("name", mappings.available())
def test_padded_positions_contribute_nothing(name):
    """Changing log π, log μ and (N, T) advantages on padded positions — to other numbers, to
    ±inf or NaN — changes neither the loss, nor the gradient, nor the metrics; the gradient is
    exactly 0 there."""
    old, lp, mask, adv = make_inputs(seed=7)
    adv_tok = np.repeat(adv[:, None], mask.shape[1], axis=1)
    reference = None
    rng = np.random.default_rng(0)
    garbage_sets = [
        (rng.normal(0, 30, lp.shape), rng.normal(0, 30, lp.shape), rng.normal(0, 9, lp.shape)),
        (np.full(lp.shape, np.inf), np.full(lp.shape, -np.inf), np.full(lp.shape, np.nan)),
        (np.full(lp.shape, np.nan), np.full(lp.shape, np.nan), np.full(lp.shape, -np.inf)),
    ]
    for pad_lp, pad_old, pad_adv in [(lp, old, adv_tok), *garbage_sets]:
        x = torch.tensor(np.where(mask, lp, pad_lp), requires_grad=True)
        loss, metrics = losses.policy_loss(
            name,
            x,
            torch.tensor(np.where(mask, old, pad_old)),
            torch.tensor(np.where(mask, adv_tok, pad_adv)),
            torch.tensor(mask),
        )
        loss.backward()
        result = (loss.item(), x.grad.numpy().copy(), metrics)
        assert (result[1][~mask] == 0).all()
        if reference is None:
            reference = result
            continue
        assert result[0] == reference[0]
        np.testing.assert_array_equal(result[1], reference[1])
        assert result[2] == pytest.approx(reference[2], rel=1e-12, nan_ok=True)


def test_token_advantages_equal_sequence_advantages():
    old, lp, mask, adv = make_inputs(seed=8)
    adv_tok = np.repeat(adv[:, None], mask.shape[1], axis=1)
    for name in ("ppo_clip", "vespo", "gspo"):
        loss_seq, grad_seq, _ = torch_grad(name, lp, old, mask, adv)
        x = torch.tensor(lp, requires_grad=True)
        loss, _ = losses.policy_loss(
            name, x, torch.tensor(old), torch.tensor(adv_tok), torch.tensor(mask)
        )
        loss.backward()
        assert loss.item() == loss_seq.item()
        np.testing.assert_array_equal(x.grad.numpy(), grad_seq.numpy())


def test_mask_may_be_given_as_numbers_and_mapping_as_object():
    old, lp, mask, adv = make_inputs(seed=9)
    loss_ref, grad_ref, m_ref = torch_grad("dual_clip", lp, old, mask, adv, c_dual=2.0)
    x = torch.tensor(lp, requires_grad=True)
    loss, metrics = losses.policy_loss(
        mappings.get("dual_clip", c_dual=2.0),
        x,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask.astype(np.int64)),
    )
    loss.backward()
    assert loss.item() == loss_ref.item() and metrics == m_ref
    np.testing.assert_array_equal(x.grad.numpy(), grad_ref.numpy())
    no_metrics = losses.policy_loss(
        "dual_clip",
        x,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        compute_metrics=False,
        c_dual=2.0,
    )
    assert no_metrics[1] == {} and no_metrics[0].item() == loss_ref.item()


# --- metrics against numpy formulas ----------------------------------------------------------


def numpy_metrics(lp, old, mask):
    """The module docstring's formulas, in float64 numpy (valid tokens only)."""
    lr = (lp - old)[mask]
    r = np.exp(lr)
    log_w = np.where(mask, lp - old, 0.0).sum(axis=1)
    W = np.exp(log_w)
    N = mask.shape[0]
    return {
        "chi2_tok": np.mean(r**2) - 1.0,
        "chi2_seq": np.mean(W**2) - 1.0,
        "ess": W.sum() ** 2 / (N * (W**2).sum()),
        "kl_k1": np.mean(-lr),
        "kl_k3": np.mean(r - 1.0 - lr),
        "kl_k1_seq": np.mean(-log_w),
        "kl_k3_seq": np.mean(W - 1.0 - log_w),
        "log_ratio_mean": np.mean(lr),
        "log_ratio_abs_max": np.abs(lr).max(),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_metrics_match_numpy_formulas(dtype):
    old, lp, mask, adv = make_inputs(seed=10, scale=0.15)
    expected = numpy_metrics(lp, old, mask)
    _, _, metrics = torch_grad("naive", lp, old, mask, adv, dtype=dtype)
    rel = 1e-10 if dtype == torch.float64 else 1e-4
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=rel, abs=1e-12), key
    assert metrics["clip_frac"] == 0.0


def test_float32_metrics_stay_accurate_near_on_policy():
    """A log-ratio spread of 1e-4 (k3 ≈ 5e-9 per token): the float32 χ² and k3 are within 1e-4
    relative of float64 sums over the same float32 log-ratios (the module docstring states
    ~1e-5 at 0.5M tokens; r − 1 formed by subtraction would be off by tens of percent)."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.empty(64, 512, dtype=torch.float64).exponential_(1.0, generator=gen)
    lp = old + 1e-4 * torch.randn(64, 512, generator=gen, dtype=torch.float64)
    mask = torch.ones(64, 512, dtype=torch.bool)
    _, metrics = losses.policy_loss("naive", lp.float(), old.float(), torch.ones(64), mask)
    lr = (lp.float() - old.float()).double()
    e = torch.expm1(lr)
    assert metrics["kl_k3"] == pytest.approx(float((e - lr).mean()), rel=1e-4)
    assert metrics["chi2_tok"] == pytest.approx(float((e * e + 2 * e).mean()), rel=1e-4)


def test_metrics_of_large_log_ratios_use_the_log_space_path():
    """With log r = 45 on some tokens (e^90 overflows float32) χ² is still e^90-sized and
    finite, computed in float64 log space; the k3 estimate keeps its float64 value."""
    old, lp, mask, adv = make_inputs(seed=11, scale=0.1)
    lp = lp.copy()
    lp[5, 0] = old[5, 0] + 45.0
    expected = numpy_metrics(lp, old, mask)
    _, _, m32 = torch_grad("naive", lp, old, mask, adv, dtype=torch.float32)
    for key in ("chi2_tok", "kl_k3", "kl_k3_seq", "kl_k1"):
        assert m32[key] == pytest.approx(expected[key], rel=1e-4), key


def test_clip_fraction_matches_the_registry_coefficients():
    """clip_frac per the module table, from the numpy coefficients: PPO-style and masks count
    the zeroed tokens, truncations the tokens whose weight differs from r (or W)."""
    old, lp, mask, adv = make_inputs(seed=12, scale=0.3)
    lr = lp - old
    n_valid = mask.sum()
    r = np.exp(lr)
    W = np.exp(np.where(mask, lr, 0.0).sum(axis=1))[:, None] * np.ones_like(lr)
    zeroed = (
        "ppo_clip",
        "dual_clip",
        "dapo",
        "mis_token",
        "icepop",
        "mis_seq",
        "geo_mask",
        "opsm",
        "token_veto",
        "m2po",
        "kl_rs",
    )
    for name in zeroed:
        c = mappings.get(name).coefficients(lr, mask, adv)
        _, _, metrics = torch_grad(name, lp, old, mask, adv)
        assert metrics["clip_frac"] == pytest.approx(((c == 0) & mask).sum() / n_valid), name
    for name, ratio in (("cispo", r), ("tis_token", r), ("tis_seq", W)):
        c = mappings.get(name).coefficients(lr, mask, adv)
        _, _, metrics = torch_grad(name, lp, old, mask, adv)
        clipped = ~np.isclose(c, ratio, rtol=1e-12) & mask
        assert metrics["clip_frac"] == pytest.approx(clipped.sum() / n_valid), name
        assert 0 < metrics["clip_frac"] < 1


def test_psis_reports_the_registry_khat():
    old, lp, mask, adv = make_inputs(seed=13, N=300, scale=0.5)
    log_w = np.where(mask, lp - old, 0.0).sum(axis=1)
    _, _, metrics = torch_grad("psis", lp, old, mask, adv)
    assert metrics["khat"] == pytest.approx(mappings.psis_khat(log_w), rel=1e-9)


def test_psis_matches_registry_on_a_large_heavy_tailed_batch():
    """PSIS with a ⌊3√N⌋ tail (N = 300 > 225) and heavy tails, against arviz-stats' smoothing."""
    old, lp, mask, adv = make_inputs(seed=14, N=300, scale=0.5)
    c = mappings.get("psis").coefficients(lp - old, mask, adv)
    _, grad, _ = torch_grad("psis", lp, old, mask, adv)
    expected = -c * adv[:, None] * aggregation_weights(mask, "token-mean")
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-9, atol=1e-15)


def test_aggregation_scale_matches_numpy():
    _, _, mask, _ = make_inputs(seed=15)
    for agg in AGGREGATIONS:
        inv_z = losses.aggregation_scale(torch.tensor(mask), agg).numpy()
        np.testing.assert_allclose(
            np.where(mask, inv_z[:, None], 0.0), aggregation_weights(mask, agg), rtol=1e-15
        )
    inv_z = losses.aggregation_scale(torch.tensor(mask), "seq-mean-token-sum-norm", max_length=20)
    assert np.allclose(inv_z.numpy(), 1 / (mask.shape[0] * 20))


# --- errors -----------------------------------------------------------------------------------


def good_inputs():
    old, lp, mask, adv = make_inputs(seed=16, N=4, T=3)
    return torch.tensor(lp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            lambda a: {**a, "log_prob": a["log_prob"][0]},
            ValueError,
            r"log_prob must have shape \(N, T\)",
        ),
        (lambda a: {**a, "log_prob": a["log_prob"].long()}, ValueError, "floating-point"),
        (lambda a: {**a, "log_prob": a["log_prob"].tolist()}, TypeError, "torch.Tensor"),
        (lambda a: {**a, "old_log_prob": a["old_log_prob"][:, :2]}, ValueError, "old_log_prob has"),
        (lambda a: {**a, "response_mask": a["response_mask"][:3]}, ValueError, "response_mask has"),
        (lambda a: {**a, "response_mask": a["response_mask"] * 2.0}, ValueError, "boolean"),
        (
            lambda a: {**a, "advantages": a["advantages"][:3]},
            ValueError,
            r"advantages must have shape",
        ),
        (lambda a: {**a, "advantages": torch.full((4,), math.nan)}, ValueError, "non-finite"),
        (
            lambda a: {**a, "advantages": torch.arange(12.0).reshape(4, 3)},
            ValueError,
            "constant over each row",
        ),
        (lambda a: {**a, "agg": "sum"}, ValueError, "valid aggregations: token-mean"),
        (lambda a: {**a, "max_length": 10}, ValueError, "seq-mean-token-sum-norm"),
        (
            lambda a: {**a, "agg": "seq-mean-token-sum-norm", "max_length": 2},
            ValueError,
            "shorter than",
        ),
        (
            lambda a: {**a, "agg": "seq-mean-token-sum-norm", "max_length": 0},
            ValueError,
            "positive integer",
        ),
        (lambda a: {**a, "name": "ppo"}, KeyError, "available mappings: naive"),
        (lambda a: {**a, "name": 3}, TypeError, "mapping name"),
        (lambda a: {**a, "eps_low": -0.1}, ValueError, "eps_low must be in"),
        (lambda a: {**a, "epsilon": 0.2}, TypeError, "no hyperparameter"),
        (lambda a: {**a, "preset": "nope"}, ValueError, "no preset"),
        (lambda a: {**a, "name": mappings.get("ppo_clip"), "eps_low": 0.1}, TypeError, "not both"),
    ],
)
def test_bad_input_raises_a_clear_error(change, error, match):
    lp, old, adv, mask = good_inputs()
    args = {
        "name": "ppo_clip",
        "log_prob": lp,
        "old_log_prob": old,
        "advantages": adv,
        "response_mask": mask,
    }
    args = change(args)
    name = args.pop("name")
    log_prob = args.pop("log_prob")
    with pytest.raises(error, match=match):
        losses.policy_loss(
            name,
            log_prob,
            args.pop("old_log_prob"),
            args.pop("advantages"),
            args.pop("response_mask"),
            **args,
        )


def test_nan_on_a_valid_token_is_an_error():
    lp, old, adv, mask = good_inputs()
    lp[1, 0] = math.nan
    with pytest.raises(ValueError, match="NaN on a valid token"):
        losses.policy_loss("naive", lp, old, adv, mask, compute_metrics=False)


def test_loss_form_names_every_mapping_and_rejects_unknown_ones():
    assert losses.loss_form("ppo_clip") == "surrogate"
    assert losses.loss_form("vespo") == "detached"
    with pytest.raises(KeyError, match="available losses"):
        losses.loss_form("nope")


@pytest.mark.parametrize("name", mappings.available())
def test_loss_value_is_the_same_without_autograd(name):
    """Under ``torch.no_grad`` (evaluation) every loss takes the same value and metrics."""
    old, lp, mask, adv = make_inputs(seed=17)
    args = (torch.tensor(lp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    with torch.no_grad():
        loss0, m0 = losses.policy_loss(name, *args)
    loss1, m1 = losses.policy_loss(name, args[0].clone().requires_grad_(True), *args[1:])
    assert loss0.item() == loss1.item() and not loss0.requires_grad
    assert m0 == pytest.approx(m1, nan_ok=True)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize(
    "name, hp",
    [("kl_rs", {"criteria": "token_k3", "u": 0.05}), ("mis_token", {}), ("geo_mask", {})],
)
def test_kept_denominator_divides_by_the_surviving_tokens(name, hp, agg):
    """``denominator="kept"`` (verl's legacy path): Z from the tokens the rejection keeps, the
    numpy ``kept_mask`` fed to ``aggregation_weights``; ``"valid"`` is the default."""
    old, lp, mask, adv = make_inputs(seed=21)
    m = mappings.get(name, **hp)
    c = m.coefficients(lp - old, mask, adv)
    kept = m.kept_mask(lp - old, mask, adv)
    assert 0 < kept.sum() < mask.sum()
    x = torch.tensor(lp, requires_grad=True)
    args = (torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    loss, _ = losses.policy_loss(name, x, *args, agg=agg, denominator="kept", **hp)
    loss.backward()
    expected = -c * adv[:, None] * aggregation_weights(kept, agg)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=RTOL, atol=1e-14)


def test_unknown_denominator_lists_the_valid_ones():
    old, lp, mask, adv = make_inputs(seed=22)
    args = (torch.tensor(lp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    with pytest.raises(ValueError, match="valid denominators: valid, kept"):
        losses.policy_loss("kl_rs", *args, denominator="surviving")


def test_clip_cov_takes_its_subset_from_the_numpy_generator():
    old, lp, mask, adv = make_inputs(seed=23)
    args = (torch.tensor(old), torch.tensor(adv * 4), torch.tensor(mask))
    m = mappings.get("clip_cov", ratio=0.05, lb=0.0, ub=50.0)
    grads = []
    for seed in (1, 1, 2):
        x = torch.tensor(lp, requires_grad=True)
        loss, _ = losses.policy_loss(m, x, *args, rng=np.random.default_rng(seed))
        loss.backward()
        grads.append(x.grad.numpy())
        c = m.coefficients(lp - old, mask, adv * 4, log_prob=lp, rng=np.random.default_rng(seed))
        expected = -c * (adv * 4)[:, None] * aggregation_weights(mask, "token-mean")
        np.testing.assert_allclose(grads[-1], expected, rtol=RTOL, atol=1e-14)
    np.testing.assert_array_equal(grads[0], grads[1])
    assert not np.array_equal(grads[0], grads[2])


def test_kl_cov_breaks_covariance_ties_by_position_like_numpy():
    """Discrete log-probabilities (many equal covariances): the torch top-k and the numpy
    top-k pick the same tokens (ties at the k-th value: first in row-major order)."""
    rng = np.random.default_rng(24)
    old = -rng.integers(1, 3, (40, 6)).astype(float)
    lp = old + rng.choice([-0.5, 0.0, 0.5], (40, 6))
    mask = np.ones(lp.shape, bool)
    adv = rng.choice([-1.0, 1.0], 40)
    m = mappings.get("kl_cov", ratio=0.1)
    sel = m.selected(lp - old, mask, adv, log_prob=lp)
    cov = mappings.covariance.token_covariance(adv, lp, mask)
    kth = np.sort(cov.ravel())[::-1][sel.sum() - 1]
    assert (cov == kth).sum() > 1  # the test has ties at the boundary
    expected = -registry_coefficients(m, lp, old, mask, adv) * adv[:, None] / mask.sum()
    _, grad, _ = torch_grad(m, lp, old, mask, adv)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=RTOL, atol=1e-14)


COMPOSED = [
    ("ppo_clip", "tis_token", "decoupled", {}),
    ("dapo", "mis_token", "decoupled", {}),
    ("gspo", "kl_rs", "decoupled", {"denominator": "kept"}),
    ("kl_cov", "tis_seq", "decoupled", {}),
    ("naive", "is_seq", "bypass", {}),
    ("ppo_clip", "geo_mask", "bypass", {"denominator": "kept"}),
    ("ppo_clip", "tis_token", "bypass", {"allow_same_ratio": True}),
    ("vespo", "tis_token", "trl_vespo", {}),
    ("vespo", "icepop", "trl_vespo", {}),
]


@pytest.mark.parametrize("padding", [True, False], ids=["padding", "full"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mapping, correction, mode, extra", COMPOSED, ids=str)
def test_composed_loss_gradient_equals_the_composed_estimator(
    mapping, correction, mode, extra, agg, padding
):
    """policy_loss(..., correction=, mode=, rollout_log_prob=): ∂loss/∂log π = −c·A/Z with c and
    1/Z of ``Estimator(mapping, correction=…, mode=…)`` (simkit.composition); with padding
    and without (where policy_loss multiplies by no mask)."""
    from simkit.estimators import Estimator

    rng = np.random.default_rng(31)
    old, lp, mask, adv = make_inputs(seed=30)
    if not padding:
        mask = np.ones_like(mask)
    adv[adv == 0] = 0.5  # kl_cov's penalty has no c·A form at A = 0 (tested elsewhere)
    rollout = old - rng.normal(0.0, 0.3, old.shape)  # log μ; old is log π_old
    if mode == "bypass":
        rollout = old  # π_old := μ
    est = Estimator(mapping, correction=correction, mode=mode, aggregation=agg, **extra)
    ell, o = lp - rollout, old - rollout  # log π − log μ, log π_old − log μ
    c = est.coefficients(ell, mask, adv, o, log_prob=lp)
    expected = -c * adv[:, None] * est.kept_weights(ell, mask, adv, o)
    x = torch.tensor(lp, requires_grad=True)
    loss, _ = losses.policy_loss(
        mapping,
        x,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        agg=agg,
        correction=correction,
        mode=mode,
        rollout_log_prob=None if mode == "bypass" else torch.tensor(rollout),
        **extra,
    )
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=RTOL, atol=1e-14)


def test_composed_loss_bad_input():
    old, lp, mask, adv = make_inputs(seed=32)
    args = (torch.tensor(lp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    with pytest.raises(ValueError, match="needs rollout_log_prob"):
        losses.policy_loss("ppo_clip", *args, correction="tis_token")
    with pytest.raises(ValueError, match="no rollout_log_prob"):
        losses.policy_loss(
            "ppo_clip", *args, correction="geo_mask", mode="bypass", rollout_log_prob=args[1]
        )
    with pytest.raises(ValueError, match="both act on the one ratio"):
        losses.policy_loss("ppo_clip", *args, correction="tis_token", mode="bypass")
    with pytest.raises(ValueError, match="pass correction"):
        losses.policy_loss("ppo_clip", *args, rollout_log_prob=args[1])
    with pytest.raises(ValueError, match="valid modes"):
        losses.policy_loss("ppo_clip", *args, correction="tis_token", mode="nope")


@pytest.mark.parametrize("trust_region_only", [True, False])
def test_m2po_float32_decision_matches_the_float64_mean_at_the_threshold(trust_region_only):
    """m2po_removed decides "remove nothing" from a float32 sum when the mean is clearly below
    τ (issue 28); at τ within 10⁻⁹ of the float64 mean of the float32 squares it must still
    follow that float64 mean exactly, on both sides (and with the |log r| bound given)."""
    gen = torch.Generator().manual_seed(28)
    lr = 0.05 * torch.randn(64, 512, generator=gen)
    mask = torch.ones_like(lr, dtype=torch.bool)
    positive = torch.rand(64, generator=gen) < 0.5
    side = torch.where(positive, 1.0, -1.0)[:, None]
    cand = (lr * side > 0) if trust_region_only else mask
    sq = (lr * lr).double()[cand]
    mean = float(sq.sum()) / int(cand.sum())
    bound = float(lr.abs().max())
    for b in (None, bound):
        for tau, removes in ((mean * (1 + 1e-9), False), (mean * (1 - 1e-9), True)):
            removed = losses.m2po_removed(lr, mask, positive, tau, trust_region_only, b)
            assert (removed is not None) == removes, (tau, b)
        # far below the bound's square and far above the mean: nothing removed either way
        assert losses.m2po_removed(lr, mask, positive, 2 * mean, trust_region_only, b) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_bound_decides_only_tokens_the_formula_keeps(name, dtype):
    """DPPO evaluates its trust-region test only on the tokens a bound cannot settle (issue
    28): every token the bound settles must be kept by the test itself, on batches built to
    sit on the bounds (p → 1, log π > 0, log q > 0, tiny and large |log r|, small ε, large
    verl ε), and the loss equals the one from the test on every token."""
    from simkit.lm.losses.batch import _Batch
    from simkit.lm.losses.kernels import _dppo_kept, _dppo_undecided

    gen = torch.Generator().manual_seed(28)
    N, T = 8, 256
    for kind in range(6):
        if kind == 0:
            a = -torch.empty(N, T, dtype=torch.float64).exponential_(1.0, generator=gen)
        elif kind == 1:  # p within 1e-10 .. 1 of 1
            a = -(10 ** (torch.rand(N, T, generator=gen, dtype=torch.float64) * 10 - 10))
        elif kind == 2:
            a = -50 * torch.rand(N, T, generator=gen, dtype=torch.float64)
        else:
            a = -torch.empty(N, T, dtype=torch.float64).exponential_(3.0, generator=gen)
        scale = (1e-6, 1e-3, 0.05, 0.2, 0.6, 0.05)[kind]
        x = scale * torch.randn(N, T, generator=gen, dtype=torch.float64)
        if kind == 5:  # log q = a − x > 0 on a third of the tokens, log π > 0 on some
            x = torch.where(torch.rand(N, T, generator=gen) < 0.3, 2 * a, x).clamp(-1, 1)
            a = a + 0.05 * torch.randn(N, T, generator=gen, dtype=torch.float64)
        a, x = a.to(dtype), x.to(dtype)
        positive = torch.rand(N, generator=gen) < 0.5
        lo, hi = torch.aminmax(x)
        b = _Batch(x, None, None, positive, None, None, None, float(lo), float(hi), log_prob=a)
        for eps in (0.2, 0.05, 1e-3, 1e-5, 0.9):
            for kl_eps in (1e-8, 1e-3, 0.5) if name == "dppo_kl" else (1e-8,):
                m = mappings.get(name, eps_low=eps, eps_high=1.5 * eps, kl_eps=kl_eps)
                kept = _dppo_kept(m, a, x, positive[:, None]).reshape(-1)
                index = _dppo_undecided(m, b, x, a)
                if index is None:
                    continue
                decided = torch.ones_like(kept)
                decided[index] = False
                assert bool(kept[decided].all()), (kind, eps, kl_eps)


def test_segment_is_single_run_rows_equal_the_general_path(monkeypatch):
    """segment_is sums a row holding one run of valid tokens by a numpy reduction (issue 28):
    loss, gradient and metrics bit-identical to the general path (index_add_ over the valid
    tokens), on full, prefix and suffix masks, float32 and float64."""
    from simkit.lm.losses import kernels

    gen = torch.Generator().manual_seed(28)
    for dtype in (torch.float32, torch.float64):
        old = -torch.empty(16, 300, dtype=dtype).exponential_(1.0, generator=gen)
        lp = old + 0.3 * torch.randn(16, 300, generator=gen, dtype=dtype)
        adv = torch.randn(16, generator=gen, dtype=dtype)
        lengths = torch.randint(0, 301, (16,), generator=gen)
        prefix = torch.arange(300)[None] < lengths[:, None]
        for mask in (torch.ones(16, 300, dtype=torch.bool), prefix, prefix.flip(1)):
            for upper in (1.2, math.inf):
                results = []
                for general in (False, True):
                    if general:
                        monkeypatch.setattr(kernels, "_single_run_row_sums", lambda b: None)
                    x = lp.clone().requires_grad_(True)
                    loss, metrics = losses.policy_loss(
                        "segment_is", x, old, adv, mask, upper_bound=upper
                    )
                    loss.backward()
                    results.append((loss.detach(), x.grad, metrics))
                    monkeypatch.undo()
                (l0, g0, m0), (l1, g1, m1) = results
                assert torch.equal(l0, l1) and torch.equal(g0, g1), (dtype, upper)
                assert m0 == m1 or all(
                    m0[k] == m1[k] or (math.isnan(m0[k]) and math.isnan(m1[k])) for k in m0
                )
