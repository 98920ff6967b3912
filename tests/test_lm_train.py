"""simkit.lm.train: RL training of the tiny Llama with the simulator's schedule (issue 16 §6)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from simkit.lm.models import tiny_llama
from simkit.lm.train import LMTrainConfig, train_lm


def model():
    return tiny_llama(
        vocab_size=8,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        seed=0,
        init_std=0.3,
    )


def params(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])


@pytest.mark.parametrize("mapping", ["ppo_clip", "tis_token", "vespo", "gspo", "sapo", "mis_seq"])
def test_first_update_with_N1_is_reinforce(mapping):
    cfg = dict(steps=1, minibatch_size=16, lr=0.05, response_length=3, eval_samples=4)
    ref = model()
    train_lm(ref, LMTrainConfig(mapping="naive", **cfg), seed=3)
    m = model()
    table = train_lm(m, LMTrainConfig(mapping=mapping, **cfg), seed=3)
    assert table["max_abs_log_ratio"].iloc[0] == 0.0  # μ's log-probs are π's, exactly
    moved = (params(ref) - params(model())).abs().max()
    assert moved > 1e-3
    torch.testing.assert_close(params(m), params(ref), rtol=0, atol=1e-6)


def small(**kw):
    base = dict(
        mapping="ppo_clip",
        steps=6,
        minibatches=2,
        minibatch_size=8,
        lag=1,
        lr=0.05,
        response_length=4,
        eval_every=3,
        eval_samples=8,
        precision="bf16",
        temperature=0.9,
    )
    base.update(kw)
    return LMTrainConfig(**base)


def test_reproducible_and_stale_minibatches_are_off_policy():
    a = train_lm(model(), small(), seed=1)
    b = train_lm(model(), small(), seed=1)
    pd.testing.assert_frame_equal(a, b)
    assert (a.loc[a.minibatch == 1, "max_abs_log_ratio"] > 0).all()
    assert a["recorded"].sum() == 3 and a["J_se"].notna().sum() == 3
    c = train_lm(model(), small(), seed=2)
    assert not a["reward_mean"].equals(c["reward_mean"])


def test_resume_gives_the_uninterrupted_run(tmp_path):
    full_model = model()
    full = train_lm(full_model, small(), seed=0)
    part = model()
    train_lm(part, small(), seed=0, out_dir=tmp_path, stop_after=4)
    resumed_model = model()  # a fresh process: weights come from the checkpoint
    resumed = train_lm(resumed_model, small(), seed=0, out_dir=tmp_path)
    pd.testing.assert_frame_equal(resumed, full)
    torch.testing.assert_close(params(resumed_model), params(full_model), rtol=0, atol=0)
    with pytest.raises(ValueError, match="another LM training run"):
        train_lm(model(), small(lr=0.1), seed=0, out_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mapping="nope"), "mapping must be one of"),
        (dict(minibatch_size=6, group_size=4), "multiple of group_size"),
        (dict(precision="fp8"), "precision"),
        (dict(temperature=0.0), "temperature"),
        (dict(correction="nope"), "correction must be None or one of"),
        (dict(mode="hybrid"), "mode must be"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LMTrainConfig(**kwargs)


def test_decoupled_ppo_tis_first_update_is_reinforce_and_it_differs_under_lag():
    cfg = dict(steps=1, minibatch_size=16, lr=0.05, response_length=3, eval_samples=4)
    ref = model()
    train_lm(ref, LMTrainConfig(mapping="naive", **cfg), seed=3)
    m = model()
    train_lm(m, LMTrainConfig(mapping="ppo_clip", correction="tis_token", **cfg), seed=3)
    torch.testing.assert_close(params(m), params(ref), rtol=0, atol=1e-6)
    a = train_lm(model(), small(correction="tis_token"), seed=1)
    b = train_lm(model(), small(), seed=1)
    assert not a["loss"].equals(b["loss"])  # the correction acts on π_old/μ


def test_bypass_training_runs_and_its_first_update_is_reinforce():
    """mode 'bypass' (π_old := μ): the trainer passes log μ as old_log_prob and no
    rollout_log_prob; on-policy the first update of naive × is_seq and of PPO × TIS
    (allow_same_ratio) is REINFORCE's."""
    cfg = dict(steps=1, minibatch_size=16, lr=0.05, response_length=3, eval_samples=4)
    ref = model()
    train_lm(ref, LMTrainConfig(mapping="naive", **cfg), seed=3)
    for kw in (
        dict(mapping="naive", correction="is_seq"),
        dict(mapping="ppo_clip", correction="tis_token", allow_same_ratio=True),
    ):
        m = model()
        train_lm(m, LMTrainConfig(mode="bypass", **kw, **cfg), seed=3)
        torch.testing.assert_close(params(m), params(ref), rtol=0, atol=1e-6)
    a = train_lm(model(), small(mapping="naive", correction="geo_mask", mode="bypass"), seed=1)
    b = train_lm(model(), small(mapping="naive"), seed=1)
    assert not a["loss"].equals(b["loss"])  # the mask acts on π/μ under lag


