"""simkit.figures.cache / runner: content hashes, dependency tracking, the cache, the manifest.

- ``content_hash`` depends on content only (same data → same hash, any change → another);
- dependencies are found statically and are exact: on a temporary copy of the package, editing
  a module changes the key of exactly the figures whose dependency closure contains it, and a
  comment- or docstring-only edit changes none;
- ``build`` computes once, then copies from the cache (same bytes), redraws from cached data
  when the drawn files are missing, recomputes with ``force``;
- a warm ``simkit figures mse_vs_T`` (a fresh process) computes and draws nothing and copies the
  same bytes (its speed-up is measured by ``benchmarks/bench_figures.py``);
- the manifest flags every kind of stale figure, and the committed ``figures/`` are not stale.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkit import figures
from simkit.figures import cache, runner

ROOT = Path(__file__).resolve().parents[1]
CHEAP = ["kernel_shapes", "vespo_bound"]
# one xdist worker runs this module, so the serial build below is made once (`make test` uses
# --dist loadgroup)
pytestmark = pytest.mark.xdist_group("figures_cache")


@pytest.fixture(scope="module")
def serial_build(tmp_path_factory):
    """``CHEAP`` built at small size, serially (jobs=1), into a fresh cache: (results, out
    directory, cache directory), made once for the tests that need such a build but not their
    own compute (drawing the two figures is ≈ 5 s). Tests copy the directories; never write
    into them."""
    root = tmp_path_factory.mktemp("serial-build")
    out, store = root / "out", root / "cache"
    results = figures.build(CHEAP, out, small=True, jobs=1, cache_dir=store, progress=False)
    assert [r.status for r in results] == ["computed", "computed"]
    return results, out, store


# --- content hash ------------------------------------------------------------------------------


def test_content_hash_follows_content():
    frame = pd.DataFrame({"a": [1.0, 2.0], "b": ["x", "y"]})
    frame.attrs["note"] = "n"
    same = pd.DataFrame({"a": [1.0, 2.0], "b": ["x", "y"]})
    same.attrs["note"] = "n"
    assert cache.content_hash(frame) == cache.content_hash(same)
    other = same.copy()
    other.loc[1, "a"] = 2.0 + 1e-15
    assert cache.content_hash(other) != cache.content_hash(frame)
    same.attrs["note"] = "m"
    assert cache.content_hash(same) != cache.content_hash(frame)
    assert cache.content_hash({"x": np.arange(3)}) != cache.content_hash({"x": np.arange(3.0)})
    assert cache.content_hash((1, 2)) != cache.content_hash([1, 2])
    assert cache.content_hash(float("nan")) == cache.content_hash(np.nan)
    cfg = figures.figure_module("mse_vs_T").config(small=True)
    assert cache.content_hash(cfg) == cache.content_hash(type(cfg)(**cfg.__dict__))
    with pytest.raises(TypeError, match="cannot hash an object of type object"):
        cache.content_hash(object())


# --- dependencies ------------------------------------------------------------------------------


def test_dependencies_are_the_imported_modules():
    deps = set(cache.dependencies("simkit.figures.mse_vs_T"))
    assert {"simkit.experiment", "simkit.envs.token_mdp", "simkit.figures.style"} <= deps
    assert "simkit.figures" not in deps  # the registry is nobody's dependency
    kernel = set(cache.dependencies("simkit.figures.kernel_shapes"))
    assert "simkit.experiment" not in kernel
    assert "simkit.mappings.vespo" in kernel
    for module in figures.FIGURES.values():
        assert "simkit.figures" not in cache.dependencies(module.__name__)


def _keys(root: Path) -> dict[str, str]:
    return {
        name: cache.figure_key(name, m.__name__, m.config(), root)
        for name, m in figures.FIGURES.items()
    }


def test_touching_a_module_invalidates_exactly_the_figures_that_import_it(tmp_path):
    copy = tmp_path / "simkit"
    shutil.copytree(cache.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    before = _keys(copy)

    def importers(module):
        return {
            n for n, m in figures.FIGURES.items() if module in cache.dependencies(m.__name__, copy)
        }

    # a comment and a docstring edit change no key
    target = copy / "envs" / "token_mdp.py"
    text = target.read_text()
    target.write_text('"""Edited docstring."""\n# a comment\n' + text.split('"""', 2)[2])
    assert _keys(copy) == before

    # a code edit changes the keys of exactly the importers
    for module, path in [
        ("simkit.envs.token_mdp", target),
        ("simkit.train.core", copy / "train" / "core.py"),
        ("simkit.figures.kernel_shapes", copy / "figures" / "kernel_shapes.py"),
    ]:
        expected = importers(module)
        assert expected and expected != set(figures.FIGURES)
        path.write_text(path.read_text() + "\n\ndef _touched():\n    return 1\n")
        after = _keys(copy)
        assert {n for n in before if after[n] != before[n]} == expected, module
        before = after
    assert importers("simkit.figures.kernel_shapes") == {"kernel_shapes"}
    # a config change is a new key too
    m = figures.figure_module("mse_vs_T")
    assert (
        cache.figure_key("mse_vs_T", m.__name__, m.config(small=True), copy) != before["mse_vs_T"]
    )


