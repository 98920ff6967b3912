"""simkit.lm.mismatch: μ from π by temperature, top-p, precision, weight noise and staleness."""

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit import divergence  # noqa: E402
from simkit.lm import experiment as X  # noqa: E402
from simkit.lm import mismatch as M  # noqa: E402
from simkit.lm import models, tasks  # noqa: E402

T = 5  # response length of the measurements


@pytest.fixture(scope="module")
def model():
    # init_std 1.0: a peaked random policy, so every knob moves μ visibly
    return models.tiny_llama(dtype=torch.float64, init_std=1.0, seed=0)


@pytest.fixture(scope="module")
def model32():
    return models.tiny_llama(dtype=torch.float32, init_std=1.0, seed=0)


@pytest.fixture(scope="module")
def task():
    # the fraction reward varies from response to response: the staleness steps always move π
    # (token 58 is the most frequent token of this random model: about 14% of its tokens)
    return tasks.TokenTask(vocab_size=64, target=58, n_prompts=4, prompt_length=4, kind="fraction")


@pytest.fixture(scope="module")
def logits(model):
    """π's logits at 40 visited-like states (random prefixes), (5, 8, 64) float64."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (5, 8), generator=gen)
    with torch.no_grad():
        return model(ids).logits


def numpy_divergences(pi_logits, mu_logits):
    """χ², KL, TV by enumeration with simkit.divergence (numpy) on softmax probabilities."""

    def softmax(z):
        z = np.asarray(z, dtype=np.float64)
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    pi, mu = softmax(pi_logits), softmax(mu_logits)
    return divergence.chi2(pi, mu), divergence.kl(pi, mu), divergence.tv(pi, mu)


def mu_logits_of(pair, model, ids):
    with torch.no_grad():
        z = model(ids).logits
        return pair.behaviour.logits(pair.target, ids, pi_logits=z)


# --- identities ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "generator",
    [
        M.Temperature(1.0),
        M.TopP(1.0),
        M.WeightNoise(0.0),
        M.Staleness(0),
        M.Precision("fp32"),
        M.Combined((M.Temperature(1.0), M.TopP(1.0))),
    ],
    ids=lambda g: g.spec,
)
def test_identity_knobs_give_mu_equal_pi(model32, task, generator):
    """Knob at its identity value ⇒ μ = π exactly (fp32 rounding of a float32 model included)."""
    pair = generator.prepare(model32, task=task, max_new_tokens=T)
    assert pair.target is model32
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = model32(ids).logits
    torch.testing.assert_close(mu_logits_of(pair, model32, ids), z, rtol=0, atol=0)
    rep = M.measure(model32, generator, task, n=8, max_new_tokens=T, seed=0)
    assert rep.chi2_tok < 1e-12 and rep.kl_tok < 1e-12 and rep.tv_tok < 1e-12


# --- values equal enumeration on the logits; monotone knobs --------------------------------


def test_temperature_values_and_monotone(logits):
    """μ_τ = softmax(z/τ) equals numpy; χ², KL, TV grow as τ leaves 1 on either side.

    Monotonicity is a theorem here: {softmax(βz)} is an exponential family in β = 1/τ, so
    KL(π‖μ_β) and log(1 + χ²) are convex in β with their minimum 0 at β = 1, and TV's
    derivative Σ_{μ>π} μ_β(z − E_β z) has the sign of β − 1.
    """
    z = logits.numpy()
    taus = (0.5, 0.7, 0.9, 1.0, 1.2, 1.5, 2.0)
    means = []
    for tau in taus:
        mu = M.temperature_logits(logits, tau)
        d = X.token_divergences(logits, mu)
        chi2, kl, tv = numpy_divergences(z, z / tau)
        np.testing.assert_allclose(d["chi2"].numpy(), chi2, rtol=1e-9, atol=1e-14)
        np.testing.assert_allclose(d["kl"].numpy(), kl, rtol=1e-9, atol=1e-14)
        np.testing.assert_allclose(d["tv"].numpy(), tv, rtol=1e-9, atol=1e-14)
        means.append(np.stack([chi2, kl, tv]))  # (3, 5, 8) per state
    means = np.array(means)
    below, above = means[:4], means[3:]  # τ ≤ 1 decreasing in τ, τ ≥ 1 increasing: per state
    assert np.all(np.diff(below, axis=0) < 0) and np.all(np.diff(above, axis=0) > 0)


def test_top_p_values_and_monotone(logits):
    """The nucleus equals an independent numpy enumeration; TV = 1 − nucleus mass decreases
    in p; χ² and KL are infinite wherever a token of π is dropped."""
    z = logits.numpy().reshape(-1, 64)
    pi = np.exp(z - z.max(1, keepdims=True))
    pi /= pi.sum(1, keepdims=True)
    tvs = []
    for p in (0.3, 0.6, 0.9, 0.99):
        mu_z = M.top_p_logits(logits, p).numpy().reshape(-1, 64)
        for row, mrow in zip(pi, mu_z):
            order = np.argsort(-row, kind="stable")
            cum = np.cumsum(row[order]) - row[order]
            kept = np.zeros(64, dtype=bool)
            kept[order[cum < p]] = True
            assert np.array_equal(np.isfinite(mrow), kept)
            mu = np.where(kept, row, 0.0) / row[kept].sum()
            np.testing.assert_allclose(
                np.exp(mrow - mrow.max()) / np.exp(mrow - mrow.max()).sum(), mu
            )
            assert row[kept].sum() >= p and row[kept].sum() - row[order][kept[order]][-1] < p
            d = X.token_divergences(torch.as_tensor(row).log(), torch.as_tensor(mrow))
            assert float(d["tv"]) == pytest.approx(1.0 - row[kept].sum(), abs=1e-12)
            if kept.all():
                assert float(d["chi2"]) < 1e-12
            else:
                assert math.isinf(float(d["chi2"])) and math.isinf(float(d["kl"]))
        tvs.append(X.token_divergences(logits, M.top_p_logits(logits, p))["tv"].numpy())
    assert np.all(np.diff(np.array(tvs), axis=0) <= 1e-15)
    # p → 0 keeps the arg max only: μ is one-hot
    tiny = M.top_p_logits(logits, 1e-9)
    assert (torch.isfinite(tiny).sum(-1) == 1).all()


def _round_bf16_numpy(x32: np.ndarray) -> np.ndarray:
    """bf16 rounding (nearest, ties to even) on float32 bit patterns: keep the top 16 bits."""
    bits = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def test_precision_values_and_ordering(model32):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 9), generator=gen)
    with torch.no_grad():
        z = model32(ids).logits
    np.testing.assert_array_equal(M.round_logits(z, "bf16").numpy(), _round_bf16_numpy(z.numpy()))
    np.testing.assert_array_equal(
        M.round_logits(z, "fp16").numpy(), z.numpy().astype(np.float16).astype(np.float32)
    )
    chi2 = {}
    for dtype in ("bf16", "fp16", "fp32"):
        d = X.token_divergences(z, M.round_logits(z, dtype))
        ref = numpy_divergences(z.numpy(), M.round_logits(z, dtype).numpy())
        np.testing.assert_allclose(d["chi2"].numpy(), ref[0], rtol=1e-6, atol=1e-15)
        chi2[dtype] = float(d["chi2"].mean())
    # fewer significant bits, larger mismatch: bf16 (8) > fp16 (11) > fp32 (24) = 0
    assert chi2["bf16"] > chi2["fp16"] > 1e-12 > chi2["fp32"]
    assert M.Precision("bf16").strength == 2.0**-8 and M.Precision("fp16").strength == 2.0**-11
    # the whole forward in bf16 is a different network, with a larger mismatch
    fwd = M.Precision("bf16", scope="forward").prepare(model32)
    assert next(fwd.behaviour.model.parameters()).dtype == torch.bfloat16
    d = X.token_divergences(z, mu_logits_of(fwd, model32, ids).float())
    assert float(d["chi2"].mean()) > chi2["bf16"]


def test_weight_noise_is_reproducible_local_and_quadratic(model, task):
    """Same seed ⇒ same μ; the original model is untouched; KL(π‖μ_σ) ≈ ½σ²·εᵀFε grows like σ²
    (ratio 4 for σ doubled; 10% tolerance is the third-order remainder at σ ≤ 2e-4)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    a = M.WeightNoise(1e-4, seed=3).prepare(model)
    b = M.WeightNoise(1e-4, seed=3).prepare(model)
    for p, q in zip(a.behaviour.model.parameters(), b.behaviour.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=0)
    only_norm = M.WeightNoise(0.1, params="norm").prepare(model).behaviour.model
    changed = [
        n
        for (n, p), q in zip(only_norm.named_parameters(), model.parameters())
        if not torch.equal(p, q)
    ]
    assert changed == ["model.norm.weight"]
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (4, 8), generator=gen)
    kls = []
    for sigma in (5e-5, 1e-4, 2e-4):
        pair = M.WeightNoise(sigma, seed=3).prepare(model)
        with torch.no_grad():
            kls.append(
                float(
                    X.token_divergences(model(ids).logits, mu_logits_of(pair, model, ids))[
                        "kl"
                    ].sum()
                )
            )
    assert kls[0] < kls[1] < kls[2]
    assert kls[1] / kls[0] == pytest.approx(4.0, rel=0.1)
    assert kls[2] / kls[1] == pytest.approx(4.0, rel=0.1)


