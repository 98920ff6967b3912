"""``make figures``: every figure computed once per change, in parallel, with visible progress.

:func:`build` is what ``simkit figures`` runs. For each figure it computes the cache key
(:func:`simkit.figures.cache.figure_key`: config + the code the figure imports + library
versions) and then

- copies the PNG and PDF from the cache when they were drawn from the same key with the same
  matplotlib version ("cached");
- otherwise draws from the cached data when the data key matches ("redrawn");
- otherwise computes the data, stores it, draws ("computed").

``force=True`` ignores the cache (and refills it). The figures that need work run in a pool of
``jobs`` processes (default: the CPUs this process may use), longest first by the time each
took last; each worker limits its BLAS/OpenMP threads to its share of the CPUs.

Progress goes to ``stream`` (stderr): one line per finished figure, and, on a terminal, tqdm
bars — the whole job and each running figure, with an ETA from the figure's last compute time;
when the output is not a terminal, a one-line summary every ``SIMKIT_PROGRESS_SECONDS``
(default 30) seconds.

Finally ``<out>/MANIFEST.json`` records, per figure, what its files were made from (config
hash, code hash and the per-module source hashes, caption hash, data hash, PNG/PDF SHA-256), so
a test can tell whether the committed figures are what the current code produces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from simkit.figures import cache as _cache

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1

#: assumed compute time of a figure never computed before (progress estimates only)
DEFAULT_SECONDS = 30.0


@dataclasses.dataclass
class Result:
    """What :func:`build` did for one figure."""

    name: str
    status: str  # "computed", "redrawn" or "cached"
    compute_s: float  # 0 unless computed
    draw_s: float  # 0 when the files came from the cache
    total_s: float
    key: str
    data_hash: str
    paths: list[Path]
    recorded_s: float = 0.0  # compute time recorded with the data (this run or the cached one)


def available_cpus() -> int:
    """CPUs this process may run on (affinity-aware)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return max(1, os.cpu_count() or 1)


def caption_hash(module) -> str:
    return hashlib.sha256(f"{module.TITLE}\n{module.CAPTION}".encode()).hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def render_key(key: str) -> str:
    """Key of the drawn files: the data key plus the matplotlib version (fonts, rasteriser)."""
    import matplotlib

    return _cache.content_hash({"data": key, "matplotlib": matplotlib.__version__})


# --- one figure ---------------------------------------------------------------------------------


def plan(name: str, small: bool, store: _cache.FigureCache, force: bool) -> tuple[str, str]:
    """(key, what is needed: "cached", "redrawn" or "computed") for figure ``name``."""
    from simkit.figures import registry as figures

    module = figures.figure_module(name)
    key = _cache.figure_key(name, module.__name__, module.config(small=small))
    if force:
        return key, "computed"
    meta = store.meta(name, key)
    if meta is None:
        return key, "computed"
    rkey = render_key(key)
    if all(store.file(name, rkey, ext).is_file() for ext in ("png", "pdf")):
        return key, "cached"
    return key, "redrawn"


def make_one(name: str, out_dir, small: bool, cache_dir, force: bool, events=None) -> Result:
    """Make figure ``name`` in ``out_dir`` using (and refilling) the cache; see module doc."""
    from simkit.figures import registry as figures

    start = time.perf_counter()
    if events is not None:
        events.put(("start", name, time.time()))
    store = _cache.FigureCache(cache_dir)
    module = figures.figure_module(name)
    key, need = plan(name, small, store, force)
    rkey = render_key(key)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    compute_s = draw_s = 0.0
    if need == "cached":
        for ext, path in zip(("png", "pdf"), paths):
            _copy(store.file(name, rkey, ext), path)
        meta = store.meta(name, key)
        data_hash, recorded = meta["data_hash"], meta.get("seconds", 0.0)
    else:
        data = None if need == "computed" else store.load(name, key)
        if data is None:
            need = "computed"
            t = time.perf_counter()
            data = module.compute(module.config(small=small))
            compute_s = time.perf_counter() - t
            data_hash = _cache.content_hash(data)
            store.store(name, key, data, compute_s, data_hash=data_hash)
            recorded = compute_s
        else:
            meta = store.meta(name, key)
            data_hash, recorded = meta["data_hash"], meta.get("seconds", 0.0)
        t = time.perf_counter()
        figures.save(name, data, out)
        draw_s = time.perf_counter() - t
        for ext, path in zip(("png", "pdf"), paths):
            store.store_file(name, rkey, ext, path)
    result = Result(
        name, need, compute_s, draw_s, time.perf_counter() - start, key, data_hash, paths, recorded
    )
    if events is not None:
        events.put(("done", name, time.time()))
    return result


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


