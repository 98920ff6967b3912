"""The preset-source table (docs catalogue) matches the mapping registry exactly."""

import ast
from pathlib import Path

import simkit
from simkit import mappings
from simkit.mappings.preset_sources import PRESET_SOURCES


def _registry() -> dict[str, set[str]]:
    return {
        name: set(mappings.mapping_class(name).presets)
        for name in mappings.available()
        if mappings.mapping_class(name).presets
    }


def test_every_registered_preset_has_a_source():
    missing = [
        (name, preset)
        for name, presets in _registry().items()
        for preset in sorted(presets)
        if not PRESET_SOURCES.get(name, {}).get(preset, "").strip()
    ]
    assert not missing, f"presets without a PRESET_SOURCES entry: {missing}"


def test_no_source_for_an_unknown_mapping_or_preset():
    registry = _registry()
    extra = [
        (name, preset)
        for name, sources in PRESET_SOURCES.items()
        for preset in sources
        if preset not in registry.get(name, set())
    ]
    assert not extra, f"PRESET_SOURCES entries with no registered preset: {extra}"


def test_library_presets_name_a_commit_or_say_unconfirmed():
    for name, sources in PRESET_SOURCES.items():
        for preset, where in sources.items():
            if not where.startswith("paper:"):
                assert " @ " in where or "not confirmed" in where, (name, preset, where)


def test_nothing_in_simkit_imports_the_table():
    """Importing it from simkit would put it in the mappings code hash of every figure."""
    root = Path(simkit.__file__).parent
    importers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any("preset_sources" in n for n in names):
                importers.append(str(path.relative_to(root)))
    assert not importers, importers