# --- the cache through build -------------------------------------------------------------------


def _count_computes(monkeypatch, names):
    calls = []
    for name in names:
        module = figures.figure_module(name)
        original = module.compute

        def counting(cfg, _orig=original, _name=name):
            calls.append(_name)
            return _orig(cfg)

        monkeypatch.setattr(module, "compute", counting)
    return calls


def test_build_computes_once_then_uses_the_cache(tmp_path, monkeypatch):
    calls = _count_computes(monkeypatch, CHEAP)
    out, store = tmp_path / "out", tmp_path / "cache"
    kw = {"small": True, "jobs": 1, "cache_dir": store, "progress": False}
    first = figures.build(CHEAP, out, **kw)
    assert [r.status for r in first] == ["computed", "computed"] and sorted(calls) == CHEAP
    files = {p.name: p.read_bytes() for p in out.glob("*.p*")}
    assert len(files) == 4

    second = figures.build(CHEAP, out, **kw)
    assert [r.status for r in second] == ["cached", "cached"] and sorted(calls) == CHEAP
    assert {p.name: p.read_bytes() for p in out.glob("*.p*")} == files

    for png in (store / "figures" / "kernel_shapes").glob("*.png"):
        png.unlink()  # drawn files gone: redraw from the cached data, same bytes
    third = figures.build(CHEAP, out, **kw)
    assert [r.status for r in third] == ["redrawn", "cached"] and sorted(calls) == CHEAP
    assert {p.name: p.read_bytes() for p in out.glob("*.p*")} == files

    forced = figures.build(CHEAP, out, force=True, **kw)
    assert [r.status for r in forced] == ["computed", "computed"] and sorted(calls) == sorted(
        CHEAP * 2
    )
    assert {p.name: p.read_bytes() for p in out.glob("*.p*")} == files  # deterministic bytes
    assert len({r.data_hash for r in (first[0], second[0], third[0], forced[0])}) == 1
    # one entry per figure is kept
    assert len(list((store / "figures" / "kernel_shapes").glob("*.pkl"))) == 1


def test_parallel_build_matches_serial(tmp_path, serial_build):
    serial, _, _ = serial_build  # computed serially into a fresh cache
    parallel = figures.build(
        CHEAP, tmp_path / "b", small=True, jobs=2, cache_dir=tmp_path / "c2", progress=False
    )
    assert [r.status for r in parallel] == ["computed", "computed"]
    for a, b in zip(serial, parallel):
        assert a.data_hash == b.data_hash
        for pa, pb in zip(a.paths, b.paths):
            assert pa.read_bytes() == pb.read_bytes()


