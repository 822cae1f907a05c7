"""Reading YAML configs at the edge: one way to say what is wrong with a file or a key.

The whole `ConfigError` hierarchy lives here: one subclass per config family, so a CLI catches exactly
its own; each command's config module keeps only its pydantic models. File reading and error wording
live here too, and so does what every config file gets alike: strict UTF-8 decoding, `${VAR}`
expansion in its string values, and upper bounds on sizes whose errors say why the bound exists.
No error shows a value that came from the environment or sits in a `SECRET` field: the key, the reason
and the variable's name are enough to fix it, and an error ends up in terminals, CI logs and tickets.
"""

from __future__ import annotations

import difflib
import os
import re
import types
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Mapping, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

Model = TypeVar("Model", bound=BaseModel)

MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""A config is written by hand; a larger file is a data file (or /dev/zero) passed by mistake."""

MAX_EXPANDED_BYTES = 4 * MAX_CONFIG_BYTES
"""A config with its YAML aliases and `${VAR}`s written out: sharing a few sections stays far below, while an
alias bomb (one 1.5 MB anchored string referenced 500,000 times in a 3.5 MB file) is 750 GB, which the phase
keys' JSON and every copy of the config would materialise."""

SECRET = object()
"""Marks a field whose value no error shows, even when written literally: `Annotated[str, configs.SECRET]`."""
SECRET_SHOWN = "a secret, not shown"