def test_generators_are_built_on_the_models_device(monkeypatch):
    """Every generator of a run (rollouts and held-out evaluations) is created on the device of
    the model's parameters, so that ``torch.multinomial`` can use it there (CPU here)."""
    import simkit.lm.train as lm_train

    devices = []

    class Recording(torch.Generator):
        def __new__(cls, device="cpu"):
            devices.append(torch.device(device))
            return super().__new__(cls, device=device)

    m = model()  # (its initialisation uses a generator of its own)
    monkeypatch.setattr(lm_train.torch, "Generator", Recording)
    table = train_lm(m, small(steps=4), seed=1)
    assert devices and all(d == torch.device("cpu") for d in devices)
    assert len(devices) == 1 + table["recorded"].sum()  # one rollout stream + one per J


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (none lent to this project so far; GPU runs not recorded)",
)
def test_cuda_run_is_reproducible_and_resumes(tmp_path):
    """On CUDA: a run reproduces itself from its seed and resumes after a stop (its stream is
    CUDA's, so its table differs from the CPU one)."""
    a = train_lm(model().to("cuda"), small(), seed=1)
    b = train_lm(model().to("cuda"), small(), seed=1)
    pd.testing.assert_frame_equal(a, b)
    train_lm(model().to("cuda"), small(), seed=1, out_dir=tmp_path, stop_after=4)
    resumed = train_lm(model().to("cuda"), small(), seed=1, out_dir=tmp_path)
    pd.testing.assert_frame_equal(resumed, a)


def test_exact_presence_J_equals_the_enumeration_of_every_response():
    """J(π) by the target-free responses = Σ over all V^T responses of π(y|x)·1{target ∈ y},
    the probabilities written here from a forward pass of every full response (V = 8, T = 3;
    the 512 responses of a prompt as the rows of one batch). The model runs in float64 but
    transformers' LlamaRMSNorm normalises in float32, so forward passes of other batch shapes
    differ by ~1e-9 relative: tolerance 1e-7 (a wrong response set or a shifted position moves
    J by > 1e-3)."""
    import itertools

    from simkit.lm.tasks import TokenTask
    from simkit.lm.train import exact_presence_J

    m = model().double()
    prompts = TokenTask(8, 1, 3, 3, seed=1).prompt_ids()
    responses = torch.tensor(list(itertools.product(range(8), repeat=3)))  # (512, 3)
    total = 0.0
    with torch.no_grad():
        for x in prompts:
            ids = torch.cat([torch.tensor(x).expand(len(responses), -1), responses], dim=1)
            lp = torch.log_softmax(m(ids).logits.double(), dim=-1)  # (512, len(x) + 3, V)
            at = lp[:, len(x) - 1 : len(x) + 2]  # the positions that predict y_1, y_2, y_3
            logp = at.gather(2, responses[:, :, None])[..., 0].sum(dim=1)
            total += float((logp.exp() * (responses == 1).any(dim=1)).sum())
    expected = total / len(prompts)
    assert exact_presence_J(m, prompts, 1, 3) == pytest.approx(expected, rel=1e-7, abs=0)


def test_exact_J_column_and_gradient_clipping():
    cfg = dict(steps=3, minibatch_size=8, lr=0.05, response_length=2, eval_every=1)
    table = train_lm(model(), LMTrainConfig(exact_J=True, **cfg), seed=0)
    assert (table["J_se"] == 0).all() and table["J"].between(0, 1).all()
    # a tiny clip norm: the first update moves θ by at most lr per coordinate (Adam) — and
    # clipping changes the run versus no clipping
    clipped = model()
    train_lm(clipped, LMTrainConfig(max_grad_norm=1e-6, **cfg), seed=0)
    free = model()
    train_lm(free, LMTrainConfig(**cfg), seed=0)
    assert not torch.equal(params(clipped), params(free))
    with pytest.raises(ValueError, match="max_grad_norm"):
        LMTrainConfig(max_grad_norm=0.0)


def test_bypass_double_count_is_refused():
    with pytest.raises(ValueError, match="'ppo_clip' and correction 'tis_token'"):
        LMTrainConfig(mapping="ppo_clip", correction="tis_token", mode="bypass")
    LMTrainConfig(mapping="ppo_clip", correction="tis_token", mode="bypass", allow_same_ratio=True)
    LMTrainConfig(mapping="naive", correction="tis_token", mode="bypass")
    LMTrainConfig(mapping="ppo_clip", correction="tis_token", mode="decoupled")
