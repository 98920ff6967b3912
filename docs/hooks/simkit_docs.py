"""MkDocs hook: the pages of the simkit site that are generated from the code at build time.

- ``on_config``: the lessons of the *Course* section of the navigation, in teaching order, from
  ``notebooks/NN_*.py`` (each lesson followed by its solutions), with plain-text titles;
- ``on_config`` also writes the rendered notebooks and solutions into ``docs/notebooks/``
  (git-ignored) — each script executed headless with ``SIMKIT_FAST=1``
  (``execute_notebook.py``, several at once) and cached under ``.simkit-cache/notebooks/`` (or
  ``$SIMKIT_CACHE_DIR``) by a content hash of the script, of the simkit code it imports
  (transitively) and of the library versions, so an unchanged notebook is not executed again;
- ``on_files``: the committed ``figures/*.png|pdf``; MathJax (``assets/mathjax/``, copied from
  the installed ``django-static-mathjax`` package of the ``docs`` extra: no CDN at view time);
  the committed notebooks without outputs (``downloads/``, the lesson's download link);
- ``on_page_content``: on notebook pages, the lesson banner (study time, download, ``make lab``,
  solutions and back), MathJax 2's empty ``<script src="">`` and its config removed, and the
  shared notebook CSS moved out of the page into one file (``assets/notebook-*.css``);
- ``on_page_context``: plain-text (TeX-free) page titles and tables of contents;
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


def notebook_cache_dir() -> Path:
    from simkit.figures import cache

    folder = cache.default_cache_dir() / "notebooks"
    if not folder.is_absolute():
        folder = ROOT / folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cached_notebook(script: Path) -> Path:
    """Where the executed ``script`` is cached (its key: script, code, libraries, executor)."""
    return notebook_cache_dir() / f"{script.stem}-{_notebook_key(script)[:20]}.ipynb"


def store_executed(script: Path, nb) -> Path:
    """Cache a notebook executed elsewhere — by ``tests/test_notebooks.py``, with the same
    settings as ``execute_notebook.py`` (``SIMKIT_FAST=1``, errors not allowed) — so that the
    site build renders it instead of executing the script again: ``make test`` executes each
    notebook once. The kernelspec is normalised as the executor does."""
    import nbformat

    nb = nbformat.from_dict(nb)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    target = cached_notebook(script)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, target)
    return target


def executed_notebooks(scripts: list[Path]) -> dict[Path, Path]:
    """script -> executed .ipynb in the cache, executing (in parallel) the ones not cached."""
    from simkit.figures.runner import available_cpus

    folder = notebook_cache_dir()
    targets = {s: cached_notebook(s) for s in scripts}
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


# --- plain-text titles -------------------------------------------------------------------------

_TEX_NAMES = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "varepsilon": "ε",
    "zeta": "ζ", "eta": "η", "theta": "θ", "kappa": "κ", "lambda": "λ", "mu": "μ", "nu": "ν",
    "xi": "ξ", "pi": "π", "rho": "ρ", "sigma": "σ", "tau": "τ", "phi": "φ", "varphi": "φ",
    "chi": "χ", "psi": "ψ", "omega": "ω", "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ",
    "Lambda": "Λ", "Pi": "Π", "Sigma": "Σ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω",
    "star": "⋆", "ast": "*", "infty": "∞", "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥",
    "ne": "≠", "neq": "≠", "cdot": "·", "times": "×", "propto": "∝", "approx": "≈", "to": "→",
    "sim": "~", "pm": "±", "ell": "ℓ", "partial": "∂", "nabla": "∇", "sum": "Σ", "prod": "Π",
    "mid": "|", "Vert": "‖", "|": "‖", "log": "log", "exp": "exp", "min": "min", "max": "max",
    "ldots": "…", "dots": "…", "cdots": "…", "in": "∈", "hat": "", "tilde": "", "bar": "",
}  # fmt: skip
_SUPERSCRIPT = dict(zip("0123456789+-()nkTi⋆*", "⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁽⁾ⁿᵏᵀⁱ⋆*", strict=True))
_SUBSCRIPT = dict(zip("0123456789+-()aeiklmnopstx", "₀₁₂₃₄₅₆₇₈₉₊₋₍₎ₐₑᵢₖₗₘₙₒₚₛₜₓ", strict=True))
_MATH = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)", re.S)


def _scripts(text: str, mark: str, table: dict) -> str:
    def replace(m: re.Match) -> str:
        body = m.group(1) if m.group(1) is not None else m.group(2)
        if all(ch in table for ch in body):
            return "".join(table[ch] for ch in body)
        return mark + body

    return re.sub(re.escape(mark) + r"(?:\{([^{}]*)\}|(\S))", replace, text)


def tex_to_text(tex: str) -> str:
    """Readable plain text for a TeX fragment (``Q^\\star`` → ``Q⋆``, ``(1+\\chi^2)^T`` →
    ``(1+χ²)ᵀ``): for navigation titles and tables of contents, where no maths renders."""
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", tex)
    s = re.sub(
        r"\\(?:mathrm|mathbf|mathbb|mathcal|mathsf|text|textrm|operatorname|boldsymbol)"
        r"\{([^{}]*)\}",
        r"\1",
        s,
    )
    s = re.sub(r"\\([,;:! ])", " ", s)
    s = re.sub(r"\\(left|right|big|Big|bigg|Bigg)\b", "", s)
    s = re.sub(r"\\([A-Za-z]+|\|)", lambda m: _TEX_NAMES.get(m.group(1), m.group(1)), s)
    s = _scripts(s, "^", _SUPERSCRIPT)
    s = _scripts(s, "_", _SUBSCRIPT)
    s = re.sub(r"\((\w)\)/\((\w)\)", r"\1/\2", s)
    s = s.replace("{", "").replace("}", "")
    return " ".join(s.split())


def plain_title(text: str) -> str:
    """``text`` with every ``$…$``, ``$$…$$`` and ``\\(…\\)`` replaced by :func:`tex_to_text`,
    and backticks and stray backslashes dropped: a title that reads the same without MathJax."""
    out = _MATH.sub(lambda m: tex_to_text(next(g for g in m.groups() if g is not None)), text)
    out = out.replace("`", "")
    out = re.sub(r"\\([A-Za-z]+)", lambda m: _TEX_NAMES.get(m.group(1), m.group(1)), out)
    return " ".join(out.split())


# --- study time ---------------------------------------------------------------------------------

READING_WPM = 120  #: words a minute for technical prose with formulas
MIN_PER_CODE_CELL = 1.0  #: reading and running one code cell
MIN_PER_EXERCISE = 15.0  #: one exercise, attempted before the solutions


def study_minutes(script: Path) -> int:
    """Estimated study time of a lesson, in minutes, rounded to 5: its prose read at
    :data:`READING_WPM` words a minute, :data:`MIN_PER_CODE_CELL` per code cell and
    :data:`MIN_PER_EXERCISE` per exercise (counted from the notebook itself)."""
    import jupytext

    nb = jupytext.read(script)
    words = sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    code = sum(1 for c in nb.cells if c.cell_type == "code")
    exercises = len(notebook_header(script)["exercises"])
    total = words / READING_WPM + code * MIN_PER_CODE_CELL + exercises * MIN_PER_EXERCISE
    return max(5, 5 * round(total / 5))


def _hours(minutes: int) -> str:
    h, m = divmod(minutes, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min"


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


def solution_of(script: Path) -> Path | None:
    path = SOLUTIONS / f"{script.stem}_solutions.py"
    return path if path.exists() else None


def course_nav() -> list:
    """The lessons in teaching order, each followed by its solutions (plain-text titles)."""
    entries: list = []
    for script in notebook_scripts():
        entries.append({plain_title(notebook_header(script)["title"]): doc_uri(script)})
        sol = solution_of(script)
        if sol is not None:
            entries.append({f"Solutions to {script.stem[:2]}": doc_uri(sol)})
    return entries


def on_config(config):
    materialize_notebooks()
    nav = config["nav"]
    for entry in nav:
        if isinstance(entry, dict) and "Course" in entry:
            section = entry["Course"]
            if not isinstance(section, list) or "course/index.md" not in section:
                raise PluginError("mkdocs.yml: the 'Course' section must list course/index.md")
            entry["Course"] = ["course/index.md", *course_nav()]
            break
    else:
        raise PluginError("mkdocs.yml: the nav has no 'Course' section")
    return config


def mathjax_dir() -> Path:
    """The MathJax 3 distribution (``es5/``) of the installed ``django-static-mathjax``."""
    import importlib.util

    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise PluginError(
            "MathJax is not installed: pip install -e '.[docs]' (django-static-mathjax)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5"
    if not (path / MATHJAX_ENTRY).is_file():
        raise PluginError(f"MathJax: {path / MATHJAX_ENTRY} is missing")
    return path


MATHJAX_ENTRY = "tex-svg.js"  #: one file, fonts included (works from file:// too)
#: loaded on demand by the entry point: TeX extensions (autoload), the menu, accessibility
MATHJAX_PARTS = ("input/tex/extensions", "ui", "a11y")


def on_files(files, config):
    from simkit import figures

    for name in figures.FIGURES:
        for ext in ("png", "pdf"):
            path = FIGURES / f"{name}.{ext}"
            if path.exists():
                files.append(
                    File.generated(config, f"figures/{name}.{ext}", abs_src_path=str(path))
                )
    source = mathjax_dir()
    paths = [source / MATHJAX_ENTRY]
    for part in MATHJAX_PARTS:
        paths += sorted(p for p in (source / part).rglob("*.js") if p.is_file())
    for path in paths:
        uri = "assets/mathjax/" + path.relative_to(source).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    for script in notebook_scripts() + solution_scripts():
        committed = script.with_suffix(".ipynb")
        if committed.exists():
            uri = f"downloads/{committed.name}"
            files.append(File.generated(config, uri, abs_src_path=str(committed)))
    return files


# --- notebook pages -----------------------------------------------------------------------------

_SHARED_CSS: dict[str, str] = {}  # file name -> css, written once by on_post_build
_MATHJAX2 = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S)
_STYLE = re.compile(r"<style[^>]*>(.*?)</style>", re.S)
SHARED_CSS_MIN_CHARS = 2000  #: a <style> block this long is the template's, the same every page


def _relative(page, target: str) -> str:
    from mkdocs.utils import get_relative_url

    return get_relative_url(target, page.url or ".")


def _script_of(page) -> Path | None:
    uri = page.file.src_uri
    if not uri.startswith("notebooks/") or not uri.endswith(".ipynb"):
        return None
    script = ROOT / Path(uri).with_suffix(".py")
    return script if script.exists() else None


def lesson_banner(script: Path, page, files) -> str:
    """The box on top of a lesson (or of its solutions): study time, download, make lab, links."""
    lesson = (
        script if script.parent == NOTEBOOKS else NOTEBOOKS / script.name.replace("_solutions", "")
    )
    download = _relative(page, f"downloads/{script.with_suffix('.ipynb').name}")
    run = (
        f'<a href="{download}" download>download the notebook</a> '
        f"(<code>{script.with_suffix('.ipynb').name}</code>, without outputs) and run it "
        "locally with <code>make lab</code> (after <code>git clone</code>; the first run installs "
        "the environment), or open <code>notebooks/"
        + script.relative_to(NOTEBOOKS).as_posix()
        + "</code> in any editor (a jupytext script)"
    )
    items = []
    if script.parent == NOTEBOOKS:
        info = notebook_header(script)
        items.append(
            f"<strong>Study time</strong>: about {_hours(study_minutes(script))} "
            f"(execution: {_inline_code(info['runtime'].split(' (')[0])})"
        )
        sol = solution_of(script)
        if sol is not None:
            href = _relative(page, files.get_file_from_path(doc_uri(sol)).url)
            items.append(
                f'<strong>Solutions</strong>: <a href="{href}">worked solutions</a> '
                "(try the exercises first)"
            )
    else:
        href = _relative(page, files.get_file_from_path(doc_uri(lesson)).url)
        items.append(f'<strong>Lesson</strong>: <a href="{href}">back to the notebook</a>')
    items.append(f"<strong>Run it yourself</strong>: {run}")
    course = _relative(page, files.get_file_from_path("course/index.md").url)
    items.append(f'<a href="{course}">Course syllabus</a>')
    body = "".join(f"<li>{item}</li>" for item in items)
    return (
        '<div class="admonition info simkit-lesson"><p class="admonition-title">This lesson</p>'
        f"<ul>{body}</ul></div>"
    )


def _inline_code(text: str) -> str:
    """HTML of a header snippet: escaped, its `code` spans as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html_escape(text))


