"""The figure-data cache: content hashes of configs, data and the code a figure imports.

A figure's computed data (``module.compute(config)``) is stored under a *key*: the SHA-256 of

- the figure's name and its config (a canonical hash of the frozen dataclass's field values),
- the code of every simkit module the figure module imports, transitively (:func:`dependencies`),
  each hashed by :func:`source_hash` — the module's syntax tree without comments, formatting
  or docstrings, so an edit that only touches those changes no key,
- the versions of Python, numpy, scipy and pandas (their results enter the data).

A figure therefore recomputes exactly when its config, a module it imports or a numeric library
changes; ``draw`` always runs (drawing is cheap and its code changes most often).

Dependencies are found statically (``ast``, no import is run): ``import simkit.a.b`` and
``from simkit.a import b`` (``b`` a submodule) depend on ``simkit.a.b``;
``from simkit.a import name`` (``name`` defined in ``simkit/a/__init__.py``) and
``from simkit import a`` depend on the package ``simkit.a`` itself, whose ``__init__`` imports
are followed in turn. Imports inside functions count; relative imports are resolved. A parent
package's ``__init__`` is *not* a dependency merely because a submodule lives in it (so the
figure registry ``simkit/figures/__init__.py`` is nobody's dependency). Not seen:
``importlib.import_module("simkit.x")`` with a computed name, and data files read at run time.

The cache lives in ``$SIMKIT_CACHE_DIR`` or else ``.simkit-cache/`` in the current directory
(git-ignored); :class:`FigureCache` keeps one entry (the newest) per figure, each a pickle
written atomically, plus the last compute time of each figure (for progress estimates).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import os
import pickle
import platform
import struct
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

#: directory of the ``simkit`` package whose sources are hashed
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "simkit"

#: default cache directory (relative to the current directory) when SIMKIT_CACHE_DIR is unset
DEFAULT_CACHE_DIR = ".simkit-cache"

#: bumped when the key or the entry format changes (invalidates every entry)
CACHE_FORMAT = 1


# --- canonical content hash --------------------------------------------------------------------


def content_hash(obj) -> str:
    """SHA-256 (hex) of a canonical encoding of ``obj``'s *content*.

    Handles None, bool, int, float (bit pattern; every NaN alike), complex, str, bytes, tuples,
    lists, dicts (in insertion order), sets (sorted), dataclasses (class name and fields),
    numpy arrays and scalars (dtype, shape, values), pandas DataFrame / Series / Index
    (columns, dtypes, values, index and ``attrs``). Equal content gives equal hashes across
    processes and runs (unlike ``hash`` or a pickle); anything else raises ``TypeError``.
    """
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _tag(h, tag: str) -> None:
    h.update(tag.encode())
    h.update(b"\0")


def _feed(h, obj) -> None:
    if obj is None:
        _tag(h, "none")
    elif isinstance(obj, bool | np.bool_):
        _tag(h, f"bool:{bool(obj)}")
    elif isinstance(obj, int | np.integer):
        _tag(h, f"int:{int(obj)}")
    elif isinstance(obj, float | np.floating):
        x = float(obj)
        _tag(h, "float:nan" if math.isnan(x) else "float")
        if not math.isnan(x):
            h.update(struct.pack("<d", x))
    elif isinstance(obj, complex | np.complexfloating):
        _tag(h, "complex")
        _feed(h, obj.real)
        _feed(h, obj.imag)
    elif isinstance(obj, str):
        _tag(h, f"str:{len(obj)}")
        h.update(obj.encode("utf-8", "surrogatepass"))
    elif isinstance(obj, bytes | bytearray):
        _tag(h, f"bytes:{len(obj)}")
        h.update(bytes(obj))
    elif isinstance(obj, tuple | list):
        _tag(h, f"{type(obj).__name__}:{len(obj)}")
        for item in obj:
            _feed(h, item)
    elif isinstance(obj, dict):
        _tag(h, f"dict:{len(obj)}")
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, set | frozenset):
        _tag(h, f"set:{len(obj)}")
        for digest in sorted(content_hash(item) for item in obj):
            h.update(digest.encode())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _tag(h, f"dataclass:{type(obj).__qualname__}")
        _feed(h, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    elif isinstance(obj, np.ndarray):
        _feed_array(h, obj)
    elif isinstance(obj, pd.DataFrame):
        _tag(h, f"frame:{obj.shape}")
        _feed(h, [str(c) for c in obj.columns])
        for column in range(obj.shape[1]):
            _feed(h, obj.iloc[:, column])
        _feed(h, obj.index)
        _feed(h, dict(obj.attrs))
    elif isinstance(obj, pd.Series):
        _tag(h, f"series:{obj.name!s}:{obj.dtype}")
        _feed_array(h, obj.to_numpy())
        _feed(h, obj.index)
        _feed(h, dict(obj.attrs))
    elif isinstance(obj, pd.Index):
        _tag(h, f"index:{type(obj).__name__}:{obj.dtype}")
        _feed_array(h, obj.to_numpy())
    elif isinstance(obj, np.generic):
        _feed_array(h, np.asarray(obj))
    elif isinstance(obj, pd.Timestamp | pd.Timedelta):
        _tag(h, f"{type(obj).__name__}:{obj.isoformat()}")
    else:
        raise TypeError(f"content_hash: cannot hash an object of type {type(obj).__name__}")


def _feed_array(h, a: np.ndarray) -> None:
    _tag(h, f"array:{a.dtype.str}:{a.shape}")
    if a.dtype.hasobject:
        for item in a.ravel().tolist():
            _feed(h, item)
    else:
        h.update(np.ascontiguousarray(a).tobytes())


# --- the code a module imports -----------------------------------------------------------------


def module_file(name: str, root: Path = PACKAGE_ROOT) -> Path | None:
    """The source file of simkit module ``name`` under ``root`` (module or package), or None."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = Path(root, *parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def direct_imports(name: str, root: Path = PACKAGE_ROOT) -> set[str]:
    """Simkit modules that module ``name``'s source imports (anywhere in the file)."""
    path = module_file(name, root)
    if path is None:
        raise KeyError(f"no simkit module {name!r} under {root}")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = _resolve(_parsed(path)[1], package, root)
    found.discard(name)
    return found