def test_staleness_one_sgd_step_is_the_policy_gradient(model, task):
    """k = 1, SGD, REINFORCE loss on the norm weight γ: θ₁ − θ₀ = lr·Σ_{i,t} A_i S_{i,t} / #tokens
    (token-mean), with S the per-token scores of the rollout batch (independent path: vmap)."""
    B, lr = 6, 0.05
    target = M.stale_target(
        model, task, steps=1, lr=lr, optimizer="sgd", batch_size=B, loss="naive",
        params="norm", max_new_tokens=T, seed=4,
    )  # fmt: skip
    batch = M.rollout_batch(model, task, B, T, seed=4)
    names = ("model.norm.weight",)
    adv = batch.rewards - batch.rewards.mean()
    expected = torch.zeros(32, dtype=torch.float64)
    for idx, ids, m, p in batch.groups:
        S = X.per_token_scores(model, names, ids, p, method="vmap") * m[..., None]
        expected += torch.einsum("n,ntd->d", torch.as_tensor(adv[idx]), S)
    expected *= lr / float(batch.mask.sum())
    assert np.ptp(batch.rewards) > 0 and float(expected.abs().max()) > 1e-4  # a real step
    got = dict(target.named_parameters())["model.norm.weight"] - model.model.norm.weight
    # float32 RMSNorm inside the float64 model: agreement to float32 rounding
    torch.testing.assert_close(
        got.detach(), expected, rtol=1e-5, atol=1e-7 * float(expected.abs().max())
    )
    # only γ moved; the behaviour is the given model itself
    for (n, p), q in zip(target.named_parameters(), model.parameters()):
        assert torch.equal(p, q) == (n != "model.norm.weight"), n
    pair = M.Staleness(2, lr=0.01, batch_size=4, seed=1).prepare(model, task=task, max_new_tokens=T)
    assert pair.behaviour.model is model and pair.target is not model
    again = M.Staleness(2, lr=0.01, batch_size=4, seed=1).prepare(
        model, task=task, max_new_tokens=T
    )
    for p, q in zip(pair.target.parameters(), again.target.parameters()):
        assert torch.equal(p, q)
    rep = M.measure(model, pair, task, n=16, max_new_tokens=T)
    assert rep.kl_tok > 0 and rep.behaviour == "staleness" and rep.strength == 2.0


