"""The website: a strict ``mkdocs build``, then headless Chromium over the built site.

The build (``mkdocs build --strict``: a warning, a broken link or a missing image fails it)
goes into a temporary directory, which is served on localhost. Chromium (Debian's
``chromium`` + ``chromium-driver``; nothing is downloaded) then opens the home page, the mapping
catalogue, a rendered notebook and an API page: each must load with no console error and
every image on it must load; the site search must find ``vespo``. Screenshots are saved in the
test's temporary directory. Without Chromium the browser test is skipped — and fails when
``CI=true``, where ``.ci/run`` installs it.
"""

from __future__ import annotations

import functools
import http.server
import os
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
    "home": "",
    "catalogue": "catalogue/",
    "notebook": "notebooks/04_bandit_bias_variance/",
    "api": "api/mappings/",
    "config api": "api/config/",
    "architecture": "architecture/",
}


def _find(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
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


def test_site_builds_strictly_with_every_page(site):
    for page in PAGES.values():
        assert (site / page / "index.html").is_file(), page
    assert (site / "search" / "search_index.json").is_file()
    catalogue = (site / "catalogue" / "index.html").read_text()
    from simkit import mappings

    for name in mappings.available():  # generated from the registry: every mapping is there
        assert f'id="{name.replace("_", "-")}"' in catalogue, name
    course = (site / "course" / "index.html").read_text()
    solutions = list((ROOT / "notebooks" / "solutions").glob("*_solutions.py"))
    assert solutions and course.count("Solutions (try the exercises first)") == len(solutions)


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None
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
def test_page_loads_without_console_errors_and_with_every_image(browser, server, page, tmp_path):
    problems, images = page_problems(browser, server + PAGES[page])
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