def html_escape(text: str) -> str:
    import html

    return html.escape(text, quote=False)


def on_page_content(html, page, config, files):
    script = _script_of(page)
    if script is None:
        return html
    html = _MATHJAX2.sub("", html)
    html = html.replace('<script src=""> </script>', "").replace('<script src=""></script>', "")

    def share(match: re.Match) -> str:
        css = match.group(1)
        if len(css) < SHARED_CSS_MIN_CHARS:
            return match.group(0)
        import hashlib

        name = f"assets/notebook-{hashlib.sha256(css.encode()).hexdigest()[:12]}.css"
        _SHARED_CSS[name] = css
        return f'<link rel="stylesheet" href="{_relative(page, name)}">'

    html = _STYLE.sub(share, html)
    # the notebooks' "Solutions: `solutions/x.py`" lines become links to the rendered solutions
    sol = solution_of(script) if script.parent == NOTEBOOKS else None
    if sol is not None:
        href = _relative(page, files.get_file_from_path(doc_uri(sol)).url)
        html = html.replace(
            f"<code>solutions/{sol.name}</code>",
            f'<a href="{href}"><code>solutions/{sol.name}</code></a>',
        )
    return lesson_banner(script, page, files) + html


def _plain_toc(items) -> None:
    for item in items:
        item.title = plain_title(item.title)
        _plain_toc(item.children)


