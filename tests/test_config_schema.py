"""``simkit schema [experiment|train]``: the JSON Schema of the TOML configs (pydantic models).

Every shipped config validates against the schema of its kind (checked with the ``jsonschema``
package, an implementation independent of pydantic), and a misspelt key is rejected at the top
level and in nested tables, as :func:`simkit.config.load_config` rejects it.
"""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from simkit import config as C
from simkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def _schema(kind: str, capsys) -> dict:
    assert main(["schema", kind]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _load(path: Path) -> dict:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def _errors(schema: dict, data: dict) -> list[str]:
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_validates_against_the_schema_of_its_kind(path, capsys):
    data = _load(path)
    kind = data.get("kind", "experiment")
    assert _errors(_schema(kind, capsys), data) == []


MISSPELT = {
    "top level": lambda d: d.update(stepz=d.pop("steps")),
    "environment": lambda d: d["environment"].update(
        constructr=d["environment"].pop("constructor")
    ),
    "estimator": lambda d: d["estimators"][0].update(group_sise=8),
    "mismatch": lambda d: d.update(mismatch=[{"precison": "bf16"}]),
}


@pytest.mark.parametrize("where", list(MISSPELT), ids=list(MISSPELT))
def test_train_schema_rejects_a_misspelt_key(where, capsys):
    schema = _schema("train", capsys)
    data = copy.deepcopy(_load(ROOT / "configs" / "train_quick.toml"))
    assert _errors(schema, data) == []
    MISSPELT[where](data)
    errors = _errors(schema, data)
    assert errors, where
    with pytest.raises(C.ConfigError, match="unknown key"):  # the loader agrees
        C.config_from_dict(data)


def test_schema_lists_the_registries(capsys):
    schema = _schema("experiment", capsys)
    text = json.dumps(schema)
    for name in ("ppo_clip", "vespo", "logit_noise", "seq-mean-token-sum"):
        assert f'"{name}"' in text, name
    data = _load(ROOT / "configs" / "quick.toml")
    data["estimators"][0]["mapping"] = "ppo"
    assert _errors(schema, data)


def test_schema_command_rejects_an_unknown_kind(capsys):
    assert main(["schema", "bandit"]) == 2
    assert "invalid choice" in capsys.readouterr().err
