"""Configurations in and out of TOML, by kind: reading (:func:`load_config`,
:func:`config_from_dict`), checking before work (:func:`validate`), writing (:func:`to_toml`)
and the JSON Schema of each kind (:func:`json_schema`, ``simkit schema``).

The top-level ``kind`` key selects the schema (:data:`SCHEMAS`): ``"experiment"`` (the default,
:class:`simkit.config.SweepConfig`) or ``"train"``
(:class:`simkit.train.config.TrainSweepConfig`). The training schema lives with the trainer and
builds on this package, so it is named here by its import path, not imported.
"""

from __future__ import annotations

import importlib
import json
import math
import tomllib
from pathlib import Path

from .errors import ConfigError

__all__ = [
    "CONFIG_KINDS",
    "SCHEMAS",
    "config_from_dict",
    "json_schema",
    "load_config",
    "schema_class",
    "to_toml",
    "validate",
]

#: config kind -> "module:class" of its schema
SCHEMAS = {
    "experiment": "simkit.config.schema:SweepConfig",
    "train": "simkit.train.config:TrainSweepConfig",
}
#: values of the top-level ``kind`` key: experiment sweeps (the default) and training sweeps
CONFIG_KINDS = tuple(SCHEMAS)


def schema_class(kind: str) -> type:
    """The schema class of a config kind (:data:`SCHEMAS`)."""
    if kind not in SCHEMAS:
        raise ConfigError(f"kind: unknown config kind {kind!r}; valid: {', '.join(SCHEMAS)}")
    module, name = SCHEMAS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def config_from_dict(d: dict):
    """A sweep configuration from a plain dict: ``kind = "train"`` gives a
    :class:`~simkit.train.config.TrainSweepConfig`, ``"experiment"`` or no ``kind`` a
    :class:`~simkit.config.SweepConfig`. Raises :class:`ConfigError` naming the key path."""
    kind = d.get("kind", "experiment") if isinstance(d, dict) else "experiment"
    if not isinstance(kind, str):
        raise ConfigError(f"kind: expected a string, got {type(kind).__name__} {kind!r}")
    return schema_class(kind).validated(d)


def load_config(path, check: bool = True):
    """Read a TOML sweep configuration and :func:`validate` it (unless ``check=False``).

    The top-level ``kind`` selects the schema: ``"experiment"`` (default,
    :class:`~simkit.config.SweepConfig`) or ``"train"``
    (:class:`~simkit.train.config.TrainSweepConfig`). Raises :class:`ConfigError` naming the file
    and the offending key path.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        config = config_from_dict(data)
        if check:
            validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config


def validate(config):
    """Every check that needs the built environments, before any work starts
    (:meth:`simkit.config.SweepConfig.validate`,
    :meth:`simkit.train.config.TrainSweepConfig.validate`). Returns ``config``."""
    if not callable(getattr(config, "validate", None)) or not hasattr(config, "to_dict"):
        raise TypeError(
            f"config must be a SweepConfig or a TrainSweepConfig, got {type(config).__name__}"
        )
    return config.validate()


# --- TOML writing -------------------------------------------------------------------------------


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
        )
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _toml_key(key: str) -> str:
    bare = key and all(c.isalnum() or c in "_-" for c in key) and key.isascii()
    return key if bare else json.dumps(key)


def _assignments(d: dict) -> list[str]:
    return [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d.items()]


def to_toml(config) -> str:
    """The canonical TOML text of a configuration (``load`` of it gives ``config`` back): the
    keys of :meth:`to_dict`, then its ``[tables]`` and ``[[arrays of tables]]``
    (``config.toml_tables()``)."""
    d = config.to_dict()
    tables, arrays = config.toml_tables()
    lines = _assignments({k: v for k, v in d.items() if k not in (*tables, *arrays)})
    for table in tables:
        lines += ["", f"[{table}]", *_assignments(d[table])]
    for array in arrays:
        for entry in d[array]:
            lines += ["", f"[[{array}]]", *_assignments(entry)]
    return "\n".join(lines) + "\n"


# --- JSON Schema --------------------------------------------------------------------------------


def _closed(node) -> None:
    """``additionalProperties: false`` on every object with properties (tables forbid unknown
    keys; pydantic says so for its models, not for the dataclasses it validates)."""
    if isinstance(node, dict):
        if "properties" in node:
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _closed(value)
    elif isinstance(node, list):
        for value in node:
            _closed(value)


def json_schema(kind: str = "experiment") -> dict:
    """The JSON Schema (draft 2020-12) of a config kind's TOML file, for editors and
    validators (``simkit schema [experiment|train]``)."""
    schema = schema_class(kind).model_json_schema()
    _closed(schema)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"simkit {kind} sweep configuration"
    return schema