def on_page_context(context, page, config, nav):
    if page.title:
        page.title = plain_title(page.title)
    _plain_toc(page.toc)
    return context


def on_post_build(config):
    site = Path(config["site_dir"])
    for name, css in _SHARED_CSS.items():
        target = site / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(css, encoding="utf-8")


MARKERS = {
    "catalogue.md": "<!-- catalogue -->",
    "figures.md": "<!-- gallery -->",
    "course/index.md": "<!-- syllabus -->",
    "api/figures.md": "<!-- figure-modules -->",
    "quickstart.md": "<!-- readme-tour -->",
}


def on_page_markdown(markdown, page, config, files):
    uri = page.file.src_uri
    if uri not in MARKERS:
        return markdown
    marker = MARKERS[uri]
    if marker not in markdown:
        raise PluginError(f"{uri}: the marker {marker} is missing")
    generate = {
        "catalogue.md": catalogue,
        "figures.md": gallery,
        "course/index.md": syllabus,
        "api/figures.md": figure_modules,
        "quickstart.md": readme_tour,
    }
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
    """Markdown-safe prose: ``|`` and ``*`` escaped outside code spans (RST's double backticks
    are code spans too), Sphinx roles shown as code; code spans left as they are."""
    text = re.sub(r":(?:func|class|meth|mod|attr|data|obj|exc):`~?([^`]+)`", r"`\1`", text)
    parts = re.split(r"(`+[^`]*`+)", text)
    return "".join(
        p if p.startswith("`") else p.replace("|", "\\|").replace("*", "\\*") for p in parts
    )


