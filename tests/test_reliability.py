"""Issue 13: nothing lost, nothing half-written, every bad input named.

One test (or a few) per case of the issue: concurrent sweeps on a new directory (§1), torn
shards on resume (§2), ``simkit report`` on a torn shard and a torn training checkpoint (§3),
unusable ``--out`` before any work (§4), sizes that cannot fit (§5), NaN/inf log-ratios and
advantages in every mapping (§6, a property test over the registry), messages naming what the
user typed (§7), the README's column name (§8). The file-system cases run ``simkit`` in real
processes on real files; each checks the message names the problem and that no file is left
half-written (no temporary file, every shard readable).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import bandit_toml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkit import _memory, divergence, mappings, sweep
from simkit.envs import TokenMDP

ROOT = Path(__file__).resolve().parents[1]


def tiny_toml(seed: int = 0) -> str:
    """A tiny bandit sweep (two behaviours, naive and sequence IS) with ``seed``."""
    return bandit_toml("tiny", seed=seed, targets=(0.1, 0.5))


#: a single training run small enough for a subprocess test (12 steps, chunks of 4)
TRAIN_ARGS = [
    "train", "--env", "iid", "--V", "4", "--T", "4", "--recipe", "tis", "--minibatch-size",
    "8", "--steps", "12", "--chunk-steps", "4", "--no-progress",
]  # fmt: skip


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MPLBACKEND"] = "Agg"
    env.update(extra)
    return env


def simkit(*args, timeout=300, **env) -> subprocess.CompletedProcess:
    """``python -m simkit ARGS`` in a real process (text output)."""
    return subprocess.run(
        [sys.executable, "-m", "simkit", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
        cwd=ROOT,
        check=False,
    )


def one_line_error(proc, *fragments) -> str:
    """The process failed with exit status 2 and one ``simkit: error:`` line naming
    ``fragments``; no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("simkit: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def assert_nothing_half_written(directory: Path) -> None:
    """No temporary file anywhere under ``directory``; every parquet file reads back."""
    temporaries = [p for p in directory.rglob("*") if ".tmp-" in p.name]
    assert not temporaries, temporaries
    for path in directory.rglob("*.parquet"):
        pd.read_parquet(path)


def tiny_config(tmp_path: Path, seed: int = 0, name: str = "tiny.toml") -> Path:
    path = tmp_path / name
    path.write_text(tiny_toml(seed), encoding="utf-8")
    return path


# --- §1 two sweeps started together on a new directory ---------------------------------------

RACER = textwrap.dedent(
    """
    import pathlib, sys, time
    from simkit.sweep import SweepError, run_sweep

    config, out, me, other = sys.argv[1:5]

    # widen the window between "the directory does not exist yet" and the creation of its
    # files, as a slow disk would: without the lock around check-and-write, both processes
    # pass the check and write their config.toml in turn
    _mkdir = pathlib.Path.mkdir
    def slow_mkdir(self, *args, **kwargs):
        if self == pathlib.Path(out):
            time.sleep(0.3)
        return _mkdir(self, *args, **kwargs)
    pathlib.Path.mkdir = slow_mkdir

    pathlib.Path(me).touch()  # a barrier: both processes start run_sweep together
    while not pathlib.Path(other).exists():
        time.sleep(0.0005)
    try:
        run_sweep(config, out, progress=False)
    except SweepError as err:
        print(err)
        sys.exit(3)
    """
)


def test_concurrent_sweeps_on_a_new_directory_cannot_both_write_the_config(tmp_path):
    configs = [tiny_config(tmp_path, seed=s, name=f"c{s}.toml") for s in (1, 2)]
    for trial in range(3):
        out = tmp_path / f"race{trial}"
        flags = [tmp_path / f"ready{trial}-{i}" for i in (0, 1)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, configs[i], out, flags[i], flags[1 - i]],
                env=_env(),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in (0, 1)
        ]
        results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
        codes = [r[0] for r in results]
        assert sorted(codes) == [0, 3], results
        winner = codes.index(0)
        loser_message = results[1 - winner][1]
        assert "in use by another running sweep" in loser_message or (
            "different config" in loser_message
        ), loser_message
        # the directory holds the winner's config, and its complete table
        assert (out / "config.toml").read_text() == configs[winner].read_text()
        table = sweep.load_results(out)
        expected = sweep.run_config(configs[winner], progress=False)
        pd.testing.assert_frame_equal(table, expected, check_exact=True)
        assert_nothing_half_written(out)


# --- §2 torn shards are recomputed on resume --------------------------------------------------


