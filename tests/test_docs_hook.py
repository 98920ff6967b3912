"""docs/hooks/simkit_docs.py: the generated pages follow the registries and the notebooks.

Fast checks of the generators alone (no mkdocs build, no notebook execution; the full strict
build and the browser checks are in ``test_site_browser.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from simkit import figures, mappings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hook():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location(
        "simkit_docs_hook", ROOT / "docs" / "hooks" / "simkit_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_catalogue_lists_every_mapping_with_defaults_and_presets(hook):
    text = hook.catalogue()
    for name in mappings.available():
        cls = mappings.mapping_class(name)
        assert f"## `{name}` {{#{name.replace('_', '-')}}}" in text, name
        section = text.split(f"## `{name}` ", 1)[1].split("\n## ", 1)[0]
        assert f"level **{cls.level}" in section
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                assert f"{field.name}=" in section, (name, field.name)
        for preset in cls.presets:
            assert f"| `{preset}` |" in section, (name, preset)


def test_gallery_lists_every_figure_with_its_caption(hook):
    text = hook.gallery()
    for name, module in figures.FIGURES.items():
        assert f"## {module.TITLE}" in text
        assert f"`{name}` — " in text
        if (ROOT / "figures" / f"{name}.png").exists():
            assert f"](figures/{name}.png)" in text


def test_syllabus_covers_every_notebook_and_its_solutions(hook):
    text = hook.syllabus()
    scripts = hook.notebook_scripts()
    assert scripts and len(scripts) == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.py")))
    for script in scripts:
        info = hook.notebook_header(script)
        assert f"## {info['title']}" in text
        assert info["goals"] and info["runtime"] and info["exercises"]
    assert text.count("??? success") == len(hook.solution_scripts())


def test_a_header_without_goals_is_a_build_error(hook, tmp_path):
    script = tmp_path / "99_bad.py"
    script.write_text("# %% [markdown]\n# # 99 — Bad\n#\n# No goals here.\n", encoding="utf-8")
    with pytest.raises(hook.PluginError, match="lacks goals, runtime, exercises"):
        hook.notebook_header(script)
