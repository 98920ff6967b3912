"""The exact top-k tree of a language model (simkit.lm.exact) and its leaf environment."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")

from simkit import experiment as E  # noqa: E402
from simkit.lm import exact, models, tasks, topk  # noqa: E402
from simkit.lm import experiment as X  # noqa: E402

Z = 5.0  # z of the stochastic checks
PROMPT = [3, 17, 41, 8]


@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny(dtype=torch.float64, seed=0):
    return models.tiny_llama(init_std=1.0, dtype=dtype, seed=seed)


def second_token(model, prompt, k=3):
    """A token of the root's top-k support (rank 1): a reward that fires on some leaves."""
    with torch.no_grad():
        z = model(torch.tensor([prompt])).logits[0, -1]
    return int(torch.topk(z.float(), k).indices[1])


def presence(target):
    return lambda seqs, mask: ((seqs == target) & mask).any(axis=1).astype(float)


@pytest.mark.parametrize(
    "eos,dtype,std,tol",
    [
        (None, torch.float32, 0.1, 1e-6),
        ("rank1", torch.float32, 0.1, 1e-6),
        (None, torch.float64, 1.0, 1e-10),  # peaked policy: the float32 gap is rounding only
    ],
)
def test_leaf_log_probs_match_independent_scoring(eos, dtype, std, tol):
    """Cached, batched-by-depth tree = a full forward of every leaf with top-k renormalised.

    init_std 0.1 keeps float32 logits small (|z| < 1): at init_std 1 (|z| ≈ 20) float32 rounding
    of two differently ordered computations differs by ~6e-5 in log-probability."""
    model = models.tiny_llama(init_std=std, dtype=dtype)
    k, T = 3, 4
    eos_id = None if eos is None else second_token(model, PROMPT, k)
    tr = exact.tree(model, PROMPT, k, T, "temperature:1.3", eos_id, params=None, batch_size=7)
    assert tr.n_leaves == (k**T if eos is None else tr.n_leaves)
    if eos is not None:
        assert tr.n_leaves < k**T and not tr.mask.all()  # some responses end at EOS
    np.testing.assert_allclose(np.exp(tr.log_pi).sum(), 1.0, atol=1e-12)
    np.testing.assert_allclose(np.exp(tr.log_mu).sum(), 1.0, atol=1e-12)
    rows = torch.cat(
        [torch.tensor([PROMPT]).expand(tr.n_leaves, -1), torch.as_tensor(tr.sequences)], 1
    )
    ind = exact.topk_token_log_probs(model, rows, len(PROMPT), k).numpy()
    np.testing.assert_allclose(np.where(tr.mask, ind, 0.0), tr.token_log_pi, atol=tol, rtol=0)
    # μ = softmax(z/1.3) on the same support
    with torch.no_grad():
        z = model(rows).logits[:, len(PROMPT) - 1 : -1].double()
    sup = torch.topk(z.float(), k, dim=-1).indices
    lq = torch.log_softmax(z.gather(-1, sup) / 1.3, -1)
    y = rows[:, len(PROMPT) :, None]
    lq_y = (lq * (sup == y)).sum(-1).numpy()
    np.testing.assert_allclose(np.where(tr.mask, lq_y, 0.0), tr.token_log_mu, atol=tol)
    # distinct leaves
    assert len({tuple(r[m]) for r, m in zip(tr.sequences, tr.mask)}) == tr.n_leaves


def _tree(model, behaviour, k=3, T=4, params="norm", **kw):
    target = second_token(model, PROMPT, k)
    return exact.tree(model, PROMPT, k, T, behaviour, params=params, rewards=presence(target), **kw)


