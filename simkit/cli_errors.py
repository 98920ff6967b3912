"""The error type of the command line: a usage error that ``simkit`` reports as
``simkit: error: …`` with exit status 2.

Command modules (:mod:`simkit.cli`, :mod:`simkit.lm.cli`, :mod:`simkit.train.cli`) raise it; it
lives here, not in :mod:`simkit.cli`, so that the top-level CLI imports the command modules and
none of them imports the top-level CLI back.
"""

from __future__ import annotations

__all__ = ["CLIError"]


class CLIError(Exception):
    """A usage error reported as ``simkit: error: …`` with exit status 2."""
