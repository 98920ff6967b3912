"""Regenerate ``train_tabular_reference.parquet``: the tables of the tabular trainer for the
cases of ``tests/test_train_params.py::reference_cases`` (seed 5). It was written by the
trainer *before* the parameterisations existed; rerun only to re-baseline deliberately.

    PYTHONPATH=. python tests/data/make_train_reference.py
"""

import importlib.util
from pathlib import Path

import pandas as pd

from simkit.train import TrainConfig, train

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("cases", HERE.parent / "test_train_params.py")
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)

frames = []
for name, env, kw, extra in cases.reference_cases():
    table = train(env, TrainConfig(**kw, **extra), seed=5)
    table.insert(0, "case", name)
    frames.append(table)
pd.concat(frames, ignore_index=True).to_parquet(
    HERE / "train_tabular_reference.parquet", index=False
)