def test_resume_recomputes_truncated_and_zeroed_shards(tmp_path):
    config = tiny_config(tmp_path)
    out = tmp_path / "run"
    first = simkit("sweep", config, "--out", out, "--no-progress")
    assert first.returncode == 0, first.stderr
    table = sweep.load_results(out)
    shards = sorted((out / "cells").glob("*.parquet"))
    assert len(shards) == 4
    truncated, zeroed = shards[0], shards[2]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    zeroed.write_bytes(b"")
    with pytest.raises(sweep.DamagedShardError, match=re.escape(truncated.name)):
        sweep.load_results(out)

    resumed = simkit("sweep", config, "--out", out, "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "2 damaged shard(s)" in resumed.stderr
    assert str(truncated) in resumed.stderr and str(zeroed) in resumed.stderr
    assert "2 done before, 2 ran" in resumed.stderr
    pd.testing.assert_frame_equal(sweep.load_results(out), table, check_exact=True)
    assert_nothing_half_written(out)

    # a shard holding another cell's rows, or missing a row, is not accepted either
    shards[1].write_bytes(shards[3].read_bytes())
    one = pd.read_parquet(shards[0])
    one.iloc[:1].to_parquet(shards[0], index=False)
    summary = sweep.run_sweep(config, out, progress=False)
    assert set(summary.damaged) == {str(shards[0]), str(shards[1])} and summary.ran == 2
    pd.testing.assert_frame_equal(sweep.load_results(out), table, check_exact=True)
    assert sweep.run_sweep(config, out, progress=False).done_before == 4  # intact: all kept


# --- §3 report on a torn shard, a torn training checkpoint ------------------------------------


def test_report_on_a_torn_shard_names_the_file_and_resume_recovers(tmp_path):
    config = tiny_config(tmp_path)
    out = tmp_path / "run"
    assert simkit("sweep", config, "--out", out, "--no-progress").returncode == 0
    shard = sorted((out / "cells").glob("*.parquet"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    proc = simkit("report", out)
    one_line_error(proc, str(shard), "damaged", "re-run")
    assert not (out / "results.parquet").exists() and not (out / "results.csv").exists()
    assert simkit("sweep", config, "--out", out, "--no-progress").returncode == 0
    proc = simkit("report", out)
    assert proc.returncode == 0, proc.stderr
    assert len(pd.read_parquet(out / "results.parquet")) == 8
    assert_nothing_half_written(out)


def test_torn_training_checkpoint_is_named_and_the_run_recovers(tmp_path):
    from simkit.train.core import DamagedCheckpointError, load_run

    whole = simkit(*TRAIN_ARGS, "--out", tmp_path / "whole", "--table", tmp_path / "whole.parquet")
    assert whole.returncode == 0, whole.stderr
    reference = pd.read_parquet(tmp_path / "whole.parquet")

    for damage in ("last", "both"):
        out = tmp_path / f"run-{damage}"
        part = simkit(*TRAIN_ARGS, "--out", out, "--stop-after", "8")
        assert part.returncode == 0, part.stderr
        checkpoint = out / "checkpoint.npz"
        checkpoint.write_bytes(checkpoint.read_bytes()[:200])  # torn: zipfile.BadZipFile before
        if damage == "both":
            (out / "checkpoint-previous.npz").write_bytes(b"")
        with pytest.raises(DamagedCheckpointError, match=r"checkpoint\.npz is damaged"):
            load_run(out)
        table = tmp_path / f"{damage}.parquet"
        resumed = simkit(*TRAIN_ARGS, "--out", out, "--table", table)
        assert resumed.returncode == 0, resumed.stderr
        assert "BadZipFile" in resumed.stderr and str(checkpoint) in resumed.stderr
        if damage == "last":
            assert "resuming from the previous checkpoint (step 4)" in resumed.stderr
        else:
            assert "restarts from step 0" in resumed.stderr
        pd.testing.assert_frame_equal(pd.read_parquet(table), reference, check_exact=True)
        pd.testing.assert_frame_equal(load_run(out), reference, check_exact=True)
        assert_nothing_half_written(out)


def test_tables_written_by_the_commands_are_never_half_written(tmp_path, monkeypatch):
    """``simkit run --out``, ``simkit train --table``, ``simkit report`` write through
    :func:`simkit.sweep.write_table`: a write that dies midway leaves the previous file."""
    table = pd.DataFrame({"cell": ["a", "b"], "x": [1.0, 2.0]})
    for name in ("t.parquet", "t.csv"):
        path = tmp_path / name
        sweep.write_table(table, path)
        before = path.read_bytes()

        def dies(self, *args, **kwargs):
            fh = args[0] if args else kwargs.get("path")
            if hasattr(fh, "write"):
                fh.write(b"partial")
            raise OSError("disk full")

        with monkeypatch.context() as m:
            m.setattr(pd.DataFrame, "to_parquet", dies)
            m.setattr(
                pd.DataFrame,
                "to_csv",
                lambda self, *a, **k: (_ for _ in ()).throw(OSError("disk full")),
            )
            with pytest.raises(OSError, match="disk full"):
                sweep.write_table(table.assign(x=[3.0, 4.0]), path)
        assert path.read_bytes() == before
        assert_nothing_half_written(tmp_path)


# --- §4 --out checked before any work ---------------------------------------------------------


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory in which no file can be created: permission bits for a normal user; for
    root (who ignores them) /proc, where even root cannot create a file."""
    if os.name == "posix" and os.geteuid() != 0:
        d = tmp_path / "readonly"
        d.mkdir()
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
    elif Path("/proc").is_dir():
        yield Path("/proc")
    else:  # pragma: no cover - neither a normal user nor Linux
        pytest.skip("no directory is unwritable for this user on this system")


def _bad_outputs(tmp_path, unwritable_dir):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    return {
        "existing file": (a_file, "is an existing file"),
        "under a file": (a_file / "sub", "is a file"),
        "unwritable": (unwritable_dir / "simkit-out", "cannot write in"),
    }


@pytest.mark.parametrize("case", ["existing file", "under a file", "unwritable"])
def test_out_that_cannot_be_written_fails_before_any_work(tmp_path, unwritable_dir, case):
    out, why = _bad_outputs(tmp_path, unwritable_dir)[case]
    config = tiny_config(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    one_line_error(simkit("sweep", config, "--out", out, "--no-progress"), "--out", why)
    train_config = ROOT / "configs" / "train_quick.toml"
    one_line_error(simkit("train", train_config, "--out", out, "--no-progress"), "--out", why)
    one_line_error(simkit(*TRAIN_ARGS, "--out", out), "--out", why)
    # simkit run --out FILE: a directory, a file under a file, an unwritable directory
    a_dir = tmp_path / "a_dir.csv"
    a_dir.mkdir()
    run_out, why = {
        "existing file": (a_dir, "is a directory"),
        "under a file": (tmp_path / "a_file" / "t.csv", "is not a directory"),
        "unwritable": (unwritable_dir / "t.csv", "cannot write in"),
    }[case]
    one_line_error(simkit("run", config, "--out", run_out, "--no-progress"), "--out", why)
    after = sorted(p.name for p in tmp_path.iterdir())
    assert set(after) - set(before) == {"a_dir.csv"}  # nothing created (no sweep directory)
    assert list(a_dir.iterdir()) == [] and (tmp_path / "a_file").read_text() == "not a directory"


def test_run_out_is_checked_before_the_cells_run(tmp_path, monkeypatch, capsys):
    from simkit import cli

    def no_work(*args, **kwargs):  # pragma: no cover - called only if the check is missing
        raise AssertionError("the cells ran before --out was checked")

    monkeypatch.setattr(sweep, "run_config", no_work)
    monkeypatch.setattr(sweep, "execute_cell", no_work)
    (tmp_path / "f").write_text("x")
    config = tiny_config(tmp_path)
    assert cli.main(["run", str(config), "--out", str(tmp_path / "f" / "t.csv")]) == 2
    assert cli.main(["sweep", str(config), "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.count("simkit: error: --out") == 2
    # from Python the argument is named as written there
    with pytest.raises(sweep.SweepError, match=r"out_dir .*f is an existing file"):
        sweep.run_sweep(config, tmp_path / "f", progress=False)


# --- §5 sizes that cannot fit -----------------------------------------------------------------

BIG_MDP = """\
name = "big"
n = [8]
reps = 50
[environment]
kind = "token_mdp"
constructor = "markov"
V = 1000000
T = [16]
[behaviour]
family = "logit_noise"
divergence = "chi2"
targets = [0.1]
[[estimators]]
mapping = "naive"
"""


def _limited(args, memory_limit: str | None = None):
    """Run simkit with the address space capped at 4 GiB: without the estimate the process
    would die of MemoryError (not try for real)."""
    cap = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
    code = cap + "import sys; from simkit.cli import main; sys.exit(main(sys.argv[1:]))"
    extra = {} if memory_limit is None else {_memory.ENV_VAR: memory_limit}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(**extra),
        cwd=ROOT,
        check=False,
    )


def test_sizes_that_cannot_fit_are_refused_with_estimate_limit_and_parameter(tmp_path):
    mdp = tmp_path / "big.toml"
    mdp.write_text(BIG_MDP)
    line = one_line_error(
        _limited(["run", mdp, "--no-progress"]), "V = 1000000", "memory limit", "reduce V"
    )
    assert "needs about 473 TiB" in line  # 8 B x (4 T P V + S V), P = S = V + 1
    bandit = tmp_path / "bandit.toml"
    bandit.write_text(tiny_toml(0).replace("K = 4", "K = 2000000000"))
    one_line_error(
        _limited(["sweep", bandit, "--out", tmp_path / "b", "--no-progress"]),
        "K = 2000000000",
        "needs about 89.4 GiB",
        "reduce K",
    )
    assert not (tmp_path / "b").exists()
    # the limit is the environment variable when set: a small config refused, then allowed
    small = tiny_config(tmp_path)
    one_line_error(
        _limited(["run", small, "--no-progress"], "1KiB"),
        "reps x n x T = 20 x 16 x 1",
        "SIMKIT_MEMORY_LIMIT=1KiB",
        "reduce reps or n",
    )
    assert _limited(["run", small, "--no-progress"], "none").returncode == 0


def test_memory_estimates_bound_the_arrays_actually_held(monkeypatch):
    env = TokenMDP.markov(V=7, T=5, stationary=False)
    held = env.logits.nbytes + env.pi.nbytes + env.transition.nbytes
    estimate = _memory.token_mdp_bytes(env.T, env.P, env.V, env.S)
    assert held <= estimate <= 3 * held
    monkeypatch.setenv(_memory.ENV_VAR, "1MiB")
    with pytest.raises(_memory.MemoryLimitError, match=r"V = 200, T = 8.*reduce V"):
        TokenMDP.markov(V=200, T=8)
    from simkit import experiment
    from simkit.envs import Bandit

    bandit = Bandit(logits=np.zeros(3), means=np.full(3, 0.5))
    with pytest.raises(_memory.MemoryLimitError, match=r"reps x n x T = 20000 x 64.*reps or n"):
        experiment.run(bandit, np.full(3, 1 / 3), ["naive"], n=64, reps=20000)
    from simkit.estimators import Estimator
    from simkit.train import TrainConfig, train

    with pytest.raises(_memory.MemoryLimitError, match=r"rollout batch of 8192 .*--minibatch"):
        train(TokenMDP.iid(V=3, T=4), TrainConfig(Estimator("naive"), steps=1, batch=8192))
    monkeypatch.setenv(_memory.ENV_VAR, "lots")
    with pytest.raises(_memory.MemoryLimitError, match="SIMKIT_MEMORY_LIMIT='lots' is not a size"):
        _memory.memory_limit()


# --- §6 NaN / inf on valid tokens, every mapping ----------------------------------------------

BAD_VALUES = (math.nan, math.inf, -math.inf)


@st.composite
def batches(draw):
    N = draw(st.integers(1, 6))
    T = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    mask = rng.random((N, T)) < draw(st.floats(0.2, 1.0))
    mask[draw(st.integers(0, N - 1)), draw(st.integers(0, T - 1))] = True  # a valid token
    lr = rng.normal(0.0, 0.5, (N, T))
    adv = rng.normal(0.0, 1.0, N)
    return lr, mask, adv, rng, draw(st.sampled_from(BAD_VALUES))


@pytest.mark.parametrize("name", mappings.available())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches())
def test_every_mapping_rejects_non_finite_values_on_valid_tokens_only(name, batch):
    lr, mask, adv, rng, bad = batch
    m = mappings.get(name)
    if m.requires_log_prob:  # dppo, gepo: log π = log r + log 0.3 (NaN/inf wherever log r is)
        raw = m

        class _WithLogProb:
            def coefficients(self, log_ratio, mask, advantages):
                lp = np.asarray(log_ratio, dtype=np.float64) + math.log(0.3)
                return raw.coefficients(log_ratio, mask, advantages, log_prob=lp)

        m = _WithLogProb()
    clean = m.coefficients(np.where(mask, lr, 0.0), mask, adv)
    # on a valid position: ValueError naming log_ratio and the first bad position
    valid = np.argwhere(mask)
    i, t = valid[rng.integers(len(valid))]
    poisoned = lr.copy()
    poisoned[i, t] = bad
    first = tuple(np.argwhere(mask & ~np.isfinite(poisoned))[0])
    with pytest.raises(ValueError, match=rf"log_ratio is {bad} at valid position \[{first[0]}, "):
        m.coefficients(poisoned, mask, adv)
    # anywhere on padding: ignored (the same coefficients)
    padded = np.where(mask, lr, rng.choice(BAD_VALUES, size=lr.shape))
    np.testing.assert_array_equal(m.coefficients(padded, mask, adv), clean)
    # advantages: NaN on a row with a valid token raises; on an all-padding row it does not
    bad_adv = adv.copy()
    bad_adv[i] = math.nan
    with pytest.raises(ValueError, match=rf"advantages is nan at row {i}"):
        m.coefficients(lr, mask, bad_adv)
    empty = ~mask.any(axis=1)
    if empty.any():
        quiet = adv.copy()
        quiet[empty] = math.nan
        np.testing.assert_array_equal(m.coefficients(lr, mask, quiet), clean)


def test_torch_policy_loss_agrees_on_nan():
    torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")
    from simkit.lm.losses import policy_loss

    lp, old = torch.zeros(2, 3), torch.zeros(2, 3)
    mask, adv = torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, -1.0])
    lp[0, 1] = math.nan
    with pytest.raises(ValueError, match="NaN on a valid token"):
        policy_loss("tis_token", lp, old, adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss("tis_token", torch.zeros(2, 3), old, torch.tensor([math.nan, 1.0]), mask)
    mask[0, 1] = False  # the NaN is padding: ignored, as in numpy
    loss, _ = policy_loss("tis_token", lp, old, adv, mask)
    assert math.isfinite(float(loss))


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_torch_policy_loss_rejects_inf_on_valid_tokens(bad):
    torch = pytest.importorskip("torch", reason="needs torch (the lm extra)")
    from simkit.lm.losses import policy_loss

    lp = torch.zeros(2, 3)
    lp[0, 1] = bad
    for name in ("gspo", "tis_token", "ppo_clip"):
        with pytest.raises(ValueError, match=r"infinite on a valid token at position \(0, 1\)"):
            policy_loss(
                name, lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3) > 0
            )
    mask = torch.ones(2, 3) > 0
    mask[0, 1] = False  # the same value on padding is inert
    loss, _ = policy_loss("gspo", lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert math.isfinite(float(loss))


# --- §7 messages naming what the user typed ---------------------------------------------------


def test_negative_seed_is_named():
    from simkit import experiment
    from simkit.envs import Bandit

    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        TokenMDP.iid(V=3, T=2, seed=-1)
    bandit = Bandit(logits=np.zeros(3), means=np.full(3, 0.5))
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -3"):
        experiment.run(bandit, np.full(3, 1 / 3), ["naive"], n=4, reps=10, seed=-3)


def test_string_and_complex_arrays_are_named():
    p = np.array([0.5, 0.5])
    with pytest.raises(TypeError, match="mu must hold real numbers, got a complex array"):
        divergence.chi2(p, p.astype(complex))
    with pytest.raises(TypeError, match="pi must hold real numbers, got strings"):
        divergence.kl(["0.5", "0.5"], p)
    with pytest.raises(TypeError, match="log_ratio must hold real numbers, got strings"):
        divergence.chi2_mc(np.array(["1", "2"]))
    m = mappings.get("tis_token")
    with pytest.raises(TypeError, match="log_ratio must hold real numbers, got a complex"):
        m.coefficients(np.zeros((1, 2), complex), np.ones((1, 2), bool), np.ones(1))
    with pytest.raises(TypeError, match="advantages must hold real numbers, got strings"):
        m.coefficients(np.zeros((1, 2)), np.ones((1, 2), bool), np.array(["1"]))


@pytest.mark.parametrize(
    ("args", "named", "not_named"),
    [
        (["--N", "0"], "--N must be an integer >= 1, got 0", "TrainConfig"),
        (["--minibatch-size", "0"], "--minibatch-size", "TrainConfig"),
        (["--env", "markovv"], "--env: unknown", "--constructor"),
        (["--env-seed", "-1"], "--env-seed", "--seed:"),
        (["--seed", "-2"], "--seed must be an integer >= 0, got -2", "SeedSequence"),
    ],
)
def test_train_options_are_named_as_typed(tmp_path, args, named, not_named):
    line = one_line_error(simkit("train", *args, "--steps", "2", "--no-progress"), named)
    assert not_named not in line and args[1] in line  # the value typed is quoted back


# --- §8 the README names the merged table's key column ----------------------------------------


def test_readme_names_the_cell_column(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`cell_key`" not in readme
    assert "`simkit_version` and `cell` (the\ncell's key)" in readme
    table = sweep.run_config(tiny_config(tmp_path), progress=False)
    assert "cell" in table.columns and "cell_key" not in table.columns
