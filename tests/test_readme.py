"""The README's Python examples run as written (in order, sharing one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 3


def test_readme_examples_run():
    namespace: dict = {}
    for i, block in enumerate(python_blocks()):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"README python block {i} failed: {exc!r}\n{block}") from exc
    table = namespace["table"]
    # the token-MDP example: every estimator exact, sequence IS unbiased
    assert table["exact"].all()
    assert table.loc[table["mapping"] == "is_seq", "bias"].iloc[0] < 1e-12


def test_readme_lists_every_notebook():
    text = README.read_text(encoding="utf-8")
    notebooks = sorted((README.parent / "notebooks").glob("[0-9][0-9]_*.py"))
    assert notebooks, "no notebooks found"
    missing = [p.stem for p in notebooks if f"`{p.stem}`" not in text]
    assert not missing, f"README.md does not list the notebooks {missing}"
    assert "make lab" in text


def test_readme_lists_every_figure():
    from simkit.figures import FIGURES

    text = README.read_text(encoding="utf-8")
    missing = [name for name in FIGURES if f"`{name}`" not in text]
    assert not missing, f"README.md does not list the figures {missing}"


def test_readme_catalogue_table_is_the_registry():
    """The mapping table has one row per registered mapping, and the count in the example is
    the registry's."""
    from simkit import mappings

    text = README.read_text(encoding="utf-8")
    section = text.split("### The mapping catalogue", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert rows == mappings.available()
    count = re.search(r"mappings.available\(\)  # the (\d+) names below", text)
    assert count and int(count.group(1)) == len(mappings.available())
