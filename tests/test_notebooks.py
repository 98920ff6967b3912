"""The notebooks: executed headless, paired with their scripts, public API only, well formed.

Every ``notebooks/*.py`` and ``notebooks/solutions/*.py`` (jupytext percent scripts, the
reviewed source of truth) is discovered by glob, so notebooks added later are picked up without
editing this file. For each one:

- execution: the script is read with jupytext and executed by nbclient in a fresh kernel
  that runs *this* interpreter (a kernelspec written to a temporary directory, pointing at
  ``sys.executable``, so it works in a fresh venv where no kernelspec was ever installed), with
  ``SIMKIT_FAST=1`` and ``MPLBACKEND=Agg``, errors disallowed, a per-cell timeout, in the
  script's own directory (``notebooks/`` for the numbered notebooks);
- pairing: the ``.ipynb`` next to the script exists, has no outputs, and jupytext reads the
  same cells (types and sources) from both;
- public API: no ``simkit._x`` module, no ``_name`` imported or reached through an attribute;
- structure: learning goals, runtime and an Exercises section; a solutions notebook for every
  numbered notebook, and no solutions without a notebook.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOLUTIONS = NOTEBOOKS / "solutions"
CELL_TIMEOUT_S = 300
KERNEL_NAME = "simkit-test-python"
NUMBERED = re.compile(r"^(\d\d)_[A-Za-z0-9_]+$")


def discover() -> list[Path]:
    """Every notebook script: ``notebooks/*.py`` then ``notebooks/solutions/*.py``, sorted."""
    return sorted(NOTEBOOKS.glob("*.py")) + sorted(SOLUTIONS.glob("*.py"))


def notebook_id(script: Path) -> str:
    return script.relative_to(NOTEBOOKS).with_suffix("").as_posix()


SCRIPTS = discover()
MAIN_SCRIPTS = [s for s in SCRIPTS if s.parent == NOTEBOOKS]
IDS = [notebook_id(s) for s in SCRIPTS]
MAIN_IDS = [notebook_id(s) for s in MAIN_SCRIPTS]


# --------------------------------------------------------------------------- pairing


def cells_of(path: Path) -> list[tuple[str, str]]:
    """(cell type, source) of every cell jupytext reads from ``path`` (script or notebook)."""
    nb = jupytext.read(path)
    return [(cell.cell_type, cell.source.strip("\n")) for cell in nb.cells]


def pairing_problem(script: Path, notebook: Path) -> str | None:
    """None when ``script`` and ``notebook`` have the same cells, else what differs.

    Cells are compared by type and source (outputs and metadata ignored); the message names the
    notebook and the first differing cell.
    """
    if not notebook.exists():
        return f"{script.name}: the paired notebook {notebook.name} does not exist"
    py_cells, nb_cells = cells_of(script), cells_of(notebook)
    for i, (a, b) in enumerate(zip(py_cells, nb_cells)):
        if a != b:
            return (
                f"{notebook.name} disagrees with {script.name} at cell {i}: "
                f"script has {a[0]} cell {a[1][:120]!r}, notebook has {b[0]} cell {b[1][:120]!r}"
            )
    if len(py_cells) != len(nb_cells):
        return (
            f"{notebook.name} disagrees with {script.name}: {len(py_cells)} cells in the script, "
            f"{len(nb_cells)} in the notebook (first differing cell: "
            f"{min(len(py_cells), len(nb_cells))})"
        )
    return None


def outputs_problem(notebook: Path) -> str | None:
    """None when no code cell of ``notebook`` carries outputs or an execution count."""
    nb = nbformat.read(notebook, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count")):
            return f"{notebook.name}: cell {i} has outputs; commit the notebook without outputs"
    return None


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_script_and_notebook_are_paired(script):
    formats = jupytext.read(script).metadata.get("jupytext", {}).get("formats", "")
    assert "ipynb" in formats and "py:percent" in formats, (
        f"{script.name}: the jupytext header must pair it as 'formats: ipynb,py:percent', "
        f"got {formats!r}"
    )
    notebook = script.with_suffix(".ipynb")
    problem = pairing_problem(script, notebook)
    assert problem is None, problem + f" (regenerate: jupytext --to ipynb {script})"
    problem = outputs_problem(notebook)
    assert problem is None, problem


def _write_pair(tmp_path: Path, cells: list[str]) -> tuple[Path, Path]:
    header = "# ---\n# jupyter:\n#   jupytext:\n#     formats: ipynb,py:percent\n# ---\n\n"
    script = tmp_path / "99_pair.py"
    script.write_text(header + "\n\n".join(cells) + "\n", encoding="utf-8")
    notebook = tmp_path / "99_pair.ipynb"
    jupytext.write(jupytext.read(script), notebook)
    return script, notebook


PAIR_CELLS = [
    "# %% [markdown]\n# # Title",
    "# %%\nx = 1",
    "# %% [markdown]\n# Some prose",
    "# %%\ny = x + 1",
]


def test_pairing_check_passes_on_a_fresh_pair(tmp_path):
    script, notebook = _write_pair(tmp_path, PAIR_CELLS)
    assert pairing_problem(script, notebook) is None
    assert outputs_problem(notebook) is None


def test_pairing_check_flags_an_edited_cell(tmp_path):
    script, notebook = _write_pair(tmp_path, PAIR_CELLS)
    script.write_text(script.read_text().replace("y = x + 1", "y = x + 2"), encoding="utf-8")
    problem = pairing_problem(script, notebook)
    assert problem is not None and "99_pair.ipynb" in problem and "cell 3" in problem


def test_pairing_check_flags_a_changed_cell_type(tmp_path):
    script, notebook = _write_pair(tmp_path, PAIR_CELLS)
    nb = nbformat.read(notebook, as_version=4)
    nb.cells[1] = nbformat.v4.new_markdown_cell("x = 1")
    nbformat.write(nb, notebook)
    problem = pairing_problem(script, notebook)
    assert problem is not None and "cell 1" in problem


def test_pairing_check_flags_a_missing_cell_and_a_missing_notebook(tmp_path):
    script, notebook = _write_pair(tmp_path, PAIR_CELLS)
    nb = nbformat.read(notebook, as_version=4)
    del nb.cells[-1]
    nbformat.write(nb, notebook)
    problem = pairing_problem(script, notebook)
    assert problem is not None and "4 cells in the script, 3 in the notebook" in problem
    notebook.unlink()
    assert "does not exist" in pairing_problem(script, notebook)


def test_outputs_check_flags_an_executed_cell(tmp_path):
    _, notebook = _write_pair(tmp_path, PAIR_CELLS)
    nb = nbformat.read(notebook, as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    nbformat.write(nb, notebook)
    assert "cell 1 has outputs" in outputs_problem(notebook)


# --------------------------------------------------------------------------- public API


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_api_uses(source: str, filename: str = "<notebook>") -> list[str]:
    """Every use of a private simkit name in ``source``: ``import simkit._x``,
    ``from simkit._x import …``, ``from simkit.x import _name``, attribute access
    ``simkit…._name`` (through any name bound to something imported from simkit) and
    ``getattr(<simkit name>, "_name")``. Each entry names the line and the offending code."""
    tree = ast.parse(source, filename=filename)
    simkit_names: set[str] = set()
    problems: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        problems.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != "simkit":
                    continue
                if any(_is_private(p) for p in parts):
                    flag(node, f"import {alias.name}")
                simkit_names.add(alias.asname or parts[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "simkit":
                continue
            if any(_is_private(p) for p in parts):
                flag(node, f"from {node.module} import …")
            for alias in node.names:
                if _is_private(alias.name):
                    flag(node, f"from {node.module} import {alias.name}")
                if alias.name != "*":
                    simkit_names.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if _root_name(node) in simkit_names:
                flag(node, f"attribute {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and _root_name(node.args[0]) in simkit_names
        ):
            flag(node, ast.unparse(node))
    return problems


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_notebook_uses_only_public_api(script):
    source = jupytext.writes(jupytext.read(script), fmt="py:percent")
    # magics (%matplotlib, !pip) are commented out by jupytext's py format: plain Python remains
    problems = private_api_uses(source, filename=script.name)
    assert not problems, "private simkit names used:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "snippet, expected",
    [
        ("import simkit._validation", "import simkit._validation"),
        ("import simkit._validation as v", "import simkit._validation"),
        ("from simkit._validation import check", "from simkit._validation import"),
        ("from simkit.figures._common import x", "from simkit.figures._common import"),
        ("from simkit.mappings import _helper", "from simkit.mappings import _helper"),
        ("from simkit import _validation", "from simkit import _validation"),
        ("import simkit\nsimkit.mappings._registry", "attribute simkit.mappings._registry"),
        ("import simkit.divergence as dv\ndv._check(1)", "attribute dv._check"),
        ("from simkit import shifts\nshifts._solve", "attribute shifts._solve"),
        ("from simkit import mappings\ngetattr(mappings, '_REG')", "getattr(mappings, '_REG')"),
    ],
)
def test_public_api_checker_flags_private_names(snippet, expected):
    problems = private_api_uses(snippet)
    assert len(problems) == 1 and expected in problems[0], problems


def test_public_api_checker_accepts_public_code():
    snippet = (
        "import numpy as np\nimport simkit\nfrom simkit import divergence, shifts\n"
        "from simkit.mappings import get\nsimkit.__version__\nnp._NoValue\n"
        "divergence.chi2(p, q)\nobj._private  # not reached through simkit\n"
    )
    assert private_api_uses(snippet) == []


# --------------------------------------------------------------------------- structure


def _markdown(script: Path) -> list[str]:
    return [c.source for c in jupytext.read(script).cells if c.cell_type == "markdown"]


def structure_problems(script: Path) -> list[str]:
    """What a numbered notebook lacks: a first markdown cell with "Learning goals" and
    "Runtime", a markdown heading "Exercises", and its solutions notebook."""
    nb = jupytext.read(script)
    problems = []
    if not nb.cells or nb.cells[0].cell_type != "markdown":
        problems.append("the first cell must be markdown (title, learning goals, runtime)")
    else:
        for needed in ("Learning goals", "Runtime"):
            if needed not in nb.cells[0].source:
                problems.append(f"the first markdown cell has no {needed!r}")
    if not any(re.search(r"^#+ .*Exercises", md, flags=re.M) for md in _markdown(script)):
        problems.append("no markdown heading 'Exercises'")
    if NUMBERED.match(script.stem):
        solutions = script.parent / "solutions" / f"{script.stem}_solutions.py"
        if not solutions.exists():
            problems.append(f"no solutions script {solutions.relative_to(script.parent)}")
    else:
        problems.append("the name must start with a two-digit number: NN_name.py")
    return problems


def test_notebooks_are_discovered():
    assert len(MAIN_SCRIPTS) >= 3, f"expected the numbered notebooks in {NOTEBOOKS}"
    assert MAIN_IDS[:3] == ["01_divergences", "02_importance_sampling", "03_weight_mapping_zoo"]


@pytest.mark.parametrize("script", MAIN_SCRIPTS, ids=MAIN_IDS)
def test_notebook_structure(script):
    problems = structure_problems(script)
    assert not problems, f"{script.name}: " + "; ".join(problems)


def test_every_solutions_script_belongs_to_a_notebook():
    for solutions in SOLUTIONS.glob("*.py"):
        stem = solutions.stem.removesuffix("_solutions")
        assert solutions.stem.endswith("_solutions") and (NOTEBOOKS / f"{stem}.py").exists(), (
            f"{solutions.name}: expected notebooks/solutions/NN_name_solutions.py next to a "
            "notebooks/NN_name.py"
        )


def test_structure_check_flags_a_bad_notebook(tmp_path):
    script = tmp_path / "42_bad.py"
    script.write_text("# %% [markdown]\n# # Title only\n\n# %%\nx = 1\n", encoding="utf-8")
    problems = structure_problems(script)
    assert any("Learning goals" in p for p in problems)
    assert any("Runtime" in p for p in problems)
    assert any("Exercises" in p for p in problems)
    assert any("solutions" in p for p in problems)
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "42_bad_solutions.py").write_text("x = 1\n", encoding="utf-8")
    script.write_text(
        "# %% [markdown]\n# # T\n# **Learning goals** …\n# **Runtime** …\n\n"
        "# %% [markdown]\n# ## Exercises\n",
        encoding="utf-8",
    )
    assert structure_problems(script) == []


# --------------------------------------------------------------------------- execution


@pytest.fixture(scope="session")
def kernel_spec_manager(tmp_path_factory):
    """A KernelSpecManager that knows one kernel: ipykernel on ``sys.executable``."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    kernels = tmp_path_factory.mktemp("kernels")
    spec_dir = Path(write_kernel_spec())  # a temporary directory, argv[0] = sys.executable
    shutil.copytree(spec_dir, kernels / KERNEL_NAME)
    shutil.rmtree(spec_dir, ignore_errors=True)
    ksm = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    spec = ksm.get_kernel_spec(KERNEL_NAME)
    assert spec.argv[0] == sys.executable, spec.argv
    return ksm


def error_outputs(nb: nbformat.NotebookNode) -> list[str]:
    """Errors recorded in the outputs of cells that did not raise themselves, such as a figure
    that fails to render (IPython's display formatter catches the exception and shows its
    traceback as an output; the cell still succeeds)."""
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append(f"cell {i}: {output.get('ename')}: {output.get('evalue', '')[:300]}")
    return found


def execute_script(script: Path, kernel_spec_manager) -> nbformat.NotebookNode:
    """Execute the jupytext script headless, as CI does; raises on the first failing cell."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    nb = jupytext.read(script)
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_spec_manager)
    client = NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(script.parent)}},
    )
    env = dict(os.environ, SIMKIT_FAST="1", MPLBACKEND="Agg", PYTHONHASHSEED="0")
    return client.execute(env=env, cleanup_kc=True)


def test_kernel_runs_this_interpreter(kernel_spec_manager, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "# %%\nimport os, sys\nprint(sys.executable)\nprint(os.environ['SIMKIT_FAST'])\n"
        "print(os.environ['MPLBACKEND'])\nprint(os.getcwd())\n",
        encoding="utf-8",
    )
    nb = execute_script(script, kernel_spec_manager)
    lines = "".join(o.get("text", "") for o in nb.cells[0].outputs).split()
    assert Path(lines[0]).resolve() == Path(sys.executable).resolve()
    assert lines[1:3] == ["1", "Agg"]
    assert Path(lines[3]).resolve() == tmp_path.resolve()


def test_execution_fails_on_a_failing_cell(kernel_spec_manager, tmp_path):
    from nbclient.exceptions import CellExecutionError

    script = tmp_path / "broken.py"
    script.write_text("# %%\nx = 1\n\n# %%\nassert x == 2, 'claim no longer true'\n")
    with pytest.raises(CellExecutionError, match="claim no longer true"):
        execute_script(script, kernel_spec_manager)


def test_execution_check_flags_a_figure_that_fails_to_render(kernel_spec_manager, tmp_path):
    script = tmp_path / "bad_figure.py"
    script.write_text(
        "# %%\n# %matplotlib inline\nimport matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\nax.set_title(r'$\\frac12$')  # invalid mathtext\n"
        "plt.show()\n",
        encoding="utf-8",
    )
    nb = execute_script(script, kernel_spec_manager)  # the cell itself succeeds…
    problems = error_outputs(nb)  # …but its output records the rendering error
    assert len(problems) == 1 and problems[0].startswith("cell 0: ValueError"), problems


def store_for_the_site(script: Path, nb: nbformat.NotebookNode) -> None:
    """Hand an executed notebook to the website build (``docs/hooks/simkit_docs.py``), which
    then renders it instead of executing the script a second time. Without mkdocs (the
    ``docs`` extra) there is no site build to hand it to."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "simkit_docs_hook", ROOT / "docs" / "hooks" / "simkit_docs.py"
    )
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    hook.store_executed(script, nb)


# One xdist worker executes the notebooks and then builds the site (tests/test_site_browser.py,
# the same group, collected after this file): the build finds every notebook executed here.
@pytest.mark.xdist_group("site")
@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_notebook_executes(script, kernel_spec_manager):
    nb = execute_script(script, kernel_spec_manager)
    problems = error_outputs(nb)
    assert not problems, f"{script.name}: errors in cell outputs:\n" + "\n".join(problems)
    store_for_the_site(script, nb)