def test_build_rejects_bad_arguments_before_work(tmp_path):
    with pytest.raises(KeyError, match="available figures"):
        figures.build(["nope"], tmp_path, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        figures.build(CHEAP, tmp_path, jobs=0, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_progress_lines_when_not_a_terminal(tmp_path, monkeypatch):
    import io

    monkeypatch.setenv("SIMKIT_PROGRESS_SECONDS", "0")
    stream = io.StringIO()
    figures.build(CHEAP, tmp_path, small=True, jobs=2, cache_dir=tmp_path / "c", stream=stream)
    text = stream.getvalue()
    assert "[1/2]" in text and "[2/2]" in text and "computed in" in text
    assert "\r" not in text  # no bar redraws in a log


def test_periodic_progress_while_one_figure_computes_in_process(tmp_path, monkeypatch):
    import io

    module = figures.figure_module("vespo_bound")
    original = module.compute

    def slow(cfg):
        time.sleep(2.5)
        return original(cfg)

    monkeypatch.setattr(module, "compute", slow)
    monkeypatch.setenv("SIMKIT_PROGRESS_SECONDS", "0")
    stream = io.StringIO()
    figures.build(["vespo_bound"], tmp_path, small=True, jobs=1, cache_dir=tmp_path, stream=stream)
    assert "figures: 0/1 done" in stream.getvalue()
    assert "running: vespo_bound" in stream.getvalue()


def test_progress_bars_on_a_terminal(tmp_path):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    kw = {"small": True, "jobs": 2, "cache_dir": tmp_path / "c", "stream": stream}
    figures.build(CHEAP, tmp_path / "a", **kw)
    first = stream.getvalue()
    assert "figures" in first and "%|" in first and "[1/2]" in first
    assert "first run: no estimate" in first or "kernel_shapes" in first
    (tmp_path / "c" / "figures" / "kernel_shapes").joinpath("seconds.json").write_text(
        '{"seconds": 50.0}'
    )
    stream.seek(0)
    stream.truncate()
    figures.build(["kernel_shapes"], tmp_path / "a", force=True, **kw)
    assert "last run 50s" in stream.getvalue()  # the running figure's ETA uses the last time


@pytest.mark.slow
def test_warm_figure_is_copied_from_the_cache(tmp_path):
    """A second run of an unchanged figure computes and draws nothing: it copies the PNG and
    PDF from the cache, byte for byte. (How much faster that is, cold vs warm, is measured by
    ``benchmarks/bench_figures.py``, not asserted here: a timing test is flaky on a shared
    machine.) At ``--small`` sizes: the cache path is the same, the cold run 21 s of CPU
    cheaper."""
    env = {**os.environ, "SIMKIT_CACHE_DIR": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    env.pop("SIMKIT_SMALL", None)

    def run(out):
        cmd = [sys.executable, "-m", "simkit", "figures", "mse_vs_T", "--small", "--out", str(out)]
        proc = subprocess.run(
            cmd, env=env, check=True, capture_output=True, text=True, cwd=tmp_path
        )
        files = {p.name: p.read_bytes() for p in out.glob("mse_vs_T.*")}
        return proc.stdout + proc.stderr, files

    cold_log, cold_files = run(tmp_path / "cold")
    warm_log, warm_files = run(tmp_path / "warm")  # a fresh directory: the files must be copied
    assert "(1 computed, 0 redrawn from cached data, 0 from the cache)" in cold_log, cold_log
    assert "(0 computed, 0 redrawn from cached data, 1 from the cache)" in warm_log, warm_log
    assert set(cold_files) == {"mse_vs_T.png", "mse_vs_T.pdf"}
    assert warm_files == cold_files


# --- the manifest ------------------------------------------------------------------------------


def test_manifest_flags_stale_figures(tmp_path, monkeypatch, serial_build):
    out = tmp_path / "out"
    shutil.copytree(serial_build[1], out)  # what figures.build(CHEAP, out, small=True) wrote
    assert set(runner.stale(out, CHEAP).values()) == {"made with --small"}
    assert "not in MANIFEST.json" in runner.stale(out, ["mse_vs_T"])["mse_vs_T"]

    # pretend the entries were made at full size from the current code: not stale
    manifest = json.loads((out / "MANIFEST.json").read_text())
    for name in CHEAP:
        manifest["figures"][name].update(runner.manifest_entry(name, small=False))
    (out / "MANIFEST.json").write_text(json.dumps(manifest))
    assert runner.stale(out, CHEAP) == {}

    module = figures.figure_module("vespo_bound")
    monkeypatch.setattr(module, "CAPTION", module.CAPTION + " (edited)")
    assert runner.stale(out, CHEAP) == {"vespo_bound": "its TITLE/CAPTION changed"}
    monkeypatch.undo()

    entry = manifest["figures"]["kernel_shapes"]
    entry["modules"]["simkit.mappings.vespo"] = "0" * 64
    entry["code"] = "old"
    (out / "MANIFEST.json").write_text(json.dumps(manifest))
    assert runner.stale(out, ["kernel_shapes"]) == {
        "kernel_shapes": "code changed since it was made: simkit.mappings.vespo"
    }

    (out / "vespo_bound.png").write_bytes(b"not the figure")
    assert "vespo_bound.png is not the file" in runner.stale(out, CHEAP)["vespo_bound"]


def test_manifest_is_deterministic(tmp_path, serial_build):
    kw = {"small": True, "jobs": 1, "progress": False}
    # a: CHEAP computed serially into a fresh cache (the shared build); b: the same cache,
    # computed again in the other order
    shutil.copytree(serial_build[1], tmp_path / "a")
    shutil.copytree(serial_build[2], tmp_path / "c")
    figures.build(CHEAP[::-1], tmp_path / "b", cache_dir=tmp_path / "c", force=True, **kw)
    a, b = (json.loads((tmp_path / d / "MANIFEST.json").read_text()) for d in ("a", "b"))
    for manifest in (a, b):  # compute times (whole seconds) may differ between the two runs
        for entry in manifest["figures"].values():
            entry.pop("compute_s")
    assert a == b and list(a["figures"]) == CHEAP  # gallery order
    before = (tmp_path / "b" / "MANIFEST.json").read_text()
    c = figures.build(CHEAP, tmp_path / "b", cache_dir=tmp_path / "c", **kw)  # warm: same file
    assert [r.status for r in c] == ["cached", "cached"]
    assert (tmp_path / "b" / "MANIFEST.json").read_text() == before


def test_committed_gallery_matches_the_code(tmp_path):
    committed = ROOT / "figures"
    for png in committed.glob("*.png"):
        (tmp_path / png.name).touch()
    figures.write_gallery(tmp_path)
    assert (committed / "README.md").read_text() == (tmp_path / "README.md").read_text(), (
        "figures/README.md differs from the captions in the code: run `make figures`"
    )


def test_committed_figures_are_what_the_code_produces():
    committed = ROOT / "figures"
    if not (committed / "MANIFEST.json").exists():
        pytest.xfail("figures/MANIFEST.json not produced yet: run `make figures` and commit it")
    problems = runner.stale(committed)
    assert not problems, "stale committed figures (run `make figures`): " + "; ".join(
        f"{name}: {why}" for name, why in problems.items()
    )
