"""MkDocs hook: the pages of the simkit site that are generated from the code at build time.

- ``on_config``: the *Notebooks* section of the navigation, from ``notebooks/NN_*.py``;
- ``on_config`` also writes the rendered notebooks and solutions into ``docs/notebooks/``
  (git-ignored) — each script executed headless with ``SIMKIT_FAST=1``
  (``execute_notebook.py``, several at once) and cached under ``.simkit-cache/notebooks/`` (or
  ``$SIMKIT_CACHE_DIR``) by a content hash of the script, of the simkit code it imports
  (transitively) and of the library versions, so an unchanged notebook is not executed again;
- ``on_files``: the committed ``figures/*.png|pdf``;
- ``on_page_markdown``: the markers ``<!-- catalogue -->`` (the mapping registry: name,
  level, ratio, defaults, presets with the upstream library, docstring),
  ``<!-- gallery -->`` (every registered figure with its title and caption, and whether the
  committed file is stale according to ``figures/MANIFEST.json``) and ``<!-- syllabus -->``
  (goals, prerequisites, time and exercises of each notebook, read from the notebook's own
  header; solutions behind a toggle).

A marker missing from its page, a notebook that fails to execute, or a header that lacks its
goals/runtime/exercises is a build error.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NOTEBOOKS = ROOT / "notebooks"
SOLUTIONS = NOTEBOOKS / "solutions"
FIGURES = ROOT / "figures"
DOCS = ROOT / "docs"
EXECUTOR = Path(__file__).with_name("execute_notebook.py")
NUMBERED = re.compile(r"^\d\d_[A-Za-z0-9_]+$")

#: where each preset's library lives upstream (presets are named after the library or paper)
LIBRARIES = {
    "verl": ("verl", "https://github.com/volcengine/verl"),
    "trl": ("TRL", "https://github.com/huggingface/trl"),
    "openrlhf": ("OpenRLHF", "https://github.com/OpenRLHF/OpenRLHF"),
    "slime": ("slime", "https://github.com/THUDM/slime"),
    "icepop": ("IcePop (Ring-1T, arXiv 2510.18855)", "https://arxiv.org/abs/2510.18855"),
    "rl_collapse": ("rl-collapse (arXiv 2512.01374)", "https://arxiv.org/abs/2512.01374"),
}


# --- discovery ----------------------------------------------------------------------------------


def notebook_scripts() -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("*.py") if NUMBERED.match(p.stem))


def solution_scripts() -> list[Path]:
    return sorted(SOLUTIONS.glob("*_solutions.py"))


def doc_uri(script: Path) -> str:
    return script.relative_to(ROOT).with_suffix(".ipynb").as_posix()


def _markdown_cells(script: Path) -> list[str]:
    import jupytext

    nb = jupytext.read(script)
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def notebook_header(script: Path) -> dict:
    """Title, intro, goals, runtime, prerequisites and exercise titles of a notebook script."""
    cells = _markdown_cells(script)
    if not cells:
        raise PluginError(f"{script.name}: no markdown cell")
    first = cells[0]
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", first) if p.strip()]
    title = re.sub(r"^#\s*", "", paragraphs[0].splitlines()[0]).strip()
    info = {"title": title, "intro": "", "goals": "", "runtime": "", "prerequisites": ""}
    for i, para in enumerate(paragraphs[1:], 1):
        if para.startswith("**Learning goals**"):
            rest = para[len("**Learning goals**") :].strip()
            info["goals"] = rest or (paragraphs[i + 1] if i + 1 < len(paragraphs) else "")
        elif para.startswith("**Runtime**"):
            info["runtime"] = para.split(":", 1)[1].strip() if ":" in para else para
        elif para.startswith("**Prerequisites**"):
            info["prerequisites"] = para.split(":", 1)[1].strip() if ":" in para else para
        elif not info["intro"] and not para.startswith(("**", "-", "#")):
            info["intro"] = para
    exercises = next((c for c in cells if re.search(r"^##\s+Exercises", c, re.M)), "")
    info["exercises"] = [
        " ".join(t.split()) for t in re.findall(r"^\d+\.\s+\*\*(.+?)\*\*", exercises, re.M | re.S)
    ]
    missing = [k for k in ("goals", "runtime", "exercises") if not info[k]]
    if NUMBERED.match(script.stem) and missing:
        raise PluginError(f"{script.name}: the header lacks {', '.join(missing)}")
    return info


# --- notebook execution (cached) ----------------------------------------------------------------


def _notebook_key(script: Path) -> str:
    from simkit.figures import cache

    text = script.read_text(encoding="utf-8")
    return cache.content_hash(
        {
            "format": 1,
            "script": text,
            "code": cache.modules_hash(cache.source_imports(text)),
            "libraries": cache.library_versions(),
            "env": {"SIMKIT_FAST": "1"},
            "executor": EXECUTOR.read_text(encoding="utf-8"),
        }
    )


def executed_notebooks(scripts: list[Path]) -> dict[Path, Path]:
    """script -> executed .ipynb in the cache, executing (in parallel) the ones not cached."""
    from simkit.figures import cache
    from simkit.figures.runner import available_cpus

    folder = cache.default_cache_dir() / "notebooks"
    if not folder.is_absolute():
        folder = ROOT / folder
    folder.mkdir(parents=True, exist_ok=True)
    targets = {s: folder / f"{s.stem}-{_notebook_key(s)[:20]}.ipynb" for s in scripts}
    todo = [s for s, t in targets.items() if not t.exists()]
    jobs = int(os.environ.get("SIMKIT_DOCS_JOBS", "0")) or available_cpus()
    running: dict[Path, tuple[subprocess.Popen, float]] = {}
    failures = []
    start = time.perf_counter()
    if todo:
        print(f"simkit docs: executing {len(todo)} notebook(s), {jobs} at a time", flush=True)
    while todo or running:
        while todo and len(running) < jobs:
            script = todo.pop(0)
            proc = subprocess.Popen(
                [sys.executable, str(EXECUTOR), str(script), str(targets[script])],
                cwd=script.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(
                        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
                    ),
                },
            )
            running[script] = (proc, time.perf_counter())
        time.sleep(0.2)
        for script, (proc, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            output = proc.stdout.read().decode(errors="replace")
            del running[script]
            if proc.returncode:
                failures.append(f"{script.name} (exit {proc.returncode}):\n{output[-3000:]}")
            else:
                print(f"  {script.name}: {time.perf_counter() - t0:.1f} s", flush=True)
    if failures:
        raise PluginError("notebooks failed to execute:\n" + "\n".join(failures))
    for script, target in targets.items():  # keep one executed copy per notebook
        for old in folder.glob(f"{script.stem}-*.ipynb"):
            if old != target:
                old.unlink(missing_ok=True)
    if time.perf_counter() - start > 1:
        print(f"simkit docs: notebooks ready in {time.perf_counter() - start:.1f} s", flush=True)
    return targets


# --- hook events --------------------------------------------------------------------------------


def materialize_notebooks() -> None:
    """Executed notebooks into ``docs/notebooks/`` (git-ignored), rewriting only changed files."""
    scripts = notebook_scripts() + solution_scripts()
    wanted = {}
    for script, executed in executed_notebooks(scripts).items():
        target = DOCS / doc_uri(script)
        wanted[target] = executed
        target.parent.mkdir(parents=True, exist_ok=True)
        data = executed.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    for old in (DOCS / "notebooks").rglob("*.ipynb"):
        if old not in wanted:
            old.unlink()


def on_config(config):
    materialize_notebooks()
    nav = config["nav"]
    for entry in nav:
        if isinstance(entry, dict) and "Notebooks" in entry:
            entry["Notebooks"] = [
                {notebook_header(s)["title"]: doc_uri(s)} for s in notebook_scripts()
            ]
            break
    else:
        raise PluginError("mkdocs.yml: the nav has no 'Notebooks' section")
    return config


def on_files(files, config):
    from simkit import figures

    for name in figures.FIGURES:
        for ext in ("png", "pdf"):
            path = FIGURES / f"{name}.{ext}"
            if path.exists():
                files.append(
                    File.generated(config, f"figures/{name}.{ext}", abs_src_path=str(path))
                )
    return files


MARKERS = {
    "catalogue.md": "<!-- catalogue -->",
    "figures.md": "<!-- gallery -->",
    "course/index.md": "<!-- syllabus -->",
}


def on_page_markdown(markdown, page, config, files):
    uri = page.file.src_uri
    if uri not in MARKERS:
        return markdown
    marker = MARKERS[uri]
    if marker not in markdown:
        raise PluginError(f"{uri}: the marker {marker} is missing")
    generate = {"catalogue.md": catalogue, "figures.md": gallery, "course/index.md": syllabus}
    return markdown.replace(marker, generate[uri]())


# --- the mapping catalogue ----------------------------------------------------------------------


def _value(v) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "∞" if v > 0 else "−∞"
        return f"{v:g}"
    return str(v)


def _hp(d: dict) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in d.items()) or "—"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")


def catalogue() -> str:
    """Markdown of the registry: summary table, then one section per mapping."""
    import inspect

    from simkit import mappings
    from simkit.mappings.preset_sources import PRESET_SOURCES

    rows = [
        "| name | level | ratio | defaults | presets |",
        "|---|---|---|---|---|",
    ]
    sections = []
    for name in mappings.available():
        cls = mappings.mapping_class(name)
        defaults = {
            f.name: f.default
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING
        }
        ratio = getattr(cls, "ratio_kind", "") if issubclass(cls, mappings.ScalarMapping) else ""
        level = cls.level + (" (batch dependent)" if cls.batch_dependent else "")
        presets = dict(cls.presets)
        rows.append(
            f"| [`{name}`](#{name.replace('_', '-')}) | {level} | {ratio or '—'} | "
            f"{_md_escape(_hp(defaults))} | {', '.join(presets) or '—'} |"
        )
        doc = inspect.getdoc(cls) or ""
        summary = doc.split("\n\n", 1)[0].replace("\n", " ")
        sources = {
            **(getattr(cls, "preset_sources", {}) or {}),
            **PRESET_SOURCES.get(name, {}),
        }
        lines = [
            f"## `{name}` {{#{name.replace('_', '-')}}}",
            "",
            f"`{cls.__module__}.{cls.__qualname__}` · level **{level}**"
            + (f" · ratio **{ratio}**" if ratio else "")
            + f" · on-policy identity: {'yes' if cls.on_policy_identity else 'no'}",
            "",
            f"> {_md_escape(summary)}",
            "",
            f"**Defaults**: `{_hp(defaults)}`",
            "",
        ]
        if presets:
            lines += ["| preset | hyperparameters | upstream | file |", "|---|---|---|---|"]
            for preset, hp in presets.items():
                lib = LIBRARIES.get(preset)
                upstream = f"[{lib[0]}]({lib[1]})" if lib else f"{preset} (the paper's values)"
                where = sources.get(preset, "not recorded (see the docstring)")
                lines.append(f"| `{preset}` | `{_hp(hp)}` | {upstream} | {_md_escape(where)} |")
            lines.append("")
        lines += [
            '??? note "Docstring (formula, paper, where libraries disagree)"',
            "",
            "    ```text",
            *("    " + line for line in doc.splitlines()),
            "    ```",
            "",
        ]
        sections.append("\n".join(lines))
    return "\n".join(rows) + "\n\n" + "\n".join(sections)


# --- the figure gallery -------------------------------------------------------------------------


def gallery() -> str:
    from simkit import figures
    from simkit.figures import runner

    stale = runner.stale(FIGURES) if (FIGURES / runner.MANIFEST).exists() else None
    parts = []
    for name, module in figures.FIGURES.items():
        parts += [f"## {module.TITLE}", "", f"`{name}` — {_md_escape(module.CAPTION)}", ""]
        png, pdf = FIGURES / f"{name}.png", FIGURES / f"{name}.pdf"
        if png.exists():
            parts += [f"![{module.TITLE}](figures/{name}.png)", ""]
        if pdf.exists():
            parts += [f"[PDF](figures/{name}.pdf)", ""]
        if not png.exists():
            parts += ['!!! warning "Not generated yet"', "", "    Run `make figures`.", ""]
        elif stale is not None and name in stale:
            parts += [
                '!!! warning "The committed file may be stale"',
                "",
                f"    {_md_escape(stale[name])} — run `make figures`.",
                "",
            ]
    if stale is None:
        parts += [
            '!!! note "No manifest"',
            "",
            "    `figures/MANIFEST.json` is absent: whether the committed files match the code "
            "is not known.",
            "",
        ]
    return "\n".join(parts)


# --- the course syllabus ------------------------------------------------------------------------


def syllabus() -> str:
    solutions = {s.stem.removesuffix("_solutions"): s for s in solution_scripts()}
    rows = ["| # | notebook | time | prerequisites |", "|---|---|---|---|"]
    sections = []
    for script in notebook_scripts():
        info = notebook_header(script)
        link = f"../{doc_uri(script)}"
        rows.append(
            f"| {script.stem[:2]} | [{info['title']}]({link}) | {info['runtime'].split(' (')[0]} "
            f"| {info['prerequisites'].split('. Next')[0] or 'none'} |"
        )
        lines = [
            f"## {info['title']}",
            "",
            info["intro"],
            "",
            f"**Time**: {info['runtime']}",
            "",
            f"**Prerequisites**: {info['prerequisites'] or 'none'}",
            "",
            "**Learning goals**",
            "",
            info["goals"],
            "",
            "**Exercises**",
            "",
            *(f"{i}. {t}" for i, t in enumerate(info["exercises"], 1)),
            "",
            f"[Read the notebook]({link}) · source: `notebooks/{script.name}`",
            "",
        ]
        sol = solutions.get(script.stem)
        if sol is not None:
            lines += [
                '??? success "Solutions (try the exercises first)"',
                "",
                f"    Worked solutions, executed: [{script.stem} — solutions](../{doc_uri(sol)})"
                f" · source: `notebooks/solutions/{sol.name}`",
                "",
            ]
        sections.append("\n".join(lines))
    return "\n".join(rows) + "\n\n" + "\n".join(sections)
