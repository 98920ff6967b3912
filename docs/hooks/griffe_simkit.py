"""Griffe extension for the simkit API pages (mkdocstrings loads it, see ``mkdocs.yml``).

Two fixes of what the static analysis alone renders badly:

- **Sphinx roles** (``:func:`x```, ``:class:`~simkit.a.B```, ``:mod:``, ``:meth:``, ``:attr:``,
  ``:data:``, ``:obj:``, ``:exc:``) become cross-references: the target is resolved in the
  docstring's own scope (imports included) to the object's canonical path and written as an
  *optional* autoref, a link when the object is documented on the site and plain code when it
  is not (a private helper), never raw role text.
- **Dataclasses declared through a base class** (the mappings are dataclasses made by
  ``ScalarMapping.__init_subclass__``, invisible to static analysis): the runtime class is
  imported and, when :func:`dataclasses.is_dataclass`, its constructor ``__init__(field=default,
  ...)`` is added (so ``merge_init_into_class`` shows the signature) and a numpy *Attributes*
  section (name, type, default) is appended to the docstring when it has no such section.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import re

import griffe

ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|attr|data|obj|exc|const):`(~?)([^`<>]+?)`")


def resolve(obj: griffe.Object, target: str, loader: griffe.GriffeLoader) -> str | None:
    """Canonical path of ``target`` as written in ``obj``'s docstring, or None."""
    target = target.strip().removesuffix("()")
    head, _, rest = target.partition(".")
    candidates = []
    if head == "simkit":
        candidates.append(target)
    else:
        scope = obj if isinstance(obj, griffe.Module | griffe.Class) else obj.parent
        while scope is not None:
            try:
                base = scope.resolve(head)
            except (griffe.NameResolutionError, Exception):  # any miss: try up
                base = None
            if base:
                candidates.append(f"{base}.{rest}" if rest else base)
                break
            scope = scope.parent
        candidates.append(target)
    for path in candidates:
        try:
            found = loader.modules_collection[path]
        except Exception:  # not in the loaded package
            continue
        try:
            return found.canonical_path if not found.is_alias else found.final_target.path
        except Exception:  # an alias to something not loaded
            return path
    return None


def rewrite_roles(text: str, obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    def replace(match: re.Match) -> str:
        _role, tilde, target = match.groups()
        shown = target.strip().split(".")[-1] if tilde else target.strip()
        code = f"<code>{html.escape(shown)}</code>"
        path = resolve(obj, target, loader)
        if path is None:
            return f"`{shown}`"
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return ROLE.sub(replace, text)


def _runtime_class(cls: griffe.Class):
    try:
        module = importlib.import_module(cls.module.path)
    except Exception:  # optional extras (torch) absent: no runtime view
        return None
    target = module
    for part in cls.path.removeprefix(cls.module.path + ".").split("."):
        target = getattr(target, part, None)
        if target is None:
            return None
    return target if isinstance(target, type) else None


def _default_text(field: dataclasses.Field) -> str | None:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return f"{getattr(field.default_factory, '__name__', 'factory')}()"
    return None


def add_dataclass_view(cls: griffe.Class) -> None:
    runtime = _runtime_class(cls)
    if runtime is None or not dataclasses.is_dataclass(runtime):
        return
    fields = [f for f in dataclasses.fields(runtime) if f.init]
    if not fields:
        return
    if "__init__" not in cls.members or cls.members["__init__"].is_alias:
        kind = griffe.ParameterKind.positional_or_keyword
        params = [griffe.Parameter("self", kind=kind)]
        for f in fields:
            annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None)
            params.append(
                griffe.Parameter(f.name, annotation=annotation, kind=kind, default=_default_text(f))
            )
        init = griffe.Function("__init__", parameters=griffe.Parameters(*params), parent=cls)
        cls.set_member("__init__", init)
    if cls.docstring is None or re.search(
        r"^\s*(Parameters|Attributes|Fields)\n\s*-{3,}", cls.docstring.value, re.M
    ):
        return
    rows = ["", "", "Attributes", "----------"]
    for f in fields:
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        default = _default_text(f)
        rows.append(f"{f.name} : {annotation}")
        rows.append(
            "    Dataclass field, a keyword of the constructor; "
            + (f"default `{default}`." if default is not None else "required.")
        )
    cls.docstring.value = cls.docstring.value.rstrip() + "\n".join(rows)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SimkitDocstrings(griffe.Extension):
    """Sphinx roles to cross-references; runtime dataclass fields and constructors."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for obj in _walk(pkg):
            if isinstance(obj, griffe.Class):
                add_dataclass_view(obj)
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite_roles(obj.docstring.value, obj, loader)
