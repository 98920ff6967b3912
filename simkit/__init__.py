"""simkit: bias and variance of importance-sampling weight mappings in LLM RL.

The numeric core (``divergence``, ``shifts``, ``envs``, ``mappings``, ``estimators``,
``experiment``, ``theory``) depends only on numpy, scipy and pandas; ``figures`` adds
matplotlib on top.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("simkit")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