@pytest.mark.parametrize("behaviour", ["temperature:1.3", "weight_noise:0.2", "precision:bf16"])
def test_sequence_is_is_exactly_unbiased(behaviour):
    model = tiny()
    env = _tree(model, behaviour).env()
    grad = env.grad_J()
    assert 0 < env.J() < 1 and np.linalg.norm(grad) > 0
    if behaviour != "precision:bf16":  # bf16 logits of a float64 model barely move μ
        assert env.divergences("mu")["chi2_seq"] > 1e-4
    table = E.run(env, "mu", X.default_estimators(["naive", "is_seq"]), n=4, reps=2)
    seq = table[table.mapping == "is_seq"].iloc[0]
    assert seq.exact and seq.bias < 1e-8 * np.linalg.norm(grad)
    if behaviour == "temperature:1.3":
        naive = table[table.mapping == "naive"].iloc[0]
        assert naive.bias > 1e-3 * np.linalg.norm(grad)


def test_on_policy_every_mapping_equals_reinforce():
    model = tiny()
    env = _tree(model, None).env()
    table = E.run(env, "mu", X.default_estimators(), n=4, reps=2)
    exact_rows = table[table.exact]
    assert len(exact_rows) >= 20
    ests = {e.name: e for e in X.default_estimators()}
    ref = E.exact_moments(env, "mu", ests["naive"], 4)
    for name in exact_rows.estimator:
        if not ests[name].mapping.on_policy_identity:  # luspo (c = |y|), by design
            continue
        m = E.exact_moments(env, "mu", ests[name], 4)
        np.testing.assert_allclose(m.mean, ref.mean, rtol=1e-10, atol=1e-14, err_msg=name)
        assert m.variance == pytest.approx(ref.variance, rel=1e-10)
    # naive on-policy is unbiased: E ĝ = ∇J
    np.testing.assert_allclose(ref.mean, env.grad_J(), rtol=1e-10, atol=1e-14)


def test_closed_form_scores_equal_torch_func_and_finite_differences():
    model = tiny()
    head = _tree(model, "temperature:1.3", params="norm,lm_head", grad_method="head")
    func = _tree(model, "temperature:1.3", params="norm,lm_head", grad_method="vmap")
    # transformers' RMSNorm runs in float32 even in a float64 model: agreement to ~2e-7
    np.testing.assert_allclose(func.scores, head.scores, rtol=1e-6, atol=1e-8)
    # ∇J w.r.t. the final norm weight by central differences of the exact J(θ)
    env = _tree(model, None).env()
    grad = env.grad_J()
    target = second_token(model, PROMPT, 3)
    eps = 1e-5
    weight = model.model.norm.weight
    for i in (0, 7, 19):
        vals = []
        for sign in (1, -1):
            with torch.no_grad():
                weight[i] += sign * eps
            tr = exact.tree(model, PROMPT, 3, 4, None, params=None, rewards=presence(target))
            with torch.no_grad():
                weight[i] -= sign * eps
            vals.append(float(np.exp(tr.log_pi) @ tr.rewards))
        assert (vals[0] - vals[1]) / (2 * eps) == pytest.approx(grad[i], rel=1e-5, abs=1e-9)


def test_batching_does_not_change_the_tree():
    model = tiny()
    a = _tree(model, "weight_noise:0.1", batch_size=1)
    b = _tree(model, "weight_noise:0.1", batch_size=1000)
    np.testing.assert_allclose(a.token_log_pi, b.token_log_pi, atol=1e-12)
    np.testing.assert_allclose(a.token_log_mu, b.token_log_mu, atol=1e-12)
    np.testing.assert_allclose(a.scores, b.scores, atol=1e-12)


