import numpy as np, pandas as pd
from simkit.envs import TokenMDP
from simkit.estimators import Estimator
from simkit import mappings
from simkit.train import TrainConfig, Mismatch, train
from simkit.train.recipes import recipe

def cases():
    env = TokenMDP.at_least_k(V=4, T=6, k=2, seed=1, scale=0.5)
    env_eos = TokenMDP.at_least_k(V=4, T=6, k=2, eos=3, seed=1, scale=0.5)
    yield "grpo_N4_lag2", env, TrainConfig(recipe("grpo", 4), steps=24, batch=32, minibatches=4, lag=2, lr=0.3, record_every=3)
    yield "vespo_eos_mism", env_eos, TrainConfig(recipe("vespo", 4), steps=16, batch=16, minibatches=2, lag=1, lr=0.1,
        mismatch=Mismatch(logit_noise=0.1, precision="bf16", spike_prob=0.2, spike_strength=4.0), max_grad_norm=1.0)
    yield "tis_sgd_exact", env, TrainConfig(recipe("tis", 4), steps=10, batch=8, optimizer="sgd", lr=0.5, gradient="exact")
    yield "mis_N2", env_eos, TrainConfig(recipe("mis", 4), steps=12, batch=16, minibatches=2, lr=0.2)

frames = []
for name, env, cfg in cases():
    t = train(env, cfg, seed=5)
    t.insert(0, "case", name)
    frames.append(t)
pd.concat(frames, ignore_index=True).to_parquet("tests/data/train_tabular_reference.parquet", index=False)
print(pd.concat(frames).groupby("case").J.last())