ARXIV = re.compile(r"arXiv (\d{4}\.\d{4,5})(v\d+)?")
_REPO_PATH = re.compile(
    r"(?:(?P<repo>[A-Za-z0-9-]+/[A-Za-z0-9_.-]+) )?"
    r"(?P<path>(?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|sh|md)|[\w.-]+\.md\b)"
)
_COMMIT = re.compile(r"@ ([0-9a-f]{7,40})\b")


def linkify_source(source: str) -> str:
    """Markdown of a preset source (``PRESET_SOURCES``): arXiv ids and upstream files as links
    (``owner/repo path`` at the segment's ``@ commit``; a path without its repo or commit uses
    the previous segment's)."""
    out, repo, commit = [], None, None
    for segment in source.split("; "):
        found = _COMMIT.search(segment)
        commit = found.group(1) if found else commit

        def link(m: re.Match, commit=commit) -> str:
            nonlocal repo
            path = m.group("path")
            if "/" not in path and not m.group("repo"):
                return m.group(0)  # a root file (README.md) only right after its owner/repo
            repo = m.group("repo") or repo
            if repo is None or commit is None:
                return m.group(0)
            url = f"https://github.com/{repo}/blob/{commit}/{path}"
            prefix = f"{m.group('repo')} " if m.group("repo") else ""
            return f"{prefix}[{path}]({url})"

        segment = _md_escape(segment)
        segment = _REPO_PATH.sub(link, segment)
        segment = arxiv_links(segment)
        out.append(segment)
    return "; ".join(out)


