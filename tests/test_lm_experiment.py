"""simkit.lm.experiment and simkit.lm.tasks: the gradient study on the tiny Llama."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit import divergence, mappings  # noqa: E402
from simkit.estimators import AGGREGATIONS, Estimator  # noqa: E402
from simkit.lm import experiment as X  # noqa: E402
from simkit.lm import models, tasks  # noqa: E402

Z = 5.0  # z of the stochastic checks (|est − truth| ≤ Z·SE, SE from the same draws)
T = 4  # response length of the studies
PARAMS = "norm"  # θ = the final RMSNorm weight (D = 32): cheap per-token Jacobians


@pytest.fixture(scope="module")
def model():
    # init_std 1.0 gives a peaked random policy (a temperature then moves it visibly)
    return models.tiny_llama(dtype=torch.float64, init_std=1.0, seed=0)


@pytest.fixture(scope="module")
def task():
    return tasks.TokenTask(vocab_size=64, target=1, n_prompts=4, prompt_length=4, seed=0)


@pytest.fixture(scope="module")
def on_policy(model, task):
    """On-policy study of every mapping; its reference draws are reused off-policy."""
    return X.gradient_study(
        model,
        task,
        X.default_estimators(),
        behaviour=None,
        params=PARAMS,
        n=8,
        reps=100,
        n_ref=3000,
        n_pilot=500,
        max_new_tokens=T,
        seed=1,
        loss_path="numpy",
        n_boot=50,
        rows_per_call=256,
    )


# --- tasks ----------------------------------------------------------------------------------


def test_checkers():
    assert tasks.parse_first_integer("The answer is 12, not 3") == 12
    assert tasks.parse_first_integer("minus -4") == -4
    assert tasks.parse_first_integer("no digits") is None
    assert tasks.arithmetic_reward(" 7.", 7) == 1.0
    assert tasks.arithmetic_reward("8", 7) == 0.0
    assert tasks.contains_keyword("It is PARIS.", "Paris")
    assert not tasks.contains_keyword("Parisian food", "Paris")  # whole word only
    ids = np.array([[1, 2, 1, 0], [3, 3, 3, 1]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=bool)  # the last 1 of row 2 is padding
    np.testing.assert_array_equal(tasks.token_presence_reward(ids, mask, 1), [1.0, 0.0])
    np.testing.assert_allclose(tasks.token_fraction_reward(ids, mask, 1), [2 / 3, 0.0])


def test_tasks_prompts_and_errors():
    t = tasks.TokenTask(vocab_size=16, target=3, n_prompts=3, prompt_length=5, seed=2)
    p = t.prompt_ids()
    assert p == t.prompt_ids() and len(p) == 3 and all(len(r) == 5 for r in p)
    assert all(0 <= x < 16 for r in p for x in r)
    with pytest.raises(ValueError, match="target"):
        tasks.TokenTask(vocab_size=4, target=4)
    with pytest.raises(ValueError, match="prompt_index"):
        t.rewards(np.array([0, 5]), np.zeros((2, 3), int), np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="tokenizer"):
        tasks.ArithmeticTask().prompt_ids(None)
    with pytest.raises(KeyError, match="available tasks"):
        tasks.get_task("nope")
    q, a = tasks.ArithmeticTask(n_prompts=2, seed=0).questions()[0]
    x, y = (int(v) for v in q.split("What is ")[1].split("?")[0].split("+"))
    assert a == x + y


# --- building blocks ------------------------------------------------------------------------


def test_select_parameters(model):
    assert X.select_parameters(model, "norm") == ("model.norm.weight",)
    assert X.select_parameters(model, "lm_head") == ("lm_head.weight",)
    last = X.select_parameters(model, "last_layer")
    assert last and all(n.startswith("model.layers.1.") for n in last)
    assert set(X.select_parameters(model, "last_mlp")) < set(last)
    assert X.parameter_dim(model, ("model.norm.weight",)) == 32
    with pytest.raises(ValueError, match="matches no parameter"):
        X.select_parameters(model, "decoder.nothing")


def test_token_divergences_match_numpy_and_inf():
    gen = torch.Generator().manual_seed(0)
    pi_logits = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)
    mu_logits = pi_logits + 0.5 * torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)
    d = X.token_divergences(pi_logits, mu_logits)
    pi = torch.softmax(pi_logits, -1).numpy()
    mu = torch.softmax(mu_logits, -1).numpy()
    np.testing.assert_allclose(d["chi2"].numpy(), divergence.chi2(pi, mu), rtol=1e-10)
    np.testing.assert_allclose(d["kl"].numpy(), divergence.kl(pi, mu), rtol=1e-10)
    np.testing.assert_allclose(d["tv"].numpy(), divergence.tv(pi, mu), rtol=1e-10)
    mu_cut = mu_logits.clone()
    mu_cut[..., 0] = -math.inf  # μ misses a token π has: χ² and KL are infinite
    cut = X.token_divergences(pi_logits, mu_cut)
    assert torch.isinf(cut["chi2"]).all() and torch.isinf(cut["kl"]).all()
    assert torch.isfinite(cut["tv"]).all()


def test_per_sample_gradients_vmap_equals_loop(model):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (5, 9), generator=gen)
    names = X.select_parameters(model, "lm_head,norm,last_mlp")
    lam = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    fast = X.per_sample_gradients(model, names, ids, 3, lam, method="vmap")
    slow = X.per_sample_gradients(model, names, ids, 3, lam, method="loop")
    assert fast.shape == (5, X.parameter_dim(model, names))
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    S = X.per_token_scores(model, names, ids, 3, method="vmap", chunk_size=2)
    torch.testing.assert_close(S, X.per_token_scores(model, names, ids, 3, method="loop"))
    # a per-sample gradient is the λ-weighted sum of the per-token scores; the two are different
    # backward passes, and transformers' LlamaRMSNorm computes in float32 even in a float64
    # model, so they agree to float32 rounding (relative to the gradient's scale), not 1e-12
    scale = float(fast.abs().max())
    torch.testing.assert_close(
        torch.einsum("nt,ntd->nd", lam, S), fast, rtol=1e-6, atol=1e-6 * scale
    )


def test_head_scores_equal_autograd(model):
    """The closed-form scores of the final norm weight and the untied lm_head equal the
    autograd Jacobian (float32 RMSNorm inside the float64 model: float32 rounding)."""
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 64, (4, 9), generator=gen)
    names = X.select_parameters(model, "lm_head,norm")
    assert X.head_parameter_names(model) == ("model.norm.weight", "lm_head.weight")
    assert X.resolve_grad_method(model, names, "auto") == "head"
    fast = X.per_token_scores(model, names, ids, 3, method="head")
    slow = X.per_token_scores(model, names, ids, 3, method="vmap")
    assert fast.shape == (4, 6, 32 + 64 * 32)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6 * float(slow.abs().max()))
    lam = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        X.per_sample_gradients(model, names, ids, 3, lam, method="head"),
        X.per_sample_gradients(model, names, ids, 3, lam, method="loop"),
        rtol=1e-6,
        atol=1e-6 * float(slow.abs().max()),
    )
    # other parameters: auto falls back to vmap, and head names what it cannot do
    assert X.resolve_grad_method(model, X.select_parameters(model, "last_mlp"), "auto") == "vmap"
    with pytest.raises(ValueError, match="grad method 'head'"):
        X.per_token_scores(model, X.select_parameters(model, "last_mlp"), ids, 3, method="head")
    tied = models.tiny_llama(seed=1, tie_word_embeddings=True)
    assert X.head_parameter_names(tied) == ("model.norm.weight",)
    with pytest.raises(ValueError, match="method must be one of"):
        X.per_token_scores(model, names, ids, 3, method="fast")


def test_contraction_equals_backprop_of_the_torch_loss(model):
    """ĝ = Σ λ S with λ = −∂loss/∂log π equals −∇θ loss backpropagated through the model."""
    from simkit.lm import losses

    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (6, 10), generator=gen)
    p = 4
    names = X.select_parameters(model, "lm_head")
    S = X.per_token_scores(model, names, ids, p)
    with torch.no_grad():
        log_pi = X.response_log_probs(model(ids).logits, ids, p)
    old = log_pi + 0.3 * torch.randn(log_pi.shape, generator=gen, dtype=torch.float64)
    mask = torch.ones_like(log_pi, dtype=torch.bool)
    mask[0, 4:] = False
    rewards = (torch.arange(6) % 2).double().numpy()
    for name in ("ppo_clip", "is_seq", "cispo", "gspo"):
        est = Estimator(mappings.get(name), aggregation="token-mean")
        lam, _ = X.estimator_token_weights(
            est, log_pi.numpy(), old.numpy(), mask.numpy(), rewards, 0.5, "torch"
        )
        g_contract = torch.einsum("nt,ntd->d", torch.as_tensor(lam), S * mask[..., None])
        params = dict(model.named_parameters())
        model.zero_grad(set_to_none=True)
        lp = X.response_log_probs(model(ids).logits, ids, p)
        loss, _ = losses.policy_loss(
            name,
            lp,
            old,
            torch.as_tensor(rewards - 0.5),
            mask,
            agg="token-mean",
            **est.mapping.hyperparameters,
        )
        (g_back,) = torch.autograd.grad(loss, [params[names[0]]])
        # float32 RMSNorm inside the float64 model: agreement to float32 rounding
        scale = float(g_back.abs().max())
        torch.testing.assert_close(g_contract, -g_back.reshape(-1), rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_torch_and_numpy_loss_paths_agree(agg):
    rng = np.random.default_rng(5)
    log_pi = rng.normal(-2.0, 0.5, size=(2, 8, 5))
    old = log_pi + rng.normal(0.0, 0.3, size=log_pi.shape)
    mask = np.ones(log_pi.shape, dtype=bool)
    mask[:, 0, 3:] = False
    rewards = rng.integers(0, 2, size=(2, 8)).astype(float)
    for name in mappings.available():
        est = Estimator(mappings.get(name), aggregation=agg)
        lam_t, c_t = X.estimator_token_weights(est, log_pi, old, mask, rewards, 0.4, "torch")
        lam_n, c_n = X.estimator_token_weights(est, log_pi, old, mask, rewards, 0.4, "numpy")
        np.testing.assert_allclose(lam_t, lam_n, rtol=1e-9, atol=1e-12, err_msg=name)
        np.testing.assert_array_equal(c_t, c_n)


def test_bias_statistics_remove_the_monte_carlo_floor():
    """Synthetic Gaussian draws with a known mean offset Δ: bias_sq is unbiased for ‖Δ‖²
    (within Z·SE) while the plug-in ‖ḡ − ∇̂J‖² sits far above it (the floor)."""
    rng = np.random.default_rng(0)
    D, R, M = 400, 200, 400
    truth = rng.normal(size=D)
    for shift in (0.0, 0.3):
        delta = np.zeros(D)
        delta[0] = shift
        g = truth + delta + rng.normal(0.0, 1.0, size=(R, D))
        u = truth + rng.normal(0.0, 2.0, size=(M, D))
        st = X.bias_statistics(g, u)
        assert abs(st["bias_sq"] - shift**2) <= Z * st["bias_sq_se"]
        plug_in = float(np.sum((g.mean(0) - u.mean(0)) ** 2))
        assert plug_in - shift**2 > Z * st["bias_sq_se"]  # what the subtraction removes
        np.testing.assert_allclose(st["noise"], D / R + 4 * D / M, rtol=0.1)
    with pytest.raises(ValueError, match="share D"):
        X.bias_statistics(np.zeros((3, 2)), np.zeros((3, 4)))


# --- the study ------------------------------------------------------------------------------


def test_on_policy_every_estimator_matches_the_reference(on_policy):
    tab = on_policy.table
    assert list(tab.mapping) == mappings.available()
    assert (tab.chi2_tok.abs() < 1e-12).all() and (tab.kl_tok.abs() < 1e-12).all()
    # luspo (c = |y|) and gepo (c = π(y)/Ê_group[π]) are not 1 on-policy: biased by design
    not_one = {n for n in mappings.available() if not mappings.mapping_class(n).on_policy_identity}
    assert not_one == {"luspo", "gepo"}
    for _, row in tab.iterrows():
        if row.mapping in not_one:
            continue
        assert abs(row.bias_sq) <= Z * row.bias_sq_se, row.estimator
        assert row.bias_lo == 0.0
    # μ = π: every mapping is REINFORCE (c = 1), so every row has the same gradients — except
    # clip_cov, which detaches tokens by cov(A, log π) whatever the ratio (an entropy
    # regulariser, not an importance correction), and the two above
    g = on_policy.gradients[[m not in not_one | {"clip_cov"} for m in tab.mapping]]
    np.testing.assert_allclose(g, np.broadcast_to(g[:1], g.shape), rtol=1e-12, atol=1e-14)
    assert on_policy.grad_norm > 0
    assert abs(on_policy.table.J.iloc[0] - on_policy.J) == 0


def test_off_policy_naive_is_biased_and_sequence_is_is_not(model, task, on_policy):
    res = X.gradient_study(
        model,
        task,
        X.default_estimators(["naive", "is_seq", "tis_seq", "ppo_clip"]),
        behaviour=3.0,  # μ = softmax(logits / 3)
        params=PARAMS,
        n=8,
        reps=400,
        max_new_tokens=T,
        seed=2,
        loss_path="numpy",
        n_boot=50,
        rows_per_call=256,
        reference=on_policy,
    )
    tab = res.table.set_index("mapping")
    assert tab.loc["naive", "chi2_tok"] > 0.5
    naive, seq = tab.loc["naive"], tab.loc["is_seq"]
    assert naive.bias_sq > Z * naive.bias_sq_se  # biased: detected
    assert abs(seq.bias_sq) <= Z * seq.bias_sq_se  # sequence IS is unbiased
    assert naive.bias_lo > 0 and seq.bias_lo == 0
    assert naive.ess == pytest.approx(8.0) and seq.ess < naive.ess
    assert res.profile.shape == (T, 6) and (res.profile.running == 1).all()
    np.testing.assert_allclose(
        (res.profile.chi2_tok * res.profile.tokens).sum() / res.profile.tokens.sum(),
        naive.chi2_tok,
    )
    for col in ("bias", "variance", "cosine", "mse", "snr", "ess", "chi2_seq"):
        assert np.isfinite(tab[col]).all(), col
    # k̂ of the unbounded sequence weights is finite; bounded ones (naive: all 1) have no tail
    # k̂ is NaN where no Pareto tail can be fitted (constant weights, few draws), never ±inf
    assert math.isnan(naive.khat) and not math.isinf(seq.khat)
    assert (tab.variance_lo <= tab.variance).all() and (tab.variance <= tab.variance_hi).all()
    assert not tab.exact.any()


def test_study_is_reproducible_and_validates(model, task):
    kw = dict(params=PARAMS, n=4, reps=3, n_ref=8, n_pilot=8, max_new_tokens=3, seed=7)
    kw["n_boot"] = 10
    a = X.gradient_study(model, task, ["naive", "is_token"], behaviour=1.5, **kw)
    b = X.gradient_study(model, task, ["naive", "is_token"], behaviour=1.5, **kw)
    np.testing.assert_array_equal(a.gradients, b.gradients)
    assert a.table.equals(b.table)
    with pytest.raises(ValueError, match="multiple of group_size"):
        X.gradient_study(model, task, ["naive"], **{**kw, "group_size": 3})
    with pytest.raises(ValueError, match="clash"):
        X.gradient_study(model, task, ["naive"], setting={"bias": 1}, **kw)
    with pytest.raises(ValueError, match="distinct"):
        X.gradient_study(model, task, ["naive", "naive"], **kw)
    with pytest.raises(ValueError, match="temperature"):
        X.gradient_study(model, task, ["naive"], behaviour=-1.0, **kw)


def test_eos_responses_are_masked(model, task):
    res = X.gradient_study(
        model,
        task,
        ["naive"],
        params=PARAMS,
        n=8,
        reps=2,
        n_ref=8,
        n_pilot=8,
        max_new_tokens=6,
        eos_token_id=2,
        seed=0,
        n_boot=10,
    )
    assert res.lengths.min() >= 1 and res.lengths.max() <= 6
    assert res.profile.running.iloc[0] == 1.0
    assert (np.diff(res.profile.running) <= 0).all()


# --- comparison with the simulation ---------------------------------------------------------


def test_simulation_twin_matches_the_profile():
    chi2 = np.array([0.05, 0.1, 0.2, 0.1])
    env, mu = X.simulation_twin(chi2, J=0.3, V=3)
    assert env.T == 4 and env.V == 3
    assert env.J() == pytest.approx(0.3, rel=1e-12)
    prof = env.divergence_profile(mu)
    np.testing.assert_allclose(prof["chi2_tok"], chi2, rtol=1e-7)
    with pytest.raises(ValueError, match="J must be"):
        X.simulation_twin(chi2, J=0.0)


def test_rank_agreement_and_relative_metrics():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, np.nan])
    rho, lo, hi, k = X.rank_agreement(x, x**2, n_boot=100)
    assert rho == pytest.approx(1.0) and k == 5 and lo <= rho <= hi
    rho, *_ = X.rank_agreement(x, -x, n_boot=100)
    assert rho == pytest.approx(-1.0)
    assert math.isnan(X.rank_agreement([1.0, 2.0], [1.0, 2.0])[0])
    import pandas as pd

    tab = pd.DataFrame(
        {
            "estimator": ["naive", "a"],
            "mapping": ["naive", "a"],
            "variance": [2.0, 4.0],
            "bias": [0.5, 0.25],
            "mse": [2.25, 4.0625],
        }
    )
    rel = X.relative_metrics(tab)
    np.testing.assert_allclose(rel.rel_variance, [1.0, 2.0])
    np.testing.assert_allclose(rel.rel_bias, [1.0, 0.5])
    with pytest.raises(ValueError, match="no 'is_seq' row"):
        X.relative_metrics(tab, reference="is_seq")


def test_gradient_metrics_cache_gives_the_same_values_and_needs_boot_weights():
    """The reference-only terms shared through ``cache`` (issue 28) change no value: every
    metric equals the uncached one exactly, for two estimators sharing one cache."""
    from simkit.lm.metrics import _resample_weights

    rng = np.random.default_rng(5)
    U = rng.normal(size=(40, 6))
    boot = (_resample_weights(12, 50, rng), _resample_weights(40, 50, rng))
    coeffs, mask = rng.random((12, 3, 4)), rng.random((12, 3, 4)) < 0.8
    cache = {}
    for shift in (0.0, 0.3):
        g = rng.normal(size=(12, 6)) + shift
        plain = X.gradient_metrics(g, U, 3, coeffs, mask, boot_weights=boot)
        shared = X.gradient_metrics(g, U, 3, coeffs, mask, boot_weights=boot, cache=cache)
        assert plain.keys() == shared.keys()
        for key, value in plain.items():
            assert value == shared[key] or (value != value and shared[key] != shared[key]), key
    assert set(cache) == {"gram_uu", "zero"}
    with pytest.raises(ValueError, match="cache needs boot_weights"):
        X.gradient_metrics(g, U, 3, coeffs, mask, cache={})