def source_imports(text: str, root: Path = PACKAGE_ROOT) -> set[str]:
    """Simkit modules that the Python source ``text`` (a script, a notebook) imports."""
    return _resolve(_parse(text, "<source>")[1], PACKAGE, root)


def _resolve(records, package: str, root: Path) -> set[str]:
    found: set[str] = set()
    for level, target, names in records:
        if level:
            base = package.split(".")
            base = base[: len(base) - (level - 1)]
            target = ".".join([*base, target] if target else base)
        if target.split(".")[0] != PACKAGE:
            continue
        if names is None:  # import simkit.a.b
            candidates = [target]
        else:  # from target import names: a submodule's code, else the module's own
            candidates = [
                f"{target}.{n}" if module_file(f"{target}.{n}", root) else target for n in names
            ]
        found.update(c for c in candidates if module_file(c, root) is not None)
    return found


def dependencies(name: str, root: Path = PACKAGE_ROOT) -> list[str]:
    """Module ``name`` and every simkit module it imports, transitively (sorted)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(direct_imports(module, root) - seen)
    return sorted(seen)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


#: raw-bytes SHA-256 -> (source hash, import records); persisted by load/save_source_memo
_SOURCE_MEMO: dict[str, tuple[str, tuple]] = {}
_USED: set[str] = set()
#: a saved memo larger than this keeps only the entries this process used
MEMO_LIMIT = 2000


def _parse(text: str, filename: str):
    tree = ast.parse(text, filename=filename)
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.extend((0, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module or "", tuple(a.name for a in node.names)))
    digest = hashlib.sha256(ast.dump(_strip_docstrings(tree)).encode()).hexdigest()
    return digest, tuple(imports)


@lru_cache(maxsize=4096)
def _parsed_at(path: str, mtime_ns: int, size: int):
    raw = Path(path).read_bytes()
    raw_hash = hashlib.sha256(raw).hexdigest()
    _USED.add(raw_hash)
    if raw_hash not in _SOURCE_MEMO:
        _SOURCE_MEMO[raw_hash] = _parse(raw.decode("utf-8"), path)
    return _SOURCE_MEMO[raw_hash]


def _parsed(path: Path):
    """(source hash, import records) of ``path``, memoised on its bytes (and mtime, size)."""
    st = Path(path).stat()
    return _parsed_at(str(path), st.st_mtime_ns, st.st_size)


def load_source_memo(path: Path) -> None:
    """Read parse results saved by :func:`save_source_memo` (skips parsing unchanged files)."""
    try:
        memo = json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return
    if memo.get("format") != CACHE_FORMAT:
        return
    for raw_hash, (digest, imports) in memo.get("sources", {}).items():
        _SOURCE_MEMO.setdefault(
            raw_hash,
            (digest, tuple((lv, mod, None if n is None else tuple(n)) for lv, mod, n in imports)),
        )


def save_source_memo(path: Path) -> None:
    """Write the parse results of this process (keyed by each file's raw-bytes hash)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sources = _SOURCE_MEMO
    if len(sources) > MEMO_LIMIT:
        sources = {h: v for h, v in sources.items() if h in _USED}
    memo = {"format": CACHE_FORMAT, "sources": sources}
    _atomic_write(Path(path), json.dumps(memo).encode())


def source_hash(path: Path) -> str:
    """SHA-256 of a module's code: its syntax tree without comments, layout and docstrings."""
    return _parsed(path)[0]


def code_hash(name: str, root: Path = PACKAGE_ROOT) -> str:
    """SHA-256 over :func:`source_hash` of module ``name`` and of all its :func:`dependencies`
    (``modules_hash(dependencies(name))``: the dependencies are already closed under import,
    so they are hashed without walking the imports of each of them again)."""
    return _closure_hash(dependencies(name, root), root)


def modules_hash(modules, root: Path = PACKAGE_ROOT) -> str:
    """SHA-256 over the :func:`source_hash` of each of ``modules`` and their dependencies."""
    return _closure_hash(sorted({d for m in modules for d in dependencies(m, root)}), root)


def _closure_hash(closure, root: Path) -> str:
    """SHA-256 over ``module:source hash`` lines of the sorted modules ``closure``."""
    h = hashlib.sha256()
    for module in closure:
        h.update(f"{module}:{source_hash(module_file(module, root))}\n".encode())
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions that enter every key: Python (major.minor), numpy, scipy, pandas."""
    import scipy

    return {
        "python": ".".join(platform.python_version_tuple()[:2]),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "pandas": pd.__version__,
    }


def figure_key(name: str, module_name: str, config, root: Path = PACKAGE_ROOT) -> str:
    """The cache key of figure ``name`` (module ``module_name``) computed with ``config``."""
    return content_hash(
        {
            "format": CACHE_FORMAT,
            "figure": name,
            "config": config,
            "code": code_hash(module_name, root),
            "libraries": library_versions(),
        }
    )


# --- the store ---------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$SIMKIT_CACHE_DIR`` if set, else ``.simkit-cache`` in the current directory."""
    return Path(os.environ.get("SIMKIT_CACHE_DIR") or DEFAULT_CACHE_DIR)


class FigureCache:
    """Computed figure data (and drawn files) on disk, under ``<dir>/figures/<name>/``.

    ``<key>.pkl`` holds the data, ``<key>.json`` its compute time and content hash, and
    ``<render key>.png|pdf`` the files drawn from it. ``store`` writes atomically (temporary
    file renamed into place) and removes the figure's older entries, so the cache holds one
    entry per figure; ``seconds(name)`` is the last compute time (kept across keys).
    """

    def __init__(self, directory=None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.root = self.directory / "figures"

    def _entry(self, name: str, key: str, ext: str) -> Path:
        return self.root / name / f"{key}.{ext}"

    def meta(self, name: str, key: str) -> dict | None:
        """The entry's metadata (``seconds``, ``data_hash``), or None when there is none."""
        path = self._entry(name, key, "json")
        if not self._entry(name, key, "pkl").is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def load(self, name: str, key: str):
        """The data stored under ``key``, or None (missing or unreadable entries)."""
        path = self._entry(name, key, "pkl")
        try:
            with path.open("rb") as fh:
                return pickle.load(fh)
        except FileNotFoundError:
            return None
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError):
            path.unlink(missing_ok=True)  # a corrupt or outdated entry: recompute
            return None

    def store(self, name: str, key: str, data, seconds: float, data_hash: str | None = None):
        """Store ``data`` under ``key`` (replacing the figure's other entries)."""
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        data_hash = data_hash or content_hash(data)
        meta = {"seconds": float(seconds), "data_hash": data_hash}
        _atomic_write(self._entry(name, key, "pkl"), pickle.dumps(data, protocol=5))
        _atomic_write(self._entry(name, key, "json"), json.dumps(meta).encode())
        _atomic_write(folder / "seconds.json", json.dumps({"seconds": float(seconds)}).encode())
        for old in folder.iterdir():
            if old.suffix in (".pkl", ".json", ".png", ".pdf") and old.stem != key:
                if old.name != "seconds.json":
                    old.unlink(missing_ok=True)

    def file(self, name: str, render_key: str, ext: str) -> Path:
        """Where the drawn ``ext`` file of render key ``render_key`` is kept."""
        return self._entry(name, render_key, ext)

    def store_file(self, name: str, render_key: str, ext: str, source: Path) -> None:
        """Keep a copy of the drawn file ``source``."""
        target = self.file(name, render_key, ext)
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(target, Path(source).read_bytes())

    def seconds(self, name: str) -> float | None:
        """The last compute time of figure ``name`` (None when never computed here)."""
        try:
            return float(json.loads((self.root / name / "seconds.json").read_text())["seconds"])
        except (FileNotFoundError, ValueError, KeyError):
            return None


def _atomic_write(path: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
