"""The building blocks of the sweep schemas (:mod:`simkit.config.schema`,
:mod:`simkit.config.old`, :mod:`simkit.train.config`): the frozen base model of every table
(:class:`Frozen`, whose direct construction raises a key-path :class:`ConfigError`), the field
types (swept keys, non-negative numbers, parameter tables stored as sorted pairs) and the
validators of names from a registry."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from simkit.estimator_specs import plain

from .errors import ConfigError, KeyPathError, config_error

__all__ = [
    "Frozen",
    "Grid",
    "Kwargs",
    "NonNeg",
    "NonNegInt",
    "Number",
    "ParamValue",
    "Params",
    "PosInt",
    "one_or_more",
]


class _Tables(type(BaseModel)):
    """Direct construction (``TokenMDPConfig(V=1, ...)``) raises a :class:`ConfigError` naming
    the key path, as loading a file does (nested tables are validated by pydantic itself and
    do not pass through here)."""

    def __call__(cls, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except pydantic.ValidationError as exc:
            raise config_error(exc, cls, cls.table) from None


class Frozen(BaseModel, metaclass=_Tables):
    """Base of every configuration table: frozen, unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: key path of this table in a config file (prefixes the errors of a direct construction)
    table: ClassVar[str] = ""

    @classmethod
    def validated(cls, d: dict):
        """``cls.model_validate(d)`` (numpy scalars made plain first), a pydantic error turned
        into a :class:`~simkit.config.ConfigError` naming the key path."""
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a table (dict), got {type(d).__name__} {d!r}")
        try:
            return cls.model_validate(plain(d))
        except pydantic.ValidationError as exc:
            raise config_error(exc, cls) from None

    def _set(self, name: str, value) -> None:
        """Store a normalised value during validation (the model is frozen afterwards)."""
        object.__setattr__(self, name, value)


# --- field types --------------------------------------------------------------------------------


def _message(exc: BaseException) -> str:
    # KeyError's str() adds quotes around the message
    return exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)


def _as_list(value):
    return list(value) if isinstance(value, list | tuple) else [value]


def _distinct(values: tuple) -> tuple:
    seen = set()
    for i, v in enumerate(values):
        if v in seen:
            raise KeyPathError(f"[{i}]", f"repeated value {v!r}")
        seen.add(v)
    return values


def _scalar_or_array(schema: dict) -> None:
    """JSON Schema of a swept key: one value, or a non-empty array of them."""
    array = {k: schema.pop(k) for k in ("type", "items", "minItems") if k in schema}
    schema["anyOf"] = [array["items"], array]


def one_or_more(item, distinct: bool = True):
    """A swept key: a non-empty list of ``item`` (one value is a list of one); distinct."""
    checks = [AfterValidator(_distinct)] if distinct else []
    return Annotated[
        tuple[item, ...],
        BeforeValidator(_as_list),
        Field(min_length=1, json_schema_extra=_scalar_or_array),
        *checks,
    ]


NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosInt = Annotated[StrictInt, Field(ge=1)]
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]
NonNeg = Annotated[StrictFloat, Field(ge=0.0, allow_inf_nan=False)]
ParamValue = StrictBool | StrictInt | StrictFloat | StrictStr


def _pairs(value):
    """A table as sorted ``(name, value)`` pairs (lists frozen to tuples)."""
    return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))


def _freeze(value):
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _from_pairs(value):
    return dict(value) if isinstance(value, tuple) else value


#: a table of scalar parameters ``{name = value}``, stored as sorted pairs
Params = Annotated[dict[str, ParamValue], BeforeValidator(_from_pairs), AfterValidator(_pairs)]
#: a hyperparameter grid ``{name = [values]}``, stored as sorted (name, values) pairs
Grid = Annotated[
    dict[str, Annotated[tuple[ParamValue, ...], Field(min_length=1)]],
    BeforeValidator(_from_pairs),
    AfterValidator(_pairs),
]
#: constructor arguments ``{name = value or list}``, stored as sorted pairs
Kwargs = Annotated[dict[str, Any], BeforeValidator(_from_pairs), AfterValidator(_pairs)]


def _like_default(defaults, pairs: tuple) -> tuple:
    """Values as floats where the hyperparameter's default is a float and the value an int
    (TOML ``c = 2`` and ``c = 2.0`` are one configuration, one key, one column dtype)."""

    def cast(name, value):
        default = getattr(defaults, name, None)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value

    return tuple(
        (k, tuple(cast(k, x) for x in v) if isinstance(v, tuple) else cast(k, v)) for k, v in pairs
    )


def _omit_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _names(choices, what: str):
    """A validator of a name from a registry (``choices()`` is read when validating)."""

    def check(value: str) -> str:
        valid = tuple(choices())
        if value not in valid:
            raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(map(str, valid))}")
        return value

    return check


def _enum(choices):
    """JSON Schema ``enum`` of a registry, read when the schema is generated."""

    def extra(schema: dict) -> None:
        schema["enum"] = list(choices())

    return extra
