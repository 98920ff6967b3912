"""The sweep tables of ``configs/quick.toml`` and ``configs/train_quick.toml`` are bit-identical
to tables saved before the configuration code was refactored (issue 14).

Provenance: ``tests/data/quick_reference.parquet`` and ``tests/data/train_quick_reference.parquet``
were written by ``run_cell`` over ``expand(load_config(...))`` (serial, every cell in expansion
order, the ``simkit_version`` column dropped) with the configuration code *before* the pydantic
refactor: ``train_quick`` at commit db15e9a, ``quick`` on main at 1d2fb07 (after issue 12's
BASELINE change, oracle = R − J(μ), and the ``params`` column) and rewritten at the merge of
main into ``arch`` after 95ca35c, whose only changes to that table are issue 12's ``reliable`` and
``tail_draws`` columns and its k̂ (NaN where no Pareto tail can be fitted); every other column,
the ``cell`` keys included, was bit-identical to 1d2fb07's table. They include the ``cell``
column, so the cell keys (content hashes of every cell's parameters) are checked too.

``train_quick``'s table was updated at issue 23 (lag counted in optimizer updates): the
``cell`` keys changed because the training configuration gained the ``lag_updates`` field, and
the columns ``lag_updates``, ``policy_age_min`` / ``_mean`` / ``_max`` were appended; every
saved value of the other columns was kept and still matches to rounding.

The default advantage of both configs is ``"oracle"`` as it was in main at that commit. When the
meaning of an advantage, an estimator or an environment changes on purpose (for example issue
12's ``oracle`` / ``oracle_pi`` split), these tables change with it: regenerate them with
``python tests/test_config_reference.py`` on the new main and say so in the commit message.

Bit-identity holds on the CPU type that wrote the tables. numpy dispatches ``exp``, ``log``,
``pow`` and its pairwise sums to SIMD kernels chosen by the CPU, so another machine type gives
the same table to float rounding only (measured on an AMD EPYC against the saved tables:
quantities that are zero in exact arithmetic differ at 1e-17, e.g. a bias of 4.885e-17 vs
4.996e-17). The test therefore compares every non-float column (cell keys, names, flags)
exactly and every float column to ``rtol = 1e-9``, ``atol = 1e-12`` — far below any change of
meaning, far above rounding.

Columns added since the tables were saved are listed in :data:`ADDED` (issue 22: the scale-free
error ``mse_zero`` … ``rel_mse_scaled``, the kept fractions and the planner's ``method`` /
``why_mc``, with their bounds; issue 26: the training table's ``dropped`` / ``waited`` counts of
the ``max_off_policy`` filter and the per-prompt rows ``prompt_rows``); the saved columns must
still come in the same order with the same values, and the added ones must be exactly those
listed.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from simkit.config import expand, load_config, run_cell

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
NAMES = ("quick", "train_quick")
#: columns of the experiment table added after the reference was saved (issue 22)
ADDED = {
    "quick": (
        *(
            f"{k}{s}"
            for k in ("mse_scaled", "rel_mse_scaled", "kept", "kept_seq")
            for s in ("", "_lo", "_hi")
        ),
        "mse_zero",
        "alpha_star",
        "method",
        "why_mc",
    ),
    # issue 26: samples dropped / waited for per rollout by the max_off_policy filter (0 here),
    # and the rows of each mini-batch per prompt (the coverage of drop vs keep vs wait)
    "train_quick": ("dropped", "waited", "prompt_rows"),
}


def _table(name: str) -> pd.DataFrame:
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    table = pd.concat([run_cell(c) for c in expand(cfg)], ignore_index=True)
    return table.drop(columns=["simkit_version"])


@pytest.mark.parametrize("name", NAMES)
def test_sweep_table_is_bit_identical_to_the_saved_reference(name):
    saved = pd.read_parquet(DATA / f"{name}_reference.parquet")
    table = _table(name)
    added = [c for c in table.columns if c not in saved.columns]
    assert sorted(added) == sorted(ADDED[name])
    assert_equal_to_rounding(table.drop(columns=added), saved)


def assert_equal_to_rounding(table: pd.DataFrame, saved: pd.DataFrame) -> None:
    """Non-float columns exactly, float columns to rounding (see the module docstring)."""
    assert list(table.columns) == list(saved.columns)
    assert len(table) == len(saved)
    for col in saved.columns:
        exact = not pd.api.types.is_float_dtype(saved[col])
        pd.testing.assert_series_equal(
            table[col], saved[col], check_exact=exact, rtol=1e-9, atol=1e-12, obj=col
        )


if __name__ == "__main__":  # regenerate the references (see the module docstring)
    for name in NAMES:
        _table(name).to_parquet(DATA / f"{name}_reference.parquet", index=False)
        print("wrote", DATA / f"{name}_reference.parquet")
