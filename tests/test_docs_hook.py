"""docs/hooks/simkit_docs.py: the generated pages follow the registries and the notebooks.

Fast checks of the generators alone (no mkdocs build, no notebook execution; the full strict
build and the browser checks are in ``test_site_browser.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
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


# --------------------------------------------------------------------------- plain-text titles


@pytest.mark.parametrize(
    ("tex", "text"),
    [
        ("$Q^\\star$ is a tilted $\\mu$", "Q⋆ is a tilted μ"),
        ("Sequence weights: $(1+\\chi^2)^T$", "Sequence weights: (1+χ²)ᵀ"),
        ("a knob like GAE's $\\lambda$", "a knob like GAE's λ"),
        ("\\(\\mathrm{MSE}=\\frac{a}{b}\\)", "MSE=a/b"),
        ("as the length `$T$` grows", "as the length T grows"),
    ],
)
def test_plain_title_reads_without_mathjax(hook, tex, text):
    assert hook.plain_title(tex) == text


def test_navigation_and_headings_of_every_notebook_are_tex_free(hook):
    import jupytext

    titles = [title for entry in hook.course_nav() for title in entry]
    for script in hook.notebook_scripts() + hook.solution_scripts():
        for cell in jupytext.read(script).cells:
            if cell.cell_type == "markdown":
                titles += [
                    line.lstrip("#").strip()
                    for line in cell.source.splitlines()
                    if line.startswith("#")
                ]
    bad = [(t, hook.plain_title(t)) for t in titles if re.search(r"[$\\`]", hook.plain_title(t))]
    assert not bad, bad


def test_course_nav_lists_lessons_in_order_each_followed_by_its_solutions(hook):
    uris = [uri for entry in hook.course_nav() for uri in entry.values()]
    expected = []
    for script in hook.notebook_scripts():
        expected.append(hook.doc_uri(script))
        if hook.solution_of(script) is not None:
            expected.append(hook.doc_uri(hook.solution_of(script)))
    assert uris == expected
    assert len(hook.solution_scripts()) == sum("/solutions/" in u for u in uris)


def test_syllabus_table_has_one_single_line_row_per_lesson(hook):
    table = hook.syllabus().split("\n\n", 1)[0].splitlines()
    assert table[0].startswith("| # | lesson | study time |")
    rows = table[2:]
    assert len(rows) == len(hook.notebook_scripts())
    for row, script in zip(rows, hook.notebook_scripts(), strict=True):
        assert row.startswith(f"| {script.stem[:2]} |") and row.count(" | ") >= 3, row


def test_study_time_follows_the_stated_rates(hook, tmp_path):
    script = tmp_path / "98_probe.py"
    words = " ".join(["word"] * (hook.READING_WPM * 20))  # 20 min of reading
    script.write_text(
        "# %% [markdown]\n# # 98 — Probe\n#\n# **Learning goals**: read.\n#\n"
        "# **Runtime**: 1 s.\n\n"
        f"# %% [markdown]\n# {words}\n\n# %%\nx = 1\n\n"
        "# %% [markdown]\n# ## Exercises\n#\n# 1. **One.** Do it.\n",
        encoding="utf-8",
    )
    # 20 min of prose (the header's dozen words add 0.1 min), one code cell, one exercise
    expected = 20 + hook.MIN_PER_CODE_CELL + hook.MIN_PER_EXERCISE
    assert hook.study_minutes(script) == 5 * round(expected / 5)


# --------------------------------------------------------------------------- catalogue sources


def test_presets_are_labelled_by_their_recorded_source(hook):
    from simkit.mappings.preset_sources import PRESET_SOURCES

    for name, presets in PRESET_SOURCES.items():
        for preset, source in presets.items():
            origin = hook.preset_origin(source)
            assert (origin == "paper") == source.startswith("paper:"), (name, preset, origin)
            linked = hook.linkify_source(source)
            for arxiv in re.findall(r"arXiv (\d{4}\.\d{4,5})", source):
                assert f"(https://arxiv.org/abs/{arxiv})" in linked, (name, preset)
            if origin.startswith("library: "):
                repo = origin.split()[1]
                commit = re.search(r"@ ([0-9a-f]{7,40})", source).group(1)
                assert f"(https://github.com/{repo}/blob/{commit}/" in linked, (name, preset)


def test_catalogue_lists_the_2026_mappings_with_formula_paper_and_upstream_links(hook):
    """Issue 24: every new entry shows its formula (the docstring summary), a paper link and a
    link to the upstream file at its commit; the verl re-check table lists every verl preset."""
    from simkit.mappings.preset_sources import MAPPING_SOURCES, VERL_PRESET_CHANGES

    text = hook.catalogue()
    new = ["dro", "dppo_tv", "dppo_kl", "luspo", "rollout_is", "segment_is", "gepo"]
    assert set(MAPPING_SOURCES) == set(new)
    for name in new:
        section = text.split(f"## `{name}` ", 1)[1].split("\n## ", 1)[0]
        summary = section.split("\n> ", 1)[1].split("\n", 1)[0]
        assert "c_t" in summary or "c =" in summary or "weight" in summary, (name, summary)
        sources = section.split("**Sources**: ", 1)[1].split("\n", 1)[0]
        assert "](https://github.com/" in sources and "/blob/" in sources, name
        if "arXiv" in MAPPING_SOURCES[name]:
            assert "](https://arxiv.org/abs/" in sources, name
    table = text.split("{#verl-presets-1dda039}", 1)[1].split("\n## ", 1)[0]
    verl_presets = {
        (name, preset)
        for name, presets in __import__(
            "simkit.mappings.preset_sources", fromlist=["PRESET_SOURCES"]
        ).PRESET_SOURCES.items()
        for preset in presets
        if preset.startswith("verl")
    }
    assert {(n, p) for n, p, _, _ in VERL_PRESET_CHANGES} == verl_presets
    for name, preset, status, _ in VERL_PRESET_CHANGES:
        assert f"| [`{name}`](#{name.replace('_', '-')}) | `{preset}` | **{status}** |" in table


def test_catalogue_prose_keeps_code_spans_unescaped(hook):
    assert hook._md_escape("``c_t = r_t`` and a|b, :func:`x`") == "``c_t = r_t`` and a\\|b, `x`"


# --------------------------------------------------------------------------- single execution


def test_a_notebook_executed_by_the_tests_is_the_one_the_site_renders(hook, tmp_path, monkeypatch):
    import nbformat

    monkeypatch.setenv("SIMKIT_CACHE_DIR", str(tmp_path))
    script = hook.notebook_scripts()[0]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    stored = hook.store_executed(script, nb)
    assert stored == hook.cached_notebook(script) and stored.is_relative_to(tmp_path)
    assert hook.executed_notebooks([script]) == {script: stored}  # found: nothing executed
    assert nbformat.read(stored, 4).metadata["kernelspec"]["name"] == "python3"


# --------------------------------------------------------------------------- API docstrings


def test_griffe_extension_turns_roles_into_optional_autorefs_and_shows_dataclass_fields():
    griffe = pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location(
        "griffe_simkit", ROOT / "docs" / "hooks" / "griffe_simkit.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loader = griffe.GriffeLoader(
        extensions=griffe.load_extensions(module.SimkitDocstrings()), search_paths=[str(ROOT)]
    )
    pkg = loader.load("simkit")
    loader.resolve_aliases(implicit=False, external=False)
    vespo = pkg["mappings.vespo.VESPO"]
    doc = vespo.docstring.value
    assert ":func:" not in doc
    assert '<autoref identifier="simkit.mappings.vespo.vespo_f" optional>' in doc
    assert "Attributes\n----------" in doc and "k_pos : float" in doc
    init = vespo.members["__init__"]
    assert [p.name for p in init.parameters][1:3] == ["k_pos", "lambda_pos"]
    assert init.parameters["k_pos"].default == "2.0"
    remaining = [
        obj.path
        for obj in module._walk(pkg)
        if obj.docstring is not None and module.ROLE.search(obj.docstring.value)
    ]
    assert not remaining, remaining[:5]
