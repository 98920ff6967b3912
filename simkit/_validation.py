"""Shared input checks. Every error names the offending argument and what was expected."""

from __future__ import annotations

import dataclasses
import numbers
import os
import tempfile
from pathlib import Path

import numpy as np

PROB_ATOL = 1e-9


def as_real(x, name: str) -> np.ndarray:
    """``x`` as a float64 array; ``TypeError`` naming ``name`` unless it holds real numbers.

    Strings, bytes, complex numbers (whose imaginary part numpy would drop with a warning) and
    objects that are not numbers are refused before any conversion, with the dtype found.
    """
    arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    kind = arr.dtype.kind
    if kind in "biuf":
        return arr.astype(np.float64, copy=False)
    if kind == "c":
        raise TypeError(
            f"{name} must hold real numbers, got a complex array (dtype {arr.dtype}); pass the "
            "real part explicitly if that is what you mean"
        )
    if kind in "USa":
        raise TypeError(f"{name} must hold real numbers, got strings (dtype {arr.dtype})")
    try:
        return np.asarray(arr, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must hold real numbers, got an array of {arr.dtype} that is not numeric"
        ) from None


def check_seed(seed, name: str = "seed"):
    """``seed`` checked before numpy sees it: a non-negative int (returned as a Python int);
    None, a ``SeedSequence`` or a ``Generator`` pass through unchanged. ``ValueError`` naming
    ``name`` otherwise (numpy's own message, "expected non-negative integer", names nothing)."""
    if seed is None or isinstance(seed, np.random.SeedSequence | np.random.Generator):
        return seed
    return nonnegative_int(seed, name)


def int_at_least(value, name: str, low: int, what: str | None = None) -> int:
    """``value`` as an int >= ``low`` (bools refused); ``ValueError`` "``name`` must be
    ``what`` (default: an integer >= ``low``), got …"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be {what or f'an integer >= {low}'}, got {value!r}")
    return int(value)


def positive_int(value, name: str) -> int:
    """``value`` as an int >= 1: "``name`` must be a positive integer"."""
    return int_at_least(value, name, 1, "a positive integer")


def nonnegative_int(value, name: str) -> int:
    """``value`` as an int >= 0: "``name`` must be a non-negative integer"."""
    return int_at_least(value, name, 0, "a non-negative integer")


def check_hyperparameters(cls, hyperparams, what: str) -> None:
    """``TypeError`` if a key of ``hyperparams`` is not a field of the dataclass ``cls``, naming
    ``what`` (``"mapping 'ppo_clip'"``…), the unknown keys and the valid ones."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(hyperparams) - fields
    if unknown:
        raise TypeError(
            f"{what} has no hyperparameter {sorted(unknown)}; "
            f"its hyperparameters are {sorted(fields) or 'none'}"
        )


def _first_bad(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def check_output_dir(path, name: str = "--out") -> Path:
    """Check, before any work, that ``path`` is (or can be created as) a writable directory.

    Nothing is created: the nearest existing ancestor must be a directory in which a
    temporary file can really be created (so a read-only mount or a directory without write
    permission is detected even for root, for whom ``os.access`` says yes). ``ValueError``
    naming ``name`` and the path otherwise: an existing file, a path under a file, an
    unwritable directory.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} {path} is an existing file, not a directory")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ValueError(f"{name} {path}: {probe} is a file, so the directory cannot be created")
    _try_write(probe, path, name)
    return path


def check_output_file(path, name: str = "--out") -> Path:
    """Check, before any work, that the file ``path`` can be written (its directory exists and
    is writable, ``path`` is not a directory); ``ValueError`` naming ``name`` otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name} {path} is a directory, expected a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        above = parent
        while not above.exists() and above.parent != above:
            above = above.parent
        if above.exists() and not above.is_dir():
            raise ValueError(f"{name} {path}: {above} is a file, not a directory")
        raise ValueError(f"{name} {path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise ValueError(f"{name} {path}: {parent} is not a directory")
    _try_write(parent, path, name)
    return path


def _try_write(directory: Path, path: Path, name: str) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=".simkit-write-test-", dir=directory)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"{name} {path}: cannot write in {directory} ({reason})") from None
    os.close(fd)
    os.unlink(tmp)


