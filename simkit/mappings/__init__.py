"""The weight-mapping registry: ``get(name, **hyperparams)``, ``available()``.

One module per family of the reference sheet (sections A–C). Importing this package registers
every mapping.
"""

from simkit.mappings import classic  # noqa: F401  (registers)
from simkit.mappings.base import (
    Mapping,
    ScalarMapping,
    available,
    get,
    mapping_class,
    register,
)

__all__ = ["Mapping", "ScalarMapping", "available", "get", "mapping_class", "register"]