def test_staleness_with_constant_rewards_warns(model):
    flat = tasks.TokenTask(vocab_size=64, target=1, n_prompts=2, prompt_length=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target = M.stale_target(
            model, _Constant(flat), steps=1, lr=0.1, batch_size=2, max_new_tokens=2
        )
    assert any("advantages are 0" in str(w.message) for w in caught)
    for p, q in zip(target.parameters(), model.parameters()):
        assert torch.equal(p, q)


class _Constant:
    """A task whose reward is always 1."""

    def __init__(self, inner):
        self.inner = inner

    def prompt_ids(self, tokenizer=None):
        return self.inner.prompt_ids(tokenizer)

    def rewards(self, prompt_index, response_ids, response_mask, tokenizer=None):
        return np.ones(len(prompt_index))


# --- measuring -----------------------------------------------------------------------------


def test_divergence_summary_is_token_weighted():
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype=bool)
    d = {k: np.array([[1.0, 3.0, 99.0], [2.0, 99.0, 99.0]]) for k in ("chi2", "kl", "tv")}
    means, prof = M.divergence_summary(d, mask)
    assert means["chi2_tok"] == pytest.approx(2.0)  # (1 + 3 + 2) / 3 valid tokens
    np.testing.assert_allclose(prof.chi2_tok[:2], [1.5, 3.0])
    assert math.isnan(prof.chi2_tok[2]) and list(prof.running) == [1.0, 0.5, 0.0]