def arxiv_links(text: str) -> str:
    return ARXIV.sub(lambda m: f"[{m.group(0)}](https://arxiv.org/abs/{m.group(1)})", text)


def preset_origin(source: str | None) -> str:
    """``paper`` or ``library repo @ commit``, from a preset's recorded source."""
    if not source:
        return "not recorded"
    if source.startswith("paper:"):
        return "paper"
    repo = re.match(r"([A-Za-z0-9-]+/[A-Za-z0-9_.-]+) ", source)
    commit = _COMMIT.search(source)
    if repo:
        return f"library: {repo.group(1)}" + (f" @ {commit.group(1)}" if commit else "")
    return "release / library (see the source)"


def catalogue() -> str:
    """Markdown of the registry: summary table, then one section per mapping."""
    import inspect

    from simkit import mappings
    from simkit.mappings.preset_sources import (
        MAPPING_SOURCES,
        PRESET_SOURCES,
        VERL_PRESET_CHANGES,
    )

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
            f"> {arxiv_links(_md_escape(summary))}",
            "",
            f"**Defaults**: `{_hp(defaults)}` · formula and notation: "
            f"[Notation and formulas](reference.md#mappings)",
            "",
        ]
        if name in MAPPING_SOURCES:
            lines += [f"**Sources**: {linkify_source(MAPPING_SOURCES[name])}", ""]
        if presets:
            lines += ["| preset | hyperparameters | from | source |", "|---|---|---|---|"]
            for preset, hp in presets.items():
                where = sources.get(preset)
                origin = preset_origin(where)
                cell = linkify_source(where) if where else "not recorded (see the docstring)"
                lines.append(f"| `{preset}` | `{_hp(hp)}` | {origin} | {cell} |")
            lines.append("")
        lines += [
            '??? note "Docstring (formula, paper, where libraries disagree)"',
            "",
            *(("    " + arxiv_links(_md_escape(line))).rstrip() for line in doc.splitlines()),
            "",
        ]
        sections.append("\n".join(lines))
    return "\n".join(rows) + "\n\n" + verl_changes(VERL_PRESET_CHANGES) + "\n".join(sections)


def verl_changes(changes) -> str:
    """Markdown table of the verl presets re-checked between b178a3c and 1dda039."""
    lines = [
        "## verl presets: b178a3c → 1dda039 {#verl-presets-1dda039}",
        "",
        "Every preset taken from verl, re-checked at "
        "[verl-project/verl@1dda039](https://github.com/verl-project/verl/tree/1dda039) "
        "against [volcengine/verl@b178a3c](https://github.com/volcengine/verl/tree/b178a3c) "
        "(`simkit.mappings.preset_sources.VERL_PRESET_CHANGES`).",
        "",
        "| mapping | preset | at 1dda039 | what changed |",
        "|---|---|---|---|",
    ]
    for name, preset, status, note in changes:
        anchor = name.replace("_", "-")
        lines.append(f"| [`{name}`](#{anchor}) | `{preset}` | **{status}** | {_md_escape(note)} |")
    return "\n".join(lines) + "\n\n"


# --- the figure gallery -------------------------------------------------------------------------


