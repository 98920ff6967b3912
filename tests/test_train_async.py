"""Asynchronous training (TrainConfig.lag_distribution / partial_hazard / max_off_policy): the
per-token versions of partial rollouts are recorded as scheduled and their log μ is the
generating version's; drop and wait counts match a hand count of the unfiltered draw; the
drawn batch follows the exact versioned behaviour; resume and the sweep backends are bit
identical; synchronous configs are unchanged."""

import numpy as np
import pandas as pd
import pytest

from simkit import config as C
from simkit import sweep
from simkit.envs import TokenMDP
from simkit.estimators import Estimator
from simkit.train import TrainConfig, load_checkpoint, train
from simkit.train.mismatch import log_softmax
from simkit.train.rollout import (
    initial_state,
    keep_version,
    new_rollout,
    optimizer_step,
)


def small_env() -> TokenMDP:
    return TokenMDP.at_least_k(V=4, T=6, k=2, seed=1, scale=0.5)


def grpo(name: str) -> Estimator:
    return Estimator(name, advantage="grpo", group_size=4)


def _rollouts(env, cfg, seed, upto):
    """The rollouts of a run up to rollout ``upto`` (the training loop of simkit.train.core),
    with the θ kept for each version step."""
    param = cfg.parameterization_of(env)
    state = initial_state(env, cfg, param, seed)
    out = []
    N = cfg.minibatches
    while state.step < upto * N + 1:
        keep_version(state, cfg)
        if state.step % N == 0:
            state.rollout = new_rollout(env, cfg, param, state, state.step // N)
            kept = dict(zip(state.version_steps, [v.copy() for v in state.versions], strict=True))
            out.append((state.rollout, kept))
        optimizer_step(env, cfg, param, state, False, None)
        state.step += 1
    return out, param


def test_partial_rollout_versions_are_recorded_as_scheduled():
    """hazard 1: a response that starts a ages old moves to the next newer version at every
    position, so token t has age max(a − t, 0); its log μ is that version's."""
    env = small_env()
    cfg = TrainConfig(
        grpo("tis_token"),
        steps=8,
        batch=32,
        lag_distribution="uniform",
        lag_rollouts_max=2,
        partial_hazard=1.0,
        lr=0.1,
    )
    rollouts, param = _rollouts(env, cfg, seed=3, upto=4)
    seen = set()
    for ro, kept in rollouts[2:]:  # from rollout 2 on, the versions are 0, 1, 2 updates old
        age0 = ro.token_age[:, 0]
        t = np.arange(env.T)
        expected = np.maximum(age0[:, None] - t[None, :], 0)
        assert np.array_equal(ro.token_age, expected)
        seen |= set(age0.tolist())
        for a in range(3):  # log μ of every token of age a is θ_{rN − a}'s
            log_q = log_softmax(param.logits(kept[ro.index - a])).ravel()
            sel = (ro.token_age == a) & ro.mask
            np.testing.assert_array_equal(ro.log_mu_tok[sel], log_q.take(ro.flat_index[sel]))
    assert seen == {0, 1, 2}


def _counts(strategy, max_off):
    env = small_env()
    base = dict(
        estimator=grpo("tis_token"),
        steps=6,
        batch=32,
        minibatches=2,
        lag_distribution="geometric",
        lag_rollouts_max=2,
        lag_p=0.3,
        lr=0.05,
    )
    free, _ = _rollouts(env, TrainConfig(**base), seed=5, upto=2)
    cfg = TrainConfig(**base, max_off_policy=max_off, off_policy_strategy=strategy)
    filtered, _ = _rollouts(env, cfg, seed=5, upto=2)
    return free, filtered


def test_wait_count_matches_a_hand_count():
    """The same seed draws the same components: the waited count is the number of rows of
    the unfiltered rollout older than max_off_policy (ages 0, 2, 4 at N = 2), whole groups."""
    free, filtered = _counts("wait", 3)
    hand = [int((ro.token_age[:, 0] > 3).sum()) for ro, _ in free]
    assert hand[-1] > 0  # the check can fail
    assert [ro.waited for ro, _ in filtered] == hand
    assert [ro.dropped for ro, _ in filtered] == [0] * len(hand)
    for (ro_f, _), (ro, _) in zip(free, filtered, strict=True):
        assert ro.token_age.max() <= 3
        old = ro_f.token_age[:, 0] > 3  # the waited rows are trained at the oldest acceptable age
        expected = np.where(old, ro_f.token_age[:, 0].clip(max=2), ro_f.token_age[:, 0])
        assert np.array_equal(ro.token_age[:, 0], expected)


def _draw_setup(prompt_lag_p=None, strategy="drop", **kw):
    """Three versions (ages 0, 2, 4) of two prompts, 8 groups of G = 4."""
    from simkit.train.versioned import prompt_starts
    from simkit.train.worlds import as_prompts, difficulty_prompts

    envs = as_prompts(difficulty_prompts(3, 4, ks=(1, 3), seed=0))
    base = dict(
        estimator=grpo("tis_token"),
        steps=6,
        batch=32,
        minibatches=2,
        lag_distribution="geometric",
        lag_rollouts_max=2,
        lag_p=0.4,
        prompt_lag_p=prompt_lag_p,
        max_off_policy=3,
        off_policy_strategy=strategy,
    )
    base.update(kw)
    cfg = TrainConfig(**base)
    steps, starts = prompt_starts(cfg, 4, lambda r: max(2 * r, 0), 2)
    rng = np.random.default_rng(11)
    log_mus = [log_softmax(rng.normal(size=envs[0].logits.shape)) for _ in steps]
    ages = [8 - s for s in steps]
    prompt = (np.arange(32) // 4) % 2
    return envs, cfg, log_mus, ages, starts, prompt


def test_drop_evicts_whole_groups_and_refills_from_the_prompt_stream():
    """A hand count on the uniform stream: each candidate group takes one uniform u and the
    component searchsorted(cdf of its prompt, u); candidates 0 … 7 have prompts 0, 1, 0, …,
    a stale one (age 4 > 3) is evicted and its slot taken by the next candidate of the stream
    (prompt = candidate index mod 2). The dropped count is the evicted groups' rows."""
    from simkit.train.versioned import draw_versioned

    envs, cfg, log_mus, ages, starts, prompt = _draw_setup(prompt_lag_p=(0.7, 0.2))
    draw = draw_versioned(envs, prompt, cfg, log_mus, ages, starts, np.random.default_rng(5), 4)
    u = iter(np.random.default_rng(5).random(1000))
    cdf = np.cumsum(starts, axis=1)
    cdf /= cdf[:, -1:]
    slots = [(g % 2, int(cdf[g % 2].searchsorted(next(u), side="right"))) for g in range(8)]
    nxt, evicted = 8, 0
    while any(ages[c] > 3 for _, c in slots):
        stale = [i for i, (_, c) in enumerate(slots) if ages[c] > 3]
        evicted += len(stale)
        for i in stale:
            k = nxt % 2
            nxt += 1
            slots[i] = (k, -1)
        for i in stale:  # the refills' uniforms come after the round's evictions, in slot order
            k = slots[i][0]
            slots[i] = (k, int(cdf[k].searchsorted(next(u), side="right")))
    assert evicted > 0 and draw.dropped == 4 * evicted
    assert np.array_equal(draw.prompt, np.repeat([k for k, _ in slots], 4))
    assert np.array_equal(draw.token_age[:, 0], np.repeat([ages[c] for _, c in slots], 4))
    assert np.array_equal(draw.prompt_rows, np.bincount(draw.prompt, minlength=2))
    assert draw.prompt_rows.sum() == 32


def test_a_group_is_generated_together():
    """Every row of a GRPO group has the same component: start version and switch points."""
    env = small_env()
    cfg = TrainConfig(
        grpo("tis_token"),
        steps=8,
        batch=32,
        lag_distribution="uniform",
        lag_rollouts_max=2,
        partial_hazard=0.3,
        lr=0.1,
    )
    rollouts, _ = _rollouts(env, cfg, seed=3, upto=4)
    varied = set()
    for ro, _ in rollouts[2:]:
        ages = ro.token_age.reshape(8, 4, env.T)
        assert (ages == ages[:, :1]).all()
        varied |= {tuple(a) for a in ages[:, 0]}
    assert len(varied) > 1  # the check can fail: groups differ


def test_table_counts_per_rollout():
    env = small_env()
    cfg = TrainConfig(
        grpo("tis_token"),
        steps=6,
        batch=32,
        minibatches=2,
        lag_distribution="geometric",
        lag_rollouts_max=2,
        lag_p=0.3,
        max_off_policy=3,
        lr=0.05,
    )
    table = train(env, cfg, seed=5)
    _, filtered = _counts("drop", 3)
    assert table.dropped.tolist()[::2] == [ro.dropped for ro, _ in filtered]
    assert table.dropped.sum() > 0 and (table.dropped % 4 == 0).all()  # whole groups
    assert (table.prompt_rows == "16").all()  # refilled: the batch stays full
    assert (table.dropped.iloc[1::2] == 0).all() and (table.waited == 0).all()
    assert (table.policy_age_max <= 3 + 1).all()


def test_drawn_ages_follow_the_exact_lag_distribution():
    """Rollout 2 onward at N = 1, K = 2: ages 0, 1, 2 with the truncated geometric weights
    (p = 0.5: 4/7, 2/7, 1/7), checked with a z-test over the drawn rows (z < 4)."""
    env = small_env()
    cfg = TrainConfig(
        grpo("naive"),
        steps=40,
        batch=64,
        lag_distribution="geometric",
        lag_rollouts_max=2,
        lag_p=0.5,
        lr=0.01,
    )
    rollouts, _ = _rollouts(env, cfg, seed=0, upto=30)
    ages = np.concatenate([ro.token_age[:, 0] for ro, _ in rollouts[2:]])
    p = np.array([4, 2, 1]) / 7
    for a in range(3):
        frac = np.mean(ages == a)
        se = np.sqrt(p[a] * (1 - p[a]) / ages.size)
        assert abs(frac - p[a]) < 4 * se


def async_config(**kw) -> TrainConfig:
    base = dict(
        estimator=grpo("tis_token"),
        steps=14,
        batch=16,
        minibatches=2,
        lag=1,
        lag_distribution="geometric",
        lag_rollouts_max=2,
        lag_p=0.5,
        partial_hazard=0.2,
        max_off_policy=5,
        lr=0.05,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_interrupted_async_run_resumes_to_the_uninterrupted_table(tmp_path):
    env = small_env()
    cfg = async_config()
    memory = train(env, cfg, seed=4)
    assert memory.dropped.sum() > 0 and memory.policy_age_max.max() > memory.staleness.max()
    whole = train(env, cfg, seed=4, out_dir=tmp_path / "whole", chunk_steps=3)
    pd.testing.assert_frame_equal(whole, memory, check_exact=True)
    part = tmp_path / "part"
    first = train(env, cfg, seed=4, out_dir=part, chunk_steps=3, stop_after=9)  # mid-rollout
    assert len(first) == 9 and load_checkpoint(part)[0] == 9
    resumed = train(env, cfg, seed=4, out_dir=part, chunk_steps=3)
    pd.testing.assert_frame_equal(resumed, whole, check_exact=True)


ASYNC_SWEEP = {
    "kind": "train",
    "name": "async",
    "environment": {
        "kind": "token_mdp",
        "constructor": "at_least_k",
        "V": 3,
        "T": [4],
        "kwargs": {"k": 2},
    },
    "steps": 6,
    "minibatch_size": 16,
    "minibatches": [1, 2],
    "lag_distribution": "uniform",
    "lag_rollouts_max": 2,
    "max_off_policy": 2,
    "off_policy_strategy": "wait",
    "estimators": [{"mapping": "tis_token", "advantages": ["grpo"], "group_size": 4}],
}


def test_async_sweep_serial_and_processes_are_identical(tmp_path):
    cfg = C.config_from_dict(ASYNC_SWEEP)
    assert C.config_from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["off_policy_strategy"] == "wait"
    serial = sweep.run_config(cfg, progress=False)
    procs = sweep.run_config(cfg, progress=False, backend="processes", workers=2)
    pd.testing.assert_frame_equal(serial, procs, check_exact=True)
    assert serial.waited.sum() > 0


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_filter_above_every_age_is_todays_run_bit_for_bit(strategy):
    """A fixed lag with max_off_policy at the lag drops / waits for nothing: the run equals
    the synchronous-lag run bit for bit (mismatch on, a difficulty-mixed prompt set)."""
    from simkit.train.mismatch import Mismatch
    from simkit.train.worlds import difficulty_prompts

    env = difficulty_prompts(4, 5, ks=(1, 2, 3), seed=0)
    base = dict(
        estimator=grpo("tis_token"),
        steps=9,
        batch=24,
        minibatches=3,
        lag_updates=2,
        lr=0.1,
        mismatch=Mismatch(logit_noise=0.05, precision="bf16"),
    )
    today = train(env, TrainConfig(**base), seed=3)
    filtered = train(
        env,
        TrainConfig(**base, max_off_policy=2, off_policy_strategy=strategy),
        seed=3,
    )
    pd.testing.assert_frame_equal(filtered, today, check_exact=True)


def test_loglinear_old_in_training():
    """old_logp='loglinear': o = α·ℓ with α = a/(a + j + 1) from each token's age; on-policy
    (N = 1, no lag, no mismatch) it is the recomputed π_old bit for bit (ℓ = o = 0)."""
    from simkit.train.rollout import old_log_ratio_of

    env = small_env()
    composed = Estimator("ppo_clip", correction="tis_token", advantage="grpo", group_size=4)
    on = dict(estimator=composed, steps=5, batch=16, lr=0.1)
    a = train(env, TrainConfig(**on), seed=2)
    b = train(env, TrainConfig(**on, old_logp="loglinear"), seed=2)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    cfg = async_config(estimator=composed, old_logp="loglinear", partial_hazard=0.0)
    (ro, _), *_ = _rollouts(env, cfg, seed=1, upto=3)[0][2:]
    rows = slice(8, 16)  # mini-batch j = 1
    mask = ro.mask[rows]
    lr = np.where(mask, 0.3, 0.0)  # any log-ratio
    age = ro.token_age[rows]
    got = old_log_ratio_of(cfg, ro, rows, 1, lr, mask)
    np.testing.assert_allclose(got, np.where(mask, age / (age + 2.0) * 0.3, 0.0), rtol=1e-15)
    assert (age > 0).any()
    recompute = old_log_ratio_of(async_config(), ro, rows, 1, lr, mask)
    np.testing.assert_array_equal(
        recompute, np.where(mask, ro.log_old_tok[rows] - ro.log_mu_tok[rows], 0.0)
    )
    assert train(env, cfg, seed=1).J.notna().any()


def test_synchronous_config_dicts_are_unchanged():
    d = TrainConfig(grpo("naive"), steps=3, batch=8).to_dict()
    assert not {"lag_distribution", "partial_hazard", "max_off_policy"} & set(d)
    assert TrainConfig.from_dict(async_config().to_dict()) == async_config()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lag_distribution": "poisson", "lag_rollouts_max": 1}, "lag_distribution"),
        ({"lag_distribution": "geometric"}, "lag_rollouts_max"),
        ({"lag_rollouts_max": 2}, "lag_rollouts_max"),
        ({"partial_hazard": 0.5}, "partial_hazard"),
        ({"partial_hazard": 1.5}, "partial_hazard"),
        ({"max_off_policy": 1, "lag_updates": 3}, "max_off_policy"),
        ({"off_policy_strategy": "skip"}, "off_policy_strategy"),
        ({"old_logp": "linear"}, "old_logp"),
        (
            {
                "lag_distribution": "uniform",
                "lag_rollouts_max": 1,
                "partial_hazard": 0.2,
                "max_off_policy": 1,
                "off_policy_strategy": "wait",
            },
            "wait",
        ),
    ],
)
def test_bad_async_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(grpo("naive"), steps=3, batch=8, **kwargs)


def test_record_logp_with_one_version_agrees_bit_for_bit():
    """max_off_policy at a fixed lag: one version through the versioned path; the true, the
    start and the assumed version are then the same table bit for bit."""
    from simkit.train.worlds import difficulty_prompts

    env = difficulty_prompts(4, 5, ks=(1, 3), seed=0)
    base = dict(
        estimator=Estimator("ppo_clip", correction="tis_token", advantage="grpo", group_size=4),
        steps=6,
        batch=16,
        minibatches=2,
        lag_updates=2,
        max_off_policy=2,
        old_logp="loglinear",
        lr=0.1,
    )
    true = train(env, TrainConfig(**base), seed=1)
    for record in ("start", "assumed"):
        other = train(env, TrainConfig(**base, record_logp=record), seed=1)
        pd.testing.assert_frame_equal(other, true, check_exact=True)


def test_record_logp_records_the_assumed_or_start_version():
    """Partial rollouts (hazard 1): the same draw, log μ recorded from the generating version
    (true), the version of the response's first token (start) or the rollout's newest
    version (assumed), and the loglinear α reads the recorded age."""
    from simkit.train.rollout import old_log_ratio_of

    env = small_env()
    base = dict(
        estimator=grpo("tis_token"),
        steps=8,
        batch=32,
        lag_distribution="uniform",
        lag_rollouts_max=2,
        partial_hazard=1.0,
        lr=0.1,
    )
    for r in RECORDS:
        out, param = _rollouts(env, TrainConfig(**base, record_logp=r), 3, 3)
        ro, kept = out[2]
        logq = {a: log_softmax(param.logits(kept[ro.index - a])).ravel() for a in range(3)}
        if r == "true":
            rec_age = ro.token_age
        elif r == "start":
            rec_age = np.repeat(ro.token_age[:, :1], env.T, axis=1)
        else:
            rec_age = np.zeros_like(ro.token_age)
        assert np.array_equal(ro.recorded_age, rec_age)
        assert r == "true" or (rec_age != ro.token_age)[ro.mask].any()  # the check can fail
        for a in range(3):
            sel = (rec_age == a) & ro.mask
            np.testing.assert_array_equal(ro.log_mu_tok[sel], logq[a].take(ro.flat_index[sel]))
        cfg = TrainConfig(**base, record_logp=r, old_logp="loglinear")
        lr = np.where(ro.mask, 0.3, 0.0)
        got = old_log_ratio_of(cfg, ro, slice(None), 0, lr, ro.mask)
        np.testing.assert_allclose(got, np.where(ro.mask, rec_age / (rec_age + 1.0) * 0.3, 0.0))


RECORDS = ("true", "start", "assumed")


def test_drop_starves_slow_prompts_in_training():
    """prompt_lag_p = (0.8, 0.2): the hard prompt's groups are old more often. Keep and wait
    train every prompt's groups (8 + 8 rows per rollout exactly); drop trains fewer rows of the
    hard prompt (mean share below 1/2 by more than 4 SE over the rollouts)."""
    from simkit.train import prompt_rows
    from simkit.train.worlds import difficulty_prompts

    env = difficulty_prompts(4, 5, ks=(1, 3), seed=0)
    base = dict(
        estimator=grpo("tis_token"),
        steps=30,
        batch=16,
        lag_distribution="geometric",
        lag_rollouts_max=3,
        lag_p=0.5,
        prompt_lag_p=(0.8, 0.2),
        lr=0.05,
    )
    keep = prompt_rows(train(env, TrainConfig(**base), seed=2))
    wait = prompt_rows(
        train(env, TrainConfig(**base, max_off_policy=1, off_policy_strategy="wait"), seed=2)
    )
    assert (keep == 8).all() and (wait == 8).all()
    table = train(env, TrainConfig(**base, max_off_policy=1), seed=2)
    drop = prompt_rows(table)
    assert (drop.sum(axis=1) == 16).all() and table.dropped.sum() > 0
    share = drop[3:, 1] / 16  # from rollout 3 on every age is reachable
    assert 0.5 - share.mean() > 4 * share.std(ddof=1) / np.sqrt(share.size)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"record_logp": "belief"}, "record_logp"),
        ({"prompt_lag_p": (0.5,)}, "prompt_lag_p"),  # needs a geometric lag law
        (
            {"lag_distribution": "geometric", "lag_rollouts_max": 1, "prompt_lag_p": (0.5, 0)},
            "prompt_lag_p",
        ),
    ],
)
def test_bad_prompt_lag_and_record_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(grpo("naive"), steps=3, batch=8, **kwargs)


def test_prompt_lag_p_round_trips_and_must_match_the_prompts():
    from simkit.train.worlds import difficulty_prompts

    cfg = async_config(lag_distribution="geometric", prompt_lag_p=[0.8, 0.2], record_logp="start")
    assert cfg.prompt_lag_p == (0.8, 0.2)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    env = difficulty_prompts(4, 5, ks=(1, 2, 3), seed=0)
    with pytest.raises(ValueError, match="prompt_lag_p"):
        train(env, async_config(prompt_lag_p=(0.5, 0.5), batch=24, minibatches=2), seed=0)


def test_sweep_takes_prompt_lag_p_and_record_logp(tmp_path):
    d = {
        **ASYNC_SWEEP,
        "lag_distribution": "geometric",
        "prompt_lag_p": [0.5],
        "record_logp": "assumed",
        "steps": 4,
    }
    cfg = C.config_from_dict(d)
    assert cfg.to_dict()["prompt_lag_p"] == [0.5] and cfg.to_dict()["record_logp"] == "assumed"
    assert C.config_from_dict(cfg.to_dict()) == cfg
    table = sweep.run_config(cfg, progress=False)
    assert set(table.prompt_rows) == {"16"}
