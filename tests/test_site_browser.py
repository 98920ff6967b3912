"""The website: a strict ``mkdocs build``, then headless Chromium over the built site.

The build (``mkdocs build --strict``: a warning, a broken link or a missing image fails it)
goes into a temporary directory, which is served on localhost. Chromium (Debian's
``chromium`` + ``chromium-driver``; nothing is downloaded) then opens the home page, the mapping
catalogue, a rendered notebook and an API page: each must load with no console error and
every image on it must load; the site search must find ``vespo``.

What a reader sees, on **every** page of the site, once MathJax has typeset it: no raw TeX
(``$…$``, ``\\(…\\)``, ``\\frac`` …) left in the text outside code, every arithmatex span
typeset, no MathJax error, no raw Sphinx role (``:func:``), navigation and table-of-contents
titles free of TeX; no ``<script src="">`` in any page; the syllabus table has one row per
lesson. Screenshots of a notebook page and of the catalogue are written to
``site/browser-test/`` (a CI artifact; ``site/`` is git-ignored).

``SIMKIT_TEST_SITE=DIR`` checks an already built site instead of building one (for example the
site of an older commit, to see these checks fail on it). Without Chromium the browser tests
are skipped — and fail when ``CI=true``, where ``.ci/run`` installs it.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("site")  # one worker builds the site once

CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
]
PAGES = {
    "home": "index.html",
    "catalogue": "catalogue.html",
    "notebook": "notebooks/04_bandit_bias_variance.html",
    "api": "api/mappings.html",
    "config api": "api/config.html",
    "architecture": "architecture.html",
}
ARTIFACTS = ROOT / "site" / "browser-test"  # screenshots kept for CI (site/ is git-ignored)


def _find(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if os.environ.get("SIMKIT_TEST_SITE"):
        return Path(os.environ["SIMKIT_TEST_SITE"]).resolve()
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + proc.stderr[-6000:]
    return out


def _page_file(site: Path, page: str) -> Path:
    """The HTML file of ``page`` (``a/b.html``), in either URL layout."""
    flat = site / page
    return flat if flat.is_file() else site / page.removesuffix(".html") / "index.html"


def site_pages(site: Path) -> list[str]:
    """Every content page of the built site, as a path relative to it."""
    skip = ("assets/", "search/", "404.html", "downloads/", "figures/", "browser-test/")
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("*.html")
        if not p.relative_to(site).as_posix().startswith(skip) and p.name != "404.html"
    )


def test_site_builds_strictly_with_every_page(site):
    for page in PAGES.values():
        assert _page_file(site, page).is_file(), page
    assert (site / "search" / "search_index.json").is_file()
    catalogue = _page_file(site, "catalogue.html").read_text()
    from simkit import mappings

    for name in mappings.available():  # generated from the registry: every mapping is there
        assert f'id="{name.replace("_", "-")}"' in catalogue, name
    course = _page_file(site, "course/index.html").read_text()
    solutions = list((ROOT / "notebooks" / "solutions").glob("*_solutions.py"))
    assert solutions and course.count("Solutions (try the exercises first)") == len(solutions)


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args, **kwargs):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = _find("chromium", "chromium-browser", "google-chrome")
    driver_path = _find("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:  # pragma: no cover - the docs extra is installed by make install
        webdriver = None
    if chromium is None or driver_path is None or webdriver is None:
        missing = "selenium" if webdriver is None else "chromium / chromedriver"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {missing} is not installed (.ci/run installs it)")
        pytest.skip(f"{missing} not installed (Debian: apt-get install chromium chromium-driver)")
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _wait(predicate, timeout=30.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


IMAGES_JS = (
    "return Array.from(document.images).map(i => [i.currentSrc || i.src, i.complete, "
    "i.naturalWidth]);"
)


def page_problems(browser, url: str) -> tuple[list[str], list]:
    """(problems, images) of the page at ``url``: console errors and images that did not load."""
    browser.get_log("browser")  # drop earlier entries
    browser.get(url)
    _wait(lambda: browser.execute_script("return document.readyState") == "complete")

    def all_done():
        return all(done for _, done, _ in browser.execute_script(IMAGES_JS))

    _wait(all_done, timeout=15)
    images = browser.execute_script(IMAGES_JS)
    problems = [f"image did not load: {src[:120]}" for src, ok, w in images if not ok or w == 0]
    problems += [
        f"console error: {e['message'][:300]}"
        for e in browser.get_log("browser")
        if e["level"] == "SEVERE"
    ]
    return problems, images


@pytest.mark.parametrize("page", list(PAGES))
def test_page_loads_without_console_errors_and_with_every_image(
    browser, server, site, page, tmp_path
):
    path = _page_file(site, PAGES[page]).relative_to(site).as_posix()
    problems, images = page_problems(browser, server + path)
    assert "404" not in browser.title
    assert not problems, f"{page}: " + "; ".join(problems)
    if page in ("home", "notebook"):
        assert images, f"{page}: expected images on the page"
    browser.save_screenshot(str(tmp_path / f"{page}.png"))
    assert (tmp_path / f"{page}.png").stat().st_size > 1000


def test_the_checks_catch_a_broken_page(browser, server, site):
    bad = site / "broken-test-page.html"
    bad.write_text(
        "<html><body><img src='no-such-image.png'>"
        "<script>console.error('deliberate')</script></body></html>"
    )
    try:
        problems, _ = page_problems(browser, server + bad.name)
    finally:
        bad.unlink()
    assert any("no-such-image.png" in p for p in problems), problems
    assert any("deliberate" in p for p in problems), problems


def test_site_search_finds_vespo(browser, server, tmp_path):
    browser.get(server + "?q=vespo")
    js = (
        "return Array.from(document.querySelectorAll('.md-search-result__item'))"
        ".map(e => e.innerText);"
    )
    results = _wait(lambda: browser.execute_script(js), timeout=60)
    browser.save_screenshot(str(tmp_path / "search.png"))
    assert results, "the search returned nothing for 'vespo'"
    assert any("vespo" in r.lower() for r in results), results[:5]
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"search: console errors: {errors}"


# --------------------------------------------------------------------------- what a reader sees

#: TeX a reader should never see as text: $…$ / $$…$$, \\( \\) \\[ \\], and common macros
RAW_TEX = re.compile(
    r"\$\$|\$[^$\s][^$\n]{0,300}?\$|\\[()\[\]]|\\(?:frac|mathrm|mathbb|mathcal|operatorname|"
    r"chi|pi|mu|lambda|varphi|star|sum|prod|left|right|cdot|sqrt|text|le|ge|infty)\b"
)
RAW_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):")
TEX_IN_TITLE = re.compile(r"[$\\]")

READER_JS = """
const done = arguments[arguments.length - 1];
const ready = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
ready.then(() => {
  const root = document.querySelector('article') || document.body;
  const clone = root.cloneNode(true);
  clone.querySelectorAll('pre, code, mjx-container, script, style, textarea, .highlight, ' +
      '.highlight-ipynb, .jp-InputArea-editor')
    .forEach(e => e.remove());
  const titles = Array.from(document.querySelectorAll(
      '.md-nav__link, .md-nav__title, .md-footer__title, title'))
    .map(e => e.textContent.trim()).filter(t => t);
  done({
    text: clone.textContent,
    titles: titles.concat([document.title]),
    arithmatex: document.querySelectorAll('.arithmatex').length,
    untypeset: Array.from(document.querySelectorAll('.arithmatex'))
      .filter(e => !e.querySelector('mjx-container')).length,
    maths: document.querySelectorAll('mjx-container').length,
    errors: document.querySelectorAll('mjx-merror').length,
    mathjax: !!(window.MathJax && MathJax.startup),
  });
}).catch(e => done({error: String(e)}));
"""


def _snippets(pattern: re.Pattern, text: str, limit: int = 5) -> list[str]:
    return [
        " ".join(text[max(0, m.start() - 40) : m.end() + 40].split())
        for m in list(pattern.finditer(text))[:limit]
    ]


def reader_problems(browser, url: str) -> tuple[list[str], dict]:
    """What a reader of the page at ``url`` would see wrong, and the raw observations."""
    browser.get(url)
    _wait(lambda: browser.execute_script("return document.readyState") == "complete")
    browser.set_script_timeout(60)
    seen = browser.execute_async_script(READER_JS)
    if "error" in seen:
        return [f"MathJax failed: {seen['error']}"], seen
    problems = []
    tex = RAW_TEX.findall(seen["text"])
    if tex:
        problems.append(f"{len(tex)} raw TeX spans, e.g. {_snippets(RAW_TEX, seen['text'])}")
    roles = RAW_ROLE.findall(seen["text"])
    if roles:
        problems.append(f"{len(roles)} raw Sphinx roles, e.g. {_snippets(RAW_ROLE, seen['text'])}")
    if seen["untypeset"]:
        problems.append(f"{seen['untypeset']} of {seen['arithmatex']} formulas not typeset")
    if seen["errors"]:
        problems.append(f"{seen['errors']} MathJax errors (mjx-merror)")
    bad_titles = sorted({t for t in seen["titles"] if TEX_IN_TITLE.search(t)})
    if bad_titles:
        problems.append(f"TeX in navigation / TOC titles: {bad_titles[:5]}")
    return problems, seen


def test_every_page_shows_rendered_maths_and_no_raw_markup(browser, server, site):
    pages = site_pages(site)
    assert len(pages) > 20, pages
    report, totals, observed = [], {"maths": 0, "pages with maths": 0}, {}
    # The search index (≈ 2 MB) is what every page's search worker fetches and indexes on load:
    # nothing a reader sees in the article, the navigation or the titles comes from it, and
    # indexing it on each of the ~40 pages was a third of this test's time. The site search is
    # checked by test_site_search_finds_vespo; the index is unblocked again below.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/search/search_index.json"]})
    try:
        for page in pages:
            problems, seen = reader_problems(browser, server + page)
            observed[page] = seen
            if problems:
                report.append(f"{page}: " + "; ".join(problems))
            totals["maths"] += seen.get("maths", 0)
            totals["pages with maths"] += bool(seen.get("maths"))
    finally:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
        browser.get_log("browser")  # the blocked fetches' console entries: no later test's
    assert not report, f"{len(report)} of {len(pages)} pages:\n" + "\n".join(report)
    # maths is typeset (MathJax served by the site), on ordinary and notebook pages alike
    assert totals["pages with maths"] >= 10, totals
    for page in ("reference.html", "notebooks/01_divergences.html", "course/index.html"):
        seen = observed[_page_file(site, page).relative_to(site).as_posix()]  # seen above
        assert seen.get("mathjax") and seen.get("maths", 0) > 0, (page, seen.get("maths"))


def test_no_page_loads_an_empty_script(site):
    empty = re.compile(r"<script[^>]*\bsrc=(\"\"|'')")
    bad = [p for p in site_pages(site) if empty.search(_page_file(site, p).read_text())]
    assert not bad, f'<script src=""> in {len(bad)} pages: {bad[:5]}'


def test_the_reader_checks_catch_raw_tex_and_roles(browser, server, site):
    bad = site / "raw-tex-test-page.html"
    bad.write_text(
        "<html><head><title>$Q^\\star$</title></head><body><article>"
        "<p>$$\\chi^2 = \\frac{a}{b}$$ and \\(x\\)</p><p>see :func:<code>run</code></p>"
        "</article></body></html>"
    )
    try:
        problems, _ = reader_problems(browser, server + bad.name)
    finally:
        bad.unlink()
    text = " ".join(problems)
    assert "raw TeX" in text and "Sphinx roles" in text and "TeX in navigation" in text, problems


def test_syllabus_table_has_one_row_per_lesson(browser, server, site):
    lessons = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    page = _page_file(site, "course/index.html").relative_to(site).as_posix()
    browser.get(server + page)
    rows = browser.execute_script(
        "const t = document.querySelector('article table');"
        "return t ? t.querySelectorAll('tbody tr').length : -1;"
    )
    assert rows == len(lessons), f"syllabus table: {rows} rows for {len(lessons)} lessons"


@pytest.mark.parametrize("page", ["notebook", "catalogue"])
def test_screenshot_artifacts(browser, server, site, page):
    path = _page_file(site, PAGES[page]).relative_to(site).as_posix()
    browser.get(server + path)
    browser.set_script_timeout(60)
    browser.execute_async_script(READER_JS)  # wait for MathJax
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"{page}.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 1000
