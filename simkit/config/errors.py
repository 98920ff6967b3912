"""Configuration errors: :class:`ConfigError`, and pydantic's validation errors turned into one
message that names the key path as written in the TOML file, the bad value and the valid keys
or names.

A key path is written as in the file: ``estimators[2].grid``, ``behaviour.targets[0]``. The
schemas' own checks raise :class:`KeyPathError` (a ``ValueError``) with the part of the path
below the model that raised it (``".group_size"``, ``".grid (eps_high=-1.0)"``, ``" (T = 2)"``),
so that every message starts with the full path.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence

import pydantic

__all__ = ["ConfigError", "KeyPathError", "config_error", "key_path"]


class ConfigError(ValueError):
    """An invalid sweep configuration; the message starts with the offending key path."""


class KeyPathError(ValueError):
    """A check of a schema that failed at ``where`` (a key path relative to the model that
    raised it, with its leading ``.``, ``[`` or space; empty: the model itself)."""

    def __init__(self, where: str, message: str):
        super().__init__(message)
        self.where = where
        self.message = message


#: pydantic error types reworded (the key path and the value are added to every message)
_MESSAGES = {
    "missing": "missing required key",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "too_short": "expected a non-empty list",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "bool_type": "expected a boolean",
    "finite_number": "must be finite",
    "model_type": "expected a table (dict)",
    "dict_type": "expected a table (dict)",
    "model_attributes_type": "expected a table (dict)",
    "dataclass_type": "expected a table (dict)",
    "dataclass_args_type": "expected a table (dict)",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
    "scalar_type": "expected a number, string or boolean",
}
#: what the value of a key with fixed choices is, in "unknown <noun> 'x'; valid: …"
_NOUNS = {
    "kind": "kind",
    "constructor": "TokenMDP constructor",
    "reward": "reward kind",
    "divergence": "divergence",
    "level": "level",
    "aggregate": "aggregate",
    "grid_mode": "grid mode",
    "aggregations": "aggregation",
    "advantages": "advantage",
    "optimizer": "optimizer",
    "gradient": "gradient",
    "mode": "mode",
    "denominator": "denominator",
}
#: the members of a union of scalars, as pydantic names them in an error's location
_SCALARS = ("bool", "int", "float", "str")


def key_path(loc: Sequence) -> str:
    """``("estimators", 2, "grid")`` → ``"estimators[2].grid"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _one(err: dict, model, prefix: str = "") -> str:
    raw = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    kind = err["type"]
    if raw and raw[-1] in _SCALARS and kind.endswith("_type"):  # a member of ParamValue
        raw.pop()
        value = err.get("input")
        err = {**err, "type": "scalar_type", "loc": raw}
        kind = "scalar_type"
    ctx = err.get("ctx") or {}
    loc, _ = _walk(model, raw)
    top = [prefix] if prefix else []
    loc = [*top, *loc]
    if kind == "value_error" and isinstance(ctx.get("error"), KeyPathError):
        exc = ctx["error"]
        path = key_path(loc) + exc.where
        return f"{path.lstrip('.')}: {exc.message}" if path else exc.message
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = ctx.get("discriminator", "'kind'").strip("'")
        found = ctx.get("tag")
        what = f"unknown {tag} {found!r}" if found is not None else "missing required key"
        return f"{key_path([*loc, tag])}: {what}; valid: {ctx.get('expected_tags', '')}"
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        parent, cls = _walk(model, raw[:-1])
        parent = [*top, *parent]
        valid = _keys(cls)
        where = f" in {key_path(parent)}" if parent else ""
        listed = f"; valid keys{where}: {', '.join(valid)}" if valid else ""
        return f"{key_path([*parent, raw[-1]])}: unknown key {raw[-1]!r}{listed}"
    if kind in ("value_error", "assertion_error"):
        message = str(ctx.get("error", err["msg"]))
    elif kind == "literal_error":
        name = next((p for p in reversed(raw) if isinstance(p, str)), "")
        what = _NOUNS.get(name, "value")
        # pydantic writes the choices as "'a', 'b' or 'c'" (True, False unquoted: TOML true, false)
        choices = re.findall(r"'([^']*)'|\b(True|False)\b", ctx.get("expected", ""))
        valid = ", ".join(a or b.lower() for a, b in choices)
        message = f"unknown {what} {err['input']!r}; valid: {valid}"
    else:
        template = _MESSAGES.get(kind)
        message = (
            template.format(**{k: _fmt(v) for k, v in ctx.items()}) if template else err["msg"]
        )
        if kind.startswith(("greater", "less")) and isinstance(err.get("input"), int):
            message = message.replace("must be", "must be an integer")
        if kind != "missing":
            value = err.get("input")
            message += f", got {type(value).__name__} {value!r}"
    path = key_path(loc)
    return f"{path}: {message}" if path else message


def _members(ann) -> list:
    """The pydantic models and dataclasses in an annotation (through tuples, unions, optionals)."""
    if isinstance(ann, type) and (
        issubclass(ann, pydantic.BaseModel) or dataclasses.is_dataclass(ann)
    ):
        return [ann]
    return [m for arg in typing.get_args(ann) for m in _members(arg)]


def _annotation(cls, name: str):
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        field = cls.model_fields.get(name)
        return field.annotation if field is not None else None
    if dataclasses.is_dataclass(cls):
        return typing.get_type_hints(cls).get(name)
    return None


def _walk(model, loc) -> tuple[list, type | None]:
    """The key path of ``loc`` as the user wrote it (a discriminated union's tag, which pydantic
    puts in the location, is dropped) and the class of the table it ends at."""
    shown: list = []
    cls, union = model, None
    for part in loc:
        if union is not None and part in union:
            cls, union = union[part], None
            continue
        shown.append(part)
        if isinstance(part, int) or cls is None:
            continue
        members = _members(_annotation(cls, part))
        if len(members) > 1:
            union = {getattr(m, "model_fields", {}).get("kind").default: m for m in members}
            cls = None
        else:
            cls = members[0] if members else None
    return shown, cls


def _keys(cls) -> list[str]:
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        return list(cls.model_fields)
    if cls is not None and dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return []


def config_error(exc: pydantic.ValidationError, model=None, prefix: str = "") -> ConfigError:
    """The first error of a pydantic ``ValidationError`` (the most telling one, :func:`_rank`) as a
    :class:`ConfigError` (``model``:
    the validated class, to list the valid keys of a table; ``prefix``: the key path of that
    table in the file)."""
    errors = exc.errors(include_url=False)
    return ConfigError(_one(min(errors, key=_rank), model, prefix))


def _rank(err: dict) -> int:
    """Which error to report: a wrong ``kind`` first (the table is of another kind), then an
    unknown key (a misspelt key is also a missing one, and the unknown key says why), then the
    first of the rest (pydantic's order: the order of the fields)."""
    if err["loc"][-1:] == ("kind",) or err["type"].startswith("union_tag"):
        return 0
    return 1 if err["type"] in ("extra_forbidden", "unexpected_keyword_argument") else 2
