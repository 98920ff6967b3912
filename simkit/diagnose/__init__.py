"""``simkit diagnose ROLLOUTS``: how off-policy are a trainer's rollouts, and what does it cost?

- :mod:`simkit.diagnose.readers`: trainer dumps (SkyRL, verl, slime, NeMo-RL, prime-rl, TRL,
  parquet / JSONL) → :class:`LoadedRollouts`, with errors naming the file and the field;
- :mod:`simkit.diagnose.report`: the metrics, the twin's predictions and the report directory;
- :mod:`simkit.diagnose.cli`: the ``simkit diagnose`` subcommand.
"""

from simkit.diagnose.cli import register
from simkit.diagnose.readers import ROLES, LoadedRollouts, RolloutError, read_rollouts
from simkit.diagnose.report import CAVEATS, diagnose, metrics, twin_predictions

__all__ = [
    "CAVEATS",
    "ROLES",
    "LoadedRollouts",
    "RolloutError",
    "diagnose",
    "metrics",
    "read_rollouts",
    "register",
    "twin_predictions",
]