_REPR_CHARS = 100
"""How much of a bad value an error line shows: a 1 MB string stays one readable line."""


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file or each bad key, and why."""


class StrictModel(BaseModel):
    """The base of every config section: unknown keys are errors (a typo never passes silently), values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class APIKeySource(StrictModel):
    """Where an HTTP client's API key comes from: a file or an environment variable, never the config itself (a key
    there would sit in a file and in every error that quotes it). Read once, by `read_api_key`, into the client."""

    api_key_file: Path | None = Field(None, description="a file holding the API key (mode 0600)")
    api_key_env: Annotated[str | None, SECRET] = Field(  # SECRET: where a pasted key would land
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="name of an environment variable holding the API key"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_literal_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError("api_key cannot be given in a config (it would sit in a file and in errors): use api_key_file or api_key_env")
        return data

    @model_validator(mode="after")
    def _at_most_one_key_source(self) -> "APIKeySource":
        if self.api_key_file is not None and self.api_key_env is not None:
            raise ValueError("give exactly one key source, not both: api_key_file or api_key_env")
        return self

    def read_api_key(self, error: type[Exception]) -> str | None:
        """The key, None when no source is given; an unreadable file or an unset variable is `error`, naming the
        source and never the key."""
        if self.api_key_file is not None:
            try:
                key = self.api_key_file.read_text().strip()
            except OSError as exc:
                raise error(f"api_key_file {self.api_key_file}: cannot read it: {exc.strerror}") from None
            source = f"api_key_file {self.api_key_file}"
        elif self.api_key_env is not None:
            key = os.environ.get(self.api_key_env, "").strip()
            source = f"the environment variable {self.api_key_env} (api_key_env)"
        else:
            return None
        if not key:
            raise error(f"{source} is unset or empty")
        return key


class CorpusConfigError(ConfigError):
    """An `ember corpus build` config (sources, filters, dedup, output) that cannot be used."""


class TokenizeConfigError(ConfigError):
    """A tokenize + pack config (tokenizer, packing, shard sources) that cannot be used."""


class MidtrainConfigError(ConfigError):
    """A `midtrain train | launch | rl` config that cannot be used."""


class EtlConfigError(ConfigError):
    """A rollout ETL config that cannot be used."""


class GraderConfigError(ConfigError):
    """An `ember rollouts grade` config (task set, tokenizer, graders, Kafka) that cannot be used."""


def unique_names(items: list, what: str = "source names") -> list:
    """`items` unchanged when their `.name`s are unique; else a ValueError naming the repeats."""
    names = [item.name for item in items]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{what} must be unique; repeated: {repeated}")
    return items


def at_most(limit: int | float, why: str) -> AfterValidator:
    """An upper bound for a size field whose error says the bound and why it exists (`None` passes: it means off).

    Used as `Annotated[int, at_most(4096, "...")]`, so the bound sits next to the field it documents.
    """

    def check(value: Any) -> Any:
        if value is not None and value > limit:
            raise ValueError(f"at most {limit:,}: {why}")
        return value

    return AfterValidator(check)


def gib(n_bytes: float) -> str:
    """A byte count as GiB for memory estimates in error messages."""
    return f"{n_bytes / 2**30:,.1f} GiB"


class Problems(ValueError):
    """Every independent problem one validator found, so a load lists them all, one line each, instead of
    stopping at the first. Each is `(key, message)` with the key relative to the validated model, or a bare
    message about the model as a whole."""

    def __init__(self, problems: list[str | tuple[str, str]]):
        self.problems = [("", p) if isinstance(p, str) else p for p in problems]
        super().__init__("; ".join(f"{key}: {message}" if key else message for key, message in self.problems))


def check(problems: list[str | tuple[str, str]]) -> None:
    """Raise `Problems` when a validator found any (a model validator ends with `configs.check(problems)`)."""
    if problems:
        raise Problems(problems)


def _unwrap(annotation: Any) -> list[Any]:
    """The types a value of `annotation` may take: Annotated and unions (`X | None`) taken apart."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _unwrap(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [t for arg in get_args(annotation) for t in _unwrap(arg)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def models_at(model: type[BaseModel], loc: tuple) -> list[type[BaseModel]]:
    """The models that validate the value at `loc` (a pydantic error location) inside `model`."""
    candidates: list[Any] = [model]
    for part in loc:
        found: list[Any] = []
        for annotation in (t for c in candidates for t in _unwrap(c)):
            args = get_args(annotation)
            if _is_model(annotation) and isinstance(part, str):
                field = annotation.model_fields.get(part) or next(
                    (f for f in annotation.model_fields.values() if f.alias == part), None
                )
                found += [field.annotation] if field is not None else []
            elif get_origin(annotation) in (list, tuple, set, frozenset) and isinstance(part, int) and args:
                found.append(args[0])
            elif get_origin(annotation) is dict and len(args) == 2:
                found.append(args[1])
        candidates = found
    return [t for c in candidates for t in _unwrap(c) if _is_model(t)]


def close_key(model: type[BaseModel], loc: tuple) -> str | None:
    """The allowed key closest to the unknown key at `loc` (a typo's likely intent), if any is close."""
    names = {
        name
        for m in models_at(model, loc[:-1])
        for field_name, field in m.model_fields.items()
        for name in (field_name, field.alias)
        if name
    }
    return closest(str(loc[-1]), names)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice `word` most likely meant (a typo's intent), if any is close: the did-you-mean of every message."""
    found = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def error_items(exc: ValidationError, hint_unknown: str = "", model: type[BaseModel] | None = None) -> list[tuple[str, str]]:
    """`(dotted.key, what is wrong)` per problem ("" for the top level); an unknown key is matched against the
    keys `model` allows there ("did you mean"), and gets `hint_unknown` (e.g. where the example is).

    A value from `${VAR}` is shown as the variable (`got the value of ${VAR}`), a `SECRET` field's not at all;
    a message that embeds either (our validators' words) shows the text as written, `${VAR}` and all."""
    items = []
    for item in exc.errors():
        key = ".".join(str(p) for p in item["loc"])
        error = item.get("ctx", {}).get("error")
        value = item.get("input")
        scalar = "input" in item and not isinstance(value, (dict, list))
        secret = scalar and model is not None and _is_secret(model, item["loc"])
        hidden = {v: v.written for v in expansions(value)} | ({str(value): SECRET_SHOWN} if secret else {})
        if isinstance(error, Problems):
            items += [(".".join(k for k in (key, sub) if k), conceal(message, hidden)) for sub, message in error.problems]
        elif item["type"] == "extra_forbidden":  # never echo the value: a misplaced key may hold a secret
            closest = close_key(model, item["loc"]) if model is not None else None
            message = "unknown key" + (f"; did you mean {closest}?" if closest else "")
            items.append((key, f"{message} ({hint_unknown})" if hint_unknown else message))
        else:  # our own validators' words without pydantic's "Value error, " prefix; scalars are shown
            message = conceal(str(error) if item["type"] == "value_error" else item["msg"], hidden)
            if scalar:
                shown = value.shown() if isinstance(value, Expanded) else SECRET_SHOWN if secret else _short_repr(value)
                message += f" (got {shown})"
            items.append((key, message))
    return items


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_CHARS else f"{text[:_REPR_CHARS]}... ({len(text):,} characters)"


def _is_secret(model: type[BaseModel], loc: tuple) -> bool:
    """Whether `loc` is at or inside a field marked `SECRET`."""
    for i, part in enumerate(loc):
        for m in models_at(model, loc[:i]) if isinstance(part, str) else ():
            field = m.model_fields.get(part) or next((f for f in m.model_fields.values() if f.alias == part), None)
            if field is not None and any(meta is SECRET for meta in field.metadata):
                return True
    return False


class Expanded(str):
    """A string value with text from the environment; `written` is how the config spelled it, which an error
    shows instead of the value (`shown`)."""

    written: str

    def __new__(cls, value: str, written: str) -> "Expanded":
        self = super().__new__(cls, value)
        self.written = written
        return self

    def __reduce__(self):  # pickled with `written` (Beam ships a few config values to workers)
        return Expanded, (str(self), self.written)

    def shown(self) -> str:
        single = _REFERENCE.fullmatch(self.written)
        if single and single.group(1):
            return f"the value of ${{{single.group(1)}}}"
        return f"the expansion of {_short_repr(self.written)}"


for _representer in (yaml.representer.SafeRepresenter, yaml.representer.Representer):  # a config read, then dumped
    _representer.add_representer(Expanded, _representer.represent_str)


def expansions(data: Any) -> list[Expanded]:
    """Every `Expanded` string in `data` (shared and cyclic containers visited once)."""
    found, seen, stack = [], set(), [data]
    while stack:
        node = stack.pop()
        if isinstance(node, Expanded):
            found.append(node)
        elif isinstance(node, (dict, list)) and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)
    return found


def conceal(text: str, hidden: Mapping[str, str]) -> str:
    """`text` with each key of `hidden` (and its repr'd form) replaced by its value, e.g. an expanded value by
    how the config wrote it. A short key is replaced only as a whole word: a variable holding `1` leaves `1,024`."""
    for value in sorted((v for v in hidden if v), key=len, reverse=True):
        for form in dict.fromkeys((str(value), repr(str(value))[1:-1])):
            pattern = re.escape(form) if len(form) >= 8 else rf"(?<!\w){re.escape(form)}(?!\w)"
            text = re.sub(pattern, lambda _, shown=hidden[value]: shown, text)
    return text


def error_lines(exc: ValidationError, hint_unknown: str = "", model: type[BaseModel] | None = None) -> list[str]:
    """`dotted.key: what is wrong` per problem (see `error_items`)."""
    return [f"{key or '(top level)'}: {message}" for key, message in error_items(exc, hint_unknown, model)]


def validate(model: type[Model], data: Any, where: str, error: type[ConfigError], hint_unknown: str = "") -> Model:
    """The validated model, or `error` listing every bad key of `data` (read from `where`)."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{where} is invalid:\n  " + "\n  ".join(error_lines(exc, hint_unknown, model))) from None


_REFERENCE = re.compile(r"\$\$\{|\$\{(?:([A-Za-z_][A-Za-z0-9_]*)(?::-([^${}]*))?\})?")


def expand_env(data: Any, where: str, error: type[ConfigError], environ: Mapping[str, str] = os.environ) -> Any:
    """`data` with `${VAR}` / `${VAR:-default}` in every string value replaced from `environ`; `$${` is a literal `${`.

    Applied to parsed YAML values, never to the raw text, so an expanded value cannot change the document's
    structure and YAML quoting stays what it was. The default applies when VAR is unset or empty, as in sh.
    Keys are never expanded. An unset variable without a default, or a `${` that starts no reference, is an
    error naming the dotted key (the value itself is never echoed: it may hold what the variable held). A
    string that took text from `environ` comes back as `Expanded`, so a later error can show the variable
    instead. The data as used, aliases and variables written out, is at most MAX_EXPANDED_BYTES, measured
    without writing it out; a recursive alias is an error.
    """
    return _Expander(where, error, environ).walk(data, "")[0]


class _Expander:
    """One walk over a parsed YAML tree; shared nodes (YAML aliases) are expanded once but counted at each use."""

    def __init__(self, where: str, error: type[ConfigError], environ: Mapping[str, str]):
        self._where, self._error, self._environ = where, error, environ
        self._done: dict[int, tuple[Any, int | None]] = {}  # id -> (expanded, size once complete)

    def walk(self, node: Any, key: str) -> tuple[Any, int]:
        """The expanded node and its size written out (about its JSON length)."""
        if isinstance(node, str):
            value = self._string(node, key)
            return value, len(value) + 2
        if not isinstance(node, (dict, list)):
            return node, len(node) if isinstance(node, bytes) else len(str(node))
        if id(node) in self._done:
            value, size = self._done[id(node)]
            if size is None:
                raise self._error(f"{self._where}: {key or '(top level)'}: a YAML alias refers to a node that contains it; "
                                  "a config cannot be recursive")
            return value, size
        out: dict | list = {} if isinstance(node, dict) else []
        self._done[id(node)] = (out, None)
        size = 2
        for k, v in node.items() if isinstance(node, dict) else enumerate(node):
            child, n = self.walk(v, f"{key}.{k}" if key else str(k))
            if isinstance(out, dict):
                out[k] = child
                n += len(str(k)) + 4
            else:
                out.append(child)
            size = self._bounded(size + n + 1, key)
        self._done[id(node)] = (out, size)
        return out, size

    def _bounded(self, size: int, key: str) -> int:
        if size > MAX_EXPANDED_BYTES:
            raise self._error(
                f"{self._where}: {key or '(top level)'}: over {MAX_EXPANDED_BYTES // 2**20} MiB with its YAML aliases and "
                "${VAR}s written out; a config is written by hand, this is an alias bomb or a data file"
            )
        return size

    def _string(self, value: str, key: str) -> str:
        if "$" not in value:
            return value
        pieces, size, last, from_env = [], len(value), 0, False
        for match in _REFERENCE.finditer(value):
            text, filled = self._replace(match, key or "(top level)")
            pieces += [value[last:match.start()], text]
            size = self._bounded(size + len(text) - len(match.group(0)), key)
            last, from_env = match.end(), from_env or filled
        out = "".join(pieces) + value[last:]
        return Expanded(out, value) if from_env else out

    def _replace(self, match: re.Match, key: str) -> tuple[str, bool]:
        """The text for one reference, and whether it came from the environment (not a default or an escape)."""
        if match.group(0) == "$${":
            return "${", False
        name, default = match.group(1), match.group(2)
        if name is None:
            raise self._error(
                f"{self._where}: {key}: '${{' starts no ${{NAME}} or ${{NAME:-default}} reference (write $${{ for a literal ${{)"
            )
        found = self._environ.get(name)
        if default is not None and not found:
            return default, False
        if found is None:
            raise self._error(
                f"{self._where}: {key}: environment variable {name} is not set "
                f"(export it, or write ${{{name}:-default}})"
            )
        return found, True


def decode_config(data: bytes, where: str, error: type[ConfigError]) -> str:
    """The text of a config file: strict UTF-8, no NUL byte (a binary file), at most MAX_CONFIG_BYTES."""
    if len(data) > MAX_CONFIG_BYTES:
        raise error(f"{where}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, not a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    nul = data.find(b"\x00")
    if nul >= 0:
        raise error(f"{where}: not a text file (byte 0x00 at offset {nul})")
    return text


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """libyaml where PyYAML was built with it: it parses a 4 MiB file in a second where pure Python takes a minute,
    and it bounds nesting depth itself. Both compose an alias as the anchored node, so aliases cost no memory here.

    Booleans are YAML 1.2's: only true / false. YAML 1.1 also read on, off, yes, no, y and n as booleans, so
    `replay: off` reached a field whose choices are "off" and "replay" as False and was refused; a boolean field
    still takes those words (pydantic reads "off" as False)."""


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_LOADER = _Loader


def parse_yaml_mapping(text: str, where: str, error: type[ConfigError], sections: str = "") -> dict:
    """The top-level mapping of a YAML document, `${VAR}`s expanded; an empty document is an empty mapping."""
    try:
        data = yaml.load(text, Loader=_LOADER)
        if data is None:
            return {}
        if not isinstance(data, dict):
            expected = f"a mapping of sections ({sections})" if sections else "a mapping at the top level"
            raise error(f"{where}: expected {expected}, got {type(data).__name__}")
        return expand_env(data, where, error)
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML: {_yaml_problem(exc)}") from None
    except ValueError as exc:  # a scalar YAML resolves but Python refuses: a 5,000-digit int, month 13
        raise error(f"{where}: not valid YAML: {exc}") from None
    except RecursionError:
        raise error(f"{where}: not valid YAML: nested too deeply") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line, without its excerpt of the file (which may hold a secret)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or not exc.problem:
        return " ".join(str(exc).split())

    def at(mark: Any) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    context = f" ({exc.context}{at(exc.context_mark)})" if exc.context else ""
    return f"{exc.problem}{at(exc.problem_mark)}{context}"


def parse_yaml_bytes(data: bytes, where: str, error: type[ConfigError], sections: str = "") -> dict:
    """`parse_yaml_mapping` of a config file's raw bytes (read from any filesystem), decoded by `decode_config`."""
    return parse_yaml_mapping(decode_config(data, where, error), where, error, sections)


def read_config_bytes(read: Callable[[int], bytes]) -> bytes:
    """Up to MAX_CONFIG_BYTES + 1 bytes from `read`, so `/dev/zero` or a huge file is refused, not read whole."""
    chunks, total = [], 0
    while total <= MAX_CONFIG_BYTES:
        chunk = read(MAX_CONFIG_BYTES + 1 - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_yaml_mapping(path: str | Path, error: type[ConfigError], sections: str = "") -> dict:
    """`parse_yaml_bytes` of a local file, with a missing or unreadable file named as such."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            data = read_config_bytes(handle.read)
    except FileNotFoundError:
        raise error(f"{path}: no such config file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the config file: {exc.strerror}") from None
    return parse_yaml_bytes(data, str(path), error, sections)