def test_measure_matches_the_study_and_is_reproducible(model, task):
    a = M.measure(model, "temperature:1.5", task, n=16, max_new_tokens=T, seed=3, rows_per_call=5)
    b = M.measure(model, M.Temperature(1.5), task, n=16, max_new_tokens=T, seed=3, rows_per_call=5)
    assert a.chi2_tok == b.chi2_tok and a.profile.equals(b.profile)  # same seed, same numbers
    assert a.as_row()["behaviour"] == "temperature" and a.strength == 1.5
    assert a.profile.shape == (T, 6) and a.lengths.shape == (16,)
    # the generator, the spec string and the bare temperature give the same study
    kw = dict(params="norm", n=4, reps=3, n_ref=8, n_pilot=8, max_new_tokens=3, seed=7, n_boot=10)
    s1 = X.gradient_study(model, task, ["naive", "is_seq"], behaviour=M.Temperature(1.5), **kw)
    s2 = X.gradient_study(model, task, ["naive", "is_seq"], behaviour="temperature:1.5", **kw)
    s3 = X.gradient_study(model, task, ["naive", "is_seq"], behaviour=1.5, **kw)
    np.testing.assert_array_equal(s1.gradients, s2.gradients)
    np.testing.assert_array_equal(s1.gradients, s3.gradients)
    assert list(s1.table.behaviour) == ["temperature"] * 2 and (s1.table.strength == 1.5).all()


def test_study_on_a_stale_policy_rejects_a_foreign_reference(model, task):
    kw = dict(params="norm", n=4, reps=2, n_ref=8, n_pilot=8, max_new_tokens=3, seed=0, n_boot=10)
    ref = X.gradient_study(model, task, ["naive"], **kw)
    stale = M.Staleness(2, lr=0.01, batch_size=8, max_new_tokens=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rollout batch has varied rewards: no warning
        res = X.gradient_study(model, task, ["naive", "is_seq"], behaviour=stale, **kw)
    assert res.table.chi2_tok.iloc[0] > 0 and res.fingerprint != ref.fingerprint
    with pytest.raises(ValueError, match="another target policy"):
        X.gradient_study(model, task, ["naive"], behaviour=stale, reference=ref, **kw)
    with pytest.raises(ValueError, match="changes the target policy"):
        X.as_behaviour(stale.prepare(model, task=task, max_new_tokens=3), model)


# --- parsing and validation ----------------------------------------------------------------


def test_parse_specs_round_trip():
    assert M.parse("temperature:1.3") == M.Temperature(1.3)
    assert M.parse("top_p:0.9") == M.TopP(0.9)
    assert M.parse("precision:bf16,scope=forward") == M.Precision("bf16", scope="forward")
    assert M.parse("weight_noise:0.01,seed=2,relative=false") == M.WeightNoise(
        0.01, seed=2, relative=False
    )
    st = M.parse("staleness:4,lr=0.001,optimizer=sgd,max_new_tokens=none")
    assert st == M.Staleness(4, lr=0.001, optimizer="sgd")
    combo = M.parse("temperature:0.7+top_p:0.9")
    assert combo == M.Combined((M.Temperature(0.7), M.TopP(0.9)))
    assert combo.spec == "temperature:0.7+top_p:0.9"
    assert M.parse(st.spec) == st and M.parse("on_policy") is None
    assert M.available() == ["temperature", "top_p", "precision", "weight_noise", "staleness"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("temperature:0", "tau must be > 0"),
        ("temperature:nan", "finite"),
        ("top_p:0", r"in \(0, 1\]"),
        ("top_p:1.5", r"in \(0, 1\]"),
        ("precision:int8", "bf16"),
        ("precision:bf16,scope=kernel", "scope"),
        ("weight_noise:-0.1", ">= 0"),
        ("staleness:-1", "steps must be an integer >= 0"),
        ("staleness:2,optimizer=rmsprop", "adam"),
        ("staleness:2,loss=nope", "not a policy loss"),
        ("staleness:2,lr=0", "lr must be > 0"),
        ("warp:2", "available: temperature, top_p"),
        ("temperature:1.2,alpha=3", "no field 'alpha'"),
        ("temperature:x", "cannot read"),
        ("temperature:1.2+staleness:2", "must come first"),
        ("staleness:2+weight_noise:0.1", "at most one"),
        ("", "non-empty"),
    ],
)
def test_bad_knobs_are_rejected(spec, message):
    with pytest.raises(ValueError, match=message):
        M.parse(spec)


def test_staleness_needs_the_task(model):
    with pytest.raises(ValueError, match="needs the task"):
        M.Staleness(1).prepare(model, max_new_tokens=3)
