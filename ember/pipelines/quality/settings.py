"""Settings of the quality stages: web filters (URL block-list, language ID, datatrove's heuristics), code
filters and redaction. They live beside the filters that read them, below the corpus config that composes them.

The datatrove web filters take exactly the keyword arguments of their datatrove constructors: their models
are generated from those signatures, so a threshold datatrove does not have is an error here.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from ember import configs
from ember.configs import StrictModel
from ember.pipelines.quality.language_id import DEFAULT_CANDIDATES, unknown_codes
from ember.pipelines.web.blocklist import normalize_domain


PERMISSIVE_LICENSES = (
    # permissive: The Stack / StarCoder keep permissively licensed code (Kocetkov et al. 2022, "The Stack:
    # 3 TB of permissively licensed source code", after the Blue Oak Council's permissive list); these are
    # its OSI-approved entries that are common on GitHub
    "mit",
    "mit-0",
    "apache-2.0",
    "bsd-2-clause",
    "bsd-3-clause",
    "bsd-3-clause-clear",
    "isc",
    "unlicense",
    "cc0-1.0",
    "0bsd",
    "zlib",
    "artistic-2.0",
    "bsl-1.0",
    "python-2.0",
    "psf-2.0",  # the CPython standard library's licence
    "upl-1.0",
    "ncsa",
    "postgresql",
    "x11",
    "afl-3.0",
    # weak, file-level copyleft: a choice, kept by default because the files stay under their own licence
    "mpl-2.0",
)
"""The default licence allow-list (SPDX ids, lower case) of `filters.code.licenses` and of
`dedup.permissive_licenses`: the OSI licences StarCoder-class code corpora keep, plus MPL-2.0.
Strong copyleft (GPL, AGPL, LGPL) and unknown licences are left out; a config narrows or widens it."""


def _datatrove_params_model(name: str, cls: type) -> type[BaseModel]:
    """A strict model of `cls.__init__`'s tunable keyword arguments (writer and language are ember's to set)."""
    fields: dict[str, Any] = {}
    for param in inspect.signature(cls.__init__).parameters.values():
        if param.name in ("self", "exclusion_writer", "language") or param.default is param.empty:
            continue
        fields[param.name] = (param.annotation if param.annotation is not param.empty else Any, param.default)
    return create_model(name, __base__=StrictModel, **fields)


@functools.cache
def web_filter_models() -> dict[str, type[BaseModel]]:
    """Built on first use: datatrove's import takes seconds, and a config that sets no filter params needs none."""
    from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter

    return {
        "gopher_repetition": _datatrove_params_model("GopherRepetitionParams", GopherRepetitionFilter),
        "gopher_quality": _datatrove_params_model("GopherQualityParams", GopherQualityFilter),
        "c4_quality": _datatrove_params_model("C4QualityParams", C4QualityFilter),
        "fineweb_quality": _datatrove_params_model("FineWebQualityParams", FineWebQualityFilter),
    }


WEB_FILTER_ORDER = ("gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality")
# FineWeb's recipe keeps lines without terminal punctuation in C4's filter; everything else is datatrove's default.
WEB_FILTER_DEFAULTS: dict[str, dict[str, Any]] = {"c4_quality": {"filter_no_terminal_punct": False}}


class DatatroveFilter(StrictModel):
    """One datatrove filter: on or off, and its constructor arguments (validated against datatrove's signature)."""

    enabled: bool = True
    params: dict[str, Any] = Field(default_factory=dict)


class LanguageId(StrictModel):
    """lingua over the first `max_chars` characters of each web document, among `candidates` (ISO 639-1)."""

    enabled: bool = True
    candidates: list[str] = Field(default_factory=lambda: list(DEFAULT_CANDIDATES), min_length=2)
    low_accuracy: bool = Field(default=False, description="lingua's low-accuracy mode: faster, weaker on short text")
    max_chars: int = Field(default=2000, ge=1)

    @field_validator("candidates")
    @classmethod
    def _lingua_knows(cls, codes: list[str]) -> list[str]:
        unknown = unknown_codes(codes)
        if unknown:
            raise ValueError(f"{unknown} are not ISO 639-1 codes of a language lingua detects")
        return list(dict.fromkeys(codes))


class UrlBlocklistSettings(StrictModel):
    """Web documents whose URL's host is (or is under) a listed domain are rejected as url_blocklist:<domain>."""

    domains: list[str] = Field(default_factory=list)
    file: str | None = Field(default=None, min_length=1, description="a file of domains, one a line (# comments)")

    @field_validator("domains")
    @classmethod
    def _domains(cls, domains: list[str]) -> list[str]:
        return [normalize_domain(d) for d in domains]


