"""Reading YAML configs at the edge: one way to say what is wrong with a file or a key.

The whole `ConfigError` hierarchy lives here: one subclass per config family, so a CLI catches exactly
its own; each command's config module keeps only its pydantic models. File reading and error wording
live here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file or each bad key, and why."""


class StrictModel(BaseModel):
    """The base of every config section: unknown keys are errors (a typo never passes silently), values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CorpusConfigError(ConfigError):
    """An `ember corpus build` config (sources, filters, dedup, output) that cannot be used."""


class TokenizeConfigError(ConfigError):
    """A tokenize + pack config (tokenizer, packing, shard sources) that cannot be used."""


class MidtrainConfigError(ConfigError):
    """A `midtrain train | launch | rl` config that cannot be used."""


class EtlConfigError(ConfigError):
    """A rollout ETL config that cannot be used."""


def unique_names(items: list, what: str = "source names") -> list:
    """`items` unchanged when their `.name`s are unique; else a ValueError naming the repeats."""
    names = [item.name for item in items]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{what} must be unique; repeated: {repeated}")
    return items


def error_lines(exc: ValidationError, hint_unknown: str = "") -> list[str]:
    """`dotted.key: what is wrong` per problem; unknown keys get `hint_unknown` (e.g. where the example is)."""
    lines = []
    for item in exc.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":  # never echo the value: a misplaced key may hold a secret
            lines.append(f"{key}: unknown key ({hint_unknown})" if hint_unknown else f"{key}: unknown key")
        elif isinstance(item.get("input"), (dict, list)) or "input" not in item:
            lines.append(f"{key}: {item['msg']}")
        else:
            lines.append(f"{key}: {item['msg']} (got {item['input']!r})")
    return lines


def validate(model: type[Model], data: Any, where: str, error: type[ConfigError], hint_unknown: str = "") -> Model:
    """The validated model, or `error` listing every bad key of `data` (read from `where`)."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{where} is invalid:\n  " + "\n  ".join(error_lines(exc, hint_unknown))) from None


def parse_yaml_mapping(text: str, where: str, error: type[ConfigError], sections: str = "") -> dict:
    """The top-level mapping of a YAML document; an empty document is an empty mapping."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        expected = f"a mapping of sections ({sections})" if sections else "a mapping at the top level"
        raise error(f"{where}: expected {expected}, got {type(data).__name__}")
    return data


def read_yaml_mapping(path: str | Path, error: type[ConfigError], sections: str = "") -> dict:
    """`parse_yaml_mapping` of a local file, with a missing or unreadable file named as such."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise error(f"{path}: no such config file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the config file: {exc.strerror}") from None
    return parse_yaml_mapping(text, str(path), error, sections)