def test_monte_carlo_study_agrees_with_the_exact_tree():
    """The MC gradient study on the truncated LM (TopK) vs the exact tree, within Z·SE."""
    model = tiny()
    k, T = 3, 4
    target = second_token(model, tasks.get_task("token", n_prompts=2).prompt_ids()[0], k)
    task = tasks.get_task("token", vocab_size=64, target=target, n_prompts=2)
    from simkit.estimators import Estimator

    # the LM study's baseline is its pilot estimate of J(π): advantage oracle_pi on both sides
    names = ["naive", "is_seq", "is_token", "ppo_clip", "tis_token"]
    ests = [
        Estimator(m, aggregation="seq-mean-token-sum", advantage="oracle_pi", name=m) for m in names
    ]
    ex = exact.exact_study(model, task, "temperature:1.5", ests, k=k, T=T, n=8, reps=50)
    assert ex.table.exact.all() and 0.05 < ex.J < 0.95
    res = X.gradient_study(
        topk.TopK(model, k),
        task,
        ests,
        behaviour="temperature:1.5",
        params="norm",
        grad_method="vmap",
        n=8,
        reps=60,
        n_ref=400,
        n_pilot=200,
        max_new_tokens=T,
        seed=3,
    )
    assert abs(res.J - ex.J) <= Z * res.J_se
    truth = ex.table.set_index("estimator")
    for row in res.table.itertuples():
        b2 = truth.loc[row.estimator, "bias"] ** 2
        assert abs(row.bias_sq - b2) <= Z * row.bias_sq_se + 1e-12, row.estimator
        var = truth.loc[row.estimator, "variance"]
        g = res.gradients[list(res.table.estimator).index(row.estimator)]
        dev = np.sum((g - g.mean(0)) ** 2, axis=1)
        se = dev.std(ddof=1) / math.sqrt(len(dev))
        assert abs(row.variance - var) <= Z * se, row.estimator
    naive = truth.loc["naive"]
    assert naive.bias > 0.05 * naive.grad_norm  # a bias to detect
    # the scale-free error and kept fractions of the MC rows cover the exact tree's, within
    # Z·SE (SE from the width of the 95% bootstrap interval)
    for row in res.table.itertuples():
        assert isinstance(row.reliable, bool | np.bool_)
        for key in ("mse_scaled", "rel_mse_scaled", "kept", "kept_seq"):
            value, lo, hi = (getattr(row, key + s) for s in ("", "_lo", "_hi"))
            se = (hi - lo) / (2 * 1.96)
            # a share whose rare event was never drawn has a zero-width interval: allow the
            # rule of three, 3/N (the 95% bound on an event not seen in N = reps·n draws)
            slack = 3.0 / (row.reps * row.n) if key.startswith("kept") else 1e-12
            assert abs(value - truth.loc[row.estimator, key]) <= Z * se + slack, (row, key)
    assert truth.loc["naive", "rel_mse_scaled"] < 1.0  # a signal to detect


def test_batch_dependent_estimators_are_monte_carlo_and_flagged():
    model = tiny()
    target = second_token(model, tasks.get_task("token", n_prompts=1).prompt_ids()[0], 3)
    task = tasks.get_task("token", vocab_size=64, target=target, n_prompts=1)
    ex = exact.exact_study(
        model, task, "temperature:1.5", ["naive", "is_seq", "snis"], k=3, T=3, n=8, reps=200
    )
    t = ex.table.set_index("mapping")
    assert t.loc["naive", "exact"] and t.loc["is_seq", "exact"] and not t.loc["snis", "exact"]
    assert np.isfinite(t.loc["snis", "bias_lo"]) and np.isnan(t.loc["naive", "bias_lo"])
    assert t.loc["is_seq", "chi2_seq"] > 0 and t.loc["is_seq", "top_k"] == 3


def test_memory_error_names_k_T_and_bytes():
    model = tiny()
    with pytest.raises(MemoryError, match=r"k = 8, T = 9 needs about \d+ bytes"):
        exact.tree(model, PROMPT, 8, 9, None, params="norm", memory_limit=1 << 20)
    with pytest.raises(ValueError, match="k = 100 exceeds the vocabulary"):
        exact.tree(model, PROMPT, 100, 2, None)
    with pytest.raises(ValueError, match="T must be an integer >= 1"):
        exact.tree(model, PROMPT, 2, 0, None)


def test_group_advantages_need_one_prompt():
    from simkit.estimators import Estimator

    model = tiny()
    task = tasks.get_task("token", vocab_size=64, target=1, n_prompts=2)
    est = Estimator("naive", advantage="grpo", group_size=4, aggregation="seq-mean-token-sum")
    with pytest.raises(ValueError, match="group advantages"):
        exact.exact_study(model, task, None, [est], k=2, T=2, n=8)