class WebFilters(StrictModel):
    """FineWeb's order: URL block-list, language ID (and the `languages` allow-list), then the heuristic
    stack run with datatrove's own filter classes in this order."""

    url_blocklist: UrlBlocklistSettings = Field(default_factory=UrlBlocklistSettings)
    language_id: LanguageId = Field(default_factory=LanguageId)
    languages: list[str] | None = Field(default=None, description="ISO 639-1 allow-list; null keeps every language")
    min_language_score: float = Field(default=0.65, ge=0, le=1, description="lingua confidence an allowed language needs")
    gopher_repetition: DatatroveFilter = Field(default_factory=DatatroveFilter)
    gopher_quality: DatatroveFilter = Field(default_factory=DatatroveFilter)
    c4_quality: DatatroveFilter = Field(default_factory=lambda: DatatroveFilter(params=WEB_FILTER_DEFAULTS["c4_quality"]))
    fineweb_quality: DatatroveFilter = Field(default_factory=DatatroveFilter)

    @model_validator(mode="after")
    def _languages_detectable(self) -> "WebFilters":
        if self.languages is not None:
            if not self.language_id.enabled:
                raise ValueError("languages needs language_id.enabled: true")
            missing = [c for c in self.languages if c not in self.language_id.candidates]
            if missing:
                raise ValueError(f"languages {missing} are not among language_id.candidates, so never detected; add them there")
        return self

    @model_validator(mode="after")
    def _params_match_datatrove(self) -> "WebFilters":
        problems = []
        for name in WEB_FILTER_ORDER:
            params = getattr(self, name).params
            if params in ({}, WEB_FILTER_DEFAULTS.get(name)):  # datatrove's defaults, or ember's (checked by its tests)
                continue
            model = web_filter_models()[name]
            try:
                model.model_validate(params)
            except ValidationError as exc:
                problems += [(f"{name}.params.{key}", message) for key, message in configs.error_items(exc, model=model)]
        configs.check(problems)
        return self

    def validated_params(self, name: str) -> dict[str, Any]:
        """Constructor kwargs with datatrove's types (lists from YAML become the tuples datatrove expects)."""
        model = web_filter_models()[name].model_validate(getattr(self, name).params)
        return {k: getattr(model, k) for k in getattr(self, name).params}


class CodeFilters(StrictModel):
    """StarCoder-style code heuristics; each limit can be switched off with null."""

    min_chars: int | None = Field(default=20, ge=0)
    max_chars: int | None = Field(default=1_000_000, ge=1)
    max_line_length: int | None = Field(default=1000, ge=1)
    max_mean_line_length: float | None = Field(default=100.0, gt=0)
    min_alphanum_fraction: float | None = Field(default=0.25, ge=0, le=1)
    autogenerated_header_lines: int | None = Field(default=5, ge=1, description="lines searched for generator markers")
    max_encoded_fraction: float | None = Field(
        default=0.5, gt=0, le=1, description="share of characters inside long base64/hex/escape runs"
    )
    data_extensions: list[str] = Field(default_factory=lambda: ["json", "yaml", "yml", "csv", "tsv", "xml"])
    data_max_chars: int | None = Field(default=5000, ge=1, description="data files (data_extensions) longer than this are dropped")
    languages: list[str] | None = Field(default=None, description="allow-list of languages; null keeps every language")
    licenses: list[str] | None = Field(
        default_factory=lambda: list(PERMISSIVE_LICENSES),
        description="allow-list of SPDX ids (lower case), applied when a document has license metadata; null: off",
    )

    @model_validator(mode="after")
    def _ordered(self) -> "CodeFilters":
        if self.min_chars is not None and self.max_chars is not None and self.min_chars > self.max_chars:
            raise ValueError(f"min_chars ({self.min_chars}) is larger than max_chars ({self.max_chars})")
        return self


class QualityClassifier(StrictModel):
    """A fastText classifier from a local file scoring documents (DCLM's recipe): the probability of `label` goes to
    metadata.quality_score, and a document scoring under `threshold` is a `quality_classifier` reject."""

    model: str = Field(min_length=1, description="a local fastText .bin model; relative paths resolve against the config")
    label: str = Field(default="__label__hq", min_length=1, description="the label whose probability is the score")
    threshold: float = Field(default=0.5, ge=0, le=1, description="keep documents whose score is at least this")
    applies_to: list[Literal["code", "web"]] = Field(default_factory=lambda: ["code", "web"], min_length=1)
    max_chars: int = Field(default=100_000, ge=1, description="characters of a document scored (its head)")


class Filters(StrictModel):
    web: WebFilters = Field(default_factory=WebFilters)
    code: CodeFilters = Field(default_factory=CodeFilters)
    classifier: QualityClassifier | None = Field(default=None, description="model-based quality scoring; off when absent")


REDACTION_TYPES = (
    "email", "ip_address", "aws_access_key", "github_token", "slack_token", "api_token", "private_key", "jwt",
    "bearer_token", "url_password", "secret", "password",
)


class Redaction(StrictModel):
    """Which secret/PII detectors run; each hit becomes its typed placeholder and is counted by type."""

    enabled: bool = True
    types: list[Literal[REDACTION_TYPES]] = Field(default_factory=lambda: list(REDACTION_TYPES))  # type: ignore[valid-type]
    min_secret_entropy: float = Field(default=3.0, ge=0, description="bits/char a *_KEY/*_TOKEN/*_SECRET value needs")
    min_secret_length: int = Field(default=16, ge=1)
    min_password_length: int = Field(default=6, ge=1)
    time_limit_s: float | None = Field(
        default=10.0, gt=0, le=3600,
        description="CPU seconds one document's redaction may take; an overrun is a redaction_timeout reject (null: no limit)",
    )