# --- workers ------------------------------------------------------------------------------------

_LIMITS = None
_EVENTS = None


def _init_worker(threads: int, events, memo: str) -> None:
    global _LIMITS, _EVENTS
    os.environ["TQDM_DISABLE"] = "1"  # inner bars would garble the parent's display
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    from threadpoolctl import threadpool_limits

    _LIMITS = threadpool_limits(limits=threads)
    _EVENTS = events
    _cache.load_source_memo(Path(memo))  # the parent's parse results: no re-parsing
    if "torch" in sys.modules:  # pragma: no cover - only when a figure module imports torch
        sys.modules["torch"].set_num_threads(threads)


def _work(name, out_dir, small, cache_dir, force) -> Result:
    return make_one(name, out_dir, small, cache_dir, force, events=_EVENTS)


# --- the job ------------------------------------------------------------------------------------


def build(
    names=None,
    out_dir="figures",
    *,
    small: bool = False,
    force: bool = False,
    jobs: int | None = None,
    cache_dir=None,
    stream=None,
    progress: bool = True,
) -> list[Result]:
    """Make figures ``names`` (default: all) in ``out_dir``; write the gallery and manifest.

    Returns one :class:`Result` per figure, in the order of ``names``. ``jobs``: worker
    processes (default: available CPUs; 1 runs in this process). ``cache_dir``: see
    :func:`simkit.figures.cache.default_cache_dir`. ``stream``: where progress goes
    (default stderr); ``progress=False`` prints only the per-figure lines.
    """
    from simkit.figures import registry as figures

    names = list(dict.fromkeys(names or figures.available()))
    small = small or figures.small_from_env()
    if jobs is not None and (not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    for name in names:
        figures.figure_module(name)  # KeyError listing the figures, before any work
    stream = sys.stderr if stream is None else stream
    store = _cache.FigureCache(cache_dir)
    memo = store.directory / "sources.json"
    _cache.load_source_memo(memo)
    plans = {name: plan(name, small, store, force) for name in names}
    _cache.save_source_memo(memo)
    # expected compute times: this cache's last run, else the committed manifest's record
    recorded = read_manifest(out_dir).get("figures", {})
    expected = {
        n: store.seconds(n)
        if store.seconds(n) is not None
        else recorded.get(n, {}).get("compute_s")
        for n in names
    }
    known = {n for n, s in expected.items() if s is not None}
    times = sorted(expected[n] for n in known)
    fallback = times[len(times) // 2] if times else DEFAULT_SECONDS
    expected = {n: (s if s is not None else fallback) for n, s in expected.items()}

    reporter = _Reporter(names, plans, expected, stream, progress, known)
    results: dict[str, Result] = {}
    # cache hits (file copies) first, in this process: they are instant
    for name in names:
        if plans[name][1] == "cached":
            results[name] = make_one(name, out_dir, small, store.directory, force)
            reporter.done(results[name])
    todo = sorted(
        (n for n in names if n not in results),
        key=lambda n: -(expected[n] if plans[n][1] == "computed" else 1.0),
    )
    workers = min(jobs or available_cpus(), len(todo))
    try:
        if workers <= 1:
            with reporter.ticking():  # progress while a figure computes in this process
                for name in todo:
                    reporter.started(name, time.time())
                    results[name] = make_one(name, out_dir, small, store.directory, force)
                    reporter.done(results[name])
        else:
            _run_pool(todo, workers, out_dir, small, store.directory, force, reporter, results)
    finally:
        reporter.close()
    figures.write_gallery(out_dir)
    write_manifest(out_dir, [results[n] for n in names], small=small)
    return [results[n] for n in names]


def _run_pool(todo, workers, out_dir, small, cache_dir, force, reporter, results) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    threads = max(1, available_cpus() // workers)
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(threads, events, str(Path(cache_dir) / "sources.json")),
    ) as pool:
        futures = {
            pool.submit(_work, name, str(out_dir), small, str(cache_dir), force): name
            for name in todo
        }
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            _drain(events, reporter)
            for future in finished:
                result = future.result()  # re-raises a figure's exception here
                results[result.name] = result
                reporter.done(result)
            reporter.tick()
        _drain(events, reporter)


def _drain(events, reporter) -> None:
    import queue

    while True:
        try:
            kind, name, when = events.get_nowait()
        except queue.Empty:
            return
        if kind == "start":
            reporter.started(name, when)


# --- progress -----------------------------------------------------------------------------------


class _Reporter:
    """Per-figure lines always; tqdm bars on a terminal, periodic summaries otherwise."""

    def __init__(self, names, plans, expected, stream, progress, known=None):
        self.names, self.plans, self.stream = names, plans, stream
        self.known = set(names) if known is None else set(known)  # names with a recorded time
        self.work = {n: (expected[n] if plans[n][1] == "computed" else 1.0) for n in names}
        self.expected = expected
        self.start = time.time()
        self.running: dict[str, float] = {}
        self.finished: list[str] = []
        self.interval = float(os.environ.get("SIMKIT_PROGRESS_SECONDS", "30"))
        self.last_line = self.start
        self.tty = progress and getattr(stream, "isatty", lambda: False)()
        self.periodic = progress and not self.tty
        self.bar = None
        self.figure_bars: dict[str, object] = {}
        self.lock = threading.RLock()
        if self.tty and any(plans[n][1] != "cached" for n in names):
            from tqdm import tqdm

            self._tqdm = tqdm
            self.bar = tqdm(
                total=round(sum(self.work.values()), 1),
                desc="figures",
                unit="s",
                file=stream,
                bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}] {postfix}",
                position=0,
                dynamic_ncols=True,
            )

    @contextlib.contextmanager
    def ticking(self, interval: float = 1.0):
        """Call :meth:`tick` from a background thread every ``interval`` seconds."""
        stop = threading.Event()

        def loop():
            while not stop.wait(interval):
                with self.lock:
                    self.tick()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def started(self, name: str, when: float) -> None:
        with self.lock:
            self._started(name, when)

    def _started(self, name: str, when: float) -> None:
        self.running[name] = when
        if self.bar is not None and self.plans[name][1] == "computed":
            if name in self.known:  # a bar with an ETA from the last run's time
                total = round(self.expected[name], 1)
                fmt = (
                    "{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, last run "
                    f"{_fmt(self.expected[name])}]"
                )
            else:  # never computed here: elapsed time only
                total, fmt = None, "{desc} [{elapsed}, first run: no estimate]"
            self.figure_bars[name] = self._tqdm(
                total=total,
                desc=f"  {name}",
                unit="s",
                file=self.stream,
                position=len(self.figure_bars) + 1,
                leave=False,
                bar_format=fmt,
                dynamic_ncols=True,
            )

    def done(self, result: Result) -> None:
        with self.lock:
            self._done(result)

    def _done(self, result: Result) -> None:
        self.running.pop(result.name, None)
        self.finished.append(result.name)
        bar = self.figure_bars.pop(result.name, None)
        if bar is not None:
            bar.close()
        i, total = len(self.finished), len(self.names)
        detail = {
            "computed": f"computed in {result.compute_s:.1f} s, drawn in {result.draw_s:.1f} s",
            "redrawn": f"cached data, drawn in {result.draw_s:.1f} s",
            "cached": "cached files",
        }[result.status]
        self._write(
            f"[{i}/{total}] {result.name} ... done ({detail}) -> "
            + ", ".join(str(p) for p in result.paths)
        )
        self.tick()

    def _progress_units(self, now: float) -> float:
        done = sum(self.work[n] for n in self.finished)
        running = sum(
            min(now - t0, 0.95 * self.work[n]) for n, t0 in self.running.items() if n in self.work
        )
        return done + running

    def tick(self) -> None:
        now = time.time()
        if self.bar is not None:
            self.bar.n = round(self._progress_units(now), 1)
            self.bar.set_postfix_str(
                ", ".join(f"{n} {_fmt(now - t0)}" for n, t0 in self.running.items()),
                refresh=False,
            )
            self.bar.refresh()
            for name, bar in self.figure_bars.items():
                elapsed = now - self.running[name]
                bar.n = round(elapsed if bar.total is None else min(elapsed, bar.total), 1)
                bar.refresh()
        elif self.periodic and now - self.last_line >= self.interval and self.running:
            self.last_line = now
            elapsed = now - self.start
            units, total = self._progress_units(now), sum(self.work.values())
            left = elapsed * (total - units) / units if units > 0 else float("nan")
            running = ", ".join(
                f"{n} {_fmt(now - t0)}"
                + (f" (last run {_fmt(self.expected[n])})" if n in self.known else " (first run)")
                for n, t0 in self.running.items()
            )
            print(
                f"figures: {len(self.finished)}/{len(self.names)} done, {_fmt(elapsed)} elapsed, "
                f"about {_fmt(left)} left; running: {running}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        for bar in self.figure_bars.values():
            bar.close()
        if self.bar is not None:
            self.bar.n = self.bar.total
            self.bar.close()


def _fmt(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


# --- the manifest -------------------------------------------------------------------------------


def manifest_entry(name: str, small: bool) -> dict:
    """The manifest fields that follow from the current code alone (no computation)."""
    from simkit.figures import registry as figures

    module = figures.figure_module(name)
    deps = _cache.dependencies(module.__name__)
    return {
        "small": small,
        "config": _cache.content_hash(module.config(small=small)),
        "code": _cache.code_hash(module.__name__),
        "modules": {m: _cache.source_hash(_cache.module_file(m)) for m in deps},
        "caption": caption_hash(module),
    }


def write_manifest(out_dir, results: list[Result], small: bool) -> Path:
    """Update ``<out_dir>/MANIFEST.json`` with ``results`` (entries of other figures are kept).

    Deterministic for a given cache (gallery order; ``compute_s``, the compute time in whole
    seconds recorded with the data, only changes when a figure is recomputed): committing it
    changes nothing unless a figure was recomputed. ``compute_s`` orders the first run on a
    fresh clone (longest first) and feeds its ETAs.
    """
    from simkit.figures import registry as figures

    path = Path(out_dir) / MANIFEST
    old = read_manifest(out_dir).get("figures", {})
    entries = {n: e for n, e in old.items() if n in figures.FIGURES}
    for r in results:
        entry = manifest_entry(r.name, small)
        entry.update(
            compute_s=round(r.recorded_s),
            data=r.data_hash,
            png=file_hash(r.paths[0]),
            pdf=file_hash(r.paths[1]),
        )
        entries[r.name] = entry
    manifest = {
        "format": MANIFEST_FORMAT,
        "note": "written by `simkit figures` (make figures); do not edit",
        "figures": {n: entries[n] for n in figures.FIGURES if n in entries},
    }
    text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def read_manifest(out_dir) -> dict:
    """``<out_dir>/MANIFEST.json`` as a dict ({} when absent)."""
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def stale(out_dir, names=None) -> dict[str, str]:
    """Figures in ``out_dir`` that the current code would not reproduce: name -> why.

    A figure is stale when the manifest lacks it, was made at small size, its config, caption or
    code (any module it imports) changed, or its PNG/PDF differ from the recorded SHA-256.
    """
    from simkit.figures import registry as figures

    manifest = read_manifest(out_dir).get("figures", {})
    out = Path(out_dir)
    problems: dict[str, str] = {}
    for name in names or figures.available():
        entry = manifest.get(name)
        if entry is None:
            problems[name] = "not in MANIFEST.json (never made by `simkit figures`)"
            continue
        now = manifest_entry(name, small=False)
        if entry.get("small"):
            problems[name] = "made with --small"
        elif entry.get("config") != now["config"]:
            problems[name] = "its Config changed"
        elif entry.get("caption") != now["caption"]:
            problems[name] = "its TITLE/CAPTION changed"
        elif entry.get("code") != now["code"]:
            before, after = entry.get("modules", {}), now["modules"]
            changed = sorted(m for m in set(before) | set(after) if before.get(m) != after.get(m))
            problems[name] = "code changed since it was made: " + ", ".join(changed)
        else:
            for ext in ("png", "pdf"):
                path = out / f"{name}.{ext}"
                if not path.exists() or file_hash(path) != entry.get(ext):
                    problems[name] = f"{path.name} is not the file the manifest records"
                    break
    return problems