def test_patched_closed_form_mc_study_equals_torch_func_study():
    """mc_study's closed-form top-k scores = the torch.func scores of TopK on the same draws."""
    model = tiny()
    target = second_token(model, tasks.get_task("token", n_prompts=2).prompt_ids()[0], 3)
    task = tasks.get_task("token", vocab_size=64, target=target, n_prompts=2)
    ests = X.default_estimators(["naive", "is_seq", "ppo_clip"])
    kw = dict(
        behaviour="temperature:1.5",
        params="norm",
        n=8,
        reps=4,
        n_ref=16,
        n_pilot=8,
        max_new_tokens=4,
    )
    a = X.gradient_study(topk.TopK(model, 3), task, ests, grad_method="vmap", **kw)
    b = topk.mc_study(model, task, ests, 3, grad_method="head", **kw)
    np.testing.assert_allclose(b.gradients, a.gradients, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.reference_samples, a.reference_samples, rtol=1e-5, atol=1e-6)
    # outside the block the study's scorer is the original again
    from simkit.lm import sampling

    assert sampling.head_scores is X.head_scores


def test_exact_scale_free_columns_equal_an_enumeration_of_the_leaves():
    """mse_zero, alpha_star, mse_scaled, rel_mse_scaled, kept, kept_seq of the exact study
    equal a direct sum over the enumerated leaves (1e-10)."""
    from simkit import mappings
    from simkit.estimators import Estimator

    model = tiny()
    k, T, n = 3, 3, 4
    target = second_token(model, tasks.get_task("token", n_prompts=1).prompt_ids()[0], k)
    task = tasks.get_task("token", vocab_size=64, target=target, n_prompts=1)
    names = ["naive", "is_seq", "tis_token", "ppo_clip", "mis_token"]
    ests = [Estimator(m, aggregation="seq-mean-token-sum", name=m) for m in names]
    ex = exact.exact_study(model, task, "temperature:1.6", ests, k=k, T=T, n=n, reps=20)
    env = ex.env
    assert ex.table.exact.all()
    p_mu, p_pi = env.prob("mu"), env.prob("pi")
    R = env.rewards
    S = env.scores[env.edges]  # (L, T, D), zero on padding
    J_pi, J_mu = float(p_pi @ R), float(p_mu @ R)
    grad_J = np.einsum("l,ltd->d", p_pi * (R - J_pi), S)
    log_ratio = np.where(env.mask, env.log_pi_tok - env.log_mu_tok, 0.0)
    for est in ests:
        A = R - J_mu  # the oracle advantage
        mapping = mappings.get(est.mapping.name, **est.mapping.hyperparameters)
        c = mapping.coefficients(log_ratio, env.mask, np.where(A >= 0, 1.0, -1.0))
        c = np.where(env.mask, c, 0.0)
        h = A[:, None] * np.einsum("lt,ltd->ld", c, S)  # one sample's contribution
        mean = p_mu @ h
        second_one = float(p_mu @ np.sum(h * h, axis=1))
        variance = (second_one - mean @ mean) / n
        second = mean @ mean + variance
        zero = grad_J @ grad_J
        inner = mean @ grad_J
        row = ex.table.set_index("estimator").loc[est.name]
        assert row.mse_zero == pytest.approx(zero, rel=1e-10, abs=1e-14)
        assert row.alpha_star == pytest.approx(inner / second, rel=1e-10, abs=1e-14)
        assert row.mse_scaled == pytest.approx(zero - inner**2 / second, rel=1e-10, abs=1e-14)
        assert row.rel_mse_scaled == pytest.approx(1 - inner**2 / second / zero, rel=1e-10)
        nz = (c != 0) & env.mask
        kept = (p_mu @ nz.sum(1)) / (p_mu @ env.mask.sum(1))
        assert row.kept == pytest.approx(kept, rel=1e-10)
        assert row.kept_seq == pytest.approx(p_mu @ nz.any(1), rel=1e-10)
        assert np.isnan(row.rel_mse_scaled_lo) and np.isnan(row.kept_hi)
    t = ex.table.set_index("estimator")
    assert t.loc["naive", "kept"] == 1.0 and t.loc["mis_token", "kept"] < 1.0  # a mask to see
