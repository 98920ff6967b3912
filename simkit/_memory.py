"""Memory estimates, checked before large arrays are allocated.

A size that cannot fit (a token MDP with V = 10⁶, a bandit with 2·10⁹ arms, Monte Carlo
batches of reps × n × T tokens) is refused *before* numpy tries to allocate it, with the
estimate, the limit and the parameter to change, instead of a ``MemoryError`` traceback (or,
with overcommit, a machine that swaps to death).

The limit is :data:`DEFAULT_FRACTION` of the memory available now (``MemAvailable`` of
``/proc/meminfo``, else ``sysconf`` available pages); the environment variable
:data:`ENV_VAR` (``SIMKIT_MEMORY_LIMIT``) overrides it: a size such as ``64GiB``, ``500M`` or
a number of bytes, or ``none`` to switch the check off. Where the available memory cannot be
read (and the variable is unset) nothing is checked.

The estimates count the arrays a computation holds at once (float64 and int64: 8 bytes per
value); they are estimates of the order of magnitude, meant to catch sizes that are off by
factors, not to budget the last megabyte:

- token MDP (:func:`token_mdp_bytes`): 4 arrays of shape (T, P, V) — θ, π = softmax θ, a
  behaviour μ and the exact gradient ∇J or a DP table of the same size — plus the (S, V)
  transition table;
- bandit (:func:`bandit_bytes`): 6 arrays of shape (K,) (logits, means, π, μ, ∇J and the
  per-arm terms of the exact moments);
- Monte Carlo batches (:func:`sample_bytes`): 6 values per token of the reps × n × T batch
  (actions, automaton states, log-ratios, coefficients, token weights, the mask).
"""

from __future__ import annotations

import math
import os
import re

ENV_VAR = "SIMKIT_MEMORY_LIMIT"
#: share of the available memory one allocation may take
DEFAULT_FRACTION = 0.5
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}


class MemoryLimitError(ValueError):
    """An allocation would exceed the memory limit (the message has the estimate and limit)."""


def format_bytes(n: float) -> str:
    """``7.28 TiB``-style text of a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def parse_size(text: str) -> int | None:
    """``"64GiB"`` / ``"500M"`` / ``"123"`` → bytes; ``"none"`` → None (no limit)."""
    value = text.strip().lower()
    if value in ("none", "off", "unlimited", "inf"):
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?b)?", value)
    if not match:
        raise MemoryLimitError(
            f"{ENV_VAR}={text!r} is not a size: use e.g. 64GiB, 500M, a number of bytes, or none"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def available_bytes() -> int | None:
    """Memory available now (``MemAvailable``, else ``sysconf``), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def memory_limit() -> tuple[int | None, str]:
    """(limit in bytes or None, how it was set) — :data:`ENV_VAR`, else a share of free RAM."""
    text = os.environ.get(ENV_VAR)
    if text is not None and text.strip():
        return parse_size(text), f"{ENV_VAR}={text.strip()}"
    free = available_bytes()
    if free is None:
        return None, "available memory unknown"
    return (
        int(DEFAULT_FRACTION * free),
        f"{DEFAULT_FRACTION:.0%} of the {format_bytes(free)} available; set {ENV_VAR} to change",
    )


def check_memory(nbytes: float, what: str, parameter: str) -> None:
    """Raise :class:`MemoryLimitError` if ``nbytes`` exceeds :func:`memory_limit`.

    ``what`` says what would be allocated (``"a token MDP with V = 1000000, T = 16 (…)"``),
    ``parameter`` what to change (``"V"``, ``"reps or n"``).
    """
    limit, how = memory_limit()
    if limit is None or nbytes <= limit:
        return
    raise MemoryLimitError(
        f"{what} needs about {format_bytes(nbytes)}, over the memory limit of "
        f"{format_bytes(limit)} ({how}); reduce {parameter}"
    )


def token_mdp_bytes(T: int, P: int, V: int, S: int) -> int:
    """Estimate for a token MDP and its exact computations (module docstring)."""
    return 8 * (4 * T * P * V + S * V)


def bandit_bytes(K: int) -> int:
    """Estimate for a K-armed bandit and its exact computations (module docstring)."""
    return 8 * 6 * K


def sample_bytes(reps: int, n: int, T: int) -> int:
    """Estimate for reps Monte Carlo batches of n sequences of length T (module docstring)."""
    return 8 * 6 * reps * n * max(T, 1)


def check_token_mdp(T: int, P: int, V: int, S: int) -> None:
    """Refuse a token MDP whose arrays cannot fit (names V and T: the sizes a user sets)."""
    check_memory(
        token_mdp_bytes(T, P, V, S),
        f"a token MDP with V = {V}, T = {T} ({P} policy classes, {S} automaton states: "
        f"arrays of shape (T, P, V) = ({T}, {P}, {V}))",
        "V (or T)",
    )


def check_bandit(K: int) -> None:
    """Refuse a bandit whose (K,) arrays cannot fit."""
    check_memory(bandit_bytes(K), f"a bandit with K = {K} arms", "K")


def check_samples(reps: int, n: int, T: int) -> None:
    """Refuse Monte Carlo batches of reps × n × T tokens that cannot fit."""
    check_memory(
        sample_bytes(reps, n, T),
        f"the Monte Carlo batches (reps x n x T = {reps} x {n} x {T} = "
        f"{math.prod((reps, n, max(T, 1))):.3g} tokens)",
        "reps or n",
    )


__all__ = [
    "DEFAULT_FRACTION",
    "ENV_VAR",
    "MemoryLimitError",
    "available_bytes",
    "bandit_bytes",
    "check_bandit",
    "check_memory",
    "check_samples",
    "check_token_mdp",
    "format_bytes",
    "memory_limit",
    "parse_size",
    "sample_bytes",
    "token_mdp_bytes",
]