def as_prob(p, name: str) -> np.ndarray:
    """Return ``p`` as a float64 array of probabilities over the last axis.

    Raises ``ValueError`` if it has no last axis, contains negative / non-finite entries, or
    does not sum to one (within ``PROB_ATOL``) along the last axis.
    """
    arr = as_real(p, name)
    if arr.ndim == 0:
        raise ValueError(
            f"{name} must have a last axis of categories (shape (..., V)), got a scalar"
        )
    if arr.shape[-1] == 0:
        raise ValueError(f"{name} has an empty last axis (V = 0)")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite entries")
    if np.any(arr < 0):
        raise ValueError(f"{name} contains negative probabilities (min {arr.min():.3g})")
    sums = arr.sum(axis=-1)
    bad = np.abs(sums - 1.0) > PROB_ATOL * max(1, arr.shape[-1])
    if np.any(bad):
        worst = sums.flat[int(np.argmax(np.abs(sums - 1.0)))]
        raise ValueError(
            f"{name} is not normalised over its last axis: a row sums to {worst:.12g}, expected 1"
        )
    return arr


def like_log_ratio(x, log_ratio: np.ndarray, name: str) -> np.ndarray:
    """``x`` as a float64 array of the shape of ``log_ratio`` (a per-token companion of the
    log-ratio: ``log_prob``, ``old_log_ratio``, ``ref_log_ratio``); a clear error naming
    ``name`` otherwise."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.shape != log_ratio.shape:
        raise ValueError(
            f"{name} must have the shape of log_ratio {log_ratio.shape}, got {arr.shape}"
        )
    return arr


def same_shape(a: np.ndarray, b: np.ndarray, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {name_a} has shape {a.shape}, {name_b} has {b.shape}")


def check_batch(log_ratio, mask, advantages):
    """Validate the (N, T) / (N, T) / (N,) triple that every mapping receives.

    Returns ``(log_ratio float64 (N,T), mask bool (N,T), advantages float64 (N,))``.
    ``log_ratio`` must be finite on valid tokens and ``advantages`` finite on rows with a
    valid token (``ValueError`` naming the argument and the first bad position); padded
    positions (and the advantages of rows without a valid token) may hold anything (±inf, NaN)
    and are replaced by 0 in the returned arrays.
    """
    lr = as_real(log_ratio, "log_ratio")
    if lr.ndim != 2:
        raise ValueError(f"log_ratio must have shape (N, T), got shape {lr.shape}")
    m = np.asarray(mask)
    if m.shape != lr.shape:
        raise ValueError(f"shape mismatch: log_ratio has shape {lr.shape}, mask has {m.shape}")
    m = m.astype(bool, copy=False)
    adv = as_real(advantages, "advantages")
    if adv.shape != (lr.shape[0],):
        raise ValueError(
            f"advantages must have shape (N,) = ({lr.shape[0]},), got shape {adv.shape}"
        )
    # fast path: a finite sum means every entry is finite (NaN and ±inf propagate)
    with np.errstate(invalid="ignore", over="ignore"):
        lr_sum, adv_sum = np.sum(lr), np.sum(adv)
    if not np.isfinite(lr_sum):
        bad = m & ~np.isfinite(lr)
        if bad.any():
            i, t = _first_bad(bad)
            raise ValueError(
                f"log_ratio is {lr[i, t]} at valid position [{i}, {t}] (mask is True there); "
                "log-ratios of valid tokens must be finite (padding may hold anything)"
            )
        lr = np.where(m, lr, 0.0)
    if not np.isfinite(adv_sum):
        bad = ~np.isfinite(adv) & m.any(axis=1)
        if bad.any():
            (i,) = _first_bad(bad)
            raise ValueError(
                f"advantages is {adv[i]} at row {i}, which has valid tokens; advantages must "
                "be finite (a NaN would silently count as negative)"
            )
        adv = np.where(np.isfinite(adv), adv, 0.0)  # rows without a valid token: padding
    return lr, m, adv