def gallery() -> str:
    from simkit import figures
    from simkit.figures import runner

    stale = runner.stale(FIGURES) if (FIGURES / runner.MANIFEST).exists() else None
    parts = []
    for name, module in figures.FIGURES.items():
        parts += [
            f"## {module.TITLE}",
            "",
            f"`{name}` — {_md_escape(module.CAPTION)}",
            "",
            f"Drawn by [`{module.__name__}`](api/figures.md#{module.__name__}) · regenerate: "
            f"`simkit figures {name}`",
            "",
        ]
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


def figure_modules() -> str:
    """``:::`` blocks (mkdocstrings) for every registered figure module, in registry order."""
    from simkit import figures

    return "\n\n".join(
        f"::: {module.__name__}\n    options:\n      heading_level: 3"
        for module in figures.FIGURES.values()
    )


# --- the quickstart: the README's tour, executed -------------------------------------------------


def readme_section(title: str = "A short tour") -> str:
    """The README's ``## title`` section, up to the next ``## `` heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.S | re.M)
    if match is None:
        raise PluginError(f"README.md: no section '## {title}'")
    return match.group(1)


def _run_block(code: str, namespace: dict) -> str:
    """Execute ``code`` in ``namespace``; the printed output and the last expression's value."""
    import ast
    import contextlib
    import io

    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "README.md", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "README.md", "eval"), namespace)
            if value is not None:
                text = getattr(value, "to_string", None)
                print(text() if callable(text) else repr(value))
    return out.getvalue().rstrip()


def readme_tour() -> str:
    """The README's tour with every python block followed by its output (executed now)."""
    import os

    section = readme_section()
    namespace: dict = {}
    parts = re.split(r"(```python\n.*?```)", section, flags=re.S)
    out = []
    for part in parts:
        out.append(part.replace("### ", "## "))
        if part.startswith("```python"):
            code = part.removeprefix("```python\n").removesuffix("```")
            os.environ.setdefault("MPLBACKEND", "Agg")
            try:
                result = _run_block(code, namespace)
            except Exception as exc:  # a README example that fails is a build error
                raise PluginError(f"README.md tour: a python block failed: {exc!r}") from exc
            if result:
                out.append(
                    "\n\nOutput (when this site was built):\n\n```text\n" + result + "\n```\n"
                )
    return "## A short tour\n" + "".join(out)


# --- the course syllabus ------------------------------------------------------------------------


def _one_line(text: str) -> str:
    """A table cell: one line, pipes escaped (a wrapped header line would split the row)."""
    return " ".join(text.split()).replace("|", "\\|")


def syllabus() -> str:
    rows = ["| # | lesson | study time | prerequisites |", "|---|---|---|---|"]
    sections = []
    for script in notebook_scripts():
        info = notebook_header(script)
        link = f"../{doc_uri(script)}"
        minutes = study_minutes(script)
        prerequisites = _one_line(info["prerequisites"].split(". Next")[0]) or "none"
        rows.append(
            f"| {script.stem[:2]} | [{_one_line(info['title'])}]({link}) | {_hours(minutes)} "
            f"| {prerequisites} |"
        )
        lines = [
            f"## {info['title']}",
            "",
            info["intro"],
            "",
            f"**Study time**: about {_hours(minutes)} · **execution**: {info['runtime']}",
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
            f"[Read the lesson]({link}) · [download the notebook](../downloads/"
            f"{script.stem}.ipynb) · source: `notebooks/{script.name}`",
            "",
        ]
        sol = solution_of(script)
        if sol is not None:
            lines += [
                '??? success "Solutions (try the exercises first)"',
                "",
                f"    Worked solutions, executed: [{script.stem} — solutions](../{doc_uri(sol)})"
                f" · source: `notebooks/solutions/{sol.name}`",
                "",
            ]
        sections.append("\n".join(lines))
    note = (
        f"*Study time* is estimated from each notebook: its prose at {READING_WPM} words a "
        f"minute, {MIN_PER_CODE_CELL:g} min per code cell (reading and running it) and "
        f"{MIN_PER_EXERCISE:g} min per exercise; the execution time of the code alone is given "
        "under each lesson."
    )
    return "\n".join(rows) + "\n\n" + note + "\n\n" + "\n".join(sections)
